"""The memory model of one training configuration, per pipeline rank, for the baseline and AGoQ.

Every byte count here comes from the code the trainer runs or measures, not from a second copy
of a formula: saved activations per layer from :func:`agoq.activation.layer_saved_bytes` (checked
to the byte against the meter), the loss's from :func:`agoq.activation.loss.loss_saved_bytes`,
a stage's from :func:`agoq.parallel.stage_saved_bytes`, in-flight peaks from torch's own
schedule order (:func:`agoq.parallel.peak_inflight_bytes`), stage bits from the trainer's DBCA
function (:func:`agoq.parallel.stage_layer_bits`), parameter shapes from the model's own modules
(built on the meta device), and 8-bit sizes from :meth:`agoq.quant.QuantFormat.nbytes`.

Tensor parallelism with sequence parallelism (Megatron-LM's TP + SP) divides every saved tensor
of a decoder layer by ``tp``: norm inputs and GEMM inputs are sharded along the sequence, the
attention core and the SwiGLU tensors along heads / the intermediate size. The per-rank count is
therefore the layer accounting at ``seq_len / tp`` tokens per sequence, which is the same number
(a quantized tensor's bytes depend only on its element count). The remaining assumptions are in
docs/plan.md.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from agoq.activation.accounting import U_bytes, layer_saved_bytes
from agoq.activation.loss import default_chunk_size
from agoq.activation.ops import NORM_CHUNK_VALUES, SWIGLU_CHUNK_VALUES, chunk_rows
from agoq.activation.policy import ActivationPolicy, LayerPrecision, make_policy
from agoq.gradient.buffer import DEFAULT_BUCKET_BYTES, FOLD_PIECE, plan_buckets
from agoq.gradient.collectives import reduce_piece
from agoq.models.config import PRESETS, LlamaConfig, get_config
from agoq.parallel.dbca import BIT_CANDIDATES, stage_layer_bits, stage_saved_bytes
from agoq.parallel.inflight import inflight_microbatches, loss_recompute_needed, peak_inflight_bytes
from agoq.parallel.layout import PipelineLayout
from agoq.parallel.pipeline import check_schedule, rank_stages, schedule_name, split_layers
from agoq.quant import QuantFormat, parse_format

from agoq.train.optim import STEP_GROUP_BYTES

if TYPE_CHECKING:
    from agoq.train.config import TrainConfig

SCHEMA = "agoq.plan/1"
DEFAULT_SETUPS = ("baseline", "baseline+zero1", "A", "A+G", "A+G+O", "A+G+O+zero1")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX_BYTES = 8  # int64 token ids / targets
ADAM_MOMENTS = 2
# torchao's AdamW8bit (and bitsandbytes) keep a tensor's moments in 8 bits only when it has at least
# this many values and whole blocks; smaller tensors keep fp32 moments.
OPTIM8_MIN_NUMEL = 4096
OPTIM8_QMAP_BYTES = 256 * 4  # the fp32 code book each 8-bit state tensor carries
STEP_BYTES = 4  # AdamW's per-parameter step counter (a 0-dim fp32 tensor)
# Per element of the [tokens, intermediate] tensors, what a SwiGLU backward materialises at once,
# counted from agoq.activation.ops: the baseline (autograd through silu and mul) makes the gradients
# of the product, gate and up and SiLU's derivative in the compute dtype; the fused op's backward
# (_swiglu_backward), per element of the chunk of rows it works on, at its peak holds gate and up
# dequantized to fp32, the output gradient in fp32, sigmoid, SiLU and the gate gradient's first
# product in fp32, and the up gradient and the output gradient as computed in the compute dtype
# (besides the whole gate and up gradients it writes the chunks into).
SWIGLU_BACKWARD_VALUES = {"baseline": (0, 4), "quantized": (6, 2)}  # (fp32 values, compute-dtype values)
# The paper's measured cost of its quantization kernels per layer: +2% forward, +3% backward.
QUANT_OVERHEAD = (0.02, 0.03)
BACKWARD_OVER_FORWARD = 2.0  # backward does two GEMMs per forward GEMM


class PlanError(ValueError):
    """A configuration that cannot be planned; the one-line message names the value and the fix."""


# ------------------------------------------------------------------------------ sizes


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


MAX_SIZE = 2**60  # 1 EiB: any memory size above is a typo
MAX_LAYERS = 4096  # the planner walks layers one by one; real models have at most a few hundred


def parse_size(text: str | int | float, *, allow_zero: bool = False) -> int:
    """Bytes of a size such as '48GiB', '46.1GB', '512MiB' or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise PlanError(f"cannot read the size {text!r}; write e.g. 48GiB, 46.1GB, 512MiB or a number of bytes")
        unit = (m.group(2) or "").lower().rstrip("b")
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number) or number > MAX_SIZE:
            raise PlanError(f"size {text!r} is beyond any machine (the limit is 1 EiB); write e.g. 80GiB")
        value = int(number)
    if value > MAX_SIZE:
        raise PlanError(f"size {text!r} is beyond any machine (the limit is 1 EiB); write e.g. 80GiB")
    if value < 0 or (value == 0 and not allow_zero):
        raise PlanError(f"size {text!r} must be positive")
    return value


def format_size(n: int | None) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB)."""
    if n is None:
        return "-"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------ what is compressed


@dataclass(frozen=True)
class Setup:
    """One memory configuration: which of AGoQ's parts are on, and whether the optimizer is sharded."""

    activations: bool = False  # A: LAAQ saved activations (4-bit, stage bits from DBCA) + fused loss
    gradients: bool = False  # G: 8-bit gradient buffer (QuanGrad) instead of fp32 main grads
    optimizer: bool = False  # O: 8-bit AdamW moments instead of fp32
    zero1: bool = False  # optimizer state (moments and fp32 master) sharded over dp

    @property
    def name(self) -> str:
        """'baseline', 'baseline+zero1', 'A', 'A+G', 'A+G+O+zero1', ..."""
        parts = [p for p, on in (("A", self.activations), ("G", self.gradients), ("O", self.optimizer)) if on] or ["baseline"]
        return "+".join(parts + (["zero1"] if self.zero1 else []))

    @property
    def description(self) -> str:
        """One line saying what this configuration keeps in which precision."""
        acts = "4-bit saved activations (DBCA stage bits), fused loss" if self.activations else "bf16 saved activations"
        grads = "8-bit gradients" if self.gradients else "fp32 gradients"
        optim = "8-bit AdamW + fp32 master" if self.optimizer else "fp32 AdamW + fp32 master"
        return f"{acts}, {grads}, {optim}" + (", optimizer sharded over dp (ZeRO-1)" if self.zero1 else "")


def parse_setup(name: str) -> Setup:
    """A Setup from its name: 'baseline', 'baseline+zero1', or '+'-joined parts among A, G, O, zero1."""
    parts = [p.strip() for p in str(name).split("+") if p.strip()]
    known = {"baseline", "A", "G", "O", "zero1"}
    bad = [p for p in parts if p not in known]
    if not parts or bad:
        raise PlanError(f"unknown configuration {name!r}; use 'baseline', 'baseline+zero1' or parts of A+G+O(+zero1), e.g. 'A+G'")
    if "baseline" in parts and set(parts) & {"A", "G", "O"}:
        raise PlanError(f"configuration {name!r} mixes 'baseline' with AGoQ parts; write e.g. 'A+G' or 'baseline+zero1'")
    return Setup("A" in parts, "G" in parts, "O" in parts, "zero1" in parts)


# ------------------------------------------------------------------------------ the configuration


@dataclass(frozen=True)
class PlanConfig:
    """A training configuration to plan: architecture, parallel layout, batch and memory limits."""

    model: LlamaConfig
    seq_len: int
    model_name: str = "custom"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int | None = None  # sequences per optimizer step over all dp ranks; default micro_batch * dp
    schedule: str = "1f1b"
    virtual_stages: int | None = None  # model chunks per pp rank; default 2 for interleaved schedules, else 1
    dtype: str = "bf16"  # compute dtype of parameters and activations
    activation_format: str = "int4/128"
    stage_bits: str = "dbca"  # dbca: later pipeline stages get more bits at no peak cost (the trainer's); uniform
    gradient_block: int = 256
    optimizer_block: int = 256
    gpu_memory: int | None = None  # device bytes; fits means total + reserved <= gpu_memory
    reserved: int = 2 * 2**30  # CUDA context, NCCL buffers and allocator fragmentation, off the top
    memory_budget: int | None = None  # budget mode: bits and recompute chosen to fit this many bytes
    recompute_layers: int | None = None  # a fixed recompute count per stage for every configuration; None: the fewest that fit
    setups: tuple[str, ...] = DEFAULT_SETUPS
    device: str = "cuda"  # where the step runs: some temporaries are cut into device-sized chunks

    @property
    def vstages(self) -> int:
        """Virtual stages (model chunks) per pp rank."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if schedule_name(self.schedule) in ("interleaved1f1b", "interleavedzerobubble", "zbvzerobubble", "dualpipev") else 1

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline per step."""
        gb = self.global_batch if self.global_batch is not None else self.micro_batch * self.dp
        return gb // (self.micro_batch * self.dp)

    @property
    def capacity(self) -> int | None:
        """Bytes a rank's total may take: the memory budget, else the GPU memory less the reserve."""
        if self.memory_budget is not None:
            return self.memory_budget
        if self.gpu_memory is not None:
            return self.gpu_memory - self.reserved
        return None

    def validate(self) -> None:
        """Raise PlanError (one line) for a configuration that cannot run."""
        c = self.model
        for name in ("seq_len", "tp", "pp", "dp", "micro_batch", "gradient_block", "optimizer_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"{name.replace('_', '-')}={v!r} must be a positive integer")
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype={self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        if c.n_heads % self.tp:
            raise PlanError(f"{self.model_name}: n_heads={c.n_heads} is not divisible by tp={self.tp}; pick a tp that divides {c.n_heads}")
        if c.n_kv_heads % self.tp:
            raise PlanError(f"{self.model_name}: n_kv_heads={c.n_kv_heads} is not divisible by tp={self.tp}; pick a tp that divides {c.n_kv_heads}")
        if c.intermediate % self.tp:
            raise PlanError(f"{self.model_name}: intermediate={c.intermediate} is not divisible by tp={self.tp}")
        if self.seq_len % self.tp:
            raise PlanError(f"seq-len={self.seq_len} is not divisible by tp={self.tp} (sequence parallelism shards the sequence)")
        gb = self.global_batch if self.global_batch is not None else self.micro_batch * self.dp
        if gb < 1 or gb % (self.micro_batch * self.dp):
            raise PlanError(
                f"global-batch={gb} is not a multiple of micro-batch x dp = {self.micro_batch} x {self.dp}; "
                f"use a multiple of {self.micro_batch * self.dp}"
            )
        try:
            key = check_schedule(self.schedule, self.pp, self.microbatches, self.vstages)
            split_layers(c.n_layers, self.pp, self.vstages)
        except ValueError as e:
            raise PlanError(f"{self.model_name}: {e}") from None
        if key not in ("gpipe", "1f1b", "interleaved1f1b"):
            raise PlanError(f"schedule {self.schedule!r} is not planned; use gpipe, 1f1b or interleaved-1f1b")
        if key == "interleaved1f1b" and self.vstages < 2:
            raise PlanError("schedule interleaved-1f1b needs virtual-stages >= 2; set --virtual-stages 2 or use 1f1b")
        try:
            fmt = parse_format(self.activation_format)
        except ValueError as e:
            raise PlanError(f"activation-format={self.activation_format!r}: {e}") from None
        if fmt.kind != "int" or fmt.bits not in BIT_CANDIDATES:
            raise PlanError(
                f"activation-format={self.activation_format!r}: stage bits need an int format of {BIT_CANDIDATES[:-1]} bits, e.g. int4/128"
            )
        if self.recompute_layers is not None and (not isinstance(self.recompute_layers, int) or self.recompute_layers < 0):
            raise PlanError(f"recompute-layers={self.recompute_layers!r} must be a non-negative integer")
        if self.stage_bits not in ("dbca", "uniform"):
            raise PlanError(f"stage-bits={self.stage_bits!r} is unknown; use dbca or uniform")
        for s in self.setups:
            parse_setup(s)
        if self.memory_budget is not None and self.gpu_memory is not None and self.memory_budget > self.gpu_memory:
            raise PlanError(f"memory-budget={self.memory_budget} exceeds gpu-memory={self.gpu_memory}; lower the budget")
        if self.gpu_memory is not None and self.gpu_memory <= self.reserved:
            raise PlanError(f"gpu-memory={self.gpu_memory} is not above the reserve of {self.reserved} bytes; lower --reserved")


def make_plan_config(model: str = "tiny", model_fields: dict[str, object] | None = None, **kwargs: object) -> PlanConfig:
    """A PlanConfig for a preset (with architecture field overrides), validated."""
    fields = dict(model_fields or {})
    if model not in PRESETS:
        raise PlanError(f"unknown model {model!r}; use one of {', '.join(PRESETS)} (with --model-field key=value for a custom one)")
    seq = kwargs.get("seq_len")
    if isinstance(seq, int) and seq > PRESETS[model].max_seq_len:
        fields.setdefault("max_seq_len", seq)
    try:
        cfg = get_config(model, **fields)
    except (ValueError, TypeError) as e:
        raise PlanError(str(e)) from None
    if cfg.n_layers > MAX_LAYERS:
        raise PlanError(f"n_layers={cfg.n_layers} cannot be planned (the limit is {MAX_LAYERS} layers); check --model-field n_layers")
    name = model if not fields else model + "(" + ",".join(f"{k}={v}" for k, v in fields.items() if k != "max_seq_len") + ")"
    plan = PlanConfig(model=cfg, model_name=name.replace("()", ""), **kwargs)  # type: ignore[arg-type]
    plan.validate()
    return plan


# ------------------------------------------------------------------------------ results


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
                "gradient_format": f"int8/{c.gradient_block}",
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
        }


# ------------------------------------------------------------------------------ the model


class PlanAccounting:
    """The byte and time formulas of one configuration, per rank: parameters, gradients, optimizer
    state, saved activations, temporaries and iteration time (the search over bits and recompute is
    :func:`_plan_setup`, the report agoq.plan.report).

    Over 250 lines on purpose: every formula reads the same derived sizes (the model, the per-rank
    stages and layer ranges, the schedule's order and in-flight counts, tp-sharded token and vocab
    counts), computed once in ``__init__``; split, the halves would pass them all back and forth.
    """

    def __init__(self, cfg: PlanConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.m = cfg.model
        self.dtype = DTYPES[cfg.dtype]
        self.es = torch.empty((), dtype=self.dtype).element_size()
        self.layout = PipelineLayout(cfg.schedule, cfg.pp, cfg.microbatches, cfg.vstages, cfg.dp)
        self.key = self.layout.key
        self.num_stages = self.layout.num_stages
        self.ranges = self.layout.stage_ranges(self.m.n_layers)
        self.rank_stages = [rank_stages(self.key, r, cfg.pp, cfg.vstages) for r in range(cfg.pp)]
        self.fmt = parse_format(cfg.activation_format)
        self.device = torch.device(cfg.device)  # sizes the chunks some temporaries are cut into
        # Per-rank tokens of one micro-batch's sharded tensors: sequence parallelism cuts seq by tp.
        self.seq_tp = cfg.seq_len // cfg.tp
        self.tokens_tp = cfg.micro_batch * self.seq_tp
        self.tokens = cfg.micro_batch * cfg.seq_len
        self.vocab_tp = -(-self.m.vocab_size // cfg.tp)  # vocab-parallel embedding / head, padded to tp
        if cfg.pp == 1:
            self.order = None
            self.inflight = (1,)  # one micro-batch's forward and backward before the next (Megatron, agoq's trainer)
        else:
            self.order = self.layout.order()
            self.inflight = inflight_microbatches(self.key, cfg.pp, cfg.microbatches, cfg.vstages).per_rank

    # ---- parameters

    @cached_property
    def layer_numels(self) -> list[int]:
        """Per-rank numel of each parameter tensor of one decoder layer: TP splits 2-D weights, norms are replicated."""
        from agoq.models.llama import DecoderLayer

        with torch.device("meta"):
            layer = DecoderLayer(self.m, 0)
        return [p.numel() if p.ndim == 1 else p.numel() // self.cfg.tp for p in layer.parameters()]

    def rank_numels(self, rank: int) -> list[int]:
        """Per-rank numel of every parameter tensor a pp rank holds, in the trainer's registration order."""
        m, out = self.m, []
        for s in self.rank_stages[rank]:
            if s == 0:
                out.append(self.vocab_tp * m.hidden)
            out += self.layer_numels * len(self.ranges[s])
            if s == self.num_stages - 1:
                out.append(m.hidden)  # final norm
                # A tied head shares the embedding where one rank holds both; else the last stage keeps
                # its own copy (Megatron's shared-embedding copy, kept in sync by an all-reduce).
                if not (m.tie_embeddings and 0 in self.rank_stages[rank]):
                    out.append(self.vocab_tp * m.hidden)
        return out

    def buckets(self, numels: list[int]) -> list[tuple[int, list]]:
        """The gradient buckets of a rank's parameters: the layout rule of the 8-bit buffer and of ZeRO-1's shards."""
        return plan_buckets(numels, self.cfg.gradient_block, DEFAULT_BUCKET_BYTES // 4, self.cfg.dp)

    def parameter_bytes(self, numels: list[int]) -> int:
        """Model weights in the compute dtype."""
        return sum(numels) * self.es

    def gradient_bytes(self, numels: list[int], setup: Setup) -> int:
        """fp32 main gradients (flat, or bucketed and padded for ZeRO-1), or the 8-bit block-wise buffer."""
        if setup.gradients:
            fmt = QuantFormat("int", 8, self.cfg.gradient_block)
            return sum(fmt.nbytes(n) for n, _ in self.buckets(numels))
        if setup.zero1:
            return 4 * sum(n for n, _ in self.buckets(numels))
        return 4 * sum(numels)

    def _moments(self, n: int, setup: Setup) -> int:
        """AdamW's two moments of n values: fp32, or 8-bit block-wise where the 8-bit optimizer quantizes."""
        if setup.optimizer and n >= OPTIM8_MIN_NUMEL and n % self.cfg.optimizer_block == 0:
            return ADAM_MOMENTS * (QuantFormat("int", 8, self.cfg.optimizer_block).nbytes(n) + OPTIM8_QMAP_BYTES)
        return ADAM_MOMENTS * 4 * n

    def optimizer_bytes(self, numels: list[int], setup: Setup) -> int:
        """AdamW moments (fp32 or 8-bit), step counters and fp32 master weights; ZeRO-1 keeps one dp shard of each bucket."""
        master = 0 if self.dtype == torch.float32 else 4
        if not setup.zero1:
            return sum(master * n + self._moments(n, setup) + STEP_BYTES for n in numels)
        total = 0
        for n, segments in self.buckets(numels):
            chunk = n // self.cfg.dp
            # one step counter per (parameter, shard) piece; dp rank 0's shard
            pieces = sum(1 for sg in segments if sg.offset < chunk)
            total += master * chunk + self._moments(chunk, setup) + STEP_BYTES * pieces
        return total

    # ---- activations

    def policy(self, setup: Setup) -> ActivationPolicy:
        """The activation policy agoq's trainer builds for this configuration."""
        if not setup.activations:
            return make_policy("bf16")
        spec = self.fmt.name
        recompute = loss_recompute_needed(self.cfg.pp)
        return make_policy("agoq", overrides={k: spec for k in ("norm_input", "act_input", "out_proj_input")}, loss_recompute=recompute)

    def layer_bytes(self, policy: ActivationPolicy, bits: int) -> int:
        """What one decoder layer keeps for one micro-batch on one tp rank at ``bits``."""
        return stage_saved_bytes(self.m, policy, range(1), False, bits, self.cfg.micro_batch, self.seq_tp, self.dtype)

    @cached_property
    def final_norm_bytes(self) -> int:
        """The final RMSNorm's saved input and rstd (one of a baseline layer's two norms)."""
        c = self.m
        kinds = layer_saved_bytes(
            self.cfg.micro_batch, self.seq_tp, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate, self.dtype, LayerPrecision()
        )
        return kinds["norm_input"] // 2

    @property
    def hidden_bytes(self) -> int:
        """One micro-batch's [tokens, hidden] tensor on one tp rank (1U / tp)."""
        return self.tokens_tp * self.m.hidden * self.es

    def stage_bytes(self, stage: int, policy: ActivationPolicy, bits: int, recompute: int) -> tuple[int, int]:
        """(saved for backward, pipeline buffers) of one in-flight micro-batch on a stage."""
        layers = self.ranges[stage]
        last = stage == self.num_stages - 1
        saved = stage_saved_bytes(self.m, policy, layers, last, bits, self.cfg.micro_batch, self.seq_tp, self.dtype, tp=self.cfg.tp)
        k = min(recompute, len(layers))
        if k:
            # A recomputed layer keeps only its input (Megatron's block recomputation).
            saved -= k * (self.layer_bytes(policy, bits) - self.hidden_bytes)
        if stage == 0:
            saved += self.tokens * INDEX_BYTES  # the embedding keeps the token ids
        if last:
            saved += self.final_norm_bytes
        buffers = 0
        quantized_input = policy.layer(0).norm_input is not None and bits < 16
        if stage > 0 and quantized_input:
            buffers += self.hidden_bytes  # the received input, which the first layer no longer keeps itself
        if not last and self.cfg.pp > 1:
            buffers += self.hidden_bytes  # torch.distributed.pipelining keeps each stage output until its backward
        return saved, buffers

    def rope_bytes(self, rank: int) -> int:
        """The fp32 cos/sin tables every stage module keeps once, shared by its layers and micro-batches."""
        return len(self.rank_stages[rank]) * 2 * self.cfg.seq_len * self.m.head_dim * 4

    def peaks(self, weights: list[int]) -> list[int]:
        """Each rank's peak over one step of in-flight bytes, stage s weighing weights[s] per micro-batch."""
        if self.order is None:
            return [sum(weights)]
        return peak_inflight_bytes(self.order, weights)

    # ---- temporaries (estimates)

    def _compute_work_bytes(self, rank: int, setup: Setup, bits: list[int], recompute: int, policy: ActivationPolicy) -> int:
        """The largest working set of a rank's forward and backward compute: a layer's fused backward
        (plus the recomputed layer's activations) or, on the last stage, the loss's."""
        m, es = self.m, self.es
        fp32_values, dtype_values = SWIGLU_BACKWARD_VALUES["quantized" if setup.activations else "baseline"]
        if setup.activations:
            # The fused backward works a chunk of rows at a time beside its two whole outputs.
            rows = chunk_rows(self.tokens_tp, m.intermediate, self.fmt.block_size, self.device, SWIGLU_CHUNK_VALUES)
            swiglu = rows * m.intermediate * (4 * fp32_values + es * dtype_values) + 2 * self.tokens_tp * m.intermediate * es
            # Then the fused norm + gate/up backward: those two gradients, the two weight gradients
            # it returns, and the norm's fp32 recompute and backward (about six [rows, hidden] of
            # the chunk of rows it works on).
            norm_rows = chunk_rows(self.tokens_tp, m.hidden, self.fmt.block_size, self.device, NORM_CHUNK_VALUES)
            norm_gate_up = 2 * (self.tokens_tp + m.hidden) * m.intermediate * es + 6 * norm_rows * m.hidden * 4
            swiglu = max(swiglu, norm_gate_up)
        else:
            swiglu = self.tokens_tp * m.intermediate * (4 * fp32_values + es * dtype_values)
        worst = 0
        for s, b in zip(self.rank_stages[rank], bits):
            layer = swiglu
            if recompute and len(self.ranges[s]):
                layer += self.layer_bytes(policy, b)  # the recomputed layer's activations, during its backward
            worst = max(worst, layer)
            if s == self.num_stages - 1:
                if policy.fused_loss:
                    rows = min(self.tokens, default_chunk_size(self.vocab_tp, m.hidden))
                    loss = rows * self.vocab_tp * (4 + 2 * es)  # a chunk's logits, fp32 log-probs and gradient
                else:
                    loss = self.tokens * self.vocab_tp * (4 + es)  # fp32 gradient of the log-softmax and its cast
                worst = max(worst, loss)
        return worst

    def temporary_bytes(self, rank: int, numels: list[int], setup: Setup, bits: list[int], recompute: int, policy: ActivationPolicy) -> int:
        """The largest transient working set of a rank: the worst of its step's three phases.

        The trainer counts the same three (agoq.train.saved.StepAllocations): forward and backward,
        the gradient reduction, and the optimizer step; tests/test_plan_train.py checks this bound
        against its measurements.
        """
        es, dp = self.es, self.cfg.dp
        worst = self._compute_work_bytes(rank, setup, bits, recompute, policy)
        p2p = 2 * self.hidden_bytes if self.cfg.pp > 1 else 0  # send and receive buffers
        largest = max(numels)
        # Backward: autograd's full-precision gradient of the largest tensor before it is folded into
        # the gradient buffer (into 8 bits a piece at a time), besides a layer's or the loss's work.
        folding = largest * es
        if setup.gradients:
            # A piece being folded: the stored values dequantized, the sum, and the quantizer's work.
            folding += 3 * 4 * min(FOLD_PIECE, largest)
        reduction = optimizer = 0
        fmt8 = QuantFormat("int", 8, self.cfg.gradient_block)
        buckets = self.bucket_sizes(rank)
        bucket = max(buckets)
        chunk = bucket // dp
        in_flight = 0
        if setup.gradients and dp > 1:
            in_flight = 2 * fmt8.nbytes(bucket)  # two buckets' 8-bit rows on the wire (sent, received or gathered)
            # One bucket reduced a piece at a time: the chunk's requantized bytes to send, and one
            # piece summed in fp32 and requantized (the fp32 values and integer codes the quantizer
            # works on), beside the buckets in flight. A ZeRO-1 reduce-scatter keeps its fp32 shards (below).
            reduction = in_flight + fmt8.nbytes(chunk) + 9 * min(reduce_piece(self.device), chunk)
        # A bucket is sent once the gradient that completed it is folded and dropped, so the buckets
        # in flight and the full-precision gradient being folded are not held at once; a rank's
        # only bucket is sent after its last layer's backward, others during a later layer's.
        beside = worst if len(buckets) > 1 else 0
        backward = p2p + max(worst + folding, in_flight + beside)
        if setup.zero1:
            # Every bucket's fp32 shard of the reduced gradient waits for the optimizer step, which
            # then all-gathers one bucket's updated weights in the compute dtype.
            shards = 4 * sum(n // dp for n in buckets)
            reduction = max(reduction, shards)
            optimizer = shards + es * (bucket + chunk)
        elif setup.gradients:
            # Gradients read back from 8 bits in fp32 for one group of parameters (at most
            # STEP_GROUP_BYTES, or the largest tensor alone), dequantized in place.
            optimizer = max(STEP_GROUP_BYTES, 4 * largest)
        if setup.optimizer:
            optimizer += ADAM_MOMENTS * 4 * largest  # one tensor's moments dequantized for its update
        return max(backward, reduction, optimizer)

    # ---- iteration time (estimate)

    def rank_time(self, rank: int, setup: Setup, recompute: int, policy: ActivationPolicy, bits: list[int] | None = None) -> float:
        """Forward-equivalent work of one micro-batch on a rank, in units of one token's GEMM FLOPs."""
        m = self.m
        per_layer_params = sum(self.layer_numels) * self.cfg.tp
        layer = 2 * per_layer_params + 2 * self.cfg.seq_len * m.hidden  # GEMMs + causal attention, per token
        head = 2 * m.vocab_size * m.hidden
        fwd_bwd = 1 + BACKWARD_OVER_FORWARD
        total = 0.0
        for s in self.rank_stages[rank]:
            quantized = setup.activations and (bits is None or bits[s] < 16)
            quant = (QUANT_OVERHEAD[0] + BACKWARD_OVER_FORWARD * QUANT_OVERHEAD[1]) if quantized else 0.0
            n = len(self.ranges[s])
            total += n * layer * (fwd_bwd + quant) + min(recompute, n) * layer
            if s == self.num_stages - 1:
                total += head * fwd_bwd + (head if policy.fused_loss and policy.loss_recompute else 0)
        return total

    # ---- one configuration

    def dbca_bits(self, policy: ActivationPolicy) -> list[int]:
        """Per-stage bits from the trainer's DBCA function (uniform base bits at pp = 1, as the trainer does)."""
        if self.cfg.pp == 1 or self.cfg.stage_bits == "uniform":
            return [self.fmt.bits] * self.num_stages
        layer_bits = stage_layer_bits(
            self.m,
            self.layout,
            self.cfg.micro_batch,
            self.seq_tp,
            policy,
            self.fmt.bits,
            dtype=self.dtype,
        )
        return [layer_bits[r.start] for r in self.ranges]

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one planner per plan; the bucket layout is costly for 70B)
    def bucket_sizes(self, rank: int) -> tuple[int, ...]:
        """Padded value counts of a rank's gradient buckets."""
        return tuple(n for n, _ in self.buckets(self.rank_numels(rank)))

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one planner per plan; the bucket layout is costly for 70B)
    def states(self, rank: int, setup: Setup) -> tuple[list[int], tuple[int, int, int]]:
        """A rank's parameter numels and its (parameter, gradient, optimizer) bytes, which no bit width changes."""
        numels = self.rank_numels(rank)
        return numels, (self.parameter_bytes(numels), self.gradient_bytes(numels, setup), self.optimizer_bytes(numels, setup))

    def rank_memory(self, rank: int, setup: Setup, policy: ActivationPolicy, stage_bits: list[int], recompute: int) -> RankMemory:
        """One rank's bytes with the given per-stage bits and recompute count."""
        numels, (params, grads, optim) = self.states(rank, setup)
        saved, buffers = zip(*(self.stage_bytes(s, policy, stage_bits[s], recompute) for s in range(self.num_stages)))
        saved_peak = self.peaks(list(saved))[rank] + self.rope_bytes(rank)
        both_peak = self.peaks([a + b for a, b in zip(saved, buffers)])[rank] + self.rope_bytes(rank)
        mine = self.rank_stages[rank]
        rm = RankMemory(
            pp_rank=rank,
            stages=tuple(mine),
            layers=sum(len(self.ranges[s]) for s in mine),
            bits=tuple(stage_bits[s] for s in mine) if setup.activations else None,
            inflight=self.inflight[rank],
            recompute_layers=recompute,
            parameters=params,
            gradients=grads,
            optimizer=optim,
            activations_per_microbatch=sum(saved[s] for s in mine),
            activations_peak=saved_peak,
            pipeline_buffers=both_peak - saved_peak,
            temporary=self.temporary_bytes(rank, numels, setup, [stage_bits[s] for s in mine], recompute, policy),
            total_without_recompute=0,
        )
        return rm

    @cached_property
    def layer_units(self) -> dict[str, float]:
        """Saved bytes of one decoder layer in U (batch x seq x hidden x 2 bytes), without tp: baseline and 4-bit."""
        unit = U_bytes(self.cfg.micro_batch, self.cfg.seq_len, self.m.hidden)
        out = {}
        for name, setup in (("baseline", Setup()), ("A", Setup(activations=True))):
            p = self.policy(setup)
            b = stage_saved_bytes(self.m, p, range(1), False, self.fmt.bits, self.cfg.micro_batch, self.cfg.seq_len, self.dtype)
            out[name] = round(b / unit, 4)
        return out


# ---- the configuration search: bits and recompute per configuration, on the accounting above


def _plan_setup(acc: PlanAccounting, setup: Setup, budget_mode: bool) -> tuple[SetupPlan, list[float]]:
    """The plan of one configuration, and its per-rank times (for the relative time)."""
    policy = acc.policy(setup)
    cap = acc.cfg.capacity
    base_bits = acc.fmt.bits
    if not setup.activations:
        bits = [16] * acc.num_stages
    elif budget_mode and cap is not None:
        bits = _budget_bits(acc, setup, policy, cap)
    else:
        bits = acc.dbca_bits(policy)
    plain = [acc.rank_memory(r, setup, policy, bits, 0) for r in range(acc.cfg.pp)]
    k: int | None = 0
    if acc.cfg.recompute_layers:
        k = acc.cfg.recompute_layers
        ranks = [acc.rank_memory(r, setup, policy, bits, k) for r in range(acc.cfg.pp)]
    elif cap is not None and any(r.total > cap for r in plain):
        # Megatron's recompute_num_layers is one count for every (virtual) stage: take the
        # smallest that fits every rank, with 4-bit stages where bits were raised.
        if setup.activations and budget_mode:
            bits = [base_bits] * acc.num_stages
        k = None
        for n in range(1, max(len(r) for r in acc.ranges) + 1):
            ranks = [acc.rank_memory(r, setup, policy, bits, n) for r in range(acc.cfg.pp)]
            if all(r.total <= cap for r in ranks):
                k = n
                break
        if k is None:
            n = max(len(r) for r in acc.ranges)
            ranks = [acc.rank_memory(r, setup, policy, bits, n) for r in range(acc.cfg.pp)]
    else:
        ranks = plain
    for r, p in zip(ranks, plain):
        r.total_without_recompute = p.total
    fits = None if cap is None else all(r.total <= cap for r in ranks)
    applied = k if k is not None else max(len(r) for r in acc.ranges)
    times = [acc.rank_time(r, setup, applied, policy, bits) for r in range(acc.cfg.pp)]
    return SetupPlan(setup, ranks, fits, k, 0.0), times


def _budget_bits(acc: PlanAccounting, setup: Setup, policy: ActivationPolicy, cap: int) -> list[int]:
    """Per stage, the highest bits (base..8, or 16) that keep its rank within the budget; base where none does."""
    base = acc.fmt.bits
    candidates = [b for b in BIT_CANDIDATES if b >= base]
    bits = [base] * acc.num_stages
    for rank in range(acc.cfg.pp):
        for b in reversed(candidates):
            trial = list(bits)
            for s in acc.rank_stages[rank]:
                trial[s] = b
            if acc.rank_memory(rank, setup, policy, trial, 0).total <= cap or b == base:
                bits = trial
                break
    return bits


def plan_memory(cfg: PlanConfig) -> Plan:
    """Per pp rank bytes of every configuration in cfg.setups, with recompute to fit and time estimates."""
    planner = PlanAccounting(cfg)
    budget_mode = cfg.memory_budget is not None
    results, times = [], {}
    for name in cfg.setups:
        setup = parse_setup(name)
        sp, t = _plan_setup(planner, setup, budget_mode)
        results.append(sp)
        times[setup.name] = t
    reference = max(planner.rank_time(r, Setup(), 0, planner.policy(Setup())) for r in range(cfg.pp))
    for sp in results:
        # A pipeline runs at the pace of its slowest rank.
        sp.relative_time = max(times[sp.setup.name]) / reference
    return Plan(cfg, results, tuple(planner.inflight), planner.layer_units)


def from_train_config(cfg: TrainConfig, vocab_size: int | None = None, **memory: object) -> PlanConfig:
    """The PlanConfig of an ``agoq train`` configuration (tp = 1), to predict what its ranks hold.

    ``vocab_size`` is the tokenizer's real vocabulary when it differs from data.vocab_size.
    """
    p, pr, d = cfg.parallel, cfg.precision, cfg.data
    dtype = pr.compute_dtype
    if dtype == "auto":
        # The dtype the trainer would pick on this machine (the same cached decision).
        from agoq.train.compute_dtype import compute_dtype_for, worker_threads

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = compute_dtype_for(cfg, device, worker_threads(cfg.world_size)).name
    if pr.activations not in ("bf16", "agoq"):
        raise PlanError(f"precision.activations={pr.activations!r} is not planned; the planner models bf16 and agoq")
    if pr.fused_loss is not None and pr.fused_loss != (pr.activations == "agoq"):
        raise PlanError(f"precision.fused_loss={pr.fused_loss} differs from the {pr.activations} default the planner models")
    model = cfg.model_config()
    if vocab_size is not None:
        model = replace(model, vocab_size=vocab_size)
    setup = Setup(pr.activations == "agoq", pr.gradients == "int8", cfg.optim.name == "adamw8bit", p.zero1)
    return PlanConfig(
        model=model,
        seq_len=d.seq_len,
        model_name=cfg.model.preset,
        tp=1,
        pp=p.pp,
        dp=p.dp,
        micro_batch=d.batch_size // (p.dp * p.microbatches),
        global_batch=d.batch_size,
        schedule=p.schedule,
        virtual_stages=p.virtual_stages,
        dtype=dtype,
        activation_format=pr.activation_format,
        gradient_block=pr.gradient_block,
        stage_bits=pr.stage_bits,
        recompute_layers=pr.recompute_layers or None,
        setups=(setup.name,),
        device="cuda" if torch.cuda.is_available() else "cpu",
        **memory,  # type: ignore[arg-type]
    )
