"""The compiled CPU path (agoq.quant.compiled) equals the torch reference: codes, scales, sums, losses."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from agoq.quant import QTensor, backend, dequantize, parse_format, quantize
from agoq.quant import compiled as C

pytestmark = pytest.mark.skipif(not backend.compiler_available(), reason="no C++ compiler for torch.compile")

BF16_FORMATS = ("int4/128", "nf4/128", "fp4/128")
FORMATS = ["int2/128", "int3/128", "int4/128", "int5/128", "int6/128", "int8/256", "fp4/128", "nf4/128", "fp8/128", "int4/64"]


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
    x[: min(n, 128)] = 0.0  # an all-zero block: scale 0, exact zeros
    return x.to(dtype)


@pytest.fixture(params=[False, True], ids=["byte_codes", "float_codes"])
def codes_as_floats(request, monkeypatch) -> bool:
    """Both ways the kernels can get codes: bytes, and fp32 as on CPUs held to AVX2 (C.codes_as_floats)."""
    monkeypatch.setattr(C, "codes_as_floats", lambda device_type="cpu": request.param)
    return request.param


def _reference(fn, *args, **kwargs):
    with backend.use_backend("torch"):
        return fn(*args, **kwargs)


@pytest.mark.parametrize("spec", FORMATS)
def test_codes_scales_and_values_are_bit_identical_to_the_reference(spec: str) -> None:
    fmt = parse_format(spec)
    # bf16 input for the activation formats; each (format, dtype) is a compile of its own, and a
    # cold CI run pays for every one.
    for dtype in (torch.float32, torch.bfloat16) if spec in BF16_FORMATS else (torch.float32,):
        # One partial block, a partial last block and byte, whole blocks. (Sizes 0 and 1 would each
        # compile a specialized variant: minutes of a cold CI run for no new arithmetic.)
        for n in (7, 4 * 128 * 3 + 77, 65536):
            x = _data(n, dtype)
            ref = _reference(quantize, x, fmt)
            got = C.quantize(x, fmt)
            assert torch.equal(got.payload, ref.payload), (spec, dtype, n)
            assert torch.equal(got.scales, ref.scales), (spec, dtype, n)
            assert torch.equal(C.dequantize(ref), _reference(dequantize, ref)), (spec, dtype, n)


@pytest.mark.parametrize("spec", ["int3/128", "int4/128", "int8/256", "nf4/128", "fp8/128"])
def test_dequantizing_from_float_codes_equals_the_reference(spec: str, monkeypatch) -> None:
    # codes_as_floats (CPUs held to AVX2): the codes reach the kernel as fp32, slab by slab.
    monkeypatch.setattr(C, "codes_as_floats", lambda device_type="cpu": True)
    monkeypatch.setattr(C, "SLAB_VALUES", 4096)  # small slabs, so that a small tensor has three
    fmt = parse_format(spec)
    x = _data((2 * C.SLAB_VALUES // fmt.block_size + 3) * fmt.block_size, torch.float32, seed=3)
    q = _reference(quantize, x, fmt)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(C.dequantize(q, dtype), _reference(dequantize, q, dtype)), (spec, dtype)


@pytest.mark.parametrize("spec", ["int2/128", "int4/128", "fp4/128", "nf4/128", "fp4/64"])
def test_every_byte_value_decodes_as_the_reference_decodes_it(spec: str) -> None:
    # fp4 and nf4 are dequantized by one table load per byte, int codes by arithmetic: every one of
    # the 256 byte values, in every position of a block, under scales from 2**-20 to 2**20 and 0.
    fmt = parse_format(spec)
    blocks = 256 * 8 // fmt.block_size // fmt.bits * 2
    payload = torch.arange(256, dtype=torch.uint8).repeat(blocks * fmt.payload_bytes(fmt.block_size) // 256)
    scales = torch.logspace(-20, 20, blocks, base=2.0)
    scales[0] = 0.0
    q = QTensor(payload, scales, torch.Size([blocks * fmt.block_size]), torch.bfloat16, fmt)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(C.dequantize(q, dtype), _reference(dequantize, q, dtype)), (spec, dtype)


@pytest.mark.parametrize("spec", ["int4/128", "fp4/128", "nf4/128"])
def test_packed_codes_slab_by_slab_equal_the_reference(spec: str) -> None:
    fmt = parse_format(spec)
    n = 2 * C.SLAB_VALUES + 3 * 128 + 77  # two whole slabs, a partial one, a partial block
    x = _data(n, torch.bfloat16)
    ref, got = _reference(quantize, x, fmt), C.quantize(x, fmt)
    assert torch.equal(got.payload, ref.payload) and torch.equal(got.scales, ref.scales)
    assert torch.equal(C.dequantize(ref), _reference(dequantize, ref))
    # fp4/nf4 write a narrower dtype through an fp32 scratch a slab at a time: the same single rounding.
    for dtype in (torch.float16, torch.float32):
        assert torch.equal(C.dequantize(ref, dtype), _reference(dequantize, ref, dtype)), dtype


def test_dequantize_rounds_once_into_another_dtype() -> None:
    fmt = parse_format("int4/128")
    ref = _reference(quantize, _data(4 * 128 + 77, torch.bfloat16), fmt)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(C.dequantize(ref, out), _reference(dequantize, ref, out)), out


def test_the_backend_switch_routes_quantize_and_dequantize() -> None:
    fmt = parse_format("int4/128")
    x = _data(4096, torch.float32)
    with backend.use_backend("compiled"):
        assert backend.kernels("cpu", fmt) is C
        q = quantize(x, fmt)
        y = dequantize(q)
    ref = _reference(quantize, x, fmt)
    assert torch.equal(q.payload, ref.payload) and torch.equal(y, _reference(dequantize, ref))


def test_non_finite_input_takes_the_reference_path_for_both_modes() -> None:
    fmt = parse_format("int4/128")
    x = _data(1024, torch.float32)
    x[300], x[900] = float("nan"), float("inf")
    with backend.use_backend("compiled"):
        q = quantize(x, fmt, nonfinite="propagate")
        with pytest.raises(ValueError, match="flat index 300"):
            quantize(x, fmt)
    ref = _reference(quantize, x, fmt, nonfinite="propagate")
    assert torch.equal(q.payload, ref.payload)
    assert torch.equal(torch.isnan(q.scales), torch.isnan(ref.scales))
    assert torch.equal(q.scales[~torch.isnan(q.scales)], ref.scales[~torch.isnan(ref.scales)])
    assert torch.isnan(q.scales).tolist() == [False, False, True, False, False, False, False, True]


@pytest.mark.parametrize("spec", ["int8/256", "int4/128", "fp8/128"])
def test_the_gradient_fold_equals_dequantize_add_requantize(spec: str, codes_as_floats: bool) -> None:
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


@pytest.mark.parametrize("average", [False, True])
def test_the_all_reduce_local_sum_is_the_reference_sum_in_rank_order(average: bool, codes_as_floats: bool) -> None:
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
    assert torch.equal(q.payload, want_q.payload) and torch.equal(q.scales, want_q.scales)
    # Rows read where they lie in a wider buffer (as a wire buffer's payloads), without the sum.
    wide = torch.zeros(3, pay.shape[1] + 64, dtype=torch.uint8)
    wide[:, : pay.shape[1]] = pay
    no_sum, strided = C.reduce_rows(wide[:, : pay.shape[1]], sc, fmt, average=average, keep_sum=False, requantize=True)
    assert no_sum is None
    assert torch.equal(strided.payload, want_q.payload) and torch.equal(strided.scales, want_q.scales)


def test_a_non_finite_block_in_the_rows_requantizes_as_the_reference_does() -> None:
    """A block whose sum is not finite: its scale is NaN, the other blocks' bytes the reference's,
    whether or not the caller kept the sum (the sum is then computed again for the reference)."""
    fmt = parse_format("int8/256")
    inputs = [_data(1024, torch.float32, seed=r) for r in range(2)]
    inputs[1][300] = float("inf")
    rows = [quantize(x, fmt, nonfinite="propagate") for x in inputs]
    pay, sc = torch.stack([q.payload for q in rows]), torch.stack([q.scales for q in rows])
    with backend.use_backend("torch"):
        want = quantize(dequantize(rows[0]) + dequantize(rows[1]), fmt, nonfinite="propagate")
    for keep_sum in (True, False):
        acc, q = C.reduce_rows(pay, sc, fmt, average=False, keep_sum=keep_sum, requantize=True)
        assert (acc is not None) == keep_sum
        assert torch.equal(q.scales.isnan(), want.scales.isnan()) and int(q.scales.isnan().sum()) == 1
        assert torch.equal(q.scales.nan_to_num(-1.0), want.scales.nan_to_num(-1.0)) and torch.equal(q.payload, want.payload)


@pytest.mark.parametrize("spec", ["int8/256", "fp8/128", "int4/64"])
def test_dequantizing_rows_in_place_equals_dequantizing_each_row(spec: str, codes_as_floats: bool) -> None:
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


def test_a_dispatch_mode_sends_work_to_the_reference_path() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with backend.use_backend("compiled"):
        assert backend.resolve("cpu") == "compiled"
        with Count():
            assert backend.resolve("cpu") == "torch"


def test_a_fold_that_overflows_marks_its_block_with_a_nan_scale() -> None:
    fmt = parse_format("int8/256")
    pay = torch.zeros(fmt.payload_bytes(512), dtype=torch.uint8)
    sc = torch.zeros(2)
    g = torch.ones(512)
    g[300] = float("inf")
    C.accumulate_(pay, sc, g, fmt, first=True)
    assert sc[0].item() == pytest.approx(1 / 127, rel=1e-6)  # the finite block keeps its scale
    assert torch.isnan(sc[1])


def test_a_torch_held_to_avx2_compiles_into_a_cache_folder_of_its_own() -> None:
    # Inductor's cache does not key on ATEN_CPU_CAPABILITY: AVX512 kernels handed to such a
    # process crashed it. agoq.quant points the cache at a subfolder before inductor fixes it.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = "import os, agoq.quant, torch.distributed.pipelining; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    held = subprocess.run([sys.executable, "-c", code], env={**env, "ATEN_CPU_CAPABILITY": "avx2"}, capture_output=True, text=True, check=True)
    assert held.stdout.strip().endswith(os.sep + "aten-cpu-capability-avx2")
    chosen = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert chosen.stdout.strip() == "/tmp/x"  # the user's choice stands


def test_a_compiled_formula_runs_its_variants_without_dynamo_and_compiles_one_more_for_new_arguments() -> None:
    fmt = parse_format("int4/64")
    kernel = C.compiled(C._quantize_blocks, max_value=fmt.max_value, **C._constants(fmt))
    x = torch.randn(64 * 40)
    codes, scales = kernel(x)
    assert kernel._variants, "torch.compile's variant was not picked up"
    compiles = []
    dynamo = kernel._dynamo

    def counted(*tensors):
        compiles.append([t.dtype for t in tensors])
        return dynamo(*tensors)

    kernel._dynamo = counted
    try:
        y = torch.randn(64 * 24)  # another size, same dtype: the variant's guard accepts it (dynamic shapes)
        got = kernel(y)
        assert compiles == []
        ref = C._quantize_blocks(y, max_value=fmt.max_value, **C._constants(fmt))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        z = torch.randn(64 * 24, dtype=torch.float64)  # another dtype: no guard accepts it
        got = kernel(z)
        assert compiles == [[torch.float64]]
        ref = C._quantize_blocks(z, max_value=fmt.max_value, **C._constants(fmt))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        kernel(z)
        assert len(compiles) == 1  # the new variant now serves it directly
    finally:
        kernel._dynamo = dynamo


def test_a_formula_whose_build_fails_runs_eagerly_with_one_warning_and_the_same_results() -> None:
    from torch._inductor.exc import CppCompileError

    fmt = parse_format("int8/64")
    calls = []

    def agoq_quantize_blocks(*tensors):
        return C._quantize_blocks(*tensors, max_value=fmt.max_value, **C._constants(fmt))

    def failing(*tensors):
        calls.append(len(tensors))
        raise CppCompileError(["g++", "kernel.cpp"], "error: unrecognized command-line option '-mavx512f'")

    kernel = C._Variants(failing, agoq_quantize_blocks, any_size=False)
    x = torch.randn(64 * 10)
    ref = C._quantize_blocks(x, max_value=fmt.max_value, **C._constants(fmt))
    with pytest.warns(RuntimeWarning, match="could not build agoq_quantize_blocks.*eager torch path"):
        codes, scales = kernel(x)
    assert torch.equal(codes, ref[0]) and torch.equal(scales, ref[1])
    codes, scales = kernel(x)  # no second attempt, no second warning
    assert calls == [1] and torch.equal(codes, ref[0]) and torch.equal(scales, ref[1])


def test_other_errors_of_a_compiled_formula_are_raised() -> None:
    def failing(*tensors):
        raise ValueError("a bug in the formula")

    kernel = C._Variants(failing, C._quantize_blocks, any_size=False)
    with pytest.raises(ValueError, match="a bug in the formula"):
        kernel(torch.randn(64))


def test_inductor_takes_the_listed_vector_isa_without_its_build_checks_and_a_user_choice_stands() -> None:
    # Inductor builds and dlopen-probes a test library per listed ISA in every process unless told
    # the ISA is fine; agoq tells it so once the compiler accepted the chosen ISA's flags. It must
    # pick the same ISA either way (the same kernels are built). On an AVX-512 CPU inductor still
    # probes its extensions (bf16, VNNI, AMX) itself; on an AVX2-only CPU nothing is left to probe.
    import os
    import subprocess
    import sys

    code = (
        "import torch._inductor.config as c, torch._inductor.cpu_vec_isa as v\n"
        "from agoq.quant import compiled\n"
        "probes = []\n"
        "v.VecISA._probe_load = lambda self, path: probes.append(path) or True\n"
        "own = str(v.pick_vec_isa()), len(probes)\n"  # inductor's own check first
        "probes.clear()\n"
        "trusted = compiled.trust_listed_vector_isa()\n"
        "print(own[0], own[1], trusted, c.cpp.vec_isa_ok, str(v.pick_vec_isa()), len(probes), sep='|')\n"
        "compiled.trust_listed_vector_isa.cache_clear()\n"
        "c.cpp.vec_isa_ok = False\n"  # as TORCHINDUCTOR_VEC_ISA_OK=0 sets it
        "print(compiled.trust_listed_vector_isa(), c.cpp.vec_isa_ok, sep='|')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    own_isa, own_probes, trusted, ok, isa, probes = out[0].split("|")
    assert trusted == ok == "True", out
    assert isa == own_isa, out  # the same ISA, so the same kernels
    assert int(probes) < int(own_probes), out  # fewer test libraries probed
    assert out[1] == "False|False", out  # the user's setting stands


@contextmanager
def _compiles_counted(monkeypatch) -> Iterator[list[str]]:
    """The names of the formulas compiled inside the block, compiled there and not read from
    inductor's on-disk caches: a graph that an older revision cached keeps that compile's guards."""
    import torch._functorch.config as aot_config
    import torch._inductor.config as inductor_config

    compiles: list[str] = []
    call = C._Variants._call  # what __call__ runs, with grad mode off

    def counted(self, *tensors):
        if not any(guard.check({"tensors": tensors}) for guard, _ in self._variants):
            compiles.append(self._fn.__name__)
        return call(self, *tensors)

    monkeypatch.setattr(C._Variants, "_call", counted)
    with inductor_config.patch(fx_graph_cache=False), aot_config.patch(enable_autograd_cache=False):
        yield compiles


def _quantize_dequantize_fold(fmt, blocks: int) -> None:
    """Quantize, dequantize and fold ``blocks`` blocks of ``fmt`` on the compiled path, each equal to the reference."""
    x = _data(blocks * fmt.block_size, torch.float32, seed=blocks)
    q, ref = C.quantize(x, fmt), _reference(quantize, x, fmt)
    assert torch.equal(q.payload, ref.payload) and torch.equal(q.scales, ref.scales), (fmt.name, blocks)
    assert torch.equal(C.dequantize(q), _reference(dequantize, ref)), (fmt.name, blocks)
    payload, scales = q.payload.clone(), q.scales.clone()
    C.accumulate_(payload, scales, x, fmt, first=False)  # x + x: twice each value, requantized
    twice = _reference(quantize, _reference(dequantize, ref) + x, fmt)
    assert torch.equal(payload, twice.payload) and torch.equal(scales, twice.scales), (fmt.name, blocks)


def test_one_block_takes_the_graph_compiled_for_many(monkeypatch) -> None:
    """A tensor of one block (a norm weight's gradient) runs the graph that many blocks compiled, with the reference's results."""
    fmt = parse_format("int8/512")  # a block size no other test compiles in this process
    with _compiles_counted(monkeypatch) as compiles:
        _quantize_dequantize_fold(fmt, 12)
        many = list(compiles)
        _quantize_dequantize_fold(fmt, 1)
    assert many, "nothing was compiled for 12 blocks"
    assert compiles == many, f"one block compiled {compiles[len(many) :]} again"


def test_every_int_width_at_one_block_size_shares_each_graph(codes_as_floats: bool, monkeypatch) -> None:
    """int4, int6 and int8 at one block size (two pipeline stages' activations under DBCA) compile each formula once, with the reference's results."""
    with _compiles_counted(monkeypatch) as compiles:
        _quantize_dequantize_fold(parse_format("int4/384"), 5)  # a block size no other test compiles in this process
        int4 = list(compiles)
        for spec in ("int6/384", "int8/384"):
            _quantize_dequantize_fold(parse_format(spec), 5)
    assert int4, "nothing was compiled for int4"
    assert compiles == int4, f"int6 / int8 compiled {compiles[len(int4) :]} again"


@pytest.mark.parametrize("spec", ["int8/256", "int4/128", "nf4/64"])
def test_sum_of_squares_reads_whole_blocks_in_one_pass_and_equals_the_dequantized_sum(spec: str, codes_as_floats: bool) -> None:
    fmt = parse_format(spec)
    x = torch.randn(fmt.block_size * 37) * 3
    q = quantize(x, fmt)
    ref = torch.linalg.vector_norm(dequantize(q), dtype=torch.float64).square()
    got = C.sum_of_squares(q)
    assert got.dtype == torch.float64 and abs(float(got) - float(ref)) <= 1e-12 * float(ref)
    with pytest.raises(ValueError, match="whole blocks"):
        C.sum_of_squares(quantize(x[:-1], fmt))


def test_the_gradient_buffer_norm_under_compiled_code_equals_the_reference() -> None:
    from agoq.gradient.buffer import QuantGradBuffer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.Linear(70, 3))
    buf = QuantGradBuffer(model, fmt="int8/64", bucket_numel=1024)
    model(torch.randn(8, 40)).square().sum().backward()
    buf.finish()
    with backend.use_backend("torch"):
        ref = buf.grad_norm()
    with backend.use_backend("compiled"):
        got = buf.grad_norm()
    assert ref > 0 and abs(got - ref) <= 1e-12 * ref


@pytest.mark.parametrize("spec", ["int4/128", "nf4/64", "int8/32"])
def test_a_formula_reading_codes_equals_the_formula_on_dequantized_values(spec: str, codes_as_floats: bool) -> None:
    from agoq.activation.ops import _swiglu_backward

    fmt = parse_format(spec)
    torch.manual_seed(0)
    rows, width = 24, 80  # 1920 values: whole blocks of 32, 64 and 128
    gate, up, grad = torch.randn(rows, width) * 2, torch.randn(rows, width), torch.randn(rows, width)
    qg, qu = quantize(gate, fmt), quantize(up, fmt)
    constants = {"act_dtype": torch.float32, "gate_dtype": torch.float32, "up_dtype": torch.float32}
    fused = C.reading_codes(_swiglu_backward, fmt, (1, 2), **constants)
    got = fused(grad, qg, qu)
    want = _swiglu_backward(grad, dequantize(qg, torch.float32), dequantize(qu, torch.float32), **constants)
    for g, w in zip(got, want):
        assert g.shape == (rows, width)
        torch.testing.assert_close(g, w, rtol=2e-7, atol=0)  # the same fp32 operations; exp may round apart by an ulp
    with pytest.raises(ValueError, match="whole blocks"):
        fused(grad[:-1, :-1].contiguous(), quantize(gate[:-1, :-1], fmt), quantize(up[:-1, :-1], fmt))


@pytest.mark.parametrize("spec", ["int4/128", "int8/256", "nf4/128", "fp4/64", "int3/128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(64, 688), (3, 37, 200)], ids=["whole_blocks", "padded"])
def test_the_fused_swiglu_forward_quantizes_as_quantize_does_and_rounds_the_product_once(spec: str, dtype: torch.dtype, shape, monkeypatch) -> None:
    """swiglu_quantize: gate's and up's codes and scales are the reference's bits, also a slab at a
    time; SiLU(gate) * up is the fp32 product rounded once to the dtype (eagerly SiLU is rounded
    first), so it is within one rounding of the eager forward's, and NaN in a block stays there."""
    import torch.nn.functional as F

    fmt = parse_format(spec)
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    up = torch.randn(*shape, generator=gen).to(dtype)
    gate.view(-1)[700] = float("nan")  # poisons its block of gate's codes and the product there only
    want_gate, want_up = (_reference(quantize, t, fmt, nonfinite="propagate") for t in (gate, up))
    act, q_gate, q_up = C.swiglu_quantize(gate, up, fmt)
    monkeypatch.setattr(C, "SLAB_VALUES", 1024)  # several slabs, packed one by one
    sliced = C.swiglu_quantize(gate, up, fmt)
    for got in ((q_gate, q_up), sliced[1:]):
        for q, want in zip(got, (want_gate, want_up)):
            assert torch.equal(q.payload, want.payload)
            assert torch.equal(q.scales.nan_to_num(-1.0), want.scales.nan_to_num(-1.0))
    torch.testing.assert_close(sliced[0], act, rtol=0, atol=0, equal_nan=True)  # the same bits
    eager = torch.mul(F.silu(gate), up)
    assert act.shape == gate.shape and act.dtype == dtype
    assert torch.equal(act.isnan(), eager.isnan()) and int(act.isnan().sum()) == 1
    g, u = gate.float(), up.float()
    once = (g / (1 + torch.exp(-g)) * u).to(dtype)
    # bf16: one rounding of the dtype; fp32: a few ulps, inductor's exp being another approximation than torch's.
    tolerance = {torch.float32: 8 * 2.0**-23, torch.bfloat16: 2.0**-7}[dtype]
    finite = ~eager.isnan()
    for other in (once, eager):  # the single rounding, and the eager forward's double one
        diff = (act.float() - other.float()).abs()[finite]
        assert bool((diff <= tolerance * other.float().abs()[finite] + 1e-30).all())
    if dtype == torch.bfloat16:
        assert not torch.equal(act[finite], eager[finite])  # the two roundings do differ somewhere: the test can tell


def _scaled_sum(values: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return values * 2 + other


def test_grad_mode_and_a_size_equal_to_an_offset_add_no_variant() -> None:
    """One compiled variant serves calls with grad mode on and off, on dtype views of wire rows at
    any storage offset, including one equal to the view's length (duck sizing once took that
    coincidence for a rule and compiled again for the next offset)."""
    kernel = C.compiled(_scaled_sum)
    wire = torch.zeros(4, 8192, dtype=torch.uint8)
    other = torch.ones(1024)
    for row, start, grad_mode in ((0, 4096, True), (1, 4096, False), (2, 0, True), (3, 2048, False)):
        values = wire[row, start : start + 4096].view(torch.float32)  # offset 1024 floats in row 0: its length
        with torch.set_grad_enabled(grad_mode):
            assert torch.equal(kernel(values, other), other)
    assert len(C._cache_entries(kernel._fn)) == 1


def _generated_code(fn) -> str:
    """The C++ inductor generates while ``fn`` runs (its caches bypassed, so it does generate)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _, code = run_and_get_code(fn)
    return "\n".join(code)


@pytest.mark.parametrize("spec", ["int8/160", "int4/224"])
def test_every_formula_reading_codes_indexes_them_linearly(spec: str, codes_as_floats: bool) -> None:
    """Codes arrive as [blocks, block] with sizes of their own (no duck sizing); a formula that
    converted them before viewing them as blocks read each byte through a modulo of the index,
    which inductor cannot vectorize (an int8 dequantize into an existing tensor took 11x a copy's
    time so, 0.7x of it when linear). The block sizes are this test's alone (int widths share
    graphs at one block size), so each formula compiles here."""
    from agoq.activation.ops import _swiglu_backward

    fmt = parse_format(spec)
    x = _data(fmt.block_size * 48, torch.float32)
    q = quantize(x, fmt)
    rows = q.payload.view(2, -1), q.scales.view(2, -1)
    constants = {"act_dtype": torch.float32, "gate_dtype": torch.float32, "up_dtype": torch.float32}
    grad = x.view(48, fmt.block_size)
    calls = {
        "dequantize": lambda: C.dequantize(q, out=torch.empty_like(x)),
        "sum_of_squares": lambda: C.sum_of_squares(q),
        "reduce_rows": lambda: C.reduce_rows(*rows, fmt, average=False, requantize=True),
        "fold": lambda: C.fold_(q.payload.clone(), q.scales.clone(), x, fmt, first=False),
        "reading_codes": lambda: C.reading_codes(_swiglu_backward, fmt, (1, 2), **constants)(grad, q, q),
    }
    for name, call in calls.items():
        code = _generated_code(call)
        assert "extern" in code, name  # it did compile
        assert " % " not in code, (name, [line.strip() for line in code.splitlines() if " % " in line][:3])


@pytest.mark.parametrize("spec", ["fp4/96", "nf4/160"])
def test_the_byte_table_dequantize_loads_each_byte_once_straight_into_the_output(spec: str) -> None:
    """fp4/nf4 values come from a table of each byte's codes; over the flat block each value
    loaded its byte through an index division and took its code by a modulo, and a view of the
    output inside the graph made inductor store into a buffer of its own and copy it. The block
    sizes are this test's alone, so the table kernel compiles here."""
    fmt = parse_format(spec)
    x = _data(fmt.block_size * 48, torch.float32)
    q = quantize(x, fmt)
    out = torch.empty_like(x)
    code = _generated_code(lambda: C.dequantize(q, out=out))
    assert "extern" in code  # it did compile
    assert " % " not in code and "div_floor_integer(static_cast<int64_t>(x1)" not in code
    assert len(re.findall(r"float\* out_ptr\d", code)) == 1  # one store: into the output
    assert torch.equal(out, _reference(dequantize, q, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp4_codes_at_every_boundary_and_beside_it_are_the_references(dtype: torch.dtype) -> None:
    """fp4 is encoded by a search on |y| among the positive boundaries alone (the negative ones
    mirror them, each -nextup(b)). At each boundary and one fp32 step either side, on both signs,
    and at +-0 (a negative y that rounds to zero has code 0, as in the reference), the codes and
    scales are the reference's bit for bit. Blocks of absmax 6 (fp4's largest value) times a
    power of two have scale exactly that power, so the scaled values are the ones listed."""
    import math

    fmt = parse_format("fp4/128")
    mirrored = C._mirrored_half(C._book("fp4"))
    assert mirrored is not None and mirrored[1] == 8 and C._mirrored_half(C._book("nf4")) is None
    b = torch.tensor(mirrored[0], dtype=torch.float32)
    points = torch.cat([b, torch.nextafter(b, torch.tensor(math.inf)), torch.nextafter(b, torch.tensor(-math.inf)), torch.tensor([0.0, 6.0])])
    block = torch.zeros(fmt.block_size)
    block[: 2 * points.numel()] = torch.cat([points, -points])
    block[-1] = -0.0
    x = torch.cat([block * 2.0**k for k in (0, -3, 5)]).to(dtype)
    q = C.quantize(x, fmt)
    r = _reference(quantize, x, fmt)
    assert torch.equal(q.scales, r.scales) and torch.equal(q.payload, r.payload)
