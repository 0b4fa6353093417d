"""QuanGrad's gradient buffer: the gradients of a set of parameters, stored in 8 bits.

:class:`QuantGradBuffer` composes four pieces, each in its own module:

- layout (:mod:`agoq.gradient.layout`): parameters in backward order, each on a quantization-block
  boundary, in buckets padded to W x whole blocks, the layout of the 8-bit collective; a
  bucket's storage (:mod:`agoq.gradient.bucket`) is kept in wire rows, so it is sent as it is and
  the reduced rows are gathered back into it;
- accumulation (:mod:`agoq.gradient.fold`): a ``post_accumulate_grad`` hook folds each
  full-precision gradient in as soon as autograd produces it and drops ``p.grad``;
- communication (:mod:`agoq.gradient.pipeline`): a bucket whose parameters are complete starts its
  8-bit all-to-all -> fp32 sum -> requantize -> all-gather while backward runs; :meth:`finish`
  completes the rest and agrees on non-finite gradients;
- reading (:mod:`agoq.gradient.readback`): :meth:`grad`, :meth:`grads` and :meth:`step`
  dequantize one parameter (or one bucket's parameters) at a time, so full-precision gradients
  never exist all at once.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from agoq.quant import QuantFormat

from agoq.gradient.bucket import Bucket, allocate_buckets
from agoq.gradient.collectives import Group, gradient_format, parse_op, world_of
from agoq.gradient.counter import CommCounter
from agoq.gradient.feedback import WireEncoder
from agoq.gradient.fold import COMPILED_FOLD_PIECE, EightBitFolder, fold_on_accumulate
from agoq.gradient.nodes import NodeGroups
from agoq.gradient.layout import (
    DEFAULT_BUCKET_BYTES,
    FOLD_PIECE,
    GradLayout,
    Params,
    Segment,
    bucket_numel_for,
    named_params,
    param_index,
    plan_buckets,
)
from agoq.gradient.pipeline import BucketPipeline
from agoq.gradient.readback import GradReader, all_finite, sum_of_squares

__all__ = [
    "COLLECTIVES",
    "COMPILED_FOLD_PIECE",
    "DEFAULT_BUCKET_BYTES",
    "FOLD_PIECE",
    "Bucket",
    "QuantGradBuffer",
    "Segment",
    "all_finite",
    "plan_buckets",
    "sum_of_squares",
]

COLLECTIVES = ("all_reduce", "reduce_scatter")


def _pipeline_attribute(name: str, doc: str) -> property:
    # The pipeline holds the reduction settings and the step's outcome; the buffer only shows them.
    return property(lambda self: getattr(self.pipeline, name), doc=doc)


class QuantGradBuffer:
    """8-bit block-wise gradient storage for a set of parameters, with bucketed 8-bit collectives.

    ``group`` is the data-parallel ProcessGroup of these parameters (default: WORLD if
    torch.distributed is initialized, else no communication); a pipeline stage passes its own
    parameters and its dp group. ``microbatches`` backward passes make one optimizer step.
    ``collective='reduce_scatter'`` leaves each rank its fp32 shard of every bucket (ZeRO-1).
    """

    group = _pipeline_attribute("group", "The data-parallel group the buckets are reduced over.")
    op = _pipeline_attribute("op", "'sum' or 'avg'.")
    collective = _pipeline_attribute("collective", "'all_reduce' or 'reduce_scatter' (ZeRO-1 shards).")
    overlap = _pipeline_attribute("overlap", "Whether buckets start their reduction while backward runs.")
    counter = _pipeline_attribute("counter", "The CommCounter the collectives record into, if any.")
    world_size = _pipeline_attribute("world_size", "Ranks in the group (1 without torch.distributed).")
    rank = _pipeline_attribute("rank", "This process's rank in the group.")
    communicates = _pipeline_attribute("communicates", "Whether this buffer reduces over more than one rank.")
    microbatches = _pipeline_attribute("microbatches", "Backward passes per optimizer step (change it with zero_grad(microbatches=...)).")
    skipped_steps = _pipeline_attribute("skipped_steps", "Steps skipped because some rank saw a non-finite gradient.")
    nonfinite = _pipeline_attribute(
        "nonfinite", "(global rank, first non-finite parameter's name) of each rank of the group that saw one in the last step."
    )

    def __init__(
        self,
        params: Params,
        *,
        fmt: QuantFormat | str | None = None,
        bucket_numel: int | None = None,
        bucket_bytes: int | None = None,
        group: Group = None,
        op: str | dist.ReduceOp = "avg",
        microbatches: int = 1,
        collective: str = "all_reduce",
        overlap: bool = True,
        counter: CommCounter | None = None,
        wire_fmt: QuantFormat | str | None = None,
        error_feedback: bool = False,
        nodes: NodeGroups | None = None,
    ) -> None:
        self.fmt = gradient_format(fmt)
        op = parse_op(op)
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        self.names, self.params = named_params(params)
        if not self.params:
            raise ValueError("QuantGradBuffer got no parameters that require grad")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; build one buffer per device")
        self.device = devices.pop()
        self.layout = GradLayout([p.numel() for p in self.params], self.fmt, bucket_numel_for(bucket_numel, bucket_bytes), world_of(group)[0])
        self.buckets = allocate_buckets(self.layout, self.device)
        self.folder = EightBitFolder(self.layout, self.buckets, self.device)
        if error_feedback and wire_fmt is None:
            raise ValueError("error_feedback needs a wire_fmt narrower than the storage format (e.g. 'int4/128'): only its rounding is fed back")
        # Only a reduction over several ranks sends anything: one rank keeps its 8-bit storage as it is.
        self.encoder = (
            WireEncoder(self.buckets, gradient_format(wire_fmt), error_feedback) if wire_fmt is not None and world_of(group)[0] > 1 else None
        )
        self.pipeline = BucketPipeline(
            self.buckets,
            self.folder,
            self.names,
            group=group,
            op=op,
            collective=collective,
            overlap=overlap,
            counter=counter,
            microbatches=microbatches,
            encoder=self.encoder,
            nodes=nodes,
        )
        self.reader = GradReader(self.layout, self.buckets, self.pipeline, self.names, self.params)
        self._handles = fold_on_accumulate(self.params, self.pipeline.fold, then=self.pipeline.launch_ready)

    # ---- layout and accounting ----------------------------------------------------------------

    @property
    def segments(self) -> list[list[Segment]]:
        """Per parameter, its segments in parameter order (see GradLayout)."""
        return self.layout.segments

    @property
    def bucket_numel(self) -> int:
        """Values per bucket before padding, in whole blocks."""
        return self.layout.bucket_numel

    @property
    def storage_bytes(self) -> int:
        """Bytes the buffer stores: packed codes plus fp32 scales, padding included, and the
        error-feedback residuals where there are any."""
        residuals = self.encoder.residual_bytes() if self.encoder is not None else 0
        return sum(b.wire.numel() for b in self.buckets) + residuals

    def state_dict(self) -> dict:
        """What must survive a restart: the error-feedback residuals (empty without error feedback)."""
        return self.encoder.state_dict() if self.encoder is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        if self.encoder is not None:
            self.encoder.load_state_dict(state)
        elif state:
            raise ValueError("the saved gradient state holds error-feedback residuals, but this buffer has no error feedback")

    @property
    def numel(self) -> int:
        """Gradient values held (sum of parameter sizes)."""
        return self.layout.numel

    @property
    def peak_fp_grad_bytes(self) -> int:
        """The most full-precision gradient bytes held at once: a fold's gradient and scratch, or a shard being summed."""
        return max(self.folder.peak_fp_grad_bytes, self.pipeline.peak_shard_bytes)

    def memory_stats(self) -> dict[str, int]:
        """Storage bytes, the fp32 size of one full gradient and of the largest bucket, and the peak."""
        return {
            "storage_bytes": self.storage_bytes,
            "fp32_grad_bytes": 4 * self.numel,
            "largest_bucket_fp32_bytes": 4 * max(b.layout.world_size * b.layout.padded_chunk for b in self.buckets),
            "peak_fp_grad_bytes": self.peak_fp_grad_bytes,
            "buckets": len(self.buckets),
        }

    def bucket_order(self) -> list[int]:
        """Parameter indices grouped by the bucket that holds their last segment."""
        return self.layout.bucket_order()

    # ---- accumulation and communication -------------------------------------------------------

    def bucket_states(self) -> list[str]:
        """Per bucket: 'open', 'launched' (all-to-all in flight), 'reducing' (all-gather) or 'done'."""
        return self.pipeline.states()

    def remove_hooks(self) -> None:
        """Stop folding gradients into this buffer (p.grad behaves normally again)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def zero_grad(self, microbatches: int | None = None) -> None:
        """Empty the buffer for the next optimizer step (optionally with a new micro-batch count)."""
        self.pipeline.reset(microbatches)

    def fold(self, param: int | str | torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add one micro-batch's full-precision gradient of ``param`` into the 8-bit buffer."""
        self.pipeline.fold(param_index(self.names, self.params, param), grad)
        self.pipeline.launch_ready()

    def finish(self) -> bool:
        """Complete every bucket's collective and agree on non-finite gradients; False = skip step."""
        return self.pipeline.finish()

    # ---- reading back -------------------------------------------------------------------------

    def grad(self, param: int | str | torch.nn.Parameter, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored gradient of one parameter, dequantized, in the parameter's shape."""
        return self.reader.grad(param, dtype)

    def grad_slice(self, param: int | str | torch.nn.Parameter, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values ``start``..``end`` of one parameter's flattened gradient, dequantized (``start`` on a block boundary)."""
        return self.reader.grad_slice(param, start, end, dtype)

    def grads(self) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """(name, parameter, fp32 gradient) one parameter at a time, in bucket order."""
        return self.reader.grads()

    def grad_norm(self) -> float:
        """L2 norm of the stored gradients, accumulated in fp64 a piece at a time (see GradReader.grad_sq_norm)."""
        return self.reader.grad_norm()

    def grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the stored gradients: an fp64 scalar on the buffer's device, not read by the host."""
        return self.reader.grad_sq_norm()

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float = 1.0) -> None:
        """Run ``optimizer`` bucket by bucket, each parameter's .grad set only while its bucket steps.

        torch optimizers skip parameters whose .grad is None, so every parameter is stepped exactly
        once; ``grad_scale`` multiplies the gradients (e.g. a clipping coefficient).
        """
        if not self.pipeline.finished:
            self.finish()
        if self.pipeline.ok:
            self.reader.step(optimizer, grad_scale)

    def local_shards(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """reduce_scatter mode: (bucket, start, end, fp32 values) of this rank's shard of each bucket."""
        return self.reader.local_shards()
