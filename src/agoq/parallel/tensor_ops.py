"""Tensor- and sequence-parallel building blocks (Megatron-LM style) on a tp process group.

The residual stream lives sequence-parallel: each of the tp ranks holds seq / tp consecutive tokens
of every sequence, ``[batch, seq / tp, hidden]``. Before a column-parallel GEMM the norm output is
all-gathered along the sequence (backward: reduce-scatter of its gradient); after a row-parallel
GEMM the partial sums are reduce-scattered along the sequence (backward: all-gather). The LM head is
vocab-parallel: each rank holds vocab / tp rows and the log-softmax is agreed by two small
all-reduces per chunk (max, then sum-exp with the target logit).

Why explicit column/row-parallel GEMMs and not DTensor's ``parallelize_module``: agoq's fused ops
(RMSNorm + GEMMs keeping the 4-bit norm input, SwiGLU + GEMM keeping 4-bit gate/up) are custom
autograd Functions over plain tensors, which ``ColwiseParallel`` / ``RowwiseParallel`` would not carry
through; and LAAQ under sequence parallelism must save the 4-bit copy of the *sequence-sharded*
norm input (1/tp of the tokens) and all-gather it quantized (payload + scales on the wire) in
backward, a collective placed inside the op's backward that no sharding plan expresses.

Only torch.distributed collectives are used: ``all_gather_single``, ``reduce_scatter_single`` (gloo
implements it in torch 2.13, so no emulation is needed) and ``all_reduce``. Every one records the
bytes this rank sends in a :class:`agoq.gradient.counter.CommCounter`, counted as the 8-bit
collectives count them (an all-gather of m bytes costs (tp - 1) m, a reduce-scatter to m bytes
(tp - 1) m, a ring all-reduce of n bytes 2 (tp - 1) / tp n).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agoq.activation.loss import default_chunk_size
from agoq.activation.meter import meter_scope
from agoq.activation.ops import _norm_backward, _norm_forward, _quantize_saved, rms_norm
from agoq.gradient.counter import COMM_COUNTER, CommCounter, ring_all_reduce_bytes
from agoq.quant import QTensor, QuantFormat, dequantize

Group = Any

# Names under which the collectives record their bytes.
SEQ_ALL_GATHER = "tp_seq_all_gather"
SEQ_REDUCE_SCATTER = "tp_seq_reduce_scatter"
NORM_INPUT_ALL_GATHER = "tp_norm_input_all_gather"  # the 4-bit norm input, gathered in backward
VOCAB_ALL_REDUCE = "tp_vocab_all_reduce"
REPLICATED_GRAD_ALL_REDUCE = "tp_replicated_grad_all_reduce"  # the norm weights' gradients, summed over tp


def tp_size(group: Group) -> int:
    """Ranks in the tp group."""
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- raw collectives along the sequence dimension (dim 1 of [batch, seq, ...]) ------------------


def all_gather_seq(x: torch.Tensor, group: Group, counter: CommCounter, name: str = SEQ_ALL_GATHER) -> torch.Tensor:
    """[batch, s, ...] on each rank -> [batch, tp * s, ...], rank r's tokens at r * s.. (no autograd)."""
    w = tp_size(group)
    if w == 1:
        return x
    flat = torch.empty((w * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(flat, x.contiguous(), group=group)
    counter.record(name, (w - 1) * _nbytes(x))
    return flat.view(w, *x.shape).movedim(0, 1).reshape(x.shape[0], w * x.shape[1], *x.shape[2:])


def reduce_scatter_seq(x: torch.Tensor, group: Group, counter: CommCounter, name: str = SEQ_REDUCE_SCATTER) -> torch.Tensor:
    """[batch, seq, ...] partial sums on each rank -> this rank's [batch, seq / tp, ...] of their sum (no autograd)."""
    w = tp_size(group)
    if w == 1:
        return x
    b, s = x.shape[:2]
    rest = x.shape[2:]
    pieces = x.reshape(b, w, s // w, *rest).movedim(1, 0).contiguous().view(w * b, s // w, *rest)
    out = torch.empty((b, s // w, *rest), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, pieces, group=group)
    counter.record(name, (w - 1) * _nbytes(out))
    return out


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, counter: CommCounter) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return all_gather_seq(x, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return reduce_scatter_seq(grad, ctx.group, ctx.counter), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, counter: CommCounter) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return reduce_scatter_seq(x, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return all_gather_seq(grad, ctx.group, ctx.counter), None, None


def gather_seq(x: torch.Tensor, group: Group, counter: CommCounter | None = None) -> torch.Tensor:
    """Sequence all-gather with autograd (backward: reduce-scatter of the gradient)."""
    return _GatherSeq.apply(x, group, COMM_COUNTER if counter is None else counter)


def scatter_seq(x: torch.Tensor, group: Group, counter: CommCounter | None = None) -> torch.Tensor:
    """Sequence reduce-scatter with autograd (backward: all-gather of the gradient)."""
    return _ReduceScatterSeq.apply(x, group, COMM_COUNTER if counter is None else counter)


# ---- RMSNorm + column-parallel GEMMs, LAAQ under sequence parallelism ----------------------------


def _gather_quantized(q: QTensor, group: Group, counter: CommCounter) -> torch.Tensor:
    """Every rank's quantized [batch, s, hidden] shard, gathered as codes + scales and
    dequantized to fp32 [batch, tp * s, hidden]."""
    w = tp_size(group)
    payloads = torch.empty(w * q.payload.numel(), dtype=q.payload.dtype, device=q.device)
    scales = torch.empty(w * q.scales.numel(), dtype=q.scales.dtype, device=q.device)
    dist.all_gather_single(payloads, q.payload.reshape(-1), group=group)
    dist.all_gather_single(scales, q.scales.reshape(-1), group=group)
    payloads, scales = payloads.view(w, -1), scales.view(w, -1)
    counter.record(NORM_INPUT_ALL_GATHER, (w - 1) * _nbytes(q.payload), (w - 1) * _nbytes(q.scales))
    parts = [dequantize(QTensor(payloads[r], scales[r], q.shape, q.dtype, q.fmt), torch.float32) for r in range(w)]
    return torch.cat(parts, dim=1)


class _SPNormLinear(torch.autograd.Function):
    """RMSNorm of the sequence-sharded x, all-gathered, times column-parallel weights; keeps only
    the 4-bit copy of the sharded x (1/tp of the tokens) and recomputes the rest in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, fmt: QuantFormat, group: Group, counter: CommCounter, *weights: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        h, _ = _norm_forward(x, norm_weight, eps=eps)
        h_full = all_gather_seq(h, group, counter)
        del h
        outs = tuple(F.linear(h_full, w) for w in weights)
        q = _quantize_saved(x, fmt)
        ctx.save_for_backward(q.payload, q.scales, norm_weight, *weights)
        ctx.meta = (q.shape, q.dtype, q.fmt, eps, group, counter)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        payload, scales, norm_weight, *weights = ctx.saved_tensors
        shape, dtype, fmt, eps, group, counter = ctx.meta
        q = QTensor(payload, scales, shape, dtype, fmt)
        # Every token's GEMM input is recomputed from the gathered 4-bit shards, so the weight
        # gradients see exactly the tp = 1 recompute of the tokens.
        x_full = _gather_quantized(q, group, counter) if tp_size(group) > 1 else dequantize(q, torch.float32)
        h_full, _ = _norm_forward(x_full, norm_weight, eps=eps, out_dtype=dtype)
        del x_full
        grad_h = torch.zeros(h_full.shape, dtype=torch.float32, device=payload.device)
        weight_grads: list[torch.Tensor | None] = [None] * len(weights)
        h_rows = h_full.reshape(-1, h_full.shape[-1])
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            grad_h += F.linear(g, w.t())
            if ctx.needs_input_grad[6 + i]:
                weight_grads[i] = g.reshape(-1, g.shape[-1]).t().mm(h_rows).to(w.dtype)
        del h_full, h_rows
        # Each rank's grad_h is its column shard's share: summed over tp, this rank keeps its tokens.
        # Sent in the compute dtype, as the baseline's gather backward sends it.
        grad_h = reduce_scatter_seq(grad_h.to(dtype), group, counter)
        x = dequantize(q, torch.float32)
        _, rstd = _norm_forward(x, norm_weight, eps=eps)
        gx, gw = _norm_backward(grad_h, x, rstd, norm_weight, x_dtype=dtype, need_weight_grad=ctx.needs_input_grad[1])
        return (gx, gw, None, None, None, None, *weight_grads)


class _GatheredLinear(torch.autograd.Function):
    """Sequence all-gather of h then column-parallel GEMMs, keeping only the sharded h (1/tp of the
    tokens) and gathering it again in backward, as Megatron-LM's sequence-parallel linear does."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, group: Group, counter: CommCounter, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h_full = all_gather_seq(h, group, counter)
        ctx.save_for_backward(h, *weights)
        ctx.meta = (group, counter)
        return tuple(F.linear(h_full, w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        h, *weights = ctx.saved_tensors
        group, counter = ctx.meta
        h_rows = all_gather_seq(h, group, counter).reshape(-1, h.shape[-1])
        grad_h = torch.zeros((*h.shape[:1], h.shape[1] * tp_size(group), h.shape[2]), dtype=torch.float32, device=h.device)
        weight_grads: list[torch.Tensor | None] = [None] * len(weights)
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            grad_h += F.linear(g, w.t())
            if ctx.needs_input_grad[3 + i]:
                weight_grads[i] = g.reshape(-1, g.shape[-1]).t().mm(h_rows).to(w.dtype)
        return (reduce_scatter_seq(grad_h.to(h.dtype), group, counter), None, None, *weight_grads)


def sp_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weights: Sequence[torch.Tensor],
    fmt: QuantFormat | None,
    group: Group,
    counter: CommCounter | None = None,
) -> tuple[torch.Tensor, ...]:
    """RMSNorm of sequence-sharded x [batch, s / tp, hidden], gathered to [batch, s, hidden], times
    each column-parallel weight shard. With fmt only quantized x is saved (LAAQ); without, the
    baseline (Megatron-LM's): the norm keeps its sharded input and rstd, the GEMMs the sharded norm
    output, all-gathered again in backward."""
    counter = COMM_COUNTER if counter is None else counter
    if fmt is None:
        h = rms_norm(x, norm_weight, eps)
        with meter_scope(kind="gemm_input"):
            return _GatheredLinear.apply(h, group, counter, *weights)
    with meter_scope(kind="norm_input"):
        return _SPNormLinear.apply(x, norm_weight, eps, fmt, group, counter, *weights)


class _SumGradOverTp(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over tp (Megatron's sequence-parallel
    parameter all-reduce, placed in autograd so the sum exists before any gradient hook folds it)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: Group, counter: CommCounter) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: never autograd's own tensor
        w = tp_size(ctx.group)
        if w > 1:
            dist.all_reduce(grad, group=ctx.group)
            ctx.counter.record(REPLICATED_GRAD_ALL_REDUCE, ring_all_reduce_bytes(_nbytes(grad), w))
        return grad, None, None


def replicated(weight: torch.Tensor, group: Group, counter: CommCounter | None = None) -> torch.Tensor:
    """A tp-replicated parameter (a norm weight) as used in forward: each rank's gradient of it is
    partial (its own tokens), so backward sums it over tp; every tp rank then holds the full,
    identical gradient, summed exactly once."""
    return _SumGradOverTp.apply(weight, group, COMM_COUNTER if counter is None else counter)


# ---- vocab-parallel embedding and LM head + cross-entropy ---------------------------------------


def vocab_parallel_embedding(
    tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int, group: Group, counter: CommCounter | None = None
) -> torch.Tensor:
    """Token ids [batch, seq] (the same on every rank) -> this rank's sequence shard [batch, seq / tp, hidden].

    Each rank looks up the ids in its rows [vocab_start, vocab_start + rows), zeros elsewhere; the
    reduce-scatter sums the ranks' lookups and leaves each rank its tokens.
    """
    local = tokens - vocab_start
    own = (local >= 0) & (local < weight.shape[0])
    e = F.embedding(torch.where(own, local, 0), weight) * own.unsqueeze(-1).to(weight.dtype)
    return scatter_seq(e, group, counter)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: Group, counter: CommCounter) -> None:
    w = tp_size(group)
    if w > 1:
        dist.all_reduce(t, op=op, group=group)
        counter.record(VOCAB_ALL_REDUCE, ring_all_reduce_bytes(_nbytes(t), w))


def _vocab_chunk_lse(
    logits: torch.Tensor, local: torch.Tensor, own: torch.Tensor, group: Group, counter: CommCounter
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp over the whole vocab, target logit) of one chunk's fp32 local logits."""
    peak = logits.max(dim=1).values
    _all_reduce(peak, dist.ReduceOp.MAX, group, counter)
    target = logits.gather(1, torch.where(own, local, 0).unsqueeze(1)).squeeze(1)
    stats = torch.stack([(logits - peak.unsqueeze(1)).exp().sum(dim=1), torch.where(own, target, 0.0)], dim=1)
    _all_reduce(stats, dist.ReduceOp.SUM, group, counter)
    return peak + stats[:, 0].log(), stats[:, 1]


class _VocabParallelLoss(torch.autograd.Function):
    """Mean cross-entropy of hidden @ weight_shard.T over the vocab split on tp; keeps the hidden
    states, targets and one fp32 log-sum-exp per token, never logits; backward recomputes each
    chunk's local logits. With ``seq_sharded`` the hidden states come as this rank's sequence shard:
    forward all-gathers them, only the shard is kept, and backward gathers them again and
    reduce-scatters their gradient (Megatron's sequence-parallel LM head)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        ignore_index: int,
        chunk: int,
        group: Group,
        counter: CommCounter,
        seq_sharded: bool,
    ) -> torch.Tensor:
        kept = hidden
        if seq_sharded:
            hidden = all_gather_seq(hidden, group, counter)
        h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        valid = t != ignore_index
        local = t - vocab_start
        own = valid & (local >= 0) & (local < weight.shape[0])
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], weight).float()
            lse[s : s + chunk], target = _vocab_chunk_lse(logits, local[s : s + chunk], own[s : s + chunk], group, counter)
            total += torch.where(valid[s : s + chunk], lse[s : s + chunk] - target, 0.0).sum()
            del logits
        scale = valid.sum().float().reciprocal()
        ctx.save_for_backward(kept, weight, targets, lse)
        ctx.args = (vocab_start, ignore_index, chunk, scale)
        ctx.gather = (group, counter) if seq_sharded else None
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        vocab_start, ignore_index, chunk, scale = ctx.args
        if ctx.gather is not None:
            hidden = all_gather_seq(hidden, *ctx.gather)
        h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        valid = t != ignore_index
        local = t - vocab_start
        own = valid & (local >= 0) & (local < weight.shape[0])
        coef = torch.where(valid, grad_out * scale, 0.0)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, h.shape[0], chunk):
            h_c, own_c = h[s : s + chunk], own[s : s + chunk]
            g = (F.linear(h_c, weight).float() - lse[s : s + chunk].unsqueeze(1)).exp_()
            rows = own_c.nonzero().squeeze(1)
            g[rows, local[s : s + chunk][rows]] -= 1.0
            g = g.mul_(coef[s : s + chunk].unsqueeze(1)).to(h.dtype)
            torch.mm(g, weight, out=grad_h[s : s + chunk])
            grad_w.addmm_(g.t().float(), h_c.float())
        grad_h = grad_h.view(hidden.shape)
        if ctx.gather is not None:
            grad_h = reduce_scatter_seq(grad_h, *ctx.gather)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None, None, None


def vocab_parallel_loss_saved_bytes(tokens: int, hidden: int, dtype: torch.dtype, tp: int = 1) -> int:
    """What :func:`vocab_parallel_cross_entropy` with ``sequence_parallel`` keeps for backward on
    each of ``tp`` ranks for ``tokens`` tokens: their hidden states' sequence shard, and every
    token's target and fp32 log-sum-exp."""
    es = torch.empty((), dtype=dtype).element_size()
    return tokens // tp * hidden * es + tokens * (torch.empty((), dtype=torch.long).element_size() + 4)


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    group: Group,
    counter: CommCounter | None = None,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy of hidden [batch, seq, hidden] (every token, the same on each
    rank) against targets [batch, seq], with this rank holding LM-head rows [vocab_start, vocab_start + rows).

    The returned loss is the full-vocabulary loss on every rank; the hidden-state gradient is this
    rank's vocab shard's share (the caller sums it over tp). With ``sequence_parallel`` hidden is
    this rank's sequence shard [batch, seq / tp, hidden], gathered inside (only the shard is kept
    for backward), and its gradient is the full one of that shard."""
    chunk = chunk_size if chunk_size is not None else default_chunk_size(weight.shape[0], weight.shape[1])
    counter = COMM_COUNTER if counter is None else counter
    return _VocabParallelLoss.apply(hidden, weight, targets, vocab_start, ignore_index, chunk, group, counter, sequence_parallel)
