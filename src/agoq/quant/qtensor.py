"""Block-wise quantization: the one quantize/dequantize pair every feature of agoq calls.

The input is flattened in memory order and cut into blocks of ``block_size`` consecutive values
(the last block is zero-padded for the arithmetic only; padding is never stored). Each block keeps
one fp32 scale = absmax / max_value, so the largest magnitude of the block is exactly
representable and nothing clips.

Rounding rules (stated because kernels must match them):
- ``nearest`` on int formats: ``torch.round`` (ties to even); on fp8: torch's float8_e4m3fn cast
  (ties to even); on fp4 / nf4: the nearer table value, ties to the lower value.
- ``stochastic``: round up with probability equal to the distance from the lower neighbour over
  the gap, so E[dequantize(quantize(x))] = x exactly (unbiased).

Non-finite input is never turned into finite garbage: ``nonfinite="raise"`` (default) raises
:class:`NonFiniteError` naming the first bad element; ``nonfinite="propagate"`` stores a NaN scale
for every block holding a NaN or Inf, so the whole block dequantizes to NaN and a NaN loss or
gradient check downstream sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agoq.quant.formats import SCALE_DTYPE, QuantFormat, codebook_tables, parse_format
from agoq.quant.packing import pack, unpack

ROUNDINGS = ("nearest", "stochastic")
NONFINITE_MODES = ("raise", "propagate")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Every byte stored: packed payload plus scales."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def device(self) -> torch.device:
        """Device holding the payload and scales."""
        return self.payload.device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Same as :func:`dequantize` (self)."""
        return dequantize(self, dtype)

    def to(self, device: torch.device | str) -> "QTensor":
        """A copy on another device."""
        return QTensor(self.payload.to(device), self.scales.to(device), self.shape, self.dtype, self.fmt)


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """x as fp32 [num_blocks, block] (zero-padded) and its element count."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    nb = (n + block - 1) // block
    flat = flat.float()
    if nb * block != n:
        flat = torch.nn.functional.pad(flat, (0, nb * block - n))
    return flat.view(nb, block), n


def _first_nonfinite(x: torch.Tensor) -> str:
    bad = (~torch.isfinite(x.detach().reshape(-1))).nonzero()
    i = int(bad[0])
    return f"{bad.numel()} non-finite value(s), the first at flat index {i} ({x.reshape(-1)[i].item()})"


def quantize(
    x: torch.Tensor,
    fmt: QuantFormat | str = "int4",
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    nonfinite: str = "raise",
) -> QTensor:
    """Quantize ``x`` (any shape; fp32/bf16/fp16) block-wise into a packed :class:`QTensor`."""
    fmt = parse_format(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize expects a floating-point tensor (fp32/bf16/fp16), got {x.dtype}")
    blocks, n = _blocks(x, fmt.block_size)
    absmax = blocks.abs().amax(dim=1) if n else blocks.new_zeros(0)
    bad = ~torch.isfinite(absmax)
    any_bad = bool(bad.any()) if n else False
    if any_bad:
        if nonfinite == "raise":
            raise NonFiniteError(
                f"cannot quantize a tensor of shape {tuple(x.shape)} holding {_first_nonfinite(x)}; "
                "check the producer for overflow, or pass nonfinite='propagate' to keep NaN blocks"
            )
        blocks = torch.where(bad[:, None], 0.0, blocks)
        absmax = torch.where(bad, 0.0, absmax)
    scale = (absmax / fmt.max_value).to(SCALE_DTYPE)
    # An all-zero block has scale 0: divide by 1 instead so its codes are exact zeros, never NaN.
    y = blocks / torch.where(scale > 0, scale, 1.0)[:, None]
    if rounding == "stochastic":
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=torch.float32)
    codes = _encode(y, fmt, noise if rounding == "stochastic" else None)
    codes = codes.reshape(-1)[:n]
    if any_bad:
        scale = torch.where(bad, float("nan"), scale)
    return QTensor(pack(codes, fmt.bits), scale.contiguous(), x.shape, x.dtype, fmt)


def _encode(y: torch.Tensor, fmt: QuantFormat, noise: torch.Tensor | None) -> torch.Tensor:
    """Codes (uint8) of scaled values y, |y| <= max_value."""
    if fmt.kind == "int":
        q = torch.round(y) if noise is None else torch.floor(y + noise)
        q = q.clamp_(-fmt.qmax, fmt.qmax)
        return (q + (1 << (fmt.bits - 1))).to(torch.uint8)
    if fmt.kind == "fp8" and noise is None:
        return y.to(torch.float8_e4m3fn).view(torch.uint8)
    vals, codes, _ = codebook_tables(fmt.kind, y.device)
    idx = torch.searchsorted(vals, y.contiguous()).clamp_(1, vals.numel() - 1)
    lo, hi = vals[idx - 1], vals[idx]
    if noise is None:
        take_hi = (y - lo) > (hi - y)
    else:
        take_hi = noise * (hi - lo) < (y - lo)
    return codes[idx - 1 + take_hi.to(idx.dtype)]


def decode(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """fp32 format values (before scaling) of uint8 codes."""
    if fmt.kind == "int":
        return codes.float() - float(1 << (fmt.bits - 1))
    if fmt.kind == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    _, _, by_code = codebook_tables(fmt.kind, codes.device)
    return by_code[codes.long()]


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor ``q`` represents, in its original shape and dtype (or ``dtype``)."""
    fmt = q.fmt
    n = q.numel
    codes = unpack(q.payload, fmt.bits, n)
    if q.scales.numel() != fmt.num_blocks(n):
        raise ValueError(
            f"quantized tensor has {q.scales.numel()} scales but shape {tuple(q.shape)} with block "
            f"{fmt.block_size} needs {fmt.num_blocks(n)}; it is truncated or mismatched"
        )
    vals = decode(codes, fmt)
    nb = q.scales.numel()
    if nb * fmt.block_size != n:
        vals = torch.nn.functional.pad(vals, (0, nb * fmt.block_size - n))
    out = (vals.view(nb, fmt.block_size) * q.scales[:, None]).reshape(-1)[:n]
    return out.reshape(q.shape).to(dtype or q.dtype)


def quantization_error_bound(q: QTensor) -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| for nearest rounding, as fp32 in x's shape.

    Half the gap between the two format values around the element, times its block's scale; for
    int formats that is exactly scale / 2.
    """
    fmt = q.fmt
    n = q.numel
    nb = q.scales.numel()
    if fmt.kind == "int":
        half = torch.full((nb * fmt.block_size,), 0.5, device=q.device)
    else:
        vals, _, by_code = codebook_tables(fmt.kind, q.device)
        gaps = vals[1:] - vals[:-1]
        # The element lies within half a gap of its code's value; take the larger adjacent gap.
        v = decode(unpack(q.payload, fmt.bits, n), fmt)
        idx = torch.searchsorted(vals, v.contiguous())
        left = torch.where(idx > 0, gaps[(idx - 1).clamp(min=0)], 0.0)
        right = torch.where(idx < gaps.numel(), gaps[idx.clamp(max=gaps.numel() - 1)], 0.0)
        half = torch.maximum(left, right) / 2
        if nb * fmt.block_size != n:
            half = torch.nn.functional.pad(half, (0, nb * fmt.block_size - n))
    bound = (half.view(nb, fmt.block_size) * q.scales[:, None]).reshape(-1)[:n]
    return bound.reshape(q.shape)
