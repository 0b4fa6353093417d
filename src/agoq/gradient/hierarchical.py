"""A two-hop quantized all-reduce for jobs spread over nodes: int8 within a node, int4 between nodes.

The ranks of a group form nodes of ``node_size`` consecutive ranks (:func:`node_groups`). With L
ranks per node and N nodes (W = L N):

1. intra-node reduce-scatter at ``intra_fmt`` (default int8/256): the tensor is cut into L chunks
   (:func:`~agoq.gradient.collectives.chunk_layout`), each quantized, exchanged by all-to-all and
   summed in fp32 in rank order; the rank with local index l holds its node's sum of chunk l;
2. inter-node all-reduce at ``inter_fmt`` (default int4/128) of that chunk among the N ranks with
   local index l (:class:`~agoq.gradient.collectives.EightBitReduction`): quantize, all-to-all,
   fp32 sum in node order, requantize, all-gather; those N ranks hold the same bytes of chunk l;
3. intra-node all-gather of those bytes, forwarded as they are (never requantized); every rank
   dequantizes the same bytes, so the result is bit-identical on every rank of the group.

Only hop 2 crosses nodes, carrying 1 / L of the tensor per rank at inter_fmt.

Error per element against the exact sum of the inputs x_r (for ``op="sum"``):

    |y - sum_r x_r| <= sum_r h1_r + sum_k h2_k + h_out + fp32 rounding of the two sums

with h1_r rank r's half-step at intra_fmt (its hop-1 input rounding), h2_k the half-step of node
k's fp32 partial sum quantized at inter_fmt for hop 2, and h_out the half-step of the requantized
global sum at inter_fmt (hop 3 adds nothing). For int formats a half-step is scale / 2 of the
element's block, i.e. W + N + 1 half-steps; for ``op="avg"`` the h1 terms are divided by W and
the h2 terms by N. :func:`hierarchical_error_bound` evaluates it element by element.
Non-finite inputs are never turned into finite values: their blocks come out NaN on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from agoq.quant import QuantFormat, dequantize, quantization_error_bound

from agoq.gradient.collectives import (
    ChunkLayout,
    chunk_layout,
    from_wire,
    parse_op,
    quantize_rows,
    start_reduction,
    timed_phase,
)
from agoq.gradient.counter import COMM_COUNTER, CommCounter
from agoq.gradient.nodes import NodeGroups, check_node_size, gather_within_node

DEFAULT_INTRA_FORMAT = "int8/256"
DEFAULT_INTER_FORMAT = "int4/128"
HOP_NAMES = ("hier_intra_reduce_scatter", "hier_inter_all_reduce", "hier_intra_all_gather")
# fp32 unit roundoff: the bound's term for rounding in the fp32 sums.
_FP32_U = 2.0**-24


@dataclass(frozen=True)
class HierarchicalLayout:
    """How a tensor travels: ``outer`` cuts it into node_size chunks, ``inner`` cuts one chunk into nodes sub-chunks."""

    outer: ChunkLayout
    inner: ChunkLayout

    @property
    def numel(self) -> int:
        return self.outer.numel


def hierarchical_layout(numel: int, node_size: int, nodes: int, intra_fmt: QuantFormat | str, inter_fmt: QuantFormat | str) -> HierarchicalLayout:
    """The layouts of hop 1 (the whole tensor over a node) and hop 2 (one chunk over the nodes)."""
    outer = chunk_layout(numel, node_size, intra_fmt)
    return HierarchicalLayout(outer, chunk_layout(outer.chunk, nodes, inter_fmt))


def hierarchical_bytes(layout: HierarchicalLayout) -> dict[str, tuple[int, int]]:
    """(payload, scale) bytes one rank sends per hop: (W_group - 1) rows per rank per exchange."""
    outer, inner = layout.outer, layout.inner
    ls, ns = outer.world_size, inner.world_size
    return {
        HOP_NAMES[0]: ((ls - 1) * outer.row_payload_bytes, (ls - 1) * outer.row_scale_bytes),
        HOP_NAMES[1]: (2 * (ns - 1) * inner.row_payload_bytes, 2 * (ns - 1) * inner.row_scale_bytes),
        HOP_NAMES[2]: ((ls - 1) * ns * inner.row_payload_bytes, (ls - 1) * ns * inner.row_scale_bytes),
    }


def _unpack(wire: torch.Tensor, layout: HierarchicalLayout, out: torch.Tensor) -> None:
    """Dequantize the gathered bytes [node_size, nodes * inner.row_bytes] into the flat ``out``."""
    outer, inner = layout.outer, layout.inner
    for local in range(outer.world_size):
        lo, hi = outer.shard_range(local)
        if hi <= lo:
            break
        q = from_wire(wire[local].view(inner.world_size, inner.row_bytes), inner)
        values = dequantize(q, torch.float32).view(inner.world_size, inner.padded_chunk)[:, : inner.chunk]
        out[lo:hi].copy_(values.reshape(-1)[: hi - lo])


def all_reduce_hierarchical(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    groups: NodeGroups | None = None,
    *,
    intra_fmt: QuantFormat | str = DEFAULT_INTRA_FORMAT,
    inter_fmt: QuantFormat | str = DEFAULT_INTER_FORMAT,
    counter: CommCounter | None = None,
    timings: dict[str, float] | None = None,
) -> None:
    """In-place two-hop quantized all-reduce (sum or avg) of a float tensor over the ranks of ``groups``.

    ``timings``, if given, receives seconds per hop (under the names in HOP_NAMES) and for the final dequantize.
    """
    if groups is None:
        raise ValueError("all_reduce_hierarchical needs the NodeGroups of node_groups(node_size, group)")
    if not tensor.is_floating_point():
        raise TypeError(f"all_reduce_hierarchical expects a floating-point tensor (fp32/bf16/fp16), got {tensor.dtype}")
    op = parse_op(op)
    counter = COMM_COUNTER if counter is None else counter
    layout = hierarchical_layout(tensor.numel(), groups.node_size, groups.nodes, intra_fmt, inter_fmt)
    with timed_phase(timings, HOP_NAMES[0], tensor.device):
        hop1 = start_reduction(tensor, layout.outer, op, groups.intra, consume=True, counter=counter, name=HOP_NAMES[0])
        partial = hop1.reduce()[: layout.outer.chunk]
    with timed_phase(timings, HOP_NAMES[1], tensor.device):
        hop2 = start_reduction(partial, layout.inner, op, groups.inter, consume=True, counter=counter, name=HOP_NAMES[1])
        del partial
        hop2.reduce_and_gather()
        chunk_bytes = hop2.gathered().reshape(-1)
    with timed_phase(timings, HOP_NAMES[2], tensor.device):
        inner = layout.inner
        counter.record(
            HOP_NAMES[2],
            (groups.node_size - 1) * inner.world_size * inner.row_payload_bytes,
            (groups.node_size - 1) * inner.world_size * inner.row_scale_bytes,
        )
        wire = gather_within_node(chunk_bytes, groups)
    with timed_phase(timings, "dequantize", tensor.device):
        flat = (
            tensor.view(-1)
            if tensor.is_contiguous() and tensor.dtype == torch.float32
            else torch.empty(tensor.numel(), dtype=torch.float32, device=tensor.device)
        )
        _unpack(wire, layout, flat)
        if flat.data_ptr() != tensor.data_ptr() or flat.dtype != tensor.dtype:
            tensor.copy_(flat.view(tensor.shape))


def _fp32_sum(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = rows[0].clone()
    for row in rows[1:]:
        acc += row
    return acc


def _flat(t: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """A [world_size x padded_chunk] tensor of ``layout`` back to its numel flat values."""
    return t.reshape(layout.world_size, layout.padded_chunk)[:, : layout.chunk].reshape(-1)[: layout.numel]


def _hop(inputs: Sequence[torch.Tensor], layout: ChunkLayout, average: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One quantized exchange recomputed locally: (fp32 sum in rank order, summed half-steps, |values| summed), flat."""
    qs = [quantize_rows(x, layout) for x in inputs]
    deq = [_flat(dequantize(q, torch.float32), layout) for q in qs]
    total = _fp32_sum(deq)
    steps = _fp32_sum([_flat(quantization_error_bound(q), layout) for q in qs])
    size = _fp32_sum([d.abs() for d in deq])
    if average:
        total /= len(inputs)
        steps /= len(inputs)
        size /= len(inputs)
    return total, steps, size


def simulate_hierarchical(
    inputs: Sequence[torch.Tensor],
    node_size: int,
    *,
    op: str | dist.ReduceOp = "sum",
    intra_fmt: QuantFormat | str = DEFAULT_INTRA_FORMAT,
    inter_fmt: QuantFormat | str = DEFAULT_INTER_FORMAT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(result, per-element error bound) of :func:`all_reduce_hierarchical` on ``inputs``, recomputed in one process.

    ``inputs`` are every rank's tensor in group-rank order. The result is what every rank holds
    (flat fp32); the bound is the module docstring's: the hop-1 half-steps of every input at
    intra_fmt, the half-steps of every node's partial sum at inter_fmt, the half-step of the final
    requantization, and fp32 rounding of both sums (one unit roundoff per addition of |terms|).
    """
    average = parse_op(op) == "avg"
    world = len(inputs)
    check_node_size(node_size, world)
    nodes = world // node_size
    flats = [x.detach().reshape(-1).float() for x in inputs]
    layout = hierarchical_layout(flats[0].numel(), node_size, nodes, intra_fmt, inter_fmt)
    outer, inner = layout.outer, layout.inner
    n, span = outer.numel, outer.world_size * outer.chunk
    node_sums, h1, fp = [], torch.zeros(n), torch.zeros(n)
    for k in range(nodes):
        total, steps, size = _hop(flats[k * node_size : (k + 1) * node_size], outer, average)
        node_sums.append(torch.nn.functional.pad(total, (0, span - n)).view(outer.world_size, outer.chunk))
        h1 += steps / (nodes if average else 1)
        fp += size * (node_size - 1) * _FP32_U / (nodes if average else 1)
    result, h2, h_out = torch.empty(n), torch.empty(n), torch.empty(n)
    for local in range(outer.world_size):
        lo, hi = outer.shard_range(local)
        if hi <= lo:
            break
        total, steps, size = _hop([s[local] for s in node_sums], inner, average)
        q = quantize_rows(total, inner)
        result[lo:hi] = _flat(dequantize(q, torch.float32), inner)[: hi - lo]
        h2[lo:hi], h_out[lo:hi] = steps[: hi - lo], _flat(quantization_error_bound(q), inner)[: hi - lo]
        fp[lo:hi] += (size * (nodes - 1 + 2 * average) * _FP32_U)[: hi - lo]
    return result, h1 + h2 + h_out + fp


def hierarchical_error_bound(
    inputs: Sequence[torch.Tensor],
    node_size: int,
    *,
    op: str | dist.ReduceOp = "sum",
    intra_fmt: QuantFormat | str = DEFAULT_INTRA_FORMAT,
    inter_fmt: QuantFormat | str = DEFAULT_INTER_FORMAT,
) -> torch.Tensor:
    """Per-element bound on |all_reduce_hierarchical(inputs) - exact sum (or mean)|, flat fp32 (see the module docstring)."""
    return simulate_hierarchical(inputs, node_size, op=op, intra_fmt=intra_fmt, inter_fmt=inter_fmt)[1]
