"""The Triton kernels of agoq.quant against the torch reference path.

The reference is always the torch path on CPU. Without a GPU the kernels run on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported); with a GPU they run
on it and their results are compared with the CPU reference.

Tie rule: every kernel rounds like the torch path (int: ties to even as torch.round; fp4 and fp8:
ties to the even code; nf4: ties to the lower value), so codes and scales are asserted equal bit
for bit, exact ties included. What is not a quantization (the norm, SiLU, sums over a row) is
compared within a stated tolerance: reduction order and exp differ from torch's.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("AGOQ_TEST_TRITON_DEVICE", "cuda") == "cuda"
if not ON_GPU:
    # Must precede the first import of triton: kernels are bound to the interpreter when defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'agoq[triton]')")

import agoq.quant.triton as tq  # noqa: E402
from agoq.activation.ops import _norm_backward, _norm_forward, rms_norm_linear, swiglu_linear  # noqa: E402
from agoq.gradient import QuantGradBuffer, all_reduce_8bit  # noqa: E402
from agoq.quant import NonFiniteError, QTensor, backend, dequantize, parse_format, quantize  # noqa: E402
from agoq.quant.formats import codebook_tables  # noqa: E402
from tests._dist import run_distributed  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
if not ON_GPU and not tq.INTERPRETED:
    pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module; run these tests in their own process", allow_module_level=True)

FORMATS = ("int2", "int3", "int4", "int5", "int6", "int8", "int8/256", "int4/64", "int5/96", "fp4", "nf4", "fp8")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
N = 16384 + 77  # a partial last block, and for 3/5/6 bits a partial last packing group
# Whole tiles of whole blocks (3 * 2**14 also for blocks of 96). On a GPU Triton compiles a kernel
# once for sizes divisible by 16, with wide loads and stores, and once for the rest (N above).
ALIGNED = (2**16, 3 * 2**14)
EPS = 1e-5


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values with blocks that test the edges: all zeros, tiny, -0.0, a 1e4 outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n // 256 + 1, generator=g)).repeat_interleave(256)[:n]
    x[256:512] = 0.0
    x[512:768] *= 1e-30 if dtype == torch.float32 else 1e-6
    x[768:1024:3] = -0.0
    x[1030] = 1e4
    return x.to(dtype)


def _reference_quantize(x: torch.Tensor, fmt, **kw) -> QTensor:
    with backend.use_backend("torch"):
        return quantize(x.cpu(), fmt, **kw)


def _reference_dequantize(q: QTensor, dtype=None) -> torch.Tensor:
    with backend.use_backend("torch"):
        return dequantize(q.to("cpu"), dtype)


def _assert_same_q(q: QTensor, ref: QTensor) -> None:
    assert q.shape == ref.shape and q.dtype == ref.dtype and q.fmt == ref.fmt
    assert torch.allclose(q.scales.cpu(), ref.scales, rtol=0, atol=0, equal_nan=True), "scales differ"
    mismatch = (q.payload.cpu() != ref.payload).sum().item()
    assert mismatch == 0, f"{mismatch} payload bytes differ"


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str) -> None:
    """|a - b| <= rtol * max|b| (+ rtol * |b|): agreement up to the rounding of the dtype."""
    a, b = a.float().cpu(), b.float().cpu()
    err = (a - b).abs()
    bound = rtol * (b.abs() + b.abs().max())
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3g}, allowed {bound.min().item():.3g}"


# The interpreter evaluates inf - inf (the kernels' finiteness test) in numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


# ---- quantize / dequantize ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
def test_quantize_and_dequantize_equal_torch_bit_for_bit(spec: str, dtype: torch.dtype) -> None:
    fmt = parse_format(spec)
    x = _data(N, dtype, seed=len(spec))
    ref = _reference_quantize(x, fmt)
    q = tq.quantize(x.to(DEVICE), fmt)
    _assert_same_q(q, ref)
    assert q.payload.numel() == fmt.payload_bytes(N) and q.scales.numel() == fmt.num_blocks(N)
    for out_dtype in (None, torch.float32):
        got = tq.dequantize(ref.to(DEVICE), out_dtype).cpu()
        want = _reference_dequantize(ref, out_dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("n", ALIGNED)
@pytest.mark.parametrize("spec", FORMATS)
def test_quantize_and_dequantize_at_aligned_sizes_equal_torch_bit_for_bit(spec: str, n: int) -> None:
    fmt = parse_format(spec)
    for dtype in (torch.float32, torch.bfloat16):
        x = _data(n, dtype, seed=n + len(spec))
        ref = _reference_quantize(x, fmt)
        _assert_same_q(tq.quantize(x.to(DEVICE), fmt), ref)
        got = tq.dequantize(ref.to(DEVICE)).cpu()
        want = _reference_dequantize(ref)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)


TIES = {
    # (format, block of values whose absmax makes the scale exactly 1, what each rounds to)
    "int4": ([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -6.5], [7.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0, -6.0]),
    "fp4": ([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0]),
    "fp8": ([448.0, 1.0625, 1.1875, 17.0, -17.0, 2.0**-10, 3 * 2.0**-10, 232.0], [448.0, 1.0, 1.25, 16.0, -16.0, 0.0, 2.0**-8, 224.0]),
}


@pytest.mark.parametrize("spec", sorted(TIES))
def test_exact_ties_round_to_even_like_torch(spec: str) -> None:
    # Triton's round() and the interpreter's casts send .5 away from zero; the kernels must not.
    values, expected = TIES[spec]
    fmt = parse_format(spec, block_size=16)
    x = torch.zeros(16)
    x[: len(values)] = torch.tensor(values)
    q = tq.quantize(x.to(DEVICE), fmt)
    _assert_same_q(q, _reference_quantize(x, fmt))
    assert float(q.scales[0]) == 1.0
    assert tq.dequantize(q).cpu()[: len(values)].tolist() == expected


def test_nf4_ties_go_to_the_lower_value() -> None:
    fmt = parse_format("nf4/16")
    t = codebook_tables("nf4")
    x = torch.cat([torch.ones(1), t.boundaries])  # scale 1: every boundary is an exact tie
    q = tq.quantize(x.to(DEVICE), fmt)
    _assert_same_q(q, _reference_quantize(x, fmt))
    assert torch.equal(tq.dequantize(q).cpu()[1:], t.values[:-1])


def test_nonfinite_blocks_get_nan_scales_and_the_torch_path_raises() -> None:
    fmt = parse_format("int4/128")
    x = torch.randn(1024)
    x[5], x[300], x[301] = float("nan"), float("inf"), -float("inf")
    q = tq.quantize(x.to(DEVICE), fmt)
    _assert_same_q(q, _reference_quantize(x, fmt, nonfinite="propagate"))
    assert torch.isnan(q.scales.cpu()).tolist() == [True, False, True] + [False] * 5
    with backend.use_backend("triton"), pytest.raises(NonFiniteError, match="flat index 5"):
        quantize(x.to(DEVICE), fmt)


# ---- writing into given tensors -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ("int4", "int5/96", "fp8"))
def test_quantize_and_dequantize_into_out_equal_the_new_tensors(spec: str) -> None:
    fmt = parse_format(spec)
    x = _data(N, torch.bfloat16, seed=11).to(DEVICE)
    fresh = tq.quantize(x, fmt)
    out = (torch.empty(fmt.payload_bytes(N), dtype=torch.uint8, device=DEVICE), torch.empty(fmt.num_blocks(N), device=DEVICE))
    q = tq.quantize(x, fmt, out=out)
    assert q.payload is out[0] and q.scales is out[1]
    _assert_same_q(q, fresh.to("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        into = torch.empty(N, dtype=dtype, device=DEVICE)
        assert tq.dequantize(q, out=into) is into and torch.equal(into, tq.dequantize(q, dtype))
    strided = torch.empty(N, 2, device=DEVICE)[:, 0]  # the reference's contract: any layout (then a copy)
    assert tq.dequantize(q, out=strided) is strided and torch.equal(strided, tq.dequantize(q, torch.float32))


def test_quantize_rows_into_and_dequantize_rows_write_into_the_given_rows() -> None:
    fmt = parse_format("int4/64")
    x = _data(3 * 4096, torch.float32, seed=12).view(3, 4096).to(DEVICE)
    pb, nb = fmt.payload_bytes(4096), 4096 // 64
    payload, scales = torch.empty(3, pb, dtype=torch.uint8, device=DEVICE), torch.empty(3, nb, device=DEVICE)
    tq.quantize_rows_into(x, payload, scales, fmt)  # contiguous rows: one launch straight into them
    want = tq.quantize(x, fmt)
    assert torch.equal(payload.view(-1), want.payload) and torch.equal(scales.view(-1), want.scales)
    wire = torch.cat([payload, scales.view(torch.uint8)], 1)  # rows [codes | scales]: a launch per row
    for rows_payload, rows_scales in ((payload, scales), (wire[:, :pb], wire[:, pb:].view(torch.float32))):
        out = torch.empty(3, 4096, dtype=torch.bfloat16, device=DEVICE)
        assert tq.dequantize_rows(rows_payload, rows_scales, fmt, out) is out
        assert torch.equal(out, tq.dequantize(want, torch.bfloat16).view(3, 4096))


@pytest.mark.parametrize("width", (640, 688), ids=["whole-blocks", "padded-rows"])
def test_fused_backward_kernels_write_into_out_bit_for_bit(width: int) -> None:
    fmt, dtype = parse_format("int4/128"), torch.bfloat16
    g = torch.Generator().manual_seed(13)
    qg = _reference_quantize((torch.randn(32, width, generator=g) * 3).to(dtype), fmt).to(DEVICE)
    qu = _reference_quantize(torch.randn(32, width, generator=g).to(dtype), fmt).to(DEVICE)
    grad_act = torch.randn(32, width, generator=g).to(dtype).to(DEVICE)
    act, gg, gu = tq.swiglu_backward(grad_act, qg, qu, dtype, dtype)
    out = (torch.empty(32, width, dtype=dtype, device=DEVICE), torch.empty(32, width, dtype=dtype, device=DEVICE))
    act2, gg2, gu2 = tq.swiglu_backward(grad_act, qg, qu, dtype, dtype, out=out)
    assert gg2 is out[0] and gu2 is out[1]
    assert torch.equal(act2, act) and torch.equal(gg2, gg) and torch.equal(gu2, gu)
    if width % fmt.block_size:  # the norm kernels take whole blocks per row
        return
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    h, rstd = tq.rms_norm_recompute(qg, w, EPS, dtype)
    into = torch.empty(32, width, dtype=dtype, device=DEVICE)
    h2, rstd2 = tq.rms_norm_recompute(qg, w, EPS, dtype, out=into)
    assert h2 is into and torch.equal(h2, h) and torch.equal(rstd2, rstd)
    gx, gw = tq.rms_norm_backward(grad_act, qg, rstd, w, dtype, True)
    into = torch.empty(32, width, dtype=dtype, device=DEVICE)
    gx2, gw2 = tq.rms_norm_backward(grad_act, qg, rstd, w, dtype, True, out=into)
    assert gx2 is into and torch.equal(gx2, gx) and torch.equal(gw2, gw)


def test_a_bad_out_is_refused_by_name() -> None:
    fmt, dtype = parse_format("int4/128"), torch.bfloat16
    x = torch.randn(16, 256).to(dtype).to(DEVICE)
    q = tq.quantize(x, fmt)
    w = torch.ones(256, dtype=dtype, device=DEVICE)
    _, rstd = tq.rms_norm_recompute(q, w, EPS, dtype)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor of shape \(16, 256\) .* got torch.float32"):
        tq.rms_norm_recompute(q, w, EPS, dtype, out=torch.empty(16, 256, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be .* got torch.bfloat16 \(256, 16\)"):
        tq.rms_norm_backward(x, q, rstd, w, dtype, False, out=torch.empty(256, 16, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match=r"out\[1\] \(the grad of up\) must be .* not contiguous"):
        tq.swiglu_backward(x, q, q, dtype, None, out=(torch.empty_like(x), torch.empty(256, 16, dtype=dtype, device=DEVICE).t()))
    with pytest.raises(ValueError, match=r"out\[1\] \(the scales\) must be a contiguous torch.float32 tensor of shape \(32,\)"):
        tq.quantize(x, fmt, out=(torch.empty(2048, dtype=torch.uint8, device=DEVICE), torch.empty(33, device=DEVICE)))
    with pytest.raises(ValueError, match=r"payload_rows must be a torch.uint8 tensor of shape \(2, 1024\)"):
        tq.quantize_rows_into(x.view(2, -1), torch.empty(2, 1000, dtype=torch.uint8, device=DEVICE), torch.empty(2, 16, device=DEVICE), fmt)
    with pytest.raises(ValueError, match="dequantize into a tensor of 100 values"):
        tq.dequantize(q, out=torch.empty(100, device=DEVICE))


# ---- which GPU a launch runs on --------------------------------------------------------------------------


def test_every_launch_runs_on_the_gpu_of_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current CUDA device: tensors on cuda:1 with cuda:0 current (a model spread
    over GPUs) must still run there. Fake tensors stand in for GPU memory; each launch records the
    current device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    current = [0]

    class _DeviceGuard:  # torch.cuda.device, without a GPU
        def __init__(self, device: torch.device) -> None:
            self.index = torch.device(device).index

        def __enter__(self) -> None:
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc: object) -> None:
            current[0] = self.previous

    launches: list[tuple[str, int]] = []

    class _Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple):
            return lambda *args, **kwargs: launches.append((self.name, torch.cuda.current_device()))

    monkeypatch.setattr(torch.cuda, "device", _DeviceGuard)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    names = sorted(n for n in dir(tq.ops.K) if n.endswith("_kernel"))
    for name in names:
        monkeypatch.setattr(tq.ops.K, name, _Kernel(name))
    monkeypatch.setattr(tq.ops, "_spec", functools.lru_cache(tq.ops._spec.__wrapped__))  # fake tables stay out of the cache
    fmt, fmt8 = parse_format("int4/128"), parse_format("int8/256")
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = torch.device("cuda", 1)
        x, w = torch.empty(8, 256, dtype=torch.bfloat16, device=dev), torch.empty(256, dtype=torch.bfloat16, device=dev)
        q = tq.quantize(x, fmt)
        tq.dequantize(q, out=torch.empty(8, 256, device=dev))
        _, qn = tq.rms_norm_quantize(x, w, EPS, fmt)
        _, rstd = tq.rms_norm_recompute(qn, w, EPS, x.dtype)
        tq.rms_norm_backward(x, qn, rstd, w, x.dtype, True)
        _, qg, qu = tq.swiglu_quantize(x, x, fmt)
        tq.swiglu_backward(x, qg, qu, x.dtype, x.dtype)
        payload, scales = torch.empty(2048, dtype=torch.uint8, device=dev), torch.empty(8, device=dev)
        tq.accumulate_(payload, scales, torch.empty(2048, device=dev), fmt8, first=True)
        # Contiguous rows: fake tensors cannot be indexed without a CUDA build (the rows then take one launch).
        rows, row_scales = torch.empty(4, 1024, dtype=torch.uint8, device=dev), torch.empty(4, 4, device=dev)
        tq.quantize_rows_into(torch.empty(4, 1024, device=dev), rows, row_scales, fmt8)
        tq.dequantize_rows(rows, row_scales, fmt8, torch.empty(4, 1024, device=dev))
        tq.reduce_rows(rows, row_scales, fmt8, average=True, requantize=True)
        from agoq.quant.spans import Span, span_table

        storage, flag = torch.empty(2 * (1024 + 16), dtype=torch.uint8, device=dev), torch.empty(1, dtype=torch.uint8, device=dev)
        spans = span_table([Span(0, 1024, 0, 1024), Span(1024, 1024, 1040, 2064)], fmt8, dev)
        tq.accumulate_spans_(storage, spans, torch.empty(2048, device=dev), flag, first=False)
        tq.dequantize_spans(storage, spans, torch.empty(2048, device=dev))
        tq.sum_of_squares_spans(storage, spans)
        tq.zero_scales_spans_(storage, spans)
    assert sorted({name for name, _ in launches}) == names
    assert [(name, d) for name, d in launches if d != 1] == []


# ---- backend selection ----------------------------------------------------------------------------------


def test_backend_choice_env_api_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.get_backend() == "auto"
    # auto: the compiled formulas on CPUs where a C++ compiler is found, Triton on CUDA
    assert backend.resolve("cpu") == ("compiled" if backend.compiler_available() else "torch")
    with backend.use_backend("compiled"):
        assert backend.resolve("cpu") == ("compiled" if backend.compiler_available() else "torch")
    with backend.use_backend("torch"):
        assert backend.kernels("cpu") is None
    assert backend.resolve("cuda") == "triton"  # auto: Triton on CUDA whenever it is importable
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend.kernels("cpu", parse_format("int4")) is tq
    assert backend.kernels("cpu", parse_format("int4/100")) is None  # blocks of 100 x 4 bits: torch path
    with backend.use_backend("torch"):
        assert backend.resolve("cuda") == "torch"
    assert backend.get_backend() == "triton"
    monkeypatch.setenv(backend.ENV_VAR, "cuda-please")
    with pytest.raises(ValueError, match="AGOQ_QUANT_BACKEND must be one of auto, torch, compiled, triton, got 'cuda-please'"):
        backend.get_backend()
    with pytest.raises(ValueError, match="one of auto, torch, compiled, triton"):
        backend.set_backend("fast")


def test_empty_tensors_and_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    q = tq.quantize(torch.empty(0, 3, device=DEVICE), parse_format("int5"))
    assert q.payload.numel() == 0 and q.scales.numel() == 0 and q.shape == (0, 3)
    assert tq.dequantize(q).shape == (0, 3)
    monkeypatch.setattr(tq.ops, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        tq.quantize(torch.ones(8), parse_format("int4"))


def test_public_quantize_uses_the_kernel_and_falls_back_for_stochastic_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(tq, "quantize", lambda x, fmt: calls.append(fmt) or tq.ops.quantize(x, fmt))
    x = _data(4096, torch.bfloat16, seed=3).to(DEVICE)
    with backend.use_backend("triton"):
        q = quantize(x, "int4")
        qs = quantize(x, "int4", rounding="stochastic", generator=torch.Generator(DEVICE).manual_seed(0))
        odd = quantize(x, "int4/100")
    assert len(calls) == 1
    _assert_same_q(q, _reference_quantize(x, "int4"))
    with backend.use_backend("torch"):
        _assert_same_q(qs, quantize(x, "int4", rounding="stochastic", generator=torch.Generator(DEVICE).manual_seed(0)).to("cpu"))
    _assert_same_q(odd, _reference_quantize(x, "int4/100"))


# ---- fused RMSNorm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rms_norm_forward_writes_the_norm_and_the_quantized_input(dtype: torch.dtype) -> None:
    fmt = parse_format("int4/128")
    x, w = (_data(64 * 256, torch.float32, seed=5).view(64, 256) * 0.5).to(dtype), (1 + 0.1 * torch.randn(256)).to(dtype)
    h, q = tq.rms_norm_quantize(x.to(DEVICE), w.to(DEVICE), EPS, fmt)
    _assert_same_q(q, _reference_quantize(x, fmt))
    want, _ = _norm_forward(x, w, eps=EPS)
    assert h.dtype == dtype
    _close(h, want, 2 * ULP[dtype], "norm output")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rms_norm_backward_from_the_quantized_input(dtype: torch.dtype) -> None:
    fmt = parse_format("int4/128")
    x, w = torch.randn(48, 512).to(dtype), (1 + 0.1 * torch.randn(512)).to(dtype)
    q = _reference_quantize(x, fmt)
    xq = _reference_dequantize(q, torch.float32)
    want_h, want_rstd = _norm_forward(xq, w, eps=EPS, out_dtype=dtype)
    h, rstd = tq.rms_norm_recompute(q.to(DEVICE), w.to(DEVICE), EPS, dtype)
    _close(h, want_h, 2 * ULP[dtype], "recomputed GEMM input")
    _close(rstd, want_rstd, 4 * ULP[torch.float32], "rstd")
    grad_h = torch.randn(48, 512)
    want_gx, want_gw = _norm_backward(grad_h, xq, want_rstd, w, x_dtype=dtype, need_weight_grad=True)
    gx, gw = tq.rms_norm_backward(grad_h.to(DEVICE), q.to(DEVICE), rstd, w.to(DEVICE), dtype, True)
    assert gx.dtype == dtype and gw.dtype == w.dtype
    _close(gx, want_gx, 2 * ULP[dtype] + 1e-6, "input gradient")
    _close(gw, want_gw, 2 * ULP[dtype] + 1e-6, "weight gradient")  # a sum over 48 tokens in another order
    gx2, none = tq.rms_norm_backward(grad_h.to(DEVICE), q.to(DEVICE), rstd, w.to(DEVICE), dtype, False)
    assert none is None and torch.equal(gx2, gx)


# ---- fused SwiGLU -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_swiglu_forward_writes_the_product_and_quantized_gate_and_up(dtype: torch.dtype) -> None:
    fmt = parse_format("int4/128")
    gate, up = (torch.randn(32, 688) * 3).to(dtype), torch.randn(32, 688).to(dtype)
    act, qg, qu = tq.swiglu_quantize(gate.to(DEVICE), up.to(DEVICE), fmt)
    _assert_same_q(qg, _reference_quantize(gate, fmt))
    _assert_same_q(qu, _reference_quantize(up, fmt))
    _close(act, torch.nn.functional.silu(gate) * up, 2 * ULP[dtype] + 4 * ULP[torch.float32], "SiLU(gate) * up")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_swiglu_backward_recomputes_from_quantized_gate_and_up(dtype: torch.dtype) -> None:
    fmt = parse_format("int4/128")
    qg = _reference_quantize((torch.randn(32, 688) * 3).to(dtype), fmt)
    qu = _reference_quantize(torch.randn(32, 688).to(dtype), fmt)
    grad_act = torch.randn(32, 688).to(dtype)
    gate, up = _reference_dequantize(qg, torch.float32), _reference_dequantize(qu, torch.float32)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    ga = grad_act.float()
    want = ((silu * up).to(dtype), (ga * up * sig * (1 + gate * (1 - sig))).to(dtype), (ga * silu).to(dtype))
    got = tq.swiglu_backward(grad_act.to(DEVICE), qg.to(DEVICE), qu.to(DEVICE), dtype, dtype)
    for name, a, b in zip(("product", "gate gradient", "up gradient"), got, want):
        assert a.dtype == dtype
        _close(a, b, 2 * ULP[dtype] + 8 * ULP[torch.float32], name)
    act, gg, gu = tq.swiglu_backward(grad_act.to(DEVICE), qg.to(DEVICE), qu.to(DEVICE), dtype, None)
    assert act is None and torch.equal(gg, got[1]) and torch.equal(gu, got[2])


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "swiglu-backward-in-row-chunks"])
def test_layer_ops_under_the_triton_backend_match_the_torch_backend(monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    if chunked:  # 16 rows per chunk: the kernels then read the saved codes from a block offset
        from agoq.activation import ops

        monkeypatch.setattr(ops, "SWIGLU_CHUNK_VALUES", {"cpu": 1, "cpu_fused": 1, "device": 1})
        monkeypatch.setattr(ops, "NORM_CHUNK_VALUES", {"cpu": 1, "cpu_fused": 1, "device": 1})
        monkeypatch.setattr(ops, "MIN_CHUNK_ROWS", 16)
    used = []
    for name in ("rms_norm_quantize", "rms_norm_recompute", "rms_norm_backward", "swiglu_quantize", "swiglu_backward"):
        real = getattr(tq, name)
        monkeypatch.setattr(tq, name, lambda *a, _real=real, _name=name, **k: used.append(_name) or _real(*a, **k))
    fmt = parse_format("int4/128")
    g = torch.Generator().manual_seed(0)
    x, nw = torch.randn(2, 24, 256, generator=g), 1 + 0.1 * torch.randn(256, generator=g)
    wg, wu = torch.randn(384, 256, generator=g) / 16, torch.randn(384, 256, generator=g) / 16
    wd = torch.randn(256, 384, generator=g) / 20
    results = {}
    for name in ("torch", "triton"):
        leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in (x, nw, wg, wu, wd)]
        with backend.use_backend(name):
            gate, up = rms_norm_linear(leaves[0], leaves[1], EPS, (leaves[2], leaves[3]), fmt)
            out = swiglu_linear(gate, up, leaves[4], fmt)
            (out * torch.linspace(-1, 1, 256, device=DEVICE)).sum().backward()
        results[name] = [out.detach()] + [t.grad for t in leaves]
    assert sorted(set(used)) == ["rms_norm_backward", "rms_norm_quantize", "rms_norm_recompute", "swiglu_backward", "swiglu_quantize"]
    for what, a, b in zip(("output", "x", "norm weight", "gate weight", "up weight", "down weight"), results["triton"], results["torch"]):
        _close(a, b, 1e-5, what)


# ---- QuanGrad: accumulation and the all-reduce's local step ------------------------------------------------


@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.bfloat16), ids=str)
def test_accumulate_dequantize_add_requantize_equals_torch(grad_dtype: torch.dtype) -> None:
    fmt = parse_format("int8/256")
    n, k = 16384, 16384 - 100
    payload = torch.zeros(fmt.payload_bytes(n), dtype=torch.uint8, device=DEVICE)
    scales = torch.zeros(n // 256, device=DEVICE)
    ref = None
    for i in range(3):
        g = (torch.randn(k) * 10.0 ** (i - 1)).to(grad_dtype)
        if i == 2:
            g[7] = float("nan")
        tq.accumulate_(payload, scales, g.to(DEVICE), fmt, first=i == 0)
        x = torch.zeros(n) if ref is None else _reference_dequantize(ref)
        x[:k] += g.float()
        ref = _reference_quantize(x, fmt, nonfinite="propagate")
        _assert_same_q(QTensor(payload, scales, torch.Size([n]), torch.float32, fmt), ref)
    assert torch.isnan(scales.cpu()).nonzero().flatten().tolist() == [0]


def _buffer_both_backends(rank: int, world_size: int) -> dict:
    """Three micro-batches into a buffer whose first weight spans three buckets, under each backend:
    the wire bytes, the read-back gradients and the norm after finish(), then a step with a NaN."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.GELU(), torch.nn.Linear(200, 50)).to(DEVICE)
    batches = [torch.randn(8, 96, device=DEVICE, generator=None) * (rank + 1) for _ in range(3)]
    out = {}
    for name in ("torch", "triton"):
        with backend.use_backend(name):
            buf = QuantGradBuffer(model, microbatches=3, bucket_numel=8192)
            assert len({s.bucket for s in buf.layout.segments[buf.names.index("0.weight")]}) == 3
            for b in batches:
                model(b).square().mean().backward()
            assert buf.finish()
            wire = [bk.wire.cpu().clone() for bk in buf.buckets]
            grads = {n: buf.grad(n).cpu() for n in buf.names}
            head = buf.grad_slice("0.weight", 256, 19000).cpu()
            norm = float(buf.grad_sq_norm())
            buf.zero_grad()
            cleared = all(bool((bk.wire[:, bk.layout.row_payload_bytes :] == 0).all()) for bk in buf.buckets)
            with pytest.warns(RuntimeWarning, match="non-finite gradient in '0.weight'"):
                for i, b in enumerate(batches):
                    (model(b).square().mean() * (float("nan") if i == 1 and rank == world_size - 1 else 1.0)).backward()
                assert not buf.finish()
            out[name] = dict(wire=wire, grads=grads, head=head, norm=norm, cleared=cleared, nonfinite=buf.pipeline.nonfinite)
            buf.remove_hooks()
    return out


def _assert_buffers_agree(out: dict) -> None:
    a, b = out["torch"], out["triton"]
    assert all(torch.equal(x, y) for x, y in zip(a["wire"], b["wire"]))
    assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
    assert torch.equal(a["head"], b["head"]) and torch.equal(a["head"], a["grads"]["0.weight"].reshape(-1)[256:19000])
    # The torch path sums squares of fp32 values per piece in fp64; the kernels in another order.
    assert b["norm"] == pytest.approx(a["norm"], rel=1e-12)
    assert a["cleared"] and b["cleared"] and a["nonfinite"] == b["nonfinite"] != []


def _buffers_agree(rank: int, world_size: int) -> bool:
    _assert_buffers_agree(_buffer_both_backends(rank, world_size))
    return True


def test_gradient_buffer_folds_reads_and_skips_identically_under_both_backends() -> None:
    assert _buffers_agree(0, 1)


@pytest.mark.skipif(ON_GPU, reason="gloo ranks run on CPU tensors: the kernels need the interpreter there")
def test_gradient_buffer_on_three_ranks_is_identical_under_both_backends() -> None:
    # Three rows per bucket: a parameter's spans are cut at row boundaries as well as bucket ones.
    assert run_distributed(_buffers_agree, 3) == [True] * 3


@pytest.mark.parametrize("average", (False, True))
def test_reduce_rows_sums_in_rank_order_and_requantizes(average: bool) -> None:
    fmt = parse_format("int8/256")
    w, c = 3, 8192
    rows = [_reference_quantize(torch.randn(c) * (i + 1), fmt) for i in range(w)]
    acc_ref = _reference_dequantize(rows[0], torch.float32)
    for q in rows[1:]:
        acc_ref += _reference_dequantize(q, torch.float32)
    if average:
        acc_ref /= w
    wire = torch.cat([torch.cat([q.payload.view(1, -1), q.scales.view(1, -1).view(torch.uint8)], 1) for q in rows]).to(DEVICE)
    pb = fmt.payload_bytes(c)
    acc, q = tq.reduce_rows(wire[:, :pb], wire[:, pb:].contiguous().view(torch.float32), fmt, average=average, requantize=True)
    assert torch.equal(acc.cpu(), acc_ref)
    _assert_same_q(q, _reference_quantize(acc_ref, fmt, nonfinite="propagate"))
    # Into given tensors (the row the all-reduce sends back), the sum not kept.
    out = (torch.empty(pb, dtype=torch.uint8, device=DEVICE), torch.empty(c // 256, device=DEVICE))
    none, into = tq.reduce_rows(
        wire[:, :pb], wire[:, pb:].contiguous().view(torch.float32), fmt, average=average, keep_sum=False, requantize=True, out=out
    )
    assert none is None and into.payload.data_ptr() == out[0].data_ptr() and into.scales.data_ptr() == out[1].data_ptr()
    _assert_same_q(into, q)


def test_quantize_rows_into_wire_rows_writes_the_references_bytes() -> None:
    """Codes and scales of 3 rows written into wire rows [codes | scales] (a row stride past the codes)."""
    fmt = parse_format("int8/256")
    x = torch.randn(3, 2048) * torch.tensor([[1.0], [1e-3], [1e3]])
    x[2, 700] = float("nan")
    wire = torch.zeros(3, 2048 + 32 + 8, dtype=torch.uint8, device=DEVICE)
    tq.quantize_rows_into(x.to(DEVICE), wire[:, :2048], wire[:, 2048:2080].view(torch.float32), fmt)
    for i in range(3):
        want = _reference_quantize(x[i], fmt, nonfinite="propagate")
        got = QTensor(wire[i, :2048].cpu(), wire[i, 2048:2080].contiguous().view(torch.float32).cpu(), torch.Size([2048]), torch.float32, fmt)
        _assert_same_q(got, want)
    assert bool((wire[:, 2080:] == 0).all())


def test_dequantize_rows_reads_wire_rows_in_place_as_the_reference_dequantizes_each() -> None:
    fmt = parse_format("int8/256")
    rows = [_reference_quantize(torch.randn(1024) * (i + 1), fmt) for i in range(3)]
    wire = torch.cat([torch.cat([q.payload.view(1, -1), q.scales.view(1, -1).view(torch.uint8)], 1) for q in rows]).to(DEVICE)
    pb = fmt.payload_bytes(1024)
    out = torch.empty(3, 1024, device=DEVICE)
    tq.dequantize_rows(wire[:, :pb], wire[:, pb:].view(torch.float32), fmt, out)
    for i, q in enumerate(rows):
        assert torch.equal(out[i].cpu(), _reference_dequantize(q, torch.float32)), i


def _all_reduce_both_backends(rank: int, world_size: int) -> list[bool]:
    x = torch.randn(30001, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = {}
    for name in ("torch", "triton"):
        with backend.use_backend(name):
            t = x.clone()
            all_reduce_8bit(t, "avg")
            out[name] = t
    return [torch.equal(out["torch"], out["triton"]), bool(torch.isfinite(out["triton"]).all())]


@pytest.mark.skipif(ON_GPU, reason="gloo ranks run on CPU tensors: the kernels need the interpreter there")
def test_all_reduce_8bit_on_three_ranks_is_identical_under_both_backends() -> None:
    assert run_distributed(_all_reduce_both_backends, 3) == [[True, True]] * 3


# ---- spans of one storage: a parameter over many buckets, every row of every bucket, one launch each ----


def _span_storage(fmt, region_blocks: list[int]):
    """A storage of regions of whole blocks end to end (codes, then scales, each), and each region's Span."""
    from agoq.quant.formats import SCALE_BYTES
    from agoq.quant.spans import Span

    spans, offset, first = [], 0, 0
    for blocks in region_blocks:
        n = blocks * fmt.block_size
        spans.append(Span(first, n, offset, offset + fmt.payload_bytes(n)))
        offset += fmt.payload_bytes(n) + SCALE_BYTES * blocks
        first += n
    return torch.zeros(offset, dtype=torch.uint8, device=DEVICE), spans


def _region(storage, span, fmt) -> QTensor:
    n = span.values
    return QTensor(
        storage[span.payload_byte : span.payload_byte + fmt.payload_bytes(n)],
        storage[span.scale_byte : span.scale_byte + 4 * fmt.num_blocks(n)].view(torch.float32),
        torch.Size([n]),
        torch.float32,
        fmt,
    )


@pytest.mark.parametrize("spec", ("int8/256", "int4/64", "fp8"))
def test_span_kernels_fold_read_and_sum_every_region_in_one_launch_as_per_region_kernels_do(spec: str) -> None:
    from agoq.quant.spans import Span, span_table

    fmt = parse_format(spec)
    # Regions of uneven sizes, the last one's tail short of a block: a parameter spread over buckets.
    blocks = [3, 1, 7, 2]
    storage, whole = _span_storage(fmt, blocks)
    k = sum(blocks) * fmt.block_size - 5
    spans = whole[:-1] + [Span(whole[-1].first, k - whole[-1].first, whole[-1].payload_byte, whole[-1].scale_byte)]
    table = span_table(spans, fmt, DEVICE)
    assert table.count == len(blocks) and table.most_blocks == max(blocks)
    flag = torch.zeros(1, dtype=torch.uint8, device=DEVICE)
    one_by_one = [
        (torch.zeros(fmt.payload_bytes(w.values), dtype=torch.uint8, device=DEVICE), torch.zeros(fmt.num_blocks(w.values), device=DEVICE))
        for w in whole
    ]
    for i in range(3):
        g = (torch.randn(k) * 10.0 ** (i - 1)).to(DEVICE)
        tq.accumulate_spans_(storage, table, g, flag, first=i == 0)
        for s, (pay, sc) in zip(spans, one_by_one):
            tq.accumulate_(pay, sc, g[s.first : s.first + s.values], fmt, first=i == 0)
        for w, (pay, sc) in zip(whole, one_by_one):
            _assert_same_q(_region(storage, w, fmt), QTensor(pay, sc, torch.Size([w.values]), torch.float32, fmt))
    assert flag.item() == 0
    # Read back into one flat tensor, and the sum of squares of every value (exact squares in fp64).
    out = tq.dequantize_spans(storage, table, torch.full((k,), float("nan"), device=DEVICE))
    want = torch.cat([dequantize(QTensor(pay, sc, torch.Size([w.values]), torch.float32, fmt)) for w, (pay, sc) in zip(whole, one_by_one)])
    assert torch.equal(out.cpu(), want[:k].cpu())
    rows = span_table([Span(0, w.values, w.payload_byte, w.scale_byte) for w in whole], fmt, DEVICE)
    ref = sum(float((dequantize(_region(storage, s, fmt)).double() ** 2).sum()) for s in whole)
    assert tq.sum_of_squares_spans(storage, rows).item() == pytest.approx(ref, rel=1e-12)
    # A NaN in one region: that block's scale becomes 0 (off the wire) and the flag is set.
    g = torch.zeros(k, device=DEVICE)
    g[spans[2].first + fmt.block_size + 3] = float("nan")
    tq.accumulate_spans_(storage, table, g, flag, first=False)
    scales = _region(storage, whole[2], fmt).scales.cpu()
    assert flag.item() == 1 and scales[1].item() == 0.0 and torch.isfinite(scales).all()
    tq.zero_scales_spans_(storage, rows)
    assert tq.sum_of_squares_spans(storage, rows).item() == 0.0
    assert all((_region(storage, s, fmt).scales == 0).all() for s in whole)
