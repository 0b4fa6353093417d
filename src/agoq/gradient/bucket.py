"""One bucket of the 8-bit gradient buffer: its storage and where it stands in the step's reduction.

The storage (packed codes and fp32 block scales, in the layout of the 8-bit collective) is
allocated once and only ever written in place, so views of it (the fold regions) stay valid and
the bucket goes on the wire as it is. Its state runs open -> launched (all-to-all in flight) ->
reducing (all-gather in flight) -> done, and back to open at ``reset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agoq.quant import QTensor
from agoq.quant.qtensor import quantize as reference_quantize

from agoq.gradient.collectives import ChunkLayout, EightBitReduction
from agoq.gradient.layout import GradLayout, Segment


@dataclass
class Bucket:
    """One bucket's 8-bit storage, its segments, and this step's reduction state."""

    index: int
    layout: ChunkLayout
    payload: torch.Tensor
    scales: torch.Tensor
    segments: list[Segment] = field(default_factory=list)
    pending: int = 0  # segments still waiting for their last micro-batch's gradient
    state: str = "open"  # open -> launched -> reducing -> done
    reduction: EightBitReduction | None = None
    shard: torch.Tensor | None = None

    @property
    def values(self) -> QTensor:
        """The whole bucket (world_size x padded_chunk values) as one flat QTensor over its storage."""
        n = self.layout.world_size * self.layout.padded_chunk
        return QTensor(self.payload, self.scales, torch.Size([n]), torch.float32, self.layout.fmt)

    def reset(self) -> None:
        """Empty the bucket for the next step."""
        # A zero scale makes every code decode to 0, whatever the payload holds.
        self.scales.zero_()
        self.pending = len(self.segments)
        self.state = "open"
        self.reduction = None
        self.shard = None


def allocate_buckets(layout: GradLayout, device: torch.device | str = "cpu") -> list[Bucket]:
    """The storage of every bucket of ``layout`` on ``device`` (the parameters'), each code the code of 0.0."""
    fmt = layout.fmt
    # The code of 0.0, from the reference quantizer: one block through a compiled one would
    # compile (or load) a one-block variant in every process before the first step.
    zero = reference_quantize(torch.zeros(fmt.block_size), fmt).payload[:1].to(device)
    buckets = []
    for b, (chunks, segs) in enumerate(zip(layout.chunks, layout.bucket_segments)):
        n = chunks.world_size * chunks.padded_chunk
        payload = zero.expand(fmt.payload_bytes(n)).clone()
        scales = torch.zeros(fmt.num_blocks(n), dtype=torch.float32, device=device)
        buckets.append(Bucket(b, chunks, payload, scales, segs))
    return buckets
