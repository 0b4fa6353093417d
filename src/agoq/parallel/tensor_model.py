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

The norm weights' gradients are partial per rank (each rank normalises its own tokens): backward
sums them over tp (``tensor_ops.replicated``), so every tp rank holds the full, identical gradient
before any gradient hook folds it, and a data-parallel sync over dp alone completes it.

The loss is always the sequence- and vocab-parallel chunked one, which keeps no logits, whatever
``policy.fused_loss`` says: there is no plain-logits vocab-parallel path (it would keep
[tokens, vocab / tp] fp32 log-probs per rank).

``agoq train --parallel.tp`` builds one of these per pipeline stage (agoq.launch.components); checkpoint
names carry the shard (:func:`shard_name`). Not supported: activation checkpointing
(``Llama.recompute``). ``compile_layers`` compiles each decoder layer with ``fullgraph=True``, as
``Llama.compile_layers`` does: the tp ops are custom ops that take the group and the byte counter
by name (:func:`agoq.parallel.tensor_ops.register_group`, ``register_counter``). Performance work
left: the collectives are synchronous (no overlap with the GEMMs), the sequence-parallel norm's
backward is not row-chunked as the ``agoq::norm_linear`` op's is, and it uses the eager formulas
(not the compiled or Triton ones of :mod:`agoq.quant.backend`).
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
from agoq.parallel.tensor_ops import (
    register_counter,
    register_group,
    replicated,
    scatter_seq,
    sp_rms_norm_linear,
    tp_size,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

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


def shard_name(name: str, rank: int, tp: int) -> str:
    """The checkpoint name of tp rank ``rank``'s shard of parameter ``name``: every parameter of a
    tp run is named per shard, replicated ones too, so that no two tp ranks write one key (ZeRO-1
    names a bucket after its first parameter, which may be a norm weight) and a change of tp shows
    key by key."""
    return f"{name}@tp{rank}of{tp}"


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, policy: ActivationPolicy, group: str, counter: str) -> torch.Tensor:
        """This rank's sequence shard after the layer; ``group`` and ``counter`` are the registered
        names of the tp group and the byte counter (strings: constants in a compiled graph)."""
        cfg, p, hd = self.cfg, policy.layer(self.index), self.cfg.head_dim
        a, m = self.attn, self.mlp
        b = x.shape[0]
        attn_norm, mlp_norm = replicated(self.attn_norm.weight, group, counter), replicated(self.mlp_norm.weight, group, counter)
        q, k, v = sp_rms_norm_linear(x, attn_norm, cfg.norm_eps, (a.q.weight, a.k.weight, a.v.weight), p.norm_input, group, counter)
        s = q.shape[1]  # the whole sequence: gathered
        q = rotary_embedding(q.view(b, s, self.n_heads, hd).transpose(1, 2), cos, sin)
        k = rotary_embedding(k.view(b, s, self.n_kv_heads, hd).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.n_kv_heads, hd).transpose(1, 2)
        o = causal_attention(q, k, v, p.attention).transpose(1, 2).reshape(b, s, self.n_heads * hd)
        x = x + scatter_seq(saved_input_linear(o, a.o.weight, p.out_proj_input, attention_output=p.attention is None), group, counter)
        gate, up = sp_rms_norm_linear(x, mlp_norm, cfg.norm_eps, (m.gate.weight, m.up.weight), p.norm_input, group, counter)
        return x + scatter_seq(swiglu_linear(gate, up, m.down.weight, p.act_input), group, counter)


class TensorParallelLlama(nn.Module):
    """This rank's tp shard of a :class:`Llama` or of one of its pipeline slices: the embedding on
    the first stage, the layers, the final norm and LM head on the last (as the slice has them)."""

    def __init__(self, model: Llama, group: Group, counter: CommCounter | None = None) -> None:
        super().__init__()
        cfg = model.cfg
        if model.recompute:
            raise ValueError("activation checkpointing (recompute_layers) is not supported under tensor parallelism; set it to 0")
        self.tp, self.rank = tp_size(group), dist.get_rank(group)
        check_tp_shapes(cfg, self.tp)
        self.cfg, self.policy, self.group = cfg, model.policy, group
        self.layer_range = model.layer_range
        self.counter = COMM_COUNTER if counter is None else counter
        # What the layers pass their ops: names, which a compiled graph holds as constants.
        self.group_name, self.counter_key = register_group(group), register_counter(self.counter)
        full = dict(model.named_parameters())
        shards = {name: _shard(t, split_dim(name), self.rank, self.tp) for name, t in full.items()}
        self.vocab_start = self.rank * cfg.vocab_size // self.tp
        self.embed = None
        if model.has_embed:
            w = shards["embed.weight"]
            self.embed = nn.Embedding(w.shape[0], cfg.hidden, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                self.embed.weight.copy_(w)
        self.layers = nn.ModuleDict(
            {
                str(i): TensorParallelDecoderLayer(
                    cfg, i, {n[len(f"layers.{i}.") :]: t for n, t in shards.items() if n.startswith(f"layers.{i}.")}, self.tp
                )
                for i in model.layer_range
            }
        )
        self.norm = self.head = None
        if model.has_head:
            self.norm = _norm(shards["norm.weight"], cfg.norm_eps)
            self.head = _linear(shards["embed.weight" if cfg.tie_embeddings else "head.weight"])
            if cfg.tie_embeddings:
                self.head.weight = self.embed.weight

    @property
    def has_embed(self) -> bool:
        """Whether this shard holds the embedding (first pipeline stage)."""
        return self.embed is not None

    @property
    def has_head(self) -> bool:
        """Whether this shard holds the final norm and the LM head (last pipeline stage)."""
        return self.head is not None

    def compile_layers(self, **options: Any) -> None:
        """torch.compile each decoder layer in place with fullgraph=True (parameter names unchanged),
        as :meth:`agoq.models.llama.Llama.compile_layers`; the embedding and the loss stay eager."""
        for layer in self.layers.values():
            layer.compile(fullgraph=True, **options)

    def set_policy(self, policy: ActivationPolicy) -> None:
        """Switch the activation precision policy (takes effect on the next forward)."""
        self.policy = policy

    def hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] (first stage) or this rank's sequence shard [batch, seq / tp, hidden]
        -> the sequence shard after this slice's layers (on the last stage, the final norm's output)."""
        if self.embed is not None:
            s = x.shape[1]
            if s % self.tp:
                raise ValueError(f"sequence parallelism splits the sequence: length {s} must be divisible by tp={self.tp}")
            x = vocab_parallel_embedding(x, self.embed.weight, self.vocab_start, self.group_name, self.counter_key)
        s = x.shape[1] * self.tp
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={self.cfg.max_seq_len}; raise it in the model config")
        cos, sin = rope_tables(self.cfg, s, x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin, self.policy, self.group_name, self.counter_key)
        if self.norm is not None:
            x = rms_norm(x, replicated(self.norm.weight, self.group_name, self.counter_key), self.cfg.norm_eps)
        return x

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, divisor: int = 1, weight_grad_in_forward: bool = False) -> torch.Tensor:
        """Mean next-token loss of the final hidden states' sequence shard, divided by ``divisor``
        (vocab-parallel, keeps no logits; the loss gathers the sequence and keeps only the shard;
        ``weight_grad_in_forward`` does not apply to it)."""
        if self.head is None:
            raise RuntimeError("this shard is not of the last pipeline stage: it has no LM head")
        loss = vocab_parallel_cross_entropy(
            hidden, self.head.weight, targets, self.vocab_start, self.group_name, self.counter_key, ignore_index=IGNORE_INDEX, sequence_parallel=True
        )
        return loss if divisor == 1 else loss / divisor

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (inner stage), or the mean next-token loss when targets are given (the
        same on every tp rank; seq divisible by tp)."""
        h = self.hidden_states(tokens)
        return h if targets is None or self.head is None else self.loss(h, targets)


def shard_llama(model: Llama, group: Group, counter: CommCounter | None = None) -> TensorParallelLlama:
    """This rank's tensor/sequence-parallel shard of ``model`` on the tp group ``group`` (same
    parameter names, values copied); its collectives record bytes in ``counter`` (default: the global one)."""
    return TensorParallelLlama(model, group, counter)


def _gather_full(name: str, t: torch.Tensor, group: Group) -> torch.Tensor:
    """The full tensor of one parameter-shaped shard: concatenated along its split dim (a
    replicated one is the same on every rank, its gradient already summed over tp in backward)."""
    dim = split_dim(name)
    t = t.detach().contiguous()
    if dim is None:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(tp_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def gather_gradients(model: TensorParallelLlama) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at the full model's shape, by name: shards concatenated, the
    replicated norm weights' as backward summed them (a parameter without a gradient counts as
    zeros). Every tp rank must call it; all get the same result."""
    return {name: _gather_full(name, p.grad if p.grad is not None else torch.zeros_like(p), model.group) for name, p in model.named_parameters()}


def gather_state_dict(model: TensorParallelLlama) -> dict[str, torch.Tensor]:
    """The full model's parameters by name (replicated ones taken as this rank holds them)."""
    return {name: _gather_full(name, p, model.group) for name, p in model.named_parameters()}
