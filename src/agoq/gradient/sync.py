"""Data-parallel gradient reduction: QuanGrad's 8-bit path or a plain all-reduce, behind one interface.

Both fold each parameter's gradient into a buffer the moment autograd finishes it (so the model's
own .grad never accumulates across micro-batches in bf16), reduce the buffer over the dp group
after the last micro-batch, and agree across every rank whether any gradient was non-finite.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.gradient.collectives import INTER_NODE_SUFFIX, Group, int8_gradient_format, own_rank
from agoq.gradient.counter import CommCounter, ring_all_reduce_bytes
from agoq.gradient.fold import fold_on_accumulate
from agoq.gradient.hierarchical import HOP_NAMES, all_reduce_hierarchical
from agoq.gradient.nodes import NodeGroups
from agoq.gradient.readback import all_finite, nonfinite_of_sum, skip_flag, step_in_groups, sum_of_squares

if TYPE_CHECKING:  # buffer.py is imported where a buffer is built (it pulls in the whole bucket pipeline)
    from agoq.gradient.buffer import QuantGradBuffer


@dataclass(frozen=True)
class WireChoice:
    """What the 8-bit buffer's reduction sends: its own 8-bit storage (fmt None), or a narrower
    format with or without error feedback (agoq.gradient.feedback)."""

    fmt: str | None = None
    error_feedback: bool = False


# The wire block: 64 values per fp32 scale, the largest block whose bytes stay within 0.15x of an
# fp32 all-reduce's (0.5 + 4 / 64 bytes per value against 4); smaller blocks round less but cost more scales.
INT4_WIRE_FORMAT = "int4/64"
HIER_INTRA_FORMAT = "int8/256"  # hier-8/4: 8 bits within a node, INT4_WIRE_FORMAT between nodes
WIRE_CHOICES = {"int8": WireChoice(), "int4": WireChoice(INT4_WIRE_FORMAT), "int4-ef": WireChoice(INT4_WIRE_FORMAT, True)}


class PairedOptimizer(Protocol):
    """What a gradient sync hands its gradients to (agoq.train.optim and agoq.train.zero1 optimizers)."""

    def set_grad(self, index: int, grad: torch.Tensor) -> None: ...

    def step(self) -> None: ...


class GradientSync:
    """Interface the trainer uses; see :class:`PlainGradientSync` and :class:`QuantizedGradientSync`."""

    wire_bytes_last_step: int = 0
    # True when each dp rank holds only its shard of the reduced gradients (ZeRO-1): the ranks'
    # squared norms then add up to the full norm instead of repeating it.
    sharded: bool = False

    def start_step(self) -> None:
        """Prepare to receive one step's gradients."""

    def reduce(self) -> torch.Tensor:
        """Reduce over dp. Returns an fp64 scalar on the gradients' device, nonzero if this dp group
        saw a non-finite gradient: the trainer agrees on it over all ranks and reads it once, with
        the norm and the loss, so that nothing here waits for the device."""
        raise NotImplementedError

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced gradients: an fp64 scalar on their device."""
        raise NotImplementedError

    _nonfinite: list[tuple[int, str]] = []

    def nonfinite_last_step(self) -> list[tuple[int, str]]:
        """(global rank, first parameter with a non-finite gradient) of the ranks known to have seen
        one in the last reduce: those of the dp group where its ranks agree on it (the 8-bit
        buffer), else this rank alone."""
        return list(self._nonfinite)

    def params_sq_norm(self, indices: set[int]) -> torch.Tensor:
        """Sum of squares of this rank's reduced gradients of the parameters ``indices`` only (all of
        each for a full sync, this rank's pieces of them for a sharded one), after reduce(): an fp64 scalar on their device."""
        raise NotImplementedError

    def units(self) -> list[tuple[int, int]]:
        """(unit, values) in reading order. A unit is the index the paired optimizer's ``set_grad``
        takes: a parameter index for a :class:`ParameterGradientSync` (paired with
        agoq.train.optim.MasterWeightOptimizer), a bucket index for agoq.gradient.sharded's syncs
        (paired with agoq.train.zero1.Zero1Optimizer)."""
        raise NotImplementedError

    def read(self, unit: int) -> torch.Tensor:
        """The reduced fp32 gradient of one unit; the caller may scale it in place."""
        raise NotImplementedError

    # Values a slice of a unit starts on a multiple of (the 8-bit buffer's block: slices read whole blocks).
    slice_quantum: int = 1

    def read_slice(self, unit: int, start: int, end: int) -> torch.Tensor:
        """Values ``start``..``end`` of one unit's flattened reduced fp32 gradient; the caller may scale it in place."""
        return self.read(unit).reshape(-1)[start:end]

    def unit_groups(self, group_bytes: int | None = None) -> Iterator[list[int]]:
        """The units in reading order, in groups of at most ``group_bytes`` of fp32 gradients (a larger
        unit alone; None: one group of every unit)."""
        units: list[int] = []
        size = 0
        for unit, values in self.units():
            if units and group_bytes is not None and size + 4 * values > group_bytes:
                yield units
                units, size = [], 0
            units.append(unit)
            size += 4 * values
        if units:
            yield units

    def step_optimizer(self, optimizer: PairedOptimizer, scale: float = 1.0, group_bytes: int | None = None) -> None:
        """Hand the paired optimizer every reduced gradient times ``scale`` and step it after each group of
        at most ``group_bytes`` of fp32 gradients (see :meth:`unit_groups`); every dp rank groups alike.

        A gradient is read only as it is handed over, so where gradients are read back from 8 bits
        only one group of them exists at a time (the optimizer's step drops what it was handed). A
        unit larger than a group is read and stepped a slice at a time where the optimizer can
        (``step_slices``), so no read-back gradient is ever larger than ``group_bytes``: without
        slices a 128K x 4096 embedding's would be 2 GiB.
        """
        sizes = dict(self.units())
        slice_values = self._slice_values(optimizer, group_bytes)
        for units in self.unit_groups(group_bytes):
            unit = units[0]
            if slice_values and len(units) == 1 and sizes[unit] > slice_values:
                bounds = [(a, min(a + slice_values, sizes[unit])) for a in range(0, sizes[unit], slice_values)]
                optimizer.step_slices(unit, ((a, b, self._scaled(self.read_slice(unit, a, b), scale)) for a, b in bounds))
            else:
                step_in_groups([units], self.read, optimizer.set_grad, optimizer.step, scale)

    def _slice_values(self, optimizer: PairedOptimizer, group_bytes: int | None) -> int:
        """Values per slice of a unit too large for a group: ``group_bytes`` of fp32 in whole slice
        quanta; 0 where the optimizer steps whole tensors only or groups are unbounded."""
        if group_bytes is None or not getattr(optimizer, "steps_slices", False):
            return 0
        return max(1, group_bytes // 4 // self.slice_quantum) * self.slice_quantum

    @staticmethod
    def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
        return grad.mul_(scale) if scale != 1.0 else grad

    def finish_step(self) -> None:
        """Drop this step's gradients."""

    def fp32_wire_bytes(self) -> int:
        """What an fp32 ring all-reduce of the same gradients would send per rank."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Bytes of the persistent gradient storage."""
        raise NotImplementedError

    def link_bytes_last_step(self) -> dict[str, int]:
        """Bytes this rank sent in the last reduction per link class ('intra_node', 'inter_node'),
        where the reduction knows its nodes (the two-hop one); empty otherwise."""
        return {}

    def state_dict(self) -> dict:
        """State that must survive a restart (error-feedback residuals); most syncs keep none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        if state:
            raise ValueError(
                f"this gradient sync keeps no state, but the checkpoint holds {sorted(state)}; resume with the saved precision.gradients"
            )


class ParameterGradientSync(GradientSync):
    """A gradient sync whose units are parameter indices, in the order of the parameters it was given."""

    def gradients(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(parameter index, reduced fp32 gradient), one parameter at a time in reading order."""
        for unit, _ in self.units():
            yield unit, self.read(unit)

    def params_sq_norm(self, indices: set[int]) -> torch.Tensor:
        return torch.stack([sum_of_squares(self.read(i)) for i in sorted(indices)]).sum()


class PlainGradientSync(ParameterGradientSync):
    """An fp32 gradient buffer (Megatron's main_grad) all-reduced in fp32 or bf16, or in two hops over nodes.

    A baseline's reduction of the same buffer overrides :meth:`all_reduce` (benchmarks/_ring8.py's
    FP8-LM-style ring, which no ``precision.gradients`` selects).
    """

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        group: Group,
        device: torch.device,
        wire_dtype: torch.dtype,
        nodes: NodeGroups | None = None,
    ) -> None:
        self.nodes = nodes  # the two-hop reduction's node groups (hier-8/4), or None
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.wire_dtype = wire_dtype
        self.counter = CommCounter()
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self.views = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._hooks = fold_on_accumulate(self.params, lambda i, grad: self.views[i].add_(grad))

    def reduce(self) -> torch.Tensor:
        # The one host read of this sync: which rank's own gradients were non-finite, before the
        # reduction spreads them, so that the warning names the parameter where it went bad.
        ok = all_finite(self.buffer)
        self._nonfinite = []
        if not ok:
            bad = [self.names[i] for i, v in enumerate(self.views) if not bool(torch.isfinite(v).all())]
            self._nonfinite = [(own_rank(), bad[0])]
            warnings.warn(f"non-finite gradient in {bad[0]!r} ({len(bad)} parameter(s)); skipping this step", RuntimeWarning, stacklevel=2)
        self.all_reduce()
        return self._nonfinite_flag(ok)

    def all_reduce(self) -> None:
        """Average the buffer over the dp group, and count the bytes this rank sent."""
        if self.world > 1 and self.nodes is not None:
            self.counter.reset()
            all_reduce_hierarchical(self.buffer, "avg", self.nodes, intra_fmt=HIER_INTRA_FORMAT, inter_fmt=INT4_WIRE_FORMAT, counter=self.counter)
            self.wire_bytes_last_step = self.counter.bytes()
            return
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

    def link_bytes_last_step(self) -> dict[str, int]:
        if self.nodes is None:
            return {}
        return {"intra_node": self.counter.bytes(HOP_NAMES[0]) + self.counter.bytes(HOP_NAMES[2]), "inter_node": self.counter.bytes(HOP_NAMES[1])}

    def _nonfinite_flag(self, ok: bool) -> torch.Tensor:
        # One pass over the reduced gradients gives both their squared norm (kept for
        # local_grad_sq_norm) and whether they are all finite (a peer's NaN arrives in the sum).
        self._sq_norm = sum_of_squares(self.buffer)
        return nonfinite_of_sum(self._sq_norm) + (0.0 if ok else 1.0)

    def local_grad_sq_norm(self) -> torch.Tensor:
        return self._sq_norm

    def units(self) -> list[tuple[int, int]]:
        return [(i, v.numel()) for i, v in enumerate(self.views)]

    def read(self, unit: int) -> torch.Tensor:
        return self.views[unit]

    def finish_step(self) -> None:
        self.buffer.zero_()

    def fp32_wire_bytes(self) -> int:
        return ring_all_reduce_bytes(self.buffer.numel() * 4, self.world)

    def buffer_bytes(self) -> int:
        return self.buffer.numel() * 4


def quantized_buffer(
    params: list[tuple[str, nn.Parameter]],
    group: Group,
    microbatches: int,
    block: int,
    wire: WireChoice,
    counter: CommCounter,
    collective: str = "all_reduce",
    nodes: NodeGroups | None = None,
) -> QuantGradBuffer:
    """The 8-bit buffer (blocks of ``block``) that averages ``params``' gradients over ``group``,
    sending ``wire``'s format: the storage of both QuanGrad syncs, full and sharded (ZeRO-1).
    With ``nodes`` the all-gathers go between nodes, then within them (gathers_by_node)."""
    from agoq.gradient.buffer import QuantGradBuffer

    return QuantGradBuffer(
        params,
        fmt=int8_gradient_format(block),
        group=group,
        op="avg",
        microbatches=microbatches,
        collective=collective,
        counter=counter,
        wire_fmt=wire.fmt,
        error_feedback=wire.error_feedback,
        nodes=nodes,
    )


class QuantizedBufferState:
    """What a sync over a :func:`quantized_buffer` (``self.buffer``) stores and keeps across a restart."""

    buffer: QuantGradBuffer

    def buffer_bytes(self) -> int:
        return self.buffer.storage_bytes

    def state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)

    def nonfinite_last_step(self) -> list[tuple[int, str]]:
        return list(self.buffer.nonfinite)


class QuantizedGradientSync(QuantizedBufferState, ParameterGradientSync):
    """QuanGrad: an 8-bit block-wise buffer, bucketed 8-bit all-reduce started during backward."""

    _ok: bool = True  # whether the last reduce() kept this step's gradients

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        group: Group,
        microbatches: int,
        block: int,
        wire: WireChoice = WireChoice(),
        nodes: NodeGroups | None = None,
    ) -> None:
        self.counter = CommCounter()
        self.nodes = nodes
        self.index = {name: i for i, (name, _) in enumerate(params)}
        self.buffer = quantized_buffer(params, group, microbatches, block, wire, self.counter, nodes=nodes)
        self._buffer_index = {self.index[name]: pi for pi, name in enumerate(self.buffer.names)}
        self.world = self.buffer.world_size

    def start_step(self) -> None:
        self.counter.reset()
        self.buffer.zero_grad()

    def reduce(self) -> torch.Tensor:
        # finish() agrees on non-finite gradients over the dp group (the step's one read of the
        # agreement); the flag is handed on as a device scalar like every sync's.
        self._ok = self.buffer.finish()
        self.wire_bytes_last_step = self.counter.bytes()
        return skip_flag(self._ok, self.buffer.device)

    def local_grad_sq_norm(self) -> torch.Tensor:
        if not self._ok:  # a skipped step's buffer was reset: nothing to read
            return torch.zeros((), dtype=torch.float64, device=self.buffer.device)
        return self.buffer.grad_sq_norm()

    def link_bytes_last_step(self) -> dict[str, int]:
        if self.nodes is None:
            return {}
        inter = sum(self.counter.bytes(name) for name in self.counter.as_dict() if name.endswith(INTER_NODE_SUFFIX))
        return {"intra_node": self.counter.bytes() - inter, "inter_node": inter}

    def units(self) -> list[tuple[int, int]]:
        # Bucket order: a bucket's parameters are read while its storage is warm.
        return [(self.index[self.buffer.names[pi]], self.buffer.params[pi].numel()) for pi in self.buffer.bucket_order()]

    def read(self, unit: int) -> torch.Tensor:
        return self.buffer.grad(self._buffer_index[unit])

    @property
    def slice_quantum(self) -> int:
        return self.buffer.fmt.block_size

    def read_slice(self, unit: int, start: int, end: int) -> torch.Tensor:
        return self.buffer.grad_slice(self._buffer_index[unit], start, end)

    def finish_step(self) -> None:
        self.buffer.zero_grad()

    def fp32_wire_bytes(self) -> int:
        return ring_all_reduce_bytes(self.buffer.numel * 4, self.world)
