"""The three parts of AGoQ from ``transformers.Trainer``, and from a plain DDP or Accelerate loop.

- :class:`AgoqTrainer` is ``transformers.Trainer`` with the model patched by
  :func:`agoq.integrations.hf.apply_agoq` (4-bit saved activations, the loss that keeps no logits)
  and, once the Trainer has wrapped the model, its gradient reduction in 8 bits: DDP's bucket
  all-reduce through agoq's comm hook, or FSDP2's reduce-scatter through agoq's custom one. The
  8-bit AdamW is the Trainer's own knob: ``TrainingArguments(optim="adamw_torch_8bit")`` (torchao).
- :class:`AgoqMixin` gives the same to any ``Trainer`` subclass, TRL's ``SFTTrainer`` included:
  ``class AgoqSFTTrainer(AgoqMixin, SFTTrainer): pass`` (the mixin first, so its ``__init__`` and
  ``training_step`` wrap the trainer's). A PEFT model the trainer builds (``peft_config=``) is
  patched after the trainer has built it.
- :func:`use_8bit_gradients` does the same reduction for a model a loop wrapped itself
  (``DistributedDataParallel(model)``, ``accelerator.prepare(model)``, ``fully_shard``).

Why a Trainer subclass and not a callback: callbacks see the unwrapped model, and DDP's comm hook
must be registered on the wrapper before its first backward; ``training_step`` is the Trainer's
documented override point and is handed the wrapped model.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer

from agoq.activation.policy import ActivationPolicy
from agoq.gradient.counter import CommCounter
from agoq.gradient.ddp import QuantHookState, quantized_allreduce_hook
from agoq.integrations.hf import agoq_patch, apply_agoq

GRADIENTS = ("int8", "fp32")  # what the data-parallel reduction sends: agoq's 8 bits, or the wrapper's own


def use_8bit_gradients(model: nn.Module, counter: CommCounter | None = None, fmt: str | None = None) -> CommCounter:
    """Reduce the gradients of a DDP- or FSDP2-wrapped model in 8 bits (fp32 sum); returns the byte counter.

    Call it after wrapping and before the first backward. A model that is neither (one process) is
    left as it is.
    """
    counter = counter if counter is not None else CommCounter()
    ddp = model if isinstance(model, DistributedDataParallel) else None
    if ddp is not None:
        ddp.register_comm_hook(QuantHookState(fmt=fmt, counter=counter), quantized_allreduce_hook)
        return counter
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        from agoq.gradient.fsdp import use_quantized_reduce_scatter

        use_quantized_reduce_scatter(model, fmt=fmt, counter=counter)
    return counter


class AgoqMixin:
    """AGoQ's saved activations, loss and 8-bit gradient reduction for a ``transformers.Trainer`` subclass listed after it.

    ``agoq_policy``, ``agoq_formats``, ``agoq_layer_bits``, ``agoq_fused_loss`` and ``agoq_checkpoint_format`` are
    :func:`apply_agoq`'s ``policy``, ``formats``, ``layer_bits``, ``fused_loss`` and ``checkpoint_format`` (the Trainer's
    keyword arguments carry an ``agoq_`` prefix); ``agoq_policy=None`` leaves the model unpatched. ``agoq_gradients``: 'int8' (default) or 'fp32'
    (the wrapper's own all-reduce). ``agoq_comm`` counts the bytes the 8-bit reduction sends.
    """

    def __init__(
        self,
        *args: Any,
        agoq_policy: str | ActivationPolicy | None = "agoq",
        agoq_formats: dict[str, str | None] | None = None,
        agoq_layer_bits: list[int] | None = None,
        agoq_fused_loss: bool | None = None,
        agoq_checkpoint_format: str | None = None,
        agoq_gradients: str = "int8",
        **kwargs: Any,
    ) -> None:
        if agoq_gradients not in GRADIENTS:
            raise ValueError(f"agoq_gradients={agoq_gradients!r}; use one of {', '.join(GRADIENTS)}")
        super().__init__(*args, **kwargs)
        if agoq_policy is not None and agoq_patch(self.model) is None:
            apply_agoq(
                self.model,
                agoq_policy,
                formats=agoq_formats,
                layer_bits=agoq_layer_bits,
                fused_loss=agoq_fused_loss,
                checkpoint_format=agoq_checkpoint_format,
            )
        self.agoq_gradients = agoq_gradients
        self.agoq_comm = CommCounter()
        self._agoq_wrapped: nn.Module | None = None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        if self.agoq_gradients == "int8" and model is not self._agoq_wrapped:
            # The first step on this wrapper (a resumed or re-wrapped model gets its own hook).
            self._agoq_wrapped = model
            use_8bit_gradients(model, self.agoq_comm)
        return super().training_step(model, inputs, num_items_in_batch)


class AgoqTrainer(AgoqMixin, Trainer):
    """``transformers.Trainer`` with AGoQ's saved activations, loss and 8-bit gradient reduction (:class:`AgoqMixin`)."""
