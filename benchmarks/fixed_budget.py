"""Memory at a fixed budget: what the bf16 baseline must recompute to fit where AGoQ fits without.

The paper's 1.34x iteration-time gain comes mostly from no longer recomputing activations to fit in
memory. Here the cap is the saved-activation peak that full AGoQ reaches without recompute (largest
over ranks); the bf16 baseline is measured with 0..L recomputed layers per stage, and the fewest
that bring its peak under the cap is the configuration it would have to run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "bf16 with activation recompute vs AGoQ without, under the same saved-activation cap: peaks and step times"

BF16 = ["--precision.activations=bf16", "--precision.gradients=fp32"]
AGOQ = ["--precision.activations=agoq", "--precision.gradients=int8", "--precision.stage_bits=dbca"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Batch shape, run length, and where runs go."""
    # The defaults are the activation-heavy configuration the README's figures come from: one
    # 4096-token sequence per rank, and one rank per core (see the README for why).
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step over all dp ranks")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (the first two, setup and the memory count, are not timed)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step on each dp rank")
    add_out_dir(parser, "the runs (default: under runs/bench_fixed_budget)")
    parser.add_argument(
        "--quant-backend",
        default="compiled",
        choices=("torch", "compiled"),
        help="quantization path of every run (default compiled: what a long CPU run gets; auto would pick eager for these short runs)",
    )


def _measure(label: str, policy: list[str], recompute: int, args: argparse.Namespace) -> dict[str, Any]:
    """One short run; its max-over-ranks saved-activation peak, peak RSS and mean step time."""
    from agoq.launch.config import load_config
    from agoq.launch.run import launch

    cfg = load_config(
        None,
        [
            *policy,
            f"--precision.recompute_layers={recompute}",
            # The chunked loss for both, so the comparison is only about what the decoder layers keep.
            "--precision.fused_loss=true",
            f"--data.batch_size={args.batch_size}",
            f"--data.seq_len={args.seq_len}",
            f"--train.steps={args.steps}",
            f"--parallel.pp={args.pp}",
            f"--parallel.dp={args.dp}",
            f"--parallel.microbatches={args.microbatches}",
            f"--precision.quant_backend={args.quant_backend}",
            "--train.eval_every=0",
            "--train.baseline=false",
            "--checkpoint.every=0",
            "--checkpoint.resume=false",
            f"--train.out_dir={Path(args.out_dir or 'runs/bench_fixed_budget') / f'{label}_r{recompute}'}",
        ],
    )
    s = launch(cfg)
    return {
        "run": label,
        "recompute_layers": recompute,
        "layers_per_stage": cfg.model_config().n_layers // cfg.parallel.pp,
        "peak_saved_bytes": max(g["peak_saved_bytes"] for g in s["ranks"]),
        "peak_saved_bytes_per_rank": [g["peak_saved_bytes"] for g in s["ranks"]],
        "peak_temporary_bytes": max(g["peak_temporary_bytes"] for g in s["ranks"]),
        "peak_tensor_bytes": max(g["peak_tensor_bytes"] for g in s["ranks"]),
        "peak_rss_bytes": max(g["peak_rss_bytes"] for g in s["ranks"]),
        "step_time_s": s["run"]["step_time_s"],
        "tokens_per_s": s["run"]["tokens_per_s"],
        "final_loss": s["run"]["final_loss"],
    }


def run(args: argparse.Namespace) -> int:
    """Measure AGoQ without recompute and bf16 with every recompute depth; pick what fits the cap."""
    from benchmarks._common import write_result
    from agoq.launch.config import load_config

    layers = load_config(None, []).model_config().n_layers // args.pp
    agoq = _measure("agoq", AGOQ, 0, args)
    # All of AGoQ (8-bit AdamW too): the memory comparison the paper's -52% is about.
    agoq_all = _measure("agoq+adamw8bit", AGOQ + ["--optim.name=adamw8bit"], 0, args)
    bf16 = [_measure("bf16", BF16, n, args) for n in range(layers + 1)]
    cap = agoq["peak_saved_bytes"]
    fits = [r for r in bf16 if r["peak_saved_bytes"] <= cap]
    chosen = fits[0] if fits else None
    results = {
        "config": f"tiny LLaMA, pp={args.pp} x dp={args.dp}, {args.microbatches} micro-batches, {args.batch_size} x {args.seq_len} tokens per step, chunked loss for both, "
        f"{args.quant_backend} quantization",
        "steps": args.steps,
        "cap_bytes": cap,
        "rows": [agoq, agoq_all, *bf16],
        "all_tensors_ratio_agoq_adamw8bit_vs_bf16_plain": agoq_all["peak_tensor_bytes"] / bf16[0]["peak_tensor_bytes"],
        "all_tensors_ratio_agoq_vs_bf16_plain": agoq["peak_tensor_bytes"] / bf16[0]["peak_tensor_bytes"],
        "bf16_recompute_to_fit": None if chosen is None else chosen["recompute_layers"],
        "step_time_ratio_bf16_fit_vs_agoq": None if chosen is None else chosen["step_time_s"] / agoq["step_time_s"],
        "step_time_ratio_bf16_plain_vs_agoq": bf16[0]["step_time_s"] / agoq["step_time_s"],
    }
    write_result(
        "fixed_budget",
        results,
        out_dir=args.out_dir,
        command=(
            f"python -m benchmarks.fixed_budget --batch-size {args.batch_size} --seq-len {args.seq_len} --steps {args.steps} "
            f"--pp {args.pp} --dp {args.dp} --microbatches {args.microbatches} --quant-backend {args.quant_backend}"
            + (f" --out-dir {args.out_dir}" if args.out_dir else "")
        ),
    )
    print(readme_markdown(results))
    return 0


def readme_markdown(results: dict[str, Any]) -> str:
    """Peaks and step times against the cap, and the verdict."""
    mib = 2**20
    cap = results["cap_bytes"]
    lines = [
        f"{results['config']}; {results['steps']} steps per run, mean step time without the first two (setup, and the step whose allocations are counted). "
        f"Cap = AGoQ's saved-activation peak without recompute, {cap / mib:.2f} MiB (largest over ranks). "
        "Temporaries and all tensors (parameters, gradient buffer, optimizer state and the step's joint peak) are the largest over ranks, counted on the second step.",
        "",
        "| run | recomputed layers / stage | saved-act. peak MiB (max rank) | under cap | temporaries MiB | all tensors MiB | s / step | time vs AGoQ |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    agoq_t = results["rows"][0]["step_time_s"]
    for r in results["rows"]:
        lines.append(
            f"| {r['run']} | {r['recompute_layers']} of {r['layers_per_stage']} | {r['peak_saved_bytes'] / mib:.2f} | "
            f"{'yes' if r['peak_saved_bytes'] <= cap else 'no'} | {r['peak_temporary_bytes'] / mib:.2f} | {r['peak_tensor_bytes'] / mib:.2f} | {r['step_time_s']:.3f} | {r['step_time_s'] / agoq_t:.2f}x |"
        )
    n = results["bf16_recompute_to_fit"]
    lines.append("")
    if "all_tensors_ratio_agoq_adamw8bit_vs_bf16_plain" in results:
        lines.append(
            f"All tensors against bf16 without recompute: AGoQ {results['all_tensors_ratio_agoq_vs_bf16_plain']:.2f}x, "
            f"AGoQ with 8-bit AdamW {results['all_tensors_ratio_agoq_adamw8bit_vs_bf16_plain']:.2f}x."
        )
    if n is None:
        lines.append("bf16 does not fit under the cap even when every layer is recomputed.")
    else:
        lines.append(
            f"To fit under the cap bf16 must recompute {n} layer(s) per stage; it then takes "
            f"{results['step_time_ratio_bf16_fit_vs_agoq']:.2f}x AGoQ's step time "
            f"(bf16 without recompute, over the cap: {results['step_time_ratio_bf16_plain_vs_agoq']:.2f}x)."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.fixed_budget``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fixed_budget", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
