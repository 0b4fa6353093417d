"""QuanGrad: 8-bit gradient storage and a precision-preserving 8-bit all-reduce (METHOD.md part 3).

- :class:`QuantGradBuffer`: the gradients of a set of parameters in 8 bits, filled by autograd
  hooks, accumulated over micro-batches in fp32, reduced bucket by bucket over a dp group;
- :func:`all_reduce_8bit`, :func:`reduce_scatter_8bit`: the collectives, on any float tensor;
- baselines :func:`all_reduce_fp` (fp32/bf16) and :func:`ring_all_reduce_8bit` (FP8-LM-style ring);
- adapters: :func:`quantized_allreduce_hook` for DDP, :func:`use_quantized_reduce_scatter` for FSDP2;
- :data:`COMM_COUNTER`: bytes each rank sent, per collective.

This package imports only agoq.quant. The FSDP2 adapter is loaded on first use (importing
torch's FSDP is slow).
"""

from agoq.gradient.buffer import DEFAULT_BUCKET_BYTES, QuantGradBuffer, Segment
from agoq.gradient.collectives import (
    DEFAULT_GRADIENT_FORMAT,
    ChunkLayout,
    PendingAllReduce,
    agree_nonfinite,
    all_reduce_8bit,
    all_reduce_fp,
    chunk_layout,
    reduce_scatter_8bit,
    ring_all_reduce_8bit,
)
from agoq.gradient.counter import COMM_COUNTER, CommCounter, ring_all_reduce_bytes
from agoq.gradient.ddp import QuantHookState, quantized_allreduce_hook
from agoq.gradient.hierarchical import all_reduce_hierarchical, hierarchical_error_bound, simulate_hierarchical
from agoq.gradient.nodes import NodeGroups, node_groups

__all__ = [
    "COMM_COUNTER",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_GRADIENT_FORMAT",
    "ChunkLayout",
    "CommCounter",
    "NodeGroups",
    "PendingAllReduce",
    "QuantGradBuffer",
    "QuantHookState",
    "QuantizedReduceScatter",
    "Segment",
    "agree_nonfinite",
    "all_reduce_8bit",
    "all_reduce_fp",
    "all_reduce_hierarchical",
    "chunk_layout",
    "hierarchical_error_bound",
    "node_groups",
    "quantized_allreduce_hook",
    "reduce_scatter_8bit",
    "ring_all_reduce_8bit",
    "ring_all_reduce_bytes",
    "simulate_hierarchical",
    "use_quantized_reduce_scatter",
]


def __getattr__(name: str) -> object:
    if name in ("QuantizedReduceScatter", "use_quantized_reduce_scatter"):
        from agoq.gradient import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'agoq.gradient' has no attribute {name!r}")
