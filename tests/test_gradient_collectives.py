"""8-bit collectives on real gloo groups of 2, 3 and 4 ranks, against fp32 references.

Each group is spawned once (module fixture) and runs every check; the workers return measured
values and the tests assert on them. Every rank regenerates every rank's input from seeds, so the
references are computed locally, in fp32, without trusting any collective.
"""

from __future__ import annotations

import hashlib
import math
import zlib

import pytest
import torch
import torch.distributed as dist

from agoq.gradient import CommCounter, all_reduce_8bit, reduce_scatter_8bit
from agoq.gradient.collectives import all_reduce_fp, chunk_layout, padded_rows
from agoq.gradient import transport
from agoq.gradient.transport import POLL_MAX_ROW_BYTES, polls_for, wait_for
from agoq.quant import dequantize, quantization_error_bound, quantize
from benchmarks._ring8 import ring_all_reduce_8bit
from tests._dist import run_distributed

FMT = "int8/256"
ODD_SIZES = (1, 255, 257, 4099, 30001)
RING_N = 8192


def _input(case: str, rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}/{n}".encode()))
    if case == "span":
        # Magnitudes from 1e-8 to 1e3 in one tensor: blocks of 256 at decades shared by all ranks,
        # then one block mixing all decades.
        shared = torch.Generator().manual_seed(n)
        decades = torch.randint(-8, 4, (n // 256 + 1,), generator=shared).repeat_interleave(256)[:n].float()
        x = torch.randn(n, generator=g) * torch.pow(10.0, decades)
        x[:256] = torch.randn(256, generator=g) * torch.pow(10.0, torch.linspace(-8, 3, 256))
        return x.to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _in_layout(t: torch.Tensor, layout) -> torch.Tensor:
    """A [W, padded_chunk] tensor back to the flat values it holds."""
    return t.reshape(layout.world_size, layout.padded_chunk)[:, : layout.chunk].reshape(-1)[: layout.numel]


def _reference(case: str, world: int, n: int, dtype: torch.dtype, op: str) -> dict[str, torch.Tensor]:
    """fp32 references in the collective's own layout: exact sum, sum of dequantized inputs, bounds."""
    layout = chunk_layout(n, world, FMT)
    exact = torch.zeros(n, dtype=torch.float64)
    deq_sum = None
    in_bound = torch.zeros(n)
    for r in range(world):
        x = _input(case, r, n, dtype)
        exact += x.double()
        q = quantize(padded_rows(x, layout), FMT)
        d = dequantize(q, torch.float32)
        deq_sum = d if deq_sum is None else deq_sum + d
        in_bound += _in_layout(quantization_error_bound(q), layout)
    if op == "avg":
        deq_sum = deq_sum / world
        exact /= world
        in_bound /= world
    q_out = quantize(deq_sum, FMT)
    return {
        "exact": exact,
        "deq_sum": _in_layout(deq_sum, layout),
        "expected": _in_layout(dequantize(q_out, torch.float32), layout).to(dtype),
        "in_bound": in_bound,
        "out_bound": _in_layout(quantization_error_bound(q_out), layout),
    }


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _checks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    out: dict = {"allreduce": [], "reduce_scatter": [], "digests": []}
    counter = CommCounter()
    cases = [("randn", n, torch.float32, "sum") for n in ODD_SIZES]
    cases += [("randn", 4099, torch.bfloat16, "sum"), ("randn", 30001, torch.float32, "avg"), ("span", 39936, torch.float32, "sum")]
    for case, n, dtype, op in cases:
        x = _input(case, rank, n, dtype)
        ref = _reference(case, world, n, dtype, op)
        y = x.clone()
        all_reduce_8bit(y, op, fmt=FMT, counter=counter)
        yf = y.double()
        err_exact = (yf - ref["exact"]).abs()
        bound = ref["in_bound"].double() + ref["out_bound"].double()
        if dtype == torch.bfloat16:
            # Writing the result back into a bf16 tensor adds its rounding: half an ulp, 2^-8 |y|.
            bound = bound + yf.abs() * 2.0**-8
        entry = {
            "case": case,
            "n": n,
            "dtype": str(dtype),
            "op": op,
            "equals_recomputation": bool(torch.equal(y, ref["expected"])),
            "max_err_over_bound": float((err_exact / (bound * (1 + 1e-5) + 1e-30)).max()),
            "max_err_vs_dequantized_over_half_step": float(
                ((yf - ref["deq_sum"].double()).abs() / (ref["out_bound"].double() * (1 + 1e-5) + 1e-30)).max()
            )
            if dtype == torch.float32
            else 0.0,
        }
        if case == "span":
            # Per homogeneous block (after the mixed first block): error relative to the block's
            # largest exact value, i.e. 1e-8 blocks are as precise as 1e3 blocks. The collective's
            # blocks are the layout's, so n / W must be a multiple of 256 (39936 = 13 * 12 * 256).
            e = err_exact[256:].view(-1, 256).amax(1)
            m = ref["exact"][256:].abs().view(-1, 256).amax(1)
            entry["max_block_rel_err"] = float((e / m).max())
            entry["smallest_block_max"] = float(m.min())
        out["allreduce"].append(entry)
        out["digests"].append(_digest(y))

        shard = reduce_scatter_8bit(x, op, fmt=FMT, counter=counter)
        start, end = chunk_layout(n, world, FMT).shard_range(rank)
        out["reduce_scatter"].append({"n": n, "len_ok": shard.numel() == end - start, "equal": bool(torch.equal(shard, ref["deq_sum"][start:end]))})

    # Wire bytes of one 2^20-value all-reduce, 8-bit vs fp32 and bf16.
    n = 1 << 20
    c8, cf = CommCounter(), CommCounter()
    x = _input("randn", rank, n)
    all_reduce_8bit(x.clone(), fmt=FMT, counter=c8)
    all_reduce_fp(x.clone(), counter=cf)
    all_reduce_fp(x.clone(), wire_dtype=torch.bfloat16, counter=cf)
    out["bytes"] = {"8bit": c8.as_dict(), "fp": cf.as_dict()}

    # fp baselines: fp32 equals the exact sum to fp32 rounding, bf16 to bf16 rounding.
    x = _input("randn", rank, 30001)
    exact = sum(_input("randn", r, 30001).double() for r in range(world))
    f32, b16 = x.clone(), x.clone()
    all_reduce_fp(f32, counter=cf)
    all_reduce_fp(b16, wire_dtype=torch.bfloat16, counter=cf)
    out["fp32_rel"] = float((f32.double() - exact).abs().max() / exact.abs().max())
    out["bf16_rel"] = float((b16.double() - exact).abs().max() / exact.abs().max())

    # Ring (FP8-LM style) against ours on the same N(0, 1) gradients, relative L2 error.
    x = _input("ring", rank, RING_N)
    exact = sum(_input("ring", r, RING_N).double() for r in range(world))
    ours, ring, ring_fp8 = x.clone(), x.clone(), x.clone()
    all_reduce_8bit(ours, fmt=FMT, counter=counter)
    ring_all_reduce_8bit(ring, counter=counter)
    ring_all_reduce_8bit(ring_fp8, kind="fp8", counter=counter)
    rel = lambda t: float((t.double() - exact).norm() / exact.norm())  # noqa: E731
    out["ring"] = {"ours": rel(ours), "ring_int8": rel(ring), "ring_fp8": rel(ring_fp8)}
    out["digests"] += [_digest(ring), _digest(ring_fp8)]

    # Two async all-reduces in flight, waited in order, equal the synchronous results bit for bit.
    a, b = _input("randn", rank, 5000), _input("randn", rank + 7, 777)
    sa, sb = a.clone(), b.clone()
    all_reduce_8bit(sa, counter=counter)
    all_reduce_8bit(sb, counter=counter)
    ha = all_reduce_8bit(a, async_op=True, counter=counter)
    hb = all_reduce_8bit(b, async_op=True, counter=counter)
    ha.wait()
    hb.wait()
    out["async_equal"] = bool(torch.equal(a, sa) and torch.equal(b, sb))

    # A NaN on the last rank: its block is NaN on every rank, every other block stays finite.
    x = _input("randn", rank, 3000)
    if rank == world - 1:
        x[1000] = float("nan")
    all_reduce_8bit(x, counter=counter)
    layout = chunk_layout(3000, world, FMT)
    nan_mask = torch.isnan(x)
    out["nan"] = {"count": int(nan_mask.sum()), "has_1000": bool(nan_mask[1000]), "digest": _digest(x)}
    out["nan"]["within_one_block"] = bool(nan_mask.nonzero().max() - nan_mask.nonzero().min() < layout.fmt.block_size)
    largest_polled = POLL_MAX_ROW_BYTES // 260 * 256  # values per rank whose 8-bit row (codes + scales) still fits
    out["polls"] = [polls_for(chunk_layout(world * c, world, FMT).row_bytes) for c in (3000, largest_polled, largest_polled + 256)]
    return out


@pytest.fixture(scope="module")
def groups() -> dict[int, list[dict]]:
    """Every check's measurements, per world size, per rank."""
    return {w: run_distributed(_checks, w) for w in (2, 3, 4)}


def test_all_reduce_8bit_within_w_plus_one_half_steps_of_fp32_sum(groups):
    for world, results in groups.items():
        for entry in results[0]["allreduce"]:
            assert entry["max_err_over_bound"] <= 1.0, entry


def test_all_reduce_8bit_is_one_requantization_of_the_fp32_sum_of_dequantized_inputs(groups):
    for world, results in groups.items():
        for entry in results[0]["allreduce"]:
            # Bit-equal to recomputing locally: dequantize each rank's chunks, sum in fp32, requantize.
            assert entry["equals_recomputation"], entry
            assert entry["max_err_vs_dequantized_over_half_step"] <= 1.0, entry


def test_every_rank_holds_bit_identical_results(groups):
    for world, results in groups.items():
        assert all(r["digests"] == results[0]["digests"] for r in results)
        assert all(r["nan"]["digest"] == results[0]["nan"]["digest"] for r in results)


def test_values_from_1e_minus_8_to_1e3_keep_their_relative_precision(groups):
    for world, results in groups.items():
        span = next(e for e in results[0]["allreduce"] if e["case"] == "span")
        assert span["smallest_block_max"] < 1e-7
        # (W + 1) half-steps of ~max/127 each; the inputs' maxima may exceed the sum's, hence the
        # 2x. A shared-scale format would flush the 1e-8 blocks to zero (relative error 1).
        assert span["max_block_rel_err"] <= (world + 1) / 254 * 2, span


def test_reduce_scatter_shards_equal_slices_of_the_fp32_reduce(groups):
    for world, results in groups.items():
        for r in results:
            for entry in r["reduce_scatter"]:
                assert entry["len_ok"] and entry["equal"], entry


def test_wire_bytes_are_a_quarter_of_fp32(groups):
    for world, results in groups.items():
        n = 1 << 20
        c = math.ceil(n / world)
        c_pad = math.ceil(c / 256) * 256
        expected_8bit_payload = 2 * (world - 1) * c_pad
        expected_8bit_scales = 2 * (world - 1) * (c_pad // 256) * 4
        b = results[0]["bytes"]
        assert b["8bit"]["all_reduce_8bit"]["payload"] == expected_8bit_payload
        assert b["8bit"]["all_reduce_8bit"]["scales"] == expected_8bit_scales
        assert b["fp"]["all_reduce_fp32"]["total"] == 2 * (world - 1) * 4 * n // world
        assert b["fp"]["all_reduce_bf16"]["total"] == 2 * (world - 1) * 2 * n // world
        ratio = b["8bit"]["all_reduce_8bit"]["total"] / b["fp"]["all_reduce_fp32"]["total"]
        assert ratio <= 0.27, ratio


def test_fp_baselines_match_the_exact_sum(groups):
    for world, results in groups.items():
        assert results[0]["fp32_rel"] < 1e-6
        assert 1e-6 < results[0]["bf16_rel"] < world * 2.0**-8


def test_async_all_reduces_equal_the_synchronous_path(groups):
    for world, results in groups.items():
        assert all(r["async_equal"] for r in results)


def test_nonfinite_input_poisons_only_its_block_on_every_rank(groups):
    for world, results in groups.items():
        for r in results:
            assert r["nan"]["has_1000"] and r["nan"]["within_one_block"], r["nan"]
            assert 0 < r["nan"]["count"] <= 256


def test_ring_sum_error_grows_with_world_size_while_ours_does_not(groups):
    ring = {w: groups[w][0]["ring"] for w in groups}
    # Measured relative L2 errors on N(0, 1) gradients (see the README table).
    assert ring[4]["ring_int8"] > 1.6 * ring[2]["ring_int8"], ring
    assert ring[3]["ring_int8"] > ring[2]["ring_int8"], ring
    assert ring[4]["ours"] < 1.25 * ring[2]["ours"], ring
    for w in ring:
        assert ring[w]["ours"] < ring[w]["ring_int8"] and ring[w]["ours"] < ring[w]["ring_fp8"], ring


def test_layout_pads_to_whole_blocks_per_rank():
    layout = chunk_layout(1000, 3, "int8/256")
    assert (layout.chunk, layout.padded_chunk, layout.row_bytes) == (334, 512, 512 + 8)
    assert [layout.shard_range(r) for r in range(3)] == [(0, 334), (334, 668), (668, 1000)]
    assert chunk_layout(1, 4, "int8").shard_range(3) == (1, 1)
    assert chunk_layout(10, 2, "int8").fmt.block_size == 256


@pytest.mark.parametrize("backend_name", ["torch", "compiled"])
@pytest.mark.parametrize("fmt", ["int8/256", "int4/64"])
@pytest.mark.parametrize("piece", [512, 4096], ids=["pieces_of_rows", "rows_per_piece"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_into_wire_rows_gives_the_bytes_of_quantizing_then_laying_out(monkeypatch, backend_name, fmt, piece, dtype):
    """quantize_to_wire (pieces of whole blocks straight into the rows) is to_wire(quantize_rows(...))
    bit for bit: padded chunks, a rank with no values, several pieces per row or several unpadded
    rows per piece, NaN and Inf blocks; it leaves x as it was."""
    from agoq.gradient import collectives
    from agoq.quant import backend

    monkeypatch.setitem(collectives.QUANTIZE_PIECE, "cpu", piece)
    with backend.use_backend(backend_name):
        for n, world in ((1, 4), (1000, 3), (4099, 2), (8192, 4), (6144, 3), (30001, 3)):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10).to(dtype)
            if n > 2000:
                x[1500], x[1800] = float("nan"), float("inf")
            layout = chunk_layout(n, world, fmt)
            expected = collectives.to_wire(collectives.quantize_rows(x, layout), world)
            given = x.clone()
            got = collectives.quantize_to_wire(given, layout)
            assert torch.equal(given.view(torch.uint8), x.view(torch.uint8)), (n, world)  # x is only read
            assert got.shape == expected.shape == (world, layout.row_bytes)
            pb = layout.row_payload_bytes
            scales_got, scales_expected = got[:, pb:].contiguous().view(torch.float32), expected[:, pb:].contiguous().view(torch.float32)
            assert torch.equal(scales_got.isnan(), scales_expected.isnan()), (n, world)
            finite = ~scales_expected.isnan()
            assert torch.equal(scales_got[finite], scales_expected[finite]), (n, world)
            # A NaN block's codes are unspecified (its values decode to NaN); every other byte is equal.
            block_bytes = layout.fmt.payload_bytes(layout.fmt.block_size)
            keep = finite.repeat_interleave(block_bytes, dim=1)
            assert torch.equal(got[:, :pb][keep], expected[:, :pb][keep]), (n, world)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_consumed_tensor_receives_the_rows_in_its_own_bytes_where_they_fit(dtype):
    """receiving_rows: x's first W * row_bytes bytes as [W, row_bytes] rows where they fit in a
    contiguous x; None for a non-contiguous x or one whose bytes are fewer than the rows'."""
    from agoq.gradient.collectives import receiving_rows

    for n, world, fmt in ((1, 4, "int8/256"), (1000, 3, "int8/256"), (8192, 4, "int8/256"), (30001, 3, "int4/64"), (64, 2, "int8/256")):
        x = torch.zeros(n, dtype=dtype)
        layout = chunk_layout(n, world, fmt)
        need = world * layout.row_bytes
        rows = receiving_rows(x, layout)
        if need > n * x.element_size():
            assert rows is None, (n, world, fmt)
            continue
        assert rows is not None and rows.shape == (world, layout.row_bytes) and rows.dtype == torch.uint8, (n, world, fmt)
        assert rows.data_ptr() == x.data_ptr() and rows.is_contiguous()
        rows.fill_(0xFF)  # the rows are x's bytes: exactly the first `need` of them
        assert int((x.view(torch.uint8) == 0xFF).sum()) == need
    # (1 value on 4 ranks: 4 padded rows of 260 bytes cannot fit in 4 bytes; 64 on 2: 2 x 260 > 256.)
    assert receiving_rows(torch.zeros(1), chunk_layout(1, 4, "int8/256")) is None
    assert receiving_rows(torch.zeros(4096, 2)[:, 0], chunk_layout(4096, 2, "int8/256")) is None


def test_gloo_waits_poll_only_for_rows_up_to_the_limit(groups):
    for world, results in groups.items():
        assert results[0]["polls"] == [True, True, False], world


class _Work:
    """A collective's handle that completes at its ``polls + 1``-th poll."""

    def __init__(self, polls: int) -> None:
        self.polls, self.checked, self.waited = polls, 0, 0

    def is_completed(self) -> bool:
        self.checked += 1
        return self.checked > self.polls

    def wait(self) -> bool:
        self.waited += 1
        return True


def test_a_polled_wait_polls_until_the_work_completes_then_waits_once(monkeypatch):
    # A window no busy machine exhausts in 4 polls (the default 5 ms can pass between two polls).
    monkeypatch.setattr(transport, "POLL_SECONDS", 60.0)
    work = _Work(3)
    wait_for(work, True)
    assert (work.checked, work.waited) == (4, 1)
    work = _Work(3)
    wait_for(work, False)
    assert (work.checked, work.waited) == (0, 1)
    # A peer that is late: polling stops after POLL_SECONDS and the wait sleeps instead.
    monkeypatch.setattr(transport, "POLL_SECONDS", 0.02)
    late = _Work(10**12)
    wait_for(late, True)
    assert late.waited == 1 and late.checked < 10**12


def test_single_process_all_reduce_is_a_requantization():
    x = torch.randn(1000)
    y = x.clone()
    all_reduce_8bit(y)
    assert torch.equal(y, dequantize(quantize(dequantize(quantize(x, FMT)), FMT)))


def test_bad_arguments_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="'max'.*'sum' or 'avg'"):
        all_reduce_8bit(torch.ones(4), "max")
    with pytest.raises(TypeError, match="floating-point.*torch.int64"):
        all_reduce_8bit(torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="int4/3.*multiple of 8"):
        all_reduce_8bit(torch.ones(4), fmt="int4/3")
    with pytest.raises(ValueError, match="ring kind"):
        ring_all_reduce_8bit(torch.ones(4), kind="int4")
    assert not dist.is_initialized()
