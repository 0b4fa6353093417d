"""The fused LAAQ ops: forward equal to the baseline, gradients within a bound set by the quantization step.

Each bound is derived from the per-element quantization error bound of the saved tensor
(agoq.quant.quantization_error_bound: half a step times the block scale) pushed through the
Lipschitz constants of what backward recomputes from it, plus a rounding allowance for the
compute dtype. The reference is autograd through the unfused computation in fp32 on the same
inputs. Since the bound scales with the step, it is tight at 8 bits and looser at 4.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agoq.activation import causal_attention, rms_norm, rms_norm_linear, saved_input_linear, swiglu_linear
from agoq.activation.ops import SILU_MAX_CURVATURE, SILU_MAX_SLOPE
from agoq.quant import parse_format, quantization_error_bound, quantize

EPS = 1e-5
# Rounding allowance relative to the magnitude |a|^T |b| of each product-sum: fp32 accumulation,
# or bf16 operands and outputs (unit roundoff 2**-8, two roundings).
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}
FORMATS = ["int8/128", "int4/128"]
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()


def _quant_bound(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-element |t - dequantize(quantize(t))| bound, fp32, in t's shape."""
    return quantization_error_bound(quantize(t.detach(), fmt))


def _tok(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().reshape(-1, t.shape[-1])


def _grads(outs, inputs, grads):
    return [g.float() for g in torch.autograd.grad(outs, inputs, grads)]


def _assert_within(actual: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    excess = ((actual - ref).abs() - bound).max().item()
    assert excess <= 0, f"{what}: error exceeds the bound by {excess:.3g} (max bound {bound.max().item():.3g})"


# A worst-case bound adds |errors| over every token where real errors partly cancel, so it sits
# well above the typical error; it must still say something: below this fraction of the gradient.
NON_VACUOUS = {"int8/128": 0.25, "int4/128": 3.0}


def _assert_not_vacuous(actual: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, fmt: str) -> None:
    rel_bound = (bound.norm() / ref.norm()).item()
    assert rel_bound < NON_VACUOUS[fmt], f"bound {rel_bound:.3g} of the gradient norm says nothing"
    rel_err = ((actual - ref).norm() / ref.norm()).item()
    print(f"{fmt}: relative error {rel_err:.4f}, bound {rel_bound:.4f}")


# ---- forward equality ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_forward_equals_baseline_bit_for_bit(dtype: torch.dtype) -> None:
    fmt = parse_format("int4/128")
    x, nw = _rand(3, 7, 96, dtype=dtype, seed=0), _rand(96, dtype=dtype, seed=1)
    ws = [_rand(n, 96, dtype=dtype, seed=2 + n) for n in (96, 48, 48)]
    for a, b in zip(rms_norm_linear(x, nw, EPS, ws, fmt), rms_norm_linear(x, nw, EPS, ws, None)):
        assert torch.equal(a, b)
    gate, up, wd = _rand(3, 7, 200, dtype=dtype, seed=7), _rand(3, 7, 200, dtype=dtype, seed=8), _rand(96, 200, dtype=dtype, seed=9)
    assert torch.equal(swiglu_linear(gate, up, wd, fmt), swiglu_linear(gate, up, wd, None))
    wo = _rand(96, 96, dtype=dtype, seed=10)
    assert torch.equal(saved_input_linear(x, wo, fmt), saved_input_linear(x, wo, None))
    q, k, v = (_rand(2, h, 9, 16, dtype=dtype, seed=11 + h) for h in (4, 2, 2))
    assert torch.equal(causal_attention(q, k, v, fmt), causal_attention(q, k, v, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_baseline_norm_matches_fp32_formula(dtype: torch.dtype) -> None:
    """The autograd.Function RMSNorm: output and gradients of the plain formula (fp32 stats)."""
    x, w = _rand(5, 33, dtype=dtype, seed=0), _rand(33, dtype=dtype, seed=1)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * wf
    out = rms_norm(x, w, EPS)
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=0, atol=0)
    g = _rand(5, 33, dtype=dtype, seed=2).detach()
    got = _grads(out, [x, w], g)
    want = _grads(ref, [xf, wf], g.float())
    tol = ROUNDING[dtype] * 4
    for a, b in zip(got, want):
        assert (a - b).norm() <= tol * b.norm(), (a - b).norm() / b.norm()


# ---- norm + linear -------------------------------------------------------------------------------


def _ref_norm_linear(x, nw, ws):
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
    return [F.linear(h, w.float()) for w in ws]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_linear_gradients_within_quantization_bound(fmt: str, dtype: torch.dtype) -> None:
    hidden = 96  # below the block size, and 3 * 7 * 96 is not a multiple of 128
    x = _rand(3, 7, hidden, dtype=dtype, seed=1, scale=2.0)
    nw = (1 + 0.1 * _rand(hidden, dtype=torch.float32, seed=2).detach()).to(dtype).requires_grad_()
    ws = [_rand(n, hidden, dtype=dtype, seed=3 + n, scale=0.1) for n in (96, 32, 32)]
    outs = rms_norm_linear(x, nw, EPS, ws, parse_format(fmt))
    gs = [_rand(*o.shape, dtype=dtype, seed=20 + i).detach() for i, o in enumerate(outs)]
    got = _grads(outs, [x, nw, *ws], gs)

    xr = x.detach().float().requires_grad_()
    nwr = nw.detach().float().requires_grad_()
    wrs = [w.detach().float().requires_grad_() for w in ws]
    want = _grads(_ref_norm_linear(xr, nwr, wrs), [xr, nwr, *wrs], [g.float() for g in gs])

    # Per token t, with dx_t = ||x_hat_t - x_t|| (from the per-element bound e_t) and
    # R_t = sqrt(h) / (||x_t|| - dx_t) >= rstd anywhere on the segment x..x_hat: by the mean value
    # theorem on y = x * rstd, whose gradient row b is rstd (e_b - y_b y / h) with |y_b| / sqrt(h)
    # <= (|x_b| + e_b) / (||x|| - dx), |dy_tb| <= R_t (e_tb + (|x_tb| + e_tb) dx_t / (||x_t|| - dx_t)),
    # and dh = w * dy. The input gradient rstd * P(x) (w * v) moves by at most
    # 3 sqrt(h) ||w * v|| dx_t / (||x_t|| - dx_t)^2 (rstd and the projection P both move).
    xt = _tok(x)
    e = _tok(_quant_bound(x, fmt))
    dx = e.norm(dim=1, keepdim=True)
    xn = xt.norm(dim=1, keepdim=True)
    assert bool((dx < xn).all())
    sqrt_h = math.sqrt(hidden)
    big_r = sqrt_h / (xn - dx)
    dy = big_r * (e + (xt.abs() + e) * dx / (xn - dx))
    dh = dy * nw.detach().float().abs()
    rounding = ROUNDING[dtype]
    ht = _tok(rms_norm(x, nw, EPS))
    v = sum(_tok(g) @ w.detach().float() for g, w in zip(gs, ws))  # gradient w.r.t. the norm output
    u = v * nw.detach().float()

    for i, (g, w) in enumerate(zip(gs, ws)):
        gt = _tok(g).abs()
        bound = gt.t() @ dh + rounding * 2 * (gt.t() @ ht.abs())
        _assert_within(got[2 + i], want[2 + i], bound, f"weight {i} gradient")
        _assert_not_vacuous(got[2 + i], want[2 + i], bound, fmt)

    yt = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + EPS)
    bound_nw = (v.abs() * dy).sum(0) + rounding * 4 * (v.abs() * yt.abs()).sum(0)
    _assert_within(got[1], want[1], bound_nw, "norm weight gradient")
    _assert_not_vacuous(got[1], want[1], bound_nw, fmt)

    gx_err = (got[0] - want[0]).reshape(-1, hidden).norm(dim=1, keepdim=True)
    un = u.norm(dim=1, keepdim=True)
    gx_bound = 3 * sqrt_h * un * dx / (xn - dx) ** 2 + rounding * 4 * big_r * un
    assert bool((gx_err <= gx_bound).all()), (gx_err / gx_bound).max()
    _assert_not_vacuous(got[0], want[0], gx_bound, fmt)


def test_norm_linear_backward_is_the_exact_gradient_at_the_dequantized_input() -> None:
    """In fp32, the fused backward equals autograd of the unfused op evaluated at dequantize(quantize(x))."""
    fmt = "int4/128"
    x = _rand(2, 5, 80, dtype=torch.float32, seed=3)
    nw = _rand(80, dtype=torch.float32, seed=4)
    ws = [_rand(64, 80, dtype=torch.float32, seed=5), _rand(16, 80, dtype=torch.float32, seed=6)]
    outs = rms_norm_linear(x, nw, EPS, ws, parse_format(fmt))
    gs = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7)) for o in outs]
    got = _grads(outs, [x, nw, *ws], gs)
    xq = quantize(x.detach(), fmt).dequantize().requires_grad_()
    nwr, wrs = nw.detach().requires_grad_(), [w.detach().requires_grad_() for w in ws]
    want = _grads(_ref_norm_linear(xq, nwr, wrs), [xq, nwr, *wrs], gs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# ---- SwiGLU + linear -----------------------------------------------------------------------------


def _ref_swiglu(gate, up, wd):
    return F.linear(F.silu(gate.float()) * up.float(), wd.float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_linear_gradients_within_quantization_bound(fmt: str, dtype: torch.dtype) -> None:
    inter, hidden = 200, 72  # 3 * 5 * 200 values: 23.4 blocks of 128
    gate = _rand(3, 5, inter, dtype=dtype, seed=1, scale=2.0)
    up = _rand(3, 5, inter, dtype=dtype, seed=2)
    wd = _rand(hidden, inter, dtype=dtype, seed=3, scale=0.1)
    out = swiglu_linear(gate, up, wd, parse_format(fmt))
    g = _rand(*out.shape, dtype=dtype, seed=4).detach()
    got = _grads(out, [gate, up, wd], g)
    refs = [t.detach().float().requires_grad_() for t in (gate, up, wd)]
    want = _grads(_ref_swiglu(*refs), refs, g.float())

    # Elementwise: act = SiLU(gate) * up moves by |SiLU(gate_hat)| du + |up| * max|SiLU'| dgate;
    # the down-projection gradient sums |g| times that over tokens; the gate/up gradients are the
    # exact upstream gradient G = g @ W times SiLU'(gate) * up and SiLU(gate), which move by
    # |G| (|SiLU'(gate_hat)| du + |up| max|SiLU''| dgate) and |G| max|SiLU'| dgate.
    bg, bu = _quant_bound(gate, fmt), _quant_bound(up, fmt)
    gh = quantize(gate.detach(), fmt).dequantize(torch.float32)
    uf, gf = up.detach().float(), gate.detach().float()
    s = torch.sigmoid(gh)
    dact = (gh * s).abs() * bu + uf.abs() * SILU_MAX_SLOPE * bg
    act = F.silu(gf) * uf
    G = (g.float() @ wd.detach().float()).abs()
    rounding = ROUNDING[dtype]
    bound_wd = _tok(g).abs().t() @ _tok(dact) + rounding * (_tok(g).abs().t() @ _tok(act).abs()) * 2
    _assert_within(got[2], want[2], bound_wd, "down-projection weight gradient")
    _assert_not_vacuous(got[2], want[2], bound_wd, fmt)

    dsilu = (s * (1 + gh * (1 - s))).abs()
    bound_gate = G * (dsilu * bu + uf.abs() * SILU_MAX_CURVATURE * bg) + rounding * 4 * G * SILU_MAX_SLOPE * (uf.abs() + bu)
    _assert_within(got[0], want[0], bound_gate, "gate gradient")
    _assert_not_vacuous(got[0], want[0], bound_gate, fmt)
    bound_up = G * SILU_MAX_SLOPE * bg + rounding * 4 * G * (F.silu(gf).abs() + SILU_MAX_SLOPE * bg)
    _assert_within(got[1], want[1], bound_up, "up gradient")
    _assert_not_vacuous(got[1], want[1], bound_up, fmt)


@pytest.mark.parametrize("quant_backend", ["torch", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_a_chunk_of_rows_at_a_time_equals_all_rows_at_once(monkeypatch, quant_backend: str, dtype: torch.dtype) -> None:
    """Chunking the backward over tokens only regroups the work: gate and up gradients are per-row
    (equal up to the GEMM's rounding), the down-projection gradient is a sum over chunks."""
    from agoq.activation import ops
    from agoq.quant import backend

    if quant_backend == "compiled" and not backend.compiler_available():
        pytest.skip("no C++ compiler for torch.compile")
    fmt = parse_format("int4/128")
    inter, hidden = 200, 48  # rows of 200 are stored as two blocks of 128, the second one padded
    gate, up = _rand(3, 37, inter, dtype=dtype, seed=1, scale=2.0), _rand(3, 37, inter, dtype=dtype, seed=2)
    wd = _rand(hidden, inter, dtype=dtype, seed=3, scale=0.1)
    g = _rand(3, 37, hidden, dtype=dtype, seed=4).detach()
    assert ops.chunk_rows(111, inter, 128, torch.device("cpu"), ops.SWIGLU_CHUNK_VALUES, fused=True) == 111  # one chunk by default
    with backend.use_backend(quant_backend):
        whole = _grads(swiglu_linear(gate, up, wd, fmt), [gate, up, wd], g)
        # Every row starts on a block, so a chunk may hold any number of rows: here 16.
        monkeypatch.setattr(ops, "SWIGLU_CHUNK_VALUES", dict.fromkeys(("cpu", "cpu_fused", "device"), 16 * inter))
        monkeypatch.setattr(ops, "MIN_CHUNK_ROWS", 1)
        assert ops._row_chunks(111, inter, 128, torch.device("cpu"), ops.SWIGLU_CHUNK_VALUES)[-2:] == [(80, 96), (96, 111)]
        assert ops.chunk_rows(111, inter, 128, torch.device("cpu"), {"cpu": 1}) == 1
        # Eagerly the forward's SiLU(gate) * up is also formed a chunk at a time: still the
        # baseline's bits. Compiled code forms it in one pass, rounding the product once
        # (agoq.quant.compiled.swiglu_quantize): bf16 within a rounding of the GEMM's inputs.
        fused, baseline = swiglu_linear(gate, up, wd, fmt), swiglu_linear(gate, up, wd, None)
        if quant_backend == "torch" or dtype == torch.float32:
            assert torch.equal(fused, baseline)
        else:
            torch.testing.assert_close(fused.float(), baseline.float(), rtol=2.0**-7, atol=2.0**-7 * baseline.float().abs().max().item())
        chunked = _grads(swiglu_linear(gate, up, wd, fmt), [gate, up, wd], g)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}[dtype]
    for what, a, b in zip(("gate", "up", "down weight"), chunked, whole):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item(), msg=what)


@pytest.mark.parametrize("quant_backend", ["torch", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_linear_backward_a_chunk_of_rows_at_a_time_equals_all_rows_at_once(monkeypatch, quant_backend: str, dtype: torch.dtype) -> None:
    """The fused norm + GEMMs backward cut into row chunks: the input gradient is per-row, the
    weight gradients and the norm weight's are sums over chunks (in fp32, rounded once)."""
    from agoq.activation import ops
    from agoq.quant import backend

    if quant_backend == "compiled" and not backend.compiler_available():
        pytest.skip("no C++ compiler for torch.compile")
    fmt = parse_format("int4/128")
    hidden = 72  # rows of 72 are stored as one padded block of 128
    x = _rand(3, 37, hidden, dtype=dtype, seed=1, scale=2.0)
    nw = (1 + 0.1 * _rand(hidden, dtype=torch.float32, seed=2).detach()).to(dtype).requires_grad_()
    wq, wk = _rand(40, hidden, dtype=dtype, seed=3, scale=0.1), _rand(24, hidden, dtype=dtype, seed=4, scale=0.1)
    gq, gk = _rand(3, 37, 40, dtype=dtype, seed=5).detach(), _rand(3, 37, 24, dtype=dtype, seed=6).detach()
    leaves = [x, nw, wq, wk]
    with backend.use_backend(quant_backend):
        whole = _grads(rms_norm_linear(x, nw, EPS, (wq, wk), fmt), leaves, (gq, gk))
        monkeypatch.setattr(ops, "NORM_CHUNK_VALUES", dict.fromkeys(("cpu", "cpu_fused", "device"), 16 * hidden))
        monkeypatch.setattr(ops, "MIN_CHUNK_ROWS", 1)
        assert len(ops._row_chunks(111, hidden, 128, torch.device("cpu"), ops.NORM_CHUNK_VALUES)) == 7
        chunked = _grads(rms_norm_linear(x, nw, EPS, (wq, wk), fmt), leaves, (gq, gk))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}[dtype]
    for what, a, b in zip(("input", "norm weight", "q weight", "k weight"), chunked, whole):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(), msg=what)


def test_swiglu_and_linear_backward_are_exact_gradients_at_the_dequantized_inputs() -> None:
    """In fp32, each fused backward equals autograd of the unfused op on the dequantized saved tensors."""
    fmt = "int4/128"
    gate, up = _rand(3, 7, 150, dtype=torch.float32, seed=1), _rand(3, 7, 150, dtype=torch.float32, seed=2)
    wd = _rand(40, 150, dtype=torch.float32, seed=3)
    out = swiglu_linear(gate, up, wd, parse_format(fmt))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    got = _grads(out, [gate, up, wd], g)
    gq, uq = (quantize(t.detach(), fmt).dequantize().requires_grad_() for t in (gate, up))
    wr = wd.detach().requires_grad_()
    # The gate/up gradients use the exact upstream gradient and the dequantized gate/up.
    want = _grads(_ref_swiglu(gq, uq, wr), [gq, uq, wr], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())

    x, w = _rand(4, 130, dtype=torch.float32, seed=5), _rand(24, 130, dtype=torch.float32, seed=6)
    out = saved_input_linear(x, w, parse_format(fmt))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    got = _grads(out, [x, w], g)
    xq = quantize(x.detach(), fmt).dequantize()
    gx_exact = g @ w.detach()
    gw_at_xq = g.t() @ xq
    torch.testing.assert_close(got[0], gx_exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], gw_at_xq, rtol=1e-5, atol=1e-5 * gw_at_xq.abs().max().item())


# ---- linear with a quantized saved input ---------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_saved_input_linear_gradients_within_quantization_bound(fmt: str, dtype: torch.dtype) -> None:
    x = _rand(2, 9, 100, dtype=dtype, seed=1)
    w = _rand(40, 100, dtype=dtype, seed=2, scale=0.1)
    out = saved_input_linear(x, w, parse_format(fmt))
    g = _rand(*out.shape, dtype=dtype, seed=3).detach()
    got = _grads(out, [x, w], g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = _grads(F.linear(xr, wr), [xr, wr], g.float())
    rounding = ROUNDING[dtype]
    # The input gradient never touches the quantized tensor: only rounding separates it.
    _assert_within(got[0], want[0], rounding * 2 * (g.float().abs() @ w.detach().float().abs()), "input gradient")
    gt = _tok(g).abs()
    bound = gt.t() @ _tok(_quant_bound(x, fmt)) + rounding * 2 * (gt.t() @ _tok(x).abs())
    _assert_within(got[1], want[1], bound, "weight gradient")
    _assert_not_vacuous(got[1], want[1], bound, fmt)


def test_out_projection_shares_the_attention_output_instead_of_quantizing_it() -> None:
    """A view of an output that attention keeps at full precision is saved as that view: exact gradients."""
    q, k, v = (_rand(2, h, 8, 16, dtype=torch.float32, seed=h) for h in (4, 2, 2))
    o = causal_attention(q, k, v, None).transpose(1, 2).reshape(2, 8, 64)
    w = _rand(64, 64, dtype=torch.float32, seed=9)
    out = saved_input_linear(o, w, parse_format("int4/128"))
    (gw,) = torch.autograd.grad(out.sum(), [w], retain_graph=True)
    torch.testing.assert_close(gw, out.new_ones(out.shape).reshape(-1, 64).t() @ o.detach().reshape(-1, 64))
    # Attention quantized: its output is not kept at full precision, so the input is quantized.
    o4 = causal_attention(q, k, v, parse_format("int4/128")).transpose(1, 2).reshape(2, 8, 64)
    (gw4,) = torch.autograd.grad(saved_input_linear(o4, w, parse_format("int4/128")).sum(), [w])
    assert (gw4 - gw).abs().max() > 1e-4


# ---- attention core ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_attention_gradient_error_follows_the_bit_width(dtype: torch.dtype) -> None:
    """Quantized q, k, v and output (softmax statistics exact): error shrinks ~16x from 4 to 8 bits."""
    q, k, v = (_rand(2, h, 33, 32, dtype=dtype, seed=h) for h in (4, 2, 2))
    g = _rand(2, 4, 33, 32, dtype=dtype, seed=7).detach()
    refs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = _grads(F.scaled_dot_product_attention(*refs, is_causal=True, enable_gqa=True), refs, g.float())
    errs = {}
    for fmt in FORMATS:
        got = _grads(causal_attention(q, k, v, parse_format(fmt)), [q, k, v], g)
        errs[fmt] = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))
    base = _grads(causal_attention(q, k, v, None), [q, k, v], g)
    err_base = max(((a - b).norm() / b.norm()).item() for a, b in zip(base, want))
    # The relative rms error of int-b absmax quantization of a Gaussian block is about
    # 3 / (2^(b-1) - 1) / sqrt(12): 0.7% at 8 bits, 12% at 4 bits; gradients amplify it a few times.
    assert errs["int8/128"] < 0.04 + err_base
    assert errs["int4/128"] < 0.6
    assert errs["int4/128"] > 8 * max(errs["int8/128"] - err_base, 1e-6)


def test_nonfinite_activation_reaches_the_gradient_as_nan() -> None:
    """A NaN in a saved activation must not become finite garbage in the gradient."""
    x = _rand(2, 3, 64, dtype=torch.float32, seed=0)
    w = _rand(16, 64, dtype=torch.float32, seed=1)
    with torch.no_grad():
        x[0, 1, 5] = float("nan")
    (gw,) = torch.autograd.grad(saved_input_linear(x, w, parse_format("int4/128")).sum(), [w])
    assert bool(torch.isnan(gw).any())


def test_quantized_attention_passes_what_it_keeps_through_outer_hooks() -> None:
    """An outer saved-tensor hook (a meter, an offloader) sees the payloads and scales, and gradients are unchanged."""
    fmt = parse_format("int4/128")
    q, k, v = (_rand(1, h, 12, 16, dtype=torch.float32, seed=h) for h in (2, 1, 1))
    g = torch.randn(1, 2, 12, 16, generator=torch.Generator().manual_seed(3))
    plain = _grads(causal_attention(q, k, v, fmt), [q, k, v], g)
    seen: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> tuple:
        seen.append(t.dtype)
        return ("wrapped", t.clone())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box[1]):
        out = causal_attention(q, k, v, fmt)
    wrapped = _grads(out, [q, k, v], g)
    # q, k, v, output: a uint8 payload and fp32 scales each; the fp32 log-sum-exp as is.
    assert sorted(map(str, seen)) == sorted(["torch.uint8"] * 4 + ["torch.float32"] * 5)
    for a, b in zip(wrapped, plain):
        assert torch.equal(a, b)
