"""Whether a local run fits this machine: agoq plan's estimate of its processes' tensors against the
memory they share (or a GPU's), checked before any worker starts."""

from __future__ import annotations

import os

from agoq.plan.config import from_train_config
from agoq.plan.memory import plan_memory
from agoq.launch.config import ConfigError, TrainConfig


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
