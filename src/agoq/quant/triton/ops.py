"""Launchers of the Triton kernels: the same contracts as the torch reference they replace.

Each function checks what the kernels need (contiguous memory, a format whose blocks hold whole
bytes) and raises ValueError otherwise; :mod:`agoq.quant.backend` only routes supported calls
here. Quantization here is always nearest rounding with ``nonfinite='propagate'`` semantics (a NaN
scale for every block holding NaN/Inf); the caller turns that into an error where it must.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import triton

from agoq.quant.formats import SCALE_DTYPE, QuantFormat, codebook_tables
from agoq.quant.packing import group_shape
from agoq.quant.spans import SpanTable
from agoq.quant.qtensor import (
    FLOAT_DTYPES,
    QTensor,
    check_dequantize_args,
    dequantize_each_row,
    dequantize_padded_rows,
    quantize_each_row_into,
    stored_values,
    unpadded_rows,
)
import agoq.quant.triton.kernels as K


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
GPU_WARPS = 8
# Largest block the kernels take (one block is one row of a register tile).
MAX_BLOCK = 8192
# The norm kernels hold whole rows in registers, a row per program (several where rows are short).
# Row values per thread: at 16, every norm kernel stays at or under 128 registers with no spills
# (ptxas for sm_90, every format kind); a row of 8192 at 8 warps (32 a thread) took up to 240,
# one 8-warp block per SM.
NORM_VALUES_PER_THREAD = 16
# Widest row the norm kernels take: at 16384 the quantize and backward kernels spill (72 to 260
# bytes a thread) even at 32 warps, the most a block has; wider rows take the torch path.
NORM_MAX_HIDDEN = 8192
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


def _out(n: int, dtype: torch.dtype, device: torch.device, into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(the output tensor: ``into`` or a new one, what the kernel writes into, whether that is bf16 as int16 bits)."""
    out = torch.empty(n, dtype=dtype, device=device) if into is None else into
    flat = out.view(-1)
    return (out, flat.view(torch.int16), True) if dtype == torch.bfloat16 else (out, flat, False)


def _check_out(
    name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype | None, device: torch.device, contiguous: bool = True
) -> torch.Tensor:
    """``t`` when it is a (contiguous) tensor of ``shape`` and ``dtype`` (None: any float dtype) on ``device``."""
    ok = (
        isinstance(t, torch.Tensor)
        and tuple(t.shape) == tuple(shape)
        and (t.dtype == dtype if dtype is not None else t.dtype in FLOAT_DTYPES)
        and t.device == device
        and (t.is_contiguous() or not contiguous)
    )
    if not ok:
        want = ("a contiguous " if contiguous else "a ") + ("floating-point" if dtype is None else str(dtype))
        if isinstance(t, torch.Tensor):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else ", not contiguous")
        else:
            got = type(t).__name__
        raise ValueError(f"{name} must be {want} tensor of shape {tuple(shape)} on {device}, got {got}")
    return t


def _launch_options(num_warps: int = GPU_WARPS) -> dict:
    # GPUs must not contract v * s + g into an FMA (the reference rounds the product first); the
    # interpreter takes no compiler options.
    return {} if INTERPRETED else dict(enable_fp_fusion=False, num_warps=num_warps)


def _launch(kernel: triton.JITFunction, programs: int | tuple[int, ...], device: torch.device, *args, num_warps: int = GPU_WARPS, **kwargs) -> None:
    """Launch ``programs`` programs (or a grid of them) of ``kernel`` on ``device``, the GPU its tensors are on."""
    # Triton launches on the current CUDA device, which need not hold the tensors (a model spread
    # over GPUs by device_map="auto"): the kernel would read another GPU's addresses.
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    grid = programs if isinstance(programs, tuple) else (programs,)
    with guard:
        kernel[grid](*args, **kwargs, **_launch_options(num_warps))


def _launch_blocks(kernel: triton.JITFunction, constants: dict, nblocks: int, bp: int, device: torch.device, *args, **flags) -> None:
    """Launch a kernel over ``nblocks`` blocks (tile rows of ``bp`` lanes), as many a program as a tile holds."""
    r = _rows_per_program(bp)
    _launch(kernel, triton.cdiv(nblocks, r), device, *args, BP=bp, R=r, **flags, **constants)


# ---- quantize / dequantize -------------------------------------------------------------------------


def quantize(x: torch.Tensor, fmt: QuantFormat, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> QTensor:
    """Block-wise nearest quantization of ``x`` (NaN scale for blocks holding NaN/Inf); its payload
    and scales are ``out`` (contiguous uint8 bytes, fp32 scales) when given."""
    _check_device(x)
    spec = _spec(fmt, str(x.device))
    flat, bf16 = _as_kernel_float(stored_values(x, fmt))
    n = flat.numel()
    nblocks, nbytes = fmt.num_blocks(n), fmt.payload_bytes(n)
    if out is None:
        payload = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        scales = torch.empty(nblocks, dtype=SCALE_DTYPE, device=x.device)
    else:
        payload = _check_out("out[0] (the payload)", out[0], (nbytes,), torch.uint8, x.device)
        scales = _check_out("out[1] (the scales)", out[1], (nblocks,), SCALE_DTYPE, x.device)
    if n:
        _launch_blocks(
            K.quantize_kernel,
            spec.constants(),
            nblocks,
            spec.bp,
            x.device,
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
    """The tensor ``q`` represents, in its shape and dtype (or ``dtype``); with ``out`` (q.numel
    values of any float dtype and shape, as the reference takes), written there and ``out`` returned."""
    if out is not None:
        check_dequantize_args(q, dtype, out)
    if q.padded_rows:
        return dequantize_padded_rows(q, dtype, out, dequantize)
    if out is not None and not out.is_contiguous():
        return out.copy_(dequantize(q, out.dtype).view(out.shape))
    _check_device(q.payload)
    spec = _spec(q.fmt, str(q.device))
    n = q.numel
    result, target, bf16 = _out(n, (dtype or q.dtype) if out is None else out.dtype, q.device, out)
    if n:
        nblocks = q.scales.numel()
        _launch_blocks(
            K.dequantize_kernel,
            spec.unpacking(),
            nblocks,
            spec.bp,
            q.device,
            q.payload,
            q.scales,
            spec.values,
            target,
            n,
            nblocks,
            q.payload.numel(),
            OUT_BF16=bf16,
        )
    return result.view(q.shape) if out is None else out


def dequantize_rows(payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat, out: torch.Tensor) -> torch.Tensor:
    """Writes into ``out`` (contiguous [W, n] values, n whole blocks, any float dtype) the values of
    W rows of ``fmt`` (payload [W, bytes], scales [W, n / block], e.g. rows of a collective's wire
    buffer) and returns it: one launch where the rows are contiguous, else a launch per row."""
    w, nblocks = scale_rows.shape
    n = nblocks * fmt.block_size
    _check_out("out", out, (w, n), None, payload_rows.device)
    if payload_rows.is_contiguous() and scale_rows.is_contiguous():
        dequantize(QTensor(payload_rows.view(-1), scale_rows.view(-1), torch.Size([w * n]), out.dtype, fmt), out=out.view(-1))
    else:
        dequantize_each_row(payload_rows, scale_rows, fmt, out, dequantize)
    return out


def quantize_rows_into(x: torch.Tensor, payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat) -> None:
    """Quantizes ``x`` ([W, n] values, n whole blocks) into ``payload_rows`` ([W, bytes]) and
    ``scale_rows`` ([W, n / block]), any row stride (NaN scales for blocks holding NaN/Inf): one
    launch, straight into them where both are contiguous, else followed by copies into the rows."""
    rows, n = x.shape
    if n % fmt.block_size:
        raise ValueError(f"rows of {n} values are not whole blocks of {fmt.block_size} ({fmt.name})")
    _check_out("payload_rows", payload_rows, (rows, fmt.payload_bytes(n)), torch.uint8, x.device, contiguous=False)
    _check_out("scale_rows", scale_rows, (rows, n // fmt.block_size), SCALE_DTYPE, x.device, contiguous=False)
    if payload_rows.is_contiguous() and scale_rows.is_contiguous():
        quantize(x, fmt, out=(payload_rows.view(-1), scale_rows.view(-1)))
    else:
        # Not a launch per row: callers batch many short rows into one call, each launch a fixed cost.
        quantize_each_row_into(x, payload_rows, scale_rows, fmt, quantize)


# ---- RMSNorm ---------------------------------------------------------------------------------------------


def norm_supported(hidden: int, fmt: QuantFormat) -> bool:
    """Whether the fused norm kernels take rows of ``hidden`` values in ``fmt``: whole power-of-two blocks per row, at most NORM_MAX_HIDDEN."""
    b = fmt.block_size
    return supports(fmt) and b & (b - 1) == 0 and hidden % b == 0 and hidden <= NORM_MAX_HIDDEN


def _check_norm(hidden: int, fmt: QuantFormat) -> None:
    if not norm_supported(hidden, fmt):
        raise ValueError(
            f"the fused RMSNorm kernels need rows of whole power-of-two blocks, at most {NORM_MAX_HIDDEN} values; "
            f"hidden={hidden} with {fmt.name} is not; use the torch backend for this layer"
        )


def _row_tiling(hidden: int) -> tuple[int, int]:
    hp = triton.next_power_of_2(hidden)
    return hp, _rows_per_program(hp)


def norm_warps(hp: int) -> int:
    """Warps of a norm kernel's program over rows of ``hp`` lanes: NORM_VALUES_PER_THREAD values of a row per thread."""
    return max(GPU_WARPS, hp // (32 * NORM_VALUES_PER_THREAD))


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
        _launch(
            K.rms_norm_quantize_kernel,
            triton.cdiv(tokens, rt),
            x.device,
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
            num_warps=norm_warps(hp),
            **spec.constants(),
        )
    return h.view(x.shape), QTensor(payload, scales, x.shape, x.dtype, fmt)


def rms_norm_recompute(
    q: QTensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x) * weight in out_dtype, written into ``out`` when given, and fp32 rstd [..., 1]) of
    the x that ``q`` holds, in one pass."""
    _check_device(q.payload)
    hidden = q.shape[-1]
    _check_norm(hidden, q.fmt)
    spec = _spec(q.fmt, str(q.device))
    n = q.numel
    tokens = n // hidden
    if out is not None:
        _check_out("out", out, q.shape, out_dtype, q.device)
    h, target, bf16 = _out(n, out_dtype, q.device, out)
    rstd = torch.empty(tokens, dtype=torch.float32, device=q.device)
    if n:
        hp, rt = _row_tiling(hidden)
        _launch(
            K.rms_norm_recompute_kernel,
            triton.cdiv(tokens, rt),
            q.device,
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
            num_warps=norm_warps(hp),
            **spec.unpacking(),
        )
    return h.view(q.shape) if out is None else out, rstd.view(*q.shape[:-1], 1)


def rms_norm_backward(
    grad_h: torch.Tensor,
    q: QTensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    x_dtype: torch.dtype,
    need_weight_grad: bool,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad of x in x_dtype, written into ``out`` when given, grad of weight in its dtype) of
    RMSNorm at the x that ``q`` holds."""
    _check_device(q.payload)
    hidden = q.shape[-1]
    _check_norm(hidden, q.fmt)
    spec = _spec(q.fmt, str(q.device))
    g, gbf16 = _as_kernel_float(grad_h)
    n = q.numel
    tokens = n // hidden
    if out is not None:
        _check_out("out", out, q.shape, x_dtype, q.device)
    gx, target, bf16 = _out(n, x_dtype, q.device, out)
    hp, rt = _row_tiling(hidden)
    programs = max(1, min(triton.cdiv(tokens, rt), NORM_BACKWARD_PROGRAMS))
    partials = torch.empty(programs, hidden, dtype=torch.float32, device=q.device)
    if n:
        _launch(
            K.rms_norm_backward_kernel,
            programs,
            q.device,
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
            num_warps=norm_warps(hp),
            **spec.unpacking(),
        )
    gw = partials.sum(0).to(weight.dtype) if need_weight_grad else None
    if gw is not None and not n:
        gw.zero_()
    return gx.view(q.shape) if out is None else out, gw


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
            gate.device,
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
    grad_act: torch.Tensor,
    qg: QTensor,
    qu: QTensor,
    grad_dtype: torch.dtype,
    act_dtype: torch.dtype | None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(SiLU(gate) * up in act_dtype or None, grad of gate, grad of up) from quantized gate and up;
    the gradients written into ``out`` (grad of gate, grad of up; apart from ``grad_act``) when given."""
    _check_device(qg.payload)
    if qg.shape != qu.shape or qg.fmt != qu.fmt or tuple(grad_act.shape) != tuple(qg.shape):
        raise ValueError(f"gate {tuple(qg.shape)} {qg.fmt}, up {tuple(qu.shape)} {qu.fmt} and the gradient {tuple(grad_act.shape)} must match")
    if act_dtype is not None and act_dtype != grad_dtype:
        raise ValueError(f"the recomputed product and the gradients share one dtype here, got {act_dtype} and {grad_dtype}")
    if out is not None:
        for i, what in enumerate(("gate", "up")):
            _check_out(f"out[{i}] (the grad of {what})", out[i], qg.shape, grad_dtype, qg.device)
        if qg.padded_rows:  # the kernel writes rows padded to whole blocks, which out has no room for
            act, gg, gu = swiglu_backward(grad_act, qg, qu, grad_dtype, act_dtype)
            return act, out[0].copy_(gg), out[1].copy_(gu)
    spec = _spec(qg.fmt, str(qg.device))
    # Rows that are not whole blocks run padded, as their codes are stored; the padding is dropped after.
    ga, gabf16 = _as_kernel_float(stored_values(grad_act, qg.fmt))
    n = qg.stored_numel
    gg, gg_t, bf16 = _out(n, grad_dtype, qg.device, None if out is None else out[0])
    gu, gu_t, _ = _out(n, grad_dtype, qg.device, None if out is None else out[1])
    act, act_t = (None, gg_t) if act_dtype is None else _out(n, act_dtype, qg.device)[:2]
    nblocks = qg.scales.numel()
    if n:
        _launch_blocks(
            K.swiglu_backward_kernel,
            spec.unpacking(),
            nblocks,
            spec.bp,
            qg.device,
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
    act = None if act is None else unpadded_rows(act, qg.shape, qg.fmt)
    if out is not None:
        return act, gg, gu
    return act, unpadded_rows(gg, qg.shape, qg.fmt), unpadded_rows(gu, qg.shape, qg.fmt)


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
            payload.device,
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
            dev,
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


# ---- spans of one byte storage (agoq.quant.spans) -------------------------------------------------


def _span_grid(spans: SpanTable, bp: int) -> tuple[tuple[int, int], int]:
    """((programs per span, spans), blocks per program) of a launch over every span of ``spans``."""
    r = _rows_per_program(bp)
    return (max(1, triton.cdiv(spans.most_blocks, r)), spans.count), r


def _check_storage(storage: torch.Tensor, spans: SpanTable) -> torch.Tensor:
    """The storage as fp32 (where the scales are read), after checking it can be."""
    _check_device(storage)
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous() or storage.numel() % 4:
        raise ValueError(f"a span storage is a contiguous flat uint8 tensor of whole fp32 words, got {storage.dtype} {tuple(storage.shape)}")
    if spans.table.device != storage.device:
        raise ValueError(f"the span table is on {spans.table.device}, the storage on {storage.device}: build the table on the storage's device")
    return storage.view(SCALE_DTYPE)


def accumulate_spans_(storage: torch.Tensor, spans: SpanTable, grad: torch.Tensor, flag: torch.Tensor, *, first: bool) -> None:
    """accumulate_ into every span of ``spans`` in one launch: span (f, k, ...) takes grad values
    f..f+k. Blocks that end up holding NaN/Inf get scale 0 and set ``flag`` (one uint8) to 1."""
    scales = _check_storage(storage, spans)
    if spans.count == 0:
        return
    if flag.dtype != torch.uint8 or flag.numel() != 1 or flag.device != storage.device:
        raise ValueError(f"flag must be one uint8 on {storage.device}, got {flag.dtype} {tuple(flag.shape)} on {flag.device}")
    spec = _spec(spans.fmt, str(storage.device))
    g, bf16 = _as_kernel_float(grad)
    grid, r = _span_grid(spans, spec.bp)
    _launch(
        K.accumulate_spans_kernel,
        grid,
        storage.device,
        storage,
        scales,
        spans.table,
        g,
        flag,
        spec.values,
        spec.boundaries,
        spec.codes,
        FIRST=first,
        IN_BF16=bf16,
        BP=spec.bp,
        R=r,
        **spec.constants(),
    )


def dequantize_spans(storage: torch.Tensor, spans: SpanTable, out: torch.Tensor) -> torch.Tensor:
    """Every span's values into ``out`` (contiguous, any float dtype), span (f, k, ...) at out[f : f + k], in one launch; returns ``out``."""
    scales = _check_storage(storage, spans)
    _check_out("out", out, tuple(out.shape), None, storage.device)
    if spans.count:
        spec = _spec(spans.fmt, str(storage.device))
        _, target, bf16 = _out(out.numel(), out.dtype, storage.device, out)
        grid, r = _span_grid(spans, spec.bp)
        _launch(
            K.dequantize_spans_kernel,
            grid,
            storage.device,
            storage,
            scales,
            spans.table,
            spec.values,
            target,
            OUT_BF16=bf16,
            BP=spec.bp,
            R=r,
            **spec.unpacking(),
        )
    return out


def sum_of_squares_spans(storage: torch.Tensor, spans: SpanTable) -> torch.Tensor:
    """The fp64 sum of squares of every span's values, a device scalar (each square is exact in fp64)."""
    scales = _check_storage(storage, spans)
    if spans.count == 0:
        return torch.zeros((), dtype=torch.float64, device=storage.device)
    spec = _spec(spans.fmt, str(storage.device))
    grid, r = _span_grid(spans, spec.bp)
    partial = torch.empty(grid[1], grid[0], dtype=torch.float64, device=storage.device)  # every program writes its own
    _launch(
        K.sum_of_squares_spans_kernel,
        grid,
        storage.device,
        storage,
        scales,
        spans.table,
        spec.values,
        partial,
        BP=spec.bp,
        R=r,
        **spec.unpacking(),
    )
    return partial.sum()


def zero_scales_spans_(storage: torch.Tensor, spans: SpanTable) -> None:
    """Every scale of every span := 0, in one launch (each of their codes then decodes to 0)."""
    scales = _check_storage(storage, spans)
    if spans.count:
        spec = _spec(spans.fmt, str(storage.device))
        grid, r = _span_grid(spans, spec.bp)
        _launch(K.zero_scales_spans_kernel, grid, storage.device, scales, spans.table, BLOCK=spec.block, BP=spec.bp, R=r)
