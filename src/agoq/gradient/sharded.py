"""Sharded gradient reduction for ZeRO-1: every dp rank ends a step with the fp32 sum of its shard only.

Layout. Gradients live in the buckets of :class:`agoq.gradient.QuantGradBuffer` (parameters in
backward order, each starting on a quantization-block boundary, each bucket padded to W x whole
blocks); every bucket is cut into W equal chunks and dp rank r owns chunk r. The fp32 path lays
its flat buffer out the same way (:func:`plan_buckets`), so a checkpoint does not depend on the
gradient precision. Gradients are reduce-scattered over dp: QuanGrad's 8-bit reduce-scatter
(all-to-all of 8-bit chunks, fp32 sum, no re-quantization: METHOD.md part 3, steps 1-3) or
torch's fp32 reduce-scatter. The optimizer that steps the shards is agoq.train.zero1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.compat import reduce_scatter_single
from agoq.gradient.collectives import Group, own_rank
from agoq.gradient.counter import CommCounter, ring_all_reduce_bytes
from agoq.gradient.fold import fold_on_accumulate
from agoq.gradient.layout import DEFAULT_BUCKET_BYTES, Segment, plan_buckets
from agoq.gradient.readback import nonfinite_flag, skip_flag, sum_of_squares
from agoq.gradient.sync import GradientSync, QuantizedBufferState, WireChoice, quantized_buffer


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls into this rank's shard of one bucket."""

    param: int
    param_offset: int  # first element in the flattened parameter
    shard_offset: int  # first element in this rank's shard
    numel: int


@dataclass
class ShardedBucket:
    """One gradient bucket: its flat size, its parameter segments and this rank's share of it."""

    index: int
    numel: int  # world x chunk, padding included
    chunk: int  # elements per rank
    segments: list[Segment]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def first_param(self) -> int:
        """Index of the parameter the bucket starts with."""
        return self.segments[0].param


def _shard_buckets(plan: Iterable[tuple[int, list[Segment]]], world: int, rank: int) -> list[ShardedBucket]:
    """The buckets with this rank's pieces: each segment intersected with [rank * chunk, (rank + 1) * chunk)."""
    buckets = []
    for b, (numel, segs) in enumerate(plan):
        if numel % world:
            raise ValueError(f"bucket {b} has {numel} elements, not a multiple of the dp size {world}")
        chunk = numel // world
        lo, hi = rank * chunk, (rank + 1) * chunk
        pieces = []
        for s in segs:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < end:
                pieces.append(Piece(s.param, s.param_offset + start - s.offset, start - lo, end - start))
        buckets.append(ShardedBucket(b, numel, chunk, list(segs), pieces))
    return buckets


class ShardedGradientSync(GradientSync):
    """Gradients reduce-scattered over dp: after :meth:`reduce`, this rank holds one fp32 shard per bucket.

    Its units are bucket indices: :meth:`read` gives a bucket's shard, which
    agoq.train.zero1.Zero1Optimizer takes (:meth:`shards` lists them all).
    """

    sharded = True

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: Group, buckets: list[ShardedBucket], counter: CommCounter) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.group = group
        self.world, self.rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
        self.buckets = buckets
        self.counter = counter
        self._shards: list[torch.Tensor] = []

    @property
    def wire_bytes_last_step(self) -> int:  # type: ignore[override]
        """Bytes this rank sent since start_step: the reduce-scatter and the optimizer's all-gather."""
        return self.counter.bytes()

    def start_step(self) -> None:
        self.counter.reset()
        self._shards = []

    def shards(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 shard of every bucket (``chunk`` values each), after reduce()."""
        return self._shards

    def local_grad_sq_norm(self) -> torch.Tensor:
        return self._sum(sum_of_squares(s) for s in self._shards)

    def params_sq_norm(self, indices: set[int]) -> torch.Tensor:
        return self._sum(
            sum_of_squares(shard[piece.shard_offset : piece.shard_offset + piece.numel])
            for bucket, shard in zip(self.buckets, self._shards)
            for piece in bucket.pieces
            if piece.param in indices
        )

    def units(self) -> list[tuple[int, int]]:
        return [(b, shard.numel()) for b, shard in enumerate(self._shards)]

    def _sum(self, terms: Iterable[torch.Tensor]) -> torch.Tensor:
        """The sum of fp64 scalars on the gradients' device (zero for none)."""
        terms = list(terms)
        return torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64, device=self.device)

    def read(self, unit: int) -> torch.Tensor:
        return self._shards[unit]

    def fp32_wire_bytes(self) -> int:
        return ring_all_reduce_bytes(sum(p.numel() for p in self.params) * 4, self.world)


class Fp32ShardedGradientSync(ShardedGradientSync):
    """An fp32 flat buffer per bucket, reduce-scattered in fp32 (torch's reduce_scatter_single)."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        group: Group,
        device: torch.device,
        block: int,
        bucket_numel: int = DEFAULT_BUCKET_BYTES // 4,
    ) -> None:
        world, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
        plan = plan_buckets([p.numel() for _, p in params], block, bucket_numel, world)
        super().__init__(params, group, _shard_buckets(plan, world, rank), CommCounter())
        self.flat = [torch.zeros(b.numel, dtype=torch.float32, device=device) for b in self.buckets]
        self._where: list[list[Segment]] = [[] for _ in self.params]
        for b in self.buckets:
            for s in b.segments:
                self._where[s.param].append(s)
        self._hooks = fold_on_accumulate(self.params, self._fold)

    def _fold(self, i: int, grad: torch.Tensor) -> None:
        g = grad.detach().reshape(-1)
        for s in self._where[i]:
            self.flat[s.bucket][s.offset : s.offset + s.numel].add_(g[s.param_offset : s.param_offset + s.numel])

    def reduce(self) -> torch.Tensor:
        # The one host read of this sync: whether this rank's own gradients were non-finite, before
        # the reduce-scatter spreads them, so that the warning names the parameter where it went bad.
        ok = not bool(self._sum(nonfinite_flag(f) for f in self.flat))
        self._nonfinite = []
        if not ok:
            bad = [
                self.names[i]
                for i, ss in enumerate(self._where)
                if not all(bool(torch.isfinite(self.flat[s.bucket][s.offset : s.offset + s.numel]).all()) for s in ss)
            ]
            self._nonfinite = [(own_rank(), bad[0])]
            warnings.warn(f"non-finite gradient in {bad[0]!r} ({len(bad)} parameter(s)); skipping this step", RuntimeWarning, stacklevel=2)
        self._shards = []
        # Issued whatever this rank saw: every dp rank must call the same collectives.
        for b, flat in zip(self.buckets, self.flat):
            if self.world > 1:
                shard = torch.empty(b.chunk, dtype=torch.float32, device=flat.device)
                reduce_scatter_single(shard, flat, group=self.group)  # SUM: gloo has no AVG
                shard.div_(self.world)
            else:
                shard = flat
            self.counter.record("grad_reduce_scatter_fp32", (self.world - 1) * b.chunk * 4)
            self._shards.append(shard)
        return self._sum(nonfinite_flag(s) for s in self._shards) + (0.0 if ok else 1.0)

    def finish_step(self) -> None:
        for f in self.flat:
            f.zero_()
        self._shards = []

    def buffer_bytes(self) -> int:
        return sum(f.numel() * 4 for f in self.flat)


class QuantizedShardedGradientSync(QuantizedBufferState, ShardedGradientSync):
    """QuanGrad's 8-bit buffer with the 8-bit reduce-scatter: shards are fp32 sums, never re-quantized."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: Group, microbatches: int, block: int, wire: WireChoice = WireChoice()) -> None:
        counter = CommCounter()
        self.buffer = quantized_buffer(params, group, microbatches, block, wire, counter, collective="reduce_scatter")
        plan = [(b.layout.world_size * b.layout.padded_chunk, b.segments) for b in self.buffer.buckets]
        super().__init__(params, group, _shard_buckets(plan, self.buffer.world_size, self.buffer.rank), counter)

    def start_step(self) -> None:
        super().start_step()
        self.buffer.zero_grad()

    def reduce(self) -> torch.Tensor:
        ok = self.buffer.finish()  # agrees on non-finite gradients over the dp group: the step's one read of it
        self._shards = [shard[: b.chunk] for b, (_, _, _, shard) in zip(self.buckets, self.buffer.local_shards())] if ok else []
        return skip_flag(ok, self.buffer.device)

    def finish_step(self) -> None:
        self.buffer.zero_grad()
        self._shards = []
