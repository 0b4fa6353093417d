"""Reading reduced gradients back out of 8 bits, and handing them to an optimizer a group at a time.

:class:`GradReader` dequantizes one parameter (or one piece of a bucket) at a time, so
full-precision gradients never exist all at once: a parameter's gradient, the fp64 norm, a torch
optimizer stepped bucket by bucket, and ZeRO-1's fp32 shards. :func:`step_in_groups` is the one
loop that hands read-back gradients to an optimizer and steps it after each group; the buffer and
every gradient sync step through it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from agoq.quant import backend, dequantize

from agoq.gradient.bucket import Bucket
from agoq.gradient.layout import GradLayout, param_index
from agoq.gradient.pipeline import BucketPipeline


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``t`` as an fp64 scalar, accumulated in fp64 without an fp64 copy of ``t``."""
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, without a tensor-sized mask or copy (a host read: see :func:`nonfinite_flag`)."""
    return not bool(nonfinite_flag(t))


def nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    """1.0 (fp64, on ``t``'s device) where ``t`` holds a NaN or Inf, else 0.0, without a host read.

    Squares of fp32/bf16/fp16 values stay below 1.2e77, so their fp64 sum is finite for any count
    unless an element is NaN or Inf.
    """
    return nonfinite_of_sum(sum_of_squares(t))


def nonfinite_of_sum(sq: torch.Tensor) -> torch.Tensor:
    """1.0 (fp64) where the sum of squares ``sq`` is not finite (a NaN or Inf went into it), else 0.0."""
    return (~torch.isfinite(sq)).to(torch.float64)


def skip_flag(ok: bool, device: torch.device) -> torch.Tensor:
    """The non-finite flag of a sync that already knows on the host whether its step is kept: 0.0 or 1.0 (fp64, on ``device``)."""
    return torch.full((), 0.0 if ok else 1.0, dtype=torch.float64, device=device)


def step_in_groups(
    groups: Iterable[list[int]],
    read: Callable[[int], torch.Tensor],
    set_grad: Callable[[int, torch.Tensor], None],
    step: Callable[[], None],
    scale: float = 1.0,
) -> None:
    """For each group of units: read each unit's gradient, scale it in place, hand it to ``set_grad``; then ``step()``.

    A gradient is read only as it is handed over, so read-back gradients exist one group at a time
    when ``step`` lets go of what it was handed.
    """
    for units in groups:
        for unit in units:
            grad = read(unit)
            set_grad(unit, grad.mul_(scale) if scale != 1.0 else grad)
        step()


class _TorchOptimizerSteps:
    """A torch optimizer as ``set_grad``/``step``: each parameter's .grad set only while its group steps.

    torch optimizers skip parameters whose .grad is None, so every parameter is stepped exactly once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.params = params
        self._handed: list[int] = []

    def set_grad(self, pi: int, grad: torch.Tensor) -> None:
        self.params[pi].grad = grad.to(self.params[pi].dtype)
        self._handed.append(pi)

    def step(self) -> None:
        self.optimizer.step()
        for pi in self._handed:
            self.params[pi].grad = None
        self._handed = []


class GradReader:
    """The read-back side of a buffer: gradients per parameter, their norm, optimizer steps and shards."""

    def __init__(
        self, layout: GradLayout, buckets: list[Bucket], pipeline: BucketPipeline, names: list[str], params: list[torch.nn.Parameter]
    ) -> None:
        self.layout = layout
        self.buckets = buckets
        self.pipeline = pipeline
        self.names = names
        self.params = params
        self.device = pipeline.folder.device

    def check_readable(self) -> None:
        """Raise unless the buckets hold reduced (or purely local) gradients."""
        if self.pipeline.collective == "reduce_scatter" and self.pipeline.finished:
            raise RuntimeError("a reduce_scatter buffer holds shards after finish(); read them with local_shards()")
        if any(b.state in ("launched", "reducing") for b in self.buckets) and self.pipeline.communicates:
            raise RuntimeError("gradients are being reduced; call finish() before reading them")

    def grad(self, param: int | str | torch.nn.Parameter, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored gradient of one parameter (an index, a name or the parameter), dequantized, in its shape."""
        self.check_readable()
        pi = param_index(self.names, self.params, param)
        p = self.params[pi]
        return self._read(pi, 0, p.numel(), dtype).view(p.shape)

    def grad_slice(self, param: int | str | torch.nn.Parameter, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values ``start``..``end`` of one parameter's flattened stored gradient, dequantized; only
        the blocks holding them are read. ``start`` is a multiple of the block size."""
        self.check_readable()
        pi = param_index(self.names, self.params, param)
        numel, block = self.params[pi].numel(), self.layout.fmt.block_size
        if not 0 <= start < end <= numel or start % block:
            raise ValueError(f"slice {start}..{end} of {self.names[pi]!r} ({numel} values) must start on a block of {block} values and lie inside it")
        return self._read(pi, start, end, dtype)

    def _read(self, pi: int, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        read_spans = getattr(backend.kernels(self.device, self.layout.fmt), "dequantize_spans", None)
        if read_spans is not None:  # Triton: every bucket the values lie in, in one launch
            spans = self.pipeline.folder.spans
            return read_spans(spans.storage, spans.of_param(pi, start, end), torch.empty(end - start, dtype=dtype, device=self.device))
        # Segments start on block boundaries of the parameter (GradLayout) and bucket rows are
        # whole blocks, so a start on a block boundary is one in every part read below.
        parts = []  # (bucket, its start, parameter values lo..hi) of each span within one bucket row
        for seg in self.layout.segments[pi]:
            bucket = self.buckets[seg.bucket]
            parts += [(bucket, a, lo, hi) for a, lo, hi in bucket.spans(seg, lo=start, hi=end)]
        if len(parts) == 1:  # the common case: dequantize straight into the result
            bucket, a, lo, hi = parts[0]
            return dequantize(bucket.blocks(a, hi - lo, dtype))[: hi - lo]
        out = torch.empty(end - start, dtype=dtype, device=self.device)
        for bucket, a, lo, hi in parts:
            out[lo - start : hi - start] = dequantize(bucket.blocks(a, hi - lo))[: hi - lo]
        return out

    def grads(self) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """(name, parameter, fp32 gradient) one parameter at a time, in bucket order."""
        for pi in self.layout.bucket_order():
            yield self.names[pi], self.params[pi], self.grad(pi)

    def grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the stored gradients (padding holds zeros): an fp64 scalar on the
        buffer's device, never read by the host here (the trainer reads it once per step, with the loss).

        The Triton kernels read every bucket row in one launch, compiled CPU code each row in one
        pass; the torch formulas dequantize a cache-sized piece of a row at a time (GradLayout.piece).
        """
        self.check_readable()
        kernels = backend.kernels(self.device, self.layout.fmt)
        every_row = getattr(kernels, "sum_of_squares_spans", None)
        if every_row is not None:  # Triton: every row of every bucket in one launch
            spans = self.pipeline.folder.spans
            return every_row(spans.storage, spans.rows())
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        one_pass = getattr(kernels, "sum_of_squares", None)
        piece = self.layout.piece(self.device)
        for b in self.buckets:
            for r in range(b.layout.world_size):
                row = b.row(r)
                if one_pass is not None:
                    total += one_pass(row)
                    continue
                for start in range(0, row.numel, piece):
                    total += sum_of_squares(dequantize(row.blocks(start, piece)))
        return total

    def grad_norm(self) -> float:
        """L2 norm of the stored gradients, accumulated in fp64 (reads :meth:`grad_sq_norm` on the host)."""
        return float(self.grad_sq_norm().sqrt())

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float = 1.0) -> None:
        """Run ``optimizer`` once per bucket on the parameters that bucket completes (see GradLayout.params_ending_in)."""
        groups = [group for group in map(self.layout.params_ending_in, range(len(self.buckets))) if group]
        steps = _TorchOptimizerSteps(optimizer, self.params)
        step_in_groups(groups, self.grad, steps.set_grad, steps.step, grad_scale)

    def local_shards(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """reduce_scatter mode: (bucket, start, end, fp32 values) of this rank's shard of each bucket.

        ``start``/``end`` are offsets in the bucket's flat layout (see GradLayout.segments); the
        shard is [rank * chunk, (rank + 1) * chunk) of the bucket.
        """
        if self.pipeline.collective != "reduce_scatter":
            raise RuntimeError("local_shards() needs QuantGradBuffer(collective='reduce_scatter')")
        if not self.pipeline.finished:
            raise RuntimeError("call finish() before local_shards()")
        out = []
        for b in self.buckets:
            start, end = b.layout.shard_range(self.pipeline.rank)
            shard = b.shard
            if shard is None:
                # One rank, or a skipped step: the local values are the whole reduction.
                shard = dequantize(b.blocks(start, end - start))[: end - start]
            out.append((b.index, start, end, shard))
        return out
