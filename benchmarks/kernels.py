"""Bandwidth of every quantization kernel, torch path and Triton path, against a copy of the same bytes.

Each kernel is charged the bytes it must move at the least: every input read once and every
output written once (bf16 activations, fp32 gradients, packed codes plus fp32 scales). A
device-to-device copy that reads and writes the same number of bytes is the physical limit, so
``copy_fraction`` = (copy time) / (kernel time) is the share of the achievable bandwidth a kernel
reaches (the target is 0.7). The torch path runs the reference functions one after another
(several passes), the Triton path the fused kernel (one pass): their time ratio is the fusion gain.

Meaningful on a GPU. On CPU the Triton path runs only under TRITON_INTERPRET=1 and its times
mean nothing: ``--dry-run`` uses tiny sizes to check that the benchmark itself runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from benchmarks._common import add_out_dir

DESCRIPTION = "GB/s of each quantize/dequantize and fused kernel (torch path vs Triton) as a share of a device-to-device copy of the same bytes"

DEFAULT_FORMATS = "int4,int5,int6,int8,fp4,nf4,fp8,int8/256"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.kernels``."""
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="elements of each activation-sized tensor (default 64M)")
    parser.add_argument("--hidden", type=int, default=4096, help="row length of the norm kernels (default 4096, llama3-8b)")
    parser.add_argument("--world", type=int, default=8, help="ranks summed by the all-reduce's local step (default 8)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help=f"formats of quantize/dequantize (default {DEFAULT_FORMATS})")
    parser.add_argument("--backends", default="torch,triton", help="comma-separated: torch, triton (default both)")
    parser.add_argument("--tiles", default="", help="Triton elements per program to compare, e.g. 1024,2048,4096 (default: the library's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per kernel; the median is reported")
    parser.add_argument("--inner", type=int, default=10, help="calls per timed round")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, one round: check the benchmark runs (times are meaningless)")
    add_out_dir(parser)


class _Timer:
    """Seconds per call of fn: median over rounds of ``inner`` back-to-back calls."""

    def __init__(self, device: Any, repeats: int, inner: int) -> None:
        import torch

        self.torch, self.device, self.repeats, self.inner = torch, device, repeats, inner

    def __call__(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        fn()  # warm-up: compilation, allocator, tables
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.inner):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / self.inner)
            else:
                t0 = time.perf_counter()
                for _ in range(self.inner):
                    fn()
                times.append((time.perf_counter() - t0) / self.inner)
        return statistics.median(times)


def _cases(args: argparse.Namespace, device: Any) -> list[dict[str, Any]]:
    """Every (kernel, format) with its torch-path and Triton-path callables and its byte count."""
    import torch
    import torch.nn.functional as F

    from agoq.activation.ops import _norm_backward, _norm_forward
    from agoq.quant import QTensor, backend, dequantize, parse_format, quantize

    def ref(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with backend.use_backend("torch"):
                return fn()

        return run

    def tq() -> Any:
        import agoq.quant.triton as kernels

        return kernels

    gen = torch.Generator().manual_seed(0)
    n, hidden, bf16 = args.numel, args.hidden, torch.bfloat16
    tokens = max(1, n // hidden)
    nt = tokens * hidden
    x = torch.randn(n, generator=gen).to(device=device, dtype=bf16)
    cases: list[dict[str, Any]] = []

    def qbytes(fmt: Any, numel: int) -> int:
        return fmt.nbytes(numel)

    for spec in [s.strip() for s in args.formats.split(",") if s.strip()]:
        fmt = parse_format(spec)
        q = quantize(x, fmt)
        cases.append(
            dict(
                kernel="quantize",
                format=fmt.name,
                bytes=2 * n + qbytes(fmt, n),
                torch=ref(lambda fmt=fmt: quantize(x, fmt)),
                triton=lambda fmt=fmt: tq().quantize(x, fmt),
            )
        )
        cases.append(
            dict(
                kernel="dequantize",
                format=fmt.name,
                bytes=qbytes(fmt, n) + 2 * n,
                torch=ref(lambda q=q: dequantize(q)),
                triton=lambda q=q: tq().dequantize(q),
            )
        )

    fmt = parse_format("int4/128")
    xn = x[:nt].view(tokens, hidden)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=bf16)
    qx = quantize(xn, fmt)
    rstd = _norm_forward(dequantize(qx, torch.float32), w, eps=1e-5)[1]
    grad_h = torch.randn(tokens, hidden, generator=gen).to(device)

    def norm_fwd_torch() -> Any:
        h, _ = _norm_forward(xn, w, eps=1e-5)
        return h, quantize(xn, fmt, nonfinite="propagate")

    def norm_recompute_torch() -> Any:
        return _norm_forward(dequantize(qx, torch.float32), w, eps=1e-5, out_dtype=bf16)

    def norm_bwd_torch() -> Any:
        return _norm_backward(grad_h, dequantize(qx, torch.float32), rstd, w, x_dtype=bf16, need_weight_grad=True)

    norm_q = qbytes(fmt, nt)
    cases += [
        dict(
            kernel="rms_norm_forward+quantize",
            format=fmt.name,
            bytes=2 * nt + 2 * hidden + 2 * nt + norm_q,
            torch=ref(norm_fwd_torch),
            triton=lambda: tq().rms_norm_quantize(xn, w, 1e-5, fmt),
        ),
        dict(
            kernel="rms_norm_recompute",
            format=fmt.name,
            bytes=norm_q + 2 * hidden + 2 * nt + 4 * tokens,
            torch=ref(norm_recompute_torch),
            triton=lambda: tq().rms_norm_recompute(qx, w, 1e-5, bf16),
        ),
        dict(
            kernel="rms_norm_backward",
            format=fmt.name,
            bytes=4 * nt + norm_q + 4 * tokens + 2 * hidden + 2 * nt,
            torch=ref(norm_bwd_torch),
            triton=lambda: tq().rms_norm_backward(grad_h, qx, rstd, w, bf16, True),
        ),
    ]

    gate = x.view(-1)
    up = torch.randn(n, generator=gen).to(device=device, dtype=bf16)
    qg, qu = quantize(gate, fmt), quantize(up, fmt)
    grad_act = torch.randn(n, generator=gen).to(device=device, dtype=bf16)

    def swiglu_fwd_torch() -> Any:
        return F.silu(gate) * up, quantize(gate, fmt, nonfinite="propagate"), quantize(up, fmt, nonfinite="propagate")

    def swiglu_bwd_torch() -> Any:
        g, u = dequantize(qg, torch.float32), dequantize(qu, torch.float32)
        sig = torch.sigmoid(g)
        silu = g * sig
        ga = grad_act.float()
        return (silu * u).to(bf16), (ga * u * sig * (1 + g * (1 - sig))).to(bf16), (ga * silu).to(bf16)

    cases += [
        dict(
            kernel="swiglu_forward+quantize",
            format=fmt.name,
            bytes=4 * n + 2 * n + 2 * qbytes(fmt, n),
            torch=ref(swiglu_fwd_torch),
            triton=lambda: tq().swiglu_quantize(gate, up, fmt),
        ),
        dict(
            kernel="swiglu_backward",
            format=fmt.name,
            bytes=2 * qbytes(fmt, n) + 2 * n + 6 * n,
            torch=ref(swiglu_bwd_torch),
            triton=lambda: tq().swiglu_backward(grad_act, qg, qu, bf16, bf16),
        ),
    ]

    g8 = parse_format("int8/256")
    grad = torch.randn(n, generator=gen).to(device)
    stored = quantize(grad, g8)
    pay, sc = stored.payload.clone(), stored.scales.clone()

    def accumulate_torch() -> Any:
        acc = dequantize(QTensor(pay, sc, torch.Size([n]), torch.float32, g8))
        acc += grad
        q = quantize(acc, g8, nonfinite="propagate")
        pay.copy_(q.payload)
        sc.copy_(q.scales)

    # Re-folding the same gradient keeps values bounded (the scales grow by a factor per fold).
    def accumulate_triton() -> Any:
        tq().accumulate_(pay, sc, grad, g8, first=False)

    world = args.world
    chunk = max(g8.block_size, n // world // g8.block_size * g8.block_size)
    rows = [quantize(torch.randn(chunk, generator=gen).to(device), g8) for _ in range(world)]
    pay_rows = torch.stack([r.payload for r in rows])
    sc_rows = torch.stack([r.scales for r in rows])

    def reduce_torch() -> Any:
        acc = dequantize(QTensor(pay_rows[0], sc_rows[0], torch.Size([chunk]), torch.float32, g8))
        for i in range(1, world):
            acc += dequantize(QTensor(pay_rows[i], sc_rows[i], torch.Size([chunk]), torch.float32, g8))
        acc /= world
        return acc, quantize(acc, g8, nonfinite="propagate")

    cases += [
        dict(kernel="grad_accumulate", format=g8.name, bytes=2 * qbytes(g8, n) + 4 * n, torch=ref(accumulate_torch), triton=accumulate_triton),
        dict(
            kernel=f"allreduce_local_step(W={world})",
            format=g8.name,
            bytes=world * qbytes(g8, chunk) + 4 * chunk + qbytes(g8, chunk),
            torch=ref(reduce_torch),
            triton=lambda: tq().reduce_rows(pay_rows, sc_rows, g8, average=True, requantize=True),
        ),
    ]
    return cases


def run(args: argparse.Namespace) -> int:
    """Time every kernel and a same-bytes copy, print a table, write kernels.json (and a PNG)."""
    import torch

    from benchmarks._common import write_result
    from agoq.quant import backend

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dry_run:
        args.numel, args.hidden, args.repeats, args.inner = 65536, 256, 1, 1
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("torch", "triton"):
            raise SystemExit(f"--backends: unknown backend {b!r}; use torch and/or triton")
    if "triton" in backends:
        try:
            with backend.use_backend("triton"):
                backend.resolve(device)
                import agoq.quant.triton as kernels
        except (RuntimeError, ImportError) as e:
            raise SystemExit(f"--backends triton: {e}")
        if device.type == "cpu" and not args.dry_run:
            raise SystemExit("the Triton path on CPU runs under the interpreter, whose times mean nothing; use --dry-run or --backends torch")
        tiles = [int(t) for t in args.tiles.split(",") if t.strip()] or [kernels.ops.GPU_TILE]
    else:
        tiles = []
    if args.numel < 1 or args.hidden < 1 or args.world < 1:
        raise SystemExit("--numel, --hidden and --world must be positive")
    timer = _Timer(device, args.repeats, args.inner)
    copy_cache: dict[int, float] = {}

    def copy_time(nbytes: int) -> float:
        # A copy of nbytes / 2 bytes reads and writes nbytes in all.
        if nbytes not in copy_cache:
            src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            copy_cache[nbytes] = timer(lambda: dst.copy_(src))
        return copy_cache[nbytes]

    rows: list[dict[str, Any]] = []
    default_tile = kernels.ops.GPU_TILE if tiles else None
    for case in _cases(args, device):
        variants = [("torch", None)] if "torch" in backends else []
        variants += [("triton", t) for t in tiles]
        torch_s = None
        for name, tile in variants:
            if name == "triton":
                kernels.ops.GPU_TILE = tile
            seconds = timer(case[name])
            copy_s = copy_time(case["bytes"])
            if name == "torch":
                torch_s = seconds
            rows.append(
                {
                    "kernel": case["kernel"],
                    "format": case["format"],
                    "backend": name if tile is None or len(tiles) == 1 else f"triton(tile={tile})",
                    "bytes": case["bytes"],
                    "seconds": seconds,
                    "gbps": case["bytes"] / seconds / 1e9,
                    "copy_gbps": case["bytes"] / copy_s / 1e9,
                    "copy_fraction": copy_s / seconds,
                    "speedup_vs_torch": None if torch_s is None else torch_s / seconds,
                }
            )
    if tiles:
        kernels.ops.GPU_TILE = default_tile
    results = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": args.dry_run,
        "numel": args.numel,
        "hidden": args.hidden,
        "world": args.world,
        "repeats": args.repeats,
        "inner": args.inner,
        "rows": rows,
    }
    command = (
        f"python -m benchmarks.kernels --device {device.type} --numel {args.numel} --hidden {args.hidden} --world {args.world} "
        f"--formats {args.formats} --backends {args.backends}"
        + (f" --tiles {args.tiles}" if args.tiles else "")
        + (" --dry-run" if args.dry_run else "")
        + (f" --out-dir {args.out_dir}" if args.out_dir else "")
    )
    path = write_result("kernels", results, command=command, out_dir=args.out_dir)
    _plot(rows, path.with_suffix(".png"), results["device_name"])
    print(_markdown(rows, results))
    print(f"\nwritten: {path}")
    return 0


def _markdown(rows: list[dict[str, Any]], results: dict[str, Any]) -> str:
    lines = [
        f"{results['numel'] / 2**20:g}M elements on {results['device_name']}{' (dry run: times meaningless)' if results['dry_run'] else ''}; "
        "GB/s of the bytes each kernel must move; copy = a device-to-device copy of the same bytes",
        "",
        "| kernel | format | backend | GB/s | share of copy | x torch |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        speed = "" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.2f}"
        lines.append(f"| {r['kernel']} | {r['format']} | {r['backend']} | {r['gbps']:.1f} | {r['copy_fraction']:.2f} | {speed} |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Any, device_name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = list(dict.fromkeys(f"{r['kernel']} {r['format']}" for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    width = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(labels)), 4.5))
    for i, b in enumerate(backends):
        vals = {f"{r['kernel']} {r['format']}": r["copy_fraction"] for r in rows if r["backend"] == b}
        ax.bar([j + (i - (len(backends) - 1) / 2) * width for j in range(len(labels))], [vals.get(lab, 0) for lab in labels], width=width, label=b)
    ax.axhline(0.7, color="k", linestyle="--", linewidth=1, label="target 0.7")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("share of copy bandwidth")
    ax.set_title(f"agoq kernels on {device_name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.kernels``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
