"""A tensor- and sequence-parallel copy of agoq's :class:`~agoq.models.llama.Llama` (Megatron-LM layout).

``shard_llama(model, group)`` returns a :class:`TensorParallelLlama` whose parameters are this
rank's shards of the full model's, under the same names (so gathered state dicts are the full
model's): q/k/v and gate/up are column-parallel (heads, kv heads and the intermediate split over
tp), o and down row-parallel, the embedding and LM head vocab-parallel; the norm weights are
replicated and the residual stream and norms sequence-parallel (each rank holds seq / tp tokens).
Its ``forward(tokens, targets)`` is the full model's loss on every rank.

What each rank keeps for backward under a LAAQ policy (``ActivationPolicy.layer(i)``, as
:class:`~agoq.models.llama.DecoderLayer` reads it): the 4-bit copy of its sequence shard of each
norm input (1/tp), 4-bit gate and up of its intermediate shard (1/tp), and the attention core of
its head shard (1/tp), so a layer's saved bytes are 1/tp of tp = 1's.

The norm weights' gradients are partial per rank (each rank normalises its own tokens): their sum
over tp is the full gradient (:func:`gather_gradients` sums them; a trainer must all-reduce them over
tp before the optimizer, as Megatron does for sequence-parallel parameters).

The loss is always the vocab-parallel chunked one, which keeps no logits, whatever
``policy.fused_loss`` says: there is no plain-logits vocab-parallel path (it would keep
[tokens, vocab / tp] fp32 log-probs per rank).

Integration that remains (issue R2-E): a (pp, dp, tp) mesh in ``parallel.pipeline.make_mesh``, the
trainer building these modules per stage (pipeline slices: layers without embed or head) with the
tp all-reduce of the norm gradients, QuanGrad and ZeRO-1 over the dp group only (tp shards are
distinct parameters), checkpoints saving shards or gathering them (:func:`gather_state_dict`), the
planner's per-rank bytes at tp > 1, activation checkpointing (``Llama.recompute``), tied embeddings
under a trainer, and the tp bytes of :class:`~agoq.gradient.counter.CommCounter` in the run summary.
Performance work left: the collectives are synchronous (no overlap with the GEMMs), the fused
norm's backward is not row-chunked as ``activation.ops._NormLinear``'s is, and the sequence-parallel
norm uses the eager formulas (not the compiled or Triton ones of :mod:`agoq.quant.backend`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.activation import ActivationPolicy, causal_attention, rms_norm, rotary_embedding, saved_input_linear, swiglu_linear
from agoq.gradient.counter import COMM_COUNTER, CommCounter
from agoq.models.config import LlamaConfig
from agoq.models.llama import IGNORE_INDEX, Llama, RMSNorm, rope_tables
from agoq.parallel.tensor_ops import gather_seq, scatter_seq, sp_rms_norm_linear, tp_size, vocab_parallel_cross_entropy, vocab_parallel_embedding

Group = Any

# Parameter name suffix -> the dimension split over tp (None: replicated on every tp rank).
_SPLIT_DIMS = {
    "embed.weight": 0,
    "head.weight": 0,
    "attn.q.weight": 0,
    "attn.k.weight": 0,
    "attn.v.weight": 0,
    "attn.o.weight": 1,
    "mlp.gate.weight": 0,
    "mlp.up.weight": 0,
    "mlp.down.weight": 1,
    "norm.weight": None,  # attn_norm, mlp_norm and the final norm
}


def split_dim(name: str) -> int | None:
    """The dimension of parameter ``name`` split over tp, or None if every tp rank holds all of it."""
    for suffix, dim in _SPLIT_DIMS.items():
        if name.endswith(suffix):
            return dim
    raise KeyError(f"no tensor-parallel layout for parameter {name!r}")


def check_tp_shapes(cfg: LlamaConfig, tp: int) -> None:
    """Raise a one-line ValueError if heads, kv heads, the intermediate size or the vocab do not split over tp."""
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        raise ValueError(
            f"tensor parallelism splits attention heads: n_heads={cfg.n_heads} and n_kv_heads={cfg.n_kv_heads} must both be divisible by tp={tp}"
        )
    if cfg.intermediate % tp:
        raise ValueError(f"tensor parallelism splits the MLP: intermediate={cfg.intermediate} must be divisible by tp={tp}")
    if cfg.vocab_size % tp:
        # Refused, not padded: padding rows would change the parameter shapes a checkpoint holds.
        raise ValueError(
            f"tensor parallelism splits the vocabulary: vocab_size={cfg.vocab_size} must be divisible by tp={tp}; pad the tokenizer's vocab"
        )


def _shard(t: torch.Tensor, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    if dim is None:
        return t.detach().clone()
    return t.detach().chunk(tp, dim=dim)[rank].clone()


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def _holder(**linears: nn.Linear) -> nn.Module:
    module = nn.Module()
    for name, lin in linears.items():
        setattr(module, name, lin)
    return module


def _norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


class TensorParallelDecoderLayer(nn.Module):
    """One decoder layer's tp shard: sequence-parallel norms and residual, column-parallel q/k/v and
    gate/up, row-parallel o and down (``DecoderLayer.forward`` with the tp collectives inserted)."""

    def __init__(self, cfg: LlamaConfig, index: int, shards: dict[str, torch.Tensor], tp: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        self.n_heads, self.n_kv_heads = cfg.n_heads // tp, cfg.n_kv_heads // tp
        self.attn_norm = _norm(shards["attn_norm.weight"], cfg.norm_eps)
        self.attn = _holder(**{n: _linear(shards[f"attn.{n}.weight"]) for n in ("q", "k", "v", "o")})
        self.mlp_norm = _norm(shards["mlp_norm.weight"], cfg.norm_eps)
        self.mlp = _holder(**{n: _linear(shards[f"mlp.{n}.weight"]) for n in ("gate", "up", "down")})

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, policy: ActivationPolicy, group: Group, counter: CommCounter
    ) -> torch.Tensor:
        cfg, p, hd = self.cfg, policy.layer(self.index), self.cfg.head_dim
        a, m = self.attn, self.mlp
        b = x.shape[0]
        q, k, v = sp_rms_norm_linear(x, self.attn_norm.weight, cfg.norm_eps, (a.q.weight, a.k.weight, a.v.weight), p.norm_input, group, counter)
        s = q.shape[1]  # the whole sequence: gathered
        q = rotary_embedding(q.view(b, s, self.n_heads, hd).transpose(1, 2), cos, sin)
        k = rotary_embedding(k.view(b, s, self.n_kv_heads, hd).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.n_kv_heads, hd).transpose(1, 2)
        o = causal_attention(q, k, v, p.attention).transpose(1, 2).reshape(b, s, self.n_heads * hd)
        x = x + scatter_seq(saved_input_linear(o, a.o.weight, p.out_proj_input), group, counter)
        gate, up = sp_rms_norm_linear(x, self.mlp_norm.weight, cfg.norm_eps, (m.gate.weight, m.up.weight), p.norm_input, group, counter)
        return x + scatter_seq(swiglu_linear(gate, up, m.down.weight, p.act_input), group, counter)


class TensorParallelLlama(nn.Module):
    """This rank's tp shard of a whole :class:`Llama` (embedding, every layer, final norm, LM head)."""

    def __init__(self, model: Llama, group: Group, counter: CommCounter | None = None) -> None:
        super().__init__()
        cfg = model.cfg
        if not (model.has_embed and model.has_head and len(model.layer_range) == cfg.n_layers):
            raise ValueError("shard_llama takes a whole model (embedding, every layer, head); pipeline stages are not supported yet")
        self.tp, self.rank = tp_size(group), dist.get_rank(group)
        check_tp_shapes(cfg, self.tp)
        self.cfg, self.policy, self.group = cfg, model.policy, group
        self.counter = COMM_COUNTER if counter is None else counter
        full = dict(model.named_parameters())
        shards = {name: _shard(t, split_dim(name), self.rank, self.tp) for name, t in full.items()}
        self.vocab_start = self.rank * cfg.vocab_size // self.tp
        self.embed = nn.Embedding(cfg.vocab_size // self.tp, cfg.hidden, device=shards["embed.weight"].device, dtype=shards["embed.weight"].dtype)
        with torch.no_grad():
            self.embed.weight.copy_(shards["embed.weight"])
        self.layers = nn.ModuleDict(
            {
                str(i): TensorParallelDecoderLayer(
                    cfg, i, {n[len(f"layers.{i}.") :]: t for n, t in shards.items() if n.startswith(f"layers.{i}.")}, self.tp
                )
                for i in model.layer_range
            }
        )
        self.norm = _norm(shards["norm.weight"], cfg.norm_eps)
        self.head = _linear(shards["embed.weight" if cfg.tie_embeddings else "head.weight"])
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def set_policy(self, policy: ActivationPolicy) -> None:
        """Switch the activation precision policy (takes effect on the next forward)."""
        self.policy = policy

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of tokens [batch, seq] (the same on every tp rank; seq divisible by tp)."""
        b, s = tokens.shape
        if s % self.tp:
            raise ValueError(f"sequence parallelism splits the sequence: length {s} must be divisible by tp={self.tp}")
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={self.cfg.max_seq_len}; raise it in the model config")
        cos, sin = rope_tables(self.cfg, s, tokens.device)
        x = vocab_parallel_embedding(tokens, self.embed.weight, self.vocab_start, self.group, self.counter)
        for layer in self.layers.values():
            x = layer(x, cos, sin, self.policy, self.group, self.counter)
        h = gather_seq(rms_norm(x, self.norm.weight, self.cfg.norm_eps), self.group, self.counter)
        return vocab_parallel_cross_entropy(h, self.head.weight, targets, self.vocab_start, self.group, self.counter, ignore_index=IGNORE_INDEX)


def shard_llama(model: Llama, group: Group, counter: CommCounter | None = None) -> TensorParallelLlama:
    """This rank's tensor/sequence-parallel shard of ``model`` on the tp group ``group`` (same
    parameter names, values copied); its collectives record bytes in ``counter`` (default: the global one)."""
    return TensorParallelLlama(model, group, counter)


def _gather_full(name: str, t: torch.Tensor, group: Group) -> torch.Tensor:
    """The full tensor of one parameter-shaped shard: concatenated along its split dim, or summed if replicated."""
    dim = split_dim(name)
    t = t.detach().contiguous()
    if dim is None:
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out
    parts = [torch.empty_like(t) for _ in range(tp_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def gather_gradients(model: TensorParallelLlama) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at the full model's shape, by name: shards concatenated, and the
    replicated norm weights' partial gradients summed over tp once (a parameter without a gradient
    counts as zeros). Every tp rank must call it; all get the same result."""
    return {name: _gather_full(name, p.grad if p.grad is not None else torch.zeros_like(p), model.group) for name, p in model.named_parameters()}


def gather_state_dict(model: TensorParallelLlama) -> dict[str, torch.Tensor]:
    """The full model's parameters by name (replicated ones taken as this rank holds them)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone() if split_dim(name) is None else _gather_full(name, p, model.group)
    return out
