"""Pipeline parallelism on torch.distributed and pipeline-stage-aware activation bits (DBCA-PP)."""

from agoq.parallel.dbca import (
    BIT_CANDIDATES,
    allocate_rank_bits,
    allocate_stage_bits,
    layer_bits,
    peak_bytes,
    stage_layer_bits,
    stage_saved_bytes,
)
from agoq.parallel.layout import PipelineLayout
from agoq.parallel.inflight import InFlight, count_inflight, inflight_microbatches, loss_recompute_needed, peak_inflight_bytes, schedule_order
from agoq.parallel.pipeline import (
    SCHEDULES,
    build_schedule,
    build_stages,
    check_schedule,
    is_multi_stage,
    make_mesh,
    rank_stages,
    schedule_class,
    schedule_name,
    split_layers,
    stage_to_rank,
)

__all__ = [
    "BIT_CANDIDATES",
    "SCHEDULES",
    "InFlight",
    "PipelineLayout",
    "allocate_rank_bits",
    "allocate_stage_bits",
    "build_schedule",
    "build_stages",
    "check_schedule",
    "count_inflight",
    "inflight_microbatches",
    "loss_recompute_needed",
    "is_multi_stage",
    "layer_bits",
    "make_mesh",
    "peak_bytes",
    "peak_inflight_bytes",
    "rank_stages",
    "schedule_class",
    "schedule_name",
    "schedule_order",
    "split_layers",
    "stage_layer_bits",
    "stage_saved_bytes",
    "stage_to_rank",
]
