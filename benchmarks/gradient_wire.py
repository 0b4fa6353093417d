"""The block size of the 4-bit gradient wire format: rounding error against bytes per value.

One block-wise nearest rounding of 1M values per format (int4 at blocks 32..256, and int8/256,
the buffer's own format): relative L2 error on N(0, 1) values and on heavy-tailed ones (N(0, 1)
scaled by exp(N(0, 1)), as gradients of different tensors mix magnitudes), and the bytes per value
sent with one fp32 scale per block, also as a fraction of an fp32 ring all-reduce's bytes
(4 bytes per value: the ratio is the same for the all-to-all + all-gather and the ring).
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "int4 gradient wire format: rounding error vs block size (32..256) beside int8/256, and bytes per value"

FORMATS = ("int4/32", "int4/64", "int4/128", "int4/256", "int8/256")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sample size."""
    parser.add_argument("--numel", type=int, default=1 << 20, help="values per sample (default 1M)")
    add_out_dir(parser)


def measure(numel: int) -> list[dict[str, Any]]:
    """One row per format: errors on both samples, bytes per value."""
    import torch

    from agoq.quant import dequantize, parse_format, quantize
    from agoq.quant.formats import SCALE_BYTES

    g = torch.Generator().manual_seed(0)
    samples = {"gaussian": torch.randn(numel, generator=g)}
    samples["heavy_tailed"] = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    rows = []
    for name in FORMATS:
        fmt = parse_format(name)
        errors = {k: float((dequantize(quantize(x, fmt), torch.float32) - x).norm() / x.norm()) for k, x in samples.items()}
        per_value = fmt.bits / 8 + SCALE_BYTES / fmt.block_size
        rows.append({"format": name, "rel_error": errors, "bytes_per_value": per_value, "vs_fp32_bytes": per_value / 4})
    return rows


def readme_markdown(results: dict[str, Any]) -> str:
    """The table the README shows."""
    lines = [
        "| wire format | rel. error, N(0, 1) | rel. error, heavy-tailed | bytes / value | vs fp32 all-reduce bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        e = r["rel_error"]
        lines.append(f"| {r['format']} | {e['gaussian']:.2%} | {e['heavy_tailed']:.2%} | {r['bytes_per_value']:.4f} | {r['vs_fp32_bytes']:.3f}x |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure and write gradient_wire.json."""
    from benchmarks._common import write_result

    results = {"numel": args.numel, "rows": measure(args.numel)}
    write_result("gradient_wire", results, out_dir=args.out_dir)
    print(readme_markdown(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gradient_wire", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
