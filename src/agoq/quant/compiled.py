"""Compiled CPU kernels for agoq.quant: the reference's own formulas under torch.compile.

The same API as :mod:`agoq.quant.triton` (quantize, dequantize, accumulate_, reduce_rows, ...),
chosen through :mod:`agoq.quant.backend`. Each graph below is a small function that calls the
formulas of :mod:`agoq.quant.qtensor` (``block_codes``, ``code_values``, ``block_scales``) on whole
blocks, compiled by plain ``torch.compile(fn)``: inductor fuses the reference's passes into a few
loops, and the arithmetic is the reference's, op for op, so codes and scales are its bits
(tests/test_compiled.py checks them). Quantize and dequantize pack and unpack sub-byte codes in
their graphs (``pack_groups``, ``unpack_groups``: the reference's layout by arithmetic on each
group), so no tensor of one-byte codes is written or read between them and their payload; the
gradient folds and reductions, 8-bit in practice, pack on the reference's SWAR path outside.

Every graph takes its tensors in the blocks' own shape, [blocks, block] (a view made outside it),
with the block count symbolic from the first call (:func:`_blocks`): one graph of a format serves
every size, where torch.compile's default built one for the first size and a second, symbolic one
when another size came. A symbolic count of values instead, viewed as blocks inside the graph,
reached inductor as a floor division that split the encoding from the rounding into two loops
with an fp32 buffer between them: a pass over memory more than eager torch makes. A format's
integers (block size, bits) stay constants: with them symbolic (``dynamic=True``) inductor indexed
every value through a division by the block size and left the encoding loop scalar. Codes are
made from fp32 values by one conversion (no int8 dtype view). A graph that inductor cannot build
(e.g. no working C++ compiler) runs eagerly from then on, with one warning: the same formulas,
the same results.
"""

from __future__ import annotations

import functools
import itertools
import types
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from agoq.compat import leave_dim_dynamic
from agoq.quant.formats import CodebookTables, QuantFormat, codebook_tables
from agoq.quant.packing import pack_groups, pack_into, packing_group, unpack_groups, unpack_into
from agoq.quant.qtensor import (
    QTensor,
    block_codes,
    code_values,
    dequantize_each_row,
    dequantize_padded_rows,
    quantize_each_row_into,
    stored_values,
    unpadded_rows,
)
from agoq.quant.qtensor import quantize as reference_quantize


class _Graph:
    """``fn`` under torch.compile, called with grad mode off (the formulas compute no gradients);
    eager from the first call whose compile fails, with one warning."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__  # the formula's own name, for messages (fn may be a renamed copy)
        self.compiled = torch.compile(fn)
        self.eager = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            if self.eager:
                return self.fn(*args, **kwargs)
            try:
                return self.compiled(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - told apart below: the formula's own errors recur eagerly
                failure = error
            result = self.fn(*args, **kwargs)  # an error of the formula itself is raised here, from eager code
            self.eager = True
            first_line = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
            warnings.warn(
                f"agoq: torch.compile could not build {self.name} ({first_line[:200]}); it runs on the eager "
                "torch path (same results, slower); set AGOQ_QUANT_BACKEND=torch to skip compiling",
                RuntimeWarning,
                stacklevel=3,
            )
            return result


@functools.lru_cache(maxsize=None)
def _graph(fn: Callable[..., Any], *key: Any) -> _Graph:
    """``fn`` compiled for one ``key`` (its format and other non-tensor arguments), on a code
    object of its own.

    Dynamo keeps a function's graphs per code object and makes an integer symbolic once it has
    seen two values of it: a graph that met a second format would index every value through a
    symbolic block size, the slow code described above, for every format after. Each key
    compiles its own copy of the code (``CodeType.replace()`` copies it; nothing is generated),
    where the format never changes.
    """
    name = fn.__name__
    if key:
        # A name of its own too: Dynamo's record of which sizes turned out dynamic is keyed by
        # file, line and name, so a copy under the same name would inherit the symbolic sizes.
        numbered = f"{name}_{next(_copy_numbers)}"
        copy = types.FunctionType(fn.__code__.replace(co_name=numbered), fn.__globals__, numbered, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        fn = copy
    return _Graph(fn, name)


_copy_numbers = itertools.count()  # each code copy's name gets the next number


def compiled(fn: Callable[..., Any], **constants: Any) -> Callable[..., Any]:
    """``fn`` with keyword ``constants`` fixed, torch.compile'd once per set of constants and reused."""
    return functools.partial(_graph(fn, *sorted(constants.items())), **constants)


def supports(fmt: QuantFormat) -> bool:
    """Whether the compiled path covers ``fmt``: blocks of whole packing groups (every format with block % 8 == 0)."""
    return fmt.block_size % packing_group(fmt.bits)[0] == 0


# ---- the graphs: each one calls the reference's formulas --------------------------------------------


def _block_values(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None) -> torch.Tensor:
    """fp32 values of codes [..., blocks, block] with scales [..., blocks]: the reference's product."""
    return code_values(codes, fmt, tables) * scales.unsqueeze(-1)


def _quantize_graph(x: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # ``packed``: the codes packed in the graph, [blocks, payload bytes of a block] (whole blocks only:
    # a last block's padding gets code 0 outside the graph, before packing).
    codes, scales = block_codes(x.to(torch.float32, copy=True), fmt, tables, propagate=True)
    return (pack_groups(codes, fmt.bits) if packed else codes), scales


def _dequantize_graph(payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None) -> None:
    # Multiplied in fp32 and rounded once into out's dtype, as the reference does.
    out.copy_(_block_values(unpack_groups(payload, fmt.bits), scales, fmt, tables))


def _fold_graph(
    codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None, first: bool, zero_bad: bool
) -> tuple[torch.Tensor, ...]:
    # quantize(grad if first else dequantize(region) + grad); a non-finite block gets a NaN scale
    # (or 0 with ``zero_bad``, the gradient buffer's rule) and unspecified codes.
    x = grad.to(torch.float32, copy=True)
    if not first:
        x = _block_values(codes, scales, fmt, tables) + x
    new_codes, new_scales = block_codes(x, fmt, tables)
    bad = ~torch.isfinite(new_scales)
    if zero_bad:
        return new_codes, torch.where(bad, 0.0, new_scales), bad.any()
    return new_codes, torch.where(bad, torch.nan, new_scales)


def _reduce_graph(
    codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None, average: bool, keep_sum: bool, requantize: bool
) -> tuple[torch.Tensor, ...]:
    # The fp32 sum of the rows in row order (then / rows), as the reference adds dequantized rows.
    rows = codes.shape[0]
    acc = _block_values(codes[0], scales[0], fmt, tables)
    for i in range(1, rows):
        acc = acc + _block_values(codes[i], scales[i], fmt, tables)
    if average:
        acc = acc / rows
    out: tuple[torch.Tensor, ...] = (acc,) if keep_sum else ()  # flattened outside the graph
    if requantize:
        out += block_codes(acc.view(-1, fmt.block_size).clone(), fmt, tables, propagate=True)
    return out


def _sum_of_squares_graph(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None) -> torch.Tensor:
    return _block_values(codes, scales, fmt, tables).double().square().sum()


def _swiglu_graph(
    gate: torch.Tensor, up: torch.Tensor, fmt: QuantFormat, tables: CodebookTables | None, act_dtype: torch.dtype, packed: bool
) -> tuple[torch.Tensor, ...]:
    # The product is computed in fp32 and rounded once (eagerly SiLU is rounded to the dtype first).
    g = gate.to(torch.float32, copy=True)
    u = up.to(torch.float32, copy=True)
    act = (F.silu(g) * u).to(act_dtype)  # in the blocks' shape, flattened outside the graph
    (g_codes, g_scales), (u_codes, u_scales) = block_codes(g, fmt, tables, propagate=True), block_codes(u, fmt, tables, propagate=True)
    if packed:  # as in _quantize_graph
        g_codes, u_codes = pack_groups(g_codes, fmt.bits), pack_groups(u_codes, fmt.bits)
    return act, g_codes, g_scales, u_codes, u_scales


def _reading_codes_graph(fn: Callable[..., Any], items: tuple[Any, ...], fmt: QuantFormat, tables: CodebookTables | None, **constants: Any) -> Any:
    # ``items``: fn's arguments, a quantized one as its (payload, scales) pair, the payload [blocks, bytes].
    args = [_block_values(unpack_groups(item[0], fmt.bits), item[1], fmt, tables) if isinstance(item, tuple) else item for item in items]
    return fn(*args, **constants)


# ---- the API of a kernel module -------------------------------------------------------------------------


def _tables(fmt: QuantFormat, device: torch.device) -> CodebookTables | None:
    return None if fmt.kind == "int" else codebook_tables(fmt.kind, device)


def _codes(payload: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """One uint8 code per value of a payload of whole packing groups (8-bit payloads are their codes)."""
    if fmt.bits == 8:
        return payload
    g, gbytes = packing_group(fmt.bits)
    codes = torch.empty(payload.numel() // gbytes * g, dtype=torch.uint8, device=payload.device)
    unpack_into(payload.contiguous(), fmt.bits, codes)
    return codes


def _packed(codes: torch.Tensor, fmt: QuantFormat, out: torch.Tensor | None = None) -> torch.Tensor:
    """The payload of one-byte codes of whole packing groups (written into ``out`` when given)."""
    codes = codes.reshape(-1)  # graphs return codes in their blocks' shape
    if out is None:
        if fmt.bits == 8:
            return codes
        out = torch.empty(fmt.payload_bytes(codes.numel()), dtype=torch.uint8, device=codes.device)
    pack_into(codes, fmt.bits, out)
    return out


def _symbolic(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """A view of ``t`` for a graph, its block count (dimension ``dim``) symbolic from the first graph
    on (see the module's docstring). The mark goes on a view of its own, so that no caller's tensor
    carries it into the caller's own compiles."""
    return leave_dim_dynamic(t.view(t.shape), dim)


def _blocks(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` (whole blocks) as [blocks, width] for a graph: width values, or payload bytes, of a
    block in a row; the block count symbolic, marked on this new view (:func:`_symbolic`)."""
    return leave_dim_dynamic(flat.view(-1, width), 0)


def _padded_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks (a copy only when it is not already), as :func:`_blocks`."""
    pad = -flat.numel() % block
    return _blocks(F.pad(flat, (0, pad)) if pad else flat, block)


def _block_payload(payload: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """A payload of whole blocks as [blocks, bytes of a block]: what the graphs unpack."""
    return _blocks(payload, fmt.payload_bytes(fmt.block_size))


def _packed_in_graph(stored: torch.Tensor, fmt: QuantFormat) -> bool:
    """Whether a graph packs the codes of ``stored`` values itself: when they fill whole blocks, of a
    format whose codes fill whole bytes (1, 2, 4 or 8 bits). A group spanning bytes (3, 5, 6, 7 bits)
    packs through one integer word per group, a loop inductor leaves scalar: those stay on the
    vectorized SWAR path."""
    return stored.numel() % fmt.block_size == 0 and packing_group(fmt.bits)[1] == 1


def _qtensor(x: torch.Tensor, stored: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> QTensor:
    """The QTensor of ``x`` from the codes (their payload where :func:`_packed_in_graph`) and scales of
    its ``stored`` values (:func:`stored_values`) in whole blocks (``block_codes(..., propagate=True)``'s:
    the reference's bits, NaN/Inf blocks too)."""
    if _packed_in_graph(stored, fmt):
        return QTensor(codes.view(-1), scales, x.shape, x.dtype, fmt)
    n = stored.numel()
    codes = codes.view(-1)
    if codes.numel() != n:
        codes[n:] = 0  # the reference stores code 0 for the padding of the last block
    payload = _packed(codes, fmt)
    nbytes = fmt.payload_bytes(n)
    if payload.numel() != nbytes:
        payload = payload[:nbytes].clone()  # exactly the bytes the reference stores, no more
    return QTensor(payload, scales, x.shape, x.dtype, fmt)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> QTensor:
    """Block-wise nearest quantization of ``x`` (NaN scale for blocks holding NaN/Inf)."""
    if x.numel() == 0:
        return reference_quantize(x, fmt, nonfinite="propagate")
    stored = stored_values(x, fmt)
    packed = _packed_in_graph(stored, fmt)
    codes, scales = _graph(_quantize_graph, fmt, packed)(_padded_blocks(stored, fmt.block_size), fmt, _tables(fmt, x.device), packed)
    return _qtensor(x, stored, codes, scales, fmt)


def quantize_rows_into(x: torch.Tensor, payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat) -> None:
    """Quantizes ``x`` ([rows, n] values, n whole blocks, contiguous) into ``payload_rows`` ([rows,
    bytes]) and ``scale_rows`` ([rows, n / block]), any row stride (e.g. the rows of a collective's
    wire buffer); a block holding NaN/Inf gets a NaN scale and unspecified codes."""
    quantize_each_row_into(x, payload_rows, scale_rows, fmt, quantize)


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, QTensor, QTensor]:
    """(SiLU(gate) * up in the inputs' dtype, gate quantized, up quantized), reading each once: the
    fused forward of agoq.activation.ops' SwiGLU + GEMM, as agoq.quant.triton's. The codes and
    scales are :func:`quantize`'s; the product is the fp32 one rounded once to the dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if not gate.numel():
        return torch.empty_like(gate), quantize(gate, fmt), quantize(up, fmt)
    stored_gate, stored_up = stored_values(gate, fmt), stored_values(up, fmt)
    packed = _packed_in_graph(stored_gate, fmt)
    act, gate_codes, gate_scales, up_codes, up_scales = _graph(_swiglu_graph, fmt, gate.dtype, packed)(
        _padded_blocks(stored_gate, fmt.block_size),
        _padded_blocks(stored_up, fmt.block_size),
        fmt,
        _tables(fmt, gate.device),
        act_dtype=gate.dtype,
        packed=packed,
    )
    return (
        unpadded_rows(act.view(-1)[: stored_gate.numel()], gate.shape, fmt),
        _qtensor(gate, stored_gate, gate_codes, gate_scales, fmt),
        _qtensor(up, stored_up, up_codes, up_scales, fmt),
    )


def dequantize(q: QTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``q`` represents, in its shape and dtype (or ``dtype``); written into ``out`` when given."""
    if q.padded_rows:
        return dequantize_padded_rows(q, dtype, out, dequantize)
    n, fmt = q.numel, q.fmt
    dtype = out.dtype if out is not None else dtype or q.dtype
    if n == 0:
        return torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
    blocks = q.scales.numel()
    whole = blocks * fmt.block_size
    payload = q.payload
    if payload.numel() != fmt.payload_bytes(whole):
        payload = F.pad(payload, (0, fmt.payload_bytes(whole) - payload.numel()))
    direct = out is not None and out.is_contiguous() and out.numel() == whole  # the graph stores into out itself
    values = out.view(blocks, fmt.block_size) if direct else torch.empty(blocks, fmt.block_size, dtype=dtype, device=q.device)
    _graph(_dequantize_graph, fmt)(_block_payload(payload.contiguous(), fmt), _symbolic(q.scales), _symbolic(values), fmt, _tables(fmt, q.device))
    if direct:
        return out
    flat = values.view(-1)[:n]
    return flat.view(q.shape) if out is None else out.copy_(flat.view(out.shape))


def dequantize_rows(payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat, out: torch.Tensor) -> None:
    """Writes into ``out`` ([W, n] values, n whole blocks, contiguous) the values of W rows of
    ``fmt``, each row's payload ([W, bytes]) and scales ([W, n / block]) read where they lie, e.g.
    in the rows of a collective's wire buffer (any row stride): 8-bit codes in one call (they are
    their payload), other formats a row at a time."""
    rows, nblocks = scale_rows.shape
    if fmt.bits == 8:
        codes = payload_rows.unflatten(1, (nblocks, fmt.block_size))
        values = out.view(rows, nblocks, fmt.block_size)
        _graph(_dequantize_graph, fmt)(_symbolic(codes, 1), _symbolic(scale_rows, 1), _symbolic(values, 1), fmt, _tables(fmt, out.device))
        return
    dequantize_each_row(payload_rows, scale_rows, fmt, out, dequantize)


def _fold_region(payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, first: bool, zero_bad: bool) -> tuple:
    """Fold ``grad`` into a region of whole blocks and write its payload and scales back."""
    n = scales.numel() * fmt.block_size
    if grad.numel() > n or payload.numel() != fmt.payload_bytes(n):
        raise ValueError(
            f"folding a gradient needs storage of whole blocks: {payload.numel()} bytes and {scales.numel()} scales "
            f"for {n} values of {fmt.name}, and at most {n} gradient values (got {grad.numel()})"
        )
    g = grad.detach().reshape(-1)
    g = F.pad(g, (0, n - g.numel())) if g.numel() != n else g
    codes = payload if first else _codes(payload, fmt)  # a first fold reads no codes
    blocks = (codes if first else _blocks(codes, fmt.block_size), _symbolic(scales), _blocks(g, fmt.block_size))
    new_codes, new_scales, *rest = _graph(_fold_graph, fmt, first, zero_bad)(*blocks, fmt, _tables(fmt, payload.device), first, zero_bad)
    _packed(new_codes, fmt, payload)
    scales.copy_(new_scales)
    return tuple(rest)


def accumulate_(payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, *, first: bool) -> None:
    """In place: (payload, scales) := quantize(grad if first else dequantize(payload, scales) + grad).

    The region holds whole blocks; ``grad`` may be shorter (the rest adds zero). Blocks that end up
    holding NaN/Inf get a NaN scale (their codes are unspecified).
    """
    if scales.numel():
        _fold_region(payload, scales, grad, fmt, first, zero_bad=False)


def fold_(payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, *, first: bool) -> torch.Tensor:
    """In place, for the gradient buffer: accumulate_, then a non-finite block's scale is set to 0
    (its values read as zeros and stay off the wire). Returns a 0-d bool tensor: whether any block
    was non-finite (no host sync here; the buffer reads all flags once per step)."""
    if not scales.numel():
        return torch.zeros((), dtype=torch.bool, device=scales.device)
    (bad,) = _fold_region(payload, scales, grad, fmt, first, zero_bad=True)
    return bad


def sum_of_squares(q: QTensor) -> torch.Tensor:
    """The fp64 sum of the squares of the values ``q`` holds, which must be whole blocks (e.g. a
    gradient buffer's), read in one pass: no fp32 copy, nor a call per piece of one."""
    fmt = q.fmt
    if not q.whole_blocks:
        raise ValueError(f"sum_of_squares needs whole blocks of {fmt.block_size} values, got {q.numel} values")
    if q.numel == 0:
        return torch.zeros((), dtype=torch.float64, device=q.device)
    codes = _blocks(_codes(q.payload, fmt), fmt.block_size)
    return _graph(_sum_of_squares_graph, fmt)(codes, _symbolic(q.scales), fmt, _tables(fmt, q.device))


def reduce_rows(
    payload_rows: torch.Tensor,
    scale_rows: torch.Tensor,
    fmt: QuantFormat,
    *,
    average: bool,
    keep_sum: bool = True,
    requantize: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, QTensor | None]:
    """Sum W quantized rows in fp32, in row order (then / W if ``average``); optionally requantize
    the sum, into ``out`` (payload, scales: contiguous) where given."""
    w, nblocks = scale_rows.shape
    n = nblocks * fmt.block_size
    if payload_rows.shape != (w, fmt.payload_bytes(n)):
        raise ValueError(
            f"reduce_rows needs payload rows of {fmt.payload_bytes(n)} bytes for {nblocks} blocks of {fmt.name}, got {tuple(payload_rows.shape)}"
        )
    # Rows of 8-bit codes are read where they lie (any row stride); others are unpacked first.
    code_rows = payload_rows if fmt.bits == 8 and payload_rows.stride(1) == 1 else payload_rows.contiguous()
    codes = _codes(code_rows, fmt).view(w, nblocks, fmt.block_size)
    tables = _tables(fmt, payload_rows.device)
    reduce = _graph(_reduce_graph, fmt)
    outputs = reduce(_symbolic(codes, 1), _symbolic(scale_rows, 1), fmt, tables, average, keep_sum, requantize)
    acc = outputs[0].view(-1) if keep_sum else None
    if not requantize:
        return acc, None
    new_codes, new_scales = outputs[-2:]
    q = QTensor(_packed(new_codes, fmt), new_scales, torch.Size([n]), torch.float32, fmt)
    if out is not None:
        q = QTensor(out[0].copy_(q.payload), out[1].copy_(q.scales), q.shape, q.dtype, fmt)
    return acc, q


def reading_codes(fn: Callable[..., Any], fmt: QuantFormat, positions: tuple[int, ...], **constants: Any) -> Callable[..., Any]:
    """Elementwise ``fn`` with ``constants`` fixed, called with QTensors of whole blocks of ``fmt`` at
    ``positions`` and contiguous tensors of the same shape elsewhere; the QTensors reach it as their
    fp32 values computed inside one compiled graph with ``fn`` (a fused op's backward reads its
    saved activations so). Returns fn's tensors in the arguments' shape. The graph works on the
    blocks' own shape, [blocks, block], as dequantize does."""

    def call(*args: Any) -> Any:
        shape = args[0].shape
        items: list[Any] = []
        for i, a in enumerate(args):
            quantized = i in positions
            if not (a.whole_blocks if quantized else a.numel() % fmt.block_size == 0 and a.is_contiguous()):
                raise ValueError(f"reading_codes needs whole blocks of {fmt.block_size} values and contiguous tensors (argument {i})")
            if quantized:
                items.append((_block_payload(a.payload.contiguous(), fmt), _symbolic(a.scales)))
            else:
                items.append(_blocks(a, fmt.block_size))
        out = _graph(_reading_codes_graph, fmt, fn, *sorted(constants.items()))(fn, tuple(items), fmt, _tables(fmt, args[0].device), **constants)
        if isinstance(out, torch.Tensor):
            return out.view(shape)
        return tuple(None if o is None else o.view(shape) for o in out)

    return call


__all__ = [
    "accumulate_",
    "compiled",
    "dequantize",
    "dequantize_rows",
    "fold_",
    "quantize",
    "quantize_rows_into",
    "reading_codes",
    "reduce_rows",
    "sum_of_squares",
    "supports",
    "swiglu_quantize",
]
