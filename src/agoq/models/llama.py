"""A LLaMA decoder whose saved activations follow an :class:`ActivationPolicy`.

One class serves the whole model and every pipeline stage: ``Llama(cfg, layers=range(a, b),
embed=..., head=...)`` builds only the given consecutive decoder layers, keyed by their global
index, so a stage's state dict uses the same names as the full model's.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from agoq.activation import (
    ActivationPolicy,
    causal_attention,
    make_policy,
    rms_norm,
    rms_norm_linear,
    rotary_embedding,
    saved_input_linear,
    swiglu_linear,
)
from agoq.activation.checkpoint import checkpoint_layer
from agoq.models.config import LlamaConfig

IGNORE_INDEX = -100


def rope_tables(cfg: LlamaConfig, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] in fp32 (halves repeated, as Hugging Face lays them out)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32, device=device) / half))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by position (the rotate-half convention of HF LLaMA)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm weight holder; the computation lives in the policy-aware ops."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention projections."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        kv = cfg.n_kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k = nn.Linear(cfg.hidden, kv, bias=False)
        self.v = nn.Linear(cfg.hidden, kv, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)


class MLP(nn.Module):
    """SwiGLU feed-forward projections."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block; which tensors it saves is decided by the policy."""

    def __init__(self, cfg: LlamaConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, policy: ActivationPolicy) -> torch.Tensor:
        cfg, p = self.cfg, policy.layer(self.index)
        b, s, _ = x.shape
        a = self.attn
        q, k, v = rms_norm_linear(x, self.attn_norm.weight, cfg.norm_eps, (a.q.weight, a.k.weight, a.v.weight), p.norm_input)
        q = rotary_embedding(q.view(b, s, cfg.n_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        k = rotary_embedding(k.view(b, s, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, s, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        o = causal_attention(q, k, v, p.attention).transpose(1, 2).reshape(b, s, cfg.hidden)
        x = x + saved_input_linear(o, a.o.weight, p.out_proj_input, attention_output=p.attention is None)
        m = self.mlp
        gate, up = rms_norm_linear(x, self.mlp_norm.weight, cfg.norm_eps, (m.gate.weight, m.up.weight), p.norm_input)
        return x + swiglu_linear(gate, up, m.down.weight, p.act_input)


class Llama(nn.Module):
    """A LLaMA decoder, or a consecutive slice of it (a pipeline stage).

    ``layers`` selects the decoder layers this module holds (default: all); ``embed`` and ``head``
    say whether it holds the token embedding (first stage) and the final norm + LM head (last).
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        policy: ActivationPolicy | None = None,
        layers: range | None = None,
        embed: bool | None = None,
        head: bool | None = None,
    ) -> None:
        super().__init__()
        layers = range(cfg.n_layers) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > cfg.n_layers or len(layers) == 0:
            raise ValueError(f"layers must be a non-empty consecutive range within 0..{cfg.n_layers}, got {layers}")
        self.cfg = cfg
        self.policy = policy or make_policy("bf16")
        self.layer_range = layers
        self.has_embed = layers.start == 0 if embed is None else embed
        self.has_head = layers.stop == cfg.n_layers if head is None else head
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden) if self.has_embed else None
        # Keyed by global index so stage state dicts use the full model's names.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layers})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if self.has_head else None
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False) if self.has_head else None
        if cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # Global indices of layers run under activation checkpointing (recomputed in backward).
        self.recompute: set[int] = set()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Initialise weights: N(0, 0.02), residual outputs scaled by 1/sqrt(2 * n_layers).

        Each parameter draws from a generator seeded by (seed, its global name), so a pipeline
        stage gets exactly the weights the same layers have in the full model.
        """
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("attn.o.weight", "mlp.down.weight")) else 0.02
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def compile_layers(self, **options: Any) -> None:
        """torch.compile each decoder layer in place with fullgraph=True (parameter names unchanged)."""
        # Per block, as torchtitan compiles: the layers share one graph (their parameters are its
        # inputs), and the embedding, rope tables and loss stay eager around them.
        for layer in self.layers.values():
            layer.compile(fullgraph=True, **options)

    def set_policy(self, policy: ActivationPolicy) -> None:
        """Switch the activation precision policy (takes effect on the next forward)."""
        self.policy = policy

    def _rope_for(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._rope:
            if seq_len > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seq_len} exceeds model.max_seq_len={self.cfg.max_seq_len}; raise it in the model config")
            self._rope[key] = rope_tables(self.cfg, seq_len, device)
        return self._rope[key]

    def hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states after this module's layers (and final norm)."""
        if self.embed is not None:
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"the first stage takes token ids (int64), got {x.dtype}")
            x = self.embed(x)
        cos, sin = self._rope_for(x.shape[1], x.device)
        for layer in self.layers.values():
            if layer.index in self.recompute and torch.is_grad_enabled():
                # Keeps only the layer input (in the policy's checkpoint format where it has one);
                # the whole layer runs again in backward.
                if self.policy.checkpoint_input is not None:
                    run = functools.partial(layer, cos=cos, sin=sin, policy=self.policy)
                    x = checkpoint_layer(run, x, self.policy.checkpoint_input, layer.parameters())
                else:
                    x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, self.policy, use_reentrant=False)
            else:
                x = layer(x, cos, sin, self.policy)
        if self.norm is not None:
            x = self.norm(x)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits of final (normed) hidden states."""
        if self.head is None:
            raise RuntimeError("this module is not the last pipeline stage: it has no LM head")
        return self.head(hidden)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, divisor: int = 1, weight_grad_in_forward: bool = True) -> torch.Tensor:
        """Mean next-token cross-entropy of final hidden states, divided by ``divisor`` (micro-batches
        averaged); the fused chunked path under fused_loss, which hands the head's gradient over in
        forward where the policy says so and ``weight_grad_in_forward`` allows it."""
        if self.head is None:
            raise RuntimeError("this module is not the last pipeline stage: it has no LM head")
        if self.policy.fused_loss:
            from agoq.activation.loss import chunked_lm_head_cross_entropy

            return chunked_lm_head_cross_entropy(
                hidden,
                self.head.weight,
                targets,
                ignore_index=IGNORE_INDEX,
                recompute=self.policy._loss_recompute,
                weight_grad_in_forward=self.policy._loss_weight_grad_in_forward and weight_grad_in_forward,
                divisor=divisor,
            )
        logits = self.head(hidden)
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)
        return loss if divisor == 1 else loss / divisor

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (inner stage), logits (last stage), or the loss when targets are given."""
        h = self.hidden_states(x)
        if self.head is None:
            return h
        if targets is not None:
            return self.loss(h, targets)
        return self.logits(h)
