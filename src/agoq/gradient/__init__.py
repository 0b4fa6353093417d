"""QuanGrad: 8-bit gradient storage and a precision-preserving 8-bit all-reduce (METHOD.md part 3).

- :class:`QuantGradBuffer`: the gradients of a set of parameters in 8 bits, filled by autograd
  hooks, accumulated over micro-batches in fp32, reduced bucket by bucket over a dp group;
- :func:`all_reduce_8bit`, :func:`reduce_scatter_8bit`: the collectives, on any float tensor;
  :func:`all_reduce_hierarchical` over the :func:`node_groups` of a group (int8 within a node,
  int4 between nodes);
- adapters: :func:`quantized_allreduce_hook` for DDP, :func:`use_quantized_reduce_scatter` for FSDP2;
- :class:`CommCounter`, :data:`COMM_COUNTER`: bytes each rank sent, per collective.

The fp32/bf16 baseline the benchmarks compare with (``all_reduce_fp``) is in
:mod:`agoq.gradient.collectives`; the FP8-LM-style ring, a baseline only, is benchmarks/_ring8.py's.
This package imports only agoq.quant. The FSDP2 adapter is loaded on first use (importing
torch's FSDP is slow).
"""

from agoq import _lazy_dir, _lazy_exports
from agoq.gradient.buffer import QuantGradBuffer
from agoq.gradient.collectives import all_reduce_8bit, reduce_scatter_8bit
from agoq.gradient.counter import COMM_COUNTER, CommCounter
from agoq.gradient.ddp import QuantHookState, quantized_allreduce_hook
from agoq.gradient.hierarchical import all_reduce_hierarchical
from agoq.gradient.nodes import node_groups

__all__ = [
    "COMM_COUNTER",
    "CommCounter",
    "QuantGradBuffer",
    "QuantHookState",
    "all_reduce_8bit",
    "all_reduce_hierarchical",
    "node_groups",
    "quantized_allreduce_hook",
    "reduce_scatter_8bit",
    "use_quantized_reduce_scatter",
]


# The FSDP2 adapter on first use (PEP 562): importing torch's FSDP is slow.
_LAZY = {"use_quantized_reduce_scatter": "agoq.gradient.fsdp"}
__getattr__ = _lazy_exports(__name__, _LAZY)
__dir__ = _lazy_dir(globals(), _LAZY)
