"""ZeRO-1 for the trainer: AdamW moments and fp32 master weights sharded over the dp group.

Layout. Gradients live in the buckets of :class:`agoq.gradient.QuantGradBuffer` (parameters in
backward order, each starting on a quantization-block boundary, each bucket padded to W x whole
blocks); every bucket is cut into W equal chunks and dp rank r owns chunk r. The fp32 path lays
its flat buffer out the same way (:func:`plan_buckets`), so a checkpoint does not depend on the
gradient precision.

Step. Gradients are reduce-scattered over dp: QuanGrad's 8-bit reduce-scatter (all-to-all of
8-bit chunks, fp32 sum, no re-quantization: METHOD.md part 3, steps 1-3) or torch's fp32
reduce-scatter. AdamW then steps only this rank's shard, and the updated shard is all-gathered in
the model's compute dtype and written into every parameter.

Weight decay. A shard cuts across parameters; it is stepped as one view per (parameter, shard)
intersection, the views split into a decayed and a non-decayed group by the same rule as the
unsharded optimizer, so the update of every element is the unsharded AdamW's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.gradient.buffer import DEFAULT_BUCKET_BYTES, Segment, all_finite, plan_buckets, sum_of_squares
from agoq.gradient.counter import CommCounter, ring_all_reduce_bytes
from agoq.train.config import OptimSection, TrainConfig
from agoq.gradient.sync import GradientSync
from agoq.train.optim import fused_adamw, no_weight_decay, tensor_bytes


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

    :meth:`gradients` yields (bucket index, shard), which :class:`Zero1Optimizer` takes.
    """

    sharded = True

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: Any, buckets: list[ShardedBucket], counter: CommCounter) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
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

    def local_grad_sq_norm(self) -> float:
        return float(sum(sum_of_squares(s) for s in self._shards)) if self._shards else 0.0

    def gradients(self) -> Iterator[tuple[int, torch.Tensor]]:
        yield from enumerate(self._shards)

    def fp32_wire_bytes(self) -> int:
        return ring_all_reduce_bytes(sum(p.numel() for p in self.params) * 4, self.world)


class Fp32ShardedGradientSync(ShardedGradientSync):
    """An fp32 flat buffer per bucket, reduce-scattered in fp32 (torch's reduce_scatter_single)."""

    def __init__(
        self, params: list[tuple[str, nn.Parameter]], group: Any, device: torch.device, block: int,
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
        self._hooks = [p.register_post_accumulate_grad_hook(self._fold(i)) for i, p in enumerate(self.params)]

    def _fold(self, i: int):
        def hook(p: torch.Tensor) -> None:
            g = p.grad.detach().reshape(-1)
            for s in self._where[i]:
                self.flat[s.bucket][s.offset : s.offset + s.numel].add_(g[s.param_offset : s.param_offset + s.numel])
            p.grad = None

        return hook

    def reduce(self) -> bool:
        ok = all(all_finite(f) for f in self.flat)
        if not ok:
            bad = [self.names[i] for i, ss in enumerate(self._where)
                   if not all(bool(torch.isfinite(self.flat[s.bucket][s.offset : s.offset + s.numel]).all()) for s in ss)]
            warnings.warn(f"non-finite gradient in {bad[0]!r} ({len(bad)} parameter(s)); skipping this step", RuntimeWarning, stacklevel=2)
        self._shards = []
        # Issued whatever this rank saw: every dp rank must call the same collectives.
        for b, flat in zip(self.buckets, self.flat):
            if self.world > 1:
                shard = torch.empty(b.chunk, dtype=torch.float32, device=flat.device)
                dist.reduce_scatter_single(shard, flat, group=self.group)  # SUM: gloo has no AVG
                shard.div_(self.world)
            else:
                shard = flat
            self.counter.record("grad_reduce_scatter_fp32", (self.world - 1) * b.chunk * 4)
            self._shards.append(shard)
        return ok and all(all_finite(s) for s in self._shards)

    def finish_step(self) -> None:
        for f in self.flat:
            f.zero_()
        self._shards = []

    def buffer_bytes(self) -> int:
        return sum(f.numel() * 4 for f in self.flat)


class QuantizedShardedGradientSync(ShardedGradientSync):
    """QuanGrad's 8-bit buffer with the 8-bit reduce-scatter: shards are fp32 sums, never re-quantized."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: Any, microbatches: int, block: int) -> None:
        from agoq.gradient.buffer import QuantGradBuffer

        counter = CommCounter()
        self.buffer = QuantGradBuffer(
            params, fmt=f"int8/{block}", group=group, op="avg", microbatches=microbatches,
            collective="reduce_scatter", counter=counter,
        )
        plan = [(b.layout.world_size * b.layout.padded_chunk, b.segments) for b in self.buffer.buckets]
        super().__init__(params, group, _shard_buckets(plan, self.buffer.world_size, self.buffer.rank), counter)

    def start_step(self) -> None:
        super().start_step()
        self.buffer.zero_grad()

    def reduce(self) -> bool:
        ok = self.buffer.finish()
        self._shards = [shard[: b.chunk] for b, (_, _, _, shard) in zip(self.buckets, self.buffer.local_shards())] if ok else []
        return ok

    def finish_step(self) -> None:
        self.buffer.zero_grad()
        self._shards = []

    def buffer_bytes(self) -> int:
        return self.buffer.storage_bytes


def make_sharded_sync(cfg: TrainConfig, params: list[tuple[str, nn.Parameter]], group: Any, device: torch.device) -> ShardedGradientSync:
    """The ZeRO-1 gradient path the config asks for (precision.gradients int8 or fp32)."""
    mode = cfg.precision.gradients
    if mode == "int8":
        return QuantizedShardedGradientSync(params, group, cfg.parallel.microbatches, cfg.precision.gradient_block)
    if mode == "fp32":
        return Fp32ShardedGradientSync(params, group, device, cfg.precision.gradient_block)
    raise ValueError(f"parallel.zero1=true needs precision.gradients = int8 or fp32, got {mode!r}")


class Zero1Optimizer:
    """AdamW on this dp rank's shard of every gradient bucket; updated shards are all-gathered into the model.

    Same interface as :class:`agoq.train.optim.MasterWeightOptimizer`, with bucket indices in
    place of parameter indices: ``set_grad(bucket, shard)`` for the buckets of a group, then
    ``step()``, which every dp rank must call for the same buckets (it all-gathers them).
    Masters are fp32 shard copies when the model computes in a lower precision; in fp32 the
    optimizer steps views of the parameters themselves, as the unsharded optimizer does.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimSection, sync: ShardedGradientSync) -> None:
        if cfg.name != "adamw":
            raise ValueError(f"parallel.zero1=true does not support optim.name={cfg.name!r}; set optim.name=adamw or parallel.zero1=false")
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if [id(p) for _, p in named] != [id(p) for p in sync.params]:
            raise ValueError("Zero1Optimizer must get the same parameters, in the same order, as its gradient sync")
        self.cfg = cfg
        self.sync = sync
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters have several dtypes {sorted(map(str, dtypes))}; ZeRO-1 all-gathers one compute dtype")
        self.dtype = dtypes.pop()
        self.buckets = sync.buckets
        device = self.params[0].device
        # fp32 masters of the shard; None in fp32, where the pieces are views of the parameters.
        self.masters: list[torch.Tensor | None] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        for b in self.buckets:
            master = None
            if self.dtype != torch.float32:
                master = torch.zeros(b.chunk, dtype=torch.float32, device=device)
                for pc in b.pieces:
                    master[pc.shard_offset : pc.shard_offset + pc.numel] = self._flat(pc.param)[pc.param_offset : pc.param_offset + pc.numel]
            self.masters.append(master)
            self.exp_avg.append(torch.zeros(b.chunk, dtype=torch.float32, device=device))
            self.exp_avg_sq.append(torch.zeros(b.chunk, dtype=torch.float32, device=device))
            views = []
            for pc in b.pieces:
                if master is not None:
                    v = master[pc.shard_offset : pc.shard_offset + pc.numel]
                else:
                    v = self._flat(pc.param)[pc.param_offset : pc.param_offset + pc.numel]
                views.append(v)
                (no_decay if no_weight_decay(self.names[pc.param], self.params[pc.param]) else decay).append(v)
            self.views.append(views)
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.optimizer = fused_adamw(groups, cfg)
        # Moments are views of one flat tensor per bucket shard: a checkpoint stores the shard as is.
        for b, views in zip(self.buckets, self.views):
            for pc, v in zip(b.pieces, views):
                s = slice(pc.shard_offset, pc.shard_offset + pc.numel)
                self.optimizer.state[v] = {"step": torch.zeros((), dtype=torch.float32, device=v.device), "exp_avg": self.exp_avg[b.index][s], "exp_avg_sq": self.exp_avg_sq[b.index][s]}
        self._pending: list[int] = []

    def _flat(self, param: int) -> torch.Tensor:
        return self.params[param].detach().view(-1)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def set_grad(self, index: int, grad: torch.Tensor) -> None:
        """Give bucket ``index`` this rank's (reduced, clipped) fp32 gradient shard."""
        b = self.buckets[index]
        if grad.numel() != b.chunk:
            raise ValueError(f"bucket {index} has a shard of {b.chunk} values, the gradient {grad.numel()}")
        grad = grad.to(torch.float32).reshape(-1)
        for pc, v in zip(b.pieces, self.views[index]):
            v.grad = grad[pc.shard_offset : pc.shard_offset + pc.numel]
        self._pending.append(index)

    @torch.no_grad()
    def step(self) -> None:
        """Update the shards that have gradients, all-gather them into every parameter, drop the gradients."""
        self.optimizer.step()
        for index in self._pending:
            for v in self.views[index]:
                v.grad = None
            self._gather(self.buckets[index])
        self._pending = []

    def _gather(self, b: ShardedBucket) -> None:
        """All-gather one bucket's updated shards in the compute dtype and write every parameter."""
        master = self.masters[b.index]
        if master is not None:
            send = master.to(self.dtype)
        else:
            send = torch.zeros(b.chunk, dtype=self.dtype, device=self.params[0].device)
            for pc, v in zip(b.pieces, self.views[b.index]):
                send[pc.shard_offset : pc.shard_offset + pc.numel] = v
        world = self.sync.world
        if world > 1:
            full = torch.empty(b.numel, dtype=self.dtype, device=send.device)
            dist.all_gather_single(full, send, group=self.sync.group)
        else:
            full = send
        self.sync.counter.record(f"param_all_gather_{str(self.dtype).removeprefix('torch.')}", (world - 1) * b.chunk * send.element_size())
        for s in b.segments:
            self._flat(s.param)[s.param_offset : s.param_offset + s.numel].copy_(full[s.offset : s.offset + s.numel])

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state plus fp32 master shards (not the model's own weights)."""
        total = sum(tensor_bytes(t) for t in self.exp_avg + self.exp_avg_sq)
        total += sum(tensor_bytes(m) for m in self.masters if m is not None)
        total += sum(tensor_bytes(st["step"]) for st in self.optimizer.state.values())
        return total

    def _key(self, b: ShardedBucket) -> tuple[str, str]:
        """(first parameter's global name, 'shard<dp rank>'), with the offset if the bucket starts mid-parameter."""
        first = b.segments[0]
        inner = f"shard{self.sync.rank}" if first.param_offset == 0 else f"at{first.param_offset}.shard{self.sync.rank}"
        return self.names[first.param], inner

    def _step_count(self, b: ShardedBucket) -> torch.Tensor:
        views = self.views[b.index]
        return self.optimizer.state[views[0]]["step"].clone() if views else torch.tensor(0.0)

    def state_dict(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        """Each bucket shard's moments, step and masters under '<first parameter name>.shard<dp rank>'.

        Pipeline stages hold different parameters and dp ranks different shard numbers, so no two
        ranks write the same key in a distributed checkpoint.
        """
        out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        for b in self.buckets:
            name, inner = self._key(b)
            entry = {"exp_avg": self.exp_avg[b.index], "exp_avg_sq": self.exp_avg_sq[b.index], "step": self._step_count(b)}
            if self.masters[b.index] is not None:
                entry["master"] = self.masters[b.index]
            out.setdefault(name, {})[inner] = entry
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, dict[str, torch.Tensor]]]) -> None:
        """Restore what :meth:`state_dict` returned on the same (pp stage, dp rank) layout."""
        for b in self.buckets:
            name, inner = self._key(b)
            entry = state.get(name, {}).get(inner)
            if entry is None:
                raise KeyError(
                    f"optimizer state lacks shard '{name}.{inner}'; resume with the parallel layout and "
                    "precision.gradient_block the checkpoint was saved with"
                )
            for key, mine in (("exp_avg", self.exp_avg[b.index]), ("exp_avg_sq", self.exp_avg_sq[b.index]), ("master", self.masters[b.index])):
                if mine is None:
                    continue
                saved = entry[key]
                if saved.shape != mine.shape:
                    raise ValueError(f"optimizer shard '{name}.{inner}.{key}' has shape {tuple(saved.shape)}, this run {tuple(mine.shape)}")
                if saved is not mine:
                    mine.copy_(saved)
            for v in self.views[b.index]:
                self.optimizer.state[v]["step"].fill_(float(entry["step"]))
