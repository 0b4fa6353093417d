"""QuanGrad's gradient buffer: the gradients of a set of parameters, stored in 8 bits.

Layout. Parameters are placed in reverse registration order (the order backward produces their
gradients) into buckets; every parameter starts on a quantization-block boundary, so folding one
parameter never re-rounds another's values, and a parameter larger than what is left of a bucket
continues in the next one (buckets end on block boundaries, so blocks never straddle buckets).
Each bucket is padded to W x (whole blocks), the layout of the 8-bit collective, so a bucket's
storage goes on the wire as it is.

Accumulation. A registered ``post_accumulate_grad`` hook folds each full-precision gradient in as
soon as autograd produces it and drops ``p.grad``. The first micro-batch of a step only quantizes;
later ones dequantize, add in fp32 and re-quantize (never an 8-bit add). After k folds the error
against fp32 accumulation is at most sum_j s_j / 2 per element (s_j: the block's scale after fold j).

Communication. A bucket whose parameters have all received their last micro-batch's gradient
starts its 8-bit all-to-all at once (async), while backward continues; buckets start strictly in
index order, and the previous bucket's reduce and all-gather are issued right after, so every rank
issues the same collectives in the same order. :meth:`QuantGradBuffer.finish` completes the rest,
then agrees on non-finite gradients with one small all-reduce.

Reading. :meth:`QuantGradBuffer.grad`, :meth:`grads` and :meth:`step` dequantize one parameter
(or one bucket's parameters) at a time, so full-precision gradients never exist all at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from agoq.quant import SCALE_BYTES, QTensor, QuantFormat, backend, dequantize, quantize
from agoq.quant.formats import round_up
from agoq.quant.qtensor import quantize as reference_quantize

from agoq.gradient.collectives import (
    ChunkLayout,
    EightBitReduction,
    Group,
    agree_nonfinite,
    chunk_layout,
    gradient_format,
    parse_op,
    world_of,
)
from agoq.gradient.counter import CommCounter

# DDP's default bucket_cap_mb, counted like DDP: full-precision (fp32) gradient bytes per bucket.
DEFAULT_BUCKET_BYTES = 25 * 2**20
COLLECTIVES = ("all_reduce", "reduce_scatter")
# Values folded per quantize call (rounded to whole blocks): bounds the fp32
# temporaries of a fold to a few hundred KiB whatever the parameter's size.
FOLD_PIECE = 1 << 16
# Values per compiled fold call. The compiled fold is one fused loop with no per-value fp32
# temporaries (its outputs are the new payload and per-block scales and extrema, about 1.1 bytes a
# value at 8 bits), so its pieces can be 8x larger within the same bound; each call also costs
# about 60 us of dispatch, which 64K-value pieces paid 16 times for a 1M-value embedding.
COMPILED_FOLD_PIECE = 1 << 19


@dataclass(frozen=True)
class Segment:
    """The part of one parameter's flattened gradient that lives in one bucket."""

    param: int
    bucket: int
    offset: int
    param_offset: int
    numel: int


@dataclass
class _Bucket:
    index: int
    layout: ChunkLayout
    payload: torch.Tensor
    scales: torch.Tensor
    segments: list[Segment] = field(default_factory=list)
    pending: int = 0
    state: str = "open"  # open -> launched -> reducing -> done
    reduction: EightBitReduction | None = None
    shard: torch.Tensor | None = None

    @property
    def values(self) -> QTensor:
        """The whole bucket (world_size x padded_chunk values) as one flat QTensor over its storage."""
        n = self.layout.world_size * self.layout.padded_chunk
        return QTensor(self.payload, self.scales, torch.Size([n]), torch.float32, self.layout.fmt)


class QuantGradBuffer:
    """8-bit block-wise gradient storage for a set of parameters, with bucketed 8-bit collectives.

    ``group`` is the data-parallel ProcessGroup of these parameters (default: WORLD if
    torch.distributed is initialized, else no communication); a pipeline stage passes its own
    parameters and its dp group. ``microbatches`` backward passes make one optimizer step.
    ``collective='reduce_scatter'`` leaves each rank its fp32 shard of every bucket (ZeRO-1).
    """

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
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
    ) -> None:
        self.fmt = gradient_format(fmt)
        self.group = group
        self.op = parse_op(op)
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        self.collective = collective
        self.overlap = overlap
        self.counter = counter
        self.world_size, self.rank = world_of(group)
        self.microbatches = microbatches
        self.names, self.params = _named(params)
        if not self.params:
            raise ValueError("QuantGradBuffer got no parameters that require grad")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; build one buffer per device")
        self.device = devices.pop()
        if bucket_numel is not None and bucket_bytes is not None:
            raise ValueError("give bucket_numel or bucket_bytes, not both")
        if bucket_numel is None:
            bucket_numel = (DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes) // 4
        if bucket_numel < 1:
            raise ValueError(f"bucket size must be at least one element, got {bucket_numel}")
        self.bucket_numel = round_up(bucket_numel, self.fmt.block_size)
        self.buckets, self.segments = self._build_layout()
        self._region_cache: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.peak_fp_grad_bytes = 0
        self.skipped_steps = 0
        self.nonfinite: list[tuple[int, str]] = []
        self.zero_grad()

    # ---- layout -------------------------------------------------------------------------------

    def _build_layout(self) -> tuple[list[_Bucket], list[list[Segment]]]:
        block = self.fmt.block_size
        segments: list[list[Segment]] = [[] for _ in self.params]
        buckets = []
        # The code of 0.0, from the reference quantizer: one block through a compiled one would
        # compile (or load) a one-block variant in every process before the first step.
        zero = reference_quantize(torch.zeros(block), self.fmt).payload[:1]
        for b, (n_padded, segs) in enumerate(plan_buckets([p.numel() for p in self.params], block, self.bucket_numel, self.world_size)):
            for seg in segs:
                segments[seg.param].append(seg)
            layout = chunk_layout(n_padded, self.world_size, self.fmt)
            n = layout.world_size * layout.padded_chunk
            payload = zero.expand(self.fmt.payload_bytes(n)).clone()
            scales = torch.zeros(self.fmt.num_blocks(n), dtype=torch.float32)
            buckets.append(_Bucket(b, layout, payload, scales, segs))
        for segs in segments:
            segs.sort(key=lambda seg: seg.param_offset)
        return buckets, segments

    def _whole_blocks(self, values: int) -> int:
        """``values`` rounded down to whole blocks (at least one block): the size of a fold or read-back piece."""
        return max(1, values // self.fmt.block_size) * self.fmt.block_size

    @property
    def _piece(self) -> int:
        """Values dequantized at once when folding or reading back: FOLD_PIECE in whole blocks."""
        return self._whole_blocks(FOLD_PIECE)

    def _compiled_fold_bytes(self, n: int) -> int:
        """Temporaries of one compiled fold of ``n`` values: the new payload, then per block its scale, max and min (fp32)."""
        return self.fmt.payload_bytes(round_up(n, self.fmt.block_size)) + 3 * 4 * self.fmt.num_blocks(n)

    @property
    def storage_bytes(self) -> int:
        """Bytes the buffer stores: packed codes plus fp32 scales, padding included."""
        return sum(b.payload.numel() + b.scales.numel() * SCALE_BYTES for b in self.buckets)

    @property
    def numel(self) -> int:
        """Gradient values held (sum of parameter sizes)."""
        return sum(p.numel() for p in self.params)

    def bucket_states(self) -> list[str]:
        """Per bucket: 'open', 'launched' (all-to-all in flight), 'reducing' (all-gather) or 'done'."""
        return [b.state for b in self.buckets]

    def memory_stats(self) -> dict[str, int]:
        """Storage bytes, the fp32 size of one full gradient and of the largest bucket, and the peak."""
        return {
            "storage_bytes": self.storage_bytes,
            "fp32_grad_bytes": 4 * self.numel,
            "largest_bucket_fp32_bytes": 4 * max(b.layout.world_size * b.layout.padded_chunk for b in self.buckets),
            "peak_fp_grad_bytes": self.peak_fp_grad_bytes,
            "buckets": len(self.buckets),
        }

    def remove_hooks(self) -> None:
        """Stop folding gradients into this buffer (p.grad behaves normally again)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- accumulation -------------------------------------------------------------------------

    def zero_grad(self, microbatches: int | None = None) -> None:
        """Empty the buffer for the next optimizer step (optionally with a new micro-batch count)."""
        if microbatches is not None:
            self.microbatches = microbatches
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        for b in self.buckets:
            # A zero scale makes every code decode to 0, whatever the payload holds.
            b.scales.zero_()
            b.pending = len(b.segments)
            b.state = "open"
            b.reduction = None
            b.shard = None
        self._folds = [0] * len(self.params)
        self._next = 0
        self._bad_mask = torch.zeros(len(self.params), dtype=torch.bool, device=self.device)
        self._bad_flags: list[tuple[int, torch.Tensor]] = []  # (parameter, "a block went non-finite") per compiled fold
        self._finished = False
        self._ok = True

    def _hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None
            if g is not None:
                self._fold(index, g)
                # The full-precision gradient is gone before a bucket it completed is sent, so the
                # bucket's messages never coexist with it (the largest, the embedding's, comes last).
                del g
                self._launch_ready()

        return hook

    def fold(self, param: int | str | torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add one micro-batch's full-precision gradient of ``param`` into the 8-bit buffer."""
        self._fold(self._index(param), grad)
        self._launch_ready()

    def _fold(self, pi: int, grad: torch.Tensor) -> None:
        if grad.numel() != self.params[pi].numel():
            raise ValueError(f"gradient of {self.names[pi]!r} has {grad.numel()} values, the parameter {self.params[pi].numel()}")
        if any(self.buckets[seg.bucket].state != "open" for seg in self.segments[pi]):
            raise RuntimeError(
                f"parameter {self.names[pi]!r} received a gradient after its bucket's reduction started "
                f"(more backward passes than microbatches={self.microbatches}, or finish() already ran); "
                "call zero_grad() before the next step, or zero_grad(microbatches=...) to change the count"
            )
        first = self._folds[pi] == 0
        if self._folds[pi] >= self.microbatches:
            raise RuntimeError(
                f"parameter {self.names[pi]!r} received gradient {self._folds[pi] + 1} of a step configured "
                f"for microbatches={self.microbatches}; call finish() and zero_grad() between steps, or "
                "pass the right count to zero_grad(microbatches=...)"
            )
        flat = grad.detach().reshape(-1)
        kernels = backend.kernels(self.device, self.fmt)
        fold_ = getattr(kernels, "fold_", None)
        if fold_ is not None:
            # Compiled path: one call per piece into precomputed region views; the call zeroes a
            # non-finite block's scale itself and hands back a flag, collected for finish().
            for start, end, pay, sc in self._regions(pi):
                self._bad_flags.append((pi, fold_(pay, sc, flat[start:end], self.fmt, first=first)))
            self.peak_fp_grad_bytes = max(
                self.peak_fp_grad_bytes, flat.numel() * flat.element_size() + self._compiled_fold_bytes(min(flat.numel(), COMPILED_FOLD_PIECE))
            )
        else:
            piece = self._piece
            if kernels is not None:
                piece = max(piece, flat.numel())  # the Triton fold has no fp32 temporaries: one launch per segment
            self._piece_peak = 0
            for seg in self.segments[pi]:
                bucket = self.buckets[seg.bucket]
                # Piece by piece (whole blocks, so the result is the same): quantize's fp32 temporaries
                # stay a fixed size however large the parameter is.
                for start in range(0, seg.numel, piece):
                    k = min(piece, seg.numel - start)
                    g = flat[seg.param_offset + start : seg.param_offset + start + k]
                    self._fold_piece(pi, bucket, seg.offset + start, g, first)
            self.peak_fp_grad_bytes = max(self.peak_fp_grad_bytes, flat.numel() * flat.element_size() + self._piece_peak)
        self._folds[pi] += 1
        if self._folds[pi] == self.microbatches:
            for seg in self.segments[pi]:
                self.buckets[seg.bucket].pending -= 1

    def _regions(self, pi: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(start, end in the flat gradient, payload view, scales view) of each fold piece of a parameter, built once.

        The bucket tensors are allocated once and only ever written in place, so the views stay valid.
        """
        cached = self._region_cache.get(pi)
        if cached is None:
            cached = []
            block, piece = self.fmt.block_size, self._whole_blocks(COMPILED_FOLD_PIECE)
            for seg in self.segments[pi]:
                values = self.buckets[seg.bucket].values
                for start in range(0, seg.numel, piece):
                    k = min(piece, seg.numel - start)
                    region = values.blocks(seg.offset + start, round_up(k, block))
                    cached.append((seg.param_offset + start, seg.param_offset + start + k, region.payload, region.scales))
            self._region_cache[pi] = cached
        return cached

    def _fold_piece(self, pi: int, bucket: _Bucket, offset: int, g: torch.Tensor, first: bool) -> None:
        """Fold k gradient values into the bucket region that starts at ``offset`` (a block boundary)."""
        block, k = self.fmt.block_size, g.numel()
        n = round_up(k, block)
        region = bucket.values.blocks(offset, n)
        pay, sc = region.payload, region.scales
        kernels = backend.kernels(self.device, self.fmt)
        if kernels is not None:  # Triton (the compiled path has fold_): dequantize, add, requantize in one pass
            kernels.accumulate_(pay, sc, g, self.fmt, first=first)
            bad = torch.isnan(sc)
            sc.masked_fill_(bad, 0.0)
            self._bad_mask[pi] |= bad.any()
            return
        if first and k == n:
            x = g
        elif first:
            # The padding of a parameter's last block must hold the code of zero.
            x = torch.zeros(n, dtype=torch.float32, device=self.device)
            x[:k] = g
        else:
            x = dequantize(region)
            x[:k] += g
        self._piece_peak = max(self._piece_peak, 4 * n if x is not g else 0)
        q = quantize(x, self.fmt, nonfinite="propagate")
        # A NaN scale marks a block that held NaN/Inf. Keep it off the wire (finish() makes every
        # rank skip this step) and remember the parameter, without a host sync per fold.
        bad = torch.isnan(q.scales)
        q.scales.masked_fill_(bad, 0.0)
        self._bad_mask[pi] |= bad.any()
        pay.copy_(q.payload)
        sc.copy_(q.scales)

    def _index(self, param: int | str | torch.nn.Parameter) -> int:
        if isinstance(param, int):
            return param
        if isinstance(param, str):
            if param not in self.names:
                raise KeyError(f"no parameter named {param!r} in this buffer")
            return self.names.index(param)
        for i, p in enumerate(self.params):
            if p is param:
                return i
        raise KeyError(f"parameter of shape {tuple(param.shape)} is not in this buffer")

    # ---- communication ------------------------------------------------------------------------

    @property
    def communicates(self) -> bool:
        """Whether this buffer reduces over more than one rank."""
        return self.world_size > 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        bucket.state = "launched"
        self._next = b + 1
        if not self.overlap:
            return
        self._start(bucket)
        # Keep at most three buckets' communication in flight (this one's all-to-all, the previous
        # one's all-gather, and the one before it finishing): temporaries stay a few buckets' worth
        # whatever the model size, and each collective had a whole bucket's time to complete.
        if b > 0:
            self._progress(self.buckets[b - 1])
        if b > 1:
            self._complete(self.buckets[b - 2])

    def _start(self, bucket: _Bucket) -> None:
        if not self.communicates:
            return
        layout = bucket.layout
        name = "grad_all_reduce_8bit" if self.collective == "all_reduce" else "grad_reduce_scatter_8bit"
        # The bucket's own storage is sent (it takes no fold until zero_grad, and is overwritten
        # only by the all-gather that follows this all-to-all).
        bucket.reduction = EightBitReduction(bucket.values, layout, self.op, self.group, counter=self.counter, name=name)

    def _progress(self, bucket: _Bucket) -> None:
        if bucket.state != "launched":
            return
        bucket.state = "reducing"
        if bucket.reduction is None:
            return
        if self.collective == "reduce_scatter":
            bucket.shard = bucket.reduction.reduce()
            self.peak_fp_grad_bytes = max(self.peak_fp_grad_bytes, 2 * bucket.shard.numel() * 4)
        else:
            bucket.reduction.reduce_and_gather()  # a piece of the chunk in fp32 at a time

    def _complete(self, bucket: _Bucket) -> None:
        if bucket.reduction is not None and self.collective == "all_reduce":
            # Row by row from the gathered bytes into the bucket (no flat copy of them first).
            gathered, layout = bucket.reduction.gathered(), bucket.layout
            pb = layout.row_payload_bytes
            bucket.payload.view(layout.world_size, pb).copy_(gathered[:, :pb])
            bucket.scales.view(layout.world_size, -1).copy_(gathered[:, pb:].view(torch.float32))
        bucket.reduction = None
        bucket.state = "done"

    def finish(self) -> bool:
        """Complete every bucket's collective and agree on non-finite gradients; False = skip step."""
        if self._finished:
            return self._ok
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
        if self._bad_flags:  # one reduction for the whole step instead of one per fold
            flags = torch.stack([f for _, f in self._bad_flags])
            if bool(flags.any()):
                self._bad_mask[self._bad_flags[int(flags.nonzero()[0])][0]] = True
            self._bad_flags = []
        bad_params = self._bad_mask.nonzero()
        first_bad = int(bad_params[0]) if bad_params.numel() else None
        flags = agree_nonfinite(first_bad, self.group, device=self.device, counter=self.counter)
        self._finished = True
        bad = [(r, i) for r, i in enumerate(flags) if i is not None]
        if bad:
            self._ok = False
            self.skipped_steps += 1
            self.nonfinite = [(r, self.names[i]) for r, i in bad]
            where = ", ".join(f"{name!r} on rank {r}" for r, name in self.nonfinite)
            warnings.warn(
                f"non-finite gradient in {where}; skipping this optimizer step and resetting the 8-bit "
                "gradient buffer (lower the learning rate or check the loss if this repeats)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.zero_grad()
            self._finished, self._ok = True, False
        return self._ok

    # ---- reading back -------------------------------------------------------------------------

    def _check_readable(self) -> None:
        if self.collective == "reduce_scatter" and self._finished:
            raise RuntimeError("a reduce_scatter buffer holds shards after finish(); read them with local_shards()")
        if any(b.state in ("launched", "reducing") for b in self.buckets) and self.communicates:
            raise RuntimeError("gradients are being reduced; call finish() before reading them")

    def grad(self, param: int | str | torch.nn.Parameter, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored gradient of one parameter, dequantized, in the parameter's shape."""
        self._check_readable()
        pi = self._index(param)
        p = self.params[pi]
        segments = self.segments[pi]
        if len(segments) == 1:  # the common case: dequantize straight into the result
            seg = segments[0]
            return dequantize(self.buckets[seg.bucket].values.blocks(seg.offset, seg.numel, dtype))[: seg.numel].view(p.shape)
        out = torch.empty(p.numel(), dtype=dtype, device=self.device)
        for seg in segments:
            vals = dequantize(self.buckets[seg.bucket].values.blocks(seg.offset, seg.numel))
            out[seg.param_offset : seg.param_offset + seg.numel] = vals[: seg.numel]
        return out.view(p.shape)

    def grads(self) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """(name, parameter, fp32 gradient) one parameter at a time, in bucket order."""
        for pi in self.bucket_order():
            yield self.names[pi], self.params[pi], self.grad(pi)

    def bucket_order(self) -> list[int]:
        """Parameter indices grouped by the bucket that holds their last segment."""
        return [pi for b in self.buckets for pi in self._params_ending_in(b.index)]

    def _params_ending_in(self, b: int) -> list[int]:
        return [s.param for s in self.buckets[b].segments if self.segments[s.param][-1].bucket == b]

    def grad_norm(self) -> float:
        """L2 norm of the stored gradients (padding holds zeros), accumulated in fp64.

        Compiled CPU code reads each bucket in one pass; elsewhere a piece of a bucket is
        dequantized at a time, so that the fp32 temporaries stay a few hundred KiB.
        """
        self._check_readable()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        one_pass = getattr(backend.kernels(self.device, self.fmt), "sum_of_squares", None)
        for b in self.buckets:
            values = b.values
            if one_pass is not None:
                total += one_pass(values)
                continue
            for start in range(0, values.numel, self._piece):
                total += sum_of_squares(dequantize(values.blocks(start, self._piece)))
        return float(total.sqrt())

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float = 1.0) -> None:
        """Run ``optimizer`` bucket by bucket, each parameter's .grad set only while its bucket steps.

        torch optimizers skip parameters whose .grad is None, so every parameter is stepped exactly
        once; ``grad_scale`` multiplies the gradients (e.g. a clipping coefficient).
        """
        if not self._finished:
            self.finish()
        if not self._ok:
            return
        for b in self.buckets:
            group = self._params_ending_in(b.index)
            if not group:
                continue
            for pi in group:
                g = self.grad(pi)
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                self.params[pi].grad = g.to(self.params[pi].dtype)
            optimizer.step()
            for pi in group:
                self.params[pi].grad = None

    def local_shards(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """reduce_scatter mode: (bucket, start, end, fp32 values) of this rank's shard of each bucket.

        ``start``/``end`` are offsets in the bucket's flat layout (see :attr:`segments`); the
        shard is [rank * chunk, (rank + 1) * chunk) of the bucket.
        """
        if self.collective != "reduce_scatter":
            raise RuntimeError("local_shards() needs QuantGradBuffer(collective='reduce_scatter')")
        if not self._finished:
            raise RuntimeError("call finish() before local_shards()")
        out = []
        for b in self.buckets:
            start, end = b.layout.shard_range(self.rank)
            shard = b.shard
            if shard is None:
                # One rank, or a skipped step: the local values are the whole reduction.
                shard = dequantize(b.values.blocks(start, end - start))[: end - start]
            out.append((b.index, start, end, shard))
        return out


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``t`` as an fp64 scalar, accumulated in fp64 without an fp64 copy of ``t``."""
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, without a tensor-sized mask or copy.

    Squares of fp32/bf16/fp16 values stay below 1.2e77, so their fp64 sum is finite for any count
    unless an element is NaN or Inf.
    """
    return bool(torch.isfinite(sum_of_squares(t)))


def plan_buckets(numels: list[int], block: int, bucket_numel: int, world: int) -> list[tuple[int, list[Segment]]]:
    """(padded flat size, segments) of each gradient bucket: the one layout rule of every 8-bit or sharded buffer.

    Parameters go in reverse order (the order backward produces them), each starting on a block
    boundary; a parameter larger than what is left of a bucket continues in the next; a bucket is
    padded to world x whole blocks (the layout of the 8-bit collectives).
    """
    cap = round_up(bucket_numel, block)
    per_bucket: list[list[Segment]] = [[]]
    fill = 0
    for pi in reversed(range(len(numels))):
        remaining, poff = numels[pi], 0
        while remaining > 0:
            if fill >= cap:
                per_bucket.append([])
                fill = 0
            take = min(remaining, cap - fill)
            per_bucket[-1].append(Segment(pi, len(per_bucket) - 1, fill, poff, take))
            fill += round_up(take, block)
            remaining -= take
            poff += take
    out = []
    for segs in per_bucket:
        used = max((s.offset + round_up(s.numel, block) for s in segs), default=block)
        out.append((round_up(used, world * block), segs))
    return out


def _named(
    params: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
) -> tuple[list[str], list[torch.nn.Parameter]]:
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
