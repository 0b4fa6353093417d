"""Sending the 8-bit buckets in fewer bits, optionally with error feedback.

The buffer keeps and accumulates gradients in its 8-bit storage format; a narrower wire format
(int4) is what each bucket's all-to-all and all-gather send. :class:`WireEncoder` converts a bucket
into wire rows before its reduction and the gathered wire rows back into the bucket after it.

Error feedback (LoCo, arXiv 2407.04480): the rounding to the wire's grid drops e = g - Q(g) per
value; each rank keeps e in an 8-bit residual and adds it to the next step's bucket before
rounding, so what one step drops is sent the next (Q(g_t + e_{t-1})). The residual is state: it is
saved and resumed with the run, and a step skipped for a non-finite gradient leaves it as it was
(the new residual is staged and only committed when the step is taken). Rounding to 8 bits is the
residual's own error, a small fraction of the 4-bit step it corrects.

Everything runs a piece of whole blocks at a time, so the fp32 temporaries are a piece's worth,
not a bucket's.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from agoq.quant import QTensor, QuantFormat, dequantize, quantize

from agoq.gradient.bucket import Bucket
from agoq.gradient.collectives import ChunkLayout, chunk_layout, from_wire

# Values converted at once: 256 KiB of fp32, whole blocks of every format used here.
PIECE_VALUES = 1 << 16


def _pieces(numel: int, block: int) -> Iterator[tuple[int, int]]:
    step = max(1, PIECE_VALUES // block) * block
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


def _store(q: QTensor, into: QTensor, start: int) -> None:
    """Write the quantized piece ``q`` into ``into`` at value ``start`` (same format, block-aligned)."""
    fmt = into.fmt
    p0, b0 = fmt.payload_bytes(start), start // fmt.block_size
    into.payload[p0 : p0 + q.payload.numel()].copy_(q.payload)
    into.scales[b0 : b0 + q.scales.numel()].copy_(q.scales)


def _flat(bucket: Bucket, fmt: QuantFormat, zero: bool = False) -> QTensor:
    """A flat QTensor of the bucket's values in ``fmt``, in storage of its own; with ``zero``, all
    zeros (a zero scale decodes any code to 0)."""
    n, device = bucket.numel, bucket.wire.device
    scales = (torch.zeros if zero else torch.empty)(fmt.num_blocks(n), dtype=torch.float32, device=device)
    return QTensor(torch.empty(fmt.payload_bytes(n), dtype=torch.uint8, device=device), scales, torch.Size([n]), torch.float32, fmt)


class WireEncoder:
    """Bucket storage <-> wire rows for every bucket of one buffer, with the residuals of error feedback."""

    def __init__(self, buckets: list[Bucket], wire_fmt: QuantFormat, error_feedback: bool) -> None:
        if not buckets:
            raise ValueError("WireEncoder needs at least one bucket")
        storage = buckets[0].layout.fmt
        if storage.block_size % wire_fmt.block_size:
            raise ValueError(
                f"the wire format {wire_fmt.name} must have a block size dividing the storage block {storage.block_size} "
                f"(so every bucket chunk is whole wire blocks); use a wire block of {storage.block_size} or a divisor of it"
            )
        self.wire_fmt = wire_fmt
        self.error_feedback = error_feedback
        self.layouts = [self._layout(b) for b in buckets]
        self.residuals = [_flat(b, storage, zero=True) for b in buckets] if error_feedback else []
        self._staged: dict[int, QTensor] = {}

    def _layout(self, bucket: Bucket) -> ChunkLayout:
        chunks = bucket.layout
        layout = chunk_layout(chunks.world_size * chunks.padded_chunk, chunks.world_size, self.wire_fmt)
        assert layout.padded_chunk == chunks.padded_chunk  # the storage chunk is whole wire blocks
        return layout

    def encode(self, bucket: Bucket) -> tuple[QTensor, ChunkLayout]:
        """The bucket (plus its residual, with error feedback) in wire rows; stages the new residual."""
        layout, storage, chunk = self.layouts[bucket.index], bucket.layout.fmt, bucket.layout.padded_chunk
        wire = _flat(bucket, self.wire_fmt)
        staged = _flat(bucket, storage) if self.error_feedback else None  # every piece below writes its blocks
        for r in range(layout.world_size):
            row = bucket.row(r)
            for start, end in _pieces(chunk, storage.block_size):
                at = r * chunk + start  # in the flat wire rows and residuals
                g = dequantize(row.blocks(start, end - start), torch.float32)
                if staged is not None:
                    g += dequantize(self.residuals[bucket.index].blocks(at, end - start), torch.float32)
                q = quantize(g, self.wire_fmt, nonfinite="propagate")
                _store(q, wire, at)
                if staged is not None:
                    _store(quantize(g - dequantize(q, torch.float32), storage, nonfinite="propagate"), staged, at)
        if staged is not None:
            self._staged[bucket.index] = staged
        return wire, layout

    def decode_into(self, bucket: Bucket, gathered: torch.Tensor) -> None:
        """Write the all-gathered wire rows (uint8 [W, row bytes]) into the bucket's 8-bit storage."""
        layout = self.layouts[bucket.index]
        storage = bucket.layout.fmt
        for i in range(layout.world_size):
            row, into = from_wire(gathered[i : i + 1], layout), bucket.row(i)
            for start, end in _pieces(layout.padded_chunk, storage.block_size):
                g = dequantize(row.blocks(start, end - start), torch.float32)
                _store(quantize(g, storage, nonfinite="propagate"), into, start)

    def commit(self) -> None:
        """The step was taken: the residuals staged by this step's encodes become the residuals."""
        for b, staged in self._staged.items():
            self.residuals[b] = staged
        self._staged.clear()

    def discard(self) -> None:
        """The step was skipped: keep the residuals as they were."""
        self._staged.clear()

    def residual_bytes(self) -> int:
        """Bytes of the error-feedback residuals (0 without error feedback)."""
        return sum(r.nbytes for r in self.residuals)

    def state_dict(self) -> dict[str, Any]:
        """The residuals (this rank's own: each rank drops different rounding errors)."""
        return {f"residual{b}": {"payload": r.payload, "scales": r.scales} for b, r in enumerate(self.residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s residuals; the bucket layout must be the one saved."""
        if set(state) != {f"residual{b}" for b in range(len(self.residuals))}:
            raise ValueError(f"the saved error-feedback state holds {sorted(state)}; this buffer has {len(self.residuals)} residual buckets")
        for b, r in enumerate(self.residuals):
            saved = state[f"residual{b}"]
            if saved["payload"].shape != r.payload.shape or saved["scales"].shape != r.scales.shape:
                raise ValueError(f"error-feedback residual {b} was saved for another bucket layout; resume with the saved layout")
            r.payload.copy_(saved["payload"])
            r.scales.copy_(saved["scales"])
