"""The bucket pipeline of the 8-bit gradient buffer: counting folds, reducing buckets while backward runs.

A bucket whose parameters have all received their last micro-batch's gradient starts its 8-bit
all-to-all at once (async), while backward continues; buckets start strictly in index order, and
the previous bucket's reduce and all-gather are issued right after, so every rank issues the same
collectives in the same order. :meth:`BucketPipeline.finish` completes the rest, then agrees on
non-finite gradients with one small all-reduce; a step that saw one anywhere is skipped on every
rank and the buffer is emptied.

On a GPU the buckets' collectives and the reduction kernels around them run on a side stream,
which waits for the folds before each bucket starts: the backward's kernels on the default stream
never queue behind a bucket's reduction, nor wait for its all-to-all on a slow link. The default
stream waits for the side stream once, at finish().
"""

from __future__ import annotations

import contextlib
import warnings
from typing import ContextManager

import torch

from agoq.quant import backend

from agoq.gradient.bucket import Bucket
from agoq.gradient.collectives import EightBitReduction, Group, agree_nonfinite, global_rank, world_of
from agoq.gradient.counter import CommCounter
from agoq.gradient.feedback import WireEncoder
from agoq.gradient.fold import EightBitFolder
from agoq.gradient.nodes import NodeGroups


class BucketPipeline:
    """Per-step fold counts and bucket states; starts, progresses and completes each bucket's collective.

    ``collective='reduce_scatter'`` leaves each bucket's fp32 shard in ``Bucket.shard`` (ZeRO-1)
    instead of gathering the requantized sum back into the bucket.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        folder: EightBitFolder,
        names: list[str],
        *,
        group: Group,
        op: str,
        collective: str,
        overlap: bool,
        counter: CommCounter | None,
        microbatches: int,
        encoder: WireEncoder | None = None,
        nodes: NodeGroups | None = None,
    ) -> None:
        self.buckets = buckets
        self.nodes = nodes  # the group's nodes: the all-gathers go between nodes, then within (gathers_by_node)
        self.encoder = encoder  # a narrower wire format than the storage (and error feedback), or None
        self.folder = folder
        self.segments = folder.layout.segments
        self.numels = folder.layout.numels
        self.names = names
        self.group = group
        self.op = op
        self.collective = collective
        self.overlap = overlap
        self.counter = counter
        self.world_size, self.rank = world_of(group)
        self.microbatches = microbatches
        self.peak_shard_bytes = 0
        device = folder.device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and self.communicates else None
        self.skipped_steps = 0
        self.nonfinite: list[tuple[int, str]] = []
        self._clean = False  # whether nothing happened since the last reset (a second reset has nothing to do)
        self.reset()

    @property
    def communicates(self) -> bool:
        """Whether the buckets are reduced over more than one rank."""
        return self.world_size > 1

    def reset(self, microbatches: int | None = None) -> None:
        """Empty every bucket for the next optimizer step (optionally with a new micro-batch count)."""
        if microbatches is not None:
            self.microbatches = microbatches
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if self._clean:  # the trainer empties the buffer after a step and before the next
            return
        self._join_side()  # a step abandoned before finish(): the side stream's kernels write the buckets
        zero_scales = getattr(backend.kernels(self.folder.device, self.folder.fmt), "zero_scales_spans_", None)
        for b in self.buckets:
            b.reset(clear=zero_scales is None)
        if zero_scales is not None:  # Triton: every bucket's scales in one launch
            zero_scales(self.folder.spans.storage, self.folder.spans.rows())
        if self.encoder is not None:
            self.encoder.discard()  # residuals staged by a step that was not finished
        self.folder.reset()
        self._folds = [0] * len(self.segments)
        self._next = 0
        self.finished = False
        self.ok = True
        self._clean = True

    def fold(self, pi: int, grad: torch.Tensor) -> None:
        """Fold one micro-batch's gradient of parameter ``pi``; its buckets may then be ready (see launch_ready)."""
        if grad.numel() != self.numels[pi]:
            raise ValueError(f"gradient of {self.names[pi]!r} has {grad.numel()} values, the parameter {self.numels[pi]}")
        if any(self.buckets[seg.bucket].state != "open" for seg in self.segments[pi]):
            raise RuntimeError(
                f"parameter {self.names[pi]!r} received a gradient after its bucket's reduction started "
                f"(more backward passes than microbatches={self.microbatches}, or finish() already ran); "
                "call zero_grad() before the next step, or zero_grad(microbatches=...) to change the count"
            )
        if self._folds[pi] >= self.microbatches:
            raise RuntimeError(
                f"parameter {self.names[pi]!r} received gradient {self._folds[pi] + 1} of a step configured "
                f"for microbatches={self.microbatches}; call finish() and zero_grad() between steps, or "
                "pass the right count to zero_grad(microbatches=...)"
            )
        self._clean = False
        self.folder.fold(pi, grad, first=self._folds[pi] == 0)
        self._folds[pi] += 1
        if self._folds[pi] == self.microbatches:
            for seg in self.segments[pi]:
                self.buckets[seg.bucket].pending -= 1

    def launch_ready(self) -> None:
        """Launch, in index order, every bucket whose parameters have all received their last gradient."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._launch(self._next)

    def states(self) -> list[str]:
        """Per bucket: 'open', 'launched' (all-to-all in flight), 'reducing' (all-gather) or 'done'."""
        return [b.state for b in self.buckets]

    def finish(self) -> bool:
        """Complete every bucket's collective and agree on non-finite gradients; False = skip step."""
        if self.finished:
            return self.ok
        self._clean = False
        with self._on_side():
            self._complete_all()
        self._join_side()
        self.nonfinite = []
        flags = agree_nonfinite(self.folder.first_nonfinite(), self.group, device=self.folder.device, counter=self.counter)
        self.finished = True
        bad = [(r, i) for r, i in enumerate(flags) if i is not None]
        if bad:
            self._skip(bad)
        elif self.encoder is not None:
            self.encoder.commit()
        return self.ok

    def _launch(self, b: int) -> None:
        self._clean = False
        bucket = self.buckets[b]
        bucket.state = "launched"
        self._next = b + 1
        if not self.overlap:
            return
        with self._on_side():
            self._start(bucket)
            # Keep at most three buckets' communication in flight (this one's all-to-all, the previous
            # one's all-gather, and the one before it finishing): temporaries stay a few buckets' worth
            # whatever the model size, and each collective had a whole bucket's time to complete.
            if b > 0:
                self._progress(self.buckets[b - 1])
            if b > 1:
                self._complete(self.buckets[b - 2])

    def _join_side(self) -> None:
        """Order the current stream after everything queued on the side stream (no-op without one)."""
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)

    def _on_side(self) -> ContextManager[object]:
        """The side stream as the current one, once it has waited for the work queued so far (the
        folds into the buckets it sends); a no-op off the GPU or on one rank."""
        if self._side is None:
            return contextlib.nullcontext()
        self._side.wait_stream(torch.cuda.current_stream(self._side.device))
        return torch.cuda.stream(self._side)

    def _start(self, bucket: Bucket) -> None:
        if not self.communicates:
            return
        name = "grad_all_reduce_8bit" if self.collective == "all_reduce" else "grad_reduce_scatter_8bit"
        # The bucket's own storage is sent as it is (it takes no fold until reset, and is
        # overwritten only by the all-gather that follows this all-to-all), or its rows in the
        # narrower wire format.
        rows, layout = self.encoder.encode(bucket) if self.encoder is not None else (bucket.wire, bucket.layout)
        bucket.reduction = EightBitReduction(rows, layout, self.op, self.group, counter=self.counter, name=name, nodes=self.nodes)

    def _progress(self, bucket: Bucket) -> None:
        if bucket.state != "launched":
            return
        bucket.state = "reducing"
        if bucket.reduction is None:
            return
        if self.collective == "reduce_scatter":
            bucket.shard = bucket.reduction.reduce()
            self.peak_shard_bytes = max(self.peak_shard_bytes, 2 * bucket.shard.numel() * 4)
        else:
            # A piece of the chunk in fp32 at a time; the rows gathered straight into the storage,
            # whose bytes the all-to-all has sent (a narrower wire format is decoded into it later).
            bucket.reduction.reduce_and_gather(out=bucket.wire if self.encoder is None else None)

    def _complete(self, bucket: Bucket) -> None:
        if bucket.reduction is not None and self.collective == "all_reduce":
            gathered = bucket.reduction.gathered()
            if self.encoder is not None:
                self.encoder.decode_into(bucket, gathered)
            elif gathered.data_ptr() != bucket.wire.data_ptr():  # gathered over nodes, into a tensor of its own
                bucket.wire.copy_(gathered)
        bucket.reduction = None
        bucket.state = "done"

    def _complete_all(self) -> None:
        for b in range(self._next, len(self.buckets)):
            self._launch(b)
        for i, bucket in enumerate(self.buckets):
            if not self.overlap and bucket.state == "launched":
                self._start(bucket)
            self._progress(bucket)
            if i > 0:
                self._complete(self.buckets[i - 1])  # one all-gather in flight while the next bucket reduces
        if self.buckets:
            self._complete(self.buckets[-1])

    def _skip(self, bad: list[tuple[int, int]]) -> None:
        """Every rank skips this step: ``bad`` names (group rank, first non-finite parameter) of each rank that saw one."""
        self.skipped_steps += 1
        # Global ranks: a rank of a pipeline stage's dp group is another process than the global rank of that number.
        self.nonfinite = [(global_rank(self.group, r), self.names[i]) for r, i in bad]
        where = ", ".join(f"{name!r} on rank {r}" for r, name in self.nonfinite)
        warnings.warn(
            f"non-finite gradient in {where}; skipping this optimizer step and resetting the 8-bit "
            "gradient buffer (lower the learning rate or check the loss if this repeats)",
            RuntimeWarning,
            stacklevel=4,  # past this, BucketPipeline.finish and QuantGradBuffer.finish: the code that finished the step
        )
        self.reset()
        self.finished, self.ok, self._clean = True, False, False
