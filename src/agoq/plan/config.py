"""What ``agoq plan`` plans: the training configuration (:class:`PlanConfig`, validated), which of
AGoQ's parts a memory configuration turns on (:class:`Setup`), and sizes as people write them. The
PlanConfig of an ``agoq train`` configuration is agoq.launch.planning.from_train_config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from agoq.models.config import PRESETS, LlamaConfig, get_config
from agoq.parallel.dbca import BIT_CANDIDATES
from agoq.parallel.pipeline import check_schedule, schedule_name, split_layers
from agoq.quant import parse_format

DEFAULT_SETUPS = ("baseline", "baseline+zero1", "A", "A+G", "A+G+O", "A+G+O+zero1")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class PlanError(ValueError):
    """A configuration that cannot be planned; the one-line message names the value and the fix."""


# ------------------------------------------------------------------------------ sizes


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


MAX_SIZE = 2**60  # 1 EiB: any memory size above is a typo
MAX_LAYERS = 4096  # the planner walks layers one by one; real models have at most a few hundred
# The planner replays torch's pipeline schedule, a few actions per micro-batch and stage; a real
# step has at most a few thousand micro-batches.
MAX_MICROBATCHES = 16384


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
    node_size: int = 8  # dp ranks per node, for the gradient bytes by link class
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

    def _check_node_size(self) -> None:
        """PlanError unless the dp ranks form whole nodes (a node size at or above dp: one node)."""
        if self.dp % min(self.node_size, self.dp):
            divisor = max(d for d in range(1, self.node_size) if self.dp % d == 0)
            raise PlanError(
                f"node-size={self.node_size} does not divide dp={self.dp}; give the dp ranks per node, a divisor of {self.dp} "
                f"(e.g. --node-size {divisor}) or at least {self.dp} for one node"
            )

    def validate(self) -> None:
        """Raise PlanError (one line) for a configuration that cannot run."""
        c = self.model
        for name in ("seq_len", "tp", "pp", "dp", "micro_batch", "gradient_block", "optimizer_block", "node_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"{name.replace('_', '-')}={v!r} must be a positive integer")
        self._check_node_size()
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
        if self.pp > 1 and self.microbatches > MAX_MICROBATCHES:
            raise PlanError(
                f"global-batch={gb} makes {self.microbatches} micro-batches per step, which cannot be planned (the limit is "
                f"{MAX_MICROBATCHES}); lower --global-batch or raise --micro-batch"
            )
        check_parameter_sizes(c, self.model_name)
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


def check_parameter_sizes(model: LlamaConfig, name: str = "custom") -> None:
    """Raise PlanError (one line) where one parameter tensor would hold more than MAX_SIZE bytes in fp32."""
    h = model.hidden
    tensors = (
        ("vocab_size", model.vocab_size * h, f"vocab_size={model.vocab_size} x hidden={h}"),
        ("intermediate", model.intermediate * h, f"intermediate={model.intermediate} x hidden={h}"),
        ("hidden", h * h, f"hidden={h} x hidden={h}"),
    )
    for field_name, numel, product in tensors:
        if 4 * numel > MAX_SIZE:
            raise PlanError(
                f"{name}: {product} = {numel:.3g} values in one parameter tensor, beyond any machine in fp32 "
                f"(the limit is 1 EiB); check --model-field {field_name}"
            )


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
