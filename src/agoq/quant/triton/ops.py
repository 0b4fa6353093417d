"""Launchers of the Triton kernels: the same contracts as the torch reference they replace.

Each function checks what the kernels need (contiguous memory, a format whose blocks hold whole
bytes) and raises ValueError otherwise; :mod:`agoq.quant.backend` only routes supported calls
here. Quantization here is always nearest rounding with ``nonfinite='propagate'`` semantics (a NaN
scale for every block holding NaN/Inf); the caller turns that into an error where it must.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from agoq.quant.formats import SCALE_DTYPE, QuantFormat, codebook_tables
from agoq.quant.packing import group_shape
from agoq.quant.qtensor import (
    FLOAT_DTYPES,
    QTensor,
    dequantize_each_row,
    dequantize_padded_rows,
    quantize_each_row_into,
    stored_values,
    unpadded_rows,
)
from agoq.quant.triton import kernels as K


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Kernels launched on CPU tensors only work if triton was imported under its interpreter.
INTERPRETED = _interpreted()
# Elements per program. On a GPU: 2048 keeps every kernel under ~130 registers per thread at 8
# warps with no spills (ptxas for sm_90; 4096 needs up to 246, a quarter of the occupancy). Under
# the interpreter each program has a large fixed cost whatever its size, so tiles are larger there.
GPU_TILE = 2048
INTERPRETER_TILE = 16384
# Largest block the kernels take (one block is one row of a register tile).
MAX_BLOCK = 8192
# Programs of the norm backward: enough to fill a GPU; each writes one [hidden] partial.
NORM_BACKWARD_PROGRAMS = 264


@dataclass(frozen=True)
class _Spec:
    """A format as kernel constants, with its lookup tables on one device."""

    kind: int  # K.KIND_INT, K.KIND_TABLE (fp4/nf4 codebook) or K.KIND_FP8: the kernels branch on it at compile time
    bits: int  # bits per code
    nbnd: int  # codebook decision boundaries (15 for a 16-value codebook, 0 otherwise)
    maxv: float  # largest magnitude a code represents: a block's scale is absmax / maxv
    block: int  # values per scale
    bp: int  # block rounded up to a power of two: a tile row (Triton ranges must be powers of two)
    g: int  # codes per packing group (packing.packing_group)
    gb: int  # bytes per packing group
    gbp: int  # gb rounded up to a power of two: the group's byte lanes in a tile
    boundaries: torch.Tensor  # the codebook's decision boundaries, ascending
    codes: torch.Tensor  # the code of each codebook value in ascending value order
    values: torch.Tensor  # each code's value

    def constants(self) -> dict:
        """The constexpr arguments every quantizing kernel takes."""
        return dict(KIND=self.kind, BITS=self.bits, NBND=self.nbnd, MAXV=self.maxv, BLOCK=self.block, G=self.g, GB=self.gb, GBP=self.gbp)

    def unpacking(self) -> dict:
        """The constexpr arguments of kernels that only read codes."""
        return dict(KIND=self.kind, BITS=self.bits, BLOCK=self.block, G=self.g, GB=self.gb, GBP=self.gbp)


def supports(fmt: QuantFormat) -> bool:
    """Whether the kernels cover ``fmt``: blocks of whole bytes (block_size % 8 == 0), at most MAX_BLOCK."""
    return fmt.block_size % 8 == 0 and fmt.block_size <= MAX_BLOCK


@functools.lru_cache(maxsize=None)
def _spec(fmt: QuantFormat, device: str) -> _Spec:
    if not supports(fmt):
        raise ValueError(
            f"the Triton kernels take block sizes that are multiples of 8 up to {MAX_BLOCK}, got {fmt.name}; "
            "use the torch backend (AGOQ_QUANT_BACKEND=torch) for this format"
        )
    g, gb = group_shape(fmt.bits)
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    if fmt.kind == "int":
        kind, bnd, codes, values = K.KIND_INT, dummy, dummy.to(torch.uint8), dummy
    else:
        t = codebook_tables(fmt.kind, device)
        kind = K.KIND_FP8 if fmt.kind == "fp8" else K.KIND_TABLE
        bnd, codes, values = t.boundaries, t.codes, t.by_code
    return _Spec(
        kind=kind,
        bits=fmt.bits,
        nbnd=bnd.numel() if kind == K.KIND_TABLE else 0,
        maxv=float(fmt.max_value),
        block=fmt.block_size,
        bp=triton.next_power_of_2(fmt.block_size),
        g=g,
        gb=gb,
        gbp=triton.next_power_of_2(gb),
        boundaries=bnd,
        codes=codes,
        values=values,
    )


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "Triton kernels run on CPU tensors only under its interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported, or use the torch backend on CPU (AGOQ_QUANT_BACKEND=torch)"
        )


def _rows_per_program(bp: int) -> int:
    tile = INTERPRETER_TILE if INTERPRETED else GPU_TILE
    return max(1, tile // bp)


def _as_kernel_float(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(contiguous flat tensor the kernel reads, whether it holds bf16 as int16 bits)."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"expected a floating-point tensor (fp32/bf16/fp16/fp64), got {t.dtype}")
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if t.dtype == torch.bfloat16:
        return flat.view(torch.int16), True
    return flat, False


def _out(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(the output tensor, what the kernel writes into, whether that is bf16 as int16 bits)."""
    out = torch.empty(n, dtype=dtype, device=device)
    return (out, out.view(torch.int16), True) if dtype == torch.bfloat16 else (out, out, False)


def _launch_options() -> dict:
    # GPUs must not contract v * s + g into an FMA (the reference rounds the product first); the
    # interpreter takes no compiler options.
    return {} if INTERPRETED else dict(enable_fp_fusion=False, num_warps=8)


def _launch_blocks(kernel: triton.JITFunction, constants: dict, nblocks: int, bp: int, *args, **flags) -> None:
    """Launch a kernel over ``nblocks`` blocks (tile rows of ``bp`` lanes), as many a program as a tile holds."""
    r = _rows_per_program(bp)
    kernel[(triton.cdiv(nblocks, r),)](*args, BP=bp, R=r, **flags, **constants, **_launch_options())


# ---- quantize / dequantize -------------------------------------------------------------------------


def quantize(x: torch.Tensor, fmt: QuantFormat) -> QTensor:
    """Block-wise nearest quantization of ``x`` (NaN scale for blocks holding NaN/Inf)."""
    _check_device(x)
    spec = _spec(fmt, str(x.device))
    flat, bf16 = _as_kernel_float(stored_values(x, fmt))
    n = flat.numel()
    nblocks, nbytes = fmt.num_blocks(n), fmt.payload_bytes(n)
    payload = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nblocks, dtype=SCALE_DTYPE, device=x.device)
    if n:
        _launch_blocks(
            K.quantize_kernel,
            spec.constants(),
            nblocks,
            spec.bp,
            flat,
            payload,
            scales,
            spec.boundaries,
            spec.codes,
            n,
            nblocks,
            nbytes,
            IN_BF16=bf16,
        )
    return QTensor(payload, scales, x.shape, x.dtype, fmt)


def dequantize(q: QTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``q`` represents, in its shape and dtype (or ``dtype``); written into ``out`` when given."""
    if q.padded_rows:
        return dequantize_padded_rows(q, dtype, out, dequantize)
    if out is not None:
        return out.copy_(dequantize(q, out.dtype).view(out.shape))
    _check_device(q.payload)
    spec = _spec(q.fmt, str(q.device))
    n = q.numel
    out, target, bf16 = _out(n, dtype or q.dtype, q.device)
    if n:
        nblocks = q.scales.numel()
        _launch_blocks(
            K.dequantize_kernel,
            spec.unpacking(),
            nblocks,
            spec.bp,
            q.payload,
            q.scales,
            spec.values,
            target,
            n,
            nblocks,
            q.payload.numel(),
            OUT_BF16=bf16,
        )
    return out.view(q.shape)


def dequantize_rows(payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat, out: torch.Tensor) -> None:
    """Writes into ``out`` ([W, n] values, n whole blocks) the values of W rows of ``fmt`` (payload
    [W, bytes], scales [W, n / block], e.g. rows of a collective's wire buffer), a launch per row."""
    dequantize_each_row(payload_rows, scale_rows, fmt, out, dequantize)


def quantize_rows_into(x: torch.Tensor, payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat) -> None:
    """Quantizes ``x`` ([W, n] values, n whole blocks) into ``payload_rows`` ([W, bytes]) and
    ``scale_rows`` ([W, n / block]), any row stride (NaN scales for blocks holding NaN/Inf): one
    launch, then copies into the rows."""
    quantize_each_row_into(x, payload_rows, scale_rows, fmt, quantize)


# ---- RMSNorm ---------------------------------------------------------------------------------------------


def norm_supported(hidden: int, fmt: QuantFormat) -> bool:
    """Whether the fused norm kernels take rows of ``hidden`` values in ``fmt``: whole power-of-two blocks per row."""
    b = fmt.block_size
    return supports(fmt) and b & (b - 1) == 0 and hidden % b == 0 and hidden <= 65536


def _check_norm(hidden: int, fmt: QuantFormat) -> None:
    if not norm_supported(hidden, fmt):
        raise ValueError(
            f"the fused RMSNorm kernels need rows of whole power-of-two blocks; hidden={hidden} with {fmt.name} "
            "is not; use the torch backend for this layer"
        )


def _row_tiling(hidden: int) -> tuple[int, int]:
    hp = triton.next_power_of_2(hidden)
    return hp, _rows_per_program(hp)


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, fmt: QuantFormat) -> tuple[torch.Tensor, QTensor]:
    """(RMSNorm(x) * weight in x's dtype, x quantized block-wise), reading x once."""
    _check_device(x)
    hidden = x.shape[-1]
    _check_norm(hidden, fmt)
    spec = _spec(fmt, str(x.device))
    flat, bf16 = _as_kernel_float(x)
    n = flat.numel()
    tokens = n // hidden
    h, target, _ = _out(n, x.dtype, x.device)
    payload = torch.empty(fmt.payload_bytes(n), dtype=torch.uint8, device=x.device)
    scales = torch.empty(fmt.num_blocks(n), dtype=SCALE_DTYPE, device=x.device)
    if n:
        hp, rt = _row_tiling(hidden)
        K.rms_norm_quantize_kernel[(triton.cdiv(tokens, rt),)](
            flat,
            weight.detach().contiguous(),
            target,
            payload,
            scales,
            spec.boundaries,
            spec.codes,
            tokens,
            float(eps),
            payload.numel(),
            IN_BF16=bf16,
            H=hidden,
            HP=hp,
            RT=rt,
            **spec.constants(),
            **_launch_options(),
        )
    return h.view(x.shape), QTensor(payload, scales, x.shape, x.dtype, fmt)


def rms_norm_recompute(q: QTensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x) * weight in out_dtype, fp32 rstd [..., 1]) of the x that ``q`` holds, in one pass."""
    _check_device(q.payload)
    hidden = q.shape[-1]
    _check_norm(hidden, q.fmt)
    spec = _spec(q.fmt, str(q.device))
    n = q.numel
    tokens = n // hidden
    h, target, bf16 = _out(n, out_dtype, q.device)
    rstd = torch.empty(tokens, dtype=torch.float32, device=q.device)
    if n:
        hp, rt = _row_tiling(hidden)
        K.rms_norm_recompute_kernel[(triton.cdiv(tokens, rt),)](
            q.payload,
            q.scales,
            spec.values,
            weight.detach().contiguous(),
            target,
            rstd,
            tokens,
            float(eps),
            q.payload.numel(),
            OUT_BF16=bf16,
            H=hidden,
            HP=hp,
            RT=rt,
            **spec.unpacking(),
            **_launch_options(),
        )
    return h.view(q.shape), rstd.view(*q.shape[:-1], 1)


def rms_norm_backward(
    grad_h: torch.Tensor, q: QTensor, rstd: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype, need_weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad of x in x_dtype, grad of weight in its dtype) of RMSNorm at the x that ``q`` holds."""
    _check_device(q.payload)
    hidden = q.shape[-1]
    _check_norm(hidden, q.fmt)
    spec = _spec(q.fmt, str(q.device))
    g, gbf16 = _as_kernel_float(grad_h)
    n = q.numel
    tokens = n // hidden
    gx, target, bf16 = _out(n, x_dtype, q.device)
    hp, rt = _row_tiling(hidden)
    programs = max(1, min(triton.cdiv(tokens, rt), NORM_BACKWARD_PROGRAMS))
    partials = torch.empty(programs, hidden, dtype=torch.float32, device=q.device)
    if n:
        K.rms_norm_backward_kernel[(programs,)](
            g,
            q.payload,
            q.scales,
            spec.values,
            rstd.detach().reshape(-1).contiguous(),
            weight.detach().contiguous(),
            target,
            partials,
            tokens,
            q.payload.numel(),
            GH_BF16=gbf16,
            OUT_BF16=bf16,
            NEED_GW=need_weight_grad,
            H=hidden,
            HP=hp,
            RT=rt,
            **spec.unpacking(),
            **_launch_options(),
        )
    gw = partials.sum(0).to(weight.dtype) if need_weight_grad else None
    if gw is not None and not n:
        gw.zero_()
    return gx.view(q.shape), gw


# ---- SwiGLU ----------------------------------------------------------------------------------------------


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, QTensor, QTensor]:
    """(SiLU(gate) * up in the inputs' dtype, gate quantized, up quantized), reading each once."""
    _check_device(gate)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    spec = _spec(fmt, str(gate.device))
    # Rows that are not whole blocks are read padded, as quantize reads them.
    g, bf16 = _as_kernel_float(stored_values(gate, fmt))
    u, _ = _as_kernel_float(stored_values(up, fmt))
    n = g.numel()
    act, target, _ = _out(n, gate.dtype, gate.device)
    nblocks, nbytes = fmt.num_blocks(n), fmt.payload_bytes(n)
    parts = [
        torch.empty(nbytes, dtype=torch.uint8, device=gate.device) if i % 2 == 0 else torch.empty(nblocks, dtype=SCALE_DTYPE, device=gate.device)
        for i in range(4)
    ]
    if n:
        _launch_blocks(
            K.swiglu_quantize_kernel,
            spec.constants(),
            nblocks,
            spec.bp,
            g,
            u,
            target,
            *parts,
            spec.boundaries,
            spec.codes,
            n,
            nblocks,
            nbytes,
            IN_BF16=bf16,
        )
    qg = QTensor(parts[0], parts[1], gate.shape, gate.dtype, fmt)
    qu = QTensor(parts[2], parts[3], up.shape, up.dtype, fmt)
    return unpadded_rows(act, gate.shape, fmt), qg, qu


def swiglu_backward(
    grad_act: torch.Tensor, qg: QTensor, qu: QTensor, grad_dtype: torch.dtype, act_dtype: torch.dtype | None
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(SiLU(gate) * up in act_dtype or None, grad of gate, grad of up) from quantized gate and up."""
    _check_device(qg.payload)
    if qg.shape != qu.shape or qg.fmt != qu.fmt or tuple(grad_act.shape) != tuple(qg.shape):
        raise ValueError(f"gate {tuple(qg.shape)} {qg.fmt}, up {tuple(qu.shape)} {qu.fmt} and the gradient {tuple(grad_act.shape)} must match")
    if act_dtype is not None and act_dtype != grad_dtype:
        raise ValueError(f"the recomputed product and the gradients share one dtype here, got {act_dtype} and {grad_dtype}")
    spec = _spec(qg.fmt, str(qg.device))
    # Rows that are not whole blocks run padded, as their codes are stored; the padding is dropped after.
    ga, gabf16 = _as_kernel_float(stored_values(grad_act, qg.fmt))
    n = qg.stored_numel
    gg, gg_t, bf16 = _out(n, grad_dtype, qg.device)
    gu, gu_t, _ = _out(n, grad_dtype, qg.device)
    act, act_t = (None, gg_t) if act_dtype is None else _out(n, act_dtype, qg.device)[:2]
    nblocks = qg.scales.numel()
    if n:
        _launch_blocks(
            K.swiglu_backward_kernel,
            spec.unpacking(),
            nblocks,
            spec.bp,
            ga,
            qg.payload,
            qg.scales,
            qu.payload,
            qu.scales,
            spec.values,
            act_t,
            gg_t,
            gu_t,
            n,
            nblocks,
            qg.payload.numel(),
            GA_BF16=gabf16,
            OUT_BF16=bf16,
            NEED_ACT=act is not None,
        )
    return (None if act is None else unpadded_rows(act, qg.shape, qg.fmt)), unpadded_rows(gg, qg.shape, qg.fmt), unpadded_rows(gu, qg.shape, qg.fmt)


# ---- QuanGrad ------------------------------------------------------------------------------------------


def accumulate_(payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, *, first: bool) -> None:
    """In place: (payload, scales) := quantize(grad if first else dequantize(payload, scales) + grad).

    The region holds whole blocks; ``grad`` may be shorter (the rest adds zero). Blocks that end up
    holding NaN/Inf get a NaN scale.
    """
    _check_device(payload)
    spec = _spec(fmt, str(payload.device))
    nblocks = scales.numel()
    n = nblocks * fmt.block_size
    g, bf16 = _as_kernel_float(grad)
    if g.numel() > n or payload.numel() != fmt.payload_bytes(n) or not (payload.is_contiguous() and scales.is_contiguous()):
        raise ValueError(
            f"accumulate_ needs contiguous storage of whole blocks: {payload.numel()} bytes and {nblocks} scales "
            f"for {n} values of {fmt.name}, and at most {n} gradient values (got {g.numel()})"
        )
    if nblocks:
        _launch_blocks(
            K.accumulate_kernel,
            spec.constants(),
            nblocks,
            spec.bp,
            payload,
            scales,
            g,
            spec.values,
            spec.boundaries,
            spec.codes,
            g.numel(),
            n,
            nblocks,
            payload.numel(),
            FIRST=first,
            IN_BF16=bf16,
        )


def reduce_rows(
    payload_rows: torch.Tensor,
    scale_rows: torch.Tensor,
    fmt: QuantFormat,
    *,
    average: bool,
    keep_sum: bool = True,
    requantize: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, QTensor | None]:
    """Sum W quantized rows in fp32, in row order (then / W if ``average``), in one pass.

    ``payload_rows``: uint8 [W, row payload bytes] (rows may be strided, bytes contiguous);
    ``scale_rows``: fp32 [W, blocks]. Returns (the fp32 sum if ``keep_sum``, the sum requantized
    if ``requantize``, written into ``out``, contiguous (payload, scales), where given).
    """
    _check_device(payload_rows)
    spec = _spec(fmt, str(payload_rows.device))
    w, nblocks = scale_rows.shape
    n = nblocks * fmt.block_size
    if payload_rows.shape != (w, fmt.payload_bytes(n)) or payload_rows.stride(1) != 1 or not scale_rows.is_contiguous():
        raise ValueError(
            f"reduce_rows needs payload rows of {fmt.payload_bytes(n)} contiguous bytes for {nblocks} blocks of {fmt.name}, "
            f"got {tuple(payload_rows.shape)} with strides {payload_rows.stride()}"
        )
    dev = payload_rows.device
    acc = torch.empty(n, dtype=torch.float32, device=dev) if keep_sum else None
    if requantize and out is not None:
        out_pay, out_sc = out
    else:
        out_pay = torch.empty(fmt.payload_bytes(n), dtype=torch.uint8, device=dev) if requantize else None
        out_sc = torch.empty(nblocks, dtype=SCALE_DTYPE, device=dev) if requantize else None
    dummy = scale_rows
    if nblocks:
        _launch_blocks(
            K.reduce_rows_kernel,
            spec.constants(),
            nblocks,
            spec.bp,
            payload_rows,
            payload_rows.stride(0),
            scale_rows,
            spec.values,
            spec.boundaries,
            spec.codes,
            dummy if acc is None else acc,
            payload_rows if out_pay is None else out_pay,
            dummy if out_sc is None else out_sc,
            w,
            nblocks,
            fmt.payload_bytes(n),
            AVG=average,
            STORE_SUM=keep_sum,
            REQUANT=requantize,
        )
    q = QTensor(out_pay, out_sc, torch.Size([n]), torch.float32, fmt) if requantize else None
    return acc, q
