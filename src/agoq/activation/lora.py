"""LoRA adapters inside the fused ops: y = x W^T + s * dropout(x) A^T B^T, with nothing extra saved
but a dropout mask packed at 1 bit per element.

The fused ops (:mod:`agoq.activation.ops`) never keep the GEMM input x: they recompute it (norm +
linear, SwiGLU + linear) or keep it at 4 bits (saved-input linear). An adapter on such a GEMM reads
the same x, so its backward reads the recomputed or dequantized x too; A x ([tokens, r]) is
recomputed as well. The dropout mask is drawn as ``nn.Dropout`` draws it on a CPU (``bernoulli_(1 -
p)`` over the input's shape, one draw per element whatever the dtype, then 1 / (1 - p) rounded to
the input's dtype where kept), so the same RNG state gives PEFT's mask bit for bit, and the
adapter's output equals PEFT's.

The mask is drawn as bytes (0 or 1) and packed 8 to a byte along each row ([tokens, ceil(width /
8)] bytes), so any span of rows is whole bytes. Applying it is one formula (:func:`_masked`), run
through :func:`agoq.quant.backend.formula`: under the compiled backend the forward's product and
packing are one pass over x, and each backward use unpacks the bits inside the product's own loop.

A base weight may be a bitsandbytes 4-bit parameter (QLoRA): :func:`dense_weight` dequantizes it
for one GEMM, in forward and again in backward; the dense copy is never saved.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agoq.quant import backend


@dataclass(frozen=True)
class LoraAdapter:
    """One low-rank update ``scale * dropout(x) A^T B^T`` on a projection (PEFT's LoRA ``Linear``)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float
    dropout: float = 0.0


def dense_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in dtype; a bitsandbytes 4-bit weight (a ``quant_state`` attached) dequantized first."""
    state = getattr(w, "quant_state", None)
    if state is None:
        return w if w.dtype == dtype else w.to(dtype)
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(w, state).to(dtype)


def out_features(w: torch.Tensor) -> int:
    """Rows of the weight as a GEMM sees it (a 4-bit weight's packed shape is not its own)."""
    state = getattr(w, "quant_state", None)
    return int(state.shape[0]) if state is not None else int(w.shape[0])


# ---- the packed mask -------------------------------------------------------------------------------


def mask_bytes(tokens: int, width: int) -> int:
    """Bytes of the packed dropout mask of a [tokens, width] input."""
    return tokens * _row_bytes(width)


def _in_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, width] as [rows * ceil(width / 8), 8]: each row's bytes' worth of elements, zero-padded
    where width is not a multiple of 8 (a copy then, else a view)."""
    rows, width = t.shape
    if width % 8:
        t = F.pad(t, (0, -width % 8))
    return t.reshape(-1, 8)


def _from_bytes(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """:func:`_in_bytes` undone: [rows * ceil(width / 8), 8] as [rows, width]."""
    return t.view(rows, _row_bytes(width) * 8)[:, :width]


def _row_bytes(width: int) -> int:
    """Bytes of one packed row of ``width`` mask bits (sizes are spelled out: a view cannot infer one of 0 elements)."""
    return -(-width // 8)


# The formulas below see [n, 8] tensors: n is the only size that varies, and 8 a constant, so
# compiled code indexes by n * 8 + bit (with the width a size too, inductor divided by it).


def _pack(keep: torch.Tensor) -> torch.Tensor:
    """[n, 8] zeros and ones as n bytes, element k in bit k (eight ORs: one loop over the bytes)."""
    keep = keep.to(torch.uint8)
    packed = keep[:, 0]
    for k in range(1, 8):
        packed = packed | (keep[:, k] << k)
    return packed


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """n bytes as [n, 8] int32 zeros and ones, bit k in column k."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1).to(torch.int32) >> shifts) & 1


def pack_rows(keep: torch.Tensor) -> torch.Tensor:
    """A [rows, width] tensor of zeros and ones (bool or uint8) as [rows, ceil(width / 8)] bytes:
    element (i, j) is bit j % 8 of byte (i, j // 8), so any span of rows is whole bytes."""
    return _pack(_in_bytes(keep)).view(keep.shape[0], _row_bytes(keep.shape[1]))


def unpack_rows(packed: torch.Tensor, width: int) -> torch.Tensor:
    """The [rows, width] bools that :func:`pack_rows` packed into ``packed`` ([rows, ceil(width / 8)])."""
    return _from_bytes(_bits(packed.reshape(-1)), packed.shape[0], width) != 0


def _masked(values: torch.Tensor, keep: torch.Tensor, *, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """values * (scale where ``keep`` is 1, else 0) in dtype: dropout's product. ``scale`` is 1 / (1 - p)
    already rounded to the dtype dropout multiplies in, so the fp32 product rounded once is
    dropout's own (a bf16 or fp16 product is computed in fp32 and rounded too)."""
    return (values.float() * (keep.float() * scale)).to(dtype)


def _dropout_graph(x: torch.Tensor, keep: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Forward, on [n, 8]: dropout(x) and the packed mask, reading x and the mask once.
    return _masked(x, keep, scale=scale, dtype=x.dtype), _pack(keep)


def _undrop_graph(values: torch.Tensor, packed: torch.Tensor, *, scale: float, dtype: torch.dtype) -> torch.Tensor:
    # Backward, on [n, 8] and n bytes: values times the multiplier the forward used.
    return _masked(values, _bits(packed), scale=scale, dtype=dtype)


def _undrop_pair_graph(
    grad: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, *, scale: float, dtype: torch.dtype, x_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # Backward of one chunk of rows: the input gradient and the input itself masked, the bits read once.
    bits = _bits(packed)
    return _masked(grad, bits, scale=scale, dtype=dtype), _masked(x, bits, scale=scale, dtype=x_dtype)


@functools.lru_cache(maxsize=None)
def dropout_multiplier(p: float, dtype: torch.dtype) -> float:
    """1 / (1 - p) as dropout makes it: ``noise.div_(1 - p)`` on ones of ``dtype``."""
    return float(torch.ones(8, dtype=dtype).div_(1 - p)[0])


def _formula(fn, device: torch.device, **constants):  # noqa: ANN001, ANN202 - agoq.quant.backend.formula's types
    # A backward traced by torch.compile (AOTAutograd) calls the eager formula: the trace fuses it.
    if torch.compiler.is_compiling():
        return lambda *args: fn(*args, **constants)
    return backend.formula(fn, device, **constants)


# ---- forward and backward ----------------------------------------------------------------------------


def lora_forward(x: torch.Tensor, out: torch.Tensor, adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """(out plus the adapter's output ``B(A(dropout(x))) * scale``, the packed dropout mask or an empty one).

    ``out`` (x's rows times the base weight) is this op's own tensor: it is added into in place
    where the dtypes allow. The sum is made in the adapter's dtype and rounded once to out's, as
    PEFT adds an fp32 adapter's output to a bf16 base output.
    """
    xa = _tokens(x if x.dtype == adapter.a.dtype else x.to(adapter.a.dtype))
    packed = x.new_empty(0, dtype=torch.uint8)
    if adapter.dropout > 0:
        # What F.dropout does on a CPU (and nn.Dropout in PEFT): bernoulli(1 - p) over x's shape,
        # one draw per element whatever the dtype (drawn as bytes: the same draws, a quarter of
        # the memory of fp32 noise, and read by compiled code as plain bytes), then times
        # 1 / (1 - p) in x's dtype.
        keep = torch.empty(xa.shape, dtype=torch.uint8, device=x.device).bernoulli_(1 - adapter.dropout)
        fn = _formula(_dropout_graph, x.device, scale=dropout_multiplier(adapter.dropout, xa.dtype))
        dropped, packed = fn(_in_bytes(xa), _in_bytes(keep))
        xa = _from_bytes(dropped, *xa.shape)
        del keep, dropped
    ax = F.linear(xa, adapter.a)
    rows = _tokens(out)
    if rows.dtype == adapter.b.dtype:
        rows.addmm_(ax, adapter.b.t(), alpha=adapter.scale)
        return out, packed
    summed = torch.addmm(rows.to(adapter.b.dtype), ax, adapter.b.t(), alpha=adapter.scale)
    return summed.to(out.dtype).view(out.shape), packed


def lora_grad_a_input(grad_out: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
    """The gradient of ``A dropout(x)``, [tokens, r]: ``scale * grad_out B`` (scaled at r columns, not at out)."""
    g = _tokens(grad_out)
    return g.to(adapter.b.dtype).mm(adapter.b).mul_(adapter.scale)


def lora_backward_rows(
    adapter: LoraAdapter,
    packed: torch.Tensor,
    grad_a_input: torch.Tensor,
    r0: int,
    grad: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    need_a: bool = False,
    need_b: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The adapter's backward over rows r0 .. of its input, from ``grad_a_input`` (all rows).

    With ``grad`` ([rows, width]): adds the gradient the adapter sends to those rows, in place.
    With ``x`` (the rows as forward saw them, recomputed or dequantized): returns (these rows'
    share of A's gradient or None, these rows of ``scale * A dropout(x)`` or None, for B's
    gradient: :func:`lora_b_grad`). Where both come, one pass applies the dropout mask to both.
    """
    rows = (grad if grad is not None else x).shape[0]
    ga = grad_a_input[r0 : r0 + rows]
    need_x = x is not None and (need_a or need_b)
    xd = None
    if adapter.dropout > 0:
        wb = _row_bytes((grad if grad is not None else x).shape[1])
        mine = packed.view(packed.numel() // wb, wb)[r0 : r0 + rows].reshape(-1)
        scale = dropout_multiplier(adapter.dropout, adapter.a.dtype)
        if grad is not None:
            g = ga.mm(adapter.a)
            g_dtype = torch.promote_types(g.dtype, grad.dtype)
            if need_x:
                fn = _formula(_undrop_pair_graph, grad.device, scale=scale, dtype=g_dtype, x_dtype=adapter.a.dtype)
                g_bytes, x_bytes = fn(_in_bytes(g), _in_bytes(x), mine)
                xd = _from_bytes(x_bytes, *x.shape)
            else:
                g_bytes = _formula(_undrop_graph, grad.device, scale=scale, dtype=g_dtype)(_in_bytes(g), mine)
            grad.add_(_from_bytes(g_bytes, *grad.shape))
        elif need_x:
            xd = _from_bytes(_formula(_undrop_graph, x.device, scale=scale, dtype=adapter.a.dtype)(_in_bytes(x), mine), *x.shape)
    else:
        if grad is not None:
            if grad.dtype == adapter.a.dtype:
                grad.addmm_(ga, adapter.a)
            else:
                grad.add_(ga.mm(adapter.a))
        if need_x:
            xd = x if x.dtype == adapter.a.dtype else x.to(adapter.a.dtype)
    if xd is None:
        return None, None
    grad_a = ga.t().mm(xd) if need_a else None
    ax = F.linear(xd, adapter.a).mul_(adapter.scale) if need_b else None
    return grad_a, ax


def lora_b_grad(grad_out: torch.Tensor, scaled_ax: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
    """B's gradient ``grad_out^T (scale * A dropout(x))`` from every row's ``scale * A dropout(x)``."""
    return _tokens(grad_out).to(adapter.b.dtype).t().mm(scaled_ax)


class ChunkedLoraBackward:
    """The backward of adapters that share one input, a chunk of rows at a time (the fused norm's
    backward recomputes its output so). For each chunk, :meth:`add_rows` adds every adapter's
    share of the input gradient and takes its gradients from the rows: one pass applies its
    dropout mask to both. A's gradient sums in fp32 over chunks; ``scale * A dropout(x)`` is
    [tokens, r], kept for B's gradient in :meth:`grads`."""

    def __init__(self, adapters: list[tuple[torch.Tensor, LoraAdapter, torch.Tensor, bool, bool]]) -> None:
        # (the gradient of the adapter's projection, [tokens, out]; adapter; packed mask; need A; need B)
        self.adapters = adapters
        self.a_inputs = [lora_grad_a_input(g, ad) for g, ad, *_ in adapters]  # [tokens, r] each: small, whole
        self.grad_a: list[torch.Tensor | None] = [None] * len(adapters)
        self.ax_rows: list[list[torch.Tensor]] = [[] for _ in adapters]

    def add_rows(self, grad: torch.Tensor, x: torch.Tensor, r0: int) -> None:
        """Rows r0 .. of the input (x as forward saw it) and of its gradient (added into in place)."""
        for i, ((_, ad, mask, need_a, need_b), ga_in) in enumerate(zip(self.adapters, self.a_inputs)):
            part_a, ax = lora_backward_rows(ad, mask, ga_in, r0, grad=grad, x=x, need_a=need_a, need_b=need_b)
            if part_a is not None:
                self.grad_a[i] = part_a.float() if self.grad_a[i] is None else self.grad_a[i].add_(part_a)
            if ax is not None:
                self.ax_rows[i].append(ax)

    def grads(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """(grad of A, grad of B) of each adapter, None where not needed, once every row was added."""
        out = []
        for (g, ad, *_), grad_a, axs in zip(self.adapters, self.grad_a, self.ax_rows):
            ax = (torch.cat(axs) if len(axs) > 1 else axs[0]) if axs else None
            out.append((None if grad_a is None else grad_a.to(ad.a.dtype), None if ax is None else lora_b_grad(g, ax, ad)))
        return out


def lora_weight_grads(
    grad_out: torch.Tensor, grad_a_input: torch.Tensor, x: torch.Tensor, adapter: LoraAdapter, packed: torch.Tensor, need_a: bool, need_b: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad of A, grad of B) or None where not needed, from all of x as forward saw it (recomputed or dequantized)."""
    grad_a, ax = lora_backward_rows(adapter, packed, grad_a_input, 0, x=_tokens(x), need_a=need_a, need_b=need_b)
    return grad_a, None if ax is None else lora_b_grad(grad_out, ax, adapter)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])
