"""Data-parallel gradient reduction: QuanGrad's 8-bit path or a plain all-reduce, behind one interface.

Both fold each parameter's gradient into a buffer the moment autograd finishes it (so the model's
own .grad never accumulates across micro-batches in bf16), reduce the buffer over the dp group
after the last micro-batch, and agree across every rank whether any gradient was non-finite.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.gradient.buffer import all_finite, sum_of_squares
from agoq.gradient.counter import CommCounter, ring_all_reduce_bytes


class GradientSync:
    """Interface the trainer uses; see :class:`PlainGradientSync` and :class:`QuantizedGradientSync`."""

    wire_bytes_last_step: int = 0
    # True when each dp rank holds only its shard of the reduced gradients (ZeRO-1): gradients()
    # then yields (bucket index, shard) for agoq.train.zero1.Zero1Optimizer.
    sharded: bool = False

    def start_step(self) -> None:
        """Prepare to receive one step's gradients."""

    def reduce(self) -> bool:
        """Reduce over dp; False if this dp group saw a non-finite gradient (the trainer agrees over all ranks)."""
        raise NotImplementedError

    def local_grad_sq_norm(self) -> float:
        """Sum of squares of this rank's reduced gradients."""
        raise NotImplementedError

    def gradients(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(parameter index, reduced fp32 gradient), one parameter at a time; the caller may scale it in place."""
        raise NotImplementedError

    def finish_step(self) -> None:
        """Drop this step's gradients."""

    def fp32_wire_bytes(self) -> int:
        """What an fp32 ring all-reduce of the same gradients would send per rank."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Bytes of the persistent gradient storage."""
        raise NotImplementedError


class PlainGradientSync(GradientSync):
    """An fp32 gradient buffer (Megatron's main_grad) all-reduced in fp32 or bf16, or along an 8-bit ring.

    ``ring=True`` is the FP8-LM-style ablation: one shared scale, partial sums re-rounded to 8 bits
    at every hop (agoq.gradient.ring_all_reduce_8bit), the scheme AGoQ's all-reduce replaces.
    """

    def __init__(
        self, params: list[tuple[str, nn.Parameter]], group: Any, device: torch.device, wire_dtype: torch.dtype, ring: bool = False
    ) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.wire_dtype = wire_dtype
        self.ring = ring
        self.counter = CommCounter()
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self.views = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._hooks = [p.register_post_accumulate_grad_hook(self._fold(i)) for i, p in enumerate(self.params)]

    def _fold(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self.views[i].add_(p.grad)
            p.grad = None

        return hook

    def reduce(self) -> bool:
        ok = all_finite(self.buffer)
        if not ok:
            bad = [self.names[i] for i, v in enumerate(self.views) if not bool(torch.isfinite(v).all())]
            warnings.warn(f"non-finite gradient in {bad[0]!r} ({len(bad)} parameter(s)); skipping this step", RuntimeWarning, stacklevel=2)
        if self.world > 1 and self.ring:
            from agoq.gradient.collectives import ring_all_reduce_8bit

            self.counter.reset()
            ring_all_reduce_8bit(self.buffer, "avg", self.group, counter=self.counter)
            self.wire_bytes_last_step = self.counter.bytes()
            return ok and self._reduced_finite()
        if self.world > 1:
            # Issued whatever this rank saw: every dp rank must call the same collectives.
            if self.wire_dtype == torch.float32:
                dist.all_reduce(self.buffer, group=self.group)
            else:
                low = self.buffer.to(self.wire_dtype)
                dist.all_reduce(low, group=self.group)
                self.buffer.copy_(low)
            self.buffer.div_(self.world)
        self.wire_bytes_last_step = ring_all_reduce_bytes(self.buffer.numel() * torch.finfo(self.wire_dtype).bits // 8, self.world)
        return ok and self._reduced_finite()

    def _reduced_finite(self) -> bool:
        # One pass over the reduced gradients gives both their squared norm (kept for
        # local_grad_sq_norm) and whether they are all finite.
        self._sq_norm = sum_of_squares(self.buffer)
        return bool(torch.isfinite(self._sq_norm))

    def local_grad_sq_norm(self) -> float:
        return float(self._sq_norm)

    def gradients(self) -> Iterator[tuple[int, torch.Tensor]]:
        yield from enumerate(self.views)

    def finish_step(self) -> None:
        self.buffer.zero_()

    def fp32_wire_bytes(self) -> int:
        return ring_all_reduce_bytes(self.buffer.numel() * 4, self.world)

    def buffer_bytes(self) -> int:
        return self.buffer.numel() * 4


class QuantizedGradientSync(GradientSync):
    """QuanGrad: an 8-bit block-wise buffer, bucketed 8-bit all-reduce started during backward."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: Any, microbatches: int, block: int) -> None:
        from agoq.gradient.buffer import QuantGradBuffer

        self.counter = CommCounter()
        self.index = {name: i for i, (name, _) in enumerate(params)}
        self.buffer = QuantGradBuffer(params, fmt=f"int8/{block}", group=group, op="avg", microbatches=microbatches, counter=self.counter)
        self.world = self.buffer.world_size

    def start_step(self) -> None:
        self.counter.reset()
        self.buffer.zero_grad()

    def reduce(self) -> bool:
        ok = self.buffer.finish()
        self.wire_bytes_last_step = self.counter.bytes()
        return ok

    def local_grad_sq_norm(self) -> float:
        return self.buffer.grad_norm() ** 2

    def gradients(self) -> Iterator[tuple[int, torch.Tensor]]:
        for name, _, grad in self.buffer.grads():
            yield self.index[name], grad

    def finish_step(self) -> None:
        self.buffer.zero_grad()

    def fp32_wire_bytes(self) -> int:
        return ring_all_reduce_bytes(self.buffer.numel * 4, self.world)

    def buffer_bytes(self) -> int:
        return self.buffer.storage_bytes


def make_gradient_sync(
    mode: str, params: list[tuple[str, nn.Parameter]], group: Any, device: torch.device, microbatches: int, block: int,
) -> GradientSync:
    """The gradient path for ``precision.gradients`` = ``mode`` (int8, ring8, fp32 or bf16)."""
    if mode == "int8":
        return QuantizedGradientSync(params, group, microbatches, block)
    if mode == "ring8":
        return PlainGradientSync(params, group, device, torch.float32, ring=True)
    return PlainGradientSync(params, group, device, torch.float32 if mode == "fp32" else torch.bfloat16)
