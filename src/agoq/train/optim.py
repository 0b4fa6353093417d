"""AdamW over fp32 master weights for a model computing in bf16, and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.optim.adamw import adamw

from agoq.quant.pieces import size_key
from agoq.train.optim_section import OptimSection

# fp32 gradient bytes handed to the optimizer per partial step: they are temporaries (read back from
# the 8-bit buffer). On a CPU the fused AdamW gains nothing from groups beyond a few MiB, and 2 MiB
# keeps the default run's read-back under its bf16 step's temporaries. A GPU group is larger so that
# the device is not left waiting on the host: by estimate (not measured on a GPU), AdamW's memory
# traffic for 64 MiB (28 bytes a value) lasts about as long as the host's Python work for one group.
STEP_GROUP_BYTES = {"cpu": 2 * 2**20, "device": 64 * 2**20}
# On a GPU a group also holds a whole decoder layer's gradients, up to this bound: the groups, and
# the launches each costs, then grow with the layers, not with the parameters (a wider model has
# fewer groups per value), and the temporaries stay within one layer's fp32 gradients.
STEP_GROUP_MAX_BYTES = 2**30


def step_group_bytes(device: torch.device, layer_values: int = 0) -> int:
    """fp32 gradient bytes per partial optimizer step on ``device`` (see STEP_GROUP_BYTES);
    ``layer_values``: the parameters of the largest decoder layer the optimizer steps."""
    base = STEP_GROUP_BYTES[size_key(device)]
    if size_key(device) == "cpu":
        return base
    return min(max(base, 4 * layer_values), STEP_GROUP_MAX_BYTES)


def largest_layer_values(modules: list[torch.nn.Module]) -> int:
    """Parameters of the largest decoder layer among the stage modules' ``layers`` (0 if none)."""
    return max((sum(p.numel() for p in layer.parameters()) for m in modules for layer in getattr(m, "layers", {}).values()), default=0)


def lr_at(step: int, cfg: OptimSection, total_steps: int) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at total_steps (step counts from 0)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    # Norm gains and embeddings are not decayed (the LLaMA recipe).
    return param.ndim < 2 or name.endswith("norm.weight") or name.endswith("embed.weight")


def fused_adamw(groups: list[dict], cfg: OptimSection) -> torch.optim.AdamW:
    """torch's fused AdamW (CPU and CUDA): one kernel per tensor and no parameter-sized temporaries.

    The single-tensor path allocates two fp32 temporaries the size of each parameter (about 4 GiB
    for a 128K-vocabulary, 4096-wide embedding), the foreach path its temporaries for the whole group.
    """
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``optimizer``."""
    for g in optimizer.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)  # torchao keeps lr as a tensor so its compiled step never recompiles
        else:
            g["lr"] = lr


class MasterWeightOptimizer:
    """AdamW on fp32 copies of the model's parameters; the model's (bf16) weights follow each step.

    Gradients are handed in one parameter at a time (``set_grad``) so the caller can read them out
    of a compressed buffer without materialising all of them; ``step`` then updates every master
    that received a gradient and copies it back into the model's dtype.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimSection) -> None:
        self.cfg = cfg
        self.params: list[nn.Parameter] = []
        self.names: list[str] = []
        self.masters: list[torch.Tensor] = []
        self._group: list[int] = []  # per parameter: 0 decayed, 1 not (the param_groups below)
        self._handed: list[int] = []  # parameters given a gradient since the last step
        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            master = p.detach().float().clone().requires_grad_(True) if p.dtype != torch.float32 else p
            self.params.append(p)
            self.names.append(name)
            self.masters.append(master)
            decayed = not no_weight_decay(name, p)
            self._group.append(0 if decayed else 1)
            (decay if decayed else no_decay).append(master)
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        betas = (cfg.beta1, cfg.beta2)
        if cfg.name == "adamw8bit":
            try:
                from torchao.optim import AdamW8bit
            except ImportError as e:
                raise RuntimeError(
                    "optim.name='adamw8bit' needs torchao: pip install 'agoq[optim8bit]' (or torchao), or use optim.name='adamw'"
                ) from e
            self.optimizer: torch.optim.Optimizer = AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
        else:
            self.optimizer = fused_adamw(groups, cfg)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group."""
        set_lr(self.optimizer, lr)

    def set_grad(self, index: int, grad: torch.Tensor) -> None:
        """Give parameter ``index`` its (reduced, clipped) gradient, as fp32."""
        self.masters[index].grad = grad.to(torch.float32).view_as(self.masters[index])
        self._handed.append(index)

    @torch.no_grad()
    def step(self) -> None:
        """Update the masters that have gradients, copy them into the model, drop the gradients.

        Fused AdamW updates just the masters handed a gradient: ``optimizer.step()`` looks at every
        parameter of every group, and the gradient syncs call this once per group of a few MiB,
        so for a model of hundreds of tensors the looking outgrew the update itself. The same
        kernel and arithmetic either way (tests/test_optim.py).
        """
        handed, self._handed = list(dict.fromkeys(self._handed)), []  # a gradient handed twice is still one update
        if not self.steps_slices:
            self.optimizer.step()
        else:
            for g, group in enumerate(self.optimizer.param_groups):
                idx = [i for i in handed if self._group[i] == g]
                if idx:
                    states = [self._state(self.masters[i]) for i in idx]
                    moments = [[st[k] for st in states] for k in ("exp_avg", "exp_avg_sq")]
                    self._adamw(group, [self.masters[i] for i in idx], [self.masters[i].grad for i in idx], *moments, [st["step"] for st in states])
        for i in handed:
            m, p = self.masters[i], self.params[i]
            if m is not p:
                p.copy_(m)
            m.grad = None

    def _state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """The AdamW state of ``master``, started as torch's fused AdamW starts it (so checkpoints stay alike)."""
        state = self.optimizer.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _adamw(group: dict, masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list) -> None:
        """torch's fused AdamW on these tensors with ``group``'s settings; advances each of ``steps``."""
        beta1, beta2 = group["betas"]
        adamw(
            masters,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    @property
    def steps_slices(self) -> bool:
        """Whether :meth:`step_slices` can step one parameter a slice of its gradient at a time (fused AdamW)."""
        return isinstance(self.optimizer, torch.optim.AdamW) and bool(self.optimizer.defaults.get("fused"))

    @torch.no_grad()
    def step_slices(self, index: int, slices: Iterable[tuple[int, int, torch.Tensor]]) -> None:
        """One AdamW step of parameter ``index``, from ``(start, end, fp32 gradient values)`` slices of its
        flattened gradient that cover it once, in order, each used as it comes.

        The same arithmetic as :meth:`step` (torch's fused AdamW, element by element, on views of the
        master and its moments), so a caller reading gradients back from 8 bits needs one slice in
        fp32 at a time, not the whole tensor. The step count advances once. Bit-identical to
        :meth:`step` where slices end on whole SIMD vectors (the syncs cut whole 256-value blocks);
        a slice ending inside one goes through the kernel's scalar tail, which may round
        ``exp_avg_sq``'s last bit differently.
        """
        if not self.steps_slices:
            raise RuntimeError(f"step_slices needs torch's fused AdamW; optim.name={self.cfg.name!r} steps whole tensors (use set_grad and step)")
        master, param = self.masters[index], self.params[index]
        group = self.optimizer.param_groups[self._group[index]]
        state = self._state(master)
        m, exp_avg, exp_avg_sq = (t.view(-1) for t in (master, state["exp_avg"], state["exp_avg_sq"]))
        covered = 0
        for start, end, grad in slices:
            if start != covered or grad.numel() != end - start:
                raise ValueError(
                    f"slices of {self.names[index]!r} must cover it in order: got {start}..{end} with {grad.numel()} values after {covered}"
                )
            # Each slice advances a copy of the step; the state's advances once, below.
            self._adamw(group, [m[start:end]], [grad.to(torch.float32)], [exp_avg[start:end]], [exp_avg_sq[start:end]], [state["step"].clone()])
            if master is not param:
                param.view(-1)[start:end].copy_(m[start:end])
            covered = end
            del grad  # before the next slice is read: one slice in fp32 at a time
        if covered != master.numel():
            raise ValueError(f"slices of {self.names[index]!r} covered {covered} of its {master.numel()} values")
        state["step"] += 1

    def state_bytes(self) -> int:
        """Bytes of optimizer state plus fp32 master copies (not counting the model's own weights)."""
        total = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += tensor_bytes(v)
        total += sum(m.numel() * 4 for m, p in zip(self.masters, self.params) if m is not p)
        return total

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter state keyed by the parameter's global name (master weights and moments).

        Keys are names, not optimizer indices, so pipeline ranks holding different layers never
        collide in a distributed checkpoint.
        """
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p, m in zip(self.names, self.params, self.masters):
            entry = {k: v for k, v in self.optimizer.state.get(m, {}).items() if isinstance(v, torch.Tensor)}
            if m is not p:
                entry["master"] = m.detach()
            out[name] = entry
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore what :meth:`state_dict` returned (and the model weights from the masters)."""
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"optimizer state lacks parameter {missing[0]!r} ({len(missing)} missing)")
        for name, p, m in zip(self.names, self.params, self.masters):
            entry = dict(state[name])
            master = entry.pop("master", None)
            if master is not None:
                m.copy_(master)
                p.copy_(m)
            if entry:
                self.optimizer.state[m] = {k: self._restore(m, k, v) for k, v in entry.items()}

    def _restore(self, master: torch.Tensor, key: str, saved: torch.Tensor) -> torch.Tensor:
        """A state tensor in the optimizer's own storage: 8-bit AdamW moments come back 8-bit."""
        new_buffer = getattr(self.optimizer, "_new_buffer", None)
        if new_buffer is not None and key in ("exp_avg", "exp_avg_sq"):
            # A checkpoint may hand back the moments dequantized; requantize into torchao's state.
            buf = new_buffer(master, signed=key == "exp_avg")
            buf.copy_(saved.to(master.device) if type(saved) is torch.Tensor else saved)
            return buf
        return saved.clone()


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor, including quantized subclasses that expose their parts."""
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def count_bytes(tensors: Iterable[torch.Tensor], key: Callable[[torch.Tensor], int] = tensor_bytes) -> int:
    """Total storage bytes of tensors."""
    return sum(key(t) for t in tensors)
