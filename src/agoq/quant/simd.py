"""Hand-written vector loops (AVX-512 or AVX2) for the 8-bit gradient wire's local work on CPUs:
fp32 rows quantized into int8 blocks, and W rows of int8 blocks summed and requantized.

Why not inductor's code here: quantizing fp32 into int8 blocks is the largest local cost of the
8-bit all-reduce on a CPU, and inductor's code for it runs at about 0.3x of a copy (per block:
two horizontal reductions, a scalar scale, and codes narrowed to bytes through a memcpy per
vector). This loop runs at the speed of a copy: 2M values into wire rows, one thread, AMX Xeon
(AVX-512), 0.59 ms against 1.93 ms warm and 0.77 ms against 2.53 ms from memory (a copy of the
same fp32: 0.58 and 0.75 ms). The sum-and-requantize of the received rows shares its encoding.
It is plain C with the vector intrinsics, no torch headers, so it
builds in about a second, with the C++ compiler inductor uses, once per machine: the library is
kept in inductor's cache folder (agoq.inductor_cache), named by the hash of its source, flags and
compiler, and written under a temporary name then renamed, so ranks that build it at once never
load half a file.

Bit-identical to the reference (agoq.quant.qtensor), by construction and by test
(tests/test_simd.py): the block's absmax, s = absmax / max_value raised one ulp where s * max_value
< absmax in fp64, codes = round-half-even(x / s) + zero, x divided by s and never multiplied by a
reciprocal (that would change codes), s = 0 dividing by 1; a block holding NaN/Inf gets a NaN
scale and the code of 0 for every value, as the reference writes it.

Only where it applies: int8 codes of fp32 input on an x86 CPU with AVX-512 or AVX2 (as torch
reports it, so ATEN_CPU_CAPABILITY=avx2 holds it to AVX2), and at most MAX_THREADS torch threads:
the loops are single-threaded, and inductor's parallel code overtakes them from about 3.4. Everywhere
else, or with AGOQ_SIMD=0, or where it cannot be built (one warning), callers get None and use
inductor's code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

from agoq.quant.formats import QuantFormat

ENV_VAR = "AGOQ_SIMD"
# The loop runs on one thread; inductor's OpenMP code was 3.4x slower per thread (above).
MAX_THREADS = 3

# Each loop is written once, over a vector of W floats whose few operations each ISA defines in a
# line. Blocks are whole multiples of 2W (two accumulators for the absmax: max has a latency of 4
# cycles), and at most AGOQ_MAX_BLOCK values (the reduction keeps a block's sum on the stack).
_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define AGOQ_MAX_BLOCK 4096

#ifdef __AVX512F__
#define W 16
typedef __m512 vec;
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vcodes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline vec vabs(vec v) { return _mm512_abs_ps(v); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* Lanes of |x| that are Inf or NaN: not below infinity, or unordered. */
static inline int vnonfinite(vec a) { return _mm512_cmp_ps_mask(a, vset(INFINITY), _CMP_NLT_UQ) != 0; }
static inline float vhmax(vec v) { return _mm512_reduce_max_ps(v); }
/* Codes (exact integers 0..255 as floats) to bytes. */
static inline void vstore_codes(uint8_t* p, vec q) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q))); }
#else
#define W 8
typedef __m256 vec;
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vcodes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline vec vabs(vec v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline int vnonfinite(vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, vset(INFINITY), _CMP_NLT_UQ)) != 0; }
static inline float vhmax(vec v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
static inline void vstore_codes(uint8_t* p, vec q) {
    __m256i k = _mm256_cvtps_epi32(q);
    __m128i k16 = _mm_packus_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
    _mm_storel_epi64((__m128i*)p, _mm_packus_epi16(k16, k16));
}
#endif

/* The reference's scale of a block whose largest |value| is absmax (finite). */
static inline float block_scale(float absmax, float max_value) {
    float s = absmax / max_value;
    if ((double)s * (double)max_value < (double)absmax) s = nextafterf(s, INFINITY);
    return s;
}

/* Codes of a block whose absmax is known (v: its values; bad: it holds NaN/Inf), and its scale. */
static inline float encode_block(const float* v, int64_t block, float absmax, int bad, uint8_t* c, float max_value, float zero) {
    if (bad) {
        memset(c, (int)zero, (size_t)block); /* the reference's codes: the block's values as zeros */
        return NAN;
    }
    float s = block_scale(absmax, max_value);
    const vec d = vset(s > 0 ? s : 1.0f), zero_code = vset(zero);
    for (int64_t i = 0; i < block; i += W) vstore_codes(c + i, vadd(vround(vdiv(vload(v + i), d)), zero_code));
    return s;
}

void agoq_quantize_rows(const float* x, int64_t rows, int64_t n, int64_t block, uint8_t* codes, int64_t code_stride,
                        float* scales, int64_t scale_stride, float max_value, float zero) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < n / block; ++b) {
            const float* v = x + r * n + b * block;
            vec m0 = vset(0.0f), m1 = vset(0.0f);
            int bad = 0;
            for (int64_t i = 0; i < block; i += 2 * W) {
                vec a0 = vabs(vload(v + i)), a1 = vabs(vload(v + i + W));
                bad |= vnonfinite(a0) | vnonfinite(a1);
                m0 = vmax(m0, a0);
                m1 = vmax(m1, a1);
            }
            float absmax = vhmax(vmax(m0, m1));
            scales[r * scale_stride + b] = encode_block(v, block, absmax, bad, codes + r * code_stride + b * block, max_value, zero);
        }
    }
}

/* Sum W rows of codes as values (code - zero) * scale, in fp32 in row order (then / rows if
   average), and requantize the sum: the reference's reduce_rows with requantize. */
void agoq_reduce_rows(const uint8_t* codes, int64_t code_stride, const float* scales, int64_t scale_stride, int64_t rows,
                      int64_t n, int64_t block, int average, uint8_t* out_codes, float* out_scales, float max_value, float zero) {
    float sum[AGOQ_MAX_BLOCK];
    const vec zero_code = vset(zero), count = vset((float)rows);
    for (int64_t b = 0; b < n / block; ++b) {
        vec m = vset(0.0f);
        int bad = 0;
        for (int64_t i = 0; i < block; i += W) {
            vec acc = vset(0.0f);
            for (int64_t r = 0; r < rows; ++r) {
                vec value = vmul(vsub(vcodes(codes + r * code_stride + b * block + i), zero_code), vset(scales[r * scale_stride + b]));
                acc = r ? vadd(acc, value) : value;
            }
            if (average) acc = vdiv(acc, count);
            vstore(sum + i, acc);
            vec a = vabs(acc);
            bad |= vnonfinite(a);
            m = vmax(m, a);
        }
        out_scales[b] = encode_block(sum, block, vhmax(m), bad, out_codes + b * block, max_value, zero);
    }
}
"""
_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"], "avx2": ["-mavx2", "-mfma"]}
_LANES = {"avx512": 16, "avx2": 8}


def enabled() -> bool:
    """Whether AGOQ_SIMD allows the kernel (any value but 0 / false / off)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def isa() -> str | None:
    """The vector ISA the loops are built for on this CPU (torch's own capability, fixed when torch
    loads): avx512, avx2, or None. Read once: every quantize and reduction of the wire asks."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return capability if capability in _FLAGS else None


def _compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


@functools.lru_cache(maxsize=None)
def library(which: str) -> ctypes.CDLL | None:
    """The loops built for ``which`` (avx512 / avx2), loaded; None (with one warning) where they cannot be built."""
    from agoq.inductor_cache import inductor_cache_folder

    try:
        compiler = _compiler()
        # No contraction into FMAs: the reference rounds each product and each sum.
        flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-x", "c", *_FLAGS[which]]
        key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags]).encode()).hexdigest()[:20]
        folder = inductor_cache_folder() / "agoq_simd"
        path = folder / f"int8_wire_{which}_{key}.so"
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            _build(compiler, flags, folder, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        warnings.warn(
            f"agoq: could not build the {which} int8 wire kernels ({first_line[:200]}); inductor's code runs instead "
            f"(same results, slower); set {ENV_VAR}=0 to skip it",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.agoq_quantize_rows.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, f32, f32]
    lib.agoq_reduce_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, ptr, f32, f32]
    lib.agoq_quantize_rows.restype = lib.agoq_reduce_rows.restype = None
    return lib


def _build(compiler: str, flags: list[str], folder: Path, path: Path) -> None:
    """Compile _SOURCE into ``path``, through a temporary name renamed into place (atomic on one file system)."""
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        source, built = Path(tmp) / "int8_wire.c", Path(tmp) / path.name
        source.write_text(_SOURCE)
        result = subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip() or f"{compiler} exited with {result.returncode}")
        os.replace(built, path)


# The reduction sums a block in a buffer on the stack (16 KiB): AGOQ_MAX_BLOCK above.
MAX_BLOCK = 4096


def _applies(fmt: QuantFormat, device: torch.device) -> ctypes.CDLL | None:
    """The library, where the kernels apply to ``fmt`` on ``device`` (see the module's docstring)."""
    which = isa()
    if (
        which is None
        or not enabled()
        or device.type != "cpu"
        or fmt.kind != "int"
        or fmt.bits != 8
        or fmt.block_size % (2 * _LANES[which])
        or fmt.block_size > MAX_BLOCK
        or torch.get_num_threads() > MAX_THREADS
    ):
        return None
    return library(which)


def _constants(fmt: QuantFormat) -> tuple[float, float]:
    """(max value, zero code) of an int format, as the kernels take them."""
    return float(fmt.max_value), float(1 << (fmt.bits - 1))


def quantize_rows_kernel(fmt: QuantFormat, x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """The kernel quantizing ``x`` ([rows, n] fp32, contiguous) in ``fmt``, called with (x, code
    rows uint8 [rows, n], scale rows fp32 [rows, n / block]; both any row stride, contiguous
    within a row); None where it does not apply (see the module's docstring)."""
    lib = _applies(fmt, x.device) if x.dtype == torch.float32 else None
    if lib is None:
        return None
    max_value, zero = _constants(fmt)

    def run(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        rows, n = x.shape
        if not x.is_contiguous() or codes.shape != (rows, n) or scales.shape != (rows, n // fmt.block_size) or n % fmt.block_size:
            raise ValueError(f"quantize_rows: x [{rows}, {n}] of whole blocks, contiguous, with matching code and scale rows")
        if codes.stride(1) != 1 or scales.stride(1) != 1 or codes.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise ValueError("quantize_rows: uint8 code rows and fp32 scale rows, each contiguous within a row")
        lib.agoq_quantize_rows(
            x.data_ptr(), rows, n, fmt.block_size, codes.data_ptr(), codes.stride(0), scales.data_ptr(), scales.stride(0), max_value, zero
        )

    return run


def reduce_rows_kernel(fmt: QuantFormat, device: torch.device) -> Callable[..., None] | None:
    """The kernel summing W rows of ``fmt`` codes and requantizing the sum, as the reference's
    reduce_rows: called with (code rows uint8 [W, n], scale rows fp32 [W, n / block], both any row
    stride; out codes uint8 [n], out scales fp32 [n / block], both contiguous; average). Values
    are (code - zero) * scale, summed in fp32 in row order, divided by W for an average, then
    quantized as quantize_rows_kernel does. None where it does not apply."""
    lib = _applies(fmt, device)
    if lib is None:
        return None
    max_value, zero = _constants(fmt)

    def run(codes: torch.Tensor, scales: torch.Tensor, out_codes: torch.Tensor, out_scales: torch.Tensor, average: bool) -> None:
        rows, n = codes.shape
        if scales.shape != (rows, n // fmt.block_size) or n % fmt.block_size or out_codes.shape != (n,) or out_scales.shape != (n // fmt.block_size,):
            raise ValueError(f"reduce_rows: code rows [{rows}, {n}] of whole blocks, scale rows and outputs to match")
        if codes.stride(1) != 1 or scales.stride(1) != 1 or not (out_codes.is_contiguous() and out_scales.is_contiguous()):
            raise ValueError("reduce_rows: rows contiguous within a row, outputs contiguous")
        if codes.dtype != torch.uint8 or out_codes.dtype != torch.uint8 or scales.dtype != torch.float32 or out_scales.dtype != torch.float32:
            raise ValueError("reduce_rows: uint8 codes and fp32 scales, in and out")
        lib.agoq_reduce_rows(
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            rows,
            n,
            fmt.block_size,
            int(average),
            out_codes.data_ptr(),
            out_scales.data_ptr(),
            max_value,
            zero,
        )

    return run


__all__ = ["ENV_VAR", "MAX_BLOCK", "MAX_THREADS", "enabled", "isa", "library", "quantize_rows_kernel", "reduce_rows_kernel"]
