"""What a plan holds: per pp rank bytes of each memory configuration, and its documented JSON form
(schema agoq.plan/1, docs/plan.md). The markdown tables are agoq.plan.report's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agoq.gradient.collectives import int8_gradient_format
from agoq.parallel.pipeline import schedule_name
from agoq.plan.config import PlanConfig, Setup, parse_setup
from agoq.quant import parse_format

SCHEMA = "agoq.plan/1"


@dataclass
class RankMemory:
    """One pp rank's bytes under one configuration (every tp and dp rank of it holds the same)."""

    pp_rank: int
    stages: tuple[int, ...]
    layers: int
    bits: tuple[int, ...] | None  # activation bits per stage of this rank (16 = kept as the baseline); None for bf16
    inflight: int  # peak in-flight micro-batches, counted per stage (a rank with v stages counts each)
    recompute_layers: int  # layers per stage whose activations are recomputed (only their input kept)
    parameters: int
    gradients: int
    optimizer: int
    activations_per_microbatch: int  # saved for backward by one micro-batch on all of this rank's stages
    activations_peak: int  # saved for backward at the in-flight peak of one step
    pipeline_buffers: int  # stage inputs / outputs the pipeline keeps for in-flight micro-batches, at the peak
    temporary: int  # largest transient working set (estimate)
    total_without_recompute: int

    @property
    def total(self) -> int:
        """Everything this rank holds at its peak."""
        return self.parameters + self.gradients + self.optimizer + self.activations_peak + self.pipeline_buffers + self.temporary

    def to_dict(self) -> dict[str, object]:
        """JSON form (schema agoq.plan/1)."""
        return {
            "pp_rank": self.pp_rank,
            "stages": list(self.stages),
            "layers": self.layers,
            "bits": None if self.bits is None else list(self.bits),
            "inflight": self.inflight,
            "recompute_layers": self.recompute_layers,
            "bytes": {
                "parameters": self.parameters,
                "gradients": self.gradients,
                "optimizer": self.optimizer,
                "activations_per_microbatch": self.activations_per_microbatch,
                "activations_peak": self.activations_peak,
                "pipeline_buffers": self.pipeline_buffers,
                "temporary": self.temporary,
                "total": self.total,
                "total_without_recompute": self.total_without_recompute,
            },
        }


@dataclass
class SetupPlan:
    """The plan of one configuration: every pp rank, the recompute it needs, its estimated time."""

    setup: Setup
    ranks: list[RankMemory]
    fits: bool | None  # None when no GPU memory or budget was given
    recompute_layers: int | None  # applied per stage (Megatron's recompute_num_layers); None: cannot fit at all
    relative_time: float  # estimated iteration time / the baseline's without recomputation (at full recompute if it cannot fit)

    @property
    def peak(self) -> int:
        """The largest rank total: what the GPU must hold."""
        return max(r.total for r in self.ranks)

    @property
    def peak_without_recompute(self) -> int:
        """The largest rank total before any recomputation."""
        return max(r.total_without_recompute for r in self.ranks)

    def to_dict(self) -> dict[str, object]:
        """JSON form (schema agoq.plan/1)."""
        return {
            "name": self.setup.name,
            "description": self.setup.description,
            "activations": "agoq" if self.setup.activations else "bf16",
            "gradients": "int8" if self.setup.gradients else "fp32",
            "optimizer": "adamw8bit" if self.setup.optimizer else "adamw",
            "zero1": self.setup.zero1,
            "peak_bytes": self.peak,
            "peak_bytes_without_recompute": self.peak_without_recompute,
            "fits": self.fits,
            "recompute_layers": self.recompute_layers,
            "relative_iteration_time_estimate": None if self.recompute_layers is None else round(self.relative_time, 4),
            "ranks": [r.to_dict() for r in self.ranks],
        }


@dataclass
class Plan:
    """The memory plan of every requested configuration of one training configuration."""

    config: PlanConfig
    setups: list[SetupPlan]
    inflight: tuple[int, ...]
    layer_units: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> SetupPlan:
        """The plan of configuration ``name`` ('A+G+O', ...)."""
        want = parse_setup(name).name
        for s in self.setups:
            if s.setup.name == want:
                return s
        raise KeyError(f"configuration {name!r} was not planned; planned: {', '.join(s.setup.name for s in self.setups)}")

    def speedup_estimate(self, name: str, reference: str = "baseline") -> float | None:
        """Estimated iteration-time ratio reference / name, each with the recomputation it needs to fit."""
        ref, cur = self.get(reference), self.get(name)
        if ref.recompute_layers is None or cur.recompute_layers is None:
            return None
        return ref.relative_time / cur.relative_time

    def to_dict(self) -> dict[str, object]:
        """The documented, stable JSON form (docs/plan.md, schema agoq.plan/1)."""
        c = self.config
        m = c.model
        return {
            "schema": SCHEMA,
            "model": {
                "name": c.model_name,
                **{k: v for k, v in m.to_dict().items() if k not in ("rope_theta", "norm_eps", "max_seq_len")},
                "parameters": m.num_parameters(),
            },
            "parallel": {
                "tp": c.tp,
                "pp": c.pp,
                "dp": c.dp,
                "sequence_parallel": c.tp > 1,
                "schedule": schedule_name(c.schedule),
                "virtual_stages": c.vstages,
                "micro_batch": c.micro_batch,
                "microbatches": c.microbatches,
                "global_batch": c.micro_batch * c.dp * c.microbatches,
                "seq_len": c.seq_len,
            },
            "precision": {
                "dtype": c.dtype,
                "activation_format": parse_format(c.activation_format).name,
                "gradient_format": int8_gradient_format(c.gradient_block).name,
                "optimizer_block": c.optimizer_block,
            },
            "memory": {
                "gpu_memory": c.gpu_memory,
                "reserved": c.reserved,
                "memory_budget": c.memory_budget,
                "capacity": c.capacity,
                "mode": "budget" if c.memory_budget is not None else "dbca",
            },
            "inflight_per_rank": list(self.inflight),
            "layer_saved_units": self.layer_units,
            "configurations": [s.to_dict() for s in self.setups],
            "gradient_link_bytes": {"node_size": c.node_size, "per_rank_per_step": self.gradient_link_bytes()},
        }

    def gradient_link_bytes(self) -> dict[str, dict[str, int]]:
        """Per gradient mode, the bytes the largest pp rank sends per step within a node and between
        nodes to reduce its gradients over dp (agoq.plan.links)."""
        import torch

        from agoq.plan.config import DTYPES
        from agoq.plan.links import gradient_link_bytes

        c = self.config
        numel = max(r.parameters for r in self.setups[0].ranks) // torch.empty((), dtype=DTYPES[c.dtype]).element_size()
        return gradient_link_bytes(numel, c.dp, c.node_size, c.gradient_block, by_node=c.pp == 1 and c.tp == 1)
