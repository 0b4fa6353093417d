"""Stage-aware bit widths (DBCA-PP): later stages gain precision, no stage exceeds the uniform-4-bit peak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agoq.activation.policy import make_policy, with_loss_path
from agoq.models import get_config
from agoq.parallel import PipelineLayout, allocate_stage_bits, inflight_microbatches, split_layers, stage_layer_bits
from agoq.parallel.dbca import allocate_rank_bits, layer_bits, peak_bytes, stage_saved_bytes
from agoq.parallel.inflight import loss_recompute_needed, loss_weight_grad_in_forward, peak_inflight_bytes, schedule_order


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


@pytest.mark.parametrize("schedule,pp,n,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 4, 1), ("interleaved1f1b", 4, 8, 2), ("zbvzerobubble", 2, 4, 2)])
def test_timeline_allocation_with_equal_stages_equals_the_count_rule(schedule, pp, n, v):
    order = schedule_order(schedule, pp, n, v)
    counts = inflight_microbatches(schedule, pp, n, v).per_rank

    def nbytes(b: int) -> int:
        return 100 + 8 * b

    assert allocate_rank_bits(order, lambda stage, b: nbytes(b), pp * v) == allocate_stage_bits(counts, nbytes)


def test_a_heavy_last_stage_sets_the_peak_and_the_others_use_it():
    # GPipe keeps all 4 micro-batches everywhere; the last stage's loss tensors (1000 bytes each)
    # make it the peak (4 * (1000 + 4 * 10) = 4160), so rank 0 can afford 16 bits (4 * 160 = 640).
    order = schedule_order("gpipe", 2, 4)
    bits = allocate_rank_bits(order, lambda stage, b: 10 * b + (1000 if stage == 1 else 0), 2)
    assert bits == [16, 4]
    assert peak_inflight_bytes(order, [160, 1040]) == [640, 4160]


@pytest.mark.parametrize("schedule,pp,n,v", [("1f1b", 4, 8, 1), ("interleaved1f1b", 4, 8, 2), ("interleaved1f1b", 2, 4, 2), ("gpipe", 2, 4, 1)])
@pytest.mark.parametrize("fused_loss", [True, False])
def test_llama_stage_bits_never_raise_the_peak(schedule, pp, n, v, fused_loss):
    # LLaMA2-13B shapes, one 4096-token sequence per micro-batch: bytes from the activation accounting.
    cfg = get_config("llama2-13b")
    policy = make_policy("agoq", fused_loss=fused_loss)
    per_layer = stage_layer_bits(cfg, PipelineLayout(schedule, pp, n, v), 1, 4096, policy)
    assert len(per_layer) == cfg.n_layers and min(per_layer) == 4
    ranges = split_layers(cfg.n_layers, pp, v)
    order = schedule_order(schedule, pp, n, v)

    def peaks(bits_of_layer) -> list[int]:
        return peak_inflight_bytes(
            order, [stage_saved_bytes(cfg, policy, r, s == len(ranges) - 1, bits_of_layer[r.start], 1, 4096) for s, r in enumerate(ranges)]
        )

    dbca, uniform = peaks(per_layer), peaks([4] * cfg.n_layers)
    assert max(dbca) <= max(uniform)
    # Where ranks keep different counts in flight, the lighter ones gain precision (GPipe keeps
    # n everywhere: no slack unless the loss tensors make the last rank heavier).
    if schedule != "gpipe":
        assert max(per_layer) > 4


def test_llama_interleaved_4x2x8_bits_per_rank():
    cfg = get_config("llama2-13b")
    per_layer = stage_layer_bits(cfg, PipelineLayout("interleaved1f1b", 4, 8, 2), 1, 4096, make_policy("agoq"))
    # 40 layers in 8 stages of 5; rank r holds stages r and r + 4.
    assert per_layer == ([4] * 5 + [6] * 5 + [8] * 10) * 2


@pytest.mark.parametrize(
    "schedule, pp, virtual_stages, recompute",
    [("1f1b", 1, 1, False), ("gpipe", 1, 1, False), ("1f1b", 2, 1, True), ("interleaved-1f1b", 2, 2, True), ("gpipe", 2, 1, True)],
)
def test_the_fused_loss_recomputes_only_under_a_pipeline(schedule, pp, virtual_stages, recompute):
    from agoq.launch.config import load_config
    from agoq.launch.components import make_policy_for

    assert loss_recompute_needed(pp) is recompute
    cfg = load_config(
        None,
        [
            f"--parallel.pp={pp}",
            "--parallel.dp=1",
            f"--parallel.schedule={schedule}",
            f"--parallel.virtual_stages={virtual_stages}",
            "--parallel.microbatches=8",
            "--precision.compute_dtype=fp32",
        ],
    )
    trainers = make_policy_for(cfg.precision, cfg.parallel.pp, cfg.parallel.tp)
    assert trainers._loss_recompute is recompute
    # Where it would recompute, the trainer computes the gradients in forward instead and delivers
    # the head's there (its last stage backpropagates the loss with grad_output 1).
    assert trainers._loss_weight_grad_in_forward is recompute
    assert loss_weight_grad_in_forward(pp, tp=2) is False  # the tensor-parallel loss keeps its own path
    # What the loss keeps: hidden states and targets when recomputing, the hidden-state gradient alone
    # when the head's gradient went in forward, else the hidden-state gradient and the [vocab, hidden]
    # head gradient (the planner reads the same function; tests/test_plan_train.py checks it against
    # the trainer's meter).
    m = get_config("tiny")
    policy = with_loss_path(make_policy("agoq"), recompute=recompute)
    last = stage_saved_bytes(m, policy, range(0), True, 4, 1, 128, tp=1)
    assert last == 128 * m.hidden * 2 + (128 * 8 if recompute else m.vocab_size * m.hidden * 2)
    assert stage_saved_bytes(m, trainers, range(0), True, 4, 1, 128, tp=1) == 128 * m.hidden * 2 + (0 if recompute else m.vocab_size * m.hidden * 2)
