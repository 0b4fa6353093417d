"""What a run reports: JSONL metrics per rank, the progress bar, the summary table and loss plot."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fmt_bytes(n: float | None) -> str:
    """Human-readable bytes (KiB/MiB/GiB)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


class JsonlWriter:
    """Appends one JSON object per line to a rank's metrics file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        """Write one record and flush (a crash loses nothing already logged)."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


class Progress:
    """Rank 0's progress bar: step, loss, tokens/s and ETA (tqdm when available)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total = total
        self._start = time.perf_counter()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self._bar = None

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Advance to ``step`` and show its loss and throughput."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            print(f"step {step}/{self.total} loss {loss:.4f} tokens/s {tokens_per_s:,.0f}", file=sys.stderr)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table: the run's figures against the bf16 baseline configuration."""
    lines = []
    run, base = summary["run"], summary.get("baseline")
    lines.append(f"agoq run: {summary['description']}")
    lines.append(
        f"final train loss {run['final_loss']:.4f}"
        + (f", validation loss {run['val_loss']:.4f}" if run.get("val_loss") is not None else "")
        + f", {run['tokens_per_s']:,.0f} tokens/s, {run['step_time_s']:.3f} s/step"
    )
    lines.append("")
    header = "| rank | stage(s) | layer bits | saved activations (peak) | bf16 baseline | ratio | temporaries (peak) | dp bytes on the wire / step | fp32 all-reduce | ratio | grad buffer | optimizer state | all tensors (peak) | peak RSS |"
    lines.append(header)
    lines.append("|" + "---|" * (header.count("|") - 1))
    for r in summary["ranks"]:
        b = (base or {}).get("ranks", {}).get(str(r["rank"]), {})
        act, act_b = r["peak_saved_bytes"], b.get("peak_saved_bytes")
        wire, wire_b = r["wire_bytes_per_step"], r["fp32_wire_bytes_per_step"]
        lines.append(
            f"| {r['rank']} | {','.join(map(str, r['stages']))} | {r['layer_bits']} | {fmt_bytes(act)} | {fmt_bytes(act_b)} | "
            f"{_ratio(act, act_b)} | {fmt_bytes(r.get('peak_temporary_bytes'))} | {fmt_bytes(wire)} | {fmt_bytes(wire_b)} | {_ratio(wire, wire_b)} | "
            f"{fmt_bytes(r['grad_buffer_bytes'])} | {fmt_bytes(r['optimizer_bytes'])} | {fmt_bytes(r.get('peak_tensor_bytes'))} | {fmt_bytes(r['peak_rss_bytes'])} |"
        )
    max_act = max(r["peak_saved_bytes"] for r in summary["ranks"])
    if base:
        max_b = max(v["peak_saved_bytes"] for v in base["ranks"].values())
        lines.append("")
        lines.append(f"max saved-activation peak over ranks: {fmt_bytes(max_act)} vs {fmt_bytes(max_b)} bf16 ({_ratio(max_act, max_b)})")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.3f}x"


def plot_loss(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """PNG of training (and validation) loss against step; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
