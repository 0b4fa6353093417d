"""Peak in-flight micro-batches per pipeline rank and stage, read off torch's own schedule order.

A micro-batch is *in flight* on a stage from its forward until its backward has finished: its saved
activations live that long. The count is taken from the per-rank action lists that
``torch.distributed.pipelining`` itself executes (``schedule.pipeline_order``), not from a formula,
so it follows whatever torch does (1F1B: p - r on rank r; interleaved 1F1B, 4 ranks x 2 chunks x
8 micro-batches: 11, 9, 7, 5, the figures METHOD.md quotes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agoq.parallel.pipeline import check_schedule, is_multi_stage, rank_stages, schedule_class, stage_to_rank


@dataclass(frozen=True)
class InFlight:
    """Peak in-flight micro-batch counts of one schedule configuration."""

    schedule: str
    pp: int
    n_microbatches: int
    virtual_stages: int
    # Peak over time of the micro-batches in flight on each pp rank, all its stages together: one
    # micro-batch in flight on two of a rank's stages counts twice (each stage keeps its own layers'
    # activations), so with v stages per rank the unit is 1/v of the rank's layers.
    per_rank: tuple[int, ...]
    # Peak of each global stage on its own; a rank's stages peak at different times, so the sum
    # over a rank's stages can exceed per_rank.
    per_stage: tuple[int, ...]
    stage_to_rank: tuple[int, ...]


class _OrderOnlyStage:
    """The attributes a schedule constructor reads from a stage; enough to build the action order."""

    def __init__(self, stage_index: int, num_stages: int, pp: int, pp_rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = pp_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_order(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> dict[int, list[Any]]:
    """torch's per-rank compute action lists (pipeline_order) for a schedule, without a process group."""
    key = check_schedule(schedule, pp, n_microbatches, virtual_stages)
    num_stages = pp * virtual_stages
    # Every rank's list is computed by every rank's schedule object, so rank 0's copy suffices.
    stages = [_OrderOnlyStage(s, num_stages, pp, 0) for s in rank_stages(key, 0, pp, virtual_stages)]
    cls = schedule_class(key)
    loss_fn = lambda output, target: output  # noqa: E731  (a loss makes the schedule include backwards)
    try:
        sched = cls(stages if is_multi_stage(key) else stages[0], n_microbatches, loss_fn=loss_fn)
    except (ValueError, AssertionError, RuntimeError) as err:
        raise ValueError(
            f"torch cannot build schedule {key!r} for pp={pp}, virtual_stages={virtual_stages}, n_microbatches={n_microbatches}: {err}"
        ) from err
    if sched.pipeline_order is None:
        raise ValueError(f"schedule {key!r} does not expose its action order in this torch version")
    return {rank: list(actions) for rank, actions in sched.pipeline_order.items()}


def _timeline_peaks(pipeline_order: Mapping[int, Sequence[Any]], stage_weights: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per rank, the peak summed weight of in-flight micro-batches; per stage, the peak count."""
    from torch.distributed.pipelining import schedules

    forward, done = schedules.FORWARD, (schedules.FULL_BACKWARD, schedules.BACKWARD_WEIGHT)
    num_stages = len(stage_weights)
    per_rank = [0] * len(pipeline_order)
    per_stage = [0] * num_stages
    for rank, actions in pipeline_order.items():
        live = [0] * num_stages
        total = 0
        stack = [a for a in reversed(actions) if a is not None]
        while stack:
            action = stack.pop()
            if action.sub_actions:
                stack.extend(reversed(action.sub_actions))
                continue
            s = action.stage_index
            if action.computation_type == forward:
                live[s] += 1
                total += stage_weights[s]
                per_stage[s] = max(per_stage[s], live[s])
                per_rank[rank] = max(per_rank[rank], total)
            elif action.computation_type in done:
                if live[s] == 0:
                    raise ValueError(f"rank {rank} runs {action} before any forward of stage {s}: not a valid order")
                live[s] -= 1
                total -= stage_weights[s]
    return per_rank, per_stage


def count_inflight(pipeline_order: Mapping[int, Sequence[Any]], num_stages: int) -> tuple[list[int], list[int]]:
    """Peak in-flight micro-batches (per rank, per global stage) of per-rank action lists.

    A forward ``F`` starts a micro-batch; it ends with its full backward ``B`` or, where the
    backward is split, with the weight gradient ``W`` (activations the weight gradient needs
    outlive the input gradient ``I``). Overlapped ``F;B`` actions are taken in their listed order.
    """
    return _timeline_peaks(pipeline_order, [1] * num_stages)


def peak_inflight_bytes(pipeline_order: Mapping[int, Sequence[Any]], stage_bytes: Sequence[int]) -> list[int]:
    """Each rank's peak over time of the bytes its in-flight micro-batches keep (stage s: stage_bytes[s] each)."""
    return _timeline_peaks(pipeline_order, [int(b) for b in stage_bytes])[0]


def inflight_microbatches(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> InFlight:
    """Each pp rank's and each stage's peak number of in-flight micro-batches under a torch schedule."""
    key = check_schedule(schedule, pp, n_microbatches, virtual_stages)
    per_rank, per_stage = count_inflight(schedule_order(key, pp, n_microbatches, virtual_stages), pp * virtual_stages)
    return InFlight(
        schedule=key,
        pp=pp,
        n_microbatches=n_microbatches,
        virtual_stages=virtual_stages,
        per_rank=tuple(per_rank),
        per_stage=tuple(per_stage),
        stage_to_rank=tuple(stage_to_rank(key, pp, virtual_stages)),
    )


def loss_recompute_needed(pp: int) -> bool:
    """Whether the fused loss should recompute its logits in backward under this layout.

    Precomputing the gradients in forward keeps one [vocab, hidden] LM-head weight gradient per
    in-flight micro-batch. Without a pipeline (pp = 1) one micro-batch is in flight and that is the
    gradient the head's backward creates right after anyway, so the recompute's extra LM-head GEMM
    (about 8% of a tiny model's step on CPU) buys nothing. Under a pipeline the last stage also
    holds one micro-batch at a time in 1F1B, but the extra gradient there can make the last stage,
    not the first, the rank with the highest saved-bytes peak, and DBCA's stage bits are chosen
    under the first stage's measured peak: recomputing keeps that premise (only the hidden states
    are kept).
    """
    return pp > 1


def loss_weight_grad_in_forward(pp: int, tp: int) -> bool:
    """Whether the trainer's fused loss, where it would recompute (:func:`loss_recompute_needed`),
    computes its gradients in forward instead and delivers the LM-head weight's there.

    The trainer backpropagates the last stage's loss with grad_output 1, which is all this needs:
    the logits are computed once, not twice (the recompute cost 7-8% of the default run's FLOPs),
    and what is kept is the hidden-state
    gradient, the size of the hidden states the recompute kept. The tensor-parallel stage has a
    vocab-parallel loss of its own and keeps its path.

    When torch's schedule (re)initializes (its first step, and the first after an eval()), it runs
    the last stage's loss once more, first, on placeholder values, for a backward that reaches no
    parameter; the trainer gives that call the recompute path, which hands nothing over.
    """
    return loss_recompute_needed(pp) and tp == 1
