"""A DistributedDataParallel communication hook that averages buckets with the 8-bit all-reduce.

Register it with ``ddp_model.register_comm_hook(QuantHookState(), quantized_allreduce_hook)``.
8 bits (plus scales) travel; the sum is taken in fp32. Buckets are pipelined one deep: a bucket's
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

from agoq.gradient.collectives import PendingAllReduce, all_reduce_8bit
from agoq.gradient.counter import CommCounter


@dataclass
class QuantHookState:
    """State of :func:`quantized_allreduce_hook`: the group, the wire format and a byte counter."""

    group: dist.ProcessGroup | None = None
    fmt: QuantFormat | str | None = None
    counter: CommCounter | None = None
    _pending: list[tuple[PendingAllReduce, torch.futures.Future]] = field(default_factory=list)

    def flush(self) -> None:
        """Complete every bucket still in flight (DDP's last bucket does this by itself)."""
        while self._pending:
            handle, fut = self._pending.pop(0)
            fut.set_result(handle.wait())


def quantized_allreduce_hook(state: QuantHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket averaged over the group with the 8-bit all-reduce."""
    handle = all_reduce_8bit(bucket.buffer(), "avg", state.group, fmt=state.fmt, async_op=True, counter=state.counter)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    earlier, state._pending = state._pending, [(handle, fut)]
    for prev, prev_fut in earlier:
        prev_fut.set_result(prev.wait())
    if bucket.is_last():
        state.flush()
    return fut
