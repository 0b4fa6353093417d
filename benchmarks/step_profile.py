"""Where a training step's time goes: the bf16 policy vs AGoQ, side by side, by torch.profiler.

One process (pp = dp = 1, so no communication: this isolates the compute and quantization cost),
the same model, data, dtype and micro-batches for every configuration. Step times are the median
of interleaved rounds (configurations alternate, so machine noise hits them alike); the profile of
a few more steps groups self CPU time into categories, to show what AGoQ adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "step time and a per-category profile of the bf16 policy vs AGoQ (eager and compiled quantization)"

# (name, activations, gradients, quantization backend)
CONFIGS = (
    ("bf16 policy", "bf16", "fp32", "torch"),
    ("agoq, eager quantization", "agoq", "int8", "torch"),
    ("agoq, compiled quantization", "agoq", "int8", "compiled"),
)

# Profiler event names -> category, first match wins (self CPU time, so nothing counts twice).
CATEGORIES = (
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::addmm_", "aten::linear", "aten::matmul")),
    ("attention core", ("scaled_dot_product", "flash_attention")),
    (
        "compiled quantization kernels",
        ("CompiledFxGraph", "Torch-Compiled Region", "TorchDynamo Cache Lookup", "Pregraph bytecode", "AOTDispatcher", "inductor"),
    ),
    ("gradient hooks (fold into the buffer)", ("AccumulateGrad",)),
    # The fused ops are torch.library custom ops: the profiler names each "agoq::norm_linear" (its
    # backward op "agoq::norm_linear_backward") and its autograd node
    # "GeneratedBackwardFor_agoq_norm_linear_default..."; _RMSNorm and _Rotary are autograd Functions.
    ("fused ops' Python and autograd", ("agoq::", "GeneratedBackwardFor_agoq_", "_RMSNorm", "_Rotary")),
    ("loss (log-softmax, recompute)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("adamw", "Optimizer")),
    ("allocation", ("aten::empty", "aten::zeros", "aten::full", "aten::fill_", "aten::zero_")),
    (
        "quantize/dequantize, pack/unpack (eager ops)",
        (
            "aten::amax",
            "aten::amin",
            "aten::round",
            "aten::bitwise",
            "aten::index_select",
            "aten::nextafter",
            "aten::__rshift__",
            "aten::__lshift__",
            "aten::isnan",
            "aten::isfinite",
            "aten::masked_fill",
            "aten::div_",
        ),
    ),
    ("copies and casts", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::cat", "aten::stack")),
    ("other elementwise", ("aten::",)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, dtype, lengths and output folder."""
    parser.add_argument("--model", default="tiny", help="model preset (tiny, small)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="compute dtype of every configuration")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median reported)")
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: what each worker of the default 4-process run gets on 2 cores)")
    add_out_dir(parser, "the trainer's metrics, in OUT_DIR/run (default: runs/bench_step_profile)")


def _category(name: str) -> str:
    for category, keys in CATEGORIES:
        if any(k in name for k in keys):
            return category
    return "Python and other"


def _trainer(args: argparse.Namespace, activations: str, gradients: str, which: str) -> Any:
    from agoq.launch.config import load_config
    from agoq.launch.components import build_run

    cfg = load_config(
        None,
        [
            f"--model.preset={args.model}",
            f"--precision.activations={activations}",
            f"--precision.gradients={gradients}",
            f"--precision.compute_dtype={args.dtype}",
            f"--precision.quant_backend={which}",
            "--parallel.pp=1",
            "--parallel.dp=1",
            "--checkpoint.every=0",
            "--checkpoint.resume=false",
            f"--train.out_dir={Path(args.out_dir) / 'run' if args.out_dir else 'runs/bench_step_profile'}",
        ],
    )
    return build_run(cfg).trainer


def run(args: argparse.Namespace) -> int:
    """Build the configurations, time them interleaved, profile each, write step_profile.json."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from benchmarks._common import RESULTS_DIR, same_round_ratio, write_result
    from agoq.quant import backend
    from agoq.launch.choices import cpu_bf16_flags

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ[k] = v
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    trainers = {}
    compile_s = {}
    for name, acts, grads, which in CONFIGS:
        with backend.use_backend(which):
            t0 = time.perf_counter()
            tr = _trainer(args, acts, grads, which)
            for _ in range(2):  # the first steps compile (compiled backend) and warm the allocator
                tr._train_step(None)
            compile_s[name] = time.perf_counter() - t0
        trainers[name] = (tr, which)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, (tr, which) in trainers.items():
            with backend.use_backend(which):
                t0 = time.perf_counter()
                for _ in range(args.steps_per_round):
                    tr._train_step(None)
                times[name].append((time.perf_counter() - t0) / args.steps_per_round)
    rows = []
    base = statistics.median(times[CONFIGS[0][0]])
    for name, (tr, which) in trainers.items():
        with backend.use_backend(which), profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                tr._train_step(None)
            profiled = (time.perf_counter() - t0) / args.profile_steps
        by_cat: dict[str, float] = {}
        for ev in prof.key_averages():
            cat = _category(ev.key)
            by_cat[cat] = by_cat.get(cat, 0.0) + ev.self_cpu_time_total / 1e3 / args.profile_steps
        accounted = sum(by_cat.values())
        # What the profiler saw no operator for (Python between ops, hooks' bookkeeping): the rest
        # of the profiled wall time.
        by_cat["Python and other"] = by_cat.get("Python and other", 0.0) + max(0.0, profiled * 1e3 - accounted)
        median = statistics.median(times[name])
        rows.append(
            {
                "config": name,
                "backend": which,
                "step_s_median": median,
                "step_s_all": times[name],
                "vs_bf16_policy": median / base,
                "vs_bf16_policy_same_round": same_round_ratio(times[name], times[CONFIGS[0][0]]),
                "first_two_steps_s": compile_s[name],
                "profile_ms_per_step": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            }
        )
    results = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "cpu_bf16_flags": list(cpu_bf16_flags()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "setup": "1 process (pp = dp = 1), 4 micro-batches of 4 x 128 tokens, AdamW; int8 gradients fold into the 8-bit buffer (no communication at dp = 1)",
        "rows": rows,
    }
    # Held to AVX2 (benchmarks.run_time's AVX2_ONLY_ENV) on a CPU with more, or a CPU with AMX-BF16
    # (whose bf16 GEMMs differ most from the others'): a file of its own, beside the other CPUs'.
    from benchmarks.run_time import AVX2_ONLY_ENV

    held = all(os.environ.get(k, "").lower() == v.lower() for k, v in AVX2_ONLY_ENV.items())
    results["held_to_avx2"] = held
    env = "".join(f"{k}={v} " for k, v in AVX2_ONLY_ENV.items()) if held else ""
    cmd = f"{env}python -m benchmarks.step_profile --model {args.model} --dtype {args.dtype} --rounds {args.rounds} --threads {args.threads}"
    if args.out_dir:
        cmd += f" --out-dir {args.out_dir}"
    name = f"step_profile_{args.model}_{args.dtype}" + ("_avx2" if held else "_amx" if "amx_bf16" in results["cpu_bf16_flags"] else "")
    results["history"] = history(Path(args.out_dir or RESULTS_DIR) / f"{name}.json")
    write_result(name, results, command=cmd, out_dir=args.out_dir)
    print(readme_markdown(results))
    return 0


def history(path: Path) -> list[dict[str, Any]]:
    """The earlier results' headlines, with each configuration's ratio to the bf16 policy (benchmarks._common.result_history)."""
    from benchmarks._common import result_history

    return result_history(path, lambda rows: {"vs_bf16_policy": {r["config"]: round(r["vs_bf16_policy"], 3) for r in rows}})


def readme_markdown(results: dict[str, Any]) -> str:
    """Step times and the per-category profile as markdown tables."""
    rows = results["rows"]
    flags = ", ".join(f.upper() for f in results["cpu_bf16_flags"]) or "no AVX512-BF16/AMX-BF16"
    lines = [
        f"{results['model']} model, {results['dtype']} compute, {results['threads']} thread(s), CPU {results['cpu_capability']} ({flags}); {results['setup']}.",
        "",
        "| configuration | s / step (median) | vs bf16 policy | same round | first two steps s (incl. compile) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        paired = f"{r['vs_bf16_policy_same_round']:.2f}x" if "vs_bf16_policy_same_round" in r else "-"
        lines.append(f"| {r['config']} | {r['step_s_median']:.3f} | {r['vs_bf16_policy']:.2f}x | {paired} | {r['first_two_steps_s']:.1f} |")
    cats = []
    for r in rows:
        for c in r["profile_ms_per_step"]:
            if c not in cats:
                cats.append(c)
    lines += [
        "",
        "ms per step by category (self CPU time, torch.profiler):",
        "",
        "| category | " + " | ".join(r["config"] for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{r['profile_ms_per_step'].get(c, 0.0):.1f}" for r in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.step_profile``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
