"""agoq.quant: error bounds, unbiased stochastic rounding, exact bytes, bit layouts and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

import agoq.quant.qtensor as qtensor_mod
from agoq.quant import NonFiniteError, QTensor, QuantFormat, dequantize, parse_format, quantization_error_bound, quantize
from agoq.quant.formats import SCALE_DTYPE
from agoq.quant.packing import pack, unpack
from agoq.quant.formats import NF4_VALUES, codebook_tables

INT_FORMATS = ["int2", "int3", "int4", "int5", "int6", "int8"]
CODEBOOK_FORMATS = ["fp4", "nf4", "fp8"]
ALL_FORMATS = INT_FORMATS + CODEBOOK_FORMATS
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 arithmetic (x / s, then q * s) adds at most a few ulps of |x| to the exact-arithmetic bound.
ULP_SLACK = 2.0**-22


def _format_values(q: QTensor) -> torch.Tensor:
    """Each element's format value before scaling (dequantized / scale), from the codes."""
    codes = unpack(q.payload, q.fmt.bits, q.numel).long()
    if q.fmt.kind == "int":
        return codes.float() - 2 ** (q.fmt.bits - 1)
    return codebook_tables(q.fmt.kind).by_code[codes]


def _per_element_scale(q: QTensor) -> torch.Tensor:
    return q.scales.repeat_interleave(q.fmt.block_size)[: q.numel].reshape(q.shape)


def _assert_within_bound(x: torch.Tensor, fmt: str) -> QTensor:
    q = quantize(x, fmt)
    err = (x.double() - dequantize(q, torch.float32).double()).abs()
    bound = quantization_error_bound(q).double()
    slack = x.double().abs() * ULP_SLACK
    worst = (err - bound - slack).max().item() if x.numel() else 0.0
    assert worst <= 0, f"{fmt}: error exceeds the per-element bound by {worst}"
    return q


# --- round trip: nearest rounding (with random shapes and magnitudes: tests/test_quant_properties.py)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_bound_is_exactly_half_the_scale_and_is_attained(fmt):
    x = torch.randn(64 * 128, generator=torch.Generator().manual_seed(0))
    q = _assert_within_bound(x, fmt)
    half_scale = _per_element_scale(q) / 2
    assert torch.equal(quantization_error_bound(q), half_scale)
    # Not a vacuous bound: the worst element comes within 5% of it.
    err = (x - dequantize(q)).abs()
    assert (err / half_scale).max() > 0.95


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_nearest_picks_a_closest_representable_value(fmt):
    x = torch.randn(32 * 128, generator=torch.Generator().manual_seed(1)) * 3
    q = quantize(x, fmt)
    s = _per_element_scale(q)
    if q.fmt.kind == "int":
        grid = torch.arange(-q.fmt.qmax, q.fmt.qmax + 1, dtype=torch.float32)
    else:
        grid = codebook_tables(q.fmt.kind).values
    best = (x[:, None] - grid[None, :] * s[:, None]).abs().min(dim=1).values
    got = (x - dequantize(q)).abs()
    assert (got <= best + x.abs() * ULP_SLACK).all()


def test_codebook_bound_is_half_the_local_gap():
    # fp4 around 3 (neighbours 2 and 4): gaps 1 and 1 -> bound 0.5; around 6 (neighbour 4): 1.0.
    x = torch.tensor([3.0, 6.0, 0.5, 0.1] + [0.0] * 124)
    q = quantize(x, "fp4")
    assert q.scales[0] == 1.0
    assert quantization_error_bound(q)[:4].tolist() == [0.5, 1.0, 0.25, 0.25]


# --- round trip: stochastic rounding ------------------------------------------------------------


def _draws(x: torch.Tensor, fmt: str, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draws x len(x) stochastic dequantizations, the lower neighbour and the gap (scaled) per element."""
    g = torch.Generator().manual_seed(seed)
    f = parse_format(fmt)
    assert x.numel() % f.block_size == 0  # every copy sees the same blocks, hence the same scales
    q = quantize(x.repeat(draws), f, rounding="stochastic", generator=g)
    samples = dequantize(q).view(draws, -1).double()
    s = _per_element_scale(quantize(x, f)).double()
    y = x.double() / s
    if f.kind == "int":
        lo, gap = torch.floor(y), torch.ones_like(y)
    else:
        vals = codebook_tables(f.kind).values.double()
        i = (torch.searchsorted(vals, y, right=True) - 1).clamp(0, vals.numel() - 2)
        lo, gap = vals[i], vals[i + 1] - vals[i]
    return samples, lo * s, gap * s


@pytest.mark.parametrize("fmt", ["int2", "int4", "int8", "fp4", "nf4", "fp8"])
def test_stochastic_rounding_is_unbiased_with_variance_f_one_minus_f(fmt):
    draws = 4000
    x = torch.randn(256, generator=torch.Generator().manual_seed(2)) * 2.5
    samples, lo, gap = _draws(x, fmt, draws, seed=3)
    f = ((x.double() - lo) / gap).clamp(0, 1)
    var = f * (1 - f) * gap**2  # Bernoulli(f) between the neighbours
    # Only the two neighbours ever appear.
    assert torch.isclose(samples, lo, atol=0, rtol=1e-6).logical_or(torch.isclose(samples, lo + gap, atol=0, rtol=1e-6)).all()
    # Unbiased: the mean of n draws has sd sqrt(var / n); allow 5 sd per element (plus 3 draws'
    # worth, for f near 0 or 1 where the binomial is too skewed for a normal tail) and 4 sd overall.
    bias = samples.mean(0) - x.double()
    assert (bias.abs() <= 5 * (var / draws).sqrt() + 3 * gap / draws + 1e-6 * x.double().abs()).all()
    z = bias.sum() / (var.sum() / draws).sqrt()
    assert abs(z) < 4, f"total bias is {z:.2f} standard deviations"
    # Variance: the pooled sample variance against f(1-f) gap^2; its sd follows from the 4th moment
    # of a Bernoulli: Var(s^2) ~ (mu4 - var^2) / n with mu4 = gap^4 f(1-f)(1 - 3f(1-f)).
    mu4 = gap**4 * f * (1 - f) * (1 - 3 * f * (1 - f))
    sd_total = ((mu4 - var**2).clamp(min=0) / draws).sum().sqrt()
    got = samples.var(0, unbiased=True).sum()
    assert abs(got - var.sum()) < 5 * sd_total, f"variance {got:.4g} vs theory {var.sum():.4g}"


def test_stochastic_rounding_is_reproducible_with_a_seeded_generator():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    a = quantize(x, "int4", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = quantize(x, "int4", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = quantize(x, "int4", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.payload, c.payload)


# --- bytes and packing --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("numel", [1, 3, 127, 128, 129, 255, 257, 1001, 12345])
def test_byte_count_is_packed_payload_plus_fp32_scales(fmt, numel):
    f = parse_format(fmt, 128)
    q = quantize(torch.randn(numel), f)
    expected = math.ceil(numel * f.bits / 8) + 4 * math.ceil(numel / 128)
    assert q.nbytes == expected == f.nbytes(numel)
    assert q.payload.dtype == torch.uint8 and q.payload.numel() == math.ceil(numel * f.bits / 8)
    assert q.scales.dtype == SCALE_DTYPE == torch.float32 and q.scales.numel() == math.ceil(numel / 128)


def test_int5_stores_five_bits_per_value():
    q = quantize(torch.randn(1024), "int5/256")
    assert q.nbytes == 640 + 16


def test_pack_rejects_codes_wider_than_the_bit_width():
    with pytest.raises(ValueError, match="does not fit in 3 bits"):
        pack(torch.tensor([8], dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="truncated or mismatched"):
        unpack(torch.zeros(2, dtype=torch.uint8), 4, 5)


@pytest.mark.parametrize("bits", range(1, 9))
def test_the_per_group_packing_a_compiled_graph_runs_writes_the_swar_bytes(bits):
    """pack_groups / unpack_groups (arithmetic per group, in compiled graphs) against pack / unpack
    (SWAR): the same bytes, the rows' shape kept."""
    from agoq.quant.packing import pack_groups, packing_group, unpack_groups

    g, _ = packing_group(bits)
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 16 * g), generator=gen, dtype=torch.uint8)
    codes[0], codes[1] = (1 << bits) - 1, 0  # every bit of a group set, and none
    payload = pack_groups(codes, bits)
    assert payload.shape == (5, 16 * g * bits // 8) and payload.dtype == torch.uint8
    assert torch.equal(payload.reshape(-1), pack(codes.reshape(-1), bits))
    assert torch.equal(unpack_groups(payload, bits), codes)


# --- format bit patterns ------------------------------------------------------------------------


def test_fp8_payload_is_valid_float8_e4m3fn():
    x = torch.randn(40 * 128, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 40 * 128)
    q = quantize(x, "fp8")
    raw = q.payload.view(torch.float8_e4m3fn).float()
    assert torch.isfinite(raw).all()  # no 0x7F / 0xFF NaN codes
    assert torch.equal(raw.view(-1, 128) * q.scales[:, None], dequantize(q).view(-1, 128))
    # Nearest is torch's own float8 cast of x / scale (ties to even).
    s = _per_element_scale(q)
    assert torch.equal(raw, (x / s).to(torch.float8_e4m3fn).float())


def test_fp4_codes_follow_e2m1():
    x = torch.randn(16 * 128, generator=torch.Generator().manual_seed(6))
    q = quantize(x, "fp4")
    c = unpack(q.payload, 4, q.numel).long()
    sign, exp, man = c >> 3, (c >> 1) & 3, c & 1
    e2m1 = torch.where(exp == 0, 0.5 * man, 2.0 ** (exp - 1) * (1 + 0.5 * man)) * (1 - 2 * sign)
    assert torch.equal(dequantize(q), e2m1.float() * _per_element_scale(q))
    assert set(c.unique().tolist()) <= set(range(16)) - {8}  # zero is stored as +0


def test_nf4_table_is_the_normal_quantile_construction():
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    pos = normal.icdf(torch.linspace(0.9677083, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(0.9677083, 0.5, 8, dtype=torch.float64)[:-1])
    vals = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    assert torch.allclose(torch.tensor(NF4_VALUES, dtype=torch.float64), vals / vals.abs().max(), atol=2e-7, rtol=0)


def test_tie_rules():
    def codes_of(x, fmt):
        return unpack(quantize(x, fmt).payload, parse_format(fmt).bits, x.numel()).tolist()

    # int: torch.round, ties to even; scale 1 from the block maximum qmax = 7.
    assert codes_of(torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5]), "int4/6") == [15, 8, 10, 10, 8, 6]
    # fp4: midpoints go to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 5 -> 4).
    mids = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    assert codes_of(mids, "fp4/10") == [7, 0, 2, 2, 4, 4, 6, 6, 10, 14]
    # nf4: midpoints go to the lower value (bitsandbytes' strict `x > threshold`).
    v = torch.tensor(NF4_VALUES)
    m = ((v[1:].double() + v[:-1].double()) / 2).float()
    y = torch.cat([torch.tensor([1.0]), m])
    assert codes_of(y, f"nf4/{y.numel()}")[1:] == [i if m[i] > (v[i] + v[i + 1]) / 2 else i for i in range(15)]


# --- edge cases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_all_zero_blocks_give_exact_zeros(fmt):
    x = torch.zeros(3 * 128)
    x[128:256] = torch.randn(128)
    q = quantize(x, fmt)
    y = dequantize(q)
    assert not torch.isnan(y).any()
    assert torch.equal(y[:128], torch.zeros(128)) and torch.equal(y[256:], torch.zeros(128))
    assert q.scales[0] == 0 and q.scales[2] == 0


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("magnitude", [1e-30, 1e30, 3e38, 1e-40, 1e-42, 1e-44])
def test_tiny_huge_and_subnormal_magnitudes(fmt, magnitude):
    x = torch.randn(4 * 128, generator=torch.Generator().manual_seed(9)).clamp(-1, 1) * magnitude
    q = _assert_within_bound(x, fmt)
    assert torch.isfinite(q.scales).all() and (q.scales > 0).all()
    assert torch.isfinite(dequantize(q)).all()
    # The scale is the block maximum over max_value rounded up, so nothing clips, even where fp32
    # scales are subnormal and absmax / max_value loses most of its bits.
    absmax = x.view(-1, 128).abs().amax(1).double()
    assert (q.scales.double() * q.fmt.max_value >= absmax).all()
    if magnitude < 1e-37:
        return  # subnormal scales are coarser than absmax / max_value; the bound above still holds
    # Relative to the block maximum, the error is what the format promises at any magnitude.
    rel = (x - dequantize(q)).abs().max() / x.abs().max()
    if q.fmt.kind == "int":
        promised = 0.5 / q.fmt.qmax
    else:
        vals = codebook_tables(q.fmt.kind).values
        promised = (vals.diff().max() / 2 / vals.abs().max()).item()  # fp4 1/6, nf4 0.152, fp8 1/28
    assert rel <= promised * (1 + 1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (127,), (128,), (129,), (3, 5, 7), (2, 0, 4), (4, 128), ()])
def test_dtype_and_shape_round_trip(dtype, shape):
    x = torch.randn(shape).to(dtype)
    q = quantize(x, "int4/128")
    y = dequantize(q)
    assert y.dtype == dtype and y.shape == x.shape
    assert dequantize(q, torch.float32).dtype == torch.float32
    # Dequantizing to a low-precision dtype rounds the fp32 result once.
    assert torch.equal(y, dequantize(q, torch.float32).to(dtype))
    if x.numel():
        _assert_within_bound(x, "int4/128")


def test_noncontiguous_and_grad_inputs():
    base = torch.randn(64, 50, requires_grad=True)
    x = base.t()  # non-contiguous view of a leaf that requires grad
    q = quantize(x, "int8/64")
    assert torch.equal(dequantize(q), dequantize(quantize(x.detach().contiguous(), "int8/64")))
    assert not dequantize(q).requires_grad


@pytest.mark.parametrize("fmt", ["int4/100", "nf4/64", "int3/128", "fp8/256"])
def test_result_does_not_depend_on_the_slab_size(fmt, monkeypatch):
    x = torch.randn(9 * 1000 + 37, generator=torch.Generator().manual_seed(10))
    ref = quantize(x, fmt)
    monkeypatch.setattr(qtensor_mod, "CPU_SLAB", 512)  # many slabs, a partial block at the end
    q = quantize(x, fmt)
    assert torch.equal(q.payload, ref.payload) and torch.equal(q.scales, ref.scales)
    assert torch.equal(dequantize(q), dequantize(ref))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_raises_naming_the_index(value):
    x = torch.randn(3, 200)
    x[1, 17] = value
    with pytest.raises(NonFiniteError, match=r"flat index 217 \(index \(1, 17\), value -?(nan|inf)\)"):
        quantize(x, "int4")
    with pytest.raises(NonFiniteError, match="flat index 3"):
        quantize(torch.tensor([1.0, 2.0, 3.0, 1e300], dtype=torch.float64), "int8")  # beyond fp32


@pytest.mark.parametrize("fmt", ["int4", "nf4", "fp8"])
def test_nonfinite_propagate_poisons_only_its_block(fmt):
    x = torch.randn(4 * 128, generator=torch.Generator().manual_seed(11))
    clean = dequantize(quantize(x, fmt))
    x[2 * 128 + 5] = float("inf")
    x[3 * 128 + 0] = float("nan")
    y = dequantize(quantize(x, fmt, nonfinite="propagate"))
    assert torch.isnan(y[256:]).all()
    assert torch.equal(y[:256], clean[:256])


def test_every_public_argument_is_checked_naming_it_before_any_value_is_returned():
    q = quantize(torch.randn(4, 300), "int4")
    wrong = {
        "dtype must be one of fp32/bf16/fp16/fp64, got torch.int32": (ValueError, lambda: dequantize(q, dtype=torch.int32)),
        "out must be a floating-point tensor (fp32/bf16/fp16/fp64), got torch.int64": (
            ValueError,
            lambda: dequantize(q, out=torch.zeros(4, 300, dtype=torch.int64)),
        ),
        "got NoneType None": (TypeError, lambda: quantize(torch.randn(4), None)),
        "got int 4": (TypeError, lambda: quantize(torch.randn(4), 4)),
        "dequantize expects a QTensor (what quantize returns), got Tensor": (TypeError, lambda: dequantize(torch.randn(4))),
        "quantize expects a floating-point torch.Tensor (fp32/bf16/fp16/fp64), got list": (TypeError, lambda: quantize([1.0], "int4")),
        "block_size must be an integer in 1..1048576, got 99999999999999999999": (
            ValueError,
            lambda: parse_format("int4/99999999999999999999"),
        ),
        "blocks(2048, 10): start must be a block boundary (a multiple of 128) in 0..1536": (ValueError, lambda: q.blocks(2048, 10)),
    }
    for message, (kind, call) in wrong.items():
        with pytest.raises(kind) as raised:
            call()
        assert message in str(raised.value)
    out = torch.zeros(4, 300, dtype=torch.int64)
    with pytest.raises(ValueError):
        dequantize(q, out=out)
    assert not out.any()  # nothing written into the refused output


def test_bad_specs_give_clear_errors():
    for spec in ["int7", "int9", "int1", "fp5", "int4/0", "int4/-3", "bf16", ""]:
        with pytest.raises(ValueError, match="format|block_size|bits"):
            parse_format(spec)
    with pytest.raises(ValueError, match="fp4 is a 4-bit format"):
        QuantFormat("fp4", 8)
    with pytest.raises(ValueError, match="block_size must be an integer in 1..1048576"):
        QuantFormat("int", 4, 0)
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize(torch.ones(4), "int4", rounding="up")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        quantize(torch.ones(4), "int4", nonfinite="ignore")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(4, dtype=torch.int32), "int4")
    q = quantize(torch.ones(300), "int4")
    with pytest.raises(ValueError, match="truncated or mismatched"):
        dequantize(QTensor(q.payload[:-1], q.scales, q.shape, q.dtype, q.fmt))
    with pytest.raises(ValueError, match="truncated or mismatched"):
        dequantize(QTensor(q.payload, q.scales[:-1], q.shape, q.dtype, q.fmt))


def test_parse_format_round_trips_names_and_defaults():
    assert parse_format("int4") == QuantFormat("int", 4, 128)
    assert parse_format("INT8/256") == QuantFormat("int", 8, 256)
    assert parse_format("nf4", 64).name == "nf4/64"
    for f in ALL_FORMATS:
        assert parse_format(parse_format(f + "/32").name) == parse_format(f + "/32")


@pytest.mark.parametrize("fmt", ["int4/128", "int8/256", "nf4/64", "fp8/128", "int3/128"])
def test_blocks_is_a_zero_copy_slice_that_dequantizes_to_the_same_values(fmt):
    x = torch.randn(1000)
    q = quantize(x, fmt)
    full = dequantize(q)
    block = q.fmt.block_size
    for start, n in [(0, 1000), (block, 2 * block), (block, 1), (2 * block, 10_000)]:
        part = q.blocks(start, n)
        assert part.payload.untyped_storage().data_ptr() == q.payload.untyped_storage().data_ptr()
        got = dequantize(part)
        assert torch.equal(got[: min(n, 1000 - start)], full[start : start + n])
    with pytest.raises(ValueError, match=rf"start must be a block boundary \(a multiple of {block}\) in 0..1000"):
        q.blocks(block // 2, 10)
    past = 1000 // block * block + block  # the first block boundary past the end
    with pytest.raises(ValueError, match=rf"blocks\({past}, 10\): start must be a block boundary"):
        q.blocks(past, 10)
    with pytest.raises(ValueError, match="the number of values must be at least 0"):
        q.blocks(0, -1)
    assert q.blocks(1000 // block * block, 10_000).numel == 1000 % block or block  # clipped at the last value stored


@pytest.mark.parametrize("which", ["torch", "compiled"])
@pytest.mark.parametrize("spec", ["int8/256", "int4/128", "nf4/128"])
def test_dequantize_into_out_writes_the_same_values_in_place(which: str, spec: str) -> None:
    from agoq.quant import backend

    if which == "compiled" and not backend.compiler_available():
        pytest.skip("no C++ compiler for torch.compile")
    fmt = parse_format(spec)
    for n in (2 * fmt.block_size, 3 * fmt.block_size * 8 + 5):  # whole blocks; a partial last block
        _check_dequantize_into(which, fmt, torch.randn(n, generator=torch.Generator().manual_seed(n)))


def _check_dequantize_into(which: str, fmt, x: torch.Tensor) -> None:
    from agoq.quant import backend

    with backend.use_backend(which):
        q = quantize(x, fmt)
        for dtype in (torch.float32, torch.bfloat16):
            want = dequantize(q, dtype)
            out = torch.full((x.numel(),), float("nan"), dtype=dtype)
            assert dequantize(q, out=out) is out and torch.equal(out, want)
            strided = torch.full((x.numel(), 2), float("nan"), dtype=dtype)[:, 0]  # not contiguous
            assert torch.equal(dequantize(q, out=strided), want)
        with pytest.raises(ValueError, match=f"holds {x.numel()}"):
            dequantize(q, out=torch.empty(x.numel() - 1))
