"""Stage-aware bit widths (DBCA-PP): later stages gain precision, no stage exceeds the uniform-4-bit peak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agoq.activation import make_policy
from agoq.parallel import allocate_stage_bits, inflight_microbatches, layer_bits, peak_bytes


def proportional(bits: int) -> int:
    """Bytes of a micro-batch whose saved activations are all quantized (bytes proportional to bits)."""
    return bits


def test_interleaved_11_9_7_5_gets_4_4_6_8_bits():
    counts = inflight_microbatches("interleaved1f1b", 4, 8, virtual_stages=2).per_rank
    bits = allocate_stage_bits(counts, proportional)
    assert bits == [4, 4, 6, 8]
    assert peak_bytes(counts, bits, proportional) == [44, 36, 42, 40]


def test_papers_5_bits_for_9_in_flight_exceed_the_uniform_4_peak():
    # B_i = 4 * N_1 / N_i = 4.9 for N_i = 9, rounded to 5 in the paper: 9 * 5 = 45 > 11 * 4 = 44.
    assert peak_bytes([11, 9], [4, 5], proportional) == [44, 45]
    assert allocate_stage_bits([11, 9], proportional) == [4, 4]


def test_1f1b_p4_counts_4_3_2_1_get_4_5_8_16_bits():
    counts = inflight_microbatches("1f1b", 4, 8).per_rank
    assert counts == (4, 3, 2, 1)
    bits = allocate_stage_bits(counts, proportional)
    assert bits == [4, 5, 8, 16]
    assert peak_bytes(counts, bits, proportional) == [16, 15, 16, 16]


def test_a_fixed_bf16_part_leaves_more_room_for_bits():
    # Every extra bit costs N_i * k whatever the fixed part F, while a stage's slack
    # (N_1 - N_i) * (F + 4k) grows with F: so a fixed part raises bits, never lowers them.
    def with_fixed(f: int):
        return lambda b: f + 8 * b

    assert allocate_stage_bits([11, 9, 7, 5], with_fixed(0)) == [4, 4, 6, 8]
    assert allocate_stage_bits([11, 9, 7, 5], with_fixed(32)) == [4, 5, 8, 8]
    assert allocate_stage_bits([11, 9, 7, 5], with_fixed(160)) == [4, 8, 16, 16]


def test_candidates_and_inputs_are_checked():
    assert allocate_stage_bits([2, 1], proportional, candidates=(4, 8)) == [4, 8]
    with pytest.raises(ValueError, match="base_bits=4 must be one of the candidates"):
        allocate_stage_bits([2, 1], proportional, candidates=(5, 8))
    with pytest.raises(ValueError, match="positive integers"):
        allocate_stage_bits([2, 0], proportional)
    with pytest.raises(ValueError, match="positive integers"):
        allocate_stage_bits([], proportional)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 64), min_size=1, max_size=12),
    fixed=st.integers(0, 10_000),
    per_bit=st.integers(1, 1_000),
    scale_overhead=st.integers(0, 200),
)
def test_no_stage_ever_exceeds_the_uniform_4_peak_and_bits_are_maximal(counts, fixed, per_bit, scale_overhead):
    def nbytes(b: int) -> int:
        # 16 bits keeps the tensor unquantized: no block scales.
        return fixed + per_bit * b + (0 if b == 16 else scale_overhead)

    bits = allocate_stage_bits(counts, nbytes)
    budget = max(counts) * nbytes(4)
    assert max(peak_bytes(counts, bits, nbytes)) <= budget
    for n, b in zip(counts, bits):
        assert b >= 4
        higher = [c for c in (4, 5, 6, 8, 16) if c > b]
        # It is the highest candidate that fits: every higher one would exceed the budget.
        assert all(n * nbytes(c) > budget for c in higher)


def test_layer_bits_follow_the_stage_cut():
    # Interleaved 4 x 2: rank r holds stages r and r + 4, i.e. layers 2r..2r+1 and 8+2r..9+2r of 16.
    counts = inflight_microbatches("interleaved1f1b", 4, 8, virtual_stages=2)
    bits = allocate_stage_bits(counts.per_rank, proportional)
    per_layer = layer_bits(bits, 16, counts.stage_to_rank)
    assert per_layer == [4, 4, 4, 4, 6, 6, 8, 8] * 2
    assert layer_bits([4, 8], 4) == [4, 4, 8, 8]
    policy = make_policy("agoq", layer_bits=per_layer)
    assert policy.layer(0).act_input.bits == 4 and policy.layer(6).act_input.bits == 8
    with pytest.raises(ValueError, match="5 layers cannot be cut"):
        layer_bits([4, 8], 5)
    with pytest.raises(ValueError, match="names ranks outside"):
        layer_bits([4, 8], 4, stage_to_rank=[0, 2])
