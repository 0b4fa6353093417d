"""Folding gradients in as autograd produces them: the hook every gradient path registers, and the 8-bit fold.

:func:`fold_on_accumulate` hands each parameter's full-precision gradient to a fold the moment
autograd has accumulated it and drops ``p.grad``, so the model's own .grad never accumulates across
micro-batches (the 8-bit buffer, the fp32 main-grad buffer and ZeRO-1's fp32 buckets all use it).

:class:`EightBitFolder` adds a gradient into bucket storage: the first micro-batch of a step only
quantizes; later ones dequantize, add in fp32 and re-quantize (never an 8-bit add). After k folds
the error against fp32 accumulation is at most sum_j s_j / 2 per element (s_j: the block's scale
after fold j). A block that turns non-finite gets scale 0 (it stays off the wire) and is
remembered without a host sync per fold, for the step's non-finite agreement.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from agoq.quant import backend, dequantize, quantize
from agoq.quant.formats import round_up

from agoq.gradient.bucket import Bucket, StorageSpans
from agoq.gradient.layout import GradLayout

# Values per compiled fold call. The compiled fold is one fused loop with no per-value fp32
# temporaries (its outputs are the new payload and per-block scales and extrema, about 1.1 bytes a
# value at 8 bits), so its pieces can be 8x larger within the same bound; each call also has a
# fixed dispatch cost, which 64K-value pieces paid 16 times for a 1M-value embedding.
COMPILED_FOLD_PIECE = 1 << 19


def fold_on_accumulate(
    params: Sequence[torch.Tensor], fold: Callable[[int, torch.Tensor], None], then: Callable[[], None] | None = None
) -> list[RemovableHandle]:
    """Hook every parameter so that its accumulated gradient goes to ``fold(index, grad)`` and ``p.grad`` is dropped.

    ``then()`` runs after each fold, once the full-precision gradient is gone.
    """

    def hook_for(index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            grad, p.grad = p.grad, None
            if grad is None:
                return
            fold(index, grad)
            # Gone before ``then`` sends a bucket it completed, so the bucket's messages never
            # coexist with it (the largest gradient, the embedding's, comes last).
            del grad
            if then is not None:
                then()

        return hook

    return [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]


class EightBitFolder:
    """Adds full-precision gradients into the 8-bit storage of ``buckets``, a piece at a time."""

    def __init__(self, layout: GradLayout, buckets: list[Bucket], device: torch.device) -> None:
        self.layout = layout
        self.fmt = layout.fmt
        self.buckets = buckets
        self.device = device
        self.spans = StorageSpans(layout, buckets, device)
        self._region_cache: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        self.peak_fp_grad_bytes = 0
        # Per parameter, whether a block of it went non-finite this step; kept in place (the Triton
        # fold writes it from the kernel) and emptied at reset.
        self._bad_mask = torch.zeros(len(self.layout.segments), dtype=torch.bool, device=self.device)
        self._countdown = torch.arange(len(self.layout.segments), 0, -1, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Forget the non-finite marks of the last step."""
        self._bad_mask.zero_()
        self._bad_flags: list[tuple[int, torch.Tensor]] = []  # (parameter, "a block went non-finite") per compiled fold

    def fold(self, pi: int, grad: torch.Tensor, first: bool) -> None:
        """Add ``grad`` into parameter ``pi``'s segments; ``first``: the step's first fold, which only quantizes."""
        flat = grad.detach().reshape(-1)
        kernels = backend.kernels(self.device, self.fmt)
        fold_ = getattr(kernels, "fold_", None)
        fold_spans_ = getattr(kernels, "accumulate_spans_", None)
        if fold_spans_ is not None:
            # Triton: every segment of the parameter in one launch, which zeroes a non-finite
            # block's scale and marks the parameter itself (no fp32 temporaries).
            fold_spans_(self.spans.storage, self.spans.of_param(pi), flat, self._bad_mask.view(torch.uint8)[pi : pi + 1], first=first)
            scratch = 0
        elif fold_ is not None:
            # Compiled path: one call per piece into precomputed region views; the call zeroes a
            # non-finite block's scale itself and hands back a flag, collected for first_nonfinite().
            for start, end, pay, sc in self._regions(pi):
                self._bad_flags.append((pi, fold_(pay, sc, flat[start:end], self.fmt, first=first)))
            scratch = self._compiled_fold_bytes(min(flat.numel(), COMPILED_FOLD_PIECE))
        else:
            piece = self.layout.piece(self.device)
            scratch = 0
            for seg in self.layout.segments[pi]:
                bucket = self.buckets[seg.bucket]
                # Piece by piece (whole blocks, so the result is the same): quantize's fp32 temporaries
                # stay a fixed size however large the parameter is.
                for a, p0, p1 in bucket.spans(seg, piece):
                    scratch = max(scratch, self._fold_piece(pi, bucket, a, flat[p0:p1], first))
        self.peak_fp_grad_bytes = max(self.peak_fp_grad_bytes, flat.numel() * flat.element_size() + scratch)

    def first_nonfinite(self) -> torch.Tensor:
        """1 + the first parameter that held a non-finite gradient this step, or 0 if none: an
        int64 scalar on the device, left for the step's agreement to read (agree_nonfinite)."""
        if self._bad_flags:  # one scatter for the whole step instead of one per fold
            owners = torch.tensor([pi for pi, _ in self._bad_flags], device=self.device)
            self._bad_mask.index_put_((owners,), torch.stack([f for _, f in self._bad_flags]).reshape(-1), accumulate=True)
            self._bad_flags = []
        # countdown[i] = n - i: the largest marked countdown is the first marked parameter's.
        n = self._countdown.numel()
        last = (self._bad_mask * self._countdown).amax() if n else torch.zeros((), dtype=torch.int64, device=self.device)
        return torch.where(last > 0, n + 1 - last, 0)

    def _compiled_fold_bytes(self, n: int) -> int:
        """Temporaries of one compiled fold of ``n`` values: the new payload, then per block its scale, max and min (fp32)."""
        return self.fmt.payload_bytes(round_up(n, self.fmt.block_size)) + 3 * 4 * self.fmt.num_blocks(n)

    def _regions(self, pi: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(start, end in the flat gradient, payload view, scales view) of each fold piece of a parameter, built once.

        The bucket tensors are allocated once and only ever written in place, so the views stay valid.
        """
        cached = self._region_cache.get(pi)
        if cached is None:
            cached = []
            block, piece = self.fmt.block_size, self.layout.whole_blocks(COMPILED_FOLD_PIECE)
            for seg in self.layout.segments[pi]:
                bucket = self.buckets[seg.bucket]
                for a, p0, p1 in bucket.spans(seg, piece):
                    region = bucket.blocks(a, round_up(p1 - p0, block))
                    cached.append((p0, p1, region.payload, region.scales))
            self._region_cache[pi] = cached
        return cached

    def _fold_piece(self, pi: int, bucket: Bucket, offset: int, g: torch.Tensor, first: bool) -> int:
        """Fold k gradient values into the bucket region that starts at ``offset`` (a block boundary); returns its fp32 scratch bytes."""
        block, k = self.fmt.block_size, g.numel()
        n = round_up(k, block)
        region = bucket.blocks(offset, n)
        pay, sc = region.payload, region.scales
        if first and k == n:
            x = g
        elif first:
            # The padding of a parameter's last block must hold the code of zero.
            x = torch.zeros(n, dtype=torch.float32, device=self.device)
            x[:k] = g
        else:
            x = dequantize(region)
            x[:k] += g
        q = quantize(x, self.fmt, nonfinite="propagate")
        # A NaN scale marks a block that held NaN/Inf. Keep it off the wire (the step's agreement
        # makes every rank skip it) and remember the parameter, without a host sync per fold.
        bad = torch.isnan(q.scales)
        q.scales.masked_fill_(bad, 0.0)
        self._bad_mask[pi] |= bad.any()
        pay.copy_(q.payload)
        sc.copy_(q.scales)
        return 4 * n if x is not g else 0
