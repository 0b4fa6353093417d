"""Physical bit packing: n codes of b bits occupy exactly ceil(n * b / 8) bytes.

Codes are packed little-endian: code i occupies bits [i*b, (i+1)*b) of the byte stream, lowest
bit first. Codes are packed in groups of g = 8 / gcd(b, 8) values, which fill g*b/8 whole bytes
(b=4: 2 codes per byte; b=6: 4 codes in 3 bytes; b=3 or 5: 8 codes in 3 or 5 bytes), so the work is
a handful of vectorized shifts on a [groups, g] view, with no loop over elements.
"""

from __future__ import annotations

import math

import torch


def _group(bits: int) -> tuple[int, int]:
    """(codes per group, bytes per group) for a bit width."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bit width must be in 1..8, got {bits}")
    g = 8 // math.gcd(bits, 8)
    return g, g * bits // 8


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy: ceil(numel * bits / 8)."""
    return (numel * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes (each < 2**bits) into ceil(n * bits / 8) bytes."""
    n = codes.numel()
    if bits == 8:
        return codes.reshape(-1).to(torch.uint8)
    g, gbytes = _group(bits)
    groups = (n + g - 1) // g
    word_dtype = torch.int32 if g * bits <= 24 else torch.int64
    flat = codes.reshape(-1)
    if groups * g != n:
        flat = torch.nn.functional.pad(flat, (0, groups * g - n))
    c = flat.view(groups, g).to(word_dtype)
    if gbytes == 1:
        # b in {1, 2, 4}: all codes of a group fit one byte.
        word = c[:, 0]
        for i in range(1, g):
            word = word | (c[:, i] << (bits * i))
        return word.to(torch.uint8)[: packed_nbytes(n, bits)]
    word = c[:, 0]
    for i in range(1, g):
        word = word | (c[:, i] << (bits * i))
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(gbytes)], dim=1).to(torch.uint8)
    return out.reshape(-1)[: packed_nbytes(n, bits)]


def unpack(payload: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes as a 1-D uint8 tensor."""
    if payload.numel() != packed_nbytes(numel, bits):
        raise ValueError(
            f"payload has {payload.numel()} bytes but {numel} codes of {bits} bits need "
            f"{packed_nbytes(numel, bits)}; the quantized tensor is truncated or mismatched"
        )
    if bits == 8:
        return payload.reshape(-1)
    g, gbytes = _group(bits)
    groups = (numel + g - 1) // g
    word_dtype = torch.int32 if g * bits <= 24 else torch.int64
    flat = payload.reshape(-1)
    if groups * gbytes != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, groups * gbytes - flat.numel()))
    b = flat.view(groups, gbytes).to(word_dtype)
    word = b[:, 0]
    for j in range(1, gbytes):
        word = word | (b[:, j] << (8 * j))
    mask = (1 << bits) - 1
    codes = torch.stack([(word >> (bits * i)) & mask for i in range(g)], dim=1).to(torch.uint8)
    return codes.reshape(-1)[:numel]
