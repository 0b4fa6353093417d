"""What ``agoq plan`` says of an ``agoq train`` configuration: its PlanConfig, and whether a local
run fits this machine (the planner's estimate of its processes' tensors against the memory they
share, or a GPU's), checked before any worker starts."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from agoq.launch.config import ConfigError, TrainConfig
from agoq.plan.config import PlanConfig, PlanError, Setup
from agoq.plan.memory import plan_memory


def from_train_config(cfg: TrainConfig, vocab_size: int | None = None, **memory: object) -> PlanConfig:
    """The PlanConfig of an ``agoq train`` configuration, to predict what its ranks hold.

    ``vocab_size`` is the tokenizer's real vocabulary when it differs from data.vocab_size.
    """
    p, pr, d = cfg.parallel, cfg.precision, cfg.data
    dtype = pr.compute_dtype
    if dtype == "auto":
        # The dtype the trainer would pick on this machine (the same rule).
        from agoq.launch.choices import compute_dtype_for

        dtype = compute_dtype_for(cfg, "cuda" if torch.cuda.is_available() else "cpu").name
    if pr.activations not in ("bf16", "agoq"):
        raise PlanError(f"precision.activations={pr.activations!r} is not planned; the planner models bf16 and agoq")
    if pr.fused_loss is not None and pr.fused_loss != (pr.activations == "agoq"):
        raise PlanError(f"precision.fused_loss={pr.fused_loss} differs from the {pr.activations} default the planner models")
    model = cfg.model_config()
    if vocab_size is not None:
        model = replace(model, vocab_size=vocab_size)
    if pr.gradients == "int4-ef":
        raise PlanError("precision.gradients='int4-ef' is not planned: its error-feedback residuals are not in the planner's accounting yet")
    # int4 sends the 8-bit buffer in 4 bits: what a rank holds is int8's.
    setup = Setup(pr.activations == "agoq", pr.gradients in ("int8", "int4"), cfg.optim.name == "adamw8bit", p.zero1)
    return PlanConfig(
        model=model,
        seq_len=d.seq_len,
        model_name=cfg.model.preset,
        tp=p.tp,
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


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg: TrainConfig) -> None:
    """ConfigError when the tensors of a local run's processes (agoq plan's estimate, which the
    trainer's own counts match within 5%) exceed this machine's memory, or a GPU's: such a run could
    only swap or be killed. Configurations the planner does not model are not checked."""
    import torch

    try:
        (setup,) = plan_memory(from_train_config(cfg)).setups
    except ValueError:  # PlanError: a configuration outside the planner's accounting
        return
    d, p = cfg.data, cfg.parallel
    shape = f"data.batch_size={d.batch_size} x data.seq_len={d.seq_len}"
    fix = "lower data.seq_len or data.batch_size, or raise parallel.microbatches"
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        per_gpu = -(-cfg.world_size // gpus) * setup.peak  # ranks beyond the GPU count share them
        have = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        if per_gpu > have:
            raise ConfigError(
                f"{shape} needs about {per_gpu / 2**30:.1f} GiB per GPU (agoq plan's estimate), more than its {have / 2**30:.1f} GiB; {fix}"
            )
        return
    # On the CPU every local process shares the machine's memory; replicas over dp and tp hold alike.
    need = sum(r.total for r in setup.ranks) * p.dp * p.tp
    have = machine_memory_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"{shape} needs about {need / 2**30:.1f} GiB over the {cfg.world_size} local processes (agoq plan's estimate), "
            f"more than this machine's {have / 2**30:.1f} GiB; {fix}"
        )
