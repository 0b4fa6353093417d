"""LM head + cross-entropy that never keeps [tokens, vocab] logits.

The plain path (``F.linear`` then ``F.cross_entropy(logits.float())``) keeps the fp32
log-softmax of every token for backward: 4 * V bytes per token, 16U at vocab 8 x hidden and 62U
for LLaMA3-8B (vocab 128256, hidden 4096), more than ten 4-bit decoder layers. Quantizing it is
not an option: the softmax's gradient is the difference of two nearly equal probabilities at every
vocabulary entry, which a 4- or 8-bit code of the logits loses first.

The fused path walks the tokens in chunks. For each chunk it computes the logits (in the hidden
dtype, upcast to fp32 exactly as the plain path does), the loss, and, still in forward, the
gradient with respect to the chunk's hidden states and the chunk's share of the LM-head weight
gradient; then the chunk's logits are freed. Backward only scales the two saved gradients by
``grad_output``. What autograd keeps is the hidden-state gradient ([tokens, hidden], the size of
the hidden states the plain path's GEMM keeps anyway) and the weight gradient ([vocab, hidden],
the gradient the backward would create at that point anyway).

With ``recompute=True`` (forced for ``reduction="none"``, whose per-token ``grad_output`` cannot
scale a precomputed weight gradient) the forward keeps the hidden states and targets instead and
the backward recomputes each chunk's logits: nothing vocab-sized is kept at all, for one more GEMM.

With ``weight_grad_in_forward=True`` nothing vocab-sized is kept and no GEMM is repeated: the
caller promises to backpropagate the returned loss with grad_output 1 (dividing it by ``divisor``
happens inside), so both gradients are computed in forward with their final scale, the weight's is
accumulated into ``weight.grad`` at once (through autograd: its post-accumulate hooks run, and an
8-bit gradient buffer folds it there and then), and backward returns the kept hidden-state
gradient after checking that promise. The bits are those of the recompute path.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from agoq.activation.ops import _norm_backward, _norm_forward
from agoq.compat import assert_on_device
from agoq.quant.pieces import piece_values

# A chunk's fp32 logits take at most this many bytes; the chunk's working set is about three times
# that (the logits in the hidden dtype, their fp32 log-probs turned in place into the gradient, and
# the gradient cast back). Some work is paid once per chunk whatever its size, in proportion to the
# weight (at least the pass over the fp32 [vocab, hidden] gradient sum), so small chunks are slow:
# the fused step's overhead over the plain path falls as chunks grow from 64 MiB to 256 MiB and
# beyond (benchmarks/results/loss.json, chunk_sweep). A GPU GEMM [chunk, hidden] x [hidden, vocab]
# also needs a few hundred rows to be compute-bound rather than bound by reading the weight.
# 256 MiB keeps the working set under 1 GiB, less than the plain path keeps at that vocab for
# 2048 tokens.
CHUNK_LOGITS_BYTES = 256 * 2**20
# ... and at most this many tokens per hidden unit. What a chunk costs beyond its GEMMs is fixed per
# chunk: a pass over the fp32 [vocab, hidden] weight-gradient sum it accumulates into. Two rows per
# hidden unit make that pass at most half the traffic of the chunk's fp32 logits, so the bound
# costs little speed (benchmarks/results/loss.json), while the working set stops growing with the micro-batch:
# without it a small vocabulary made a whole micro-batch one chunk, whose logits were then most
# of a small model's temporaries (32 MiB of them at 1024 tokens and vocab 4096, hidden 256).
CHUNK_ROWS_PER_HIDDEN = 2

REDUCTIONS = ("mean", "sum", "none")

# Elements of the reused blocks through which a low-precision weight gradient reaches its fp32 sum
# on a CPU (agoq.quant.pieces: a GPU's blocks are 2^24 elements, a 128K x 2048 head in 16 blocks, not 1,000).
_BLOCK_ELEMENTS = 2**21


def default_chunk_size(
    vocab: int, hidden: int, *, logits_bytes: int = CHUNK_LOGITS_BYTES, rows_per_hidden: int | None = CHUNK_ROWS_PER_HIDDEN
) -> int:
    """Tokens per chunk: at most ``rows_per_hidden`` x ``hidden`` (None: no such bound), and few
    enough that a chunk's fp32 logits fit in ``logits_bytes``."""
    if vocab < 1 or hidden < 1:
        raise ValueError(f"vocab and hidden must be positive, got {vocab} and {hidden}")
    rows = logits_bytes // (4 * vocab)
    if rows_per_hidden is not None:
        rows = min(rows, rows_per_hidden * hidden)
    # Multiples of 8 rows keep GEMM tiles whole; below 8 the budget is simply exceeded.
    return max(8, rows - rows % 8)


def plain_lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of hidden @ weight.T against targets, through full [tokens, vocab] logits (the reference path)."""
    _check_args(hidden, weight, targets, reduction, label_smoothing, chunk_size)
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(
        logits.float().flatten(0, -2),
        targets.flatten(),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.view(targets.shape) if reduction == "none" else loss


# The public signature repeats plain_lm_head_cross_entropy's on purpose: each stands in for the other.
def chunked_lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    recompute: bool = False,
    weight_grad_in_forward: bool = False,
    divisor: int = 1,
) -> torch.Tensor:
    """Cross-entropy of hidden @ weight.T against targets (divided by ``divisor``), equal to the plain path, keeping no logits.

    ``weight_grad_in_forward``: see the module docstring; it applies where the weight is a leaf
    that needs a gradient and the reduction is not 'none' (else the other paths run).
    """
    _check_args(hidden, weight, targets, reduction, label_smoothing, chunk_size)
    if not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be a positive integer (the micro-batches a loss is averaged over), got {divisor!r}")
    vocab = weight.shape[0]
    chunk = chunk_size if chunk_size is not None else default_chunk_size(vocab, weight.shape[1])
    grad_on = torch.is_grad_enabled()
    need_hidden = grad_on and hidden.requires_grad
    need_weight = grad_on and weight.requires_grad
    if weight_grad_in_forward and need_weight and weight.is_leaf and reduction != "none":
        # Eager only (it writes weight.grad in forward, which no traced graph can): the op checks
        # targets itself, so this path checks them here.
        _check_targets(targets, vocab, ignore_index)
        # The weight goes in a tuple, out of autograd's sight: as an input of the Function its
        # post-accumulate hooks would run again in backward (on the gradient already delivered).
        return _WeightGradInForwardLoss.apply(hidden, weight.detach(), targets, (weight,), ignore_index, reduction, label_smoothing, chunk, divisor)
    if recompute or reduction == "none":
        loss = _recomputed_loss_op(hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk)
    else:
        loss = _precomputed_loss_op(hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk, need_hidden, need_weight)[0]
    return loss if divisor == 1 else loss / divisor


def normed_lm_head_cross_entropy(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of RMSNorm(x) @ weight.T, keeping only x and the targets (the final norm is recomputed too).

    The chunked loss alone keeps the normed hidden states, and the final norm keeps its input
    beside them: two [tokens, hidden] tensors. Here backward recomputes the norm and the loss from
    x, so what is kept outside the decoder layers is x and the targets, nothing vocab-sized, for one
    more norm and the chunked loss's gradients computed in backward instead of forward (the same
    number of LM-head GEMMs as the recompute path).
    """
    _check_args(x, weight, targets, reduction, 0.0, chunk_size)
    return _normed_loss_op(x, norm_weight, weight, targets, eps, ignore_index, reduction, chunk_size)


# ---- the custom ops: one node each for torch.compile; the eager functions below are the definition --


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """t, or a new empty tensor where an op's gradient output is not wanted (an op returns no None)."""
    return like.new_empty(0) if t is None else t


def _loss_shape(targets: torch.Tensor, reduction: str) -> tuple[int, ...]:
    return tuple(targets.shape) if reduction == "none" else ()


@torch.library.custom_op("agoq::chunked_loss", mutates_args=())
def _precomputed_loss_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, its gradient of the hidden rows, of the weight), an empty tensor for a gradient not needed."""
    _check_targets(targets, weight.shape[0], ignore_index)
    loss, grad_h, grad_w = _precomputed_loss(hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk, need_hidden, need_weight)
    return loss, _or_empty(grad_h, hidden), _or_empty(grad_w, hidden)


@_precomputed_loss_op.register_fake
def _(hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk, need_hidden, need_weight):  # noqa: ANN001, ANN202
    grad_h = hidden.new_empty((targets.numel(), hidden.shape[-1])) if need_hidden else hidden.new_empty(0)
    grad_w = torch.empty_like(weight) if need_weight else hidden.new_empty(0)
    return hidden.new_empty((), dtype=torch.float32), grad_h, grad_w


def _precomputed_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, need_hidden, need_weight = inputs[0], inputs[7], inputs[8]
    _, grad_h, grad_w = output
    ctx.mark_non_differentiable(grad_h, grad_w)
    ctx.save_for_backward(grad_h if need_hidden else None, grad_w if need_weight else None)
    ctx.hidden_shape = hidden.shape


def _precomputed_grad(ctx: Any, grad_out: torch.Tensor, *_unused: torch.Tensor | None) -> tuple:
    grad_h, grad_w = ctx.saved_tensors
    gh = None if grad_h is None else (grad_h * grad_out).view(ctx.hidden_shape)
    gw = None if grad_w is None else grad_w * grad_out
    return gh, gw, None, None, None, None, None, None, None


_precomputed_loss_op.register_autograd(_precomputed_grad, setup_context=_precomputed_setup)


@torch.library.custom_op("agoq::chunked_loss_recompute", mutates_args=())
def _recomputed_loss_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float, chunk: int
) -> torch.Tensor:
    """The loss, keeping nothing (autograd keeps the inputs; backward recomputes each chunk's logits)."""
    _check_targets(targets, weight.shape[0], ignore_index)
    return _recomputed_loss(hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk)


@_recomputed_loss_op.register_fake
def _(hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk):  # noqa: ANN001, ANN202
    return hidden.new_empty(_loss_shape(targets, reduction), dtype=torch.float32)


@torch.library.custom_op("agoq::chunked_loss_recompute_backward", mutates_args=())
def _recomputed_loss_backward_op(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of hidden, grad of weight) of the recomputed loss, an empty tensor for one not needed."""
    gh, gw = _recomputed_grads(grad_out, hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk, need_hidden, need_weight)
    return _or_empty(gh, hidden), _or_empty(gw, hidden)


@_recomputed_loss_backward_op.register_fake
def _(grad_out, hidden, weight, targets, ignore_index, reduction, label_smoothing, chunk, need_hidden, need_weight):  # noqa: ANN001, ANN202
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)), (torch.empty_like(weight) if need_weight else hidden.new_empty(0))


def _recomputed_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    hidden, weight, targets, *args = inputs
    ctx.save_for_backward(hidden, weight, targets)
    ctx.args = tuple(args)


def _recomputed_grad(ctx: Any, grad_out: torch.Tensor) -> tuple:
    hidden, weight, targets = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    gh, gw = _recomputed_loss_backward_op(grad_out, hidden, weight, targets, *ctx.args, need_hidden, need_weight)
    return gh if need_hidden else None, gw if need_weight else None, None, None, None, None, None


_recomputed_loss_op.register_autograd(_recomputed_grad, setup_context=_recomputed_setup)


@torch.library.custom_op("agoq::normed_loss", mutates_args=())
def _normed_loss_op(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    eps: float,
    ignore_index: int,
    reduction: str,
    chunk_size: Optional[int],
) -> torch.Tensor:
    """Cross-entropy of RMSNorm(x) @ weight.T, keeping nothing (autograd keeps the inputs)."""
    _check_targets(targets, weight.shape[0], ignore_index)
    h, _ = _norm_forward(x, norm_weight, eps=eps)
    chunk = chunk_size if chunk_size is not None else default_chunk_size(weight.shape[0], weight.shape[1])
    if reduction == "none":
        return _recomputed_loss(h, weight, targets, ignore_index, reduction, 0.0, chunk)
    return _precomputed_loss(h, weight, targets, ignore_index, reduction, 0.0, chunk, False, False)[0]


@_normed_loss_op.register_fake
def _(x, norm_weight, weight, targets, eps, ignore_index, reduction, chunk_size):  # noqa: ANN001, ANN202
    return x.new_empty(_loss_shape(targets, reduction), dtype=torch.float32)


@torch.library.custom_op("agoq::normed_loss_backward", mutates_args=())
def _normed_loss_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    eps: float,
    ignore_index: int,
    reduction: str,
    chunk_size: Optional[int],
    need_x: bool,
    need_norm_weight: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of x, of the norm weight, of the LM-head weight), each recomputed from x; empty where not needed."""
    grads = _normed_loss_grads(
        grad_out, x, norm_weight, weight, targets, eps, ignore_index, reduction, chunk_size, need_x, need_norm_weight, need_weight
    )
    return tuple(_or_empty(g, x) for g in grads)  # type: ignore[return-value]


@_normed_loss_backward_op.register_fake
def _(grad_out, x, norm_weight, weight, targets, eps, ignore_index, reduction, chunk_size, need_x, need_norm_weight, need_weight):  # noqa: ANN001, ANN202
    return tuple(torch.empty_like(t) if need else x.new_empty(0) for t, need in ((x, need_x), (norm_weight, need_norm_weight), (weight, need_weight)))


def _normed_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, norm_weight, weight, targets, *args = inputs
    ctx.save_for_backward(x, norm_weight, weight, targets)
    ctx.args = tuple(args)


def _normed_grad(ctx: Any, grad_out: torch.Tensor) -> tuple:
    x, norm_weight, weight, targets = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    grads = _normed_loss_backward_op(grad_out, x, norm_weight, weight, targets, *ctx.args, *needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None)


_normed_loss_op.register_autograd(_normed_grad, setup_context=_normed_setup)


def _normed_loss_grads(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    eps: float,
    ignore_index: int,
    reduction: str,
    chunk_size: int | None,
    need_x: bool,
    need_norm_weight: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of the normed loss: the norm, then the chunked loss's gradients, then the norm's
    backward, in the order and arithmetic autograd gave them when the two were separate ops."""
    h, rstd = _norm_forward(x, norm_weight, eps=eps)
    need_h = need_x or need_norm_weight
    chunk = chunk_size if chunk_size is not None else default_chunk_size(weight.shape[0], weight.shape[1])
    if reduction == "none":
        gh, gw = _recomputed_grads(grad_out, h, weight, targets, ignore_index, reduction, 0.0, chunk, need_h, need_weight)
    else:
        _, grad_h, grad_w = _precomputed_loss(h, weight, targets, ignore_index, reduction, 0.0, chunk, need_h, need_weight)
        gh = None if grad_h is None else (grad_h * grad_out).view(h.shape)
        gw = None if grad_w is None else grad_w * grad_out
    if gh is None:
        return None, None, gw
    gx, gnw = _norm_backward(gh, x, rstd, norm_weight, x_dtype=x.dtype, need_weight_grad=need_norm_weight)
    return gx, gnw, gw


def loss_saved_bytes(
    tokens: int, hidden: int, vocab: int, dtype: torch.dtype, fused: bool, *, recompute: bool = False, weight_grad_in_forward: bool = False
) -> int:
    """Bytes autograd keeps for the LM head + cross-entropy of ``tokens`` tokens (no label smoothing, trainable head)."""
    if min(tokens, hidden, vocab) < 0:
        raise ValueError(f"tokens, hidden and vocab must be >= 0, got {tokens}, {hidden}, {vocab}")
    es = torch.empty((), dtype=dtype).element_size()
    index = torch.empty((), dtype=torch.long).element_size()
    if not fused:
        # The head GEMM keeps its input; log_softmax keeps its fp32 output; nll_loss keeps the
        # targets and a 0-dim fp32 total weight.
        return tokens * hidden * es + tokens * vocab * 4 + tokens * index + 4
    if weight_grad_in_forward:  # the hidden-state gradient only
        return tokens * hidden * es
    if recompute:
        return tokens * hidden * es + tokens * index
    # The hidden-state gradient, and the weight gradient in the weight's dtype (not per token).
    return tokens * hidden * es + vocab * hidden * es


def loss_work_bytes(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, fused: bool) -> int:
    """The most the LM head + cross-entropy's backward holds at once beside what it keeps (no label smoothing).

    Plain (``F.cross_entropy(logits.float())``): while the log-softmax's backward runs, the nll's
    fp32 gradient and its own, [tokens, vocab] each, beside the kept log-softmax. Fused: one chunk's
    fp32 logits and log-probabilities (a low-precision logits tensor is freed by its upcast, and the
    gradient is made in place of the log-probabilities), beside the whole hidden-state gradient.
    """
    if min(tokens, hidden, vocab) < 0:
        raise ValueError(f"tokens, hidden and vocab must be >= 0, got {tokens}, {hidden}, {vocab}")
    if not fused:
        return 2 * tokens * vocab * 4
    es = torch.empty((), dtype=dtype).element_size()
    rows = min(tokens, default_chunk_size(vocab, hidden)) if tokens else 0
    return 2 * rows * vocab * 4 + tokens * hidden * es


def _precomputed_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, gradient of the [tokens, hidden] rows, of the weight) with both gradients computed chunk
    by chunk in forward at grad_output 1 (backward only scales them)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    valid = t != ignore_index
    scale = _reduction_scale(valid, reduction)
    need_grad = need_hidden or need_weight
    grad_h = torch.empty_like(h) if need_hidden else None
    grad_w = _WeightGradSum(weight, chunks=-(-h.shape[0] // chunk)) if need_weight else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for _, loss_c in _by_chunk(h, weight, t, valid, label_smoothing, chunk, scale if need_grad else None, grad_h, grad_w):
        total += loss_c.sum()
    return total * scale, grad_h, None if grad_w is None else grad_w.result(weight.dtype)


class _WeightGradInForwardLoss(torch.autograd.Function):
    """Loss whose gradients are computed in forward with their final scale; the weight's is delivered
    to ``weight.grad`` there, the hidden states' kept for backward (grad_output must be 1)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, leaf, ignore_index, reduction, label_smoothing, chunk, divisor):
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        valid = t != ignore_index
        scale = _reduction_scale(valid, reduction)
        # What autograd's division by the divisor hands the recompute path as grad_output (1 / divisor
        # in fp32), times the reduction's scale in the same order: the same coefficient, so the
        # same gradients bit for bit.
        grad_out = torch.ones((), dtype=torch.float32, device=h.device) / divisor
        coef = grad_out * scale
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = _WeightGradSum(weight, chunks=-(-h.shape[0] // chunk))
        losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)  # summed at once, as the other paths do
        for s, loss_c in _by_chunk(h, weight, t, valid, label_smoothing, chunk, coef, grad_h, grad_w):
            losses[s : s + chunk] = loss_c
        torch.autograd.backward([leaf[0]], [grad_w.result(weight.dtype)])
        del grad_w
        ctx.save_for_backward(grad_h)
        ctx.hidden_shape = hidden.shape
        return losses.sum() * scale / divisor

    @staticmethod
    def backward(ctx, grad_out):
        # Checked on the device: a host read here would stall a GPU's queue every micro-batch.
        assert_on_device(
            (grad_out == 1).all(),
            "the loss was built with weight_grad_in_forward=True, which delivers the LM-head weight's gradient "
            "in forward for a grad_output of 1, but backward got another; "
            "pass divisor= instead of scaling the loss, or use recompute=True",
        )
        (grad_h,) = ctx.saved_tensors
        gh = None if grad_h is None else grad_h.view(ctx.hidden_shape)
        return gh, None, None, None, None, None, None, None, None


def _recomputed_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float, chunk: int
) -> torch.Tensor:
    """The loss alone, a chunk's logits at a time (its gradients come from :func:`_recomputed_grads`)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    valid = t != ignore_index
    losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for s, loss_c in _by_chunk(h, weight, t, valid, label_smoothing, chunk, None, None, None):
        losses[s : s + chunk] = loss_c
    if reduction == "none":
        return losses.view(targets.shape)
    return losses.sum() * _reduction_scale(valid, reduction)


def _recomputed_grads(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad of hidden, grad of weight) of the loss at ``grad_out``, each chunk's logits recomputed."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    valid = t != ignore_index
    coef = grad_out.reshape(-1) if reduction == "none" else grad_out * _reduction_scale(valid, reduction)
    grad_h = torch.empty_like(h) if need_hidden else None
    grad_w = _WeightGradSum(weight, chunks=-(-h.shape[0] // chunk)) if need_weight else None
    for _ in _by_chunk(h, weight, t, valid, label_smoothing, chunk, coef, grad_h, grad_w):
        pass
    gh = None if grad_h is None else grad_h.view(hidden.shape)
    gw = None if grad_w is None else grad_w.result(weight.dtype)
    return gh, gw


def _by_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    label_smoothing: float,
    chunk: int,
    coef: torch.Tensor | None,
    grad_h: torch.Tensor | None,
    grad_w: "_WeightGradSum | None",
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, per-token fp32 losses) of each chunk of ``h`` in turn: the one walk over the chunks
    of every path. Given ``coef`` (0-dim, or one per token), each chunk's logit gradient has gone into
    its rows of ``grad_h`` and into ``grad_w`` (where given) before the chunk is yielded, and is freed."""
    for s in range(0, h.shape[0], chunk):
        h_c = h[s : s + chunk]
        coef_c = coef[s : s + chunk] if coef is not None and coef.dim() else coef
        loss_c, g = _chunk_loss_and_logit_grad(h_c, weight, targets[s : s + chunk], valid[s : s + chunk], label_smoothing, coef_c)
        if g is not None:
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[s : s + chunk])
            if grad_w is not None:
                grad_w.add(g, h_c)
            del g
        yield s, loss_c


def _chunk_loss_and_logit_grad(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    label_smoothing: float,
    coef: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token fp32 losses of one chunk and, given coef, d(sum coef * loss)/d(logits) in h's dtype."""
    # Same arithmetic as the plain path: logits rounded to the hidden dtype, then fp32 log_softmax.
    logp = torch.log_softmax(F.linear(h, weight).float(), dim=-1)
    safe = torch.where(valid, targets, 0).unsqueeze(1)
    loss = -logp.gather(1, safe).squeeze(1)
    eps = label_smoothing
    vocab = logp.shape[1]
    if eps > 0:
        # F.cross_entropy: (1 - eps) * nll + eps / V * (-sum of log-probs), ignored tokens excluded.
        loss = (1 - eps) * loss - (eps / vocab) * logp.sum(dim=1)
    loss = torch.where(valid, loss, 0.0)
    if coef is None:
        return loss, None
    grad = logp.exp_()
    grad.scatter_add_(1, safe, torch.full_like(safe, -(1 - eps), dtype=grad.dtype))
    if eps > 0:
        grad.sub_(eps / vocab)
    # where, not a product: with every token ignored, mean's coef is 1/0 and must not reach a row.
    grad.mul_(torch.where(valid, coef, 0.0).unsqueeze(1))
    return loss, grad.to(h.dtype)


class _WeightGradSum:
    """The sum over chunks of g.T @ h, the LM-head weight gradient: in fp32, or with one chunk
    the product itself in g's dtype."""

    def __init__(self, weight: torch.Tensor, chunks: int) -> None:
        # Allocated at the first add, not before: the first chunk's logits and log-probs then never
        # coexist with it (with one chunk, as for a short micro-batch, the peak drops by a third).
        self.weight = weight
        self.chunks = chunks
        self.total: torch.Tensor | None = None
        vocab, hidden = weight.shape
        # Low-precision products go through small reused blocks of vocab rows: one [vocab, hidden]
        # temporary per chunk, plus its mixed-dtype add, cost as much as the GEMM itself on CPU.
        self.rows = min(vocab, max(1, piece_values(weight.device, _BLOCK_ELEMENTS) // hidden))

    def add(self, g: torch.Tensor, h: torch.Tensor) -> None:
        """Add one chunk's g.T @ h ([chunk, vocab] and [chunk, hidden])."""
        w = self.weight
        if g.dtype == torch.float32 or self.chunks == 1:
            # One chunk (a short micro-batch): the product is the gradient, rounded once into g's
            # dtype as the plain path's GEMM rounds it; no fp32 sum and no blocks (for a bf16
            # vocab 4096 x hidden 256 head they were 10 MiB of a 12 MiB peak of temporaries).
            if self.total is None:
                self.total = g.t().mm(h)
            else:
                self.total.addmm_(g.t(), h)
            return
        if self.total is None:
            self.total = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            self.block = torch.empty(self.rows, w.shape[1], dtype=w.dtype, device=w.device)
            self.block32 = torch.empty(self.rows, w.shape[1], dtype=torch.float32, device=w.device)
        # Each block's product is rounded to g's dtype once, as the plain path's single GEMM is,
        # and summed over chunks in fp32, so the error stays within one rounding per chunk.
        gt = g.t()
        for v in range(0, gt.shape[0], self.rows):
            n = min(self.rows, gt.shape[0] - v)
            torch.mm(gt[v : v + n], h, out=self.block[:n])
            self.block32[:n].copy_(self.block[:n])
            self.total[v : v + n].add_(self.block32[:n])

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The summed gradient in ``dtype`` (zeros if no chunk was added)."""
        if self.total is None:
            return torch.zeros(self.weight.shape, dtype=dtype, device=self.weight.device)
        return self.total if self.total.dtype == dtype else self.total.to(dtype)


def _reduction_scale(valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """The factor from summed token losses to the reduced loss: 1/valid tokens for mean (inf for none, as torch's NaN)."""
    if reduction == "mean":
        return valid.sum().float().reciprocal()
    return torch.ones((), dtype=torch.float32, device=valid.device)


def _check_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str,
    label_smoothing: float,
    chunk_size: int | None,
) -> None:
    """Raise a ValueError naming the bad argument and the fix."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dimension must equal weight's hidden size {weight.shape[1]}, got hidden shape {tuple(hidden.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one floating dtype; cast one of them")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 class indices, got {targets.dtype}; use targets.long()")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive number of tokens or None (default from the vocab), got {chunk_size!r}")


def _check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Fail if a target that is not ignore_index lies outside [0, vocab): on a GPU a device-side
    assert (no host read in the hot path), on a CPU a ValueError naming the first such target."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    message = f"a target is out of range for vocab {vocab} (ignore_index is {ignore_index})"
    try:
        assert_on_device(~bad.any(), message)
    except RuntimeError:
        # Raised at once where the check is not deferred (a CPU): the value can be named.
        value = int(targets[bad][0])
        raise ValueError(f"target {value} is out of range for vocab {vocab} (ignore_index is {ignore_index})") from None
