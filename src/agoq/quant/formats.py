"""Number formats: what a b-bit code means, as pure data.

A stored value is ``decode(code) * scale`` with one fp32 scale per block, scale = absmax / max_value
(rounded up by at most one ulp, so that nothing clips):
- ``int``: symmetric integers -qmax..qmax, qmax = 2**(b-1) - 1, stored as code = q + 2**(b-1)
  (code 0 is unused, so the grid is symmetric and zero is exact);
- ``fp4``: FP4 E2M1, the 15 distinct values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign (max 6);
- ``nf4``: the 16 NormalFloat-4 quantiles of a standard normal (QLoRA), max 1;
- ``fp8``: FP8 E4M3 (torch.float8_e4m3fn bit patterns), max 448.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch

KINDS = ("int", "fp4", "nf4", "fp8")
INT_BITS = (2, 3, 4, 5, 6, 8)
FP8_E4M3_MAX = 448.0
# Chosen on a trained LLaMA's tensors (`python -m benchmarks.quant_block_size`, benchmarks/results/): for int4
# on the SwiGLU gate/up (the bulk of LAAQ's saved bytes) block 128 minimizes bits + log2(error),
# and halving 256 -> 128 cuts their error 8-9% for 0.125 more bits per value. For int8 gradients
# 256 is within 0.02 bit of the best (512) with 3% less error; at 1024 the error grows 31%.
DEFAULT_ACTIVATION_BLOCK = 128
DEFAULT_GRADIENT_BLOCK = 256
# One scale per 2**20 values is already coarser than any measured use; the bound keeps block
# arithmetic (block * rows, slab sizes) far from int64 overflow.
MAX_BLOCK_SIZE = 1 << 20


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
            raise ValueError(f"int quantization supports bits {INT_BITS}, got {self.bits}; pick one of those")
        fixed = {"fp4": 4, "nf4": 4, "fp8": 8}
        if self.kind in fixed and self.bits != fixed[self.kind]:
            raise ValueError(f"{self.kind} is a {fixed[self.kind]}-bit format, got bits={self.bits}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be an integer in 1..{MAX_BLOCK_SIZE}, got {self.block_size!r}")

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

    def stored_numel(self, shape: Sequence[int]) -> int:
        """Values stored for a tensor of ``shape``, padding included: see :func:`stored_row`."""
        if len(shape) < 2:
            return math.prod(shape)
        return math.prod(shape[:-1]) * stored_row(shape[-1], self.block_size)

    def stored_nbytes(self, shape: Sequence[int]) -> int:
        """Bytes stored for a tensor of ``shape``: packed codes (rows padded to whole blocks) plus scales."""
        return self.nbytes(self.stored_numel(shape))

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
    if not isinstance(spec, str):
        raise TypeError(f"a quantization format is a string such as 'int4/128' or a QuantFormat, got {type(spec).__name__} {spec!r}")
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(
            f"unknown quantization format {spec!r}; use int2..int8 (int7 excluded), fp4, nf4 or fp8, optionally with '/BLOCK' (e.g. 'int4/128')"
        )
    kind = "int" if m.group(2) else m.group(1)
    bits = int(m.group(2)) if m.group(2) else (8 if kind == "fp8" else 4)
    if m.group(3) is not None:
        block_size = int(m.group(3))
    if block_size is None:
        block_size = DEFAULT_ACTIVATION_BLOCK
    return QuantFormat(kind, bits, block_size)


# NormalFloat-4 as published with QLoRA (bitsandbytes' NF4 table, fp32): 7 negative and 8 positive
# quantiles of N(0, 1) plus an exact zero, normalized to [-1, 1]. Stored verbatim, not recomputed, so
# codes are bit-compatible with NF4 checkpoints; tests check them against the quantile construction.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class CodebookTables:
    """Lookup tables of a codebook format (fp4, nf4, fp8) on one device."""

    values: torch.Tensor  # fp32, ascending distinct finite values
    codes: torch.Tensor  # uint8, the code of each entry of ``values``
    by_code: torch.Tensor  # fp32, the value of every code 0..2**bits-1 (NaN for NaN codes)
    boundaries: torch.Tensor  # fp32, decision thresholds: value i+1 is chosen iff y > boundaries[i]
    byte_values: torch.Tensor  # fp32 [8 // bits, 256]: row i = value of the i-th code packed in a byte
    # Fast "how many entries are < y" (see count_below): per float8_e4m3fn cell of y, the count
    # below the cell, and each table followed by +inf.
    values_lut: torch.Tensor  # int32 [256]
    values_ext: torch.Tensor  # fp32 [len(values) + 1]
    boundaries_lut: torch.Tensor  # int32 [256]
    boundaries_ext: torch.Tensor  # fp32 [len(boundaries) + 1]


def _fp8_cells() -> tuple[torch.Tensor, torch.Tensor]:
    """For every float8_e4m3fn code: the smallest and largest fp32 value that casts to it."""
    by_code = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float()
    lo = torch.full((256,), math.nan)
    hi = torch.full((256,), math.nan)
    finite = torch.isfinite(by_code).nonzero().flatten()
    vals = by_code[finite]
    # Order by value, with -0 (code 128) just below +0 (code 0): the cast sends -0.0 and tiny
    # negatives to code 128, +0.0 and tiny positives to code 0.
    key = vals.double() - 1e-300 * (finite >= 128).double()
    order = torch.argsort(key)
    codes, vals = finite[order], vals[order]
    lo[codes[0]], hi[codes[-1]] = vals[0], vals[-1]
    for a, b, va, vb in zip(codes[:-1].tolist(), codes[1:].tolist(), vals[:-1].tolist(), vals[1:].tolist()):
        if va == vb:  # -0 | +0: the cast splits them by the sign bit of y
            hi[a], lo[b] = -0.0, 0.0
            continue
        m = torch.tensor((va + vb) / 2)  # exact: one more mantissa bit than E4M3
        to_b = int(m.to(torch.float8_e4m3fn).view(torch.uint8)) == b
        lo[b] = m if to_b else torch.nextafter(m, torch.tensor(math.inf))
        hi[a] = torch.nextafter(m, torch.tensor(-math.inf)) if to_b else m
    return lo, hi


def _count_lut(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per fp8 cell: entries of ``table`` below the cell, ``table`` + [inf]) for count_below."""
    lo, hi = _fp8_cells()
    ok = torch.isfinite(lo)
    lut = torch.searchsorted(table, torch.where(ok, lo, 0.0))
    inside = torch.searchsorted(table, torch.where(ok, hi, 0.0), right=True) - lut
    if bool((inside[ok] > 1).any()):
        # A static property of the tables (fp4/nf4 entries are >= 0.04 apart); checked, not assumed.
        raise RuntimeError("a float8 cell holds two table entries; count_below would be wrong")
    ext = torch.cat([table, torch.tensor([math.inf])])
    return torch.where(ok, lut, 0).to(torch.int32), ext


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table`` and an integer ``index`` of any shape.

    Under torch.compile the index keeps its shape: flattened, a [blocks, block] index whose block
    count is symbolic reached inductor as modular index arithmetic that left the whole loop scalar.
    Eagerly it is flattened for index_select, which torch runs faster on CPUs than indexing."""
    if torch.compiler.is_compiling():
        return table[index]
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def count_below(y: torch.Tensor, lut: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
    """int32 count of table entries strictly below each fp32 y (|y| <= 448), via a (lut, ext) pair.

    Casting y to float8_e4m3fn finds its cell; at most one entry lies in a cell, so one comparison
    finishes the count. Exact, and fewer passes than torch.searchsorted.
    """
    cell = y.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    count = lookup(lut, cell)
    return count.add_(y > lookup(ext, count))


def _ties_up(kind: str, values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """For each gap between neighbours: whether an exact midpoint goes to the upper value."""
    if kind == "nf4":
        # bitsandbytes' NF4 decision tree uses strict `x > midpoint`: ties go to the lower value.
        return torch.zeros(values.numel() - 1, dtype=torch.bool)
    # fp4 / fp8: round half to even (IEEE, OCP MX and torch's float8 cast): the even mantissa wins,
    # i.e. the neighbour whose code is even (sign bit aside).
    return codes[1:] % 2 == 0


@functools.lru_cache(maxsize=None)
def _tables_cpu(kind: str) -> CodebookTables:
    if kind == "fp4":
        # E2M1 bit layout (sign | 2-bit exponent | 1-bit mantissa, bias 1): codes 0..7 hold
        # 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same with a minus sign (8 is -0).
        mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        by_code = torch.cat([mags, -mags])
    elif kind == "nf4":
        # The code is the index in ascending order.
        by_code = torch.tensor(NF4_VALUES, dtype=torch.float32)
    elif kind == "fp8":
        # The code is the E4M3 bit pattern itself, so payloads are valid float8_e4m3fn tensors.
        by_code = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"{kind!r} has no codebook; codebook formats are fp4, nf4 and fp8")
    finite = torch.isfinite(by_code)
    codes = torch.arange(by_code.numel())[finite]
    vals = by_code[finite]
    # -0 duplicates +0: keep the first code of each distinct value (0, not 8/128), ascending.
    order = torch.argsort(vals + 0.0, stable=True)
    vals, codes = vals[order] + 0.0, codes[order]
    keep = torch.ones_like(vals, dtype=torch.bool)
    keep[1:] = vals[1:] != vals[:-1]
    vals, codes = vals[keep].contiguous(), codes[keep]
    # Midpoints are exact in fp32 for fp4/fp8 (one more mantissa bit than the format); a midpoint
    # whose tie goes up is lowered by one ulp, so the rule is the single test `y > boundary`.
    mids = ((vals[1:].double() + vals[:-1].double()) / 2).float()
    ties_up = _ties_up(kind, vals, codes)
    bounds = torch.where(ties_up, torch.nextafter(mids, torch.tensor(-float("inf"))), mids)
    bits = 8 if kind == "fp8" else 4
    per_byte = 8 // bits
    byte = torch.arange(256)
    byte_codes = torch.stack([(byte >> (bits * i)) & ((1 << bits) - 1) for i in range(per_byte)])
    values_lut, values_ext = _count_lut(vals)
    boundaries_lut, boundaries_ext = _count_lut(bounds)
    return CodebookTables(
        values=vals,
        codes=codes.to(torch.uint8).contiguous(),
        by_code=by_code.contiguous(),
        boundaries=bounds.contiguous(),
        byte_values=by_code[byte_codes].contiguous(),
        values_lut=values_lut,
        values_ext=values_ext,
        boundaries_lut=boundaries_lut,
        boundaries_ext=boundaries_ext,
    )


@functools.lru_cache(maxsize=None)
def _tables_on(kind: str, device: str) -> CodebookTables:
    t = _tables_cpu(kind)
    return CodebookTables(*(getattr(t, f).to(device) for f in t.__dataclass_fields__))


def codebook_tables(kind: str, device: torch.device | str = "cpu") -> CodebookTables:
    """The lookup tables of a codebook format (fp4, nf4 or fp8) on ``device``."""
    return _tables_on(kind, str(torch.device(device)))


def stored_row(width: int, block: int) -> int:
    """Values stored per row (last dimension) of a tensor of two or more dimensions: ``width``
    rounded up to whole blocks, the tail zero-padded.

    A block never spans two rows. Rows are tokens, and token norms can differ 50x or more: a block
    shared by a large and a small token gets the large one's scale, the small one's codes round to
    zero, and a norm recomputed from them divides by about sqrt(eps). The cost is at most one
    block's tail per row, and nothing where the width is whole blocks (1-D tensors, such as
    gradient buffers, are one run of blocks as before).
    """
    return round_up(width, block)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a whole number of ``multiple`` (blocks, packing groups, rank shares)."""
    return -(-n // multiple) * multiple
