"""What a run reports: JSONL metrics per rank, the progress bar, the summary table and loss plot."""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any

from agoq.nofollow import ensure_folder, open_in_place, write_atomic


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM of /proc/self/status.

    Not getrusage's ru_maxrss: Linux keeps that across execve, so a worker the launcher spawned
    would report the launcher's own peak until it outgrew it. VmHWM belongs to the process's own
    address space. Where /proc is missing (macOS), ru_maxrss is the best there is (bytes there).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


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
    """Appends one JSON object per line to a rank's metrics file (never through a link: agoq.nofollow)."""

    def __init__(self, path: Path) -> None:
        self.path = ensure_folder(path.parent) / path.name
        self._f = self._open(os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a")

    def _open(self, flags: int, mode: str) -> IO[str]:
        return os.fdopen(open_in_place(self.path, flags), mode)

    def keep_until(self, step: int) -> None:
        """Drop the rows of steps after ``step`` (a resumed run redoes them; its rows must not appear twice)."""
        self._f.close()
        kept = []
        with self._open(os.O_RDONLY, "r") as f:
            for line in f:
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except ValueError:  # a line cut short by a crash
                    continue
        write_atomic(self.path, "".join(kept), durable=False)
        self._f = self._open(os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a")

    def write(self, record: dict[str, Any]) -> None:
        """Write one record and flush (a crash loses nothing already logged)."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


class Progress:
    """Rank 0's progress bar: step, loss, tokens/s and ETA (tqdm when available)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, every: int = 1) -> None:
        self.enabled = enabled
        self.total = total
        self.every = max(1, every)  # steps between lines when there is no bar
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
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total} loss {loss:.4f} tokens/s {tokens_per_s:,.0f}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """Print a line above the bar (rank 0 only)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()


def _headline(summary: dict[str, Any]) -> list[str]:
    """What ran, its loss and its throughput: the lines above either table."""
    run = summary["run"]
    skipped = run.get("skipped_steps", 0)
    steps = len(summary.get("records") or []) or run["steps"]
    if run["train_loss"] is None:
        loss = f"train loss: none, every one of the {steps} steps was skipped (a non-finite loss or gradient)"
    else:
        which = "steps" if not skipped else "steps that trained"
        loss = f"train loss {run['train_loss']:.4f} (mean of the last {run['train_loss_window']} {which}; last {run['final_loss']:.4f}, min {run['min_train_loss']:.4f})"
        if skipped:
            loss += f"; {skipped} of {steps} steps skipped (a non-finite loss or gradient), their losses left out"
    if run.get("val_loss") is not None:
        loss += f", validation loss {run['val_loss']:.4f}"
    return [
        f"agoq run: {summary['description']}",
        loss,
        f"throughput {run['tokens_per_s']:,.1f} tokens/s ({run['tokens_per_step']} tokens per step, {run['step_time_s']:.3f} s per step, "
        "first step and memory-probe step excluded)",
    ]


def _rank_rows(summary: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(label, one cell per rank) of every per-rank figure, in the order the tables show them."""
    base = (summary.get("baseline") or {}).get("ranks", {})
    ranks = summary["ranks"]

    def col(fn: Any) -> list[str]:
        return [fn(r, base.get(str(r["rank"]), {})) for r in ranks]

    rows = [
        ("stage(s)", col(lambda r, b: ",".join(map(str, r["stages"])))),
        ("layer bits", col(lambda r, b: str(r["layer_bits"]).replace(" ", ""))),
        ("saved activations (peak)", col(lambda r, b: fmt_bytes(r["peak_saved_bytes"]))),
        ("  bf16 baseline", col(lambda r, b: fmt_bytes(b.get("peak_saved_bytes")))),
        ("  ratio", col(lambda r, b: _ratio(r["peak_saved_bytes"], b.get("peak_saved_bytes")))),
        ("temporaries (peak)", col(lambda r, b: fmt_bytes(r.get("peak_temporary_bytes")))),
        ("gradient buffer", col(lambda r, b: fmt_bytes(r["grad_buffer_bytes"]))),
        ("optimizer state", col(lambda r, b: fmt_bytes(r["optimizer_bytes"]))),
        ("all tensors (peak)", col(lambda r, b: fmt_bytes(r.get("peak_tensor_bytes")))),
        ("peak RSS (process)", col(lambda r, b: fmt_bytes(r["peak_rss_bytes"]))),
        ("dp bytes on the wire / step", col(lambda r, b: fmt_bytes(r["wire_bytes_per_step"]))),
        ("  fp32 all-reduce", col(lambda r, b: fmt_bytes(r["fp32_wire_bytes_per_step"]))),
        ("  ratio", col(lambda r, b: _ratio(r["wire_bytes_per_step"], r["fp32_wire_bytes_per_step"]))),
    ]
    if any(r.get("link_bytes_per_step") for r in ranks):
        rows.append(("  within a node", col(lambda r, b: fmt_bytes(r.get("link_bytes_per_step", {}).get("intra_node")))))
        rows.append(("  between nodes", col(lambda r, b: fmt_bytes(r.get("link_bytes_per_step", {}).get("inter_node")))))
    if any(r.get("tp_wire_bytes_per_step") for r in ranks):
        rows.append(("tp bytes on the wire / step", col(lambda r, b: fmt_bytes(r.get("tp_wire_bytes_per_step")))))
    return rows


def _footer(summary: dict[str, Any]) -> list[str]:
    base = summary.get("baseline")
    if not base:
        return []
    max_act = max(r["peak_saved_bytes"] for r in summary["ranks"])
    max_b = max(v["peak_saved_bytes"] for v in base["ranks"].values())
    return ["", f"max saved-activation peak over ranks: {fmt_bytes(max_act)} vs {fmt_bytes(max_b)} bf16 ({_ratio(max_act, max_b)})"]


def summary_text(summary: dict[str, Any], ranks_per_block: int = 4) -> str:
    """The end-of-run summary for a terminal: one column per rank, at most ``ranks_per_block`` ranks side by side.

    The bf16 baseline's saved activations come from one forward/backward of the same run under the
    bf16 policy; the fp32 wire bytes from an fp32 ring all-reduce of the same gradients.
    """
    lines = _headline(summary)
    rows = _rank_rows(summary)
    ranks = [r["rank"] for r in summary["ranks"]]
    label_w = max(len(label) for label, _ in rows)
    for lo in range(0, len(ranks), ranks_per_block):
        cols = range(lo, min(lo + ranks_per_block, len(ranks)))
        width = [max(len(f"rank {ranks[i]}"), *(len(cells[i]) for _, cells in rows)) for i in cols]
        lines.append("")
        lines.append(" " * label_w + "".join(f"  {f'rank {ranks[i]}':>{w}}" for i, w in zip(cols, width)))
        for label, cells in rows:
            lines.append(f"{label:<{label_w}}" + "".join(f"  {cells[i]:>{w}}" for i, w in zip(cols, width)))
    return "\n".join(lines + _footer(summary))


def summary_markdown(summary: dict[str, Any]) -> str:
    """The same summary as one markdown table, one row per rank (written to summary.md)."""
    lines = _headline(summary) + [""]
    rows = _rank_rows(summary)
    labels = ["rank"] + [label.strip() if not label.startswith("  ") else f"{label.strip()} ({prev})" for label, prev in _with_parents(rows)]
    lines.append("| " + " | ".join(labels) + " |")
    lines.append("|" + "---|" * len(labels))
    for i, r in enumerate(summary["ranks"]):
        lines.append("| " + " | ".join([str(r["rank"])] + [cells[i] for _, cells in rows]) + " |")
    return "\n".join(lines + _footer(summary))


def _with_parents(rows: list[tuple[str, list[str]]]) -> list[tuple[str, str]]:
    """Each row's label with the label of the unindented row it belongs to."""
    out, parent = [], ""
    for label, _ in rows:
        if not label.startswith("  "):
            parent = label
        out.append((label, parent))
    return out


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.3f}x"


def memory_bars(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank, the run's memory by category and the bf16 baseline's where it was measured or counted.

    The baseline bar holds what is known of the bf16 configuration without running it in full: its
    saved activations (measured in this run under the bf16 policy), fp32 gradients (4 bytes per
    parameter, as the baseline keeps them) and the same parameters and optimizer state; its
    temporaries were not measured, so they are left out of both bars for a like-for-like total.
    """
    base = (summary.get("baseline") or {}).get("ranks", {})
    bars = []
    for r in summary["ranks"]:
        run = {
            "parameters": r["param_bytes"],
            "gradients": r["grad_buffer_bytes"],
            "optimizer": r["optimizer_bytes"],
            "saved activations": r["peak_saved_bytes"],
        }
        b = base.get(str(r["rank"]), {}).get("peak_saved_bytes")
        baseline = None
        if b is not None and r.get("param_count") is not None:
            baseline = dict(run, **{"gradients": 4 * r["param_count"], "saved activations": b})
        bars.append({"rank": r["rank"], "run": run, "baseline": baseline})
    return bars


def plot_run(summary: dict[str, Any], path: Path, title: str) -> Path | None:
    """PNG of the run: loss against step, and memory per rank as stacked bars beside the bf16 baseline.

    None if matplotlib cannot be imported.
    """
    try:
        # A Figure drawn by the Agg canvas, not pyplot: no global backend is chosen or changed.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    records = summary["records"]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    ax, mem = fig.subplots(1, 2)
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()

    bars = memory_bars(summary)
    categories = ("parameters", "optimizer", "gradients", "saved activations")
    colors = dict(zip(categories, ("#9e9e9e", "#7e57c2", "#26a69a", "#ef6c00")))
    mib = 2.0**20
    x, labels = 0.0, []
    ticks = []
    for bar in bars:
        for kind, values, hatch in (("agoq", bar["run"], None), ("bf16", bar["baseline"], "//")):
            if values is None:
                continue
            bottom = 0.0
            for c in categories:
                height = values[c] / mib
                mem.bar(x, height, bottom=bottom, color=colors[c], hatch=hatch, edgecolor="white", label=c if (x == 0.0) else None)
                bottom += height
            ticks.append(x)
            labels.append(f"r{bar['rank']}\n{kind}")
            x += 1.0
        x += 0.5
    mem.set_xticks(ticks, labels, fontsize=8)
    mem.set_ylabel("MiB")
    mem.set_title("memory per rank (bf16: saved activations measured, fp32 gradients counted)", fontsize=9)
    mem.legend(fontsize=8)
    mem.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    write_atomic(path, png.getvalue())
    return path
