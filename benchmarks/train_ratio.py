"""Full AGoQ against the bf16 policy as a user meets them: whole `agoq train` runs of the embedded
default, one with AGoQ (4-bit saved activations, 8-bit gradients) and one with
``--precision.activations=bf16 --precision.gradients=fp32``, taking turns A B A B within one
invocation. Each run is its own process with a fresh output folder, so launch, workers, pipeline
and all-reduce are what `agoq train` does; step time, memory and wire bytes are read from each
run's summary.json. The step-time ratio is the median of the rounds' ratios: the sides take turns,
so a change in the machine's load cancels within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "step time, memory and wire bytes of whole `agoq train` runs, AGoQ against the bf16 policy, alternating"

# The two sides, as `agoq train` overrides. AGoQ is the embedded default itself.
SIDES = {
    "agoq": [],
    "bf16": ["--precision.activations=bf16", "--precision.gradients=fp32"],
}

# The paths a user can pick, each given to both sides: the embedded default (on a CPU with a C++
# compiler, quantization by the reference formulas under torch.compile), the same formulas run
# eagerly, and the whole model compiled per decoder layer with fullgraph=True.
MODES = {
    "default": [],
    "eager": ["--precision.quant_backend=torch"],
    "train-compile": ["--train.compile=true"],
}

# Figures read from every run's summary.json ("run" section, or the maximum over ranks).
RUN_FIELDS = ("step_time_s", "tokens_per_s", "train_loss", "final_loss", "val_loss")
RANK_FIELDS = ("peak_saved_bytes", "peak_tensor_bytes", "peak_rss_bytes", "wire_bytes_per_step", "fp32_wire_bytes_per_step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length, rounds, extra overrides and where the runs go."""
    parser.add_argument("--steps", type=int, default=200, help="--train.steps of every run (the embedded default's own: 200)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each round runs AGoQ, then the bf16 policy")
    parser.add_argument(
        "--modes",
        default="default",
        help=f"comma-separated paths to measure, each on both sides, all taking turns within a round: {', '.join(MODES)}",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="--SECTION.KEY=VALUE",
        help="an `agoq train` override given to both sides (repeatable), e.g. --set=--train.compile=true",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="data.cache_dir shared by every run (tokenizer and token files; default: agoq's cache, $AGOQ_CACHE_DIR or ~/.cache/agoq)",
    )
    add_out_dir(parser, "the runs (default: a temporary folder, removed afterwards)")


def _train(side: str, extra: list[str], steps: int, out: Path, cache_dir: str | None) -> dict[str, Any]:
    """One `agoq train` process; its summary's figures, wall time and what it chose."""
    cmd = [sys.executable, "-m", "agoq", "train", *SIDES[side], *extra, f"--train.steps={steps}", f"--train.out_dir={out}", "--checkpoint.every=0"]
    if cache_dir:
        cmd.append(f"--data.cache_dir={cache_dir}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    precision = summary["config"]["precision"]
    row: dict[str, Any] = {
        "side": side,
        "overrides": [*SIDES[side], *extra],
        "wall_s": wall,
        # The run's `auto` choices as it decided them (the config in summary.json has them in place).
        "compute_dtype": precision["compute_dtype"],
        "quant_backend": precision["quant_backend"],
    }
    row.update({k: summary["run"].get(k) for k in RUN_FIELDS})
    for k in RANK_FIELDS:
        values = [r[k] for r in summary["ranks"] if r.get(k) is not None]
        row[k] = max(values) if values else None
    return row


def ratios(rows: list[dict[str, Any]], mode: str = "default") -> dict[str, float | None]:
    """AGoQ over the bf16 policy for each figure of one mode: the median over rounds of that round's ratio."""
    from benchmarks._common import same_round_ratio

    mine = [r for r in rows if r.get("mode", "default") == mode]
    a = [r for r in mine if r["side"] == "agoq"]
    b = [r for r in mine if r["side"] == "bf16"]
    out: dict[str, float | None] = {}
    for k in ("step_time_s", "peak_saved_bytes", "peak_tensor_bytes", "wire_bytes_per_step", "val_loss"):
        pairs = [(x[k], y[k]) for x, y in zip(a, b) if x.get(k) is not None and y.get(k)]
        out[k] = same_round_ratio([p for p, _ in pairs], [q for _, q in pairs]) if pairs else None
    return out


def run(args: argparse.Namespace) -> int:
    """Alternate the two sides for --repeats rounds and write train_ratio.json."""
    from benchmarks._common import RESULTS_DIR, result_history, write_result

    if args.steps < 3 or args.repeats < 1:
        print("python -m benchmarks.train_ratio: --steps must be >= 3 (the first step is not timed) and --repeats >= 1", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        print(f"python -m benchmarks.train_ratio: --modes={args.modes!r}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.out_dir) / "runs" if args.out_dir else Path(tmp)
        rows = []
        for round_ in range(args.repeats):
            for mode in modes:
                for side in SIDES:
                    row = _train(side, [*MODES[mode], *args.set], args.steps, runs / f"{mode}_{side}_{round_}", args.cache_dir)
                    rows.append({"round": round_, "mode": mode, **row})
                    print(f"round {round_ + 1}/{args.repeats} {mode} {side}: {row['step_time_s']:.3f} s/step, {row['wall_s']:.0f} s wall", flush=True)
    path = Path(args.out_dir or RESULTS_DIR) / "train_ratio.json"
    results = {
        "config": "embedded default (tiny LLaMA, pp=2 x dp=2, 1f1b, 4 micro-batches, 16 x 128 tokens per step)",
        "steps": args.steps,
        "repeats": args.repeats,
        "sides": SIDES,
        "rows": rows,
        "modes": {m: MODES[m] for m in modes},
        "ratios": ratios(rows, modes[0]),
        "ratios_by_mode": {m: ratios(rows, m) for m in modes},
        "history": result_history(path, lambda rows: {"ratios": ratios(rows)}),
    }
    command = f"python -m benchmarks.train_ratio --steps {args.steps} --repeats {args.repeats}"
    command += f" --modes {','.join(modes)}" if modes != ["default"] else ""
    command += "".join(f" --set={s}" for s in args.set) + (f" --cache-dir {args.cache_dir}" if args.cache_dir else "")
    command += f" --out-dir {args.out_dir}" if args.out_dir else ""
    write_result("train_ratio", results, command=command, out_dir=args.out_dir)
    print(readme_markdown(results))
    return 0


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def readme_markdown(results: dict[str, Any]) -> str:
    """Every run, in the order run, and the median ratios."""
    lines = [
        f"{results['config']}, {results['steps']} steps per run, {results['repeats']} round(s) alternating AGoQ and the bf16 policy.",
        "",
        "| round | mode | side | compute | quantization | s / step | saved activations MiB | all tensors MiB | wire MiB / step | val loss | wall s |",
        "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        val = "" if r.get("val_loss") is None else f"{r['val_loss']:.4f}"
        lines.append(
            f"| {r['round'] + 1} | {r.get('mode', 'default')} | {r['side']} | {r['compute_dtype']} | {r['quant_backend']} | {r['step_time_s']:.3f} | {_mib(r['peak_saved_bytes'])} "
            f"| {_mib(r['peak_tensor_bytes'])} | {_mib(r['wire_bytes_per_step'])} | {val} | {r['wall_s']:.0f} |"
        )
    for mode, q in results.get("ratios_by_mode", {"default": results["ratios"]}).items():
        cells = [
            f"{q[k]:.3f}x" if q.get(k) is not None else ""
            for k in ("step_time_s", "peak_saved_bytes", "peak_tensor_bytes", "wire_bytes_per_step", "val_loss")
        ]
        lines.append(f"| median | {mode} | agoq / bf16 | | | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {cells[4]} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.train_ratio``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_ratio", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
