"""One bucket of the 8-bit gradient buffer: its storage and where it stands in the step's reduction.

The storage is the 8-bit collective's wire layout itself: one row per rank's chunk, its packed codes
then its fp32 block scales (uint8 [W, row bytes]). It is allocated once and only ever written in
place, so views of it (the fold regions) stay valid, the all-to-all sends it as it is (no wire copy
beside it), and the all-gather writes the reduced rows straight back into it. Values are addressed
by their flat offset in the bucket (rank r's chunk is values r * padded_chunk ...); a region must
lie in one row (:meth:`Bucket.ranges` cuts a span at the row boundaries). Its state runs open ->
launched (all-to-all in flight) -> reducing (all-gather in flight) -> done, and back to open at
``reset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from agoq.quant import QTensor
from agoq.quant.formats import SCALE_BYTES
from agoq.quant.qtensor import quantize as reference_quantize
from agoq.quant.spans import Span, SpanTable, span_table

from agoq.gradient.collectives import ChunkLayout, EightBitReduction
from agoq.gradient.layout import GradLayout, Segment


@dataclass
class Bucket:
    """One bucket's 8-bit storage (in wire rows), its segments, and this step's reduction state."""

    index: int
    layout: ChunkLayout
    wire: torch.Tensor  # uint8 [world_size, row_bytes]: per rank's chunk, codes then fp32 scales
    segments: list[Segment] = field(default_factory=list)
    pending: int = 0  # segments still waiting for their last micro-batch's gradient
    state: str = "open"  # open -> launched -> reducing -> done
    reduction: EightBitReduction | None = None
    shard: torch.Tensor | None = None
    storage: torch.Tensor | None = None  # the buffer's one flat storage, which ``wire`` is a view of (allocate_buckets)
    byte_offset: int = 0  # where ``wire`` starts in it

    @property
    def numel(self) -> int:
        """Values the bucket holds, padding included (world_size x padded_chunk)."""
        return self.layout.world_size * self.layout.padded_chunk

    def row(self, r: int) -> QTensor:
        """Rank ``r``'s chunk (padded_chunk values) as a QTensor over the storage."""
        pb = self.layout.row_payload_bytes
        size = torch.Size([self.layout.padded_chunk])
        return QTensor(self.wire[r, :pb], self.wire[r, pb:].view(torch.float32), size, torch.float32, self.layout.fmt)

    def blocks(self, start: int, numel: int, dtype: torch.dtype | None = None) -> QTensor:
        """Values start..start+numel (rounded up to whole blocks, within one row) as a QTensor over the storage."""
        r, offset = divmod(start, self.layout.padded_chunk)
        if offset + numel > self.layout.padded_chunk:
            raise ValueError(f"values {start}..{start + numel} of bucket {self.index} cross a row boundary; cut them with ranges()")
        return self.row(r).blocks(offset, numel, dtype)

    def ranges(self, start: int, numel: int, piece: int | None = None) -> Iterator[tuple[int, int]]:
        """(a, b) spans covering values start..start+numel in order, none crossing a row boundary
        and none longer than ``piece`` values."""
        end, chunk = start + numel, self.layout.padded_chunk
        while start < end:
            stop = min(end, (start // chunk + 1) * chunk)
            if piece is not None:
                stop = min(stop, start + piece)
            yield start, stop
            start = stop

    def spans(self, seg: Segment, piece: int | None = None, lo: int | None = None, hi: int | None = None) -> Iterator[tuple[int, int, int]]:
        """(bucket start, parameter start, parameter end) of each span of segment ``seg``'s values
        (those of parameter values lo..hi, default all), cut as :meth:`ranges` cuts."""
        lo = seg.param_offset if lo is None else max(lo, seg.param_offset)
        hi = seg.param_offset + seg.numel if hi is None else min(hi, seg.param_offset + seg.numel)
        shift = seg.offset - seg.param_offset  # bucket offset minus parameter offset, along the segment
        for a, b in self.ranges(lo + shift, hi - lo, piece):
            yield a, a - shift, b - shift

    def span(self, start: int, numel: int, first: int) -> Span:
        """Values start..start+numel (within one row, ``start`` on a block) as a span of the shared
        storage, its first value at ``first`` of the flat tensor beside it (agoq.quant.spans)."""
        r, offset = divmod(start, self.layout.padded_chunk)
        if offset + numel > self.layout.padded_chunk:
            raise ValueError(f"values {start}..{start + numel} of bucket {self.index} cross a row boundary; cut them with ranges()")
        row = self.byte_offset + r * self.layout.row_bytes
        fmt = self.layout.fmt
        return Span(first, numel, row + fmt.payload_bytes(offset), row + self.layout.row_payload_bytes + SCALE_BYTES * (offset // fmt.block_size))

    def row_spans(self) -> list[Span]:
        """Every row of the bucket as a span of the shared storage (values counted from 0 in each)."""
        chunk = self.layout.padded_chunk
        return [self.span(r * chunk, chunk, 0) for r in range(self.layout.world_size)]

    def flat(self) -> QTensor:
        """A copy of the whole bucket as one flat QTensor (every row's codes, then every row's scales)."""
        rows = [self.row(r) for r in range(self.layout.world_size)]
        payload = torch.cat([q.payload for q in rows])
        scales = torch.cat([q.scales for q in rows])
        return QTensor(payload, scales, torch.Size([self.numel]), torch.float32, self.layout.fmt)

    def load_flat(self, q: QTensor) -> None:
        """Write a whole-bucket flat QTensor (as :meth:`flat` gives) into the storage."""
        pb, w = self.layout.row_payload_bytes, self.layout.world_size
        self.wire[:, :pb].copy_(q.payload.view(w, pb))
        self.wire[:, pb:].view(torch.float32).copy_(q.scales.view(w, -1))

    def reset(self, clear: bool = True) -> None:
        """Empty the bucket for the next step, once any collective still in flight on it is done
        (``clear=False``: its scales are zeroed by the caller, all buckets at once)."""
        if self.reduction is not None:
            # Its all-to-all reads these rows and its all-gather writes them: zeroing them now
            # would race with the peers' bytes arriving (a step abandoned mid-backward).
            self.reduction.drain()
        if clear:
            # A zero scale makes every code decode to 0, whatever the payload holds.
            self.wire[:, self.layout.row_payload_bytes :].zero_()
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
    # One storage holds every bucket end to end (each a whole number of fp32 words: codes of whole
    # blocks, then scales), so a kernel can address any of them from one pointer: a parameter
    # spread over many buckets is folded and read in one launch (agoq.quant.spans).
    sizes = [chunks.world_size * chunks.row_bytes for chunks in layout.chunks]
    storage = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    buckets, offset = [], 0
    for b, (chunks, segs) in enumerate(zip(layout.chunks, layout.bucket_segments)):
        wire = storage[offset : offset + sizes[b]].view(chunks.world_size, chunks.row_bytes)
        wire[:, : chunks.row_payload_bytes] = zero
        buckets.append(Bucket(b, chunks, wire, segs, storage=storage, byte_offset=offset))
        offset += sizes[b]
    return buckets


class StorageSpans:
    """Span tables over the buckets' one storage, each built on first use and kept: a parameter's
    values (or a slice of them) wherever its segments lie, and every row of every bucket. The
    Triton path folds, reads back, takes the norm of and empties the buffer with one launch per
    table (agoq.quant.spans), where bucket by bucket it took one per bucket or segment."""

    def __init__(self, layout: GradLayout, buckets: list[Bucket], device: torch.device) -> None:
        self.layout = layout
        self.buckets = buckets
        self.device = device
        self.storage = buckets[0].storage if buckets else None
        self._tables: dict[tuple[int, int, int] | None, SpanTable] = {}

    def of_param(self, pi: int, start: int = 0, end: int | None = None) -> SpanTable:
        """Parameter ``pi``'s values start..end (default all; ``start`` on a block), each span's
        ``first`` counted from ``start``."""
        end = self.layout.numels[pi] if end is None else end
        key = (pi, start, end)
        table = self._tables.get(key)
        if table is None:
            spans = []
            for seg in self.layout.segments[pi]:
                bucket = self.buckets[seg.bucket]
                spans += [bucket.span(a, hi - lo, lo - start) for a, lo, hi in bucket.spans(seg, lo=start, hi=end)]
            table = self._tables[key] = span_table(spans, self.layout.fmt, self.device)
        return table

    def rows(self) -> SpanTable:
        """Every row of every bucket."""
        table = self._tables.get(None)
        if table is None:
            table = self._tables[None] = span_table([s for b in self.buckets for s in b.row_spans()], self.layout.fmt, self.device)
        return table
