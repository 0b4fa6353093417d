"""The operations of a decoder layer whose saved tensors a policy controls.

With ``fmt=None`` each op is the bf16 baseline: what Megatron-LM with its fused RMSNorm keeps (the
norm saves its input in the compute dtype and an fp32 rstd per token; every GEMM saves its input).
With a format, the fused LAAQ ops (METHOD.md part 1) keep only the named tensor, quantized, and
recompute what follows it in backward:

- :func:`rms_norm_linear`: keeps the quantized norm input; backward recomputes rstd, the norm and
  the GEMM input;
- :func:`swiglu_linear`: keeps quantized gate and up; backward recomputes SiLU(gate) * up;
- :func:`saved_input_linear`: keeps its input quantized, unless the attention core already keeps
  that very storage at full precision (then a quantized copy would be pure extra memory);
- :func:`causal_attention`: stores the attention core's saved tensors quantized (the ``uniform4``
  ablation).

Forward outputs are the baseline's bit for bit; only gradients see the quantization. (Under the
Triton backend of :mod:`agoq.quant.backend`, the fused norm and SwiGLU kernels reduce and
exponentiate in their own order: outputs then agree within the rounding of their dtype; the saved
codes stay bit-identical.) Every op sets the kind of what it saves for :mod:`agoq.activation.meter`.

The fused ops are ``torch.library`` custom ops (namespace ``agoq``) with fake kernels and registered
autograd, so torch.compile sees each as one graph node (docs/ARCHITECTURE.md); what they run is the
eager code below, the definition a compiled graph must equal.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from agoq.activation.lora import (
    ChunkedLoraBackward,
    LoraAdapter,
    dense_weight,
    lora_backward_rows,
    lora_forward,
    lora_grad_a_input,
    lora_weight_grads,
    mask_bytes,
    out_features,
)
from agoq.activation.layouts import Layout, SavedAdapter, adapter_arguments, arguments_of, saved_adapters
from agoq.activation.meter import meter_scope
from agoq.compat import outer_saved_tensor_hooks
from agoq.quant import QTensor, QuantFormat, backend, dequantize, parse_format, quantize
from agoq.quant.formats import stored_row
from agoq.quant.pieces import sized_for_kernels

# Set on an attention output whose storage the attention core itself keeps unquantized for
# backward; saved_input_linear then saves a view of it instead of a quantized copy.
_KEPT_BY_ATTENTION = "_agoq_kept_by_attention"


# ---- the one RMSNorm implementation (forward, backward) ----------------------------------------


def _norm_forward(x: torch.Tensor, weight: torch.Tensor, *, eps: float, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x) * weight in out_dtype, fp32 rstd [..., 1]); statistics in fp32."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _declared(xf * rstd * weight.float(), out_dtype or x.dtype), rstd


def _norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, *, x_dtype: torch.dtype, need_weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad of x in x_dtype, grad of weight in its dtype) of RMSNorm, computed in fp32.

    In place where a temporary is done with (the same products and differences, so the same
    bits): eagerly three [rows, hidden] fp32 tensors besides the arguments, where the expression
    form held four.
    """
    y = x.float() * rstd
    g = grad_out.float()
    gw = (g * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype) if need_weight_grad else None
    gy = g * weight.float()
    del g
    # d(x * rstd)/dx^T v = rstd * (v - y * mean(y * v)): rstd depends on x through mean(x^2).
    dot = (gy * y).mean(-1, keepdim=True)
    gx = gy.sub_(y.mul_(dot)).mul_(rstd)
    return gx.to(x_dtype), gw


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """[..., features] as [tokens, features]."""
    return t.reshape(-1, t.shape[-1])


def _quantize_saved(t: torch.Tensor, fmt: QuantFormat) -> QTensor:
    # A NaN/Inf in an activation must reach the gradients as NaN, not fail the forward pass.
    return quantize(t, fmt, nonfinite="propagate")


def _fake_codes(x: torch.Tensor, fmt: QuantFormat) -> list[torch.Tensor]:
    """Empty [packed codes, block scales] of x in fmt: what a fake kernel returns for a quantized x."""
    n = fmt.stored_numel(x.shape)
    return [x.new_empty(fmt.payload_bytes(n), dtype=torch.uint8), x.new_empty(fmt.num_blocks(n), dtype=torch.float32)]


def _declared(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An op's output in the dtype it declares. Under autocast the GEMMs inside an op run in
    autocast's dtype; the output keeps the declared one, so a compiled graph's shapes and dtypes
    hold, and the backward reads gradients in the dtype of its weights.

    Never a no-op ``.to``: one returns its input itself, and torch 2.11's Dynamo, tracing an
    autograd.Function (``_RMSNorm``) whose output is that same tensor as an intermediate, gives
    it zero gradients, silently (2.13 traces it right; tests/test_compile_native.py catches it)."""
    return out if out.dtype == dtype else out.to(dtype)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """t, or an empty tensor where a custom op's output is not wanted (an op cannot return None)."""
    return like.new_empty(0, dtype=torch.float32) if t is None else t


def _norm_kernels(device: torch.device, fmt: QuantFormat, hidden: int) -> Any:
    """The fused Triton norm kernels when agoq.quant.backend selects them for this layer, else None."""
    kernels = backend.layer_kernels(device, fmt)
    return kernels if kernels is not None and kernels.norm_supported(hidden, fmt) else None


class _RMSNorm(torch.autograd.Function):
    """Baseline fused RMSNorm: saves its input (compute dtype) and the fp32 rstd, like Megatron's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _norm_forward(x, weight, eps=eps)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd, weight = ctx.saved_tensors
        gx, gw = _norm_backward(grad_out, x, rstd, weight, x_dtype=x.dtype, need_weight_grad=ctx.needs_input_grad[1])
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics, output in x's dtype."""
    with meter_scope(kind="norm_input"):
        return _RMSNorm.apply(x, weight, eps)


# ---- norm + linear -------------------------------------------------------------------------------


def _norm_linear_forward(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weights: Sequence[torch.Tensor],
    eps: float,
    fmt: QuantFormat,
    adapters: Sequence[SavedAdapter] = (),
) -> tuple[tuple[torch.Tensor, ...], QTensor, list[torch.Tensor]]:
    """(RMSNorm(x) times each weight plus its adapters, quantized x, packed dropout masks): the fused forward."""
    kernels = _norm_kernels(x.device, fmt, x.shape[-1])
    if kernels is not None:  # one pass writes the norm output and the quantized input
        h, q = kernels.rms_norm_quantize(x, norm_weight, eps, fmt)
    else:
        h, _ = _norm_forward(x, norm_weight, eps=eps)
        q = _quantize_saved(x, fmt)
    outs = [F.linear(h, dense_weight(w, h.dtype)) for w in weights]
    masks = []
    # Adapters in PEFT's order (projection by projection), so dropout draws PEFT's masks.
    for s in adapters:
        outs[s.target], mask = lora_forward(h, outs[s.target], s.adapter)
        masks.append(mask)
    return tuple(outs), q, masks


def _norm_output_grad(outputs: Sequence[torch.Tensor | None], dense: Sequence[torch.Tensor], r0: int, r1: int, width: int) -> torch.Tensor:
    """Rows r0 .. r1 of the gradient of the norm output, fp32: every GEMM's share (adapters add theirs after)."""
    grad_h = None
    for g, w in zip(outputs, dense):
        if g is not None:
            share = F.linear(g[r0:r1], w.t())
            # The first share is the sum so far (0 + share's bits): no zero-filled buffer to add it to.
            grad_h = share.float() if grad_h is None else grad_h.add_(share)
    return torch.zeros((r1 - r0, width), dtype=torch.float32, device=dense[0].device) if grad_h is None else grad_h


def _norm_linear_backward(
    grads: Sequence[torch.Tensor | None],
    q: QTensor,
    norm_weight: torch.Tensor,
    weights: Sequence[torch.Tensor],
    eps: float,
    need_norm_weight: bool,
    need_weights: Sequence[bool],
    adapters: Sequence[SavedAdapter] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None], list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """(grad of x, of the norm weight or None, of each weight or None, (grad of A, of B) of each adapter)
    of the fused norm + GEMMs."""
    payload, shape, dtype, fmt = q.payload, q.shape, q.dtype, q.fmt
    width = shape[-1]
    kernels = _norm_kernels(payload.device, fmt, width)
    if kernels is None:
        recompute = backend.formula(_norm_forward, payload.device, eps=eps, out_dtype=dtype)
        norm_backward = backend.formula(_norm_backward, payload.device, x_dtype=dtype, need_weight_grad=need_norm_weight)
    grad_x = torch.empty(shape, dtype=dtype, device=payload.device)
    grad_rows = _tokens(grad_x)
    outputs = [None if g is None else _tokens(g) for g in grads]
    need_weight_grads = [g is not None and need for g, need in zip(outputs, need_weights)]
    lora = ChunkedLoraBackward([(outputs[s.target], s.adapter, s.mask, s.need_a, s.need_b) for s in adapters if outputs[s.target] is not None])
    # A dequantized 4-bit base weight lives for this backward only, never saved.
    dense = [dense_weight(w, dtype) for w in weights]
    # The recomputed norm output of every token in the compute dtype (what the bf16 policy saves):
    # weight gradients are then whole GEMMs, with no fp32 accumulator of a weight's size.
    h_all = torch.empty(grad_rows.shape, dtype=dtype, device=payload.device) if any(need_weight_grads) else None
    grad_norm_weight: torch.Tensor | None = None
    # A chunk of rows at a time, as the SwiGLU backward: the norm's fp32 recompute and backward
    # then hold a chunk's rows, not every token's.
    for r0, r1 in _row_chunks(grad_rows.shape[0], width, fmt.block_size, payload.device, NORM_CHUNK_VALUES):
        q_rows = q.rows(r0, r1)
        if kernels is not None:  # dequantize + norm recompute in one pass; fp32 x never exists
            x = None  # the kernels write h and the grad of x into their rows: no copy pass after
            h, rstd = kernels.rms_norm_recompute(q_rows, norm_weight, eps, dtype, out=None if h_all is None else h_all[r0:r1])
        else:
            # Under the compiled backend the recompute is one fused loop (and so is the backward
            # below); its reductions may sum in another order: h agrees within dtype rounding.
            x = dequantize(q_rows, torch.float32)
            h, rstd = recompute(x, norm_weight)
        if h_all is not None and x is not None:
            h_all[r0:r1].copy_(h)
        grad_h = _norm_output_grad(outputs, dense, r0, r1, width)
        lora.add_rows(grad_h, h, r0)  # the adapters' shares of grad_h, and their gradients from h's rows
        del h
        if x is None:
            gx, gw = kernels.rms_norm_backward(grad_h, q_rows, rstd, norm_weight, dtype, need_norm_weight, out=grad_rows[r0:r1])
        else:
            gx, gw = norm_backward(grad_h, x, rstd, norm_weight)
            grad_rows[r0:r1].copy_(gx)
        if gw is not None:
            grad_norm_weight = gw.float() if grad_norm_weight is None else grad_norm_weight.add_(gw)
        del gx, gw, grad_h, x
    weight_grads = [g.t().mm(h_all).to(w.dtype) if need else None for g, w, need in zip(outputs, weights, need_weight_grads)]
    live_grads = iter(lora.grads())
    lora_grads = [next(live_grads) if outputs[s.target] is not None else (None, None) for s in adapters]
    if grad_norm_weight is not None:
        grad_norm_weight = grad_norm_weight.to(norm_weight.dtype)
    return grad_x, grad_norm_weight, weight_grads, lora_grads


def _fake_masks(x: torch.Tensor, lora_p: Sequence[float]) -> list[torch.Tensor]:
    """Empty packed dropout masks over x (1 bit per element), or empty tensors where p is 0."""
    width = x.shape[-1]
    return [x.new_empty(mask_bytes(x.numel() // width, width) if p > 0 else 0, dtype=torch.uint8) for p in lora_p]


def _no_grad(values: Sequence[Any]) -> list | None:
    """The gradient of a list argument of numbers: None, or an empty list for an empty one (autograd's pytree sees [] as a list of tensors)."""
    return None if values else []


def _or_none(grads: Sequence[torch.Tensor], wanted: Sequence[bool]) -> list[torch.Tensor | None]:
    return [g if want else None for g, want in zip(grads, wanted)]


def _fake_grad(t: torch.Tensor, wanted: bool) -> torch.Tensor:
    """A fake kernel's gradient of ``t``: its shape where wanted, else the empty tensor the op returns."""
    return torch.empty_like(t) if wanted else t.new_empty(0)


def _adapter_grads(grads: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]], like: torch.Tensor) -> list:
    """A backward op's adapter outputs: every A's gradient, then every B's (empty where not computed)."""
    return [_or_empty(ga, like) for ga, _ in grads] + [_or_empty(gb, like) for _, gb in grads]


# What a forward op takes of its adapters, and what its backward op takes besides.
FORWARD_ADAPTER_ARGS = ("lora_a", "lora_b", "lora_scale", "lora_p")
BACKWARD_ADAPTER_ARGS = (*FORWARD_ADAPTER_ARGS, "masks", "need_a", "need_b")

# norm + linear: what autograd keeps, and what the backward op returns.
NORM_LINEAR_SAVED = Layout("payload", "scales", "masks*", "norm_weight", "weights*", "lora_a*", "lora_b*")
NORM_LINEAR_GRADS = Layout("x", "norm_weight", "weights*", "lora_a*", "lora_b*")


def _norm_linear_impl(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weights: list[torch.Tensor],
    eps: float,
    fmt: str,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    lora_target: list[int],
    lora_scale: list[float],
    lora_p: list[float],
) -> list[torch.Tensor]:
    """[RMSNorm(x) times each weight plus its adapters..., x's packed codes, x's block scales, each adapter's packed dropout mask...]."""
    adapters = saved_adapters(lora_a, lora_b, lora_scale, lora_p, lora_target)
    outs, q, masks = _norm_linear_forward(x, norm_weight, weights, eps, parse_format(fmt), adapters)
    return [*(_declared(o, x.dtype) for o in outs), q.payload, q.scales, *masks]


_norm_linear_op = torch.library.custom_op("agoq::norm_linear", mutates_args=())(_norm_linear_impl)
_norm_linear_args = arguments_of(_norm_linear_impl)


@_norm_linear_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _norm_linear_args(*args, **kwargs)
    outs = [a.x.new_empty((*a.x.shape[:-1], out_features(w))) for w in a.weights]
    return outs + _fake_codes(a.x, parse_format(a.fmt)) + _fake_masks(a.x, a.lora_p)


def _norm_linear_backward_impl(
    grads: list[Optional[torch.Tensor]],
    payload: torch.Tensor,
    scales: torch.Tensor,
    norm_weight: torch.Tensor,
    weights: list[torch.Tensor],
    shape: list[int],
    dtype: torch.dtype,
    eps: float,
    fmt: str,
    need_norm_weight: bool,
    need_weights: list[bool],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    lora_target: list[int],
    lora_scale: list[float],
    lora_p: list[float],
    masks: list[torch.Tensor],
    need_a: list[bool],
    need_b: list[bool],
) -> list[torch.Tensor]:
    """NORM_LINEAR_GRADS: [grad of x, of the norm weight, of each weight, of each adapter's A, of each adapter's B], an empty tensor for each one not needed."""
    q = QTensor(payload, scales, torch.Size(shape), dtype, parse_format(fmt))
    adapters = saved_adapters(lora_a, lora_b, lora_scale, lora_p, lora_target, masks, need_a, need_b)
    gx, gnw, gws, lora_grads = _norm_linear_backward(grads, q, norm_weight, weights, eps, need_norm_weight, need_weights, adapters)
    return [gx, *(_or_empty(g, payload) for g in (gnw, *gws)), *_adapter_grads(lora_grads, payload)]


_norm_linear_backward_op = torch.library.custom_op("agoq::norm_linear_backward", mutates_args=())(_norm_linear_backward_impl)
_norm_linear_backward_args = arguments_of(_norm_linear_backward_impl)


@_norm_linear_backward_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _norm_linear_backward_args(*args, **kwargs)
    adapters = saved_adapters(a.lora_a, a.lora_b, a.lora_scale, a.lora_p, a.lora_target, a.masks, a.need_a, a.need_b)
    live = [a.grads[s.target] is not None for s in adapters]
    flat, _ = NORM_LINEAR_GRADS.flatten(
        x=a.payload.new_empty(a.shape, dtype=a.dtype),
        norm_weight=_fake_grad(a.norm_weight, a.need_norm_weight),
        weights=[_fake_grad(w, g is not None and need) for w, g, need in zip(a.weights, a.grads, a.need_weights)],
        lora_a=[_fake_grad(s.adapter.a, s.need_a and ok) for s, ok in zip(adapters, live)],
        lora_b=[_fake_grad(s.adapter.b, s.need_b and ok) for s, ok in zip(adapters, live)],
    )
    return flat


def _norm_linear_setup(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    a = _norm_linear_args(*inputs)
    n = len(a.weights)
    ctx.mark_non_differentiable(*output[n:])
    ctx.set_materialize_grads(False)
    payload, scales, *masks = output[n:]
    flat, ctx.lengths = NORM_LINEAR_SAVED.flatten(
        payload=payload, scales=scales, masks=masks, norm_weight=a.norm_weight, weights=a.weights, lora_a=a.lora_a, lora_b=a.lora_b
    )
    ctx.save_for_backward(*flat)
    ctx.meta = (list(a.x.shape), a.x.dtype, a.eps, a.fmt, list(a.lora_target), list(a.lora_scale), list(a.lora_p))


def _norm_linear_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    shape, dtype, eps, fmt, lora_target, lora_scale, lora_p = ctx.meta
    saved = NORM_LINEAR_SAVED.unflatten(ctx.saved_tensors, ctx.lengths)
    n = len(saved.weights)
    need = _norm_linear_args(*ctx.needs_input_grad)
    adapters = saved_adapters(saved.lora_a, saved.lora_b, lora_scale, lora_p, lora_target, saved.masks, need.lora_a, need.lora_b)
    outs = _norm_linear_backward_op(
        list(grads[:n]), saved.payload, saved.scales, saved.norm_weight, saved.weights, shape, dtype, eps, fmt,
        need.norm_weight, list(need.weights), lora_target=lora_target, **adapter_arguments(adapters, *BACKWARD_ADAPTER_ARGS),
    )  # fmt: skip
    out = NORM_LINEAR_GRADS.unflatten(outs, (n, len(adapters), len(adapters)))
    live = [grads[s.target] is not None for s in adapters]
    return (
        out.x,
        out.norm_weight if need.norm_weight else None,
        _or_none(out.weights, [g is not None and w for g, w in zip(grads, need.weights)]),
        None,
        None,
        _or_none(out.lora_a, [s.need_a and ok for s, ok in zip(adapters, live)]),
        _or_none(out.lora_b, [s.need_b and ok for s, ok in zip(adapters, live)]),
        _no_grad(lora_target),
        _no_grad(lora_scale),
        _no_grad(lora_p),
    )


_norm_linear_op.register_autograd(_norm_linear_grad, setup_context=_norm_linear_setup)


def _saved_adapters_of(adapters: Sequence[Sequence[LoraAdapter]]) -> list[SavedAdapter]:
    """Adapters given per weight as records, in that order (PEFT's: projection by projection)."""
    return [SavedAdapter(ad, target) for target, ads in enumerate(adapters) for ad in ads]


def _plain_lora(x: torch.Tensor, out: torch.Tensor, adapters: Sequence[LoraAdapter]) -> torch.Tensor:
    """out plus each adapter's update through autograd (the unfused path: PEFT's own saved tensors)."""
    for ad in adapters:
        xa = x.to(ad.a.dtype)
        out = out + (F.linear(F.linear(F.dropout(xa, ad.dropout, training=ad.dropout > 0), ad.a), ad.b) * ad.scale).to(out.dtype)
    return out


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weights: Sequence[torch.Tensor],
    fmt: QuantFormat | None,
    adapters: Sequence[Sequence[LoraAdapter]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """RMSNorm(x) times each weight (transposed) plus its LoRA adapters; with fmt, saves only quantized x."""
    adapters = adapters or [()] * len(weights)
    if fmt is None:
        h = rms_norm(x, norm_weight, eps)
        with meter_scope(kind="gemm_input"):
            # One GEMM per weight: a fused [q|k|v] GEMM would make v a view of one buffer, and
            # attention saving v would then keep q's and k's GEMM outputs alive as well.
            return tuple(_plain_lora(h, F.linear(h, dense_weight(w, h.dtype)), ads) for w, ads in zip(weights, adapters))
    with meter_scope(kind="norm_input"):
        records = _saved_adapters_of(adapters)
        args = adapter_arguments(records, "lora_target", *FORWARD_ADAPTER_ARGS)
        return tuple(_norm_linear_op(x, norm_weight, list(weights), eps, fmt.name, **args)[: len(weights)])


# ---- SwiGLU + linear -----------------------------------------------------------------------------

# max |d/dz SiLU(z)| = 1.0998 (at z = +-2.40) and max |d2/dz2 SiLU(z)| = 0.5 (at z = 0): the
# Lipschitz constants of the recomputation, used by the error bounds in the tests.
SILU_MAX_SLOPE = 1.0999
SILU_MAX_CURVATURE = 0.5


def _swiglu_linear_forward(
    gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor, fmt: QuantFormat, adapters: Sequence[SavedAdapter] = ()
) -> tuple[torch.Tensor, QTensor, QTensor, list[torch.Tensor]]:
    """((SiLU(gate) * up) times down_weight plus its adapters, quantized gate, quantized up, packed dropout masks)."""
    kernels = backend.kernels(gate.device, fmt) if gate.shape == up.shape and gate.dtype == up.dtype else None
    if kernels is not None:  # Triton or compiled code: one pass writes SiLU(gate) * up and the quantized gate and up
        act, qg, qu = kernels.swiglu_quantize(gate, up, fmt)
        out = F.linear(act, dense_weight(down_weight, act.dtype))
    else:
        # SiLU(gate) * up a chunk of rows at a time into one buffer: SiLU(gate) is never a whole
        # [tokens, intermediate] temporary (elementwise, so the product is the same bits).
        act = torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))
        rows, g2, u2 = _tokens(act), _tokens(gate), _tokens(up)
        for r0, r1 in _row_chunks(rows.shape[0], rows.shape[1], fmt.block_size, gate.device, SWIGLU_CHUNK_VALUES):
            torch.mul(F.silu(g2[r0:r1]), u2[r0:r1], out=rows[r0:r1])
        out = F.linear(act, dense_weight(down_weight, act.dtype))
        del rows
        qg, qu = _quantize_saved(gate, fmt), _quantize_saved(up, fmt)
    masks = []
    for s in adapters:
        out, mask = lora_forward(act, out, s.adapter)
        masks.append(mask)
    return out, qg, qu, masks


def _swiglu_linear_backward(
    grad_out: torch.Tensor,
    qg: QTensor,
    qu: QTensor,
    down_weight: torch.Tensor,
    need_down: bool,
    adapters: Sequence[SavedAdapter] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """(grad of gate, of up, of down_weight or None, (grad of A, of B) of each adapter) of the fused SwiGLU + GEMM."""
    need_act = need_down or any(s.need_a or s.need_b for s in adapters)
    gp, gshape, gdtype, ushape, udtype, fmt = qg.payload, qg.shape, qg.dtype, qu.shape, qu.dtype, qg.fmt
    act_dtype = grad_out.dtype if need_act else None
    kernels = backend.layer_kernels(gp.device, fmt) if gdtype == udtype == grad_out.dtype else None
    constants = {"act_dtype": act_dtype, "gate_dtype": gdtype, "up_dtype": udtype}
    formula = None if kernels is not None else backend.formula(_swiglu_backward, gp.device, **constants)
    # Compiled code dequantizes gate and up inside the formula's graph: no fp32 copy of them.
    of_codes = None if kernels is not None else backend.formula_reading_codes(_swiglu_backward, gp.device, fmt, (1, 2), **constants)
    # Eagerly the formula writes both gradients straight into their rows; compiled code returns
    # them (writing into arguments inside a graph splits its fused loop).
    eager = formula is not None and backend.resolve(gp.device) == "torch"
    go = _tokens(grad_out)
    width = gshape[-1]
    grad_gate = torch.empty(gshape, dtype=gdtype, device=gp.device)
    grad_up = torch.empty(ushape, dtype=udtype, device=gp.device)
    gate_rows, up_rows = _tokens(grad_gate), _tokens(grad_up)
    # The gradient of SiLU(gate) * up in one GEMM, the tensor the bf16 policy's backward makes
    # too. Each chunk's recomputed SiLU(gate) * up then overwrites the rows it was computed
    # from, so the down-weight gradient is one GEMM as well: whole GEMMs, and the recompute's
    # fp32 temporaries still a chunk's rows (row-chunked GEMMs cost more: benchmarks/op_overhead.py).
    grad_act = F.linear(go, dense_weight(down_weight, go.dtype).t())
    a_inputs = [lora_grad_a_input(go, s.adapter) for s in adapters]
    for s, ga_in in zip(adapters, a_inputs):
        lora_backward_rows(s.adapter, s.mask, ga_in, 0, grad=grad_act)
    into_rows = eager or kernels is not None  # the gradients written into their rows, not copied there
    for r0, r1 in _row_chunks(go.shape[0], width, fmt.block_size, gp.device, SWIGLU_CHUNK_VALUES):
        grad_act_rows = grad_act[r0:r1]
        g_chunk, u_chunk = qg.rows(r0, r1), qu.rows(r0, r1)
        if kernels is not None:  # dequantize, recompute SiLU(gate) * up and both gradients in one pass, into their rows
            act, gg, gu = kernels.swiglu_backward(grad_act_rows, g_chunk, u_chunk, gdtype, act_dtype, out=(gate_rows[r0:r1], up_rows[r0:r1]))
        elif of_codes is not None and g_chunk.whole_blocks and u_chunk.whole_blocks:  # a chunk is, except maybe the last
            act, gg, gu = of_codes(grad_act_rows, g_chunk, u_chunk)
        else:
            # Arguments passed without names, so the formula can drop each after its last use.
            into = {"out": (gate_rows[r0:r1], up_rows[r0:r1])} if eager else {}
            act, gg, gu = formula(grad_act_rows, dequantize(g_chunk, torch.float32), dequantize(u_chunk, torch.float32), **into)
        if not into_rows:
            gate_rows[r0:r1].copy_(gg)
            up_rows[r0:r1].copy_(gu)
        del gg, gu
        if act is not None:
            grad_act_rows.copy_(act)
        del act, grad_act_rows
    grad_down = go.t().mm(grad_act).to(down_weight.dtype) if need_down else None
    lora_grads = [lora_weight_grads(go, ga_in, grad_act, s.adapter, s.mask, s.need_a, s.need_b) for s, ga_in in zip(adapters, a_inputs)]
    return grad_gate, grad_up, grad_down, lora_grads


# SwiGLU + linear: what autograd keeps, and what the backward op returns.
SWIGLU_LINEAR_SAVED = Layout("gate_payload", "gate_scales", "up_payload", "up_scales", "masks*", "down_weight", "lora_a*", "lora_b*")
SWIGLU_LINEAR_GRADS = Layout("gate", "up", "down_weight", "lora_a*", "lora_b*")


def _swiglu_linear_impl(
    gate: torch.Tensor,
    up: torch.Tensor,
    down_weight: torch.Tensor,
    fmt: str,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    lora_scale: list[float],
    lora_p: list[float],
) -> list[torch.Tensor]:
    """[(SiLU(gate) * up) times down_weight plus its adapters, gate's codes, gate's scales, up's codes, up's scales, each adapter's packed dropout mask...]."""
    adapters = saved_adapters(lora_a, lora_b, lora_scale, lora_p)
    out, qg, qu, masks = _swiglu_linear_forward(gate, up, down_weight, parse_format(fmt), adapters)
    return [_declared(out, torch.promote_types(gate.dtype, up.dtype)), qg.payload, qg.scales, qu.payload, qu.scales, *masks]


_swiglu_linear_op = torch.library.custom_op("agoq::swiglu_linear", mutates_args=())(_swiglu_linear_impl)
_swiglu_linear_args = arguments_of(_swiglu_linear_impl)


@_swiglu_linear_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _swiglu_linear_args(*args, **kwargs)
    f = parse_format(a.fmt)
    out = a.gate.new_empty((*a.gate.shape[:-1], out_features(a.down_weight)), dtype=torch.promote_types(a.gate.dtype, a.up.dtype))
    return [out, *_fake_codes(a.gate, f), *_fake_codes(a.up, f), *_fake_masks(a.gate, a.lora_p)]


def _swiglu_linear_backward_impl(
    grad_out: torch.Tensor,
    gate_payload: torch.Tensor,
    gate_scales: torch.Tensor,
    up_payload: torch.Tensor,
    up_scales: torch.Tensor,
    down_weight: torch.Tensor,
    gate_shape: list[int],
    gate_dtype: torch.dtype,
    up_shape: list[int],
    up_dtype: torch.dtype,
    fmt: str,
    need_down: bool,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    lora_scale: list[float],
    lora_p: list[float],
    masks: list[torch.Tensor],
    need_a: list[bool],
    need_b: list[bool],
) -> list[torch.Tensor]:
    """SWIGLU_LINEAR_GRADS: [grad of gate, of up, of down_weight, of each adapter's A, of each adapter's B], an empty tensor for each one not needed."""
    f = parse_format(fmt)
    qg = QTensor(gate_payload, gate_scales, torch.Size(gate_shape), gate_dtype, f)
    qu = QTensor(up_payload, up_scales, torch.Size(up_shape), up_dtype, f)
    adapters = saved_adapters(lora_a, lora_b, lora_scale, lora_p, None, masks, need_a, need_b)
    gg, gu, gd, lora_grads = _swiglu_linear_backward(grad_out, qg, qu, down_weight, need_down, adapters)
    return [gg, gu, _or_empty(gd, gate_payload), *_adapter_grads(lora_grads, gate_payload)]


_swiglu_linear_backward_op = torch.library.custom_op("agoq::swiglu_linear_backward", mutates_args=())(_swiglu_linear_backward_impl)
_swiglu_linear_backward_args = arguments_of(_swiglu_linear_backward_impl)


@_swiglu_linear_backward_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _swiglu_linear_backward_args(*args, **kwargs)
    flat, _ = SWIGLU_LINEAR_GRADS.flatten(
        gate=a.grad_out.new_empty(a.gate_shape, dtype=a.gate_dtype),
        up=a.grad_out.new_empty(a.up_shape, dtype=a.up_dtype),
        down_weight=torch.empty_like(a.down_weight) if a.need_down else a.down_weight.new_empty(0, dtype=torch.float32),
        lora_a=[_fake_grad(t, need) for t, need in zip(a.lora_a, a.need_a)],
        lora_b=[_fake_grad(t, need) for t, need in zip(a.lora_b, a.need_b)],
    )
    return flat


def _swiglu_linear_setup(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    a = _swiglu_linear_args(*inputs)
    ctx.mark_non_differentiable(*output[1:])
    gate_payload, gate_scales, up_payload, up_scales, *masks = output[1:]
    flat, ctx.lengths = SWIGLU_LINEAR_SAVED.flatten(
        gate_payload=gate_payload, gate_scales=gate_scales, up_payload=up_payload, up_scales=up_scales, masks=masks,
        down_weight=a.down_weight, lora_a=a.lora_a, lora_b=a.lora_b,
    )  # fmt: skip
    ctx.save_for_backward(*flat)
    ctx.meta = (list(a.gate.shape), a.gate.dtype, list(a.up.shape), a.up.dtype, a.fmt, list(a.lora_scale), list(a.lora_p))


def _swiglu_linear_grad(ctx: Any, grads: list[torch.Tensor]) -> tuple:
    gshape, gdtype, ushape, udtype, fmt, lora_scale, lora_p = ctx.meta
    saved = SWIGLU_LINEAR_SAVED.unflatten(ctx.saved_tensors, ctx.lengths)
    need = _swiglu_linear_args(*ctx.needs_input_grad)
    adapters = saved_adapters(saved.lora_a, saved.lora_b, lora_scale, lora_p, None, saved.masks, need.lora_a, need.lora_b)
    outs = _swiglu_linear_backward_op(
        grads[0], saved.gate_payload, saved.gate_scales, saved.up_payload, saved.up_scales, saved.down_weight,
        gshape, gdtype, ushape, udtype, fmt, need.down_weight, **adapter_arguments(adapters, *BACKWARD_ADAPTER_ARGS),
    )  # fmt: skip
    out = SWIGLU_LINEAR_GRADS.unflatten(outs, (len(adapters), len(adapters)))
    return (
        out.gate,
        out.up,
        out.down_weight if need.down_weight else None,
        None,
        _or_none(out.lora_a, list(need.lora_a)),
        _or_none(out.lora_b, list(need.lora_b)),
        _no_grad(lora_scale),
        _no_grad(lora_p),
    )


_swiglu_linear_op.register_autograd(_swiglu_linear_grad, setup_context=_swiglu_linear_setup)


# Rows of the SwiGLU backward computed at once: its fp32 temporaries (the output gradient, gate
# and up dequantized, sigmoid and SiLU) are a chunk's rows, not every token's. The GEMMs stay
# whole, so a chunk costs only a call. Eagerly on a CPU a chunk is about 32K values (128 KiB of
# fp32 each, in cache between the formula's passes; six of them at 128K values were 2.9 MiB, more
# than the bf16 step's every temporary on the default run's first stage). Compiled code keeps no
# fp32 rows but pays more per call (benchmarks/op_overhead.py): 128K values. A GPU takes far larger chunks, fewer launches. At
# least MIN_CHUNK_ROWS rows.
SWIGLU_CHUNK_VALUES = {"cpu": 1 << 15, "cpu_fused": 1 << 17, "device": 1 << 24}
MIN_CHUNK_ROWS = 64


# The same for the fused norm + GEMMs backward, in values of its [tokens, hidden] input. Its
# weight gradients are whole GEMMs after the loop, so a chunk costs its share of the input
# gradient's GEMMs and a call of the norm's formulas: eagerly on a CPU about 128 rows of a
# 256-wide model (the formulas' five fp32 [rows, hidden] tensors 0.6 MiB, where every token's
# six were 1.5 MiB in the default run's micro-batches); compiled, up to 1024 such rows.
NORM_CHUNK_VALUES = {"cpu": 1 << 15, "cpu_fused": 1 << 18, "device": 1 << 24}


def chunk_rows(rows: int, width: int, block: int, device: torch.device, budgets: dict[str, int], fused: bool = False) -> int:
    """Rows per chunk of ``rows`` x ``width`` values (SWIGLU_CHUNK_VALUES or NORM_CHUNK_VALUES as
    ``budgets``): whole quantization blocks, about the device's budget of values (on a CPU, the
    eager one, or with ``fused`` kernels or compiled formulas the fused one)."""
    budget = budgets["device" if sized_for_kernels(device) else "cpu_fused" if fused else "cpu"]
    # A chunk starts on a block boundary (rows are stored in whole blocks) and on a byte boundary.
    unit = math.lcm(block, 8)
    align = unit // math.gcd(stored_row(width, block), unit)
    chunk = max(MIN_CHUNK_ROWS, budget // width) // align * align
    return min(rows, max(align, chunk))


def _row_chunks(rows: int, width: int, block: int, device: torch.device, budgets: dict[str, int]) -> list[tuple[int, int]]:
    # Compiled or Triton code runs a chunk in one fused pass, with no fp32 temporaries of its rows,
    # but pays a fixed dispatch cost a call on a CPU: it takes the larger chunks.
    if rows == 0:  # an empty batch: one empty chunk, so the backward still returns its empty gradients
        return [(0, 0)]
    chunk = chunk_rows(rows, width, block, device, budgets, fused=backend.resolve(device) != "torch")
    return [(r0, min(rows, r0 + chunk)) for r0 in range(0, rows, chunk)]


def _swiglu_backward(
    grad_act: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    act_dtype: torch.dtype | None,
    gate_dtype: torch.dtype,
    up_dtype: torch.dtype,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(SiLU(gate) * up in act_dtype or None, grad of gate, grad of up), in fp32 from fp32 gate and up.

    grad of gate = g * up * sig * (1 + gate * (1 - sig)), evaluated in that order, in place where
    a temporary is done with (products and sums commute exactly), and every tensor dropped after
    its last read, the arguments too (callers pass them without keeping them). Eagerly (the torch
    backend, and any step whose temporaries are counted) at most seven [tokens, intermediate] fp32
    tensors are alive at once, the three arguments included; the one-expression form held up to
    eleven. With ``out`` (gate and up gradient tensors of the dtypes given) the two gradients are
    written there, each product rounded once into its dtype as the casts would round it.
    """
    sig = torch.sigmoid(gate)
    silu = gate * sig
    g = grad_act.float()
    del grad_act
    grad_up = (g * silu).to(up_dtype) if out is None else torch.mul(g, silu, out=out[1])
    grad_gate = g * up
    del g
    act = silu.mul_(up).to(act_dtype) if act_dtype is not None else None  # silu * up
    del silu, up
    grad_gate.mul_(sig)
    slope = sig.neg_().add_(1).mul_(gate).add_(1)  # 1 + gate * (1 - sig), in sig's storage
    del gate
    grad_gate = grad_gate.mul_(slope).to(gate_dtype) if out is None else torch.mul(grad_gate, slope, out=out[0])
    return act, grad_gate, grad_up


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor, fmt: QuantFormat | None, adapters: Sequence[LoraAdapter] | None = None
) -> torch.Tensor:
    """(SiLU(gate) * up) times down_weight (transposed) plus its LoRA adapters; with fmt, saves only quantized gate/up."""
    adapters = list(adapters or ())
    if fmt is None:
        with meter_scope(kind="act_input"):
            act = F.silu(gate) * up
        with meter_scope(kind="gemm_input"):
            return _plain_lora(act, F.linear(act, dense_weight(down_weight, act.dtype)), adapters)
    lora = adapter_arguments([SavedAdapter(ad) for ad in adapters], *FORWARD_ADAPTER_ARGS)
    with meter_scope(kind="act_input"):
        return _swiglu_linear_op(gate, up, down_weight, fmt.name, **lora)[0]


# ---- linear with a quantized saved input ---------------------------------------------------------


# linear with a quantized saved input: what autograd keeps, and what the adapters' backward op returns.
SAVED_INPUT_LINEAR_SAVED = Layout("payload", "scales", "masks*", "weight", "lora_a*", "lora_b*")
SAVED_INPUT_LORA_GRADS = Layout("lora_a*", "lora_b*")


def _saved_input_linear_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    lora_scale: list[float],
    lora_p: list[float],
) -> list[torch.Tensor]:
    """[x times weight transposed plus its adapters, x's packed codes, x's block scales, each adapter's packed dropout mask...]."""
    out = F.linear(x, dense_weight(weight, x.dtype))
    masks = []
    for s in saved_adapters(lora_a, lora_b, lora_scale, lora_p):
        out, mask = lora_forward(x, out, s.adapter)
        masks.append(mask)
    q = _quantize_saved(x, parse_format(fmt))
    return [_declared(out, x.dtype), q.payload, q.scales, *masks]


_saved_input_linear_op = torch.library.custom_op("agoq::saved_input_linear", mutates_args=())(_saved_input_linear_impl)
_saved_input_linear_args = arguments_of(_saved_input_linear_impl)


@_saved_input_linear_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _saved_input_linear_args(*args, **kwargs)
    return [a.x.new_empty((*a.x.shape[:-1], out_features(a.weight))), *_fake_codes(a.x, parse_format(a.fmt)), *_fake_masks(a.x, a.lora_p)]


@torch.library.custom_op("agoq::saved_input_weight_grad", mutates_args=())
def _saved_input_weight_grad_op(
    grad_out: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, shape: list[int], dtype: torch.dtype, fmt: str
) -> torch.Tensor:
    """The weight gradient grad_out^T x of x @ w^T, x read back from its codes and scales."""
    x = dequantize(QTensor(payload, scales, torch.Size(shape), dtype, parse_format(fmt)))
    return _tokens(grad_out).t().mm(_tokens(x))


@_saved_input_weight_grad_op.register_fake
def _(grad_out: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, shape: list[int], dtype: torch.dtype, fmt: str) -> torch.Tensor:
    return grad_out.new_empty((grad_out.shape[-1], shape[-1]), dtype=torch.promote_types(grad_out.dtype, dtype))


def _saved_input_lora_grads_impl(
    grad_out: torch.Tensor,
    payload: torch.Tensor,
    scales: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    fmt: str,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    lora_scale: list[float],
    lora_p: list[float],
    masks: list[torch.Tensor],
    need_a: list[bool],
    need_b: list[bool],
) -> list[torch.Tensor]:
    """SAVED_INPUT_LORA_GRADS: [grad of each adapter's A, grad of each adapter's B] of x @ w^T plus adapters, x read back from its codes; empty where not needed."""
    x = dequantize(QTensor(payload, scales, torch.Size(shape), dtype, parse_format(fmt)))
    grads = [
        lora_weight_grads(grad_out, lora_grad_a_input(grad_out, s.adapter), x, s.adapter, s.mask, s.need_a, s.need_b)
        for s in saved_adapters(lora_a, lora_b, lora_scale, lora_p, None, masks, need_a, need_b)
    ]
    return _adapter_grads(grads, payload)


_saved_input_lora_grads_op = torch.library.custom_op("agoq::saved_input_lora_grads", mutates_args=())(_saved_input_lora_grads_impl)
_saved_input_lora_grads_args = arguments_of(_saved_input_lora_grads_impl)


@_saved_input_lora_grads_op.register_fake
def _(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    a = _saved_input_lora_grads_args(*args, **kwargs)
    flat, _ = SAVED_INPUT_LORA_GRADS.flatten(
        lora_a=[_fake_grad(t, need) for t, need in zip(a.lora_a, a.need_a)], lora_b=[_fake_grad(t, need) for t, need in zip(a.lora_b, a.need_b)]
    )
    return flat


def _saved_input_linear_setup(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    a = _saved_input_linear_args(*inputs)
    ctx.mark_non_differentiable(*output[1:])
    payload, scales, *masks = output[1:]
    flat, ctx.lengths = SAVED_INPUT_LINEAR_SAVED.flatten(
        payload=payload, scales=scales, masks=masks, weight=a.weight, lora_a=a.lora_a, lora_b=a.lora_b
    )
    ctx.save_for_backward(*flat)
    ctx.meta = (list(a.x.shape), a.x.dtype, a.fmt, list(a.lora_scale), list(a.lora_p))


def _saved_input_linear_grad(ctx: Any, grads: list[torch.Tensor]) -> tuple:
    grad_out = grads[0]
    shape, dtype, fmt, lora_scale, lora_p = ctx.meta
    saved = SAVED_INPUT_LINEAR_SAVED.unflatten(ctx.saved_tensors, ctx.lengths)
    need = _saved_input_linear_args(*ctx.needs_input_grad)
    adapters = saved_adapters(saved.lora_a, saved.lora_b, lora_scale, lora_p, None, saved.masks, need.lora_a, need.lora_b)
    grad_x = None
    if need.x:
        # The input gradient needs no saved activation: it is traced as plain GEMMs (and mask reads).
        grad_x = F.linear(grad_out, dense_weight(saved.weight, grad_out.dtype).t())
        for s in adapters:
            lora_backward_rows(s.adapter, s.mask, lora_grad_a_input(grad_out, s.adapter), 0, grad=_tokens(grad_x))
    grad_w = _saved_input_weight_grad_op(grad_out, saved.payload, saved.scales, shape, dtype, fmt) if need.weight else None
    gas: list = [None] * len(adapters)
    gbs: list = [None] * len(adapters)
    if any(need.lora_a) or any(need.lora_b):
        args = adapter_arguments(adapters, *BACKWARD_ADAPTER_ARGS)
        outs = SAVED_INPUT_LORA_GRADS.unflatten(
            _saved_input_lora_grads_op(grad_out, saved.payload, saved.scales, shape, dtype, fmt, **args), (len(adapters), len(adapters))
        )
        gas, gbs = _or_none(outs.lora_a, list(need.lora_a)), _or_none(outs.lora_b, list(need.lora_b))
    return grad_x, grad_w, None, gas, gbs, _no_grad(lora_scale), _no_grad(lora_p)


_saved_input_linear_op.register_autograd(_saved_input_linear_grad, setup_context=_saved_input_linear_setup)


def kept_by_attention(x: torch.Tensor) -> bool:
    """Whether x is (a view of) an attention output that the attention core keeps unquantized."""
    if torch.compiler.is_compiling():
        # A traced graph has no storages to compare, and AOTAutograd picks what it saves itself.
        return False
    base = x._base if x._base is not None else x
    return bool(getattr(base, _KEPT_BY_ATTENTION, False)) and x.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def saved_input_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: QuantFormat | None,
    *,
    attention_output: bool = False,
    adapters: Sequence[LoraAdapter] | None = None,
) -> torch.Tensor:
    """x times weight (transposed) plus its LoRA adapters; with fmt, saves x quantized for the weight gradients.

    When x is a view of an attention output that attention already keeps at full precision, x is
    saved as that view (zero extra bytes) instead of as a quantized copy, whatever ``fmt`` says.
    Under torch.compile no tensor can be asked whether it is such a view: there ``attention_output``
    (x is :func:`causal_attention`'s output, unquantized) says so, as the eager check would find it.
    """
    adapters = list(adapters or ())
    with meter_scope(kind="out_proj_input"):
        if fmt is None or (attention_output and torch.compiler.is_compiling()) or kept_by_attention(x):
            # In a compiled graph SDPA's backward needs its output too: the partitioner saves it once for both.
            return _plain_lora(x, F.linear(x, dense_weight(weight, x.dtype)), adapters)
        lora = adapter_arguments([SavedAdapter(ad) for ad in adapters], *FORWARD_ADAPTER_ARGS)
        return _saved_input_linear_op(x, weight, fmt.name, **lora)[0]


# ---- attention core ------------------------------------------------------------------------------


def _attention_hooks(fmt: QuantFormat, ndim: int) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that store every floating [batch, heads, seq, head_dim] tensor attention saves as fmt.

    Hooks do not nest in autograd (the innermost pair replaces the others), so whatever hooks were
    active outside are applied to what these keep (payloads, scales, statistics): a meter counts
    them and an offloading hook moves them.
    """
    outer = outer_saved_tensor_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)

    def pack(t: torch.Tensor) -> Any:
        # Softmax statistics (fp32, one per query row) and RNG state stay exact: quantizing the
        # log-sum-exp would scale whole probability rows.
        if not t.is_floating_point() or t.dim() != ndim:
            return (outer_pack(t),)
        q = _quantize_saved(t, fmt)
        return (outer_pack(q.payload), outer_pack(q.scales), q.shape, q.dtype, q.fmt)

    def unpack(saved: tuple) -> torch.Tensor:
        if len(saved) == 1:
            return outer_unpack(saved[0])
        payload, scales, shape, dtype, qfmt = saved
        return dequantize(QTensor(outer_unpack(payload), outer_unpack(scales), shape, dtype, qfmt))

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: QuantFormat | None) -> torch.Tensor:
    """Causal grouped-query SDPA on [batch, heads, seq, head_dim]; with fmt, saved tensors are quantized."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"causal_attention takes [batch, heads, seq, head_dim] tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    gqa = k.shape[1] != q.shape[1]
    if not q.transpose(1, 2).is_contiguous():
        # Fused SDPA kernels lay the output out like q. In [batch, seq, heads, head_dim] order the
        # caller's [batch, seq, hidden] view of the output is free, and the out-projection can
        # save that view (the storage attention keeps anyway) instead of a copy.
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    with meter_scope(kind="attention"):
        if fmt is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            # Fused SDPA kernels (CPU flash, CUDA flash / memory-efficient / cuDNN) save their output.
            if not torch.compiler.is_compiling() and out.grad_fn is not None and "_saved_output" in dir(out.grad_fn):
                setattr(out, _KEPT_BY_ATTENTION, True)
            return out
        with _attention_hooks(fmt, q.dim()):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by position (rotate-half convention), saving only cos/sin.

    Equals ``x * cos + rotate_half(x) * sin`` computed in x's dtype; cos and sin ([seq, head_dim])
    are saved as given, so tables shared by every layer are kept once.
    """
    with meter_scope(kind="other"):
        return _Rotary.apply(x, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate_half_transposed(g: torch.Tensor) -> torch.Tensor:
    """The adjoint of rotate_half: [a, b] -> [b, -a]."""
    half = g.shape[-1] // 2
    return torch.cat([g[..., half:], -g[..., :half]], dim=-1)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        g = grad_out
        return g * cos.to(g.dtype) + _rotate_half_transposed(g * sin.to(g.dtype)), None, None
