"""Physical bit packing: n codes of b bits occupy exactly ceil(n * b / 8) bytes.

Codes are packed little-endian: code i occupies bits [i*b, (i+1)*b) of the byte stream, lowest
bit first. Codes are packed in groups of g = 8 / gcd(b, 8) values, which fill g*b/8 whole bytes
(b=4: 2 codes per byte; b=6: 4 codes in 3 bytes; b=3 or 5: 8 codes in 3 or 5 bytes).

The work is SIMD-within-a-register: the g one-byte codes of a group are viewed as one g-byte
integer word, and log2(g) shift/mask/or steps halve the gaps between codes until they are
contiguous (unpacking runs the steps backwards). Every step is one vectorized pass over contiguous
words; nothing is widened to int64 per code and nothing loops over elements.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

# Word views rely on the byte order; every platform torch ships for is little-endian.
if sys.byteorder != "little":
    raise ImportError("agoq.quant.packing assumes a little-endian machine")

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def packing_group(bits: int) -> tuple[int, int]:
    """(codes per group, bytes per group) for a bit width: the smallest run that fills whole bytes."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bit width must be an integer in 1..8, got {bits!r}")
    g = 8 // math.gcd(bits, 8)
    return g, g * bits // 8


# Cached for the eager path; torch.compile'd code calls packing_group (it does not trace caches).
group_shape = functools.lru_cache(maxsize=None)(packing_group)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy: ceil(numel * bits / 8)."""
    return (numel * bits + 7) // 8


def _repeat(pattern: int, period: int, word_bits: int) -> int:
    """``pattern`` repeated every ``period`` bits across a word, as the word's signed integer."""
    v = sum(pattern << (period * k) for k in range(word_bits // period))
    return v - (1 << word_bits) if v >= 1 << (word_bits - 1) else v


@functools.lru_cache(maxsize=None)
def _steps(bits: int) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """Per step: (shift, low-lane mask, packed high-lane mask, unpacked high-lane mask, packed mask,
    unpacked mask).

    Step k joins lanes of L = 8 * 2**k bits that hold w = bits * 2**k bits each into lanes of 2L
    bits holding 2w: the high lane moves down by L - w.
    """
    g, _ = group_shape(bits)
    word_bits, lane, width, steps = 8 * g, 8, bits, []
    while lane < word_bits:
        m = (1 << width) - 1
        steps.append(
            (
                lane - width,
                _repeat(m, 2 * lane, word_bits),
                _repeat(m << width, 2 * lane, word_bits),
                _repeat(m << lane, 2 * lane, word_bits),
                _repeat((1 << 2 * width) - 1, 2 * lane, word_bits),
                _repeat(m, lane, word_bits),
            )
        )
        lane, width = 2 * lane, 2 * width
    return tuple(steps)


def pack_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack contiguous uint8 codes (each < 2**bits, count a multiple of the group) into uint8 ``out``."""
    g, gbytes = group_shape(bits)
    if bits == 8:
        out.copy_(codes.reshape(-1))
        return
    w = codes.reshape(-1).view(_WORD[g])
    for shift, lo, hi, _, joined, _ in _steps(bits):
        # Arithmetic right shifts are harmless: the masks drop every copied sign bit. Each step
        # writes into the one tensor its shift made (not a tensor per operator).
        shifted = w >> shift
        if bits <= 4:  # 2w <= L: the high lane's old copy lies outside the joined bits, one mask will do
            w = shifted.bitwise_or_(w).bitwise_and_(joined)
        else:
            w = shifted.bitwise_and_(hi).bitwise_or_(w & lo)
    if gbytes == 1:
        out.copy_(w)  # the packed byte is the low byte: a truncating cast
    else:
        out.view(-1, gbytes).copy_(w.view(torch.uint8).view(-1, g)[:, :gbytes])


def _word_dtype(gbytes: int) -> torch.dtype:
    """The integer that holds one group's bits: its byte itself, else the narrowest signed word wide enough."""
    return torch.uint8 if gbytes == 1 else torch.int32 if gbytes < 4 else torch.int64


def _join_lanes(lanes: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., k] lanes of ``width`` bits each, lowest first, as one ``dtype`` integer [...]: the sum of
    their disjoint bit fields."""
    shifts = torch.arange(0, lanes.shape[-1] * width, width, device=lanes.device, dtype=dtype)
    return (lanes.to(dtype) << shifts).sum(-1, dtype=dtype)


def _split_word(word: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """:func:`_join_lanes` undone: ``count`` uint8 lanes of ``width`` bits of each integer of
    ``word`` [..., n], lowest first, as [..., n * count]."""
    shifts = torch.arange(0, count * width, width, device=word.device, dtype=word.dtype)
    return ((word.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).to(torch.uint8).flatten(-2)


def pack_groups(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The payload of one-byte ``codes`` [..., n] (n whole groups) as uint8 [..., n * bits / 8]: the
    layout of :func:`pack_into`, computed per group by shifts into one integer, a form torch.compile
    fuses into the loop that makes the codes (the SWAR steps' dtype views it cannot)."""
    if bits == 8:
        return codes
    g, gbytes = packing_group(bits)
    return _split_word(_join_lanes(codes.unflatten(-1, (-1, g)), bits, _word_dtype(gbytes)), gbytes, 8)


def unpack_groups(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """The one-byte codes of ``payload`` [..., bytes] (whole groups) as uint8 [..., bytes * 8 / bits]:
    :func:`pack_groups` undone, for the loop that reads the codes to fuse it."""
    if bits == 8:
        return payload
    g, gbytes = packing_group(bits)
    return _split_word(_join_lanes(payload.unflatten(-1, (-1, gbytes)), 8, _word_dtype(gbytes)), g, bits)


def unpack_into(payload: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Unpack whole groups of ``bits``-bit codes from contiguous uint8 ``payload`` into ``out`` (any dtype)."""
    g, gbytes = group_shape(bits)
    if bits == 8:
        out.copy_(payload.reshape(out.shape))
        return
    if gbytes == 1:
        w = payload.reshape(-1).to(_WORD[g])
    else:
        words = torch.zeros(payload.numel() // gbytes, g, dtype=torch.uint8, device=payload.device)
        words[:, :gbytes] = payload.view(-1, gbytes)
        w = words.view(_WORD[g]).view(-1)
    for shift, lo, _, hi, _, split in reversed(_steps(bits)):
        if bits <= 4:  # w <= L / 2: the shifted copy of the low lane lands in masked-off bits
            w = (w | (w << shift)) & split
        else:
            w = (w & lo) | ((w << shift) & hi)
    out.copy_(w.view(torch.uint8).view(out.shape))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes (each < 2**bits) into ceil(n * bits / 8) bytes."""
    g, gbytes = group_shape(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack expects uint8 codes, got {codes.dtype}; convert with .to(torch.uint8)")
    flat = codes.reshape(-1)
    n = flat.numel()
    if n and bits < 8 and int(flat.max()) >= 1 << bits:
        raise ValueError(f"code {int(flat.max())} does not fit in {bits} bits (max {(1 << bits) - 1}); mask the codes or pick a wider format")
    groups = -(-n // g)
    flat = torch.nn.functional.pad(flat, (0, groups * g - n)) if groups * g != n else flat.contiguous()
    out = torch.empty(groups * gbytes, dtype=torch.uint8, device=codes.device)
    pack_into(flat, bits, out)
    return out[: packed_nbytes(n, bits)]


def unpack(payload: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes as a 1-D uint8 tensor."""
    g, gbytes = group_shape(bits)
    if payload.dtype != torch.uint8 or payload.numel() != packed_nbytes(numel, bits):
        raise ValueError(
            f"payload is {payload.numel()} {payload.dtype} values but {numel} codes of {bits} bits "
            f"need {packed_nbytes(numel, bits)} uint8 bytes; the quantized tensor is truncated or mismatched"
        )
    groups = -(-numel // g)
    flat = payload.reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, groups * gbytes - flat.numel())) if groups * gbytes != flat.numel() else flat.contiguous()
    out = torch.empty(groups * g, dtype=torch.uint8, device=payload.device)
    unpack_into(flat, bits, out)
    return out[:numel]
