"""8-bit collectives over torch.distributed.

The precision-preserving 8-bit all-reduce (METHOD.md part 3) never adds in 8 bits:

1. the tensor is cut into W rank chunks of c values, each padded to whole quantization blocks, and
   quantized block-wise (blocks never straddle chunks, so every chunk travels with its own scales);
2. all-to-all: rank j receives chunk j of every rank, its payload and its scales in one message;
3. each rank dequantizes the W received chunks and sums them in fp32, in rank order;
4. re-quantizes its reduced chunk;
5. all-gather of the reduced 8-bit chunks; every rank dequantizes the same bytes, so the result is
   bit-identical everywhere. (On gloo within one host the all-gather runs as an all-to-all, see
   :func:`agoq.gradient.transport.gathers_by_all_to_all`; over nodes it runs in two steps, see :func:`gathers_by_node`.)

Steps 1-3 are an 8-bit reduce-scatter (:func:`reduce_scatter_8bit`, for ZeRO-1 optimizers).
Error per element against the fp32 sum of the *original* inputs: at most sum_i s_i / 2 (each
rank's input rounding, s_i its block scale) + s_out / 2 (the re-quantization), i.e. W + 1
half-steps; against the fp32 sum of the *dequantized* inputs, only s_out / 2.

The baseline in the same terms: :func:`all_reduce_fp` (torch's all-reduce in fp32 or bf16). The
FP8-LM-style ring AGoQ's all-reduce replaces is a benchmark's baseline (benchmarks/_ring8.py).

Every function records the bytes this rank sends in a :class:`CommCounter`. Non-finite inputs are
never turned into finite values: the blocks holding them come out NaN on every rank.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from agoq.compat import all_gather_single
from agoq.quant import QTensor, QuantFormat, backend, dequantize, parse_format, quantize
from agoq.quant.dispatch import quantize_rows_into
from agoq.quant.formats import DEFAULT_GRADIENT_BLOCK, SCALE_BYTES
from agoq.quant.pieces import size_key

from agoq.gradient.counter import COMM_COUNTER, CommCounter, ring_all_reduce_bytes
from agoq.gradient.nodes import Group, NodeGroups, gather_within_node
from agoq.gradient.transport import gathers_by_all_to_all, polls_for, wait_for

DEFAULT_GRADIENT_FORMAT = QuantFormat("int", 8, DEFAULT_GRADIENT_BLOCK)


def world_of(group: Group = None) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (``rank`` itself without torch.distributed)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return rank
    return dist.get_global_rank(group, rank)


def own_rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def parse_op(op: str | dist.ReduceOp) -> str:
    """'sum' or 'avg' from a string or a torch.distributed.ReduceOp."""
    if isinstance(op, str):
        name = op.lower()
        if name in ("sum", "avg"):
            return name
        if name == "mean":
            return "avg"
    elif op == dist.ReduceOp.SUM:
        return "sum"
    elif op == dist.ReduceOp.AVG:
        return "avg"
    raise ValueError(f"unsupported reduction {op!r}; use 'sum' or 'avg' (ReduceOp.SUM / ReduceOp.AVG)")


def gradient_format(fmt: QuantFormat | str | None) -> QuantFormat:
    """The wire format: ``fmt`` parsed (default int8/256), checked to fill whole bytes per block."""
    if fmt is None:
        fmt = DEFAULT_GRADIENT_FORMAT
    elif isinstance(fmt, str) and "/" not in fmt:
        # A bare 'int8' means the gradient default block, not the activation one.
        fmt = parse_format(fmt, DEFAULT_GRADIENT_BLOCK)
    else:
        fmt = parse_format(fmt)
    if fmt.block_size * fmt.bits % 8:
        raise ValueError(
            f"format {fmt.name}: a block of {fmt.block_size} values x {fmt.bits} bits is not whole bytes, "
            "so chunks could not be cut at block boundaries; use a block size that is a multiple of 8"
        )
    return fmt


def int8_gradient_format(block: int) -> QuantFormat:
    """The 8-bit wire format of ``precision.gradient_block`` (blocks of ``block`` values, one fp32 scale each)."""
    return gradient_format(QuantFormat("int", 8, block))


@dataclass(frozen=True)
class ChunkLayout:
    """How ``numel`` values are cut into ``world_size`` chunks of ``chunk`` values, padded to blocks."""

    numel: int
    world_size: int
    chunk: int
    padded_chunk: int
    fmt: QuantFormat

    @property
    def blocks_per_chunk(self) -> int:
        """Scales per chunk."""
        return self.padded_chunk // self.fmt.block_size

    @property
    def row_payload_bytes(self) -> int:
        """Packed code bytes of one chunk."""
        return self.fmt.payload_bytes(self.padded_chunk)

    @property
    def row_scale_bytes(self) -> int:
        """Scale bytes of one chunk."""
        return SCALE_BYTES * self.blocks_per_chunk

    @property
    def row_bytes(self) -> int:
        """Bytes of one chunk on the wire: payload then scales."""
        return self.row_payload_bytes + self.row_scale_bytes

    @property
    def unpadded(self) -> bool:
        """Whether every rank chunk is whole blocks of values with no padding (the rows, laid end to end, are the tensor)."""
        return self.chunk == self.padded_chunk and self.numel == self.world_size * self.chunk

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the flat tensor that ``rank``'s chunk holds (empty past the end)."""
        start = min(rank * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)


def chunk_layout(numel: int, world_size: int, fmt: QuantFormat | str | None = None) -> ChunkLayout:
    """The layout of a ``numel``-value tensor in an 8-bit collective over ``world_size`` ranks."""
    fmt = gradient_format(fmt)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    chunk = -(-numel // world_size)
    block = fmt.block_size
    return ChunkLayout(numel, world_size, chunk, max(1, -(-chunk // block)) * block, fmt)


@contextmanager
def timed_phase(timings: dict[str, float] | None, key: str, device: torch.device | None = None) -> Iterator[None]:
    """Add the seconds the block takes to ``timings[key]`` (nothing when ``timings`` is None).

    On a GPU (``device``) the seconds are the device's, between events recorded on its current
    stream around the block: the host only enqueues kernels and NCCL work, so its clock would time
    the enqueueing. The phase then waits for its end event (timings are for measuring only).
    """
    if timings is None:
        yield
        return
    if device is not None and device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000  # elapsed_time is in milliseconds
    else:
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
    timings[key] = timings.get(key, 0.0) + seconds


def padded_rows(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``x`` flattened as [world_size, padded_chunk], zero-padded at the end and per row."""
    flat = x.detach().reshape(-1)
    total = layout.world_size * layout.chunk
    if total != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, total - flat.numel()))
    rows = flat.view(layout.world_size, layout.chunk)
    if layout.padded_chunk != layout.chunk:
        rows = torch.nn.functional.pad(rows, (0, layout.padded_chunk - layout.chunk))
    return rows


def to_wire(q: QTensor, rows: int) -> torch.Tensor:
    """A quantized [rows x chunk] tensor as uint8 [rows, payload + scale bytes], one message per row."""
    return torch.cat([q.payload.view(rows, -1), q.scales.view(rows, -1).view(torch.uint8)], dim=1)


def from_wire(wire: torch.Tensor, layout: ChunkLayout) -> QTensor:
    """Inverse of :func:`to_wire`: the rows of ``wire`` as one fp32 QTensor of rows x padded_chunk."""
    rows = wire.shape[0]
    pb = layout.row_payload_bytes
    payload = wire[:, :pb].reshape(-1).contiguous()
    scales = wire[:, pb:].contiguous().view(torch.float32).reshape(-1)
    return QTensor(payload, scales, torch.Size([rows * layout.padded_chunk]), torch.float32, layout.fmt)


# Values of a received chunk summed at once (whole blocks). Eagerly (the torch reference, and
# every step whose temporaries are counted) a piece's fp32 sum and the quantizer's work on it are
# the reduction's only temporaries besides the received rows, about 10 bytes a value: on a CPU
# 16K values (0.16 MiB) keep the sync phase of the default run's first stage, whose received rows
# alone are 0.97x of the bf16 step's temporaries, within 1.1x of them. The compiled and Triton kernels sum,
# requantize and write a piece in one pass with no fp32 temporaries (their output is about a byte
# a value), so their pieces are larger and cost fewer calls (each call has a fixed dispatch cost).
# A GPU takes 1M-value pieces so that each kernel launch has work enough.
REDUCE_PIECE = {"cpu": 1 << 14, "device": 1 << 20}
FUSED_REDUCE_PIECE = {"cpu": 1 << 20, "device": 1 << 20}


def reduce_piece(device: torch.device, fused: bool = False) -> int:
    """Values per piece of the reduction's sum on ``device``: eager (REDUCE_PIECE), or by the kernels (FUSED_REDUCE_PIECE)."""
    return (FUSED_REDUCE_PIECE if fused else REDUCE_PIECE)[size_key(device)]


# Appended to a collective's counter name for its bytes that cross between nodes.
INTER_NODE_SUFFIX = ":inter_node"


def inter_node_name(name: str) -> str:
    """The counter name of collective ``name``'s bytes that cross between nodes (counted apart where
    the reduction knows its nodes; the rest, within a node, stay under ``name``)."""
    return name + INTER_NODE_SUFFIX


def gathers_by_node(nodes: NodeGroups | None) -> bool:
    """Whether the 8-bit all-gather over ``nodes`` runs in two steps: between nodes, then within each.

    A ring all-gather over nodes of L ranks (N nodes) carries the reduced chunks of a quarter more
    ranks across each node's link than it must: on 2 nodes, 3/4 of the tensor leaves a node where
    1/2 (its own ranks' chunks) is all the other node lacks. Gathering first among the N ranks with
    the same local index (one per node, each over its own NIC where nodes have one per GPU), then
    within the node, sends each chunk across nodes once. The bytes are the same ones, so the
    result is too.
    """
    return nodes is not None and nodes.nodes > 1 and nodes.node_size > 1


def _check_rows(rows: QTensor | torch.Tensor, layout: ChunkLayout) -> None:
    """Refuse rows that are not ``layout``'s: wire rows (uint8 [W, row_bytes]) or a QTensor of W x padded_chunk values."""
    w = layout.world_size
    if isinstance(rows, torch.Tensor):
        if rows.dtype != torch.uint8 or rows.shape != (w, layout.row_bytes) or not rows.is_contiguous():
            raise ValueError(f"wire rows must be contiguous uint8 [{w}, {layout.row_bytes}], got {rows.dtype} {list(rows.shape)}")
    elif rows.fmt != layout.fmt or rows.numel != w * layout.padded_chunk or not (rows.payload.is_contiguous() and rows.scales.is_contiguous()):
        raise ValueError(
            f"the rows must be {w} x {layout.padded_chunk} values in {layout.fmt} with contiguous payload and scales, "
            f"got {rows.numel} values in {rows.fmt}"
        )


def _check_recv(recv: torch.Tensor | None, layout: ChunkLayout, owns_rows: bool) -> None:
    """Refuse rows to receive into that are not ``layout``'s wire rows, or that the gathered rows would land in (``owns_rows`` False)."""
    if recv is not None:
        _check_rows(recv, layout)
        if not owns_rows:
            raise ValueError("recv is only for a reduction that owns its rows (owns_rows=True): its gathered rows land in those")


class EightBitReduction:
    """One 8-bit reduction in flight: :meth:`reduce` (steps 2-3), then :meth:`start_gather` (4-5).

    ``rows`` is the quantized tensor (W x padded_chunk values), or already its wire rows (uint8
    [W, row_bytes], as :func:`to_wire` lays them out), which are then sent as they are: the caller
    must leave them unchanged until :meth:`reduce`. ``owns_rows``: the wire rows are this
    reduction's (e.g. :func:`quantize_to_wire`'s), free once sent, so :meth:`reduce_and_gather`
    gathers into them (a QTensor's rows are copied into wire rows of its own). ``recv``: free
    rows (uint8 [W, row_bytes]) to receive the all-to-all into, e.g. :func:`receiving_rows` of the
    tensor the result replaces, in place of a new tensor; only for a reduction that owns its rows,
    so that the gathered rows never land there. Construction starts the all-to-all (async). Every
    rank calls the methods of its reductions in the same order, as for any collective.
    """

    def __init__(
        self,
        rows: QTensor | torch.Tensor,
        layout: ChunkLayout,
        op: str | dist.ReduceOp = "sum",
        group: Group = None,
        *,
        counter: CommCounter | None = None,
        name: str = "all_reduce_8bit",
        timings: dict[str, float] | None = None,
        nodes: NodeGroups | None = None,
        owns_rows: bool = False,
        recv: torch.Tensor | None = None,
    ) -> None:
        self.layout = layout
        self.op = parse_op(op)
        self.group = group
        self.nodes = nodes if gathers_by_node(nodes) else None
        self.counter = COMM_COUNTER if counter is None else counter
        self.name = name
        self.timings = timings
        self.world_size, self.rank = world_of(group)
        self._device, self._poll = rows.device, self.world_size > 1 and polls_for(layout.row_bytes, group)
        if self.world_size != layout.world_size:
            raise ValueError(f"layout is for {layout.world_size} ranks but the group has {self.world_size}")
        if self.nodes is not None and self.nodes.world_size != self.world_size:
            raise ValueError(f"the nodes cover {self.nodes.world_size} ranks but the group has {self.world_size}")
        w = layout.world_size
        _check_rows(rows, layout)
        _check_recv(recv, layout, owns_rows)
        # One message per destination rank, payload then scales: a second all-to-all would cost a
        # whole collective's latency again. A QTensor's rows are copied into that layout (1/4 of the
        # fp32 tensor, until the all-to-all completes); a bucket's storage is that layout already.
        self._gather_work: dist.Work | None = None
        self._gather_send: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None
        self._requantized: tuple[torch.Tensor, int, QTensor] | None = None
        # Of the W - 1 rows sent, the W - L bound for other nodes cross between nodes.
        self._record(w - 1, w - self.nodes.node_size if self.nodes is not None else 0)
        self._a2a: dist.Work | None = None
        self._recv: torch.Tensor | None = None
        self._rows: QTensor | None = None
        # Wire rows this reduction made itself (from a QTensor, or quantize_to_wire's): free once
        # sent, so reduce_and_gather gathers into them rather than into a fresh buffer.
        self._own_send: torch.Tensor | None = None
        if w == 1:  # its own rows are the received ones
            if isinstance(rows, torch.Tensor):
                self._recv = rows
            else:
                self._rows = rows
            return
        self._send: torch.Tensor | None = rows if isinstance(rows, torch.Tensor) else to_wire(rows, w)
        if owns_rows or not isinstance(rows, torch.Tensor):
            self._own_send = self._send
        self._recv = torch.empty_like(self._send) if recv is None else recv
        with timed_phase(timings, "all_to_all", self._device):
            self._a2a = dist.all_to_all_single(self._recv, self._send, group=group, async_op=True)
            if timings is not None:
                wait_for(self._a2a, self._poll)

    def _record(self, rows: int, inter_node_rows: int, calls: int = 1) -> None:
        """Count ``rows`` wire rows sent, ``inter_node_rows`` of them under :func:`inter_node_name`."""
        pb, sb = self.layout.row_payload_bytes, self.layout.row_scale_bytes
        self.counter.record(self.name, (rows - inter_node_rows) * pb, (rows - inter_node_rows) * sb, calls=calls)
        if inter_node_rows:
            self.counter.record(inter_node_name(self.name), inter_node_rows * pb, inter_node_rows * sb, calls=0)

    def _take_received(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The W received (payload, scale) rows once the all-to-all is done, and the [W, row_bytes]
        tensor that holds them (None on one rank); released from this object (one use)."""
        if self._rows is not None:  # one rank: its own rows are the received ones
            rows, self._rows = self._rows, None
            return rows.payload.view(1, -1), rows.scales.view(1, -1), None
        if self._recv is None:
            raise RuntimeError("this reduction was already reduced")
        with timed_phase(self.timings, "all_to_all", self._device):
            if self._a2a is not None:
                wait_for(self._a2a, self._poll)
        self._a2a, self._send = None, None
        # The received rows are not needed once summed: the caller's reference is the last, so a
        # bucket waiting for its all-gather holds only its gathered bytes.
        recv, self._recv = self._recv, None
        pb = self.layout.row_payload_bytes
        return recv[:, :pb], recv[:, pb:].view(torch.float32), (recv if recv.dim() == 2 else None)

    def _pieces(self, fused: bool) -> Iterator[tuple[int, int]]:
        """(start, end) values of this rank's chunk, whole blocks of about reduce_piece(device, fused) values each."""
        block = self.layout.fmt.block_size
        piece = max(1, reduce_piece(self._device, fused) // block) * block
        for start in range(0, self.layout.padded_chunk, piece):
            yield start, min(self.layout.padded_chunk, start + piece)

    def _sum(self, recv: tuple[torch.Tensor, torch.Tensor], start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values start..end of the W received rows, summed in fp32 in rank order (then / W for avg).

        Rows are summed in rank order, so the sum is the same on every rank and for every path.
        """
        size = torch.Size([self.layout.padded_chunk])
        payload, scales = recv
        rows = [QTensor(payload[i], scales[i], size, torch.float32, self.layout.fmt).blocks(start, end - start) for i in range(self.world_size)]
        acc = dequantize(rows[0], torch.float32, out=out)
        for row in rows[1:]:
            acc += dequantize(row)
        if self.op == "avg":
            acc /= self.world_size
        return acc

    def reduce(self) -> torch.Tensor:
        """This rank's chunk summed (or averaged) over ranks in fp32: [padded_chunk] values."""
        *recv, _ = self._take_received()
        self._own_send = None
        with timed_phase(self.timings, "reduce", self._device):
            kernels = backend.kernels(self._device, self.layout.fmt)
            if kernels is not None:
                # Compiled or Triton: dequantize the W rows, sum in fp32 in rank order and
                # requantize in one pass; start_gather sends the requantized chunk if it gets
                # this very sum back.
                acc, q = kernels.reduce_rows(recv[0], recv[1].contiguous(), self.layout.fmt, average=self.op == "avg", requantize=True)
                self._requantized = (acc, acc._version, q)
                return acc
            # A piece at a time, so besides the fp32 result only one piece is ever in fp32.
            acc = torch.empty(self.layout.padded_chunk, dtype=torch.float32, device=self._device)
            for start, end in self._pieces(fused=False):
                self._sum(recv, start, end, out=acc[start:end])
        return acc

    def reduce_and_gather(self, out: torch.Tensor | None = None) -> None:
        """reduce() and start_gather() for an all-reduce, without this rank's whole chunk in fp32.

        Each piece of the chunk is summed and requantized straight into the bytes to send; blocks
        are quantized independently, so the bytes equal those of requantizing the whole sum. The
        sync phase's temporaries shrink by the fp32 chunk (4 bytes per value of the chunk).
        ``out`` (uint8 [W, row_bytes], e.g. the rows this reduction sent, free once received)
        receives the gathered rows in place of a new tensor; without it, the rows this reduction
        sent where it owns them, else the received ones. This rank's requantized row is then
        written into its own row there and gathered in place (except where gloo gathers by a ring:
        its all-gather would copy that row onto itself). The received rows, once summed, carry the
        all-to-all gather's copies of that row (a new tensor where they hold the gathered ones):
        the reduction allocates no bucket-sized tensor beyond the rows it sends and receives.
        """
        *recv, spent = self._take_received()
        own, self._own_send = self._own_send, None
        if out is None:
            # The gathered rows land in this reduction's own sent rows, free once the all-to-all
            # is done, and the received rows take the all-to-all gather's copies: those may be the
            # caller's tensor itself (receiving_rows), which the result is then written into. Sent
            # rows it does not own are the caller's: the received rows then take the gathered ones
            # (the sum reads each piece before this rank's requantized piece is written over it).
            out, spent = (own, spent) if own is not None else (spent, None)
        layout = self.layout
        fmt, pb = layout.fmt, layout.row_payload_bytes
        in_place = (
            out is not None
            and self.nodes is None
            and (self.world_size == 1 or gathers_by_all_to_all(self.group) or dist.get_backend(self.group) != "gloo")
        )
        send = out[self.rank] if in_place else torch.empty(layout.row_bytes, dtype=torch.uint8, device=self._device)
        payload, scales = send[:pb], send[pb:].view(torch.float32)
        with timed_phase(self.timings, "reduce", self._device):
            kernels = backend.kernels(self._device, fmt)
            for start, end in self._pieces(fused=kernels is not None):
                b0, b1 = start // fmt.block_size, end // fmt.block_size
                p0, p1 = fmt.payload_bytes(start), fmt.payload_bytes(end)
                if kernels is not None:
                    scale_rows = recv[1][:, b0:b1].contiguous()  # the kernels take whole rows of scales
                    piece_out = (payload[p0:p1], scales[b0:b1])
                    kernels.reduce_rows(recv[0][:, p0:p1], scale_rows, fmt, average=self.op == "avg", keep_sum=False, requantize=True, out=piece_out)
                else:
                    q = quantize(self._sum(recv, start, end), fmt, nonfinite="propagate")
                    payload[p0:p1].copy_(q.payload)
                    scales[b0:b1].copy_(q.scales)
        del recv
        self._all_gather(send, out, scratch=spent)

    def start_gather(self, reduced: torch.Tensor) -> None:
        """Re-quantize this rank's reduced chunk and start the all-gather of every rank's chunk."""
        layout = self.layout
        with timed_phase(self.timings, "reduce", self._device):
            done, self._requantized = self._requantized, None
            fresh = done is not None and done[0] is reduced and reduced._version == done[1]  # not modified since
            q = done[2] if fresh else quantize(reduced, layout.fmt, nonfinite="propagate")
            send = to_wire(q, 1)
        self._all_gather(send.reshape(-1))

    def _all_gather(self, send: torch.Tensor, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> None:
        """Start the all-gather of every rank's requantized chunk (``send``: this rank's row_bytes),
        into ``out`` where given (the two-step gather over nodes reorders into a tensor of its own).
        ``scratch`` (uint8 [W, row_bytes], free) takes the all-to-all gather's copies of ``send``."""
        layout = self.layout
        w = self.world_size
        # Two steps: N - 1 rows to the peers on other nodes, then (L - 1) N rows within the node.
        self._record(w - 1, self.nodes.nodes - 1 if self.nodes is not None else 0, calls=0)
        if w == 1:
            self._gathered = send.view(1, layout.row_bytes)
            return
        with timed_phase(self.timings, "all_gather", self._device):
            if self.nodes is not None:
                # Step 1 of 2 (gathers_by_node): the chunks of this rank's peers on the other nodes.
                flat = torch.empty(self.nodes.nodes * layout.row_bytes, dtype=torch.uint8, device=send.device)
                self._gather_work = all_gather_single(flat, send, group=self.nodes.inter, async_op=True)
                self._gathered = flat
            else:
                flat = torch.empty(w * layout.row_bytes, dtype=torch.uint8, device=send.device) if out is None else out.view(-1)
                self._gathered = flat.view(w, layout.row_bytes)
                if gathers_by_all_to_all(self.group):
                    # Every rank's row sent to every rank: the same bytes per rank as a ring, in one round.
                    rows = send.expand(w, layout.row_bytes)
                    self._gather_send = rows.contiguous() if scratch is None else scratch.copy_(rows)
                    self._gather_work = dist.all_to_all_single(flat, self._gather_send, group=self.group, async_op=True)
                else:
                    self._gather_work = all_gather_single(flat, send, group=self.group, async_op=True)
            if self.timings is not None:
                wait_for(self._gather_work, self._poll)

    def drain(self) -> None:
        """Wait for the collectives in flight and release the buffers, reducing nothing (their rows are to be reused)."""
        for work in (w for w in (self._a2a, self._gather_work) if w is not None):
            work.wait()
        self._a2a = self._gather_work = self._send = self._recv = self._own_send = self._gather_send = None
        self._gathered = self._rows = self._requantized = None

    def gathered(self) -> torch.Tensor:
        """The all-gathered wire bytes, uint8 [world_size, row_bytes], identical on every rank."""
        if self._gathered is None:
            raise RuntimeError("call start_gather() before gathered()")
        if self._gather_work is not None:
            with timed_phase(self.timings, "all_gather", self._device):
                wait_for(self._gather_work, self._poll)
                self._gather_work = self._gather_send = None
                if self.nodes is not None:
                    # Step 2 of 2: within the node, every local rank's [nodes, row] block; rank
                    # k * L + l of the group is node k's local rank l.
                    nodes, row = self.nodes, self.layout.row_bytes
                    by_local = gather_within_node(self._gathered, nodes).view(nodes.node_size, nodes.nodes, row)
                    self._gathered = by_local.transpose(0, 1).reshape(self.world_size, row)
        return self._gathered


def quantize_rows(x: torch.Tensor, layout: ChunkLayout) -> QTensor:
    """``x`` cut into rank chunks, each padded to whole blocks, and quantized (world_size x padded_chunk values)."""
    return quantize(padded_rows(x, layout), layout.fmt, nonfinite="propagate")


# Values quantized per call by quantize_to_wire: a CPU piece's codes (1 MiB at 8 bits) come from
# memory the allocator reuses and stay in cache for their copy into the wire row; a whole
# tensor's codes, wire copy and zero-padded fp32 copy were fresh tensors of the message's size,
# paid for in page faults (an 8-bit all-reduce of 64 MiB of fp32 on 2 gloo ranks over loopback
# spent about a third of its time so). A GPU quantizes in far larger pieces.
QUANTIZE_PIECE = {"cpu": 1 << 20, "device": 1 << 26}


def receiving_rows(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor | None:
    """``x``'s own bytes as rows for an all-to-all to receive into (uint8 [W, row_bytes]), once
    ``x`` is quantized and consumed (an in-place all-reduce's tensor, which the result replaces);
    None where they do not fit (W rows of wire bytes are more than x's bytes) or x is not one run.

    On CPUs a new tensor of the wire's size costs a page fault per 4 KiB each call (for an 8-bit
    all-reduce of 64 MiB of fp32 on 4 gloo ranks over loopback, 2 cores: 9.5K faults and about a
    fifth of its CPU time), so the reduction allocates one, for the rows it sends, not two. It is
    the received rows that go into x's bytes, not the sent ones: the codes are then written
    straight into a buffer that aliases nothing the quantization reads (the quantization
    writes them there in one pass), where sent rows written over x had to be quantized into a
    temporary and copied, each row's bytes before its own values.
    """
    nbytes = layout.world_size * layout.row_bytes
    if not x.is_contiguous() or nbytes > x.numel() * x.element_size():
        return None
    return x.detach().reshape(-1).view(torch.uint8)[:nbytes].view(layout.world_size, layout.row_bytes)


def quantize_to_wire(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The wire rows (uint8 [W, row_bytes]) of ``x``: the bytes of ``to_wire(quantize_rows(x, layout), W)``,
    quantized a piece of whole blocks at a time straight into the rows of a new tensor."""
    flat = x.detach().reshape(-1)
    fmt, pb, w = layout.fmt, layout.row_payload_bytes, layout.world_size
    wire = torch.empty(w, layout.row_bytes, dtype=torch.uint8, device=x.device)
    step = max(1, QUANTIZE_PIECE[size_key(x.device)] // fmt.block_size) * fmt.block_size
    if layout.unpadded and layout.chunk <= step:
        # Rows of whole blocks with nothing to pad: as many rows as a piece holds per call (each
        # call has a fixed dispatch cost), their codes written where they go.
        per_call = step // layout.chunk
        for r0 in range(0, w, per_call):
            r1 = min(w, r0 + per_call)
            rows = flat[r0 * layout.chunk : r1 * layout.chunk].view(r1 - r0, -1)
            quantize_rows_into(rows, wire[r0:r1, :pb], wire[r0:r1, pb:].view(torch.float32), fmt)
        return wire
    for r in range(w):
        lo, hi = layout.shard_range(r)
        payload, scales = wire[r, :pb], wire[r, pb:].view(torch.float32)
        for start in range(0, layout.padded_chunk, step):
            end = min(layout.padded_chunk, start + step)
            piece = flat[min(hi, lo + start) : min(hi, lo + end)]
            if piece.numel() != end - start:  # the end of a chunk: zeros up to the padded chunk's blocks
                piece = torch.nn.functional.pad(piece, (0, end - start - piece.numel()))
            q = quantize(piece, fmt, nonfinite="propagate")
            payload[fmt.payload_bytes(start) : fmt.payload_bytes(end)].copy_(q.payload)
            scales[start // fmt.block_size : end // fmt.block_size].copy_(q.scales)
    return wire


class PendingAllReduce:
    """Handle of an async :func:`all_reduce_8bit`; :meth:`wait` finishes it into the tensor.

    ``reductions`` cover the flattened tensor piece after piece, in order (one piece unless the
    all-reduce spans nodes, see :func:`node_pieces`).
    """

    def __init__(self, reductions: list[EightBitReduction], tensor: torch.Tensor) -> None:
        self._reductions = reductions
        self._tensor = tensor
        self._done = False

    def wait(self) -> torch.Tensor:
        """Reduce, re-quantize, all-gather and write the result into the tensor; return it."""
        if not self._done:
            # Every piece's all-gather is started before the first is waited for: over a slow
            # link one piece's bytes travel while the next is summed.
            for r in self._reductions:
                r.reduce_and_gather()
            t = self._tensor
            # Straight into the tensor where it is contiguous: one pass over the result
            # (dequantize, un-pad and copy made three).
            flat = t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)
            offset = 0
            for r in self._reductions:
                _dequantize_gathered(r, flat[offset : offset + r.layout.numel])
                offset += r.layout.numel
            if flat.data_ptr() != t.data_ptr():
                t.copy_(flat.view(t.shape))
            self._done = True
        return self._tensor


def _dequantize_gathered(r: EightBitReduction, flat: torch.Tensor) -> None:
    """The all-gathered bytes of ``r`` dequantized into ``flat`` (its layout.numel values): by the
    kernels in one call where the rows are whole chunks with no padding, else row by row."""
    wire = r.gathered()
    layout = r.layout
    with timed_phase(r.timings, "dequantize", wire.device):
        kernels = backend.kernels(wire.device, layout.fmt)
        if kernels is not None and layout.unpadded and flat.dtype == torch.float32:
            pb = layout.row_payload_bytes
            kernels.dequantize_rows(wire[:, :pb], wire[:, pb:].view(torch.float32), layout.fmt, flat.view(layout.world_size, layout.chunk))
            return
        for i in range(layout.world_size):
            lo, hi = i * layout.chunk, min(layout.numel, (i + 1) * layout.chunk)
            if hi <= lo:
                break
            row = from_wire(wire[i : i + 1], layout)
            if hi - lo == layout.padded_chunk:
                dequantize(row, out=flat[lo:hi])
            else:
                flat[lo:hi].copy_(dequantize(row, flat.dtype)[: hi - lo])


# Over nodes, an all-reduce of more than this many fp32 bytes runs as pieces of about this size,
# at most NODE_PIECES_MAX of them: their collectives queue back to back on the process group, so
# the slow link is never idle while a piece is summed, and TCP's send window stays open. Over a
# 100 Mbit link between 2 simulated hosts (benchmarks/allreduce.py) pieces of 1-4 MiB shortened a
# 32 MiB all-reduce; on loopback, where bytes cost little, pieces only add collectives.
NODE_PIECE_BYTES = 2 << 20
NODE_PIECES_MAX = 8


def node_pieces(numel: int, nodes: NodeGroups | None) -> list[tuple[int, int]]:
    """(start, end) of the pieces an all-reduce of ``numel`` fp32 values over ``nodes`` runs as."""
    count = min(NODE_PIECES_MAX, -(-numel * 4 // NODE_PIECE_BYTES)) if gathers_by_node(nodes) else 1
    step = -(-numel // max(1, count))
    return [(start, min(numel, start + step)) for start in range(0, numel, step)] or [(0, 0)]


def _start_8bit(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp,
    group: Group,
    fmt: QuantFormat | str | None,
    counter: CommCounter | None,
    timings: dict[str, float] | None,
    name: str,
    nodes: NodeGroups | None = None,
    consume: bool = False,
) -> EightBitReduction:
    """Quantize ``tensor`` into rank chunks and start their all-to-all: steps 1-2 of both 8-bit collectives.

    ``consume``: the tensor's bytes may receive the all-to-all's rows (see :func:`receiving_rows`).
    """
    _check_float(tensor, name)
    world_size, _ = world_of(group)
    layout = chunk_layout(tensor.numel(), world_size, fmt)
    return start_reduction(tensor, layout, op, group, consume=consume, counter=counter, name=name, timings=timings, nodes=nodes)


def start_reduction(
    tensor: torch.Tensor,
    layout: ChunkLayout,
    op: str | dist.ReduceOp,
    group: Group,
    *,
    consume: bool = False,
    timings: dict[str, float] | None = None,
    **kwargs: Any,
) -> EightBitReduction:
    """The :class:`EightBitReduction` of ``tensor`` over ``layout``: quantized into wire rows of its
    own (:func:`quantize_to_wire`), its all-to-all started. ``consume``: the tensor's bytes receive
    the rows (:func:`receiving_rows`; the result replaces the tensor). ``kwargs``: the reduction's
    (counter, name, nodes)."""
    with timed_phase(timings, "quantize", tensor.device):
        rows = quantize_to_wire(tensor, layout)
    recv = receiving_rows(tensor, layout) if consume else None
    return EightBitReduction(rows, layout, op, group, timings=timings, owns_rows=True, recv=recv, **kwargs)


def all_reduce_8bit(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: Group = None,
    *,
    fmt: QuantFormat | str | None = None,
    async_op: bool = False,
    counter: CommCounter | None = None,
    timings: dict[str, float] | None = None,
    nodes: NodeGroups | None = None,
) -> PendingAllReduce | None:
    """In-place precision-preserving 8-bit all-reduce (sum or avg) of a float tensor.

    ``timings``, if given, receives seconds per phase (quantize, all_to_all, reduce, all_gather,
    dequantize); each phase is then waited for, so it disables overlap. ``nodes``
    (:func:`~agoq.gradient.nodes.node_groups` of ``group``) gathers between nodes, then within
    them (:func:`gathers_by_node`), with the same bytes and fewer across nodes; a large tensor then
    goes as a few pieces, each an all-reduce of its own (:func:`node_pieces`).

    The tensor's own bytes receive the quantized rows sent to this rank (:func:`receiving_rows`):
    with ``async_op``, as for any torch.distributed collective, its contents are undefined until
    the handle's ``wait()`` returns.
    """
    flat = tensor.detach().reshape(-1)  # a view where the tensor is contiguous
    pieces = [flat[a:b] for a, b in node_pieces(flat.numel(), nodes)]
    pending = PendingAllReduce(
        [_start_8bit(piece, op, group, fmt, counter, timings, "all_reduce_8bit", nodes, consume=True) for piece in pieces], tensor
    )
    if async_op:
        return pending
    pending.wait()
    return None


def reduce_scatter_8bit(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: Group = None,
    *,
    fmt: QuantFormat | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    counter: CommCounter | None = None,
    timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """This rank's shard of the 8-bit-exchanged, fp32-summed ``tensor`` (see ChunkLayout.shard_range).

    The shard covers flat elements [rank * c, (rank + 1) * c) with c = ceil(numel / W); when W
    divides numel that is torch's reduce-scatter split.
    """
    reduction = _start_8bit(tensor, op, group, fmt, counter, timings, "reduce_scatter_8bit")
    start, end = reduction.layout.shard_range(reduction.rank)
    return reduction.reduce()[: end - start].to(out_dtype)


def all_reduce_fp(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: Group = None,
    *,
    wire_dtype: torch.dtype | None = None,
    counter: CommCounter | None = None,
) -> None:
    """In-place torch.distributed all-reduce with ``wire_dtype`` (default: the tensor's) on the wire."""
    _check_float(tensor, "all_reduce_fp")
    op = parse_op(op)
    wire_dtype = wire_dtype or tensor.dtype
    world_size, _ = world_of(group)
    buf = tensor if tensor.dtype == wire_dtype and tensor.is_contiguous() else tensor.to(wire_dtype).contiguous()
    name = f"all_reduce_{_DTYPE_NAMES.get(wire_dtype, str(wire_dtype).removeprefix('torch.'))}"
    (COMM_COUNTER if counter is None else counter).record(name, ring_all_reduce_bytes(buf.numel() * buf.element_size(), world_size))
    if world_size > 1:
        # SUM then divide: gloo has no AVG all-reduce.
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    if op == "avg":
        buf.div_(world_size)
    if buf is not tensor:
        tensor.copy_(buf)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def agree_nonfinite(
    local_index: int | None | torch.Tensor,
    group: Group = None,
    *,
    device: torch.device | str = "cpu",
    counter: CommCounter | None = None,
) -> list[int | None]:
    """Every rank's first non-finite item index (None where all finite), from one small all-reduce
    and one host read. ``local_index``: this rank's index or None, or 1 + index (0: none) as an
    int64 scalar tensor on ``device``, which then needs no host read before the all-reduce.

    ``device`` must be one the group's backend accepts (CUDA for NCCL).
    """
    world_size, rank = world_of(group)
    flags = torch.zeros(world_size, dtype=torch.int64, device=device)
    if isinstance(local_index, torch.Tensor):
        flags[rank] = local_index
    else:
        flags[rank] = 0 if local_index is None else local_index + 1
    if world_size > 1:
        (COMM_COUNTER if counter is None else counter).record("nonfinite_flags", ring_all_reduce_bytes(8 * world_size, world_size))
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    return [None if v == 0 else int(v) - 1 for v in flags.tolist()]


def _check_float(tensor: torch.Tensor, where: str) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{where} expects a floating-point tensor (fp32/bf16/fp16), got {tensor.dtype}")
