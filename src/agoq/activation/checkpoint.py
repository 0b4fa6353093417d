"""Compressed checkpoints: activation checkpointing whose kept layer input is quantized.

Plain activation checkpointing keeps each checkpointed layer's input in its dtype and runs the
layer again in backward. :func:`checkpoint_layer` keeps that input in a block format instead (8
bits: about half of bf16's bytes, a quarter of fp32's) and recomputes the layer from the
dequantized input. The recompute then sees the input's rounding as well as the layer's own saved
tensors' (each layer's error enters once: the forward's output, which the next layer reads, is
computed from the exact input).

The recompute reproduces the forward's random draws (LoRA dropout masks) and autocast state, as
``torch.utils.checkpoint`` does. The parameters that need gradients are inputs of the node and get
their gradients from it, so each is accumulated once, by the outer backward, and its hooks (DDP's,
agoq's 8-bit buffer's) run as they would without checkpointing; it also keeps the node in the graph
when the layer input needs no gradient (a frozen embedding under LoRA). A layer whose parameters
are swapped while it runs (FSDP's unsharding) is not supported: its gradients would go to the
swapped-in tensors.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch

from agoq.activation.meter import meter_scope
from agoq.quant import QTensor, QuantFormat, dequantize, quantize


def checkpoint_layer(
    layer: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    fmt: QuantFormat,
    params: Iterable[torch.Tensor],
) -> torch.Tensor:
    """``layer(x)``, keeping only ``x`` stored as ``fmt`` for backward, which runs ``layer`` again
    from it; ``params``: the tensors ``layer`` reads that may need gradients (its parameters)."""
    trainable = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
        return layer(x)
    # Saved tensors are packed as the node is made, after forward returns: the scope covers both.
    with meter_scope(kind="layer_input"):
        return _CompressedCheckpoint.apply(layer, fmt, x, *trainable)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _CompressedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, layer: Callable, fmt: QuantFormat, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        device = x.device
        ctx.layer, ctx.device, ctx.params = layer, device, params
        # The recompute must draw what this forward draws: the generators' states as it starts.
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.get_device_module(device.type).get_rng_state(device) if device.type not in ("cpu", "meta") else None
        ctx.autocast = {t: _autocast_state(t) for t in {"cpu", device.type} if t != "meta"}
        out = layer(x)  # grad mode is off inside forward: the layer keeps nothing
        # A NaN/Inf in a layer input reaches the gradients as NaN, as in agoq's saved activations.
        q = quantize(x.detach(), fmt, nonfinite="propagate")
        ctx.save_for_backward(q.payload, q.scales)
        ctx.stored = (q.shape, q.dtype, q.fmt)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        payload, scales = ctx.saved_tensors
        x = dequantize(QTensor(payload, scales, *ctx.stored)).detach()
        x.requires_grad_(ctx.needs_input_grad[2])
        devices = [ctx.device] if ctx.device_rng is not None else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=ctx.device.type if devices else "cuda"))
            torch.set_rng_state(ctx.cpu_rng)
            if devices:
                torch.get_device_module(ctx.device.type).set_rng_state(ctx.device_rng, ctx.device)
            for device_type, (enabled, dtype) in ctx.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            out = ctx.layer(x)
        inputs = ([x] if ctx.needs_input_grad[2] else []) + list(ctx.params)
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True) if out.requires_grad else [None] * len(inputs)
        grad_x = grads[0] if ctx.needs_input_grad[2] else None
        return (None, None, grad_x, *grads[len(inputs) - len(ctx.params) :])
