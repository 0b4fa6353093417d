"""LoRA adapters inside the fused ops: y = x W^T + s * dropout(x) A^T B^T, with nothing extra saved
but a dropout mask packed at 1 bit per element.

The fused ops (:mod:`agoq.activation.ops`) never keep the GEMM input x: they recompute it (norm +
linear, SwiGLU + linear) or keep it at 4 bits (saved-input linear). An adapter on such a GEMM reads
the same x, so its backward reads the recomputed or dequantized x too; A x ([tokens, r]) is
recomputed as well. The dropout mask is drawn as ``nn.Dropout`` draws it on a CPU (``bernoulli_(1 -
p)`` over the input's shape and dtype, then divided by ``1 - p``), so the same RNG state gives PEFT's
mask bit for bit, and the adapter's output equals PEFT's.

A base weight may be a bitsandbytes 4-bit parameter (QLoRA): :func:`dense_weight` dequantizes it
for one GEMM, in forward and again in backward; the dense copy is never saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class LoraAdapter:
    """One low-rank update ``scale * dropout(x) A^T B^T`` on a projection (PEFT's LoRA ``Linear``)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float
    dropout: float = 0.0


def dense_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in dtype; a bitsandbytes 4-bit weight (a ``quant_state`` attached) dequantized first."""
    state = getattr(w, "quant_state", None)
    if state is None:
        return w if w.dtype == dtype else w.to(dtype)
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(w, state).to(dtype)


def out_features(w: torch.Tensor) -> int:
    """Rows of the weight as a GEMM sees it (a 4-bit weight's packed shape is not its own)."""
    state = getattr(w, "quant_state", None)
    return int(state.shape[0]) if state is not None else int(w.shape[0])


def pack_mask(keep: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 bytes, 8 elements per byte (element i is bit i % 8 of byte i // 8)."""
    flat = keep.reshape(-1).view(torch.uint8)  # a bool is one byte, 0 or 1: read in place
    if flat.numel() % 8:
        flat = F.pad(flat, (0, -flat.numel() % 8))
    weights = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=keep.device)
    return (flat.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Elements start .. start + count of a mask :func:`pack_mask` packed, as bool."""
    first, last = start // 8, -(-(start + count) // 8)
    weights = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=packed.device)
    bits = (packed[first:last, None] & weights) != 0
    offset = start - first * 8
    return bits.reshape(-1)[offset : offset + count]


def dropout_scale(packed: torch.Tensor, p: float, start: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start .. start + rows of the [tokens, width] dropout multiplier (0 or 1 / (1 - p)), as dropout made it."""
    keep = unpack_mask(packed, start * width, rows * width).view(rows, width)
    return keep.to(dtype).div_(1 - p)  # the same rounding of 1 / (1 - p) as dropout's noise.div_(1 - p)


def lora_forward(x: torch.Tensor, adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """(the adapter's output ``B(A(dropout(x))) * scale`` in x's dtype, the packed dropout mask or an empty one)."""
    xa = x if x.dtype == adapter.a.dtype else x.to(adapter.a.dtype)
    packed = x.new_empty(0, dtype=torch.uint8)
    if adapter.dropout > 0:
        # What F.dropout does on a CPU (and nn.Dropout in PEFT): draw bernoulli(1 - p) over x's
        # shape and dtype, divide by 1 - p, multiply. The same draws from the same RNG state.
        noise = torch.empty_like(xa).bernoulli_(1 - adapter.dropout).div_(1 - adapter.dropout)
        packed = pack_mask(noise != 0)
        xa = xa * noise
        del noise
    return (F.linear(F.linear(xa, adapter.a), adapter.b) * adapter.scale).to(x.dtype), packed


def lora_grad_a_input(grad_out: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
    """The gradient of ``A dropout(x)``, [tokens, r]: ``scale * grad_out B``."""
    g = _tokens(grad_out).to(adapter.b.dtype)
    return F.linear(g * adapter.scale, adapter.b.t())


def lora_input_grad(grad_a_input: torch.Tensor, adapter: LoraAdapter, packed: torch.Tensor, r0: int, r1: int, width: int) -> torch.Tensor:
    """Rows r0 .. r1 of the gradient the adapter sends to x, fp32, [r1 - r0, width]."""
    g = F.linear(grad_a_input[r0:r1], adapter.a.t()).float()
    if adapter.dropout > 0:
        g.mul_(dropout_scale(packed, adapter.dropout, r0, r1 - r0, width, adapter.a.dtype))
    return g


def lora_weight_grads(
    grad_out: torch.Tensor, grad_a_input: torch.Tensor, x: torch.Tensor, adapter: LoraAdapter, packed: torch.Tensor, need_a: bool, need_b: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad of A, grad of B) or None where not needed, from x as forward saw it (recomputed or dequantized)."""
    if not (need_a or need_b):
        return None, None
    xt = _tokens(x).to(adapter.a.dtype)
    if adapter.dropout > 0:
        xt = xt * dropout_scale(packed, adapter.dropout, 0, xt.shape[0], xt.shape[1], xt.dtype)
    grad_a = grad_a_input.t().mm(xt) if need_a else None
    grad_b = None
    if need_b:
        g = _tokens(grad_out).to(adapter.b.dtype) * adapter.scale
        grad_b = g.t().mm(F.linear(xt, adapter.a))
    return grad_a, grad_b


def _tokens(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])
