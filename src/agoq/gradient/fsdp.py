"""FSDP2 adapter: a custom reduce-scatter that exchanges gradients in 8 bits and sums in fp32.

``use_quantized_reduce_scatter(model)`` installs it on every ``fully_shard``-ed module of a model
(torch's ``FSDPModule.set_custom_reduce_scatter``). FSDP2 hands over a module's gradients as W
rows (W the world size): row r is shard r of the first parameter's gradient, then shard r of the
next, and so on, each parameter padded on dim 0 to a multiple of W, so its shard in every row has
ceil(dim0 / W) * prod(other dims) values (torch's ``foreach_reduce``); it expects this rank's row
back, reduced. Quantized as it is, a block holding the end of one parameter's shard and the start
of the next shares one scale: a small gradient next to one 1e4 larger came out 62% wrong. So each
row is copied with every parameter's shard starting a block of its own (:func:`block_starts`, as
the DDP hook does), reduced by :func:`reduce_scatter_8bit`, and copied back. The shards' sizes
come from the global shapes of the parameter group's DTensors (:func:`fsdp_group_parameters`) and
are checked against what FSDP2 sends at every call. Runs on CPU/gloo and on GPUs.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from agoq.compat import fsdp_can_reduce_unused_params, fsdp_param_group, fsdp_reduce_scatter_base
from agoq.quant import QuantFormat

from agoq.gradient.collectives import gradient_format, reduce_scatter_8bit
from agoq.gradient.counter import CommCounter
from agoq.gradient.layout import block_starts


def _param_group(module: FSDPModule) -> Any:
    """``module``'s FSDP2 parameter group (None where it manages no parameters)."""
    # The one private read of FSDP2 here. The public view (the module's own DTensor parameters in
    # post-order, nested fully_shard modules left out) misses groups over several modules:
    # fully_shard([final_norm, lm_head]), Accelerate's unit for a model's tail, makes one group whose
    # rows hold both modules' shards, and no public API lists its modules. The group's fsdp_params
    # are the list foreach_reduce copies the gradients from, in that order.
    return fsdp_param_group(module)


def fsdp_group_parameters(module: FSDPModule) -> list[torch.nn.Parameter]:
    """The sharded parameters of ``module``'s FSDP2 parameter group, in the order FSDP2 lays out their gradients."""
    group = _param_group(module)
    return [] if group is None else [fp.sharded_param for fp in group.fsdp_params]


def shard_numel(param: torch.Tensor, world: int) -> int:
    """Values of ``param``'s gradient in each of FSDP2's ``world`` reduce-scatter rows (its global shape, padded on dim 0)."""
    shape = param.shape
    dims = [pl.dim for pl in getattr(param, "placements", ()) if pl.is_shard()]
    if dims and dims[0] != 0:
        # Shard(d), d > 0: FSDP2 requires even sharding and moves the d-chunks to dim 0.
        return math.prod(shape) // world
    return -(-shape[0] // world) * math.prod(shape[1:])


class QuantizedReduceScatter(fsdp_reduce_scatter_base()):
    """FSDP2 ``ReduceScatter`` of one ``fully_shard``-ed module: 8 bits on the wire, fp32 sum, one parameter per block."""

    def __init__(self, module: FSDPModule, fmt: QuantFormat | str | None = None, counter: CommCounter | None = None, name: str | None = None) -> None:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"QuantizedReduceScatter needs a fully_shard-ed module, got {type(module).__name__}; call fully_shard on it first")
        self.module = module
        self.fmt = fmt
        self.counter = counter
        self.name = name or type(module).__name__
        self.block = gradient_format(fmt).block_size

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain empty tensor, as FSDP2's default."""
        return torch.empty(*size, dtype=dtype, device=device)

    def shard_numels(self, world: int) -> list[int]:
        """Values per reduce-scatter row of each parameter FSDP2 reduces (those that require grad), in its order."""
        return [shard_numel(p, world) for p in fsdp_group_parameters(self.module) if p.requires_grad]

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
        total = output_tensor.numel()
        if input_tensor.numel() != world * total:
            raise ValueError(
                f"reduce-scatter input has {input_tensor.numel()} values for {world} ranks but the output "
                f"shard has {total}; FSDP2 pads its input to a multiple of the world size"
            )
        numels = self.shard_numels(world)
        if sum(numels) != total:
            raise ValueError(self._mismatch(total, numels))
        starts, row = block_starts(numels, self.block)
        offsets = list(accumulate(numels[:-1], initial=0))
        if starts == offsets:
            # Every shard but the last already ends on a block boundary: the rows go as they are
            # (each row is one rank chunk, padded to whole blocks at its end).
            shard = reduce_scatter_8bit(input_tensor, op, group, fmt=self.fmt, counter=self.counter)
            output_tensor.copy_(shard.view(output_tensor.shape))
            return None
        rows = input_tensor.view(world, total)
        padded = input_tensor.new_zeros(world, row)
        for n, start, offset in zip(numels, starts, offsets):
            padded[:, start : start + n].copy_(rows[:, offset : offset + n])
        # W rows of whole blocks: rank r's chunk of the 8-bit reduce-scatter is exactly row r.
        shard = reduce_scatter_8bit(padded.view(-1), op, group, fmt=self.fmt, counter=self.counter)
        out = output_tensor.view(-1)
        for n, start, offset in zip(numels, starts, offsets):
            out[offset : offset + n].copy_(shard[start : start + n])
        return None

    def _mismatch(self, total: int, numels: list[int]) -> str:
        """The one-line error for a reduce-scatter whose rows are not the parameters' shards."""
        got = f"8-bit reduce-scatter of {self.name}: FSDP2 sent {total} values per rank, but its {len(numels)} parameters that require grad shard to {sum(numels)}"
        if total < sum(numels):
            fixes = "set requires_grad=False on it"
            if fsdp_can_reduce_unused_params(self.module):
                fixes = f"call {self.name}.set_reduce_scatter_unused_params(True), or {fixes}"
            return f"{got}; one got no gradient in this backward (FSDP2 leaves it out): {fixes}"
        return (
            f"{got}; their shards are not FSDP2's Shard(0) of the global shapes (tensor parallel?): leave this module on FSDP2's own reduce-scatter"
        )


def use_quantized_reduce_scatter(model: torch.nn.Module, fmt: QuantFormat | str | None = None, counter: CommCounter | None = None) -> int:
    """Install a :class:`QuantizedReduceScatter` on every FSDP2 module in ``model``; return how many modules."""
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no fully_shard-ed module found; call torch.distributed.fsdp.fully_shard first")
    # Modules sharded together (fully_shard([a, b])) share one parameter group: one reduce-scatter for them, named by all.
    by_group: dict[int, list[tuple[str, FSDPModule]]] = {}
    for name, m in modules:
        group = _param_group(m)
        by_group.setdefault(id(m) if group is None else id(group), []).append((name or type(m).__name__, m))
    for members in by_group.values():
        comm = QuantizedReduceScatter(members[0][1], fmt, counter, name="+".join(name for name, _ in members))
        for _, m in members:
            m.set_custom_reduce_scatter(comm)
    return len(modules)
