"""Which compute dtype trains faster on this machine: the embedded default run in bf16 vs fp32."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "step time of the default training run with bf16 vs fp32 compute, side by side"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length and where runs go."""
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (the first is not timed)")
    add_out_dir(parser, "the runs (default: under runs/bench_train_dtype)")


def run(args: argparse.Namespace) -> int:
    """Train the default configuration twice, once per compute dtype, and compare step times."""
    from benchmarks._common import write_result
    from agoq.train.config import load_config
    from agoq.train.run import launch

    rows = []
    for dtype in ("bf16", "fp32"):
        cfg = load_config(
            None,
            [
                f"--precision.compute_dtype={dtype}",
                f"--train.steps={args.steps}",
                "--train.eval_every=0",
                "--train.baseline=false",
                "--checkpoint.every=0",
                "--checkpoint.resume=false",
                f"--train.out_dir={args.out_dir or 'runs/bench_train_dtype'}/{dtype}",
            ],
        )
        summary = launch(cfg)
        run = summary["run"]
        rows.append({"compute_dtype": dtype, "step_time_s": run["step_time_s"], "tokens_per_s": run["tokens_per_s"], "final_loss": run["final_loss"]})
    base = rows[1]["step_time_s"]
    for r in rows:
        r["step_time_vs_fp32"] = r["step_time_s"] / base
    import torch

    from agoq.train.compute_dtype import cpu_bf16_flags

    results = {
        "config": "embedded default (tiny, pp=2 x dp=2, 1f1b, agoq, int8 gradients)",
        "steps": args.steps,
        "rows": rows,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_flags": list(cpu_bf16_flags()),
    }
    command = f"python -m benchmarks.train_dtype --steps {args.steps}" + (f" --out-dir {args.out_dir}" if args.out_dir else "")
    write_result("train_dtype", results, out_dir=args.out_dir, command=command)
    print(readme_markdown(results))
    return 0


def readme_markdown(results: dict[str, Any]) -> str:
    """The comparison as a markdown table."""
    flags = ", ".join(f.upper() for f in results.get("cpu_bf16_flags", [])) or "no AVX512-BF16 or AMX-BF16"
    cpu = f" CPU: {results['cpu_capability']} ({flags})." if "cpu_capability" in results else ""
    lines = [
        f"{results['config']}, {results['steps']} steps each, mean step time after the first.{cpu}",
        "",
        "| compute dtype | s / step | tokens / s | final loss | time vs fp32 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['compute_dtype']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['final_loss']:.3f} | {r['step_time_vs_fp32']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.train_dtype``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_dtype", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
