"""Quantize and dequantize throughput of every agoq.quant format, against a plain copy of the same bytes."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "quantize/dequantize throughput of every format on a large bf16 tensor, as GB/s and as a ratio to tensor.clone()"

DEFAULT_FORMATS = "int2,int3,int4,int5,int6,int8,fp4,nf4,fp8,int8/256"


def parse_count(text: str) -> int:
    """An element count such as '64M', '512K' or '1000000' (K/M/G are powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 64M or 1000000, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the count must be positive, got {text!r}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.quant_throughput``."""
    parser.add_argument("--numel", type=parse_count, default=parse_count("64M"), help="elements of the bf16 tensor (default 64M)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated formats (default {DEFAULT_FORMATS}; block 128 unless /BLOCK)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement, after one warm-up; the median is reported")
    # One thread by default: on a shared or oversubscribed CPU, every multi-threaded op waits at a
    # barrier for a descheduled thread (measured here: medians 10x the minimum with 2 threads).
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0: torch's default)")
    parser.add_argument("--device", default="cpu", help="device of the tensor (cpu, cuda)")
    parser.add_argument(
        "--backends", default="torch,compiled", help="comma-separated quantization paths to time (agoq.quant.backend: torch, compiled, triton)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a markdown table")
    add_out_dir(parser)


def _timer(device: Any) -> Any:
    import torch

    def timed(fn: Any) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    return timed


def run(args: argparse.Namespace) -> int:
    """Time clone, quantize and dequantize per format, print a table, write quant_throughput.json/.png."""
    import json

    import torch

    from benchmarks._common import RESULTS_DIR, write_result
    from agoq.quant import backend, parse_format

    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        formats = [parse_format(f) for f in args.formats.split(",") if f.strip()]
    except ValueError as e:
        raise SystemExit(f"--formats: {e}")
    device = torch.device(args.device)
    n = args.numel
    timed = _timer(device)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.bfloat16)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in backend.BACKENDS or b == "auto":
            raise SystemExit(f"--backends: {b!r} is not one of torch, compiled, triton")
    rows = [_measure(x, fmt, which, timed, args.repeats) for fmt in formats for which in backends]
    results = {
        "numel": n,
        "dtype": "bfloat16",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "load_average_1min_at_start": load,
        "rows": rows,
        "history": history(Path(args.out_dir or RESULTS_DIR) / "quant_throughput.json"),
    }
    command = (
        f"python -m benchmarks.quant_throughput --numel {n} --formats {','.join(f.name for f in formats)} "
        f"--repeats {args.repeats} --threads {args.threads} --device {args.device} --backends {','.join(backends)}"
        + (f" --out-dir {args.out_dir}" if args.out_dir else "")
    )
    path = write_result("quant_throughput", results, command=command, out_dir=args.out_dir)
    _plot(rows, n, path.with_suffix(".png"))
    print(json.dumps(results, indent=2) if args.json else _markdown(rows, n, device, results["threads"]))
    print(f"\nwritten: {path}")
    return 0


def _measure(x: Any, fmt: Any, which: str, timed: Any, repeats: int) -> dict[str, Any]:
    """One format on one quantization path: median times of clone, quantize and dequantize, interleaved."""
    import torch

    from agoq.quant import backend, dequantize, quantize

    n, in_bytes = x.numel(), x.numel() * x.element_size()
    with backend.use_backend(which):
        # Warm-up (tables, allocator, compilation), a second size first: a run quantizes tensors of
        # several sizes, so what it runs is a compiled path's graph for a size it has not met first.
        dequantize(quantize(x[: n // 2 + 3 * fmt.block_size], fmt))
        q = quantize(x, fmt)
        dequantize(q)
        clone_t, q_t, dq_t = [], [], []
        # Interleaved, so that the copy and the format see the same machine load.
        for _ in range(repeats):
            clone_t.append(timed(lambda: x.clone()))
            q_t.append(timed(lambda: quantize(x, fmt)))
            dq_t.append(timed(lambda: dequantize(q)))
        y = dequantize(q, torch.float32)
    c, tq, tdq = (statistics.median(t) for t in (clone_t, q_t, dq_t))
    xf = x.float()
    return {
        "format": fmt.name,
        "backend": which,
        "numel": n,
        "input_bytes": in_bytes,
        "stored_bytes": q.nbytes,
        "bits_per_value": round(8 * q.nbytes / n, 4),
        "rel_l2_error_gaussian": float((xf - y).norm() / xf.norm()),
        "clone_s": c,
        "quantize_s": tq,
        "dequantize_s": tdq,
        "clone_gbps": in_bytes / c / 1e9,
        "quantize_gbps": in_bytes / tq / 1e9,
        "dequantize_gbps": in_bytes / tdq / 1e9,
        "quantize_vs_clone": c / tq,
        "dequantize_vs_clone": c / tdq,
        "quantize_s_all": q_t,
        "dequantize_s_all": dq_t,
        "clone_s_all": clone_t,
    }


def history(path: Path) -> list[dict[str, Any]]:
    """The earlier results' headlines: each format and path's quantize and dequantize speed as a
    fraction of a clone's (benchmarks._common.result_history)."""
    from benchmarks._common import result_history

    def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "vs_clone": {
                f"{r['format']} {r.get('backend', 'torch')}": [round(r["quantize_vs_clone"], 2), round(r["dequantize_vs_clone"], 2)] for r in rows
            }
        }

    return result_history(path, ratios)


def _markdown(rows: list[dict[str, Any]], n: int, device: Any, threads: int) -> str:
    lines = [
        f"{n / 2**20:g}M bf16 elements on {device} ({threads} threads); GB/s of bf16 input; median of repeats",
        "",
        "| format | path | bits/value | quantize GB/s | x clone | dequantize GB/s | x clone | clone GB/s | rel. L2 error (N(0,1)) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r.get('backend', 'torch')} | {r['bits_per_value']:.3f} | {r['quantize_gbps']:.2f} | {r['quantize_vs_clone']:.2f} "
            f"| {r['dequantize_gbps']:.2f} | {r['dequantize_vs_clone']:.2f} | {r['clone_gbps']:.2f} | {r['rel_l2_error_gaussian']:.4f} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], n: int, path: Any) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [f"{r['format']} {r.get('backend', 'torch')}" for r in rows]
    pos = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(9, 0.6 * len(rows)), 4))
    ax.bar([p - 0.2 for p in pos], [r["quantize_gbps"] for r in rows], width=0.4, label="quantize")
    ax.bar([p + 0.2 for p in pos], [r["dequantize_gbps"] for r in rows], width=0.4, label="dequantize")
    ax.axhline(statistics.median(r["clone_gbps"] for r in rows), color="k", linestyle="--", label="tensor.clone()")
    ax.set_xticks(list(pos), names, rotation=30)
    ax.set_ylabel("GB/s of bf16 input")
    ax.set_title(f"agoq.quant throughput, {n / 2**20:g}M bf16 elements")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.quant_throughput``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_throughput", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
