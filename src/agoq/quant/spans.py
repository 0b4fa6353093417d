"""Spans of quantized values in one byte storage, as a table a single kernel launch reads.

Block-quantized tensors laid end to end in one uint8 storage (each region its packed codes, then
elsewhere its fp32 scales) are addressed by a table: one row per span of whole blocks. The Triton
span kernels (agoq.quant.triton.kernels, ``*_spans_kernel``) take the storage, the table and a flat
float tensor beside it, so work that touches many regions, such as a parameter's gradient spread
over several buckets or every row of every bucket, is one launch however many regions there are.
The table lives on the storage's device and is built once per set of spans: building one copies
it from the host, which a step must not do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agoq.quant.formats import SCALE_BYTES, QuantFormat

# The columns of a span table row, in order.
SPAN_COLUMNS = ("first", "values", "payload_byte", "scale_index", "blocks")


@dataclass(frozen=True)
class Span:
    """``values`` values (whole blocks, but for the tail of the last one) whose codes start at byte
    ``payload_byte`` and whose scales start at byte ``scale_byte`` of the storage; ``first`` is the
    position of the span's first value in the flat tensor read or written beside it."""

    first: int
    values: int
    payload_byte: int
    scale_byte: int


@dataclass(frozen=True)
class SpanTable:
    """The device table of some spans of a storage in ``fmt``, and its extent (read on the host to size a launch)."""

    table: torch.Tensor  # int64 [S, len(SPAN_COLUMNS)] on the storage's device
    fmt: QuantFormat
    most_blocks: int  # the largest span's block count

    @property
    def count(self) -> int:
        return self.table.shape[0]


def span_table(spans: Sequence[Span], fmt: QuantFormat, device: torch.device | str) -> SpanTable:
    """The table of ``spans`` on ``device`` (one host-to-device copy: build it once, not per step)."""
    rows = []
    for s in spans:
        if s.scale_byte % SCALE_BYTES:
            raise ValueError(f"a span's scales start at byte {s.scale_byte}, not on a {SCALE_BYTES}-byte boundary")
        rows.append((s.first, s.values, s.payload_byte, s.scale_byte // SCALE_BYTES, fmt.num_blocks(s.values)))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, len(SPAN_COLUMNS)).to(device)
    return SpanTable(table, fmt, max((r[-1] for r in rows), default=0))
