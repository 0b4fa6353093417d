"""Pipeline-parallel building blocks on torch.distributed: a (pp, dp) mesh, layer cuts, stages, schedules.

Everything here is a thin, validated layer over ``torch.distributed.device_mesh`` and
``torch.distributed.pipelining``; nothing replaces them. Stage ``s`` of ``pp * virtual_stages``
holds the ``s``-th consecutive range of decoder layers; which stages a rank holds depends on the
schedule (``loop`` placement ``rank, rank + pp, ...``; ``v`` placement ``rank, 2 * pp - 1 - rank``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

# Names accepted in configs (case-insensitive) -> the name of torch's schedule class in
# torch.distributed.pipelining.schedules, imported where a schedule is built or ordered and not
# with this module: torch's pipelining imports Dynamo, which the launcher's checks, `agoq plan` and
# a pp = 1 run need none of.
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "zbvzerobubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Schedules that place two stages per rank in a V (rank r holds stages r and 2*pp-1-r).
_V_SCHEDULES = ("zbvzerobubble", "dualpipev")
# Multi-stage schedules that split each micro-batch into rounds of microbatches_per_round.
_ROUND_SCHEDULES = ("interleaved1f1b", "interleavedzerobubble")


def schedule_name(name: str) -> str:
    """The canonical (lower-case) name of a pipeline schedule; ValueError for an unknown one."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return key


def schedule_class(name: str) -> type:
    """torch.distributed.pipelining's class for a schedule name ('gpipe', '1f1b', 'interleaved1f1b', ...)."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[schedule_name(name)])


def is_multi_stage(name: str) -> bool:
    """Whether the schedule can hold several (virtual) stages per rank."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(schedule_class(name), PipelineScheduleMulti)


def stage_to_rank(name: str, pp: int, virtual_stages: int = 1) -> list[int]:
    """The pp rank that holds each global stage index under this schedule's placement.

    The placement torch's multi-stage schedules assume (``torch.distributed.pipelining``'s
    ``generate_stage_to_rank_mapping``, which it does not export): ``loop`` puts stage s on rank
    s mod pp; ``v`` walks the ranks down and back up, round k = s // pp of pp stages in rank order
    when k is even and in reverse order when it is odd.
    """
    v = schedule_name(name) in _V_SCHEDULES
    return [pp - 1 - s % pp if v and (s // pp) % 2 else s % pp for s in range(pp * virtual_stages)]


def rank_stages(name: str, pp_rank: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Global stage indices held by pp rank ``pp_rank``, in increasing order."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp rank {pp_rank} is outside 0..{pp - 1}")
    return [s for s, r in enumerate(stage_to_rank(name, pp, virtual_stages)) if r == pp_rank]


def check_schedule(name: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> str:
    """Validate a schedule configuration without any process group; return the canonical name.

    Raises ValueError naming the bad value and the fix, before any process is started.
    """
    key = schedule_name(name)
    for label, value in (("pp", pp), ("n_microbatches", n_microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    num_stages = pp * virtual_stages
    if virtual_stages != 1 and not is_multi_stage(key):
        raise ValueError(
            f"schedule {key!r} runs one stage per rank but virtual_stages={virtual_stages}; set virtual_stages=1 or use 'interleaved1f1b'"
        )
    if key in _V_SCHEDULES and virtual_stages != 2:
        raise ValueError(f"schedule {key!r} needs exactly 2 stages per rank; set virtual_stages=2 (got {virtual_stages})")
    if key == "1f1b" and n_microbatches < pp:
        raise ValueError(
            f"schedule '1f1b' needs at least as many micro-batches as stages: n_microbatches={n_microbatches} < pp={pp}; "
            f"raise n_microbatches to {pp} or more (or use 'gpipe')"
        )
    if key == "dualpipev" and n_microbatches < num_stages:
        raise ValueError(f"schedule 'dualpipev' needs n_microbatches >= 2 * pp = {num_stages}, got {n_microbatches}; raise n_microbatches")
    if key in _ROUND_SCHEDULES:
        # torch splits the micro-batches into max(1, n // pp) equal rounds.
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(
                f"schedule {key!r} with pp={pp} splits micro-batches into max(1, n_microbatches // pp) = {rounds} "
                f"equal rounds, which n_microbatches={n_microbatches} does not divide; use a multiple of pp, e.g. {pp * rounds}"
            )
    return key


def make_mesh(world_size: int, pp: int, device_type: str = "cpu", tp: int = 1) -> DeviceMesh:
    """A 3-D DeviceMesh with dims ('pp', 'dp', 'tp'): rank r is pp stage r // (dp * tp), data
    replica (r // tp) % dp and tp rank r % tp. The tp ranks are adjacent (one host's GPUs hold a
    tp group, whose collectives run every layer), the pp stages farthest apart (Megatron's order)."""
    from torch.distributed.device_mesh import init_device_mesh

    for name, size in (("pp", pp), ("tp", tp)):
        if not isinstance(size, int) or size < 1 or world_size % size:
            raise ValueError(
                f"{'pipeline' if name == 'pp' else 'tensor-parallel'} size {name}={size} must be a positive divisor of the world size {world_size}; "
                f"pick {name} among {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )
    if world_size % (pp * tp):
        raise ValueError(f"pp x tp = {pp} x {tp} does not divide the world size {world_size}; the data-parallel size would not be whole")
    return init_device_mesh(device_type, (pp, world_size // (pp * tp), tp), mesh_dim_names=("pp", "dp", "tp"))


def split_layers(n_layers: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """Consecutive, equal layer ranges, one per global stage (pp * virtual_stages of them)."""
    num_stages = pp * virtual_stages
    if num_stages < 1 or n_layers < 1 or n_layers % num_stages:
        raise ValueError(
            f"{n_layers} layers cannot be cut into pp * virtual_stages = {pp} * {virtual_stages} = {num_stages} equal stages; "
            f"make the layer count a multiple of {num_stages} or change pp / virtual_stages"
        )
    per = n_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


def build_stages(
    modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[PipelineStage]:
    """PipelineStage objects wrapping this rank's stage modules (shapes are inferred on the first step)."""
    from torch.distributed.pipelining import PipelineStage

    if len(modules) != len(stage_indices):
        raise ValueError(f"got {len(modules)} stage modules for {len(stage_indices)} stage indices; pass one module per stage")
    for s in stage_indices:
        if not 0 <= s < num_stages:
            raise ValueError(f"stage index {s} is outside 0..{num_stages - 1}")
    dev = torch.device(device)
    return [PipelineStage(m, s, num_stages, dev, group=group) for m, s in zip(modules, stage_indices)]


def build_schedule(
    name: str,
    stages: Sequence[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scale_grads: bool = True,
) -> Any:
    """A torch.distributed.pipelining schedule over this rank's stages.

    ``loss_fn(output, target)`` runs on each micro-batch of the last stage, but every rank must
    pass one: torch runs backward only on ranks whose schedule has a loss function, and a rank
    without one would leave the others waiting forever. With ``scale_grads`` (torch's default)
    gradients are divided by ``n_microbatches``, so a ``loss_fn`` that averages over its
    micro-batch yields the full-batch mean gradient; pass ``scale_grads=False`` with a summing loss.
    """
    if not stages:
        raise ValueError("no pipeline stages given; build them with build_stages()")
    if loss_fn is None:
        raise ValueError(
            "loss_fn is None: pass the loss function on every pp rank, also those without the last stage "
            "(torch only calls it on the last stage, but a rank without one skips backward and the pipeline hangs)"
        )
    key = check_schedule(name, stages[0].group_size, n_microbatches, len(stages))
    if stages[0].num_stages != stages[0].group_size * len(stages):
        raise ValueError(
            f"{len(stages)} stage(s) per rank on {stages[0].group_size} pp ranks do not make {stages[0].num_stages} stages; "
            "give each rank num_stages / pp stages"
        )
    cls = schedule_class(key)
    if is_multi_stage(key):
        return cls(list(stages), n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
