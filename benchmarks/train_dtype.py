"""Which compute dtype trains faster on this machine: the embedded default run in bf16 vs fp32,
and a sub-second probe of the same question (forward and backward of a SwiGLU MLP at the model's
width, on each worker's threads, fp32 and bf16 alternating).

agoq's ``precision.compute_dtype=auto`` does not time anything: it takes bf16 where the CPU's flags
say bf16 is native (agoq.launch.choices). This benchmark is how to check that rule on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "step time of the default training run with bf16 vs fp32 compute, side by side"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length and where runs go."""
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (the first is not timed)")
    add_out_dir(parser, "the runs (default: under runs/bench_train_dtype)")


PROBE_TOKENS = 512
# Alternating fp32/bf16 rounds of the probe, of which each dtype's median is kept: a burst of load
# from other processes then slows both dtypes alike, or only one round of one of them.
PROBE_ROUNDS = 5


def probe_seconds(dtype: Any, hidden: int, intermediate: int, threads: int, repeats: int = 3) -> float:
    """Fastest of ``repeats`` forward+backward passes of a SwiGLU MLP over PROBE_TOKENS tokens in ``dtype``."""
    import torch
    import torch.nn.functional as F

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(PROBE_TOKENS, hidden, generator=gen).to(dtype).requires_grad_()
        w_in = (torch.randn(2 * intermediate, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_()
        w_out = (torch.randn(hidden, intermediate, generator=gen) / intermediate**0.5).to(dtype).requires_grad_()
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms up allocator and kernels
            t0 = time.perf_counter()
            gate, up = F.linear(x, w_in).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, w_out).float().square().mean().backward()
            best = min(best, time.perf_counter() - t0)
            x.grad = w_in.grad = w_out.grad = None
        return best
    finally:
        torch.set_num_threads(saved)


def bf16_speedup(hidden: int, intermediate: int, threads: int, rounds: int = PROBE_ROUNDS) -> tuple[float, float, float]:
    """(fp32 seconds / bf16 seconds, fp32 seconds, bf16 seconds) of the MLP probe: the medians of
    ``rounds`` alternating rounds (fp32 first in even rounds, bf16 first in odd ones)."""
    import torch

    times: dict[Any, list[float]] = {torch.float32: [], torch.bfloat16: []}
    for i in range(rounds):
        order = (torch.float32, torch.bfloat16) if i % 2 == 0 else (torch.bfloat16, torch.float32)
        for dtype in order:
            times[dtype].append(probe_seconds(dtype, hidden, intermediate, threads, repeats=2))
    t32, t16 = statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16])
    return t32 / t16, t32, t16


def run(args: argparse.Namespace) -> int:
    """Train the default configuration twice, once per compute dtype, and compare step times."""
    from benchmarks._common import write_result
    from agoq.launch.config import load_config
    from agoq.launch.run import launch

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

    from agoq.launch.choices import choose_compute_dtype, cpu_bf16_flags, worker_threads

    mc, threads = cfg.model_config(), worker_threads(cfg.world_size)
    speedup, t32, t16 = bf16_speedup(mc.hidden, mc.intermediate, threads)
    results = {
        "config": "embedded default (tiny, pp=2 x dp=2, 1f1b, agoq, int8 gradients)",
        "steps": args.steps,
        "rows": rows,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_flags": list(cpu_bf16_flags()),
        "auto": choose_compute_dtype("auto", "cpu").name,
        "probe": {"hidden": mc.hidden, "intermediate": mc.intermediate, "threads": threads, "bf16_speedup": speedup, "fp32_s": t32, "bf16_s": t16},
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
    if "probe" in results:
        p = results["probe"]
        lines += [
            "",
            f"`auto` chose {results['auto']} by the flags. The SwiGLU MLP probe ({p['hidden']} x {p['intermediate']}, {p['threads']} "
            f"thread(s) per worker) ran bf16 at {p['bf16_speedup']:.2f}x the fp32 speed.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.train_dtype``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_dtype", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
