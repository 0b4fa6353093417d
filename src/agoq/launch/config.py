"""Typed training configuration: dataclasses, a TOML file, and ``--section.key=value`` overrides.

Every value is checked before any process starts; a bad value stops with one line naming it and
the fix (:class:`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agoq.errors import ConfigError
from agoq.values import coerce, is_text, literal, parse_value
from agoq.models.config import PRESETS, LlamaConfig, get_config
from agoq.data.tokenizer import MIN_VOCAB_SIZE
from agoq.train.optim_section import OptimSection

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
ACTIVATION_POLICIES = ("bf16", "agoq", "uniform4")
GRADIENT_MODES = ("fp32", "bf16", "int8", "int4", "int4-ef", "hier-8/4")
# Ablations that were gradient modes: baselines now, measured by these benchmarks (from a checkout).
MOVED_GRADIENT_MODES = {"ring8": "python -m benchmarks.allreduce"}
STAGE_BITS_MODES = ("dbca", "uniform")
OPTIMIZERS = ("adamw", "adamw8bit")
DTYPES = ("auto", "bf16", "fp32")


@dataclass
class ModelSection:
    """Which architecture to train: a preset plus field overrides."""

    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)  # any LlamaConfig field, e.g. {n_layers = 8}


@dataclass
class ParallelSection:
    """Pipeline x data x tensor parallel layout and schedule."""

    pp: int = 2  # pipeline stages (ranks per pipeline)
    dp: int = 2  # data-parallel replicas
    tp: int = 1  # tensor-parallel ranks per stage, sequence parallel too (heads, kv heads, intermediate, vocab and seq_len divide by it)
    schedule: str = "1f1b"  # torch.distributed.pipelining schedule
    virtual_stages: int = 1  # model chunks per pp rank (interleaved-1f1b needs >= 2)
    microbatches: int = 4  # per pipeline per step
    zero1: bool = False  # shard optimizer state over dp (8-bit reduce-scatter + all-gather)
    node_size: int = 0  # dp ranks per node, for hier-8/4 and (at pp = tp = 1) the quantized all-gather across nodes (0: LOCAL_WORLD_SIZE, the launcher's ranks per host)


@dataclass
class PrecisionSection:
    """What AGoQ compresses: saved activations, gradients, and the compute dtype."""

    activations: str = "agoq"  # saved-activation policy: agoq (4-bit norm/SwiGLU inputs, bf16 attention), uniform4 (attention too), bf16
    activation_format: str = "int4/128"  # format of quantized saved tensors (int2..int8, fp4, nf4, fp8)
    stage_bits: str = "dbca"  # dbca: later pipeline stages get more bits at no peak cost; uniform
    gradients: str = "int8"  # int8 (QuanGrad buffer + 8-bit all-reduce) | int4 / int4-ef (the same buffer sent in 4 bits, -ef: with error feedback) | hier-8/4 (two hops: int8 within a node, int4 between nodes) | fp32 | bf16 all-reduce
    gradient_block: int = 256  # values per scale of the 8-bit gradient buffer and wire format
    fused_loss: bool | None = None  # default: on for agoq/uniform4, off for bf16
    # auto: bf16 on GPUs, and on CPUs only where bf16 measures faster (agoq.launch.choices);
    # bf16 | fp32 force one. Master weights are always fp32.
    compute_dtype: str = "auto"
    # How quantization runs (agoq.quant.backend). auto: Triton on GPUs; on CPUs the compiled path for runs long enough to repay compiling, else eager torch
    # (the environment variable AGOQ_QUANT_BACKEND, if set, decides instead).
    quant_backend: str = "auto"
    recompute_layers: int = 0  # activation checkpointing of the first N decoder layers of each stage (the baseline's way to fit)
    checkpoint_format: str = "none"  # none: recomputed layers keep their input in the compute dtype; int8/128: compressed checkpoints


@dataclass
class DataSection:
    """Corpus, tokenizer and batch shape."""

    corpus: str = "kjv"  # 'kjv' or a .txt/.jsonl file or folder
    tokenizer: str | None = None  # a tokenizer.json; default: train a byte-level BPE on the corpus
    vocab_size: int = 4096  # of the BPE tokenizer trained on the corpus, and the model's embedding rows (with a tokenizer file: its vocabulary)
    seq_len: int = 128  # tokens per sequence
    batch_size: int = 16  # sequences per step, over all dp ranks
    val_fraction: float = 0.01  # of the corpus held out for validation
    cache_dir: str | None = None  # tokenizer and token files; default: $AGOQ_CACHE_DIR, else ~/.cache/agoq


@dataclass
class TrainSection:
    """Length, seed, evaluation and output."""

    steps: int = 200  # optimizer steps
    seed: int = 0  # of the initial weights and the data order, 0 .. 2**32 - 1
    log_every: int = 10  # steps between progress lines where there is no progress bar (every step goes to metrics/)
    eval_every: int = 100  # steps between validation passes (and at the end); 0 disables
    eval_batches: int = 4  # validation batches per pass
    out_dir: str = "runs/default"  # metrics, summary, plot and checkpoints of the run
    baseline: bool = True  # also measure the bf16 configuration's memory and wire bytes for the summary
    max_skipped_steps: int = 10  # stop the run after this many consecutive steps with a non-finite loss or gradient
    # torch.compile each decoder layer with fullgraph=True, as torchtitan compiles its blocks: the fused
    # ops are custom ops (one graph node each), so a block is one graph; the first steps pay the compile.
    compile: bool = False


@dataclass
class CheckpointSection:
    """Distributed checkpoints (torch.distributed.checkpoint), written atomically."""

    every: int = 100  # steps; 0 disables
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # continue from the latest checkpoint in out_dir/checkpoints
    # With resume=false: delete out_dir/checkpoints before training (without it, a fresh run into a
    # folder with checkpoints is refused, so that two runs' checkpoints never mix).
    overwrite: bool = False
    trust_unverified: bool = False  # load a checkpoint whose manifest.json is missing or lacks a file's SHA-256 (refused otherwise)


@dataclass
class TrainConfig:
    """The whole configuration of one training run."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    @property
    def world_size(self) -> int:
        """Processes the run needs: pp x dp x tp."""
        return self.parallel.pp * self.parallel.dp * self.parallel.tp

    def model_config(self) -> LlamaConfig:
        """The LLaMA architecture trained: the preset, its overrides, and the tokenizer's vocabulary
        (data.vocab_size, or the vocabulary of the data.tokenizer file); max_seq_len is the preset's
        unless model.overrides sets it (validate refuses a data.seq_len beyond it)."""
        overrides = dict(self.model.overrides)
        overrides["vocab_size"] = _tokenizer_vocab(self.data)
        try:
            return get_config(self.model.preset, **overrides)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def uses_validation(self) -> bool:
        """Whether the run reads the validation split: for evaluation, or for the bf16 baseline's batch."""
        return bool(self.train.eval_every) or (self.train.baseline and self.precision.activations != "bf16")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (TOML/JSON-able)."""
        return dataclasses.asdict(self)


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _tokenizer_vocab(d: DataSection) -> int:
    """The vocabulary the model's embedding has one row per id of: data.vocab_size for the BPE
    trained on the corpus (which may hold fewer tokens on a small corpus: their rows stay unused),
    else the data.tokenizer file's."""
    if d.tokenizer is None:
        return d.vocab_size
    if not Path(d.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is not a file; pass a tokenizer.json or leave it unset to train one")
    from agoq.data.tokenizer import tokenizer_vocab_size

    try:
        return tokenizer_vocab_size(d.tokenizer)
    except Exception as e:  # tokenizers raises its own exception types for a file it cannot parse
        raise ConfigError(
            f"data.tokenizer={d.tokenizer!r} is not a tokenizer file that loads ({str(e).splitlines()[0][:120]}); pass a Hugging Face tokenizer.json"
        ) from None


def _model_overrides(cfg: TrainConfig) -> None:
    """Every model override names a LlamaConfig field of the right type, other than vocab_size (the tokenizer's)."""
    fields = typing.get_type_hints(LlamaConfig)
    settable = [f for f in fields if f != "vocab_size"]
    for key, value in cfg.model.overrides.items():
        if key == "vocab_size":
            raise ConfigError(
                f"model.vocab_size={value!r} cannot be set: the model has one embedding row per id of the tokenizer; "
                f"set data.vocab_size=N instead (the BPE trained on the corpus, N >= {MIN_VOCAB_SIZE}) or pass a data.tokenizer file"
            )
        if key not in fields:
            raise ConfigError(f"model.overrides has unknown field {key!r}; valid fields: {', '.join(settable)}")
        coerced = coerce(value, fields[key], f"model.{key}")
        if type(coerced) is not type(value) and not (fields[key] is float and type(value) is int):
            raise ConfigError(f"model.{key}={value!r} has the wrong type; expected {fields[key].__name__}")


def _apply(cfg: TrainConfig, section: str, key: str, value: Any, *, parse_literal: bool) -> None:
    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}]; sections: {', '.join(sections)}")
    obj = getattr(cfg, section)
    if section == "model" and key not in ("preset", "overrides"):
        # [model] accepts architecture fields directly: model.n_layers=8.
        if key not in LlamaConfig.__dataclass_fields__:
            raise ConfigError(f"unknown model field model.{key}; valid: preset, {', '.join(LlamaConfig.__dataclass_fields__)}")
        ftype = typing.get_type_hints(LlamaConfig)[key]
        obj.overrides[key] = parse_value(value, ftype, f"model.{key}") if parse_literal else coerce(value, ftype, f"model.{key}")
        return
    field_types = _section_types(type(obj))
    if key not in field_types:
        raise ConfigError(f"unknown config key {section}.{key}; valid keys: {', '.join(field_types)}")
    if parse_literal and not is_text(field_types[key]):
        value = literal(value)
    value = coerce(value, field_types[key], f"{section}.{key}")
    if section == "model" and key == "overrides":
        # Typed like model.FIELD=value: a table's values are coerced to their fields' types.
        hints = typing.get_type_hints(LlamaConfig)
        value = {k: coerce(v, hints[k], f"model.{k}") if k in hints else v for k, v in value.items()}
    setattr(obj, key, value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file (if any), then ``section.key=value`` overrides; validated."""
    cfg = read_config(path, overrides)
    validate(cfg)
    return cfg


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """:func:`load_config` before its validation, which imports torch: what the launcher reads to
    start its fork server while it imports the rest. ConfigError for a file or override that does
    not parse."""
    cfg = TrainConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing .toml file or omit it for the defaults")
        try:
            # utf-8-sig: Windows editors begin a UTF-8 file with a byte-order mark, which TOML's grammar lacks.
            data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte offset {e.start}); save it as UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _apply(cfg, section, key, value, parse_literal=False)
    for item in overrides or []:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} must look like --section.key=value (e.g. --train.steps=50)")
        dotted, value = text.split("=", 1)
        section, key = dotted.split(".", 1)
        _apply(cfg, section, key, value, parse_literal=True)
    return cfg


# The seeds numpy's and torch's generators all accept, with room for the per-parameter offsets
# (agoq.models.llama.Llama.reset_parameters multiplies the seed by 1,000,003 within 64 bits).
MAX_SEED = 2**32 - 1

# (key, smallest allowed value, what the limit means) of the plain numeric lower bounds.
MINIMUMS = (
    ("optim.weight_decay", 0, ""),
    ("optim.grad_clip", 0, " (0 disables clipping)"),
    ("optim.warmup_steps", 0, ""),
    ("train.steps", 1, ""),
    ("train.eval_every", 0, " (0 disables evaluation)"),
    ("train.eval_batches", 1, ""),
    ("train.max_skipped_steps", 1, ""),
    ("train.log_every", 1, ""),
)


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError for the first value that cannot work, section by section."""
    if cfg.model.preset not in PRESETS:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is unknown; use one of {', '.join(PRESETS)}")
    _model_overrides(cfg)
    d = cfg.data
    if d.corpus != "kjv" and not Path(d.corpus).expanduser().exists():
        raise ConfigError(f"data.corpus={d.corpus!r} does not exist; pass a .txt/.jsonl file or folder, or 'kjv'")
    mc = cfg.model_config()  # loads data.tokenizer, if set, for its vocabulary
    _validate_parallel(cfg.parallel, mc)
    _validate_data(cfg.data, cfg.parallel)
    _validate_model(cfg, mc)
    _validate_precision(cfg.precision, cfg.parallel, cfg.optim)
    _validate_optim(cfg.optim, mc)
    _validate_sizes(cfg)
    _validate_compile(cfg)


def _validate_compile(cfg: TrainConfig) -> None:
    """What train.compile combines with: every op a block runs must be traceable in one graph."""
    if not cfg.train.compile:
        return
    if cfg.precision.activations == "uniform4":
        raise ConfigError(
            "train.compile=true cannot trace precision.activations=uniform4: its quantized attention keeps SDPA's saved tensors "
            "through saved_tensors_hooks, which torch.compile does not capture; use activations=agoq or bf16, or train.compile=false"
        )


def _validate_model(cfg: TrainConfig, mc: LlamaConfig) -> None:
    """The architecture against the data and the layout: context length, norm epsilon, recomputed layers, vocabulary."""
    d, p, pr = cfg.data, cfg.parallel, cfg.precision
    if d.seq_len > mc.max_seq_len:
        if "max_seq_len" in cfg.model.overrides:
            raise ConfigError(
                f"data.seq_len={d.seq_len} exceeds model.max_seq_len={mc.max_seq_len}; lower data.seq_len or set --model.overrides={{max_seq_len={d.seq_len}}}"
            )
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model {cfg.model.preset}'s max_seq_len={mc.max_seq_len}; lower data.seq_len, "
            f"or train the model at that context with --model.overrides={{max_seq_len={d.seq_len}}}"
        )
    if not math.isfinite(mc.norm_eps) or mc.norm_eps <= 0:
        raise ConfigError(f"model.norm_eps={mc.norm_eps} must be a finite number > 0 (RMSNorm divides by sqrt(mean + eps); 1e-5 is usual)")
    stages = p.pp * p.virtual_stages
    per_stage = mc.n_layers // stages
    if pr.recompute_layers > per_stage:
        raise ConfigError(
            f"precision.recompute_layers={pr.recompute_layers} exceeds the {per_stage} decoder layers of each pipeline stage "
            f"(model.n_layers={mc.n_layers} over parallel.pp x parallel.virtual_stages = {stages}); use at most {per_stage}"
        )
    default_vocab = DataSection().vocab_size
    if d.tokenizer is not None and d.vocab_size not in (default_vocab, mc.vocab_size):
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} is not used with data.tokenizer={d.tokenizer!r}, whose vocabulary is {mc.vocab_size}; "
            f"drop data.vocab_size or set it to {mc.vocab_size}"
        )


def _validate_parallel(p: ParallelSection, mc: LlamaConfig) -> None:
    """The mesh, schedule and micro-batches against the model's layers."""
    for name in ("pp", "dp", "tp", "virtual_stages", "microbatches"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={p.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if p.schedule == "interleaved-1f1b" and p.virtual_stages < 2:
        raise ConfigError("parallel.schedule='interleaved-1f1b' needs parallel.virtual_stages >= 2; set it to 2 or use '1f1b'")
    if p.schedule != "interleaved-1f1b" and p.virtual_stages != 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule='interleaved-1f1b'")
    stages = p.pp * p.virtual_stages
    if mc.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={mc.n_layers} is not divisible by parallel.pp x parallel.virtual_stages = {stages}; "
            "choose a layer count or pp that divides it"
        )
    if p.pp > 1 and p.schedule in ("1f1b", "interleaved-1f1b") and p.microbatches < p.pp:
        raise ConfigError(
            f"parallel.microbatches={p.microbatches} is fewer than parallel.pp={p.pp}; schedule {p.schedule} needs at least pp micro-batches"
        )
    if p.schedule == "interleaved-1f1b" and p.microbatches % p.pp:
        raise ConfigError(f"parallel.microbatches={p.microbatches} must be a multiple of parallel.pp={p.pp} for interleaved-1f1b")
    if mc.tie_embeddings and p.pp > 1:
        raise ConfigError("model.tie_embeddings=true is not supported with parallel.pp > 1; set model.tie_embeddings=false")
    if p.tp > 1:
        from agoq.parallel.tensor_model import check_tp_shapes

        try:
            check_tp_shapes(mc, p.tp)
        except ValueError as e:
            raise ConfigError(f"parallel.tp={p.tp}: {e}") from None


def _validate_data(d: DataSection, p: ParallelSection) -> None:
    """Batch, sequence, corpus and tokenizer."""
    if d.batch_size < 1:
        raise ConfigError(f"data.batch_size={d.batch_size} must be >= 1")
    if d.batch_size % (p.dp * p.microbatches):
        raise ConfigError(
            f"data.batch_size={d.batch_size} is not divisible by parallel.dp x parallel.microbatches = {p.dp * p.microbatches}; "
            f"use a multiple of {p.dp * p.microbatches}"
        )
    if d.seq_len < 2:
        raise ConfigError(f"data.seq_len={d.seq_len} must be at least 2")
    if d.seq_len % p.tp:
        raise ConfigError(
            f"data.seq_len={d.seq_len} is not divisible by parallel.tp={p.tp}; sequence parallelism gives each tp rank seq_len / tp tokens"
        )
    if not 0 < d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")
    # data.corpus and data.tokenizer are checked first, in validate (the vocabulary is the tokenizer's).


def _validate_precision(pr: PrecisionSection, p: ParallelSection, o: OptimSection) -> None:
    """Policies, formats, backends, and what ZeRO-1 combines with."""
    if pr.activations not in ACTIVATION_POLICIES:
        raise ConfigError(f"precision.activations={pr.activations!r} is unknown; use one of {', '.join(ACTIVATION_POLICIES)}")
    if pr.stage_bits not in STAGE_BITS_MODES:
        raise ConfigError(f"precision.stage_bits={pr.stage_bits!r} is unknown; use one of {', '.join(STAGE_BITS_MODES)}")
    if pr.gradients in MOVED_GRADIENT_MODES:
        where = MOVED_GRADIENT_MODES[pr.gradients]
        raise ConfigError(
            f"precision.gradients={pr.gradients!r} is a baseline now, moved to `{where}`; train with one of {', '.join(GRADIENT_MODES)}"
        )
    if pr.gradients not in GRADIENT_MODES:
        raise ConfigError(f"precision.gradients={pr.gradients!r} is unknown; use one of {', '.join(GRADIENT_MODES)}")
    if pr.recompute_layers < 0:
        raise ConfigError(f"precision.recompute_layers={pr.recompute_layers} must be >= 0")
    if pr.gradients == "hier-8/4":
        if p.pp > 1 or p.tp > 1 or p.zero1:
            raise ConfigError(
                "precision.gradients='hier-8/4' needs parallel.pp=1, parallel.tp=1 and parallel.zero1=false (its node groups span the dp group); use int4-ef there"
            )
        if p.node_size < 0 or (p.node_size and p.dp % p.node_size):
            raise ConfigError(f"parallel.node_size={p.node_size} must divide parallel.dp={p.dp} (ranks per node; 0 reads LOCAL_WORLD_SIZE)")
    if p.node_size < 0 or (0 < p.node_size < p.dp and p.dp % p.node_size):
        raise ConfigError(f"parallel.node_size={p.node_size} must divide parallel.dp={p.dp} (ranks per node; 0 reads LOCAL_WORLD_SIZE)")
    if pr.checkpoint_format not in ("none", "bf16") and not pr.recompute_layers:
        raise ConfigError(
            f"precision.checkpoint_format={pr.checkpoint_format!r} is the format of recomputed layers' inputs, but precision.recompute_layers=0; "
            "set precision.recompute_layers to the layers per stage to checkpoint"
        )
    if pr.recompute_layers and p.tp > 1:
        raise ConfigError(f"precision.recompute_layers={pr.recompute_layers} is not supported with parallel.tp > 1; set it to 0")
    from agoq.quant.backend import BACKENDS

    if pr.quant_backend not in BACKENDS:
        raise ConfigError(f"precision.quant_backend={pr.quant_backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if pr.compute_dtype not in DTYPES:
        raise ConfigError(f"precision.compute_dtype={pr.compute_dtype!r} is unknown; use auto, bf16 or fp32")
    from agoq.gradient.collectives import int8_gradient_format
    from agoq.quant import parse_format

    for key, check in (
        ("activation_format", lambda: parse_format(pr.activation_format)),
        ("checkpoint_format", lambda: pr.checkpoint_format in ("none", "bf16") or parse_format(pr.checkpoint_format)),
        ("gradient_block", lambda: int8_gradient_format(pr.gradient_block)),
    ):
        try:
            check()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"precision.{key}={getattr(pr, key)!r} is invalid: {e}") from None
    if p.zero1 and p.dp == 1:
        # One replica has nothing to shard over: the planner shows such a run as the unsharded one.
        raise ConfigError("parallel.zero1=true shards optimizer state over the dp ranks, but parallel.dp=1; set parallel.dp >= 2 or drop zero1")
    if p.zero1 and o.name == "adamw8bit":
        raise ConfigError("parallel.zero1=true shards AdamW's fp32 state; it does not support optim.name='adamw8bit' (use one or the other)")
    if p.zero1 and pr.gradients == "bf16":
        raise ConfigError(f"parallel.zero1=true works with precision.gradients = int8 or fp32, not {pr.gradients}")


def _validate_optim(o: OptimSection, mc: LlamaConfig) -> None:
    """The optimizer's name and every hyperparameter's range (finite first)."""
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={o.name!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    # Finite first: NaN compares false with everything, so the range checks below would let it pass.
    for key in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
        value = getattr(o, key)
        if not math.isfinite(value):
            raise ConfigError(f"optim.{key}={value} must be a finite number")
    if not math.isfinite(mc.rope_theta) or mc.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta={mc.rope_theta} must be a finite number > 0")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.lr={o.lr} and optim.min_lr={o.min_lr} must satisfy 0 <= min_lr <= lr, lr > 0")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optim.{key}={getattr(o, key)} must be in [0, 1) (AdamW's moment decay; 0.9 and 0.95 are usual)")
    if o.eps <= 0:
        raise ConfigError(f"optim.eps={o.eps} must be > 0 (it keeps AdamW's division finite; 1e-8 is usual)")


def _validate_sizes(cfg: TrainConfig) -> None:
    """Counts with a minimum, the vocabulary, the output folder and checkpoints."""
    d, t = cfg.data, cfg.train
    for key, least, why in MINIMUMS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value < least:
            raise ConfigError(f"{key}={value} must be >= {least}{why}")
    if d.vocab_size < MIN_VOCAB_SIZE and d.tokenizer is None:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} must be at least {MIN_VOCAB_SIZE}: the trained byte-level BPE holds 256 bytes and its end-of-document token"
        )
    if not 0 <= t.seed <= MAX_SEED:
        raise ConfigError(f"train.seed={t.seed} is out of range; use an integer from 0 to {MAX_SEED} (2**32 - 1)")
    if not t.out_dir.strip():
        raise ConfigError("train.out_dir is empty; name a folder, e.g. --train.out_dir=runs/NAME")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
    if cfg.checkpoint.overwrite and cfg.checkpoint.resume:
        raise ConfigError(
            "checkpoint.overwrite=true deletes the run's checkpoints and starts over, so it needs --checkpoint.resume=false "
            "(or drop overwrite to continue from them)"
        )


# ---- help and printing ------------------------------------------------------------------------


def _allowed() -> dict[str, tuple[str, ...]]:
    from agoq.quant.backend import BACKENDS

    return {
        "model.preset": tuple(PRESETS),
        "parallel.schedule": SCHEDULES,
        "precision.activations": ACTIVATION_POLICIES,
        "precision.gradients": GRADIENT_MODES,
        "precision.stage_bits": STAGE_BITS_MODES,
        "precision.compute_dtype": DTYPES,
        "precision.quant_backend": BACKENDS,
        "optim.name": OPTIMIZERS,
    }


def _field_notes(section_cls: type) -> dict[str, str]:
    """Each field's comment in this file (trailing, else the comment lines just above it): the one place they are written."""
    import inspect
    import re

    try:
        lines = inspect.getsource(section_cls).splitlines()
    except (OSError, TypeError):
        return {}
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
            continue
        m = re.match(r"(\w+): [^=]+=.*?(?:#\s*(.*))?$", text)
        if m:
            notes[m.group(1)] = m.group(2) or " ".join(above)
        above = []
    return notes


def config_help() -> str:
    """Every config key with its default, allowed values and meaning, generated from the dataclasses."""
    allowed = _allowed()
    default = TrainConfig()
    out = ["config keys (set in a TOML file or as --section.key=value; defaults shown):"]
    for section in dataclasses.fields(TrainConfig):
        cls = type(getattr(default, section.name))
        notes = _field_notes(cls)
        out.append(f"  [{section.name}] {(cls.__doc__ or '').strip()}")
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            value = getattr(getattr(default, section.name), f.name)
            line = f"    {key} = {_toml_value(value) if value is not None else '(unset)'}"
            if key in allowed:
                line += f"  [{' | '.join(allowed[key])}]"
            note = notes.get(f.name)
            if note:
                line += f"  {note}"
            out.append(line)
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(cfg: TrainConfig) -> str:
    """The whole configuration as a TOML file that load_config reads back to an equal config (unset values omitted)."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                out.append(f"# {key} is unset (its default)")
            else:
                out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)
