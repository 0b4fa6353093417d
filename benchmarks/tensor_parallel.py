"""`agoq train` at tp=2 beside tp=1, and each rank's measured bytes beside `agoq plan`'s prediction.

Three runs of the same model, seed and data on 4 local processes (gloo): tp=1 (pp=2 x dp=2),
tp=2 x pp=2 and tp=2 x dp=2, each with the bf16-policy baseline measured in the same run. Per run:
the losses, the step time, and per rank the saved-activation peak, gradient buffer and optimizer
state, measured and as the planner predicts them for the same configuration, the dp bytes on the
wire (the 8-bit gradient all-reduce) and the tp bytes (sequence all-gathers and reduce-scatters, the
4-bit norm inputs gathered in backward, the vocab-parallel loss). The tp=2 x dp=2 run's terminal
summary is kept as printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "agoq train at tp=2 (x pp=2, x dp=2) beside tp=1: loss, step time, tp and dp bytes, and each rank's bytes against agoq plan"

LAYOUTS = {
    "tp=1 (pp=2 x dp=2)": ["--parallel.tp=1", "--parallel.pp=2", "--parallel.dp=2"],
    "tp=2 x pp=2": ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=1"],
    "tp=2 x dp=2": ["--parallel.tp=2", "--parallel.pp=1", "--parallel.dp=2"],
}
SUMMARY_OF = "tp=2 x dp=2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length."""
    parser.add_argument("--steps", type=int, default=40, help="steps of each run (default 40)")
    add_out_dir(parser)  # the runs themselves go to temporary folders


def _plan(overrides: list[str], summary: dict[str, Any]) -> list[dict[str, int]]:
    """The planner's bytes per pp rank for the run's configuration, with the compute dtype it chose."""
    from agoq.plan import from_train_config, plan_memory
    from agoq.launch.config import load_config

    cfg = load_config(None, [*overrides, f"--precision.compute_dtype={summary['config']['precision']['compute_dtype']}"])
    (setup,) = plan_memory(from_train_config(cfg, summary["model"]["vocab_size"])).setups
    return [
        {"activations_peak": r.activations_peak, "gradients": r.gradients, "optimizer": r.optimizer, "parameters": r.parameters} for r in setup.ranks
    ]


def _one(label: str, overrides: list[str], steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        args = [*overrides, f"--train.steps={steps}", "--checkpoint.every=0", f"--train.out_dir={out}"]
        proc = subprocess.run([sys.executable, "-m", "agoq", "train", *args], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{label} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        planned = _plan(args, summary)
    base = summary["baseline"]["ranks"] if summary.get("baseline") else {}
    ranks = []
    for r in summary["ranks"]:
        p = planned[r["pp_rank"]]
        ranks.append(
            {
                "rank": r["rank"],
                "pp_rank": r["pp_rank"],
                "dp_rank": r["dp_rank"],
                "tp_rank": r.get("tp_rank", 0),
                "saved_peak": r["peak_saved_bytes"],
                "saved_peak_planned": p["activations_peak"],
                "saved_peak_bf16_baseline": base.get(str(r["rank"]), {}).get("peak_saved_bytes"),
                "gradient_buffer": r["grad_buffer_bytes"],
                "gradient_buffer_planned": p["gradients"],
                "optimizer": r["optimizer_bytes"],
                "optimizer_planned": p["optimizer"],
                "parameters": r["param_bytes"],
                "parameters_planned": p["parameters"],
                "dp_wire_bytes_per_step": r["wire_bytes_per_step"],
                "tp_wire_bytes_per_step": r.get("tp_wire_bytes_per_step", 0),
            }
        )
    run = summary["run"]
    return {
        "layout": label,
        "overrides": overrides,
        "compute_dtype": summary["config"]["precision"]["compute_dtype"],
        "losses": [rec["loss"] for rec in summary["records"]],
        "train_loss": run["train_loss"],
        "val_loss": run.get("val_loss"),
        "step_time_s": run["step_time_s"],
        "ranks": ranks,
        "summary_text": _terminal_summary(summary) if label == SUMMARY_OF else None,
    }


def _terminal_summary(summary: dict[str, Any]) -> str:
    from agoq.train.metrics import summary_text

    return summary_text(summary)


def run(args: argparse.Namespace) -> int:
    """Run the three layouts one after another and write tensor_parallel.json."""
    from benchmarks._common import write_result

    rows = [_one(label, overrides, args.steps) for label, overrides in LAYOUTS.items()]
    write_result("tensor_parallel", {"steps": args.steps, "rows": rows}, out_dir=args.out_dir)
    print(readme_markdown({"steps": args.steps, "rows": rows}))
    return 0


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _vs(measured: int, planned: int) -> str:
    return f"{_mib(measured)} / {_mib(planned)} ({planned / measured:.3f}x)"


def readme_markdown(results: dict[str, Any]) -> str:
    """Two tables: the runs side by side, then every rank's measured bytes against the plan."""
    rows = results["rows"]
    ref = rows[0]
    lines = [
        f"| layout ({results['steps']} steps) | compute | train loss (last 10) | vs tp=1 | val loss | step (s) | dp MiB / step / rank | tp MiB / step / rank |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        dp = max(x["dp_wire_bytes_per_step"] for x in r["ranks"])
        tp = max(x["tp_wire_bytes_per_step"] for x in r["ranks"])
        val = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        lines.append(
            f"| {r['layout']} | {r['compute_dtype']} | {r['train_loss']:.4f} | {r['train_loss'] / ref['train_loss']:.4f}x | {val} "
            f"| {r['step_time_s']:.3f} | {_mib(dp)} | {_mib(tp)} |"
        )
    lines += [
        "",
        "| layout | rank (pp, dp, tp) | saved activations: measured / planned MiB | bf16 baseline | gradient buffer | optimizer state |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        for x in r["ranks"]:
            lines.append(
                f"| {r['layout']} | {x['rank']} ({x['pp_rank']}, {x['dp_rank']}, {x['tp_rank']}) | {_vs(x['saved_peak'], x['saved_peak_planned'])} "
                f"| {_mib(x['saved_peak_bf16_baseline'])} | {_vs(x['gradient_buffer'], x['gradient_buffer_planned'])} "
                f"| {_vs(x['optimizer'], x['optimizer_planned'])} |"
            )
    text = next((r["summary_text"] for r in rows if r.get("summary_text")), None)
    if text:
        lines += ["", f"The {SUMMARY_OF} run's summary, as `agoq train` printed it:", "", "```", text, "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
