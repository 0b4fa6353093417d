"""The vector kernels of agoq.quant.simd: the reference's bytes, where they apply, and a failed build."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from agoq.quant import backend, dequantize, parse_format, quantize, simd
from agoq.quant import compiled as C

pytestmark = pytest.mark.skipif(simd.isa() is None, reason="no AVX2 or AVX-512 CPU: the vector kernels do not apply")

# Every ISA this CPU runs: its own, and AVX2 under an AVX-512 CPU.
ISAS = [isa for isa in ("avx512", "avx2") if simd.isa() == isa or (isa == "avx2" and simd.isa() == "avx512")]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(simd, "isa", lambda: request.param)
    monkeypatch.delenv(simd.ENV_VAR, raising=False)
    return request.param


def _blocks(rows: int, blocks: int, block: int, seed: int) -> torch.Tensor:
    """fp32 rows of blocks at magnitudes from 1e-30 to 1e30, with the cases a quantizer can get
    wrong: an all-zero block, -0, subnormals, exact ties (x / s = k + 1/2), NaN, +Inf and -Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks, block, generator=g) * torch.logspace(-30, 30, rows * blocks).view(rows, blocks, 1)
    x[0, 0] = 0.0
    x[0, 1, ::2] = -0.0
    x[0, 2] = torch.randn(block, generator=g) * 1e-40  # subnormal
    # s = 127 * 2**-3 / 127 exactly (no raise): x / s = k + 1/2, rounded half to even.
    x[0, 3] = (torch.arange(block) % 254 - 127 + 0.5).clamp(-127, 126.5) * 2.0**-3
    x[0, 3, 0] = 127 * 2.0**-3
    x[-1, -1, 5] = math.nan
    x[-1, -2, 7] = math.inf
    x[-1, -3, 1] = -math.inf
    return x.view(rows, blocks * block)


def _reference(x: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    with backend.use_backend("torch"):
        q = quantize(x.reshape(-1), fmt, nonfinite="propagate")
    return q.payload.view(x.shape[0], -1), q.scales.view(x.shape[0], -1)


@pytest.mark.parametrize("spec", ["int8/256", "int8/32"])
def test_quantized_rows_are_the_references_bytes(isa: str, spec: str) -> None:
    """Codes and scales of fp32 rows written into wire rows [codes | scales] (a row stride past
    the codes): the reference's, byte for byte, NaN and Inf blocks (NaN scale, the code of 0) included."""
    fmt = parse_format(spec)
    x = _blocks(3, 8, fmt.block_size, seed=1)
    n, nb = x.shape[1], x.shape[1] // fmt.block_size
    wire = torch.full((3, n + 4 * nb + 12), 0xAB, dtype=torch.uint8)
    kernel = simd.quantize_rows_kernel(fmt, x)
    assert kernel is not None
    kernel(x, wire[:, :n], wire[:, n : n + 4 * nb].view(torch.float32))
    codes, scales = _reference(x, fmt)
    assert torch.equal(wire[:, :n], codes)
    got = wire[:, n : n + 4 * nb].contiguous().view(torch.float32)
    assert torch.equal(got.isnan(), scales.isnan()) and int(scales.isnan().sum()) == 3
    assert torch.equal(got.nan_to_num(-1.0), scales.nan_to_num(-1.0))
    assert bool((wire[:, n + 4 * nb :] == 0xAB).all())  # nothing written past a row's scales


@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_reduced_rows_are_the_references_bytes(isa: str, average: bool, world: int) -> None:
    """W quantized rows summed in fp32 in row order (then / W) and requantized: the reference's
    bytes, with rows read where they lie in a wire buffer and a rank's NaN block."""
    fmt = parse_format("int8/256")
    inputs = [_blocks(1, 6, 256, seed=r).view(-1) for r in range(world)]
    inputs[-1][300] = math.nan
    with backend.use_backend("torch"):
        rows = [quantize(x, fmt, nonfinite="propagate") for x in inputs]
        acc = dequantize(rows[0]).clone()
        for q in rows[1:]:
            acc += dequantize(q)
        if average:
            acc /= world
        want = quantize(acc, fmt, nonfinite="propagate")
    n = inputs[0].numel()
    wire = torch.cat([torch.cat([q.payload, q.scales.view(torch.uint8)]).view(1, -1) for q in rows])
    out_codes, out_scales = torch.empty(n, dtype=torch.uint8), torch.empty(n // 256)
    kernel = simd.reduce_rows_kernel(fmt, wire.device)
    assert kernel is not None
    kernel(wire[:, :n], wire[:, n:].view(torch.float32), out_codes, out_scales, average)
    assert torch.equal(out_codes, want.payload)
    assert torch.equal(out_scales.nan_to_num(-1.0), want.scales.nan_to_num(-1.0)) and bool(out_scales.isnan().any())


def test_the_kernels_apply_to_int8_fp32_on_few_threads_unless_turned_off(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    int8, x = parse_format("int8/256"), torch.zeros(1, 256)
    assert simd.quantize_rows_kernel(int8, x) is not None
    assert simd.quantize_rows_kernel(parse_format("int4/256"), x) is None  # packed codes: inductor's path
    assert simd.quantize_rows_kernel(parse_format("fp8/256"), x) is None
    assert simd.quantize_rows_kernel(int8, x.bfloat16()) is None
    assert simd.quantize_rows_kernel(parse_format("int8/8"), x) is None  # blocks narrower than two vectors
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(simd.MAX_THREADS + 1)
        assert simd.quantize_rows_kernel(int8, x) is None and simd.reduce_rows_kernel(int8, x.device) is None
    finally:
        torch.set_num_threads(saved)
    monkeypatch.setenv(simd.ENV_VAR, "0")
    assert simd.quantize_rows_kernel(int8, x) is None and simd.reduce_rows_kernel(int8, x.device) is None


def test_the_kernels_refuse_tensors_they_would_misread(isa: str) -> None:
    """Shapes, strides and dtypes are checked before the loops run (they read raw pointers)."""
    fmt = parse_format("int8/256")
    x = torch.zeros(2, 512)
    quantize_rows = simd.quantize_rows_kernel(fmt, x)
    reduce_rows = simd.reduce_rows_kernel(fmt, x.device)
    assert quantize_rows is not None and reduce_rows is not None
    codes, scales = torch.empty(2, 512, dtype=torch.uint8), torch.empty(2, 2)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows(x.t().contiguous().t(), codes, scales)
    with pytest.raises(ValueError, match="matching"):
        quantize_rows(x, codes[:, :256], scales)
    with pytest.raises(ValueError, match="uint8"):
        quantize_rows(x, codes.float(), scales)
    out_codes, out_scales = torch.empty(512, dtype=torch.uint8), torch.empty(2)
    with pytest.raises(ValueError, match="uint8 codes and fp32 scales"):
        reduce_rows(codes, scales.double(), out_codes, out_scales, False)
    with pytest.raises(ValueError, match="outputs to match"):
        reduce_rows(codes, scales, out_codes[:256], out_scales, False)


def test_a_failed_build_warns_once_and_inductors_code_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No compiler (or one that fails): one RuntimeWarning naming the way out, no kernel, and
    compiled.quantize_rows_into still writes the reference's bytes."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no library built before
    monkeypatch.setattr(simd, "_compiler", lambda: str(tmp_path / "no-such-compiler"))
    simd.library.cache_clear()
    try:
        fmt = parse_format("int8/256")
        x = _blocks(2, 4, 256, seed=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert simd.quantize_rows_kernel(fmt, x) is None
            assert simd.reduce_rows_kernel(fmt, x.device) is None
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and simd.ENV_VAR in messages[0], messages
        codes, scales = torch.empty(2, 1024, dtype=torch.uint8), torch.empty(2, 4)
        C.quantize_rows_into(x, codes, scales, fmt)
        want_codes, want_scales = _reference(x, fmt)
        assert torch.equal(codes, want_codes) and torch.equal(scales.nan_to_num(-1.0), want_scales.nan_to_num(-1.0))
    finally:
        simd.library.cache_clear()
