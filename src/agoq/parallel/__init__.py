"""Pipeline parallelism on torch.distributed, pipeline-stage-aware activation bits (DBCA-PP), and
tensor + sequence parallelism.

The names here are what a user composing agoq's parallelisms needs; the building blocks stay in
their modules: ``pipeline`` (schedules and stages), ``inflight`` (in-flight micro-batch counts),
``dbca`` (stage bits), ``layout``, ``tensor_ops`` and ``tensor_model``.
"""

from agoq.parallel.dbca import allocate_stage_bits, stage_layer_bits
from agoq.parallel.inflight import inflight_microbatches
from agoq.parallel.layout import PipelineLayout
from agoq.parallel.pipeline import SCHEDULES, build_schedule, build_stages, make_mesh, rank_stages, split_layers
from agoq.parallel.tensor_model import TensorParallelLlama, shard_llama

__all__ = [
    "SCHEDULES",
    "PipelineLayout",
    "TensorParallelLlama",
    "allocate_stage_bits",
    "build_schedule",
    "build_stages",
    "inflight_microbatches",
    "make_mesh",
    "rank_stages",
    "shard_llama",
    "split_layers",
    "stage_layer_bits",
]
