"""Pipeline configuration checks and in-flight micro-batch counts read off torch's schedules (no process group)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from agoq.parallel import inflight_microbatches, make_mesh, split_layers
from agoq.parallel.inflight import count_inflight
from agoq.parallel.pipeline import check_schedule, rank_stages, schedule_class, schedule_name, stage_to_rank

F, B, I, W = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_1f1b_rank_r_of_p_keeps_p_minus_r_in_flight(p):
    counts = inflight_microbatches("1f1b", p, 2 * p)
    assert counts.per_rank == tuple(range(p, 0, -1))
    assert counts.per_stage == counts.per_rank


@pytest.mark.parametrize("p,n", [(2, 3), (4, 8), (4, 5)])
def test_gpipe_keeps_every_microbatch_in_flight(p, n):
    assert inflight_microbatches("gpipe", p, n).per_rank == (n,) * p


def test_interleaved_4x2x8_reproduces_the_papers_11_9_7_5():
    counts = inflight_microbatches("interleaved1f1b", 4, 8, virtual_stages=2)
    assert counts.per_rank == (11, 9, 7, 5)
    # Rank r holds stages r and r + 4; the two chunks peak at different times (8 + 4 > 11 on rank 0).
    assert counts.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert counts.per_stage == (8, 8, 7, 5, 4, 4, 3, 1)


def test_interleaved_counts_do_not_grow_with_more_microbatches():
    # Steady-state 1F1B bounds the warm-up; 16 micro-batches peak like 8.
    assert inflight_microbatches("interleaved1f1b", 4, 16, virtual_stages=2).per_rank == (11, 9, 7, 5)


def test_interleaved_with_one_chunk_is_not_1f1b_in_torch():
    # torch's interleaved warm-up runs 2 forwards per hop (multiply_factor=2), plain 1F1B runs 1.
    assert inflight_microbatches("interleaved1f1b", 4, 8, virtual_stages=1).per_rank == (7, 5, 3, 1)


def test_other_torch_schedules_are_counted_from_their_order():
    assert inflight_microbatches("loopedbfs", 4, 8, 2).per_rank == (16,) * 4
    # Zero-bubble schedules split the backward; a micro-batch stays in flight until its W.
    assert inflight_microbatches("interleavedzerobubble", 4, 8, 2).per_rank == (8,) * 4
    zbv = inflight_microbatches("zbvzerobubble", 4, 8, 2)
    assert zbv.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert zbv.per_rank == (8,) * 4 and zbv.per_stage == (8, 7, 6, 5, 4, 3, 2, 1)
    assert inflight_microbatches("dualpipev", 4, 8, 2).per_rank == (9,) * 4


def test_count_inflight_ends_a_microbatch_at_B_or_W_not_I():
    order = {
        0: [
            _Action(0, F, 0),
            _Action(0, F, 1),
            _Action(0, I, 0),
            _Action(0, F, 2),
            _Action(0, W, 0),
            _Action(0, B, 1),
            None,
            _Action(0, I, 2),
            _Action(0, W, 2),
        ],
    }
    assert count_inflight(order, 1) == ([3], [3])
    with pytest.raises(ValueError, match="before any forward"):
        count_inflight({0: [_Action(0, B, 0)]}, 1)


def test_schedule_names_are_case_insensitive_and_unknown_names_are_refused():
    assert schedule_name("Interleaved1F1B") == "interleaved1f1b"
    assert schedule_class("GPipe").__name__ == "ScheduleGPipe"
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'; use one of gpipe, 1f1b"):
        check_schedule("zigzag", 2, 4)


@pytest.mark.parametrize(
    "args,message",
    [
        (("1f1b", 4, 3), r"n_microbatches=3 < pp=4; raise n_microbatches to 4"),
        (("gpipe", 2, 4, 2), r"one stage per rank but virtual_stages=2"),
        (("1f1b", 2, 4, 2), r"one stage per rank but virtual_stages=2"),
        (("zbvzerobubble", 2, 4, 1), r"exactly 2 stages per rank"),
        (("dualpipev", 4, 6, 2), r"n_microbatches >= 2 \* pp = 8, got 6"),
        (("interleaved1f1b", 4, 9, 2), r"2 equal rounds, which n_microbatches=9 does not divide; use a multiple of pp, e.g. 8"),
        (("1f1b", 0, 4), r"pp must be a positive integer, got 0"),
        (("gpipe", 2, 0), r"n_microbatches must be a positive integer, got 0"),
    ],
)
def test_invalid_schedule_configs_fail_before_any_process_starts(args, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(*args)
    with pytest.raises(ValueError, match=message):
        inflight_microbatches(*args)


def test_valid_configs_pass_and_agree_with_torch():
    # Every config check_schedule accepts, torch builds (inflight_microbatches constructs it).
    for name in ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"):
        for pp in (1, 2, 4):
            for v in (1, 2, 3):
                for n in range(1, 13):
                    try:
                        check_schedule(name, pp, n, v)
                    except ValueError:
                        continue
                    counts = inflight_microbatches(name, pp, n, v)
                    assert len(counts.per_rank) == pp and len(counts.per_stage) == pp * v
                    assert 1 <= max(counts.per_rank) <= n * v


def test_split_layers_into_consecutive_equal_ranges():
    assert split_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert split_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(
        ValueError, match=r"6 layers cannot be cut into pp \* virtual_stages = 2 \* 2 = 4 equal stages; make the layer count a multiple of 4"
    ):
        split_layers(6, 2, 2)


def test_stage_placement_loop_and_v():
    assert stage_to_rank("interleaved1f1b", 2, 2) == [0, 1, 0, 1]
    assert rank_stages("interleaved1f1b", 1, 2, 2) == [1, 3]
    assert rank_stages("zbvzerobubble", 0, 2, 2) == [0, 3]
    assert rank_stages("1f1b", 1, 2) == [1]
    with pytest.raises(ValueError, match="pp rank 2 is outside 0..1"):
        rank_stages("1f1b", 2, 2)


def test_mesh_size_must_divide_world():
    with pytest.raises(ValueError, match=r"pp=3 must be a positive divisor of the world size 4; pick pp among \[1, 2, 4\]"):
        make_mesh(4, 3)


def test_build_schedule_refuses_a_rank_without_loss_fn():
    # torch would silently run that rank forward-only and the other ranks would wait forever.
    from agoq.parallel import build_schedule

    with pytest.raises(ValueError, match="pass the loss function on every pp rank"):
        build_schedule("1f1b", [object()], 4, None)
    with pytest.raises(ValueError, match="no pipeline stages given"):
        build_schedule("1f1b", [], 4, lambda out, target: out)


def test_a_pipeline_layout_is_checked_once_and_answers_for_its_schedule():
    from agoq.parallel import PipelineLayout
    from agoq.parallel.inflight import schedule_order

    layout = PipelineLayout("interleaved-1f1b", pp=2, microbatches=4, virtual_stages=2, dp=3)
    assert layout.key == check_schedule("interleaved-1f1b", 2, 4, 2) and layout.num_stages == 4
    assert layout.stage_ranges(8) == split_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert layout.stage_ranks() == [0, 1, 0, 1]
    assert layout.order() == schedule_order(layout.key, 2, 4, 2)
    assert layout == PipelineLayout("interleaved-1f1b", 2, 4, 2, 3) and layout != PipelineLayout("interleaved-1f1b", 2, 4, 2, 1)
    with pytest.raises(ValueError, match="virtual"):
        PipelineLayout("1f1b", pp=2, microbatches=4, virtual_stages=2)
    with pytest.raises(ValueError, match="dp=0 must be >= 1"):
        PipelineLayout("1f1b", pp=2, microbatches=4, dp=0)
