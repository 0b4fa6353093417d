"""FSDP2 adapter: a custom reduce-scatter that exchanges gradients in 8 bits and sums in fp32.

``use_quantized_reduce_scatter(model)`` installs it on every ``fully_shard``-ed module of a model
(torch's ``FSDPModule.set_custom_reduce_scatter``). FSDP2 hands over the padded flat gradients of a
module (``W * shard`` values) and expects this rank's ``shard`` back; that is exactly
:func:`reduce_scatter_8bit`'s split. Runs on CPU/gloo and on GPUs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from agoq.quant import QuantFormat

from agoq.gradient.collectives import reduce_scatter_8bit
from agoq.gradient.counter import CommCounter


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` that quantizes to 8 bits for the wire and reduces in fp32."""

    def __init__(self, fmt: QuantFormat | str | None = None, counter: CommCounter | None = None) -> None:
        self.fmt = fmt
        self.counter = counter

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain empty tensor, as FSDP2's default."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        """Write this rank's reduced shard of ``input_tensor`` into ``output_tensor`` (synchronously)."""
        world = dist.get_world_size(group)
        if input_tensor.numel() != world * output_tensor.numel():
            raise ValueError(
                f"reduce-scatter input has {input_tensor.numel()} values for {world} ranks but the output "
                f"shard has {output_tensor.numel()}; FSDP2 pads its input to a multiple of the world size"
            )
        shard = reduce_scatter_8bit(input_tensor, op, group, fmt=self.fmt, counter=self.counter)
        output_tensor.copy_(shard.view(output_tensor.shape))
        return None


def use_quantized_reduce_scatter(model: torch.nn.Module, fmt: QuantFormat | str | None = None, counter: CommCounter | None = None) -> int:
    """Install :class:`QuantizedReduceScatter` on every FSDP2 module in ``model``; return how many."""
    comm = QuantizedReduceScatter(fmt, counter)
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
            count += 1
    if count == 0:
        raise ValueError("no fully_shard-ed module found; call torch.distributed.fsdp.fully_shard first")
    return count
