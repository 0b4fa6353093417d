"""Number formats: what a b-bit code means, as pure data.

A stored value is ``decode(code) * scale`` with one fp32 scale per block, scale = absmax / max_value:
- ``int``: symmetric integers -qmax..qmax, qmax = 2**(b-1) - 1, stored as code = q + 2**(b-1)
  (code 0 is unused, so the grid is symmetric and zero is exact);
- ``fp4``: FP4 E2M1, the 15 distinct values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign (max 6);
- ``nf4``: the 16 NormalFloat-4 quantiles of a standard normal (QLoRA), max 1;
- ``fp8``: FP8 E4M3 (torch.float8_e4m3fn bit patterns), max 448.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

KINDS = ("int", "fp4", "nf4", "fp8")
INT_BITS = (2, 3, 4, 5, 6, 8)
FP8_E4M3_MAX = 448.0
DEFAULT_ACTIVATION_BLOCK = 128
DEFAULT_GRADIENT_BLOCK = 256


@dataclass(frozen=True)
class QuantFormat:
    """A block-wise format: kind, bits per value and values per scale."""

    kind: str = "int"
    bits: int = 4
    block_size: int = DEFAULT_ACTIVATION_BLOCK

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantization kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == "int" and self.bits not in INT_BITS:
            raise ValueError(
                f"int quantization supports bits {INT_BITS}, got {self.bits}; pick one of those"
            )
        fixed = {"fp4": 4, "nf4": 4, "fp8": 8}
        if self.kind in fixed and self.bits != fixed[self.kind]:
            raise ValueError(f"{self.kind} is a {fixed[self.kind]}-bit format, got bits={self.bits}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")

    @property
    def name(self) -> str:
        """Short spec such as 'int4/128', accepted back by :func:`parse_format`."""
        base = f"int{self.bits}" if self.kind == "int" else self.kind
        return f"{base}/{self.block_size}"

    @property
    def qmax(self) -> int:
        """Largest integer code magnitude (int formats only)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def max_value(self) -> float:
        """The largest representable magnitude before scaling; block scale = absmax / max_value."""
        if self.kind == "int":
            return float(self.qmax)
        if self.kind == "fp4":
            return 6.0
        if self.kind == "nf4":
            return 1.0
        return FP8_E4M3_MAX

    def payload_bytes(self, numel: int) -> int:
        """Bytes of packed codes for ``numel`` values: ceil(numel * bits / 8)."""
        return (numel * self.bits + 7) // 8

    def num_blocks(self, numel: int) -> int:
        """Number of blocks (and scales) for ``numel`` values."""
        return (numel + self.block_size - 1) // self.block_size

    def nbytes(self, numel: int) -> int:
        """Bytes stored for ``numel`` values: packed codes plus one fp32 scale per block."""
        return self.payload_bytes(numel) + SCALE_BYTES * self.num_blocks(numel)

    def __str__(self) -> str:
        return self.name


# Scales are stored as fp32: gradients span 1e-8..1e3 within a tensor, and an fp32 scale keeps the
# round-to-nearest bound exact (|error| <= scale / 2) without a rounded scale clipping the block
# maximum. At 4 bits / block 128 the scale costs 0.25 bit per value (bf16 would save 0.125 bit).
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4

_SPEC = re.compile(r"^(int([2-8])|fp4|nf4|fp8)(?:/(\d+))?$")


def parse_format(spec: str | QuantFormat, block_size: int | None = None) -> QuantFormat:
    """Parse 'int4', 'int4/64', 'nf4', 'fp4', 'fp8', 'int8/256' into a QuantFormat."""
    if isinstance(spec, QuantFormat):
        return spec if block_size is None else QuantFormat(spec.kind, spec.bits, block_size)
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(
            f"unknown quantization format {spec!r}; use int2..int8 (int7 excluded), fp4, nf4 or fp8, "
            "optionally with '/BLOCK' (e.g. 'int4/128')"
        )
    kind = "int" if m.group(2) else m.group(1)
    bits = int(m.group(2)) if m.group(2) else (8 if kind == "fp8" else 4)
    if m.group(3) is not None:
        block_size = int(m.group(3))
    if block_size is None:
        block_size = DEFAULT_ACTIVATION_BLOCK
    return QuantFormat(kind, bits, block_size)


@functools.lru_cache(maxsize=None)
def _tables_cpu(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted distinct values, their codes, value of every code) of a codebook format."""
    if kind == "fp4":
        # E2M1 bit layout (sign | 2-bit exponent | 1-bit mantissa, bias 1): codes 0..7 hold
        # 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same with a minus sign (8 is -0).
        mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        by_code = torch.cat([mags, -mags])
    elif kind == "nf4":
        # NormalFloat-4: 8 positive and 7 negative quantiles of N(0, 1) plus an exact zero, from
        # QLoRA's construction (offset 0.9677 keeps the tails finite), normalized to [-1, 1];
        # the code is the index in ascending order.
        normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
        offset = 0.9677083
        pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
        neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
        vals = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
        by_code = (vals / vals.abs().max()).float()
    elif kind == "fp8":
        # The code is the E4M3 bit pattern itself, so payloads are valid float8_e4m3fn tensors.
        by_code = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"{kind!r} has no codebook")
    finite = torch.isfinite(by_code)
    codes = torch.arange(by_code.numel())[finite]
    vals = by_code[finite]
    # -0 duplicates +0: keep the first code of each distinct value, in ascending order.
    order = torch.argsort(vals + 0.0, stable=True)
    vals, codes = vals[order], codes[order]
    keep = torch.ones_like(vals, dtype=torch.bool)
    keep[1:] = vals[1:] != vals[:-1]
    return vals[keep].contiguous(), codes[keep].to(torch.uint8).contiguous(), by_code


@functools.lru_cache(maxsize=None)
def _tables_on(kind: str, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.to(device) for t in _tables_cpu(kind))  # type: ignore[return-value]


def codebook_tables(
    kind: str, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a codebook format: ascending distinct values, their codes, and the value of each code."""
    return _tables_on(kind, str(torch.device(device)))
