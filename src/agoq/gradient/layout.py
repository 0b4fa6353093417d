"""Where every gradient value of a bucketed buffer lives: the bucket plan, per-parameter segments, block padding.

Parameters are placed in reverse registration order (the order backward produces their gradients)
into buckets; every parameter starts on a quantization-block boundary, so folding one parameter
never re-rounds another's values, and a parameter larger than what is left of a bucket continues in
the next one (buckets end on block boundaries, so blocks never straddle buckets). Each bucket is
padded to W x (whole blocks), the layout of the 8-bit collective, so a bucket's storage goes on the
wire as it is. :func:`bucket_runs` is the one rule, run-length encoded (the memory planner reads it
for models of any size); :func:`plan_buckets`, which the 8-bit buffer and ZeRO-1's fp32 path call,
is the same layout bucket by bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from agoq.quant import QuantFormat
from agoq.quant.formats import round_up
from agoq.quant.pieces import piece_values

from agoq.gradient.collectives import ChunkLayout, chunk_layout

# DDP's default bucket_cap_mb, counted like DDP: full-precision (fp32) gradient bytes per bucket.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# Values folded or read back per call on a CPU (rounded to whole blocks): the fp32 temporaries
# stay a few hundred KiB, within the core's cache, whatever the parameter's size (agoq.quant.pieces).
FOLD_PIECE = 1 << 15

Params = torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]]


@dataclass(frozen=True)
class Segment:
    """The part of one parameter's flattened gradient that lives in one bucket."""

    param: int
    bucket: int
    offset: int
    param_offset: int
    numel: int


@dataclass(frozen=True)
class BucketRun:
    """``count`` consecutive buckets laid out alike: ``segments`` are the first one's; the j-th next
    holds the same parameters ``j`` buckets and ``j x cap`` values further (a parameter spanning
    whole buckets, which alone are ever repeated)."""

    count: int
    padded: int
    segments: tuple[Segment, ...]
    cap: int

    def expand(self) -> list[tuple[int, list[Segment]]]:
        """(padded flat size, segments) of each bucket of the run."""
        return [
            (self.padded, [Segment(s.param, s.bucket + j, s.offset, s.param_offset + j * self.cap, s.numel) for s in self.segments])
            for j in range(self.count)
        ]


def bucket_runs(numels: list[int], block: int, bucket_numel: int, world: int) -> list[BucketRun]:
    """The layout of :func:`plan_buckets` with the whole buckets of one parameter collapsed into one run.

    It holds at most two runs per parameter (plus one) whatever their sizes, so the memory planner
    reads the buckets of any model from it in time and memory bounded by the parameter count.
    """
    cap = round_up(bucket_numel, block)
    runs: list[BucketRun] = []
    current: list[Segment] = []
    fill = bucket = 0

    def padded(segs: list[Segment] | tuple[Segment, ...]) -> int:
        used = max((s.offset + round_up(s.numel, block) for s in segs), default=block)
        return round_up(used, world * block)

    def close() -> None:
        nonlocal current, fill, bucket
        runs.append(BucketRun(1, padded(current), tuple(current), cap))
        current, fill, bucket = [], 0, bucket + 1

    for pi in reversed(range(len(numels))):
        remaining, poff = numels[pi], 0
        while remaining > 0:
            if fill >= cap:
                close()
            if fill == 0 and remaining >= cap:
                # Whole buckets of this parameter alone: one run, however many.
                whole = remaining // cap
                first = (Segment(pi, bucket, 0, poff, cap),)
                runs.append(BucketRun(whole, padded(first), first, cap))
                bucket += whole
                remaining -= whole * cap
                poff += whole * cap
                continue
            take = min(remaining, cap - fill)
            current.append(Segment(pi, bucket, fill, poff, take))
            fill += round_up(take, block)
            remaining -= take
            poff += take
    if current or not runs:
        close()
    return runs


def plan_buckets(numels: list[int], block: int, bucket_numel: int, world: int) -> list[tuple[int, list[Segment]]]:
    """(padded flat size, segments) of each gradient bucket: the one layout rule of every 8-bit or sharded buffer.

    Parameters go in reverse order (the order backward produces them), each starting on a block
    boundary; a parameter larger than what is left of a bucket continues in the next; a bucket is
    padded to world x whole blocks (the layout of the 8-bit collectives). :func:`bucket_runs` is the
    same layout, run-length encoded.
    """
    return [bucket for run in bucket_runs(numels, block, bucket_numel, world) for bucket in run.expand()]


def block_starts(numels: list[int], block: int) -> tuple[list[int], int]:
    """(start of each of ``numels``' values, total): laid end to end, each starting a block of its own.

    The layout of one flat buffer of several gradients quantized together (a DDP bucket, an FSDP2
    shard row): a block shared by two gradients takes one scale for both, so the smaller one, next to
    a gradient 1e4 larger, keeps almost no digits; with each gradient's last block padded with zeros
    every block holds one gradient's values.
    """
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += round_up(n, block)
    return starts, total


def bucket_numel_for(bucket_numel: int | None, bucket_bytes: int | None) -> int:
    """Values per bucket from either size (fp32 bytes count 4 a value); DDP's default when neither is given."""
    if bucket_numel is not None and bucket_bytes is not None:
        raise ValueError("give bucket_numel or bucket_bytes, not both")
    if bucket_numel is None:
        bucket_numel = (DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes) // 4
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least one element, got {bucket_numel}")
    return bucket_numel


class GradLayout:
    """The layout of one buffer, fixed at construction: per bucket its collective layout and segments,
    per parameter its segments (in parameter order), and the piece sizes of folds and reads."""

    def __init__(self, numels: list[int], fmt: QuantFormat, bucket_numel: int, world_size: int) -> None:
        self.fmt = fmt
        self.numels = numels
        self.bucket_numel = round_up(bucket_numel, fmt.block_size)
        plan = plan_buckets(numels, fmt.block_size, self.bucket_numel, world_size)
        self.chunks: list[ChunkLayout] = [chunk_layout(n_padded, world_size, fmt) for n_padded, _ in plan]
        self.bucket_segments: list[list[Segment]] = [segs for _, segs in plan]
        self.segments: list[list[Segment]] = [[] for _ in numels]
        for segs in self.bucket_segments:
            for seg in segs:
                self.segments[seg.param].append(seg)
        for segs in self.segments:
            segs.sort(key=lambda seg: seg.param_offset)

    @property
    def numel(self) -> int:
        """Gradient values held (sum of parameter sizes)."""
        return sum(self.numels)

    def params_ending_in(self, b: int) -> list[int]:
        """The parameters whose last segment lies in bucket ``b``: complete once ``b`` is."""
        return [s.param for s in self.bucket_segments[b] if self.segments[s.param][-1].bucket == b]

    def bucket_order(self) -> list[int]:
        """Parameter indices grouped by the bucket that holds their last segment."""
        return [pi for b in range(len(self.bucket_segments)) for pi in self.params_ending_in(b)]

    def whole_blocks(self, values: int) -> int:
        """``values`` rounded down to whole blocks (at least one block): the size of a fold or read-back piece."""
        return max(1, values // self.fmt.block_size) * self.fmt.block_size

    def piece(self, device: torch.device) -> int:
        """Values dequantized at once when folding or reading back on ``device``, in whole blocks."""
        return self.whole_blocks(piece_values(device, FOLD_PIECE))


def named_params(params: Params) -> tuple[list[str], list[torch.nn.Parameter]]:
    """(names, parameters) of those that require grad, each once; unnamed ones are called param<i>."""
    items = list(params.named_parameters()) if isinstance(params, torch.nn.Module) else list(params)
    names, out, seen = [], [], set()
    for i, item in enumerate(items):
        name, p = item if isinstance(item, tuple) else (f"param{i}", item)
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected parameters or (name, parameter) pairs, got {type(p).__name__} at {i}")
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        names.append(name)
        out.append(p)
    return names, out


def param_index(names: list[str], params: list[torch.nn.Parameter], param: int | str | torch.nn.Parameter) -> int:
    """The index of ``param``, given as an index, a name or the parameter itself."""
    if isinstance(param, int):
        return param
    if isinstance(param, str):
        if param not in names:
            raise KeyError(f"no parameter named {param!r} in this buffer")
        return names.index(param)
    for i, p in enumerate(params):
        if p is param:
            return i
    raise KeyError(f"parameter of shape {tuple(param.shape)} is not in this buffer")
