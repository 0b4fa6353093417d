"""The optimizer's own settings, the `[optim]` section of a training config: the optimizer and
ZeRO-1 are built from this section alone (standard library only, so that reading a config imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimSection:
    """AdamW with warmup + cosine decay."""

    name: str = "adamw"  # torch fused AdamW, or torchao's 8-bit AdamW
    lr: float = 3e-3  # peak learning rate, after warmup
    min_lr: float = 3e-4  # end of the cosine decay
    warmup_steps: int = 20  # linear warmup from 0
    weight_decay: float = 0.1  # decoupled (AdamW), on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm over all pp and dp ranks; 0 disables
