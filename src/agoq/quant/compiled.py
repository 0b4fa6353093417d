"""Compiled CPU kernels for agoq.quant: torch.compile (inductor's C++/OpenMP code) of the hot paths.

The same API as :mod:`agoq.quant.triton` (quantize, dequantize, accumulate_, reduce_rows), chosen
through :mod:`agoq.quant.backend`. Each function below is one whole-tensor formula that inductor fuses
into one or two loops over memory: the eager reference (agoq.quant.qtensor) needs 10-30 separate
passes and a Python call per pass, which is what made small tensors slow (a 176K-value gradient
fold cost about 1 ms eagerly, most of it call overhead).

Bit-identical to the reference, by construction and by test (tests/test_compiled.py):
- the scale is the same expression (absmax / max_value, raised one ulp where s * max_value < absmax
  in fp64), and values are divided by it, never multiplied by a reciprocal;
- int codes round half to even (inductor's nearbyint / roundscale, as torch.round), fp4/nf4 count
  the same decision boundaries (``y > boundary``), fp8 uses the same float8_e4m3fn cast;
- packing is exact arithmetic on small integers (held in fp32/fp64 below 2**53, see _pack), and
  unpacking is the reference's own (agoq.quant.packing), so the bytes are the same.

Why torch.compile and not a hand-written extension: it needs only the C++ compiler that inductor
already uses, it keeps the formulas in Python beside the reference they must equal, and compiled
code is cached on disk (inductor's FX graph cache), so later runs start in about a second per
function. Shapes are compiled dynamically: one compile per function, kind and block size (int
widths share it), not per size.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from agoq.quant.formats import SCALE_DTYPE, QuantFormat, codebook_tables
from agoq.quant.packing import pack_into, packed_nbytes, packing_group, unpack_into
from agoq.quant import simd
from agoq.quant.qtensor import QTensor, dequantize_each_row, quantize_each_row_into
from agoq.quant.qtensor import quantize as reference_quantize

# Each (formula, constants) pair has a code object of its own (see _compiled), so recompiles are
# only shape families (contiguous or not; size 1 or larger, outside the whole-block formulas): the
# default limit of 8 would do; this leaves headroom for input dtypes.
_RECOMPILE_LIMIT = 64
# Values per call where a formula first unpacks codes eagerly: keeps that slab's codes in cache.
SLAB_VALUES = 1 << 20
_KERNELS: list[Callable[..., Any]] = []


def supports(fmt: QuantFormat) -> bool:
    """Whether the compiled path covers ``fmt``: blocks of whole packing groups (every format with block % 8 == 0)."""
    return fmt.block_size % packing_group(fmt.bits)[0] == 0


def _literal(value: Any) -> str:
    """Python source for a constant (int, float, str, bool, None, torch.dtype, or a tuple of them) that evaluates back to it."""
    if isinstance(value, torch.dtype):
        return str(value)  # 'torch.float32'
    if isinstance(value, tuple):
        return "(" + "".join(_literal(v) + ", " for v in value) + ")"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value)  # floats round-trip exactly through repr
    raise TypeError(f"compiled constants must be int, float, str, bool, None, a torch.dtype or a tuple, got {type(value).__name__}")


@functools.lru_cache(maxsize=None)
def _compiled(
    fn: Callable[..., Any], static: tuple[tuple[str, Any], ...], any_size: bool = False, runtime: tuple[str, ...] = ()
) -> Callable[..., Any]:
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < _RECOMPILE_LIMIT:
            setattr(dynamo_config, name, _RECOMPILE_LIMIT)
    # The constants are written into the source of a small function of their own: torch.compile
    # specializes on literals (the formulas branch on the kind and size by the block), while tensor
    # arguments get dynamic shapes, so one compile serves every size. A code object per (formula,
    # constants) also keeps each one's compiled variants and their limit apart. (Passing them as
    # values would make them symbolic under dynamic=True, and patching the config per call to
    # prevent that cost 23 us a call.) The keywords named in ``runtime`` are the exception: integers
    # passed after the tensors, symbolic in the graph, so that one graph serves all their values.
    trust_listed_vector_isa()
    name = f"agoq_{fn.__name__.lstrip('_')}_{len(_KERNELS)}"
    k = len(runtime)
    arguments = [f"{key}=tensors[{i - k}]" for i, key in enumerate(runtime)] + [f"{key}={_literal(v)}" for key, v in static]
    namespace: dict[str, Any] = {"formula": fn, "torch": torch}
    source = f"def {name}(*tensors):\n    return formula(*tensors{f'[:-{k}]' if k else ''}, {', '.join(arguments)})\n"
    exec(source, namespace)  # noqa: S102 - source built from literals above
    _KERNELS.append(namespace[name])
    return _Variants(torch.compile(namespace[name], dynamic=True, fullgraph=True), namespace[name], any_size)


class _Variants:
    """A compiled formula, called without Dynamo's per-call frame evaluation once compiled.

    torch.compile's own call path (frame evaluation, its cache lookup, the contexts around the
    graph) cost about 30-45 us a call: with about a thousand kernel calls in a step of the small
    model, its compiled kernels took 221 ms a step through it and 160 ms called here. Dynamo keeps,
    for each variant it compiled of a function, a guard (checking dtypes, sizes 0 and 1, size
    ranges, strides and global state, in C++) and the bytecode that runs the graph and rebuilds the
    outputs; here the first variant whose guard accepts the arguments runs that bytecode. A call
    that none accepts goes through torch.compile, which compiles one more variant (or finds one),
    and the list is read again. The code that runs, and so every result, is torch.compile's.
    """

    def __init__(self, dynamo: Callable[..., Any], fn: Callable[..., Any], any_size: bool) -> None:
        self._dynamo = dynamo
        self._fn = fn
        self._any_size = any_size
        self._variants: list[tuple[Any, Callable[..., Any]]] = []
        self._eager = False

    def __call__(self, *tensors: Any) -> Any:
        if torch.is_grad_enabled():
            # The formulas compute no gradients. Grad mode is part of a variant's guard, so calls
            # with it on and off (the optimizer's read-back, autograd's backward) compiled a
            # variant each; every call now runs with it off.
            with torch.no_grad():
                return self._call(*tensors)
        return self._call(*tensors)

    def _call(self, *tensors: Any) -> Any:
        frame = {"tensors": tensors}  # the locals of the generated function: def name(*tensors)
        for guard, run in self._variants:
            if guard.check(frame):
                return run(*tensors)
        if self._eager:
            return self._fn(*tensors)
        try:
            with _shape_settings(self._any_size):
                result = self._dynamo(*tensors)
        except Exception as e:
            if not isinstance(e, _build_errors()):
                raise
            # The formula runs eagerly from now on: the same arithmetic (bit-identical by test), so
            # a compiler that cannot build this code slows the run but never stops it.
            self._eager = True
            _warn_build_failed(self._fn.__name__, e)
            return self._fn(*tensors)
        self._variants = _cache_entries(self._fn)
        return result


@functools.cache
def _build_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a failed C++ build (imported when first needed: they pull in Dynamo)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError

    return (BackendCompilerFailed, CppCompileError)


def _warn_build_failed(name: str, error: BaseException) -> None:
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    warnings.warn(
        f"agoq: torch.compile could not build {name} ({first_line[:200]}); it runs on the eager torch path "
        "(same results, slower); set AGOQ_QUANT_BACKEND=torch to skip compiling",
        RuntimeWarning,
        stacklevel=3,
    )


# A file compiled with an ISA's flags to ask the compiler whether it accepts them: a syntax check
# of one function takes milliseconds (including the intrinsics header took 0.45 s a process).
_ISA_PROBE_SOURCE = "int agoq_isa_probe(void) { return 0; }\n"


@functools.cache
def trust_listed_vector_isa() -> bool:
    """Let inductor take this CPU's vector ISA from /proc/cpuinfo without building a test library for each.

    Inductor otherwise builds and dlopen-probes a small library for every vector ISA the CPU lists,
    in every process that compiles (a fresh Python per probe): a machine's first run pays the
    builds, every later process the probes. The flags it reads from /proc/cpuinfo are the
    kernel's, which lists only what it enabled, so what is left to ask is whether the compiler
    takes the chosen ISA's flags: one syntax-only compile. If it does not, or anything in asking
    fails, inductor's own check runs as before. Inductor still probes AVX-512's extensions (bf16,
    VNNI, AMX) itself; an AVX2-only CPU has none. A value the user set (TORCHINDUCTOR_VEC_ISA_OK,
    or the config) is kept. Returns whether the ISA is trusted.

    Measured, 5-step default runs held to AVX2 on the 2-core AMD EPYC, old and new code
    alternating: a fresh inductor cache folder 57.1 / 54.6 s -> 46.9 / 43.1 s, warm 25.5 / 26.0 s
    -> 25.0 / 23.2 s.
    """
    import os
    import platform
    import subprocess
    import tempfile

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    if inductor_config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64") or os.name != "posix":
        return False
    inductor_config.cpp.vec_isa_ok = True
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        isa = cpu_vec_isa.pick_vec_isa()
        if not isa:
            raise RuntimeError("no vector ISA listed")
        flags = isa.build_arch_flags().split()
        with tempfile.TemporaryDirectory() as folder:
            source = os.path.join(folder, "probe.cpp")
            with open(source, "w") as f:
                f.write(_ISA_PROBE_SOURCE)
            subprocess.run([get_cpp_compiler(), *flags, "-fsyntax-only", source], check=True, capture_output=True, timeout=60)
        return True
    except (OSError, subprocess.SubprocessError, RuntimeError):
        inductor_config.cpp.vec_isa_ok = None
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        return False


def _shape_settings(any_size: bool) -> contextlib.AbstractContextManager[None]:
    """How Dynamo treats sizes while a formula compiles.

    No duck sizing: Dynamo otherwise takes two sizes that happen to be equal for one symbol, and a
    slice of a bucket whose storage offset equalled its length (524288 and 524288) got a variant
    that the next slice failed, two more compiles per process for the gradient fold. Sizes the
    formula's arithmetic needs equal are still guarded equal, by the ops that need it.

    ``any_size`` (the whole-block formulas): sizes 0 and 1 as any size (backed_size_oblivious).
    Dynamo otherwise compiles a size of 1 as a constant, so a tensor of one block (a norm weight's
    gradient of 256 values, its one scale) got graphs of its own: three more compiles per process
    in the default run, 1-4 s each on a machine's first run. Only there: those sizes never
    broadcast (a size-1 dimension that broadcasts, like a norm's [rows, 1] statistics, must stay a
    constant).
    """
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False, backed_size_oblivious=any_size)


def _cache_entries(fn: Callable[..., Any]) -> list[tuple[Any, Callable[..., Any]]]:
    """(guard, function running the compiled bytecode) of each variant Dynamo holds for ``fn``; none
    where this torch does not expose them (every call then goes through torch.compile)."""
    import types

    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
        return [(e.guard_manager, types.FunctionType(e.code, fn.__globals__)) for e in entries]
    except (AttributeError, TypeError):
        return []


def compiled(fn: Callable[..., Any], **constants: Any) -> Callable[..., Any]:
    """``fn`` with keyword ``constants`` fixed, compiled by torch.compile once and reused (dynamic shapes)."""
    return _compiled(fn, tuple(sorted(constants.items())))


def _block_kernel(fn: Callable[..., Any], **constants: Any) -> Callable[..., Any]:
    """:func:`compiled` for a formula over whole blocks: one graph for every block count, one block included."""
    return _compiled(fn, tuple(sorted(constants.items())), any_size=True)


# The keywords of an int format's formulas that reach its graphs as values, not literals: they are
# all that tells int4 from int8 there (codes are one per byte or float in the graph, packing is
# outside it), so one graph serves every int width at a block size. The default run's two pipeline
# stages (int4 and int8 activations, DBCA) then share their quantize, dequantize and SwiGLU
# backward graphs instead of compiling three each. Dividing by a symbolic integer is dividing by
# the same float, so codes and scales do not change (tests).
_INT_RUNTIME = ("zero", "max_value")


@functools.lru_cache(maxsize=None)
def _format_kernel(fn: Callable[..., Any], fmt: QuantFormat, any_size: bool = True, **constants: Any) -> Callable[..., Any]:
    """The compiled ``fn`` for ``fmt`` (its :func:`_constants` and ``constants`` fixed; an int format's
    zero code and max value passed as values), called with the tensors alone. ``any_size``: as
    :func:`_block_kernel` (the whole-block formulas), else as :func:`compiled`."""
    keywords = {**_constants(fmt), **constants}
    runtime = tuple(key for key in _INT_RUNTIME if key in keywords) if fmt.kind == "int" else ()
    values = tuple(int(keywords.pop(key)) for key in runtime)  # exact: small integers
    kernel = _compiled(fn, tuple(sorted(keywords.items())), any_size, runtime)
    if not values:
        return kernel

    def call(*tensors: torch.Tensor) -> Any:
        return kernel(*tensors, *values)

    return call


# ---- the formulas (traced by torch.compile; each also runs eagerly) ------------------------------------
#
# Codes are computed as exact small integers in fp32 (inductor vectorizes float arithmetic well and
# integer shifts hardly at all) and leave the graph as one byte each; packing them is the SWAR
# path's work (agoq.quant.packing), outside the graph, on contiguous words.


def _encode(y: torch.Tensor, kind: str, zero: int, book: tuple) -> torch.Tensor:
    """Codes (as floats) of scaled values |y| <= max_value: the reference's _encode, whole-tensor (``zero``: an int format's code of 0)."""
    if kind == "int":
        return torch.round(y) + zero
    if kind == "fp8":
        return y.to(torch.float8_e4m3fn).view(torch.uint8).float()
    # Value i wins iff exactly i boundaries lie below y: a binary search finds i's bits (4
    # comparisons), and they select its code (see _search; a table lookup or a comparison against a
    # tensor measured 40x slower, counting all 15 boundaries 2.3x slower).
    boundaries, codes, _ = book
    mirrored = _mirrored_half(book)
    if mirrored is not None:
        # fp4: sign and magnitude, searched on |y| among the positive boundaries alone (3
        # comparisons and 4 selects in place of 4 and 11; the formula on 1M bf16 values, one
        # thread, AMX Xeon: 1.08 -> 0.93 ms). A negative y lies above the mirrored boundary
        # -nextup(b) iff |y| <= b, so its magnitude counts the same boundaries; the reference's
        # code is 0 for every y that rounds to zero, -0 included.
        half, negative_zero = mirrored
        m = _index(_search(y.abs(), half))
        return torch.where((y < 0) & (m > 0), m + negative_zero, m)
    bits = _search(y, boundaries)
    # The codes of the usual codebooks are linear in i on each side of zero: a few arithmetic ops
    # on i (its bits weighted) in place of a tree of 15 selects (the whole formula on 1M bf16
    # values, one thread, AMX Xeon: fp4 1.10 -> 1.01 ms, nf4 1.09 -> 0.93 ms). Any other codebook
    # takes the tree.
    index = _index(bits)
    if codes == tuple(range(len(codes))):  # nf4: codes in value order
        return index
    zero_at = codes.index(0)
    top = (1 << len(bits)) - 1
    if _sign_magnitude(codes, top):  # fp4
        return torch.where(index < zero_at, top - index, index - zero_at)
    return _select(bits, codes)


def _index(bits: list[torch.Tensor]) -> torch.Tensor:
    """The index whose bits (highest first) are ``bits``, as floats: the bits weighted and summed."""
    return sum(torch.where(bit, float(1 << (len(bits) - 1 - k)), 0.0) for k, bit in enumerate(bits))


def _sign_magnitude(codes: tuple, top: int) -> bool:
    """Whether ``codes`` (in value order) are top, top - 1, ... for the negative values, then 0, 1, ...:
    a sign bit over the magnitude's code."""
    zero_at = codes.index(0) if 0 in codes else -1
    return zero_at >= 0 and codes == tuple(top - i for i in range(zero_at)) + tuple(range(len(codes) - zero_at))


def _mirrored_half(book: tuple) -> tuple[tuple, int] | None:
    """(The positive boundaries, the code of -0) of a sign-and-magnitude codebook whose negative
    boundaries mirror them (each -nextup(b), so that ties round the same way on both sides), or None.

    The zero value is then the only one between the two halves of the boundaries, and a negative
    magnitude m has code m + the code of -0 (top - zero's index).
    """
    boundaries, codes, _ = book
    n = len(boundaries)
    if n % 2 or len(codes) != n + 1 or codes[n // 2] != 0:
        return None
    half = boundaries[n // 2 :]
    top = (1 << max(1, math.ceil(math.log2(len(half) + 1))) + 1) - 1
    if not all(b > 0 for b in half):
        return None
    # The fp32 value above each b (b = m * 2**e with 0.5 <= m < 1: fp32's step there is 2**(e - 24)).
    up = [b + 2.0 ** (math.frexp(b)[1] - 24) for b in half]
    mirrored = all(boundaries[n // 2 - 1 - k] == -u for k, u in enumerate(up))
    return (half, top - len(half)) if mirrored and _sign_magnitude(codes, top) else None


def _search(y: torch.Tensor, boundaries: tuple) -> list[torch.Tensor]:
    """The bits, highest first, of i = the number of ``boundaries`` (ascending) below each y.

    A binary search in log2 steps, each one comparison against a threshold that the bits found so
    far select among literal constants: 4 comparisons and 11 selects for 15 boundaries, a third of
    the work of counting them one by one, with few live registers. Padded with +inf, which no
    finite y exceeds, to 2**k - 1 boundaries.
    """
    depth = max(1, math.ceil(math.log2(len(boundaries) + 1)))
    padded = tuple(boundaries) + (math.inf,) * ((1 << depth) - 1 - len(boundaries))
    bits: list[torch.Tensor] = []
    for level in range(depth):
        # With the higher bits h fixed, the next bit is 1 iff y lies above boundary h * 2**(depth-level) + 2**(depth-level-1) - 1.
        span = 1 << (depth - level)
        thresholds = tuple(padded[h * span + span // 2 - 1] for h in range(1 << level))
        bits.append(y > _select(bits, thresholds) if level else y > thresholds[0])
    return bits


def _select(bits: list[torch.Tensor], table: tuple) -> torch.Tensor | float:
    """table[i] for the index i whose bits (highest first) are ``bits``, as a tree of selects of literals (missing entries repeat the last)."""
    if not bits:
        return float(table[0])
    half = 1 << (len(bits) - 1)
    high, low = table[half:] or table[-1:], table[:half]
    return torch.where(bits[0], _select(bits[1:], high), _select(bits[1:], low))


def _quantize_blocks(
    x: torch.Tensor, *, block: int, kind: str, zero: int, max_value: float, book: tuple, one_pass: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(one uint8 code per value, fp32 scales) of flat ``x`` of whole blocks, assuming finite input.

    Packing is left to the caller (_pack_codes): packing inside the graph reads the codes with a
    stride of g, which inductor does not vectorize, and it split the encoding into two loops with a
    4-byte-per-value buffer between them (measured fp4: 0.25x of a copy; codes out, then packed
    by the SWAR path a slab at a time while they are in cache: see quantize).

    Inductor writes this as three loops: each block's absmax, the scales (vectorized across
    blocks), then the encoding, which reads the input a second time. ``one_pass`` makes the scales'
    loop scalar (an int16 intermediate, which inductor does not vectorize; and nextafter up as the
    bits' increment, exact for the finite positive scales it applies to), and inductor then fuses
    the three loops per block: the same codes and scales, each block read once. For an input read
    from memory that is 1.55x faster (16M fp32 values, one thread, AMX Xeon: 16.6 -> 10.7 ms); for
    one already in cache it is slower (a 256K-value piece: 113 -> 130 us). :func:`quantize` uses it
    (the small model's compiled step stayed at 1.01x of the bf16 policy); the gradient fold, the
    all-reduce's sum and the fused SwiGLU forward keep the three loops: in one pass there, that
    step measured 1.17x and 1.19x.

    A block holding NaN/Inf comes out with a non-finite scale; the caller redoes such a tensor on
    the reference path, which handles it (rare, and it keeps the per-element loop free of masks).
    """
    y = x.view(-1, block).float()
    absmax = torch.maximum(y.amax(dim=1), y.amin(dim=1).neg())
    s = absmax / max_value
    low = s.double() * max_value < absmax.double()
    if one_pass:
        low = low.to(torch.int16) > 0
        s = torch.where(low, (s.view(torch.int32) + 1).view(torch.float32), s)
    else:
        s = torch.where(low, torch.nextafter(s, torch.full_like(s, math.inf)), s)
    y = y / torch.where(s > 0, s, 1.0).unsqueeze(1)
    return _encode(y, kind, zero, book).to(torch.uint8).view(-1), s


def _values(codes: torch.Tensor, scales: torch.Tensor, block: int, kind: str, zero: int, book: tuple) -> torch.Tensor:
    """fp32 values of whole blocks from one uint8 code per value: format value times block scale.

    Codes of contiguous whole blocks (flat, or [blocks, block]) give [blocks, block] with scales
    [blocks]; codes [rows, blocks, block] read in place from rows of a larger buffer (any row
    stride) give [rows, blocks, block] with scales [rows, blocks].
    """
    blocks = codes if codes.dim() == 3 else codes.view(-1, block)
    if kind == "fp8":  # the codes are float8_e4m3fn bit patterns: a bitcast and an exact cast
        v = blocks.view(torch.float8_e4m3fn).float()
    else:
        c = blocks.float()
        if kind == "int":
            v = c - zero
        else:  # 16 codes: select against literal values (vectorizes; a gather does not)
            # One equality per code: 1.6x faster here than the binary search _encode uses (measured
            # nf4, 1M values), which needs a select of the threshold at each step.
            v = torch.zeros_like(c, dtype=torch.float32)
            for code, value in enumerate(book[2]):
                if value != 0.0 or math.copysign(1.0, value) < 0:  # v starts at +0; fp4's code 8 is -0
                    v = torch.where(c == code, value, v)
    return v * scales.unsqueeze(-1)


def _dequantize_bytes(payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block: int, per_byte: int, table: tuple) -> None:
    """Writes into ``out`` ([blocks, bytes per block, per_byte]) the values of whole blocks of packed bytes, each byte's codes read from a table.

    For the codebook formats (fp4, nf4): ``table`` holds, for each of the 256 byte values,
    the format values of its ``per_byte`` codes in packing order, so one indirect load of a byte
    gives all its values and nothing is unpacked first. The table is a literal of the graph, so its
    sizes are static (passed as a tensor under dynamic shapes, each load paid an integer division
    and a bounds check: 0.49x of a copy against 0.71x, into an existing ``out``). Measured fp4 at
    64M values (benchmarks/results/quant_throughput.json): 0.36x of a copy with the separate unpack
    pass and 16 compare-selects per value (_dequantize_blocks), 0.44x this way (0.75x into an
    existing ``out``). The load is scalar code, so int4, whose codes decode by one vectorized
    subtraction after the unpack pass, stays on that path (0.76x there, 0.46x here).

    ``out`` comes shaped by bytes (a view taken outside the graph: one taken inside made inductor
    store into a buffer and copy it): the loops then run over bytes with an inner loop over each
    byte's codes, so a byte is loaded once, not once per code with an index division (fp4, 1M
    values into fp32, one thread, AMX Xeon: 632 -> 480 us).
    """
    values = torch.tensor(table, dtype=torch.float32, device=payload.device).view(256, per_byte)
    out.copy_(values[payload.view(-1, block // per_byte).long()] * scales.view(-1, 1, 1))


def _byte_table(bits: int, book: tuple) -> tuple:
    """The format value of code k (bits [k * bits, (k + 1) * bits), little-endian) of each byte value, flat [256 x 8 // bits]."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    by_code = book[2]  # fp4's code 8 stays -0
    return tuple(by_code[(byte >> (k * bits)) & mask] for byte in range(256) for k in range(per_byte))


@functools.lru_cache(maxsize=None)
def _byte_table_kernel(fmt: QuantFormat) -> Callable[..., Any]:
    """The compiled _dequantize_bytes of a codebook format, built once: its table takes about 0.2 ms to build and hash."""
    return _block_kernel(_dequantize_bytes, block=fmt.block_size, per_byte=8 // fmt.bits, table=_byte_table(fmt.bits, _book(fmt.kind)))


def _dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block: int, kind: str, zero: int, book: tuple) -> None:
    """Writes into ``out`` ([blocks, block]) the values of whole blocks, multiplied in fp32 and rounded once.

    Written in place and in the blocks' shape: a 1-D result split the graph's loop in two, with an
    fp32 buffer of every value between them, and returning a slab's values cost a copy into the
    whole (measured fp4 at 16M values: 0.36x -> 0.5x of a copy).
    """
    out.copy_(_values(codes, scales, block, kind, zero, book))


def _accumulate(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    *,
    first: bool,
    block: int,
    kind: str,
    zero: int,
    max_value: float,
    book: tuple,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold of one gradient piece of whole blocks: quantize(grad or dequantize(region) + grad).

    A block that ends up non-finite gets a NaN scale, which is all the gradient buffer reads of it
    (it then skips the step); its codes are unspecified, unlike the reference's, so no fallback
    pass is needed. (Writing into the region inside the graph measured 4x slower: inductor then
    materializes the read-modify-write apart from the quantization.)
    """
    x = grad.float()
    if not first:
        x = _values(codes, scales, block, kind, zero, book).view(-1) + x
    new_codes, new_scales = _quantize_blocks(x, block=block, kind=kind, zero=zero, max_value=max_value, book=book)
    return new_codes, torch.where(torch.isfinite(new_scales), new_scales, math.nan)


def _fold(codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, **constants: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_accumulate (``constants``: its keywords) for the gradient buffer: (codes, scales with 0 for
    non-finite blocks, whether there was one)."""
    new_codes, new_scales = _accumulate(codes, scales, grad, **constants)
    bad = torch.isnan(new_scales)
    return new_codes, torch.where(bad, 0.0, new_scales), bad.any()


def _reduce_rows(
    code_rows: torch.Tensor,
    scale_rows: torch.Tensor,
    *,
    average: bool,
    rows: int,
    keep_sum: bool,
    requantize: bool,
    block: int,
    kind: str,
    zero: int,
    max_value: float,
    book: tuple,
) -> tuple[torch.Tensor, ...]:
    """The fp32 sum of W rows in row order (/ W if ``average``) where ``keep_sum``, then its
    requantized codes and scales where ``requantize``. (A sum not asked for is never written: it
    was 4 bytes a value of output, with its pages, in every 8-bit all-reduce.)"""
    acc = _values(code_rows[0], scale_rows[0], block, kind, zero, book).view(-1)
    for i in range(1, rows):
        acc = acc + _values(code_rows[i], scale_rows[i], block, kind, zero, book).view(-1)
    if average:
        acc = acc / rows
    out = (acc,) if keep_sum else ()
    if requantize:
        out += _quantize_blocks(acc, block=block, kind=kind, zero=zero, max_value=max_value, book=book)
    return out


def _swiglu_quantize(
    gate: torch.Tensor, up: torch.Tensor, *, act_dtype: torch.dtype, block: int, kind: str, zero: int, max_value: float, book: tuple
) -> tuple[torch.Tensor, ...]:
    """(SiLU(gate) * up in ``act_dtype``, gate's codes and scales, up's codes and scales) of flat
    whole blocks, from one read of each; the codes and scales those of :func:`_quantize_blocks`.

    The product is rounded once: inductor's C++ code keeps a bf16 intermediate in fp32, so SiLU is
    not rounded to bf16 before the product as it is eagerly. The result is within one bf16
    rounding of the eager forward's (in fp32 within a few ulps: inductor's exp is another
    approximation than torch's, as in the compiled backward). Rounding SiLU by its bits, as the
    Triton kernel does, made the loop scalar: the fused op was then slower than the separate ones.
    """
    g, u = gate.view(-1, block).float(), up.view(-1, block).float()
    act = (g / (1 + torch.exp(-g)) * u).to(act_dtype).view(-1)
    gate_codes, gate_scales = _quantize_blocks(g, block=block, kind=kind, zero=zero, max_value=max_value, book=book)
    up_codes, up_scales = _quantize_blocks(u, block=block, kind=kind, zero=zero, max_value=max_value, book=book)
    return act, gate_codes, gate_scales, up_codes, up_scales


def _sum_of_squares(codes: torch.Tensor, scales: torch.Tensor, *, block: int, kind: str, zero: int, book: tuple) -> torch.Tensor:
    """fp64 sum of the squares of the values of whole blocks: one pass that writes nothing value-sized."""
    return _values(codes, scales, block, kind, zero, book).double().square().sum()


@functools.lru_cache(maxsize=None)
def _reading_codes(fn: Callable[..., Any], positions: tuple[int, ...]) -> Callable[..., Any]:
    """Elementwise ``fn`` taking, at each of ``positions``, a (codes, scales) pair of whole blocks in
    place of an argument, which it receives as fp32 values [blocks, block] computed in the graph."""

    def formula(*tensors: torch.Tensor, block: int, kind: str, zero: int, book: tuple, **constants: Any) -> Any:
        args, parts = [], iter(tensors)
        for i in range(len(tensors) - len(positions)):
            if i in positions:
                codes, scales = next(parts), next(parts)
                args.append(_values(codes, scales, block, kind, zero, book))
            else:
                args.append(next(parts))
        return fn(*args, **constants)

    formula.__name__ = f"{fn.__name__.lstrip('_')}_of_codes"
    return formula


def reading_codes(fn: Callable[..., Any], fmt: QuantFormat, positions: tuple[int, ...], **constants: Any) -> Callable[..., Any]:
    """Elementwise ``fn`` with ``constants`` fixed, called with QTensors of whole blocks of ``fmt`` at
    ``positions`` and contiguous tensors of the same shape elsewhere; the QTensors reach it as their
    fp32 values without ever being written out: one compiled graph dequantizes and computes (a
    fused op's backward reads its saved activations so). Returns fn's tensors in the arguments' shape.

    The graph works on the blocks' own shape, [blocks, block], as dequantize does: read in rows of
    another width, values then take their scale by an index division that inductor does not
    vectorize (measured: SwiGLU backward of 512 x 1376 int4 values, 34 ms in rows of 1376, 1.9 ms
    in blocks, 2.3 ms dequantizing first).
    """
    kernel = _format_kernel(_reading_codes(fn, positions), fmt, any_size=False, **constants)

    def call(*args: Any) -> Any:
        shape = args[0].shape
        flat: list[torch.Tensor] = []
        for i, a in enumerate(args):
            quantized = i in positions
            if not (a.whole_blocks if quantized else a.numel() % fmt.block_size == 0 and a.is_contiguous()):
                raise ValueError(f"reading_codes needs whole blocks of {fmt.block_size} values and contiguous tensors (argument {i})")
            if quantized:
                flat += [_codes(a.payload, fmt).view(-1, fmt.block_size), a.scales]
            else:
                flat.append(a.view(-1, fmt.block_size))
        out = kernel(*flat)
        if isinstance(out, torch.Tensor):
            return out.view(shape)
        return tuple(None if o is None else o.view(shape) for o in out)

    return call


# ---- the API of a kernel module -------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _book(kind: str) -> tuple:
    """(decision boundaries, their codes in ascending value order, value of each code) of a codebook format, as Python floats."""
    if kind not in ("fp4", "nf4"):
        return ()
    t = codebook_tables(kind, "cpu")
    return (tuple(t.boundaries.tolist()), tuple(int(c) for c in t.codes.tolist()), tuple(t.by_code.tolist()))


def _constants(fmt: QuantFormat) -> dict[str, Any]:
    """The keywords of ``fmt``'s formulas: block size, kind, the code of 0 (int formats: 2**(bits-1); else unused) and codebook."""
    return {"block": fmt.block_size, "kind": fmt.kind, "zero": 1 << (fmt.bits - 1) if fmt.kind == "int" else 0, "book": _book(fmt.kind)}


@functools.cache
def codes_as_floats(device_type: str = "cpu") -> bool:
    """Whether the kernels get codes as fp32 values rather than bytes on this machine.

    Inductor's CPU code loads a graph's uint8 input 8 bytes at a time, as many as its float lanes;
    with AVX512 that is one masked load, but AVX2 has no masked byte load, and ATen's fallback
    copies each 8 bytes through a zero-filled buffer. Held to AVX2 on an AMD EPYC (one thread, 2M
    values), the gradient fold ran 10.7 ms from bytes and 3.1 ms from fp32 codes converted by
    ATen's vectorized cast first, an int4 dequantize 3.4 ms and 1.2 ms; with AVX512 the bytes are
    faster (1.9 ms and 0.85 ms against 3.0 ms and 1.5 ms). The values are the same: codes are
    small integers, exact in fp32.
    """
    if device_type != "cpu":
        return False
    from torch._inductor import cpu_vec_isa

    trust_listed_vector_isa()

    return str(cpu_vec_isa.pick_vec_isa()) == "avx2"


def _codes(payload: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """One code per value of a payload of whole packing groups (8-bit payloads are their codes):
    uint8, or fp32 where :func:`codes_as_floats` (fp8 codes are bit patterns and stay bytes).

    Unpacking runs on the reference's SWAR integer path (agoq.quant.packing), outside the compiled
    graph: inductor does not vectorize a loop whose input index is the output index // g, and the
    unpacked codes then feed a contiguous, vectorized loop (measured int4: 0.25x -> 0.6x of a copy).
    """
    if fmt.bits == 8:
        codes = payload
    else:
        g, gbytes = packing_group(fmt.bits)
        codes = torch.empty(payload.numel() // gbytes * g, dtype=torch.uint8, device=payload.device)
        unpack_into(payload.contiguous(), fmt.bits, codes)
    return codes.float() if fmt.kind != "fp8" and codes_as_floats(codes.device.type) else codes


def _whole_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks (a copy only when it is not already)."""
    pad = -flat.numel() % block
    return F.pad(flat, (0, pad)) if pad else flat


def _pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The payload of one-byte codes of whole packing groups (written into ``out`` when given)."""
    if out is None:
        if bits == 8:
            return codes
        out = torch.empty(packed_nbytes(codes.numel(), bits), dtype=torch.uint8, device=codes.device)
    pack_into(codes, bits, out)
    return out


def _slab_bounds(whole: int, fmt: QuantFormat) -> list[tuple[int, int]]:
    """(start, end) values of the slabs a formula over ``whole`` values (whole blocks) is called on:
    one slab for 8-bit codes (they are the payload) or up to SLAB_VALUES, else SLAB_VALUES each, so
    a slab's one-byte codes are still in cache when they are packed."""
    if fmt.bits == 8 or whole <= SLAB_VALUES:
        return [(0, whole)]
    step = max(1, SLAB_VALUES // fmt.block_size) * fmt.block_size
    return [(v0, min(whole, v0 + step)) for v0 in range(0, whole, step)]


class _Packed:
    """The QTensor of ``x`` built slab by slab (:func:`_slab_bounds`) from a formula's codes and
    scales of its whole blocks, each slab packed as it comes, while its codes are in cache."""

    def __init__(self, x: torch.Tensor, whole: int, fmt: QuantFormat) -> None:
        self.x, self.whole, self.fmt = x, whole, fmt
        self.payload: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        if not whole:
            self.payload = torch.empty(0, dtype=torch.uint8, device=x.device)
            self.scales = torch.empty(0, dtype=SCALE_DTYPE, device=x.device)

    def add(self, v0: int, v1: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Values v0..v1's codes (one byte each) and scales."""
        fmt = self.fmt
        if v0 == 0 and v1 == self.whole:  # one slab: its tensors are the result
            self.payload, self.scales = _pack_codes(codes, fmt.bits), scales
            return
        if self.payload is None or self.scales is None:
            self.payload = torch.empty(fmt.payload_bytes(self.whole), dtype=torch.uint8, device=codes.device)
            self.scales = torch.empty(self.whole // fmt.block_size, dtype=SCALE_DTYPE, device=codes.device)
        self.scales[v0 // fmt.block_size : v1 // fmt.block_size] = scales
        _pack_codes(codes, fmt.bits, self.payload[fmt.payload_bytes(v0) : fmt.payload_bytes(v1)])

    def result(self) -> QTensor:
        """``x`` quantized: the reference's result where a block holds NaN/Inf."""
        x, fmt, payload, scales = self.x, self.fmt, self.payload, self.scales
        if payload is None or scales is None:
            raise RuntimeError("the slabs of a quantization were not all added")
        if not bool(torch.isfinite(scales).all()):
            return reference_quantize(x, fmt, nonfinite="propagate")
        n = x.numel()
        nbytes = fmt.payload_bytes(n)
        if payload.numel() != nbytes:
            # The reference stores code 0 for the padding of the last block: clear its bits in the last byte.
            payload = payload[:nbytes].clone()
            spare = nbytes * 8 - n * fmt.bits
            if spare:
                payload[-1] &= (1 << (8 - spare)) - 1
        return QTensor(payload, scales, x.shape, x.dtype, fmt)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> QTensor:
    """Block-wise nearest quantization of ``x`` (NaN scale for blocks holding NaN/Inf)."""
    flat = _whole_blocks(x.detach().reshape(-1), fmt.block_size)
    packed = _Packed(x, flat.numel(), fmt)
    if x.numel():
        kernel = _format_kernel(_quantize_blocks, fmt, max_value=fmt.max_value, one_pass=True)
        for v0, v1 in _slab_bounds(flat.numel(), fmt):
            packed.add(v0, v1, *kernel(flat[v0:v1]))
    return packed.result()


def quantize_rows_into(x: torch.Tensor, payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat) -> None:
    """Quantizes ``x`` ([rows, n] values, n whole blocks, contiguous) into ``payload_rows`` ([rows,
    bytes]) and ``scale_rows`` ([rows, n / block]), any row stride (e.g. the rows of a collective's
    wire buffer); a block holding NaN/Inf gets a NaN scale and unspecified codes.

    fp32 into int8 by the vector kernel where it applies (agoq.quant.simd: 3.3x faster than
    inductor's code); else :func:`quantize`'s codes and scales, copied into the rows.
    """
    kernel = simd.quantize_rows_kernel(fmt, x)
    if kernel is not None and x.is_contiguous() and payload_rows.stride(-1) == 1 and scale_rows.stride(-1) == 1:
        kernel(x, payload_rows, scale_rows)
        return
    quantize_each_row_into(x, payload_rows, scale_rows, fmt, quantize)


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, QTensor, QTensor]:
    """(SiLU(gate) * up in the inputs' dtype, gate quantized, up quantized), reading each once: the
    fused forward of agoq.activation.ops' SwiGLU + GEMM, as agoq.quant.triton's. The codes and
    scales are :func:`quantize`'s; the product is rounded once (see _swiglu_quantize)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    flat_gate, flat_up = (_whole_blocks(t.detach().reshape(-1), fmt.block_size) for t in (gate, up))
    whole = flat_gate.numel()
    if not whole:
        return torch.empty_like(gate), quantize(gate, fmt), quantize(up, fmt)
    kernel = _format_kernel(_swiglu_quantize, fmt, max_value=fmt.max_value, act_dtype=gate.dtype)
    bounds = _slab_bounds(whole, fmt)
    act = torch.empty(whole, dtype=gate.dtype, device=gate.device) if len(bounds) > 1 else None
    packed_gate, packed_up = _Packed(gate, whole, fmt), _Packed(up, whole, fmt)
    for v0, v1 in bounds:
        slab_act, gate_codes, gate_scales, up_codes, up_scales = kernel(flat_gate[v0:v1], flat_up[v0:v1])
        if act is None:
            act = slab_act
        else:
            act[v0:v1].copy_(slab_act)
        packed_gate.add(v0, v1, gate_codes, gate_scales)
        packed_up.add(v0, v1, up_codes, up_scales)
    assert act is not None
    return act[: gate.numel()].view(gate.shape), packed_gate.result(), packed_up.result()


def dequantize(q: QTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``q`` represents, in its shape and dtype (or ``dtype``); written into ``out`` when given."""
    n, fmt = q.numel, q.fmt
    blocks = q.scales.numel()
    if out is not None and (out.numel() != blocks * fmt.block_size or not out.is_contiguous()):
        # Only a whole-block, contiguous ``out`` can take the kernel's stores directly.
        return out.copy_(dequantize(q, out.dtype).view(out.shape))
    if n == 0:
        return torch.empty(q.shape, dtype=dtype or q.dtype, device=q.device) if out is None else out
    payload = q.payload
    whole = fmt.payload_bytes(blocks * fmt.block_size)
    if payload.numel() != whole:
        payload = F.pad(payload, (0, whole - payload.numel()))
    values = torch.empty(blocks, fmt.block_size, dtype=dtype or q.dtype, device=q.device) if out is None else out.view(blocks, fmt.block_size)
    if fmt.kind in ("fp4", "nf4"):  # int codes decode by arithmetic, which vectorizes: the unpack pass is faster there
        _dequantize_by_table(payload, q.scales, values, fmt)
    else:
        _dequantize_codes(payload, q.scales, values, fmt)
    if out is not None:
        return out
    flat = values.view(-1)
    if flat.numel() != n:  # the last block's padding: less than one block of spare values
        flat = flat[:n]
    return flat.view(q.shape)


def _dequantize_by_table(payload: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, fmt: QuantFormat) -> None:
    """Writes the values of whole blocks of a codebook format into ``values`` [blocks, block] through the byte table.

    The table load makes inductor's loop scalar, and a scalar loop also rounds each value to
    bf16/fp16 in scalar code: into a bf16 ``values`` that took most of the time. So a narrower
    output is written a slab at a time through an fp32 scratch that stays in cache, and cast by
    torch's vectorized copy (the same single rounding of the fp32 product, so the same bits).
    Measured fp4 at 64M bf16 values, one thread: 0.41-0.44x of a copy directly, 0.52-0.54x this way.
    """
    kernel = _byte_table_kernel(fmt)
    per_byte = 8 // fmt.bits
    if values.dtype == torch.float32:
        kernel(payload, scales, values.view(-1, fmt.block_size // per_byte, per_byte))
        return
    blocks, per_slab = scales.numel(), max(1, SLAB_VALUES // fmt.block_size)
    scratch = torch.empty(min(blocks, per_slab), fmt.block_size, dtype=torch.float32, device=values.device)
    by_byte = scratch.view(-1, fmt.block_size // per_byte, per_byte)
    for b0, b1, lo, hi in _slabs(fmt, blocks, per_slab):
        kernel(payload[lo:hi], scales[b0:b1], by_byte[: b1 - b0])
        values[b0:b1].copy_(scratch[: b1 - b0])


def _slabs(fmt: QuantFormat, blocks: int, per_slab: int) -> Iterator[tuple[int, int, int, int]]:
    """(first block, end block, first payload byte, end payload byte) of each slab of ``per_slab`` blocks."""
    for b0 in range(0, blocks, per_slab):
        b1 = min(blocks, b0 + per_slab)
        yield b0, b1, fmt.payload_bytes(b0 * fmt.block_size), fmt.payload_bytes(b1 * fmt.block_size)


def _dequantize_codes(payload: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, fmt: QuantFormat) -> None:
    """Writes the values of whole blocks into ``values`` [blocks, block], from codes unpacked a slab at a time."""
    blocks = scales.numel()
    kernel = _format_kernel(_dequantize_blocks, fmt)
    # Packed codes are unpacked a slab at a time, so the one-byte codes of a slab are still in
    # cache when the kernel reads them (whole-tensor unpacking measured 0.28x of a copy for int4 at
    # 64M values, slabs of 1M 2x faster).
    # (Codes as fp32, codes_as_floats, also go a slab at a time: their copy is 4 bytes a value.)
    whole = fmt.bits == 8 and not codes_as_floats(payload.device.type)
    per_slab = blocks if whole else max(1, SLAB_VALUES // fmt.block_size)
    for b0, b1, lo, hi in _slabs(fmt, blocks, per_slab):
        # Codes, scales and out all carry the block count as their first size, so the compiled
        # graph sees one size (duck-shaped) and fuses everything into one loop over out.
        kernel(_codes(payload[lo:hi], fmt).view(-1, fmt.block_size), scales[b0:b1], values[b0:b1])


def dequantize_rows(payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat, out: torch.Tensor) -> None:
    """Writes into ``out`` ([W, n] values, n whole blocks) the values of W rows of ``fmt``, each
    row's payload ([W, bytes]) and scales ([W, n / block]) read where they lie, e.g. in the rows
    of a collective's wire buffer (any row stride).

    8-bit codes are their payload, so one call reads every row in place (for the 8-bit
    all-reduce of 2 MiB of fp32 on 4 ranks, 0.22 ms against 0.49 ms a row at a time, one thread,
    AMX Xeon); other formats, and codes read as floats (codes_as_floats), go a row at a time.
    """
    rows, nblocks = scale_rows.shape
    if fmt.bits == 8 and fmt.kind in ("int", "fp8") and not codes_as_floats(payload_rows.device.type):
        kernel = _format_kernel(_dequantize_blocks, fmt)
        kernel(payload_rows.unflatten(1, (nblocks, fmt.block_size)), scale_rows, out.view(rows, nblocks, fmt.block_size))
        return
    dequantize_each_row(payload_rows, scale_rows, fmt, out, dequantize)


def _fold_region(
    formula: Callable[..., Any], payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, first: bool
) -> tuple:
    """Run an _accumulate-style formula on a region of whole blocks and write its payload and scales back."""
    n = scales.numel() * fmt.block_size
    if grad.numel() > n or payload.numel() != fmt.payload_bytes(n):
        raise ValueError(
            f"folding a gradient needs storage of whole blocks: {payload.numel()} bytes and {scales.numel()} scales "
            f"for {n} values of {fmt.name}, and at most {n} gradient values (got {grad.numel()})"
        )
    g = grad.detach().reshape(-1)
    g = F.pad(g, (0, n - g.numel())) if g.numel() != n else g
    kernel = _format_kernel(formula, fmt, first=first, max_value=fmt.max_value)
    # A first fold reads no codes: its graph gets the payload as it is (no conversion).
    new_codes, new_scales, *rest = kernel(payload if first and fmt.bits == 8 else _codes(payload, fmt), scales, g)
    _pack_codes(new_codes, fmt.bits, payload)
    scales.copy_(new_scales)
    return tuple(rest)


def accumulate_(payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, *, first: bool) -> None:
    """In place: (payload, scales) := quantize(grad if first else dequantize(payload, scales) + grad).

    The region holds whole blocks; ``grad`` may be shorter (the rest adds zero). Blocks that end up
    holding NaN/Inf get a NaN scale (their codes are unspecified).
    """
    if scales.numel():
        _fold_region(_accumulate, payload, scales, grad, fmt, first)


def fold_(payload: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat, *, first: bool) -> torch.Tensor:
    """In place, for the gradient buffer: accumulate_, then a non-finite block's scale is set to 0
    (its values read as zeros and stay off the wire). Returns a 0-d bool tensor: whether any block
    was non-finite (no host sync here; the buffer reads all flags once per step)."""
    (bad,) = _fold_region(_fold, payload, scales, grad, fmt, first)
    return bad


def sum_of_squares(q: QTensor) -> torch.Tensor:
    """The fp64 sum of the squares of the values ``q`` holds, which must be whole blocks (e.g. a
    gradient buffer's), read in one pass: no fp32 copy, nor a call per piece of one."""
    fmt = q.fmt
    if not q.whole_blocks:
        raise ValueError(f"sum_of_squares needs whole blocks of {fmt.block_size} values, got {q.numel} values")
    if q.numel == 0:
        return torch.zeros((), dtype=torch.float64, device=q.device)
    kernel = _format_kernel(_sum_of_squares, fmt)
    return kernel(_codes(q.payload, fmt).view(-1, fmt.block_size), q.scales)


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
    the sum, into ``out`` (payload, scales: contiguous) where given.

    The sum requantized and not kept, of int8 rows: by the vector kernel where it applies
    (agoq.quant.simd; the same bytes).
    """
    w, nblocks = scale_rows.shape
    n = nblocks * fmt.block_size
    if payload_rows.shape != (w, fmt.payload_bytes(n)):
        raise ValueError(
            f"reduce_rows needs payload rows of {fmt.payload_bytes(n)} bytes for {nblocks} blocks of {fmt.name}, got {tuple(payload_rows.shape)}"
        )
    vector = simd.reduce_rows_kernel(fmt, payload_rows.device) if requantize and not keep_sum else None
    if vector is not None and payload_rows.stride(1) == 1 and scale_rows.stride(1) == 1:
        payload, scales = out if out is not None else (torch.empty(n, dtype=torch.uint8), torch.empty(nblocks, dtype=SCALE_DTYPE))
        vector(payload_rows, scale_rows, payload, scales, average)
        return None, QTensor(payload, scales, torch.Size([n]), torch.float32, fmt)
    # Rows of 8-bit codes are read where they lie (any row stride); others are unpacked first.
    code_rows = payload_rows if fmt.bits == 8 and payload_rows.stride(1) == 1 else payload_rows.contiguous()
    codes = _codes(code_rows, fmt).view(w, -1)
    kernel = _format_kernel(_reduce_rows, fmt, average=average, rows=w, keep_sum=keep_sum, requantize=requantize, max_value=fmt.max_value)
    outputs = kernel(codes, scale_rows)
    acc = outputs[0] if keep_sum else None
    q = QTensor(_pack_codes(outputs[-2], fmt.bits), outputs[-1], torch.Size([n]), torch.float32, fmt) if requantize else None
    if q is not None and not bool(torch.isfinite(q.scales).all()):
        # A non-finite block: the reference requantizes the sum (rare; the sum is computed again if it was not kept).
        if acc is None:
            summed = _format_kernel(_reduce_rows, fmt, average=average, rows=w, keep_sum=True, requantize=False, max_value=fmt.max_value)
            (acc,) = summed(codes, scale_rows)
        q = reference_quantize(acc, fmt, nonfinite="propagate")
        acc = acc if keep_sum else None
    if q is not None and out is not None:
        out[0].copy_(q.payload)
        out[1].copy_(q.scales)
        q = QTensor(out[0], out[1], q.shape, q.dtype, fmt)
    return acc, q


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
