"""A DistributedDataParallel communication hook that averages buckets with the 8-bit all-reduce.

Register it with ``ddp_model.register_comm_hook(QuantHookState(), quantized_allreduce_hook)``.
8 bits (plus scales) travel; the sum is taken in fp32; each parameter's gradient starts a block of
its own (:class:`_AlignedBucket`). Buckets are pipelined one deep: a bucket's
all-to-all starts when DDP hands it over, and the previous bucket's reduce and all-gather run right
after, so communication overlaps backward while every rank issues collectives in the same order
(DDP calls hooks in bucket order). The last bucket (``bucket.is_last()``) completes everything.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects, and rejects strings.
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agoq.quant import QuantFormat

from agoq.gradient.collectives import PendingAllReduce, all_reduce_8bit, gradient_format
from agoq.gradient.counter import CommCounter
from agoq.gradient.layout import block_starts


@dataclass
class QuantHookState:
    """State of :func:`quantized_allreduce_hook`: the group, the wire format and a byte counter."""

    group: dist.ProcessGroup | None = None
    fmt: QuantFormat | str | None = None
    counter: CommCounter | None = None
    _pending: list[tuple["_AlignedBucket", torch.futures.Future]] = field(default_factory=list)

    def flush(self) -> None:
        """Complete every bucket still in flight (DDP's last bucket does this by itself)."""
        while self._pending:
            aligned, fut = self._pending.pop(0)
            fut.set_result(aligned.finish())


class _AlignedBucket:
    """A DDP bucket's gradients copied so that each starts a block of its own, then reduced in 8 bits.

    DDP's bucket is one flat buffer; quantized as it is, a block holding the end of one parameter's
    gradient and the start of the next shares one scale, so a small gradient (a norm weight's) beside
    a large one loses most of its digits (measured on a 3-layer Llama: 21% relative error for a
    norm weight, 1.1% over the whole bucket). Each block now holds one parameter's values, as in
    agoq's own gradient buffer, for a copy of the bucket and the padding of each gradient's last block.
    """

    def __init__(self, state: QuantHookState, bucket: dist.GradBucket) -> None:
        block = gradient_format(state.fmt).block_size
        self.buffer = bucket.buffer()
        self.gradients = [g.view(-1) for g in bucket.gradients()]
        self.starts, total = block_starts([g.numel() for g in self.gradients], block)
        self.padded = self.buffer.new_zeros(total)
        for g, start in zip(self.gradients, self.starts):
            self.padded[start : start + g.numel()].copy_(g)
        self.handle: PendingAllReduce = all_reduce_8bit(self.padded, "avg", state.group, fmt=state.fmt, async_op=True, counter=state.counter)

    def finish(self) -> torch.Tensor:
        """Wait for the reduction and write each averaged gradient back into DDP's bucket buffer."""
        self.handle.wait()
        for g, start in zip(self.gradients, self.starts):
            g.copy_(self.padded[start : start + g.numel()])
        return self.buffer


def quantized_allreduce_hook(state: QuantHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket averaged over the group with the 8-bit all-reduce, one parameter per block."""
    aligned = _AlignedBucket(state, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    earlier, state._pending = state._pending, [(aligned, fut)]
    for prev, prev_fut in earlier:
        prev_fut.set_result(prev.finish())
    if bucket.is_last():
        state.flush()
    return fut
