"""ZeRO-1 for the trainer: AdamW moments and fp32 master weights sharded over the dp group.

Step. Gradients are reduce-scattered over dp into this rank's shard of every bucket
(agoq.gradient.sharded: the layout and both precisions). AdamW then steps only this rank's shard,
and the updated shard is all-gathered in the model's compute dtype and written into every
parameter.

Weight decay. A shard cuts across parameters; it is stepped as one view per (parameter, shard)
intersection, the views split into a decayed and a non-decayed group by the same rule as the
unsharded optimizer, so the update of every element is the unsharded AdamW's.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from agoq.compat import all_gather_single
from agoq.gradient.sharded import ShardedBucket, ShardedGradientSync
from agoq.train.optim_section import OptimSection
from agoq.train.optim import fused_adamw, no_weight_decay, set_lr, tensor_bytes


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
                self.optimizer.state[v] = {
                    "step": torch.zeros((), dtype=torch.float32, device=v.device),
                    "exp_avg": self.exp_avg[b.index][s],
                    "exp_avg_sq": self.exp_avg_sq[b.index][s],
                }
        self._pending: list[int] = []

    def _flat(self, param: int) -> torch.Tensor:
        return self.params[param].detach().view(-1)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group."""
        set_lr(self.optimizer, lr)

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
            all_gather_single(full, send, group=self.sync.group)
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
