"""The operations of a decoder layer whose saved tensors a policy controls.

With ``fmt=None`` each op is the bf16 baseline (what Megatron-LM's modules save). With a format,
the fused LAAQ variants store the named tensor quantized and recompute what follows it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from agoq.quant import QuantFormat


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics, output in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rms_norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weights: Sequence[torch.Tensor], fmt: QuantFormat | None
) -> tuple[torch.Tensor, ...]:
    """RMSNorm(x) times each weight (transposed); with fmt, saves only quantized x."""
    h = rms_norm(x, norm_weight, eps)
    return tuple(F.linear(h, w) for w in weights)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor, fmt: QuantFormat | None) -> torch.Tensor:
    """(SiLU(gate) * up) times down_weight (transposed); with fmt, saves only quantized gate/up."""
    return F.linear(F.silu(gate) * up, down_weight)


def saved_input_linear(x: torch.Tensor, weight: torch.Tensor, fmt: QuantFormat | None) -> torch.Tensor:
    """x times weight (transposed); with fmt, saves x quantized for the weight gradient."""
    return F.linear(x, weight)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: QuantFormat | None) -> torch.Tensor:
    """Causal grouped-query SDPA on [batch, heads, seq, head_dim]; with fmt, saved tensors are quantized."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
