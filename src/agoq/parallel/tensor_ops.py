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

Every op with autograd is a ``torch.library`` custom op (namespace ``agoq``, ``tp_*``) with a fake
kernel and registered autograd, as :mod:`agoq.activation.ops` are, so ``torch.compile(fullgraph=True)``
traces a tensor-parallel decoder layer into one graph (docs/ARCHITECTURE.md). An op cannot take a
process group or a counter object, so it takes their names: :func:`register_group` files a group
under its ``group_name`` and :func:`register_counter` a counter under a key, both in weak registries
of this module, and each op looks them up when it runs. The functions below take either the object
(registered on the call, eagerly) or its name (what a compiled caller passes).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agoq.compat import all_gather_single, reduce_scatter_single
from agoq.activation.loss import default_chunk_size
from agoq.activation.meter import meter_scope
from agoq.activation.layouts import Layout, arguments_of
from agoq.activation.ops import _fake_codes, _norm_backward, _norm_forward, _or_empty, _quantize_saved, rms_norm
from agoq.gradient.counter import COMM_COUNTER, CommCounter, ring_all_reduce_bytes
from agoq.quant import QTensor, QuantFormat, dequantize, parse_format

Group = Any  # a torch.distributed ProcessGroup (None: the default group), or the name register_group gave it

# Names under which the collectives record their bytes.
SEQ_ALL_GATHER = "tp_seq_all_gather"
SEQ_REDUCE_SCATTER = "tp_seq_reduce_scatter"
NORM_INPUT_ALL_GATHER = "tp_norm_input_all_gather"  # the 4-bit norm input, gathered in backward
VOCAB_ALL_REDUCE = "tp_vocab_all_reduce"
REPLICATED_GRAD_ALL_REDUCE = "tp_replicated_grad_all_reduce"  # the norm weights' gradients, summed over tp


# ---- process groups and counters by name, for the custom ops ------------------------------------

# Weak: a registry keeps no group or counter alive; the model that uses them holds them.
_GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SIZES: dict[str, int] = {}
_COUNTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
GLOBAL_COUNTER = "global"  # the key of agoq.gradient.counter.COMM_COUNTER


def register_group(group: Group) -> str:
    """The name under which the tp ops find ``group``: its ``group_name``, filed now (a name is
    returned as it is). Filing again replaces the entry, so a group created under a reused name
    (after ``destroy_process_group``) is the one found."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
    name = group.group_name
    _GROUPS[name], _SIZES[name] = group, dist.get_world_size(group)
    return name


def register_counter(counter: CommCounter | str | None) -> str:
    """The key under which the tp ops find ``counter`` (None: the global COMM_COUNTER), filed now."""
    if isinstance(counter, str):
        return counter
    if counter is None or counter is COMM_COUNTER:
        return GLOBAL_COUNTER
    key = f"counter-{id(counter):x}"  # unique while the counter lives; the entry dies with it
    _COUNTERS[key] = counter
    return key


def _group(name: str) -> Any:
    try:
        return _GROUPS[name]
    except KeyError:
        raise KeyError(f"no process group registered as {name!r}: pass the group itself, or register_group(group) first") from None


def _counter(key: str) -> CommCounter:
    if key == GLOBAL_COUNTER:
        return COMM_COUNTER
    try:
        return _COUNTERS[key]
    except KeyError:
        raise KeyError(f"no CommCounter registered as {key!r}: pass the counter itself, or register_counter(counter) first") from None


def _hold(ctx: Any, group: str, counter: str) -> None:
    # The registries are weak: the autograd graph keeps the group and the counter its backward
    # names alive, as it kept the objects themselves when they were its arguments.
    ctx.held = (_GROUPS.get(group), _COUNTERS.get(counter))


def _names(group: Group, counter: CommCounter | str | None) -> tuple[str, str]:
    return register_group(group), register_counter(counter)


def tp_size(group: Group) -> int:
    """Ranks in the tp group (a group or a registered name)."""
    if isinstance(group, str):
        return _SIZES[group]
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
    all_gather_single(flat, x.contiguous(), group=group)
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
    reduce_scatter_single(out, pieces, group=group)
    counter.record(name, (w - 1) * _nbytes(out))
    return out


def _fake_gathered(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], _SIZES[group] * x.shape[1], *x.shape[2:]))


@torch.library.custom_op("agoq::tp_gather_seq", mutates_args=())
def _gather_seq_op(x: torch.Tensor, group: str, counter: str) -> torch.Tensor:
    """all_gather_seq of x (a copy at tp = 1: an op's output may not alias its input)."""
    out = all_gather_seq(x, _group(group), _counter(counter))
    return x.clone() if out is x else out


@_gather_seq_op.register_fake
def _(x: torch.Tensor, group: str, counter: str) -> torch.Tensor:
    return _fake_gathered(x, group)


@torch.library.custom_op("agoq::tp_scatter_seq", mutates_args=())
def _scatter_seq_op(x: torch.Tensor, group: str, counter: str) -> torch.Tensor:
    """reduce_scatter_seq of x (a copy at tp = 1)."""
    out = reduce_scatter_seq(x, _group(group), _counter(counter))
    return x.clone() if out is x else out


@_scatter_seq_op.register_fake
def _(x: torch.Tensor, group: str, counter: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // _SIZES[group], *x.shape[2:]))


def _seq_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.names = inputs[1:]
    _hold(ctx, *ctx.names)


_gather_seq_op.register_autograd(lambda ctx, grad: (_scatter_seq_op(grad, *ctx.names), None, None), setup_context=_seq_setup)
_scatter_seq_op.register_autograd(lambda ctx, grad: (_gather_seq_op(grad, *ctx.names), None, None), setup_context=_seq_setup)


def gather_seq(x: torch.Tensor, group: Group, counter: CommCounter | str | None = None) -> torch.Tensor:
    """Sequence all-gather with autograd (backward: reduce-scatter of the gradient)."""
    return _gather_seq_op(x, *_names(group, counter))


def scatter_seq(x: torch.Tensor, group: Group, counter: CommCounter | str | None = None) -> torch.Tensor:
    """Sequence reduce-scatter with autograd (backward: all-gather of the gradient)."""
    return _scatter_seq_op(x, *_names(group, counter))


# ---- RMSNorm + column-parallel GEMMs, LAAQ under sequence parallelism ----------------------------


def _gather_quantized(q: QTensor, group: Group, counter: CommCounter) -> torch.Tensor:
    """Every rank's quantized [batch, s, hidden] shard, gathered as codes + scales and
    dequantized to fp32 [batch, tp * s, hidden]."""
    w = tp_size(group)
    payloads = torch.empty(w * q.payload.numel(), dtype=q.payload.dtype, device=q.device)
    scales = torch.empty(w * q.scales.numel(), dtype=q.scales.dtype, device=q.device)
    all_gather_single(payloads, q.payload.reshape(-1), group=group)
    all_gather_single(scales, q.scales.reshape(-1), group=group)
    payloads, scales = payloads.view(w, -1), scales.view(w, -1)
    counter.record(NORM_INPUT_ALL_GATHER, (w - 1) * _nbytes(q.payload), (w - 1) * _nbytes(q.scales))
    parts = [dequantize(QTensor(payloads[r], scales[r], q.shape, q.dtype, q.fmt), torch.float32) for r in range(w)]
    return torch.cat(parts, dim=1)


# The sequence-parallel norm + GEMMs: what autograd keeps, and what the backward op returns.
SP_NORM_LINEAR_SAVED = Layout("payload", "scales", "norm_weight", "weights*")
SP_NORM_LINEAR_GRADS = Layout("x", "norm_weight", "weights*")


def _sp_norm_linear_impl(
    x: torch.Tensor, norm_weight: torch.Tensor, weights: list[torch.Tensor], eps: float, fmt: str, group: str, counter: str
) -> list[torch.Tensor]:
    """RMSNorm of the sequence-sharded x, all-gathered, times each column-parallel weight; then
    [outputs..., x's packed codes, x's block scales]: only the 4-bit copy of the sharded x (1/tp
    of the tokens) is kept, the rest is recomputed in backward."""
    h, _ = _norm_forward(x, norm_weight, eps=eps)
    h_full = all_gather_seq(h, _group(group), _counter(counter))
    del h
    outs = [F.linear(h_full, w) for w in weights]
    q = _quantize_saved(x, parse_format(fmt))
    return [*outs, q.payload, q.scales]


_sp_norm_linear_op = torch.library.custom_op("agoq::tp_sp_norm_linear", mutates_args=())(_sp_norm_linear_impl)
_sp_norm_linear_args = arguments_of(_sp_norm_linear_impl)


@_sp_norm_linear_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _sp_norm_linear_args(*args, **kwargs)
    full = _fake_gathered(a.x, a.group)
    return [full.new_empty((*full.shape[:-1], w.shape[0])) for w in a.weights] + _fake_codes(a.x, parse_format(a.fmt))


def _sp_norm_linear_backward_impl(
    grads: list[Optional[torch.Tensor]],
    payload: torch.Tensor,
    scales: torch.Tensor,
    norm_weight: torch.Tensor,
    weights: list[torch.Tensor],
    shape: list[int],
    dtype: torch.dtype,
    eps: float,
    fmt: str,
    group: str,
    counter: str,
    need_norm_weight: bool,
    need_weights: list[bool],
) -> list[torch.Tensor]:
    """SP_NORM_LINEAR_GRADS: [grad of x, grad of the norm weight, grad of each weight], an empty tensor for each one not needed."""
    g_, c_ = _group(group), _counter(counter)
    q = QTensor(payload, scales, torch.Size(shape), dtype, parse_format(fmt))
    # Every token's GEMM input is recomputed from the gathered 4-bit shards, so the weight
    # gradients see exactly the tp = 1 recompute of the tokens.
    x_full = _gather_quantized(q, g_, c_) if tp_size(g_) > 1 else dequantize(q, torch.float32)
    h_full, _ = _norm_forward(x_full, norm_weight, eps=eps, out_dtype=dtype)
    del x_full
    grad_h = torch.zeros(h_full.shape, dtype=torch.float32, device=payload.device)
    weight_grads: list[torch.Tensor | None] = [None] * len(weights)
    h_rows = h_full.reshape(-1, h_full.shape[-1])
    for i, (g, w) in enumerate(zip(grads, weights)):
        if g is None:
            continue
        grad_h += F.linear(g, w.t())
        if need_weights[i]:
            weight_grads[i] = g.reshape(-1, g.shape[-1]).t().mm(h_rows).to(w.dtype)
    del h_full, h_rows
    # Each rank's grad_h is its column shard's share: summed over tp, this rank keeps its tokens.
    # Sent in the compute dtype, as the baseline's gather backward sends it.
    grad_h = reduce_scatter_seq(grad_h.to(dtype), g_, c_)
    x = dequantize(q, torch.float32)
    _, rstd = _norm_forward(x, norm_weight, eps=eps)
    gx, gw = _norm_backward(grad_h, x, rstd, norm_weight, x_dtype=dtype, need_weight_grad=need_norm_weight)
    return [gx, *(_or_empty(g, payload) for g in (gw, *weight_grads))]


_sp_norm_linear_backward_op = torch.library.custom_op("agoq::tp_sp_norm_linear_backward", mutates_args=())(_sp_norm_linear_backward_impl)
_sp_norm_linear_backward_args = arguments_of(_sp_norm_linear_backward_impl)


@_sp_norm_linear_backward_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _sp_norm_linear_backward_args(*args, **kwargs)
    none = a.payload.new_empty(0, dtype=torch.float32)
    flat, _ = SP_NORM_LINEAR_GRADS.flatten(
        x=a.payload.new_empty(a.shape, dtype=a.dtype),
        norm_weight=torch.empty_like(a.norm_weight) if a.need_norm_weight else none,
        weights=[torch.empty_like(w) if g is not None and need else none for w, g, need in zip(a.weights, a.grads, a.need_weights)],
    )
    return flat


def _sp_norm_linear_setup(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    a = _sp_norm_linear_args(*inputs)
    payload, scales = output[-2:]
    ctx.mark_non_differentiable(payload, scales)
    ctx.set_materialize_grads(False)
    flat, ctx.lengths = SP_NORM_LINEAR_SAVED.flatten(payload=payload, scales=scales, norm_weight=a.norm_weight, weights=a.weights)
    ctx.save_for_backward(*flat)
    ctx.meta = (list(a.x.shape), a.x.dtype, a.eps, a.fmt, a.group, a.counter)
    _hold(ctx, a.group, a.counter)


def _sp_norm_linear_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    saved = SP_NORM_LINEAR_SAVED.unflatten(ctx.saved_tensors, ctx.lengths)
    shape, dtype, eps, fmt, group, counter = ctx.meta
    need = _sp_norm_linear_args(*ctx.needs_input_grad)
    n = len(saved.weights)
    outs = _sp_norm_linear_backward_op(
        list(grads[:n]), saved.payload, saved.scales, saved.norm_weight, saved.weights, shape, dtype, eps, fmt, group, counter,
        need.norm_weight, list(need.weights),
    )  # fmt: skip
    out = SP_NORM_LINEAR_GRADS.unflatten(outs, (n,))
    gws = [g if g_out is not None and w else None for g, g_out, w in zip(out.weights, grads, need.weights)]
    return out.x, out.norm_weight if need.norm_weight else None, gws, None, None, None, None


_sp_norm_linear_op.register_autograd(_sp_norm_linear_grad, setup_context=_sp_norm_linear_setup)


@torch.library.custom_op("agoq::tp_gathered_linear", mutates_args=())
def _gathered_linear_op(h: torch.Tensor, weights: list[torch.Tensor], group: str, counter: str) -> list[torch.Tensor]:
    """Sequence all-gather of h then column-parallel GEMMs; with its autograd only the sharded h
    (1/tp of the tokens) is kept and gathered again in backward, as Megatron-LM's sequence-parallel
    linear does."""
    h_full = all_gather_seq(h, _group(group), _counter(counter))
    return [F.linear(h_full, w) for w in weights]


@_gathered_linear_op.register_fake
def _(h: torch.Tensor, weights: list[torch.Tensor], group: str, counter: str) -> list[torch.Tensor]:
    full = _fake_gathered(h, group)
    return [full.new_empty((*full.shape[:-1], w.shape[0])) for w in weights]


@torch.library.custom_op("agoq::tp_gathered_linear_backward", mutates_args=())
def _gathered_linear_backward_op(
    grads: list[Optional[torch.Tensor]], h: torch.Tensor, weights: list[torch.Tensor], group: str, counter: str, need_weights: list[bool]
) -> list[torch.Tensor]:
    """[grad of h, grad of each weight], an empty tensor for each weight's not needed."""
    g_, c_ = _group(group), _counter(counter)
    h_rows = all_gather_seq(h, g_, c_).reshape(-1, h.shape[-1])
    grad_h = torch.zeros((*h.shape[:1], h.shape[1] * tp_size(g_), h.shape[2]), dtype=torch.float32, device=h.device)
    weight_grads: list[torch.Tensor | None] = [None] * len(weights)
    for i, (g, w) in enumerate(zip(grads, weights)):
        if g is None:
            continue
        grad_h += F.linear(g, w.t())
        if need_weights[i]:
            weight_grads[i] = g.reshape(-1, g.shape[-1]).t().mm(h_rows).to(w.dtype)
    return [reduce_scatter_seq(grad_h.to(h.dtype), g_, c_), *(_or_empty(g, h) for g in weight_grads)]


@_gathered_linear_backward_op.register_fake
def _(grads, h, weights, group, counter, need_weights):  # noqa: ANN001, ANN202
    wanted = [g is not None and need for g, need in zip(grads, need_weights)]
    return [torch.empty_like(h), *(torch.empty_like(w) if need else h.new_empty(0, dtype=torch.float32) for w, need in zip(weights, wanted))]


def _gathered_linear_setup(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    h, weights, group, counter = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, *weights)
    ctx.meta = (group, counter)
    _hold(ctx, group, counter)


def _gathered_linear_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    h, *weights = ctx.saved_tensors
    need_weights = ctx.needs_input_grad[1]
    outs = _gathered_linear_backward_op(list(grads), h, weights, *ctx.meta, list(need_weights))
    wanted = [g is not None and need for g, need in zip(grads, need_weights)]
    return outs[0], [g if need else None for g, need in zip(outs[1:], wanted)], None, None


_gathered_linear_op.register_autograd(_gathered_linear_grad, setup_context=_gathered_linear_setup)


def sp_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weights: Sequence[torch.Tensor],
    fmt: QuantFormat | None,
    group: Group,
    counter: CommCounter | str | None = None,
) -> tuple[torch.Tensor, ...]:
    """RMSNorm of sequence-sharded x [batch, s / tp, hidden], gathered to [batch, s, hidden], times
    each column-parallel weight shard. With fmt only quantized x is saved (LAAQ); without, the
    baseline (Megatron-LM's): the norm keeps its sharded input and rstd, the GEMMs the sharded norm
    output, all-gathered again in backward."""
    group, counter = _names(group, counter)
    if fmt is None:
        h = rms_norm(x, norm_weight, eps)
        with meter_scope(kind="gemm_input"):
            return tuple(_gathered_linear_op(h, list(weights), group, counter))
    with meter_scope(kind="norm_input"):
        return tuple(_sp_norm_linear_op(x, norm_weight, list(weights), eps, fmt.name, group, counter)[: len(weights)])


@torch.library.custom_op("agoq::tp_sum_over_tp", mutates_args=())
def _sum_over_tp_op(grad: torch.Tensor, group: str, counter: str) -> torch.Tensor:
    """grad all-reduced (summed) over the tp group, into a new tensor."""
    grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: never autograd's own tensor
    g_ = _group(group)
    w = tp_size(g_)
    if w > 1:
        dist.all_reduce(grad, group=g_)
        _counter(counter).record(REPLICATED_GRAD_ALL_REDUCE, ring_all_reduce_bytes(_nbytes(grad), w))
    return grad


@_sum_over_tp_op.register_fake
def _(grad: torch.Tensor, group: str, counter: str) -> torch.Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


class _SumGradOverTp(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over tp (Megatron's sequence-parallel
    parameter all-reduce, placed in autograd so the sum exists before any gradient hook folds it).

    An autograd Function, not a custom op: its forward returns a view of the parameter (an op's
    output may not alias its input), which a saved-bytes meter recognises as the parameter.
    Dynamo traces it (strings in ctx, the sum a custom op)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: str, counter: str) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        if not torch.compiler.is_compiling():  # a compiled caller's module holds them
            _hold(ctx, group, counter)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _sum_over_tp_op(grad, ctx.group, ctx.counter), None, None


def replicated(weight: torch.Tensor, group: Group, counter: CommCounter | str | None = None) -> torch.Tensor:
    """A tp-replicated parameter (a norm weight) as used in forward: each rank's gradient of it is
    partial (its own tokens), so backward sums it over tp; every tp rank then holds the full,
    identical gradient, summed exactly once."""
    return _SumGradOverTp.apply(weight, *_names(group, counter))


# ---- vocab-parallel embedding and LM head + cross-entropy ---------------------------------------


def vocab_parallel_embedding(
    tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int, group: Group, counter: CommCounter | str | None = None
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


# The vocab-parallel loss: mean cross-entropy of hidden @ weight_shard.T over the vocab split on
# tp; keeps the hidden states, targets and one fp32 log-sum-exp per token, never logits; backward
# recomputes each chunk's local logits. With ``seq_sharded`` the hidden states come as this rank's
# sequence shard: forward all-gathers them, only the shard is kept, and backward gathers them
# again and reduce-scatters their gradient (Megatron's sequence-parallel LM head).


def _vocab_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    group: Any,
    counter: Any,
    seq_sharded: bool,
) -> tuple[torch.Tensor, ...]:
    """(hidden with the whole sequence, its rows, valid targets, targets in this shard's vocabulary,
    the valid targets this shard owns): what the vocab-parallel loss and its backward both start from."""
    if seq_sharded:
        hidden = all_gather_seq(hidden, group, counter)
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    valid = t != ignore_index
    local = t - vocab_start
    return hidden, h, valid, local, valid & (local >= 0) & (local < weight.shape[0])


@torch.library.custom_op("agoq::tp_vocab_loss", mutates_args=())
def _vocab_loss_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    chunk: int,
    group: str,
    counter: str,
    seq_sharded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, fp32 log-sum-exp of every token)."""
    g_, c_ = _group(group), _counter(counter)
    hidden, h, valid, local, own = _vocab_rows(hidden, weight, targets, vocab_start, ignore_index, g_, c_, seq_sharded)
    lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk):
        logits = F.linear(h[s : s + chunk], weight).float()
        lse[s : s + chunk], target = _vocab_chunk_lse(logits, local[s : s + chunk], own[s : s + chunk], g_, c_)
        total += torch.where(valid[s : s + chunk], lse[s : s + chunk] - target, 0.0).sum()
        del logits
    return total * valid.sum().float().reciprocal(), lse


@_vocab_loss_op.register_fake
def _(hidden, weight, targets, vocab_start, ignore_index, chunk, group, counter, seq_sharded):  # noqa: ANN001, ANN202
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(targets.numel(), dtype=torch.float32)


@torch.library.custom_op("agoq::tp_vocab_loss_backward", mutates_args=())
def _vocab_loss_backward_op(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    chunk: int,
    group: str,
    counter: str,
    seq_sharded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of hidden, grad of the weight shard)."""
    g_, c_ = _group(group), _counter(counter)
    hidden, h, valid, local, own = _vocab_rows(hidden, weight, targets, vocab_start, ignore_index, g_, c_, seq_sharded)
    scale = valid.sum().float().reciprocal()
    coef = torch.where(valid, grad_out * scale, 0.0)
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for s in range(0, h.shape[0], chunk):
        h_c, own_c = h[s : s + chunk], own[s : s + chunk]
        g = (F.linear(h_c, weight).float() - lse[s : s + chunk].unsqueeze(1)).exp_()
        # -1 at each owned target, +(-0.0) (no change) elsewhere: a scatter, where indexing the
        # owned rows would read their count on the host every chunk.
        at = torch.where(own_c, local[s : s + chunk], 0).unsqueeze(1)
        g.scatter_add_(1, at, own_c.to(g.dtype).neg().unsqueeze(1))
        g = g.mul_(coef[s : s + chunk].unsqueeze(1)).to(h.dtype)
        torch.mm(g, weight, out=grad_h[s : s + chunk])
        _add_weight_grad(grad_w, g, h_c)
    grad_h = grad_h.view(hidden.shape)
    if seq_sharded:
        grad_h = reduce_scatter_seq(grad_h, g_, c_)
    return grad_h, grad_w.to(weight.dtype)


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w (fp32) += g.T @ h. On a GPU, bf16/fp16 inputs go to a GEMM that accumulates and
    returns fp32 (an fp32 GEMM runs at a fraction of the rate); CPUs have no such GEMM."""
    if g.device.type == "cuda" and g.dtype != torch.float32:
        grad_w.add_(torch.mm(g.t(), h, out_dtype=torch.float32))
    else:
        grad_w.addmm_(g.t().float(), h.float())


@_vocab_loss_backward_op.register_fake
def _(grad_out, hidden, weight, targets, lse, vocab_start, ignore_index, chunk, group, counter, seq_sharded):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden), torch.empty_like(weight)


def _vocab_loss_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, targets, *args = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(hidden, weight, targets, output[1])
    ctx.args = args
    _hold(ctx, *args[3:5])


def _vocab_loss_grad(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None) -> tuple:
    hidden, weight, targets, lse = ctx.saved_tensors
    grad_h, grad_w = _vocab_loss_backward_op(grad_out, hidden, weight, targets, lse, *ctx.args)
    return grad_h, grad_w, None, None, None, None, None, None, None


_vocab_loss_op.register_autograd(_vocab_loss_grad, setup_context=_vocab_loss_setup)


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
    counter: CommCounter | str | None = None,
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
    return _vocab_loss_op(hidden, weight, targets, vocab_start, ignore_index, chunk, *_names(group, counter), sequence_parallel)[0]
