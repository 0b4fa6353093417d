"""Block-wise quantization: the torch reference of the quantize/dequantize pair every feature of
agoq calls (through :mod:`agoq.quant.dispatch`, which uses a backend's kernels where they apply;
this module imports no backend, so the kernels can fall back to it without an import cycle).

A 1-D input is cut into blocks of ``block_size`` consecutive values (the last block is
zero-padded for the arithmetic only; that padding is never stored). A tensor of two or more
dimensions is quantized row by row (rows: the last dimension, e.g. one token's hidden vector): each
row is zero-padded to whole blocks (:func:`agoq.quant.formats.stored_row`), so no block spans two
rows; where the width is whole blocks this is the same as flattening. Each block keeps
one fp32 scale s = absmax / max_value, rounded up by one ulp when needed so that |x| / s <= max_value
holds exactly: the largest magnitude of the block is representable and nothing clips.

Rounding rules (stated because kernels must match them):
- ``nearest``: int formats use ``torch.round`` (ties to even); fp8 uses torch's float8_e4m3fn cast
  (ties to even); fp4 takes the nearer E2M1 value with ties to the even code (as IEEE and the OCP
  MX spec round); nf4 takes the nearer value with ties to the lower one (as bitsandbytes does).
  Every element is then within half the gap around its value times its block scale (int: s / 2).
- ``stochastic``: round up iff a uniform draw u in [0, 1) is below f = (y - lower) / gap, the
  distance from the lower neighbour over the gap; so E[dequantize(quantize(x))] = x (unbiased, to
  the 2**-24 granularity of u) and the variance is f(1-f) gap^2 s^2.

Non-finite input is never turned into finite garbage: ``nonfinite="raise"`` (default) raises
:class:`NonFiniteError` naming the first bad element; ``nonfinite="propagate"`` stores a NaN scale
for every block holding a NaN or Inf, so the whole block dequantizes to NaN and a NaN loss or
gradient check downstream sees it; the other blocks are quantized as usual.

The work runs over slabs of about a million elements (whole blocks, whole packing groups), so the
fp32 temporaries of one slab stay in the CPU cache between the few vectorized passes. On GPUs the
slabs are large enough to be one or a few launches. There is no loop over blocks or elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from agoq.quant.formats import SCALE_DTYPE, CodebookTables, QuantFormat, codebook_tables, count_below, lookup, parse_format, stored_row
from agoq.quant.packing import group_shape, pack_into, unpack_into

ROUNDINGS = ("nearest", "stochastic")
NONFINITE_MODES = ("raise", "propagate")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# fp32 temporaries of 2**20 elements (4 MiB) stay in L2/L3 between passes (benchmarks/quant_throughput.py).
CPU_SLAB = 1 << 20
DEVICE_SLAB = 1 << 26


class NonFiniteError(ValueError):
    """Raised when a tensor holding NaN or Inf is quantized with nonfinite='raise'."""


@dataclass
class QTensor:
    """A block-wise quantized tensor: packed codes, per-block fp32 scales, shape, dtype, format."""

    payload: torch.Tensor  # uint8, ceil(numel * bits / 8) bytes
    scales: torch.Tensor  # fp32, one per block
    shape: torch.Size
    dtype: torch.dtype
    fmt: QuantFormat

    @property
    def numel(self) -> int:
        """Number of values represented."""
        return math.prod(self.shape)

    @property
    def stored_numel(self) -> int:
        """Number of values stored: ``numel`` plus the zero padding that ends each row on a block."""
        return self.fmt.stored_numel(self.shape)

    @property
    def padded_rows(self) -> bool:
        """Whether rows are stored padded (two or more dimensions, a width not of whole blocks)."""
        return self.stored_numel != self.numel

    @property
    def whole_blocks(self) -> bool:
        """Whether the values are stored as they are and fill every block (no padding anywhere), as
        kernels that read codes in the blocks' own shape need."""
        return self.numel == self.scales.numel() * self.fmt.block_size

    def stored(self) -> "QTensor":
        """The stored values, padding included, as a 1-D QTensor sharing this one's memory."""
        return QTensor(self.payload, self.scales, torch.Size([self.stored_numel]), self.dtype, self.fmt)

    def rows(self, start: int, end: int) -> "QTensor":
        """Rows start..end of a quantized [..., width] tensor, as a [end - start, width] QTensor sharing its memory."""
        if len(self.shape) < 2:
            raise ValueError(f"rows() needs a tensor of two or more dimensions, this one has shape {tuple(self.shape)}")
        width = self.shape[-1]
        total = self.numel // width if width else 0
        if not 0 <= start <= end <= total:
            raise ValueError(f"rows {start}..{end} are outside the {total} rows of this quantized tensor")
        stride = stored_row(width, self.fmt.block_size)
        part = self.stored().blocks(start * stride, (end - start) * stride)
        return QTensor(part.payload, part.scales, torch.Size([end - start, width]), self.dtype, self.fmt)

    @property
    def nbytes(self) -> int:
        """Every byte stored: packed payload plus scales."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def device(self) -> torch.device:
        """Device holding the payload and scales."""
        return self.payload.device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values, on the torch reference path (every backend gives the same values; for their
        speed call :func:`agoq.quant.dequantize`)."""
        return dequantize(self, dtype)

    def to(self, device: torch.device | str) -> "QTensor":
        """A copy on another device."""
        return QTensor(self.payload.to(device), self.scales.to(device), self.shape, self.dtype, self.fmt)

    def blocks(self, start: int, numel: int, dtype: torch.dtype | None = None) -> "QTensor":
        """Stored values start..start+numel (rounded up to whole blocks, and ending at the last value
        stored) as a 1-D QTensor sharing this one's memory.

        ``start`` must fall on a block boundary; e.g. to dequantize a large tensor a piece at a time.
        """
        block, total = self.fmt.block_size, self.stored_numel
        if start % block or not 0 <= start <= total:
            raise ValueError(f"blocks({start}, {numel}): start must be a block boundary (a multiple of {block}) in 0..{total}, the values stored")
        if numel < 0:
            raise ValueError(f"blocks({start}, {numel}): the number of values must be at least 0")
        if start * self.fmt.bits % 8:
            raise ValueError(
                f"start={start} of {self.fmt.name} codes is not on a byte boundary; slice at a multiple of {8 // math.gcd(self.fmt.bits, 8)} values"
            )
        n = min(-(-numel // block) * block, total - start)
        pay = self.payload[self.fmt.payload_bytes(start) : self.fmt.payload_bytes(start + n)]
        first = start // block
        return QTensor(pay, self.scales[first : first + self.fmt.num_blocks(n)], torch.Size([n]), dtype or self.dtype, self.fmt)


def _slab(fmt: QuantFormat, device: torch.device) -> int:
    """Elements per slab: whole blocks and whole packing groups, about CPU_SLAB on CPU."""
    unit = math.lcm(fmt.block_size, group_shape(fmt.bits)[0])
    target = CPU_SLAB if device.type == "cpu" else DEVICE_SLAB
    return max(1, target // unit) * unit


def _padded(m: int, fmt: QuantFormat) -> tuple[int, int]:
    """(blocks, padded length) of a slab of m values: whole blocks, then whole packing groups."""
    blocks = -(-m // fmt.block_size)
    g = group_shape(fmt.bits)[0]
    return blocks, -(-(blocks * fmt.block_size) // g) * g


def block_scales(absmax: torch.Tensor, max_value: float) -> torch.Tensor:
    """fp32 scales s with s * max_value >= absmax exactly, each within one ulp of absmax / max_value."""
    s = absmax / max_value
    # s * max_value is exact in fp64 (24 + at most 9 significant bits), so the test is exact; rounding
    # s up where it came out low guarantees |x| / s <= max_value, even for subnormal scales.
    low = s.double() * max_value < absmax.double()
    return torch.where(low, torch.nextafter(s, torch.full_like(s, math.inf)), s)


def _nonfinite_message(x: torch.Tensor) -> str:
    """Where the first non-finite value of ``x`` is, and how many there are."""
    flat = x.detach().reshape(-1)
    bad = ~torch.isfinite(flat.float())  # in fp32: fp64 values beyond its range count
    count, index = int(bad.sum()), int(bad.nonzero()[0])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), x.shape)) if x.dim() else ()
    return (
        f"cannot quantize a tensor of shape {tuple(x.shape)} holding {count} value(s) that are not finite "
        f"in fp32, the first at flat index {index} (index {where}, value {flat[index].item()}); check the "
        "producer for overflow, or pass nonfinite='propagate' to store NaN for the blocks holding them"
    )


def check_quantize_args(
    x: torch.Tensor, fmt: QuantFormat | str, rounding: str, nonfinite: str, generator: torch.Generator | None = None
) -> QuantFormat:
    """The parsed format, after refusing a bad input, format, rounding, nonfinite mode or generator (one message each)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize expects a floating-point torch.Tensor (fp32/bf16/fp16/fp64), got {got}")
    fmt = parse_format(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return fmt


def check_dequantize_args(q: "QTensor", dtype: torch.dtype | None, out: torch.Tensor | None) -> None:
    """Refuse a ``q`` that is not a consistent QTensor, a non-floating output dtype, or a bad ``out``."""
    if not isinstance(q, QTensor):
        raise TypeError(f"dequantize expects a QTensor (what quantize returns), got {type(q).__name__}")
    _check(q)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES):
        raise ValueError(f"dequantize returns floating-point values; dtype must be one of fp32/bf16/fp16/fp64, got {dtype!r}")
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.dtype not in FLOAT_DTYPES:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a floating-point tensor (fp32/bf16/fp16/fp64), got {got}")
    if out.numel() != q.numel:
        raise ValueError(f"dequantize into a tensor of {out.numel()} values, but the quantized tensor holds {q.numel}")
    if out.device != q.device:
        raise ValueError(f"out is on {out.device}, the quantized tensor on {q.device}; pass an out on {q.device}")


def stored_values(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The values of ``x`` as they are stored in ``fmt``, 1-D: rows zero-padded to whole blocks
    (a copy only where the width is not whole blocks)."""
    flat = x.detach().reshape(-1)
    if x.dim() < 2 or not flat.numel():
        return flat
    width = x.shape[-1]
    pad = stored_row(width, fmt.block_size) - width
    return F.pad(x.detach().reshape(-1, width), (0, pad)).view(-1) if pad else flat


def unpadded_rows(stored: torch.Tensor, shape: torch.Size, fmt: QuantFormat) -> torch.Tensor:
    """Values laid out as ``fmt`` stores a tensor of ``shape`` (1-D, rows padded to whole blocks),
    back in ``shape`` without the padding (a view where there is none)."""
    if fmt.stored_numel(shape) == math.prod(shape):
        return stored.view(shape)
    width = shape[-1]
    return stored.view(-1, stored_row(width, fmt.block_size))[:, :width].reshape(shape)


def dequantize_padded_rows(
    q: "QTensor", dtype: torch.dtype | None, out: torch.Tensor | None, dequantize_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """What ``q`` (stored with padded rows) represents, by ``dequantize_fn`` (a path's dequantize
    of 1-D QTensors) over the stored values, with each row's padding dropped."""
    dtype = out.dtype if out is not None else dtype or q.dtype
    values = unpadded_rows(dequantize_fn(q.stored(), dtype), q.shape, q.fmt)
    return values if out is None else out.copy_(values.view(out.shape))


def quantize(
    x: torch.Tensor,
    fmt: QuantFormat | str = "int4",
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    nonfinite: str = "raise",
) -> QTensor:
    """Quantize ``x`` (any shape; fp32/bf16/fp16) block-wise into a packed :class:`QTensor`."""
    fmt = check_quantize_args(x, fmt, rounding, nonfinite, generator)
    flat = stored_values(x, fmt)
    n = flat.numel()
    block, bits = fmt.block_size, fmt.bits
    payload = torch.empty(fmt.payload_bytes(n), dtype=torch.uint8, device=x.device)
    scales = torch.empty(fmt.num_blocks(n), dtype=SCALE_DTYPE, device=x.device)
    step = _slab(fmt, x.device)
    for start in range(0, n, step):
        m = min(step, n - start)
        blocks, length = _padded(m, fmt)
        y = (torch.empty if length == m else torch.zeros)(length, dtype=torch.float32, device=x.device)
        y[:m].copy_(flat[start : start + m])
        yb = y[: blocks * block].view(blocks, block)
        absmax = block_absmax(yb)
        bad = None
        if nonfinite == "raise":
            if not bool(torch.isfinite(absmax).all()):  # raising needs the host to know: one read per slab
                raise NonFiniteError(_nonfinite_message(x))
        else:
            bad = zero_nonfinite_blocks(yb, absmax)
        scale = block_scales(absmax, fmt.max_value)
        _divide_by_scales(yb, scale)
        noise = None
        if rounding == "stochastic":
            noise = torch.rand(length, generator=generator, device=x.device, dtype=torch.float32)
        codes = _encode(y, fmt, noise)
        if length != m:
            codes[m:] = 0  # padding never reaches the stored bits of the last byte
        b0, nbytes = start * bits // 8, length * bits // 8
        if b0 + nbytes <= payload.numel():
            pack_into(codes, bits, payload[b0 : b0 + nbytes])
        else:
            tail = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
            pack_into(codes, bits, tail)
            payload[b0:].copy_(tail[: payload.numel() - b0])
        if bad is not None:
            scale.masked_fill_(bad, math.nan)
        scales[start // block : start // block + blocks] = scale
    return QTensor(payload, scales, x.shape, x.dtype, fmt)


def block_absmax(yb: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each block of ``yb`` ([blocks, block]; NaN where a block holds NaN)."""
    return torch.maximum(yb.amax(dim=1), yb.amin(dim=1).neg())


def zero_nonfinite_blocks(yb: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``nonfinite="propagate"``'s rule, in place: each block of ``yb`` ([blocks, block]) whose
    ``absmax`` is NaN/Inf gets zero values and absmax, so that it encodes as zeros; returns those
    blocks' mask, for their scales to be set to NaN once encoded."""
    # Masked whether or not a block is bad: a host read to skip the mask would stall a GPU's queue.
    bad = ~torch.isfinite(absmax)
    yb.masked_fill_(bad[:, None], 0.0)
    absmax.masked_fill_(bad, 0.0)
    return bad


def _divide_by_scales(yb: torch.Tensor, scale: torch.Tensor) -> None:
    """Divide each block of ``yb`` by its scale, in place (never by a reciprocal: the codes depend on it)."""
    # An all-zero block has scale 0: divide it by 1 so its codes are exact zeros, never 0/0.
    yb.div_(torch.where(scale > 0, scale, 1.0)[:, None])


def block_codes(
    yb: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None = None, *, propagate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(one uint8 code per value, fp32 scales) of fp32 whole blocks ``yb`` ([blocks, block],
    overwritten), nearest rounding: the arithmetic of :func:`quantize` without its packing, which
    agoq.quant.compiled runs under torch.compile (``tables``: the format's codebook_tables, passed
    in because compiled code does not trace a cache). A block holding NaN/Inf gets unspecified
    codes, or with ``propagate`` :func:`quantize`'s ``nonfinite="propagate"`` bits: the codes of
    zeros and a NaN scale."""
    absmax = block_absmax(yb)
    bad = zero_nonfinite_blocks(yb, absmax) if propagate else None
    scale = block_scales(absmax, fmt.max_value)
    _divide_by_scales(yb, scale)
    # Codes in the blocks' own shape: flattening a dynamic [blocks, block] tensor inside a compiled
    # graph loses the static block length, and inductor's loops with it.
    codes = _encode(yb, fmt, None, tables)
    return codes, (scale if bad is None else scale.masked_fill(bad, math.nan))


def code_values(codes: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None = None) -> torch.Tensor:
    """fp32 format values (before scaling) of one-byte codes, any shape: what :func:`dequantize`
    decodes each code of a payload to."""
    if fmt.kind == "int":
        return codes.float() - (1 << (fmt.bits - 1))
    t = codebook_tables(fmt.kind, codes.device) if tables is None else tables
    return lookup(t.by_code, codes.to(torch.int32))


def _encode(y: torch.Tensor, fmt: QuantFormat, noise: torch.Tensor | None, tables: CodebookTables | None = None) -> torch.Tensor:
    """uint8 codes of scaled values y, |y| <= max_value (y is overwritten)."""
    if fmt.kind == "int":
        # |y| <= qmax, so neither rounding can leave -qmax..qmax: no clamp needed.
        if noise is None:
            y.round_()
        else:
            # Up with probability frac(y): compare the draw with the exact fraction. (floor(y + u)
            # is not safe: in fp32, 127 + 0.99999994 rounds to 128, past the top code.)
            q = torch.floor(y)
            y = q.add_(noise.lt_(y.sub_(q)))
        # q + 2**(b-1) lies in 1..2**b - 1: exact in fp32, then one conversion to the code byte
        # (no int8 detour through a dtype view, which compiled graphs cannot fuse).
        return y.add_(1 << (fmt.bits - 1)).to(torch.uint8)
    if fmt.kind == "fp8" and noise is None:
        return y.to(torch.float8_e4m3fn).view(torch.uint8)
    t = codebook_tables(fmt.kind, y.device) if tables is None else tables
    if noise is None:
        # Value i wins iff exactly i boundaries lie below y; the tie rule is built into them.
        idx = count_below(y, t.boundaries_lut, t.boundaries_ext)
    else:
        # Neighbours values[i-1] < y <= values[i] (clamped at the ends, where the gap's draw is moot).
        idx = count_below(y, t.values_lut, t.values_ext).clamp_(1, t.values.numel() - 1)
        hi = t.values.index_select(0, idx)
        idx.sub_(1)
        lo = t.values.index_select(0, idx)
        idx.add_(noise.mul_(hi.sub_(lo)) < y.sub_(lo))
    return lookup(t.codes, idx)


def _decode_into(payload: torch.Tensor, fmt: QuantFormat, out: torch.Tensor) -> None:
    """Write the fp32 format values (before scaling) of whole packing groups of codes into ``out``."""
    if fmt.kind == "int":
        unpack_into(payload, fmt.bits, out)
        out.sub_(1 << (fmt.bits - 1))
    else:
        t = codebook_tables(fmt.kind, payload.device)
        # One lookup per code position in a byte, straight from the packed bytes (no unpacking):
        # the same by_code values code_values reads, one row per position.
        index = payload.to(torch.int32)
        per_byte = out.view(-1, t.byte_values.shape[0])
        for i, row in enumerate(t.byte_values):
            torch.index_select(row, 0, index, out=per_byte[:, i])


def _check(q: QTensor) -> None:
    """Raise if the payload or scales do not match the shape and format."""
    fmt, n = q.fmt, q.stored_numel
    if q.payload.dtype != torch.uint8 or q.payload.numel() != fmt.payload_bytes(n):
        raise ValueError(
            f"quantized tensor has {q.payload.numel()} {q.payload.dtype} payload values but shape "
            f"{tuple(q.shape)} in {fmt} needs {fmt.payload_bytes(n)} uint8 bytes; it is truncated or mismatched"
        )
    if q.scales.dtype != SCALE_DTYPE or q.scales.numel() != fmt.num_blocks(n):
        raise ValueError(
            f"quantized tensor has {q.scales.numel()} {q.scales.dtype} scales but shape {tuple(q.shape)} "
            f"in {fmt} needs {fmt.num_blocks(n)} {SCALE_DTYPE}; it is truncated or mismatched"
        )


def _slab_values(q: QTensor, start: int, m: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 format values (unscaled, padded to whole blocks and groups) of elements start..start+m,
    written into ``into`` when given (fp32, exactly that padded length)."""
    fmt = q.fmt
    _, length = _padded(m, fmt)
    b0, nbytes = start * fmt.bits // 8, length * fmt.bits // 8
    chunk = q.payload[b0 : b0 + nbytes]
    if chunk.numel() < nbytes:
        chunk = torch.nn.functional.pad(chunk, (0, nbytes - chunk.numel()))
    v = torch.empty(length, dtype=torch.float32, device=q.device) if into is None else into
    _decode_into(chunk, fmt, v)
    return v


def dequantize(q: QTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``q`` represents, in its original shape and dtype (or ``dtype``).

    With ``out`` (q.numel values, its dtype is the output dtype) the values are written there and
    ``out`` is returned: one pass, where dequantizing and then copying would make two.
    """
    check_dequantize_args(q, dtype, out)
    if q.padded_rows:
        return dequantize_padded_rows(q, dtype, out, dequantize)
    if out is not None:
        dtype = out.dtype
    if out is not None and not out.is_contiguous():
        return out.copy_(dequantize(q, dtype).view(out.shape))
    result = out
    fmt, n, block = q.fmt, q.numel, q.fmt.block_size
    out = torch.empty(n, dtype=dtype or q.dtype, device=q.device) if result is None else result.view(-1)
    step = _slab(fmt, q.device)
    for start in range(0, n, step):
        m = min(step, n - start)
        blocks, length = _padded(m, fmt)
        s = q.scales[start // block : start // block + blocks, None]
        if out.dtype == torch.float32 and m == length:
            # fp32 out and a slab of whole blocks and groups: decoded and scaled where it lies,
            # with no slab-sized temporary (the same single fp32 rounding of the product).
            _slab_values(q, start, m, into=out[start : start + m]).view(blocks, block).mul_(s)
            continue
        v = _slab_values(q, start, m)
        vb = v[: blocks * block].view(blocks, block)
        if m == blocks * block:
            # Multiplied in fp32, rounded once into the output dtype.
            torch.mul(vb, s, out=out[start : start + m].view(blocks, block))
        else:
            vb.mul_(s)
            out[start : start + m].copy_(v[:m])
    return out.view(q.shape) if result is None else result


def dequantize_each_row(
    payload_rows: torch.Tensor,
    scale_rows: torch.Tensor,
    fmt: QuantFormat,
    out: torch.Tensor,
    dequantize_fn: Callable[..., torch.Tensor] = dequantize,
) -> None:
    """Writes into ``out`` ([W, n] values, n whole blocks) the values of W rows of ``fmt`` (payload
    [W, bytes], scales [W, n / block], e.g. the rows of a collective's wire buffer), a row at a time
    by ``dequantize_fn`` (a path's dequantize), each row copied out of the buffer first: how the
    kernel paths' ``dequantize_rows`` read rows they cannot read in place."""
    for i in range(scale_rows.shape[0]):
        row = QTensor(payload_rows[i].contiguous(), scale_rows[i].contiguous(), torch.Size([out.shape[1]]), out.dtype, fmt)
        dequantize_fn(row, out=out[i])


def quantize_each_row_into(
    x: torch.Tensor,
    payload_rows: torch.Tensor,
    scale_rows: torch.Tensor,
    fmt: QuantFormat,
    quantize_fn: Callable[[torch.Tensor, QuantFormat], QTensor],
) -> None:
    """Quantizes ``x`` ([W, n] values, n whole blocks, contiguous) by ``quantize_fn`` (a path's
    quantize, NaN scales for blocks holding NaN/Inf) and copies the payload and scales into
    ``payload_rows`` ([W, bytes]) and ``scale_rows`` ([W, n / block]), any row stride: how the
    paths' ``quantize_rows_into`` write rows that their kernels do not write in place."""
    rows, n = x.shape
    if n % fmt.block_size:
        raise ValueError(f"rows of {n} values are not whole blocks of {fmt.block_size} ({fmt.name})")
    q = quantize_fn(x.reshape(-1), fmt)
    payload_rows.copy_(q.payload.view(rows, -1))
    scale_rows.copy_(q.scales.view(rows, -1))


def quantization_error_bound(q: QTensor) -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| for nearest rounding, as fp32 in x's shape.

    Half the gap between the format values around the element, times its block's scale; for int
    formats that is exactly scale / 2.
    """
    _check(q)
    if q.padded_rows:
        width = q.shape[-1]
        stored = quantization_error_bound(q.stored()).view(-1, stored_row(width, q.fmt.block_size))
        return stored[:, :width].reshape(q.shape)
    fmt, n = q.fmt, q.numel
    nb = q.scales.numel()
    if fmt.kind == "int":
        half = torch.full((nb * fmt.block_size,), 0.5, device=q.device)
    else:
        t = codebook_tables(fmt.kind, q.device)
        gaps = t.values[1:] - t.values[:-1]
        # The element lies within half a gap of its code's value on either side: take the larger.
        v = _slab_values(q, 0, n)[: nb * fmt.block_size]
        idx = torch.searchsorted(t.values, v)
        left = torch.where(idx > 0, gaps[(idx - 1).clamp(min=0)], 0.0)
        right = torch.where(idx < gaps.numel(), gaps[idx.clamp(max=gaps.numel() - 1)], 0.0)
        half = torch.maximum(left, right) / 2
    bound = (half.view(nb, fmt.block_size) * q.scales[:, None]).reshape(-1)[:n]
    return bound.reshape(q.shape)
