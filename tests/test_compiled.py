"""The compiled CPU path (agoq.quant.compiled) equals the torch reference: codes, scales, sums, folds.

One test per formula family; each compiles a few graphs (one per kind and dtype), so the formats
below are chosen to share them: int widths share a graph at any block size.
"""

from __future__ import annotations

import math

import pytest
import torch

from agoq.quant import QTensor, backend, dequantize, parse_format, quantize
from agoq.quant import compiled as C

pytestmark = [
    pytest.mark.skipif(not backend.compiler_available(), reason="no C++ compiler for torch.compile"),
    # A graph that falls back to eager code would pass by being the reference: every graph here must build.
    pytest.mark.filterwarnings("error:agoq. torch.compile could not build:RuntimeWarning"),
]

# (format, input dtype): every kind, the activation formats in bf16.
FORMATS = [
    ("int4/128", torch.bfloat16),
    ("int3/64", torch.bfloat16),
    ("int8/256", torch.float32),
    ("fp4/128", torch.bfloat16),
    ("nf4/128", torch.bfloat16),
    ("fp8/128", torch.float32),
]


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
    x[: min(n, 128)] = 0.0  # an all-zero block: scale 0, exact zeros
    return x.to(dtype)


def _reference(fn, *args, **kwargs):
    with backend.use_backend("torch"):
        return fn(*args, **kwargs)


def _assert_same(got: QTensor, want: QTensor, where: object) -> None:
    assert torch.equal(got.payload, want.payload), where
    assert torch.equal(got.scales.nan_to_num(-1.0), want.scales.nan_to_num(-1.0)), where


@pytest.mark.parametrize("spec,dtype", FORMATS, ids=[f for f, _ in FORMATS])
def test_codes_scales_and_values_are_bit_identical_to_the_reference(spec: str, dtype: torch.dtype) -> None:
    fmt = parse_format(spec)
    # A partial last block and byte, and whole blocks.
    for n in (4 * 128 * 3 + 77, 65536):
        x = _data(n, dtype)
        ref = _reference(quantize, x, fmt)
        _assert_same(C.quantize(x, fmt), ref, (spec, n))
        assert torch.equal(C.dequantize(ref), _reference(dequantize, ref)), (spec, n)
    # Every byte value in every position of a block, under scales from 2**-20 to 2**20 and 0.
    blocks = max(2, 256 * 8 // fmt.block_size // fmt.bits * 2)
    payload = torch.arange(256, dtype=torch.uint8).repeat(-(-blocks * fmt.payload_bytes(fmt.block_size) // 256))
    payload = payload[: blocks * fmt.payload_bytes(fmt.block_size)]
    scales = torch.logspace(-20, 20, blocks, base=2.0)
    scales[0] = 0.0
    q = QTensor(payload, scales, torch.Size([blocks * fmt.block_size]), dtype, fmt)
    assert torch.equal(C.dequantize(q).nan_to_num(7.0), _reference(dequantize, q).nan_to_num(7.0)), spec


def test_one_graph_of_a_format_serves_every_block_count() -> None:
    # The block count is symbolic from the first graph on: torch.compile's default builds one graph
    # for the first size and a second, symbolic one at the next, which every later size runs.
    from torch._dynamo.utils import counters

    fmt = parse_format("int8/256")
    C._graph.cache_clear()  # the quantize graph on a code object Dynamo has not seen
    before = counters["stats"]["unique_graphs"]
    for blocks in (3, 40, 7):
        x = _data(blocks * fmt.block_size, torch.float32, seed=blocks)
        _assert_same(C.quantize(x, fmt), _reference(quantize, x, fmt), blocks)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_the_backend_switch_routes_quantize_and_non_finite_blocks_get_the_reference_bits_without_a_host_read() -> None:
    fmt = parse_format("int8/256")
    x = _data(2048, torch.float32)
    with backend.use_backend("compiled"):
        assert backend.kernels("cpu", fmt) is C
        q = quantize(x, fmt)
        y = dequantize(q)
    ref = _reference(quantize, x, fmt)
    assert torch.equal(q.payload, ref.payload) and torch.equal(y, _reference(dequantize, ref))
    x[300], x[1900] = float("nan"), float("inf")
    with backend.use_backend("compiled"):
        q = quantize(x, fmt, nonfinite="propagate")  # built before the count
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            q = quantize(x, fmt, nonfinite="propagate")
        # The NaN blocks are masked in the graph: no read of a value to the host (a GPU would stall on it).
        assert not [e.name for e in prof.events() if e.name == "aten::_local_scalar_dense"]
        with pytest.raises(ValueError, match="flat index 300"):
            quantize(x, fmt)
    _assert_same(q, _reference(quantize, x, fmt, nonfinite="propagate"), "nonfinite")
    assert torch.isnan(q.scales).tolist() == [False, True, False, False, False, False, False, True]


@pytest.mark.parametrize("spec", ["int8/256", "int4/128"])
def test_the_gradient_fold_equals_dequantize_add_requantize(spec: str) -> None:
    fmt = parse_format(spec)
    n = 8 * fmt.block_size
    pay_c = torch.zeros(fmt.payload_bytes(n), dtype=torch.uint8)
    sc_c = torch.zeros(n // fmt.block_size)
    pay_r, sc_r = pay_c.clone(), sc_c.clone()
    for step in range(3):
        g = _data(n - 5, torch.bfloat16, seed=step)  # shorter than the region: the rest adds zero
        C.accumulate_(pay_c, sc_c, g, fmt, first=step == 0)
        with backend.use_backend("torch"):
            region = QTensor(pay_r, sc_r, torch.Size([n]), torch.float32, fmt)
            x = torch.zeros(n) if step == 0 else dequantize(region)
            x[: g.numel()] += g.float()
            q = quantize(x, fmt)
        pay_r.copy_(q.payload)
        sc_r.copy_(q.scales)
        assert torch.equal(pay_c, pay_r) and torch.equal(sc_c, sc_r), (spec, step)
    # A fold that overflows: that block's scale is NaN (accumulate_) or 0 and flagged (fold_).
    g = _data(n, torch.bfloat16, seed=9)
    g[300] = float("inf")
    before = sc_c.clone()
    C.accumulate_(pay_c, sc_c, g, fmt, first=False)
    bad = 300 // fmt.block_size
    assert torch.isnan(sc_c[bad]) and int(sc_c.isnan().sum()) == 1
    sc_c.copy_(before)
    assert bool(C.fold_(pay_c, sc_c, g, fmt, first=False)) and sc_c[bad] == 0.0
    assert not bool(C.fold_(pay_c, sc_c, g.nan_to_num(posinf=0.0), fmt, first=False))


@pytest.mark.parametrize("average", [False, True])
def test_the_all_reduce_local_sum_is_the_reference_sum_in_rank_order(average: bool) -> None:
    fmt = parse_format("int8/256")
    rows = [quantize(_data(1024, torch.float32, seed=r), fmt) for r in range(3)]
    pay = torch.stack([q.payload for q in rows])
    sc = torch.stack([q.scales for q in rows])
    acc, q = C.reduce_rows(pay, sc, fmt, average=average, requantize=True)
    with backend.use_backend("torch"):
        want = dequantize(rows[0])
        for r in rows[1:]:
            want = want + dequantize(r)
        if average:
            want = want / 3
        want_q = quantize(want, fmt)
    assert torch.equal(acc, want)
    _assert_same(q, want_q, "sum")
    # Rows read where they lie in a wider buffer (as a wire buffer's payloads), without the sum, into out.
    wide = torch.zeros(3, pay.shape[1] + 64, dtype=torch.uint8)
    wide[:, : pay.shape[1]] = pay
    out = (torch.empty_like(want_q.payload), torch.empty_like(want_q.scales))
    no_sum, strided = C.reduce_rows(wide[:, : pay.shape[1]], sc, fmt, average=average, keep_sum=False, requantize=True, out=out)
    assert no_sum is None and strided.payload is out[0]
    _assert_same(strided, want_q, "strided")
    # A block whose sum is not finite: a NaN scale, the other blocks' bytes the reference's.
    inputs = [_data(1024, torch.float32, seed=r) for r in range(3)]
    inputs[1][300] = float("inf")
    rows = [quantize(x, fmt, nonfinite="propagate") for x in inputs]
    pay, sc = torch.stack([q.payload for q in rows]), torch.stack([q.scales for q in rows])
    with backend.use_backend("torch"):
        total = dequantize(rows[0]) + dequantize(rows[1]) + dequantize(rows[2])
        want = quantize(total / 3 if average else total, fmt, nonfinite="propagate")
    for keep_sum in (True, False):
        acc, q = C.reduce_rows(pay, sc, fmt, average=average, keep_sum=keep_sum, requantize=True)
        assert (acc is not None) == keep_sum and int(q.scales.isnan().sum()) == 1
        _assert_same(q, want, keep_sum)


@pytest.mark.parametrize("spec", ["int8/256", "fp8/128", "int4/64"])
def test_dequantizing_rows_in_place_equals_dequantizing_each_row(spec: str) -> None:
    """dequantize_rows reads W rows' payloads and scales where they lie in a wire buffer of rows
    [payload | scales] (8-bit codes in one call, others a row at a time) and writes the reference's values."""
    fmt = parse_format(spec)
    rows = [quantize(_data(1024, torch.float32, seed=r), fmt) for r in range(3)]
    pb = rows[0].payload.numel()
    wire = torch.cat([torch.cat([q.payload, q.scales.view(torch.uint8)]).view(1, -1) for q in rows])
    out = torch.empty(3, 1024)
    C.dequantize_rows(wire[:, :pb], wire[:, pb:].view(torch.float32), fmt, out)
    for i, q in enumerate(rows):
        assert torch.equal(out[i], _reference(dequantize, q)), i


@pytest.mark.parametrize("spec", ["int8/256", "nf4/64"])
def test_sum_of_squares_reads_whole_blocks_and_equals_the_dequantized_sum(spec: str) -> None:
    fmt = parse_format(spec)
    x = torch.randn(fmt.block_size * 37) * 3
    q = quantize(x, fmt)
    ref = torch.linalg.vector_norm(dequantize(q), dtype=torch.float64).square()
    got = C.sum_of_squares(q)
    assert got.dtype == torch.float64 and abs(float(got) - float(ref)) <= 1e-12 * float(ref)
    with pytest.raises(ValueError, match="whole blocks"):
        C.sum_of_squares(quantize(x[:-1], fmt))


def test_a_formula_reading_codes_equals_the_formula_on_dequantized_values() -> None:
    from agoq.activation.ops import _swiglu_backward

    fmt = parse_format("int4/128")
    torch.manual_seed(0)
    rows, width = 15, 256  # rows of whole blocks
    gate, up, grad = torch.randn(rows, width) * 2, torch.randn(rows, width), torch.randn(rows, width)
    qg, qu = quantize(gate, fmt), quantize(up, fmt)
    constants = {"act_dtype": torch.float32, "gate_dtype": torch.float32, "up_dtype": torch.float32}
    fused = C.reading_codes(_swiglu_backward, fmt, (1, 2), **constants)
    got = fused(grad, qg, qu)
    want = _swiglu_backward(grad, dequantize(qg, torch.float32), dequantize(qu, torch.float32), **constants)
    for g, w in zip(got, want):
        assert g.shape == (rows, width)
        # The same fp32 operations; inductor's exp may round apart from torch's by an ulp, which the
        # products after it carry to a few.
        torch.testing.assert_close(g, w, rtol=4 * 2.0**-23, atol=0)
    with pytest.raises(ValueError, match="whole blocks"):
        fused(grad[:, :-1].contiguous(), quantize(gate[:, :-1], fmt), quantize(up[:, :-1], fmt))  # rows stored padded


@pytest.mark.parametrize(
    "spec,dtype,shape", [("int4/128", torch.bfloat16, (3, 37, 200)), ("fp4/64", torch.float32, (64, 688))], ids=["int4_bf16_padded", "fp4_fp32"]
)
def test_the_fused_swiglu_forward_quantizes_as_quantize_does_and_rounds_the_product_once(spec: str, dtype: torch.dtype, shape) -> None:
    """swiglu_quantize: gate's and up's codes and scales are the reference's bits; SiLU(gate) * up
    is the fp32 product rounded once to the dtype (eagerly SiLU is rounded first), so it is within
    one rounding of the eager forward's, and NaN in a block stays there."""
    import torch.nn.functional as F

    fmt = parse_format(spec)
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    up = torch.randn(*shape, generator=gen).to(dtype)
    gate.view(-1)[700] = float("nan")  # poisons its block of gate's codes and the product there only
    want_gate, want_up = (_reference(quantize, t, fmt, nonfinite="propagate") for t in (gate, up))
    act, q_gate, q_up = C.swiglu_quantize(gate, up, fmt)
    _assert_same(q_gate, want_gate, "gate")
    _assert_same(q_up, want_up, "up")
    eager = torch.mul(F.silu(gate), up)
    assert act.shape == gate.shape and act.dtype == dtype
    assert torch.equal(act.isnan(), eager.isnan()) and int(act.isnan().sum()) == 1
    g, u = gate.float(), up.float()
    once = (F.silu(g) * u).to(dtype)
    # bf16: one rounding of the dtype; fp32: a few ulps, inductor's exp being another approximation than torch's.
    tolerance = {torch.float32: 8 * 2.0**-23, torch.bfloat16: 2.0**-7}[dtype]
    finite = ~eager.isnan()
    for other in (once, eager):  # the single rounding, and the eager forward's double one
        diff = (act.float() - other.float()).abs()[finite]
        assert bool((diff <= tolerance * other.float().abs()[finite] + 1e-30).all())
    if dtype == torch.bfloat16:
        assert not torch.equal(act[finite], eager[finite])  # the two roundings do differ somewhere: the test can tell


def test_fp4_codes_at_every_boundary_and_beside_it_are_the_references() -> None:
    """At each fp4 decision boundary and one fp32 step either side, on both signs, and at +-0, the
    codes and scales are the reference's bit for bit. Blocks of absmax 6 (fp4's largest value)
    times a power of two have scale exactly that power, so the scaled values are the ones listed."""
    from agoq.quant.formats import codebook_tables

    fmt = parse_format("fp4/128")
    b = codebook_tables("fp4").boundaries
    points = torch.cat([b, torch.nextafter(b, torch.tensor(math.inf)), torch.nextafter(b, torch.tensor(-math.inf)), torch.tensor([0.0, 6.0])])
    block = torch.zeros(fmt.block_size)
    block[: 2 * points.numel()] = torch.cat([points, -points])
    block[-1] = -0.0
    x = torch.cat([block * 2.0**k for k in (0, -3, 5)]).to(torch.bfloat16)
    _assert_same(C.quantize(x, fmt), _reference(quantize, x, fmt), "fp4 boundaries")


def test_each_format_compiles_on_a_code_object_and_name_of_its_own() -> None:
    # Dynamo would make a graph's block size and bit width symbolic once one code object (or one
    # file, line and name) had met two formats, and inductor's loops for symbolic sizes index every
    # value through a division by the block size: every format after the first would get them.
    a, b = parse_format("int4/128"), parse_format("int8/256")
    ga, gb = C._graph(C._quantize_graph, a), C._graph(C._quantize_graph, b)
    assert ga is C._graph(C._quantize_graph, a)  # one copy per format, reused
    assert ga.fn.__code__ is not gb.fn.__code__ and ga.fn.__code__ is not C._quantize_graph.__code__
    assert len({ga.fn.__name__, gb.fn.__name__, C._quantize_graph.__name__}) == 3
    assert ga.name == gb.name == "_quantize_graph"
    x = _data(4 * 128 * 3 + 77, torch.bfloat16)
    for fmt in (a, b):
        _assert_same(C.quantize(x, fmt), _reference(quantize, x, fmt), fmt.name)


def test_a_dispatch_mode_sends_work_to_the_reference_path() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with backend.use_backend("compiled"):
        assert backend.resolve("cpu") == "compiled"
        with Count():
            assert backend.resolve("cpu") == "torch"


def _scaled_sum(values: torch.Tensor, other: torch.Tensor, *, factor: float) -> torch.Tensor:
    return values * factor + other


def test_a_formula_whose_build_fails_runs_eagerly_with_one_warning_and_the_same_results(monkeypatch) -> None:
    kernel = C._Graph(_scaled_sum)
    calls = []

    def failing(*args, **kwargs):
        calls.append(len(args))
        raise RuntimeError("error: unrecognized command-line option '-mavx512f'")

    monkeypatch.setattr(kernel, "compiled", failing)
    x, y = torch.randn(64), torch.randn(64)
    with pytest.warns(RuntimeWarning, match="could not build _scaled_sum.*eager torch path"):
        assert torch.equal(kernel(x, y, factor=3.0), x * 3.0 + y)
    assert torch.equal(kernel(x, y, factor=2.0), x * 2.0 + y)  # no second attempt, no second warning
    assert calls == [2]
    # An error of the formula itself is raised, from its eager code.
    broken = C._Graph(_scaled_sum)
    monkeypatch.setattr(broken, "compiled", failing)
    with pytest.raises(RuntimeError, match="size of tensor a"):
        broken(torch.randn(3), torch.randn(4), factor=1.0)
