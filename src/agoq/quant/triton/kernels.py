"""Triton kernels of agoq.quant: block-wise quantize/dequantize with packing, and the fused passes.

Every kernel reproduces the torch reference (agoq.quant.qtensor, agoq.activation.ops,
agoq.gradient) operation for operation, so quantized codes are bit-identical to it wherever the
inputs are, on GPUs and under ``TRITON_INTERPRET=1``:

- divisions are IEEE round-to-nearest (``div_rn``), as torch's tensor division; Triton's ``/`` is
  an approximate division on NVIDIA GPUs;
- rounding to an integer is ties-to-even, like ``torch.round``: adding and removing 1.5 * 2**23
  leaves no fraction bits in fp32 (valid for |y| <= 2**22; here |y| <= 448). Triton's own
  round/cast helpers differ at .5 ties (half away from zero, and the interpreter's fp32 -> bf16
  cast truncates its carry), so none of them is used;
- bf16 is read and written as raw 16-bit patterns with an explicit round-to-nearest-even, and
  every launch passes ``enable_fp_fusion=False`` so ``v * s + g`` is never contracted into an FMA
  (the torch path rounds the product first);
- every offset (elements, bytes, blocks, rows) is int64: a program id or row index is widened
  before it is multiplied, since int32 products wrap at 2**31, which a reduce-scatter's wire
  buffer or a large activation passes;
- loops over runtime bounds are ``while`` loops: the interpreter of triton < 3.7 turns a ``range()``
  bound into an int with ``int()`` of a one-element array, a TypeError since NumPy 2.4.

A tile is ``[R, BP]``: R quantization blocks of BLOCK values (BP = BLOCK rounded up to a power of
two). Blocks hold whole packing groups (BLOCK % 8 == 0), so a block's codes fill whole bytes and
every block is packed independently: group k of a block (G codes) becomes GB little-endian bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Format kinds as kernel constants.
KIND_INT, KIND_TABLE, KIND_FP8 = 0, 1, 2
# 1.5 * 2**23: y + RINT_MAGIC has no fraction bits left, and its rounding is IEEE ties-to-even.
RINT_MAGIC = 12582912.0


# ---- element helpers ---------------------------------------------------------------------------


@triton.jit
def _rint(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _load_f32(ptr, offs, mask, IN_BF16: tl.constexpr):
    """fp32 values of a float tensor; bf16 arrives as int16 bit patterns (an exact widening)."""
    if IN_BF16:
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        return ((b & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _round_bf16_bits(v):
    """int32 holding the bf16 bit pattern of fp32 v, rounded to nearest even (torch's rule)."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def _round_to(v, OUT_BF16: tl.constexpr):
    """v rounded to bf16 and widened back (as torch's .to(bfloat16).float()); identity otherwise."""
    if OUT_BF16:
        return (_round_bf16_bits(v) << 16).to(tl.float32, bitcast=True)
    else:
        return v


@triton.jit
def _store_f(ptr, offs, v, mask, OUT_BF16: tl.constexpr):
    """Store fp32 v into a float tensor (bf16 through an int16 view), rounding to nearest even."""
    if OUT_BF16:
        tl.store(ptr + offs, _round_bf16_bits(v).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


# ---- one tile of blocks: scales, codes, packing ---------------------------------------------------


@triton.jit
def _encode(y, bnd_ptr, code_ptr, KIND: tl.constexpr, BITS: tl.constexpr, NBND: tl.constexpr):
    """int32 codes of scaled values y (|y| <= max_value), nearest rounding with the format's tie rule."""
    if KIND == 0:
        return _rint(y).to(tl.int32) + (1 << (BITS - 1))
    elif KIND == 1:
        # Value i wins iff i decision boundaries lie below y; the ties are built into the boundaries.
        idx = tl.zeros(y.shape, tl.int32)
        for i in tl.static_range(NBND):
            idx += (y > tl.load(bnd_ptr + i)).to(tl.int32)
        return tl.load(code_ptr + idx).to(tl.int32)
    else:
        # FP8 E4M3: the quantum of |y| is 2**(e - 3) with e its binade, at least the normal -6;
        # mantissa m = rint(|y| / quantum) (ties to even) gives code (e + 6) * 8 + m, which also
        # covers subnormals (e = -6, m < 8) and the carry into the next binade (m = 16).
        b = y.to(tl.int32, bitcast=True)
        sign = (b >> 31) & 1
        e = tl.maximum(((b >> 23) & 0xFF) - 127, -6)
        quantum_inv = ((130 - e) << 23).to(tl.float32, bitcast=True)
        m = _rint(tl.abs(y) * quantum_inv).to(tl.int32)
        return (e + 6) * 8 + m + sign * 128


@triton.jit
def _decode(codes, val_ptr, KIND: tl.constexpr, BITS: tl.constexpr):
    """fp32 format values (before scaling) of int32 codes."""
    if KIND == 0:
        return (codes - (1 << (BITS - 1))).to(tl.float32)
    else:
        return tl.load(val_ptr + codes)


@triton.jit
def _quantize_tile(x, valid, bnd_ptr, code_ptr, KIND: tl.constexpr, BITS: tl.constexpr, NBND: tl.constexpr, MAXV: tl.constexpr):
    """(int32 codes [NB, BP], fp32 scales [NB]) of a tile of blocks; invalid lanes get code 0.

    A block holding NaN/Inf gets a NaN scale and the codes of zeros (nonfinite='propagate').
    """
    ok = (x - x == 0.0) | (valid == 0)  # not ~valid: triton <= 3.3's interpreter cannot invert a boolean
    finite = tl.min(ok.to(tl.int32), axis=1) > 0
    x = tl.where(finite[:, None] & valid, x, 0.0)
    absmax = tl.max(tl.abs(x), axis=1)
    s = tl.math.div_rn(absmax, tl.full(absmax.shape, MAXV, tl.float32))
    # s * max_value is exact in fp64: where it falls short of absmax, the next fp32 up is the scale.
    low = s.to(tl.float64) * MAXV < absmax.to(tl.float64)
    s = tl.where(low, (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), s)
    y = tl.math.div_rn(x, tl.where(s > 0.0, s, 1.0)[:, None])
    codes = tl.where(valid, _encode(y, bnd_ptr, code_ptr, KIND, BITS, NBND), 0)
    return codes, tl.where(finite, s, float("nan"))


@triton.jit
def _store_codes(
    pay_ptr,
    codes,
    blk,
    nbytes,
    NB: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Pack int32 codes [NB, BP] of blocks ``blk`` [NB] into the payload (bytes < nbytes only)."""
    lane = tl.arange(0, G)
    words = tl.sum(tl.reshape(codes, [NB, BP // G, G]).to(tl.int64) << (lane * BITS).to(tl.int64)[None, None, :], axis=2)
    j = tl.arange(0, GBP)
    grp = tl.arange(0, BP // G)
    data = (words[:, :, None] >> (j * 8).to(tl.int64)[None, None, :]) & 0xFF
    offs = blk.to(tl.int64)[:, None, None] * (BLOCK * BITS // 8) + grp[None, :, None] * GB + j[None, None, :]
    mask = (grp < BLOCK // G)[None, :, None] & (j < GB)[None, None, :] & (offs < nbytes)
    tl.store(pay_ptr + offs, data.to(tl.uint8), mask=mask)


@triton.jit
def _quantize_store(
    x,
    valid,
    blk,
    blk_ok,
    pay_ptr,
    sc_ptr,
    bnd_ptr,
    code_ptr,
    nbytes,
    NB: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Quantize a tile [NB, BP] of blocks ``blk``: packed codes into the payload, scales where ``blk_ok``."""
    codes, s = _quantize_tile(x, valid, bnd_ptr, code_ptr, KIND, BITS, NBND, MAXV)
    _store_codes(pay_ptr, codes, blk, nbytes, NB, BP, BLOCK, BITS, G, GB, GBP)
    tl.store(sc_ptr + blk, s, mask=blk_ok)


@triton.jit
def _load_codes(
    pay_ptr,
    blk,
    nbytes,
    NB: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """int32 codes [NB, BP] of blocks ``blk`` [NB] unpacked from the payload."""
    j = tl.arange(0, GBP)
    grp = tl.arange(0, BP // G)
    offs = blk.to(tl.int64)[:, None, None] * (BLOCK * BITS // 8) + grp[None, :, None] * GB + j[None, None, :]
    mask = (grp < BLOCK // G)[None, :, None] & (j < GB)[None, None, :] & (offs < nbytes)
    data = tl.load(pay_ptr + offs, mask=mask, other=0).to(tl.int64)
    words = tl.sum(data << (j * 8).to(tl.int64)[None, None, :], axis=2)
    lane = tl.arange(0, G)
    codes = (words[:, :, None] >> (lane * BITS).to(tl.int64)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes.to(tl.int32), [NB, BP])


@triton.jit
def _dequantize_tile(
    pay_ptr,
    sc_ptr,
    val_ptr,
    blk,
    blk_ok,
    nbytes,
    NB: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """fp32 values [NB, BP] of blocks ``blk`` (format value times block scale, rounded once)."""
    codes = _load_codes(pay_ptr, blk, nbytes, NB, BP, BLOCK, BITS, G, GB, GBP)
    s = tl.load(sc_ptr + blk, mask=blk_ok, other=0.0)
    return _decode(codes, val_ptr, KIND, BITS) * s[:, None]


# ---- quantize / dequantize -------------------------------------------------------------------------

# The kernels' signatures repeat on purpose: Triton specializes on constexprs declared by name, and the
# launchers (ops._Spec.constants / unpacking) pass the same set as keywords to every kernel.


@triton.jit
def _flat_tile(n, BLOCK: tl.constexpr, BP: tl.constexpr, R: tl.constexpr):
    """This program's R blocks of a flat tensor of n values: block indices [R], element offsets and validity [R, BP]."""
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    col = tl.arange(0, BP)
    e = blk.to(tl.int64)[:, None] * BLOCK + col[None, :]
    valid = (col < BLOCK)[None, :] & (e < n)
    return blk, e, valid


@triton.jit
def quantize_kernel(
    x_ptr,
    pay_ptr,
    sc_ptr,
    bnd_ptr,
    code_ptr,
    n,
    nblocks,
    nbytes,
    IN_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Quantize n values into packed codes and one fp32 scale per block (NaN for non-finite blocks)."""
    blk, e, valid = _flat_tile(n, BLOCK, BP, R)
    x = _load_f32(x_ptr, e, valid, IN_BF16)
    _quantize_store(x, valid, blk, blk < nblocks, pay_ptr, sc_ptr, bnd_ptr, code_ptr, nbytes, R, BP, BLOCK, KIND, BITS, NBND, MAXV, G, GB, GBP)


@triton.jit
def dequantize_kernel(
    pay_ptr,
    sc_ptr,
    val_ptr,
    out_ptr,
    n,
    nblocks,
    nbytes,
    OUT_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Dequantize n values into a float tensor."""
    blk, e, valid = _flat_tile(n, BLOCK, BP, R)
    v = _dequantize_tile(pay_ptr, sc_ptr, val_ptr, blk, blk < nblocks, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
    _store_f(out_ptr, e, v, valid, OUT_BF16)


# ---- RMSNorm: forward with the quantized input, backward from it -----------------------------------


@triton.jit
def _row_tile(t0, T, H: tl.constexpr, HP: tl.constexpr, RT: tl.constexpr):
    rows = t0 + tl.arange(0, RT)
    col = tl.arange(0, HP)
    e = rows.to(tl.int64)[:, None] * H + col[None, :]
    valid = (rows < T)[:, None] & (col < H)[None, :]
    return rows, col, e, valid


@triton.jit
def _rstd(x, eps, H: tl.constexpr):
    """fp32 1 / sqrt(mean(x^2) + eps) per row, both steps correctly rounded."""
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), tl.full([x.shape[0]], H, tl.float32))
    return tl.math.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms + eps))


@triton.jit
def _norm_store(x, w_ptr, col, h_ptr, e, valid, eps, H: tl.constexpr, OUT_BF16: tl.constexpr):
    """Store h = RMSNorm(x) * w for the fp32 rows x [RT, HP]; returns their rstd [RT]."""
    w = tl.load(w_ptr + col, mask=col < H, other=0.0).to(tl.float32)
    rstd = _rstd(x, eps, H)
    _store_f(h_ptr, e, x * rstd[:, None] * w[None, :], valid, OUT_BF16)
    return rstd


@triton.jit
def _row_blocks(t0, T, H: tl.constexpr, HP: tl.constexpr, RT: tl.constexpr, BLOCK: tl.constexpr):
    """Global block index and validity of the RT * HP // BLOCK blocks of the rows t0..t0+RT."""
    k = tl.arange(0, RT * (HP // BLOCK))
    r = t0 + k // (HP // BLOCK)
    c = k % (HP // BLOCK)
    return r * (H // BLOCK) + c, (r < T) & (c < H // BLOCK)


@triton.jit
def rms_norm_quantize_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    pay_ptr,
    sc_ptr,
    bnd_ptr,
    code_ptr,
    T,
    eps,
    nbytes,
    IN_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    RT: tl.constexpr,
    BLOCK: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """h = RMSNorm(x) * w in x's dtype, and x quantized block-wise, from one read of x."""
    t0 = tl.program_id(0).to(tl.int64) * RT
    rows, col, e, valid = _row_tile(t0, T, H, HP, RT)
    x = _load_f32(x_ptr, e, valid, IN_BF16)
    _norm_store(x, w_ptr, col, h_ptr, e, valid, eps, H, IN_BF16)
    blk, blk_ok = _row_blocks(t0, T, H, HP, RT, BLOCK)
    NB: tl.constexpr = RT * (HP // BLOCK)
    xb = tl.reshape(x, [NB, BLOCK])
    vb = tl.reshape(valid, [NB, BLOCK])
    _quantize_store(xb, vb, blk, blk_ok, pay_ptr, sc_ptr, bnd_ptr, code_ptr, nbytes, NB, BLOCK, BLOCK, KIND, BITS, NBND, MAXV, G, GB, GBP)


@triton.jit
def _dequantize_rows(
    pay_ptr,
    sc_ptr,
    val_ptr,
    t0,
    T,
    nbytes,
    valid,
    H: tl.constexpr,
    HP: tl.constexpr,
    RT: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """fp32 [RT, HP] values of the quantized rows t0..t0+RT (zeros outside ``valid``)."""
    blk, blk_ok = _row_blocks(t0, T, H, HP, RT, BLOCK)
    v = _dequantize_tile(pay_ptr, sc_ptr, val_ptr, blk, blk_ok, nbytes, RT * (HP // BLOCK), BLOCK, BLOCK, KIND, BITS, G, GB, GBP)
    return tl.where(valid, tl.reshape(v, [RT, HP]), 0.0)


@triton.jit
def rms_norm_recompute_kernel(
    pay_ptr,
    sc_ptr,
    val_ptr,
    w_ptr,
    h_ptr,
    rstd_ptr,
    T,
    eps,
    nbytes,
    OUT_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    RT: tl.constexpr,
    BLOCK: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """From the quantized norm input: rstd (fp32) and the GEMM input RMSNorm(x) * w, in one pass."""
    t0 = tl.program_id(0).to(tl.int64) * RT
    rows, col, e, valid = _row_tile(t0, T, H, HP, RT)
    x = _dequantize_rows(pay_ptr, sc_ptr, val_ptr, t0, T, nbytes, valid, H, HP, RT, BLOCK, KIND, BITS, G, GB, GBP)
    rstd = _norm_store(x, w_ptr, col, h_ptr, e, valid, eps, H, OUT_BF16)
    tl.store(rstd_ptr + rows, rstd, mask=rows < T)


@triton.jit
def rms_norm_backward_kernel(
    gh_ptr,
    pay_ptr,
    sc_ptr,
    val_ptr,
    rstd_ptr,
    w_ptr,
    gx_ptr,
    gw_ptr,
    T,
    nbytes,
    GH_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    NEED_GW: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    RT: tl.constexpr,
    BLOCK: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """RMSNorm input gradient from the quantized input, and one weight-gradient partial per program.

    Programs stride over row tiles, so the partials are [programs, H] whatever the token count
    (summed by the caller: deterministic, unlike atomics).
    """
    pid = tl.program_id(0)
    col = tl.arange(0, HP)
    w = tl.load(w_ptr + col, mask=col < H, other=0.0).to(tl.float32)
    gw = tl.zeros([HP], tl.float32)
    t0 = pid.to(tl.int64) * RT
    while t0 < T:  # not range(): see the module docstring
        rows, _, e, valid = _row_tile(t0, T, H, HP, RT)
        x = _dequantize_rows(pay_ptr, sc_ptr, val_ptr, t0, T, nbytes, valid, H, HP, RT, BLOCK, KIND, BITS, G, GB, GBP)
        rstd = tl.load(rstd_ptr + rows, mask=rows < T, other=0.0)
        g = _load_f32(gh_ptr, e, valid, GH_BF16)
        y = x * rstd[:, None]
        gy = g * w[None, :]
        # d(x * rstd)/dx^T v = rstd * (v - y * mean(y * v)): rstd depends on x through mean(x^2).
        dot = tl.math.div_rn(tl.sum(gy * y, axis=1), tl.full([RT], H, tl.float32))
        _store_f(gx_ptr, e, rstd[:, None] * (gy - y * dot[:, None]), valid, OUT_BF16)
        gw += tl.sum(g * y, axis=0)
        t0 += tl.num_programs(0).to(tl.int64) * RT
    if NEED_GW:
        tl.store(gw_ptr + pid.to(tl.int64) * H + col, gw, mask=col < H)


# ---- SwiGLU: forward with quantized gate/up, backward from them -------------------------------------


@triton.jit
def _sigmoid(z):
    return tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))


@triton.jit
def swiglu_quantize_kernel(
    g_ptr,
    u_ptr,
    act_ptr,
    gpay_ptr,
    gsc_ptr,
    upay_ptr,
    usc_ptr,
    bnd_ptr,
    code_ptr,
    n,
    nblocks,
    nbytes,
    IN_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """act = SiLU(gate) * up in the inputs' dtype, and gate and up quantized, from one read of each."""
    blk, e, valid = _flat_tile(n, BLOCK, BP, R)
    gate = _load_f32(g_ptr, e, valid, IN_BF16)
    up = _load_f32(u_ptr, e, valid, IN_BF16)
    # As F.silu(gate) * up in the compute dtype: SiLU (torch's x / (1 + exp(-x))) rounded to it,
    # then the product rounded.
    silu = _round_to(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), IN_BF16)
    _store_f(act_ptr, e, silu * up, valid, IN_BF16)
    ok = blk < nblocks
    _quantize_store(gate, valid, blk, ok, gpay_ptr, gsc_ptr, bnd_ptr, code_ptr, nbytes, R, BP, BLOCK, KIND, BITS, NBND, MAXV, G, GB, GBP)
    _quantize_store(up, valid, blk, ok, upay_ptr, usc_ptr, bnd_ptr, code_ptr, nbytes, R, BP, BLOCK, KIND, BITS, NBND, MAXV, G, GB, GBP)


@triton.jit
def swiglu_backward_kernel(
    ga_ptr,
    gpay_ptr,
    gsc_ptr,
    upay_ptr,
    usc_ptr,
    val_ptr,
    act_ptr,
    gg_ptr,
    gu_ptr,
    n,
    nblocks,
    nbytes,
    GA_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    NEED_ACT: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """From quantized gate/up and grad of SiLU(gate) * up: the recomputed product and both gradients."""
    blk, e, valid = _flat_tile(n, BLOCK, BP, R)
    ok = blk < nblocks
    gate = _dequantize_tile(gpay_ptr, gsc_ptr, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
    up = _dequantize_tile(upay_ptr, usc_ptr, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
    sig = _sigmoid(gate)
    silu = gate * sig
    if NEED_ACT:
        _store_f(act_ptr, e, silu * up, valid, OUT_BF16)
    ga = _load_f32(ga_ptr, e, valid, GA_BF16)
    _store_f(gg_ptr, e, ga * up * sig * (1.0 + gate * (1.0 - sig)), valid, OUT_BF16)
    _store_f(gu_ptr, e, ga * silu, valid, OUT_BF16)


# ---- QuanGrad: accumulation and the all-reduce's local step ------------------------------------------


@triton.jit
def accumulate_kernel(
    pay_ptr,
    sc_ptr,
    g_ptr,
    val_ptr,
    bnd_ptr,
    code_ptr,
    k,
    n,
    nblocks,
    nbytes,
    FIRST: tl.constexpr,
    IN_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """In place: stored blocks := quantize(dequantize(stored) + g) (or quantize(g) on the first fold).

    g has k <= n values; the rest of the last block adds nothing. Each program reads and writes
    only its own blocks, so the update is safe in place.
    """
    blk, e, valid = _flat_tile(n, BLOCK, BP, R)
    g = _load_f32(g_ptr, e, valid & (e < k), IN_BF16)
    if FIRST:
        x = g
    else:
        x = _dequantize_tile(pay_ptr, sc_ptr, val_ptr, blk, blk < nblocks, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP) + g
    _quantize_store(x, valid, blk, blk < nblocks, pay_ptr, sc_ptr, bnd_ptr, code_ptr, nbytes, R, BP, BLOCK, KIND, BITS, NBND, MAXV, G, GB, GBP)


@triton.jit
def reduce_rows_kernel(
    pay_ptr,
    row_stride,
    sc_ptr,
    val_ptr,
    bnd_ptr,
    code_ptr,
    acc_ptr,
    out_pay_ptr,
    out_sc_ptr,
    W,
    nblocks,
    nbytes,
    AVG: tl.constexpr,
    STORE_SUM: tl.constexpr,
    REQUANT: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Sum W quantized rows in fp32 in row order (optionally / W); store the sum and/or requantize it."""
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    ok = blk < nblocks
    col = tl.arange(0, BP)
    e = blk.to(tl.int64)[:, None] * BLOCK + col[None, :]
    valid = (col < BLOCK)[None, :] & ok[:, None]
    acc = _dequantize_tile(pay_ptr, sc_ptr, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
    r = tl.full([], 1, tl.int64)  # row r starts r * row_stride bytes in: 2**31 and more in a large reduce-scatter
    while r < W:  # not range(): see the module docstring
        acc += _dequantize_tile(pay_ptr + r * row_stride, sc_ptr + r * nblocks, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
        r += 1
    if AVG:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, W, tl.float32))
    if STORE_SUM:
        tl.store(acc_ptr + e, acc, mask=valid)
    if REQUANT:
        _quantize_store(acc, valid, blk, ok, out_pay_ptr, out_sc_ptr, bnd_ptr, code_ptr, nbytes, R, BP, BLOCK, KIND, BITS, NBND, MAXV, G, GB, GBP)


# ---- spans of one byte storage: a launch covers many regions (the 8-bit gradient buckets) ----------
#
# A span table (agoq.quant.spans) is int64 [S, 5]: per span its first value in the flat tensor
# read or written beside the storage, its value count, the byte offset of its packed codes in the
# storage, the fp32 index of its first scale in the storage seen as fp32, and its block count. The
# grid is (programs per span, S): axis 1 picks the span, so a parameter spread over many buckets,
# or every row of every bucket, is one launch; programs past a span's end only load masked lanes.


@triton.jit
def _span_tile(table_ptr, BLOCK: tl.constexpr, BP: tl.constexpr, R: tl.constexpr):
    """This program's span (value offset, value count, payload byte offset, scale index, blocks) and its R blocks of it."""
    row = table_ptr + tl.program_id(1).to(tl.int64) * 5
    first = tl.load(row)
    k = tl.load(row + 1)
    pay = tl.load(row + 2)
    sc = tl.load(row + 3)
    nblocks = tl.load(row + 4)
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    ok = blk < nblocks
    col = tl.arange(0, BP)
    e = blk[:, None] * BLOCK + col[None, :]
    valid = (col < BLOCK)[None, :] & ok[:, None]
    return first, k, pay, sc, nblocks, blk, ok, e, valid


@triton.jit
def accumulate_spans_kernel(
    storage_ptr,
    scales_ptr,
    table_ptr,
    g_ptr,
    flag_ptr,
    val_ptr,
    bnd_ptr,
    code_ptr,
    FIRST: tl.constexpr,
    IN_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NBND: tl.constexpr,
    MAXV: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """accumulate_kernel over every span of a table, the gradient's values first..first+k going to
    span s. A block that turns non-finite gets scale 0 (it stays off the wire) and sets the flag."""
    first, k, pay, sc, nblocks, blk, ok, e, valid = _span_tile(table_ptr, BLOCK, BP, R)
    pay_ptr = storage_ptr + pay
    sc_ptr = scales_ptr + sc
    nbytes = nblocks * (BLOCK * BITS // 8)
    g = _load_f32(g_ptr + first, e, valid & (e < k), IN_BF16)
    if FIRST:
        x = g
    else:
        x = _dequantize_tile(pay_ptr, sc_ptr, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP) + g
    codes, s = _quantize_tile(x, valid, bnd_ptr, code_ptr, KIND, BITS, NBND, MAXV)
    _store_codes(pay_ptr, codes, blk, nbytes, R, BP, BLOCK, BITS, G, GB, GBP)
    bad = (s != s) & ok
    tl.store(sc_ptr + blk, tl.where(bad, 0.0, s), mask=ok)
    tl.store(flag_ptr, tl.full([], 1, tl.uint8), mask=tl.max(bad.to(tl.int32), axis=0) > 0)


@triton.jit
def dequantize_spans_kernel(
    storage_ptr,
    scales_ptr,
    table_ptr,
    val_ptr,
    out_ptr,
    OUT_BF16: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Span s's first k values into out[first : first + k]."""
    first, k, pay, sc, nblocks, blk, ok, e, valid = _span_tile(table_ptr, BLOCK, BP, R)
    nbytes = nblocks * (BLOCK * BITS // 8)
    v = _dequantize_tile(storage_ptr + pay, scales_ptr + sc, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
    _store_f(out_ptr + first, e, v, valid & (e < k), OUT_BF16)


@triton.jit
def sum_of_squares_spans_kernel(
    storage_ptr,
    scales_ptr,
    table_ptr,
    val_ptr,
    partial_ptr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    GBP: tl.constexpr,
):
    """Each program's fp64 sum of squares of its blocks' values (0 past its span) into partial[s, program]."""
    first, k, pay, sc, nblocks, blk, ok, e, valid = _span_tile(table_ptr, BLOCK, BP, R)
    nbytes = nblocks * (BLOCK * BITS // 8)
    v = _dequantize_tile(storage_ptr + pay, scales_ptr + sc, val_ptr, blk, ok, nbytes, R, BP, BLOCK, KIND, BITS, G, GB, GBP)
    v = tl.where(valid & (e < k), v, 0.0).to(tl.float64)
    total = tl.sum(tl.sum(v * v, axis=1), axis=0)
    tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0), total)


@triton.jit
def zero_scales_spans_kernel(scales_ptr, table_ptr, BLOCK: tl.constexpr, BP: tl.constexpr, R: tl.constexpr):
    """Every scale of every span := 0 (each code then decodes to 0, whatever the payload holds)."""
    first, k, pay, sc, nblocks, blk, ok, e, valid = _span_tile(table_ptr, BLOCK, BP, R)
    tl.store(scales_ptr + sc + blk, tl.zeros([R], tl.float32), mask=ok)
