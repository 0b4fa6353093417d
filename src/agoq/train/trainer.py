"""One rank's training loop, built from explicit parts: pipeline x data x tensor parallel, AGoQ
activations and gradients.

A :class:`Trainer` holds what the launch layer (agoq.launch.components) or a user built for this
rank, its :class:`Components`, and the loop's :class:`LoopSettings`; its constructor only keeps
them (no file, no collective, no global setting). Each step runs the pipeline schedule (or the
micro-batches of one stage), reduces gradients over the data-parallel group (8-bit or plain), clips
by the global norm and steps AdamW on fp32 masters; :meth:`Trainer.train` runs the steps with
evaluation, metrics and checkpoints. Without a process group (one process, no ``dist.init_*``)
the collectives between ranks are skipped: the run is its own world.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.activation.policy import ActivationPolicy, make_policy
from agoq.gradient.counter import CommCounter
from agoq.gradient.sync import GradientSync
from agoq.models import LlamaConfig
from agoq.train.metrics import Progress, peak_rss_bytes
from agoq.train.optim import largest_layer_values, lr_at, step_group_bytes
from agoq.train.optim_section import OptimSection
from agoq.train.saved import SavedActivationTracker, StepAllocations


@dataclass
class RankContext:
    """Where this process sits in the (pp, dp, tp) layout; :meth:`single` for one process alone."""

    rank: int
    world: int
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    tp: int = 1
    dp: int = 1  # data-parallel replicas, whose identical reduced gradients the norm counts once
    stages: list[int] = field(default_factory=lambda: [0])
    owns_group: bool = False  # this run created the process group (and destroys it at the end)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "RankContext":
        """One process that is the whole run: one stage, no data or tensor parallelism."""
        return cls(rank=0, world=1, pp_rank=0, dp_rank=0, pp_group=None, dp_group=None, device=torch.device(device))


class Loader(Protocol):
    """Where the training batches come from: agoq.data.tokens.TrainSampler, or any object alike.
    ``state_dict`` and ``load_state_dict`` are needed only to checkpoint and resume."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class StageLoss:
    """The micro-batch loss on the last pipeline stage, divided there: it sees grad_output 1 (see
    agoq.parallel.inflight.loss_weight_grad_in_forward). The schedule is built with it before the
    Trainer exists; the Trainer marks when the schedule's first step initialises its stages (their
    shape inference runs the loss once without a backward)."""

    def __init__(self, last: nn.Module | None, microbatches: int) -> None:
        self.last = last
        self.microbatches = microbatches
        self.initializing = True

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.last is None:
            raise RuntimeError("the loss runs on the last pipeline stage only")
        in_forward, self.initializing = not self.initializing, False
        return self.last.loss(hidden, targets, divisor=self.microbatches, weight_grad_in_forward=in_forward)


@dataclass
class Pipeline:
    """This rank's torch pipeline stages, the schedule that runs them, and the loss it calls."""

    stages: list[Any]
    schedule: Any
    loss: StageLoss


@dataclass
class Components:
    """Everything one rank trains with, built outside the Trainer.

    ``modules``: this rank's model parts, one per pipeline stage it runs (each with ``forward(x, y)``
    returning the loss, ``loss``, ``set_policy`` and ``layer_range``, as agoq.models.Llama);
    ``params``: their parameters under global names (checkpoints key on them); ``sync`` and
    ``optimizer``: the gradient path; ``pipeline``: with pp > 1, the stages and schedule;
    ``layer_bits``: each of this rank's layers' saved-activation bits, or the policy's name;
    ``replicated``: indices into ``params`` that every tp rank holds whole; ``checkpointer`` and
    ``metrics``: None for a run that keeps neither.
    """

    ctx: RankContext
    modules: list[nn.Module]
    params: list[tuple[str, nn.Parameter]]
    policy: ActivationPolicy
    sync: GradientSync
    optimizer: Any
    loader: Loader
    val_batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    pipeline: Pipeline | None = None
    layer_bits: list[int] | str = "bf16"
    replicated: set[int] = field(default_factory=set)
    tp_counter: CommCounter = field(default_factory=CommCounter)  # the bytes this rank sends over its tp group
    model_config: LlamaConfig | None = None  # the whole model's architecture, recorded in and checked by checkpoints
    checkpointer: Any = None  # agoq.train.checkpoint.Checkpointer
    metrics: Any = None  # agoq.train.metrics.JsonlWriter


@dataclass
class LoopSettings:
    """How the loop runs: its length, the micro-batches per step, the learning-rate schedule and
    clipping (``optim``), and how often it evaluates, logs and checkpoints (0: never)."""

    steps: int
    microbatches: int
    tokens_per_step: int
    optim: OptimSection = field(default_factory=OptimSection)
    eval_every: int = 0
    log_every: int = 10
    max_skipped_steps: int = 10
    checkpoint_every: int = 0


class TrainingDiverged(RuntimeError):
    """The run stopped because its loss or gradients stayed non-finite; the message says for how long and what to change."""


ESTIMATE_AFTER = 3  # records before rank 0 estimates the time left


def skipped_step_line(rec: dict[str, Any]) -> str:
    """The line rank 0 prints for a skipped step: every global rank that saw a non-finite gradient,
    its pipeline stage(s) and replica, and the first such parameter (:func:`nonfinite_ranks`)."""
    where = []
    for r in rec.get("nonfinite") or []:
        stages = ",".join(map(str, r["stages"]))
        tp = f", tp rank {r['tp_rank']}" if r.get("tp_rank") else ""
        where.append(f"rank {r['rank']} (pipeline stage {stages}, dp replica {r['dp_rank']}{tp}) in {r['parameter']}")
    seen = f"non-finite gradients on {'; '.join(where)}" if where else f"the loss ({rec['loss']}) or the reduced gradients were not finite"
    return f"agoq train: step {rec['step']} skipped, the weights left as they were: {seen}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _grouped() -> bool:
    """Whether this process is in a process group; without one the run is this one rank."""
    return dist.is_available() and dist.is_initialized()


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every rank of the run, in place."""
    if _grouped():
        dist.all_reduce(t)
    return t


def _loss_terms(loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """[loss sum, count] of this rank in fp64 on ``device``: the loss lives on the last pipeline stage only."""
    if loss is None:
        return torch.zeros(2, dtype=torch.float64, device=device)
    return torch.stack([loss.to(torch.float64), torch.ones((), dtype=torch.float64, device=device)])


def _reduce_quietly(sync: GradientSync) -> torch.Tensor:
    """``sync.reduce()`` without its non-finite warning: every rank of a dp group would print one,
    where rank 0 reports the skipped step once, naming each rank that saw it (nonfinite_ranks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="non-finite gradient", category=RuntimeWarning)
        return sync.reduce()


def nonfinite_ranks(sync: GradientSync, ctx: RankContext) -> list[dict[str, Any]]:
    """Of a skipped step, on every rank (a collective): each global rank that saw a non-finite
    gradient, with its pipeline stage(s), dp replica and tp rank, and the first such parameter."""
    seen = dict(sync.nonfinite_last_step())
    mine = {"rank": ctx.rank, "stages": list(ctx.stages), "dp_rank": ctx.dp_rank, "tp_rank": ctx.tp_rank, "parameter": seen.get(ctx.rank)}
    every: list[Any] = [mine]
    if _grouped():
        every = [None] * ctx.world
        dist.all_gather_object(every, mine)
    return [r for r in every if r["parameter"] is not None]


class Trainer:
    """One rank's share of a training run, from the parts it trains (:class:`Components`) and how
    its loop runs (:class:`LoopSettings`)."""

    def __init__(self, components: Components, settings: LoopSettings) -> None:
        self.components = components
        self.settings = settings
        self.ctx = components.ctx
        self.modules = components.modules
        self.params = components.params
        self.policy = components.policy
        self.sync = components.sync
        self.optimizer = components.optimizer
        self.sampler = components.loader
        self.val = components.val_batches
        self.replicated = components.replicated
        self.tp_counter = components.tp_counter
        self.metrics = components.metrics
        self.checkpointer = components.checkpointer
        self.pipeline = components.pipeline
        self.pipelined = components.pipeline is not None
        self.last = components.pipeline.loss.last if components.pipeline is not None else self.modules[-1]
        self.tracker = SavedActivationTracker([prm for _, prm in self.params])
        # Gradients per partial optimizer step: a fixed size (the layers do not change), so that
        # fp32 gradients read back from 8 bits never all exist at once.
        self.step_group_bytes = step_group_bytes(self.ctx.device, largest_layer_values(self.modules))
        self.step = 0
        self.steps_run = 0  # by this process (a resumed run starts at a later step)

    # ---------------------------------------------------------------------------- one step

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Run every micro-batch forward and backward; the mean loss on the last stage, else None (fp64, on the device)."""
        microbatches = self.settings.microbatches
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        if self.pipelined:
            losses: list[torch.Tensor] = []
            first = 0 in self.ctx.stages
            args = (inputs,) if first else ()
            self.pipeline.schedule.step(*args, target=targets if self.last is not None else None, losses=losses)
            return torch.stack([l.detach().float() for l in losses]).sum().to(torch.float64) if losses else None
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        model = self.modules[0]
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            loss = model(x, y)
            (loss / microbatches).backward()
            total += loss.detach().to(torch.float64) / microbatches
        return total

    def _global_loss(self, loss: torch.Tensor | None) -> float:
        """The mean over dp replicas of a loss known on the last stage, on every rank."""
        t = _sum_over_ranks(_loss_terms(loss, self.ctx.device))
        return float(t[0] / t[1])

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over one global batch."""
        # The second step this process runs also counts its temporaries (the first one includes
        # torch's one-off shape inference and lazily created state); the count costs a Python call
        # per operator, so that step's time is not representative. A dispatch mode cannot watch
        # compiled code, so torch.compile'd functions (torchao's 8-bit AdamW step) run eagerly in
        # that step: their temporaries are counted as eager code allocates them, an upper bound.
        probe = self.steps_run == 1
        with contextlib.ExitStack() as stack:
            temporaries = None
            if probe:
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                temporaries = stack.enter_context(self.tracker.temporaries())
            rec = self._train_step(temporaries)
        if temporaries is not None:
            rec["memory_probe"] = True
            rec["peak_temporary_bytes"] = temporaries.peak_temporary_bytes
            rec["peak_step_bytes"] = temporaries.peak_bytes
            rec["peak_temporary_bytes_by_phase"] = temporaries.peak_temporary_by_phase
        return rec

    def _train_step(self, temporaries: StepAllocations | None) -> dict[str, Any]:
        def phase(name: str) -> None:
            if temporaries is not None:
                temporaries.enter_phase(name)

        settings = self.settings
        t0 = time.perf_counter()
        phase("data")
        inputs, targets = self.sampler.next_batch()
        self.sync.start_step()
        self.tp_counter.reset()
        phase("forward_backward")
        with self.tracker:
            local_loss = self.forward_backward(inputs, targets)
        phase("gradient_sync")
        nonfinite = _reduce_quietly(self.sync)
        grad_sq = self.sync.local_grad_sq_norm()
        if self.replicated:
            # Each tp rank holds the whole of a replicated parameter's gradient: counted once over tp.
            grad_sq = grad_sq - (1 - 1 / self.ctx.tp) * self.sync.params_sq_norm(self.replicated)
        # One small all-reduce over every rank gives the global gradient norm, whether any pp
        # stage or dp group saw a non-finite gradient (all ranks then skip or step together), and
        # the step's loss. dp replicas hold identical reduced gradients, so their squares are
        # divided out; ZeRO-1 shards are disjoint, so theirs add up to the full norm. Everything
        # stays on the device until this one read: a host read waits for the device's queue.
        sq = grad_sq if self.sync.sharded else grad_sq / self.ctx.dp
        agree = _sum_over_ranks(torch.cat([torch.stack([sq, nonfinite]), _loss_terms(local_loss, self.ctx.device)]))
        sq_sum, nonfinite_sum, loss_sum, loss_count = agree.tolist()
        loss = loss_sum / loss_count
        grad_norm = math.sqrt(sq_sum) if nonfinite_sum == 0 and math.isfinite(sq_sum) else float("nan")
        skipped = not math.isfinite(grad_norm)
        lr = lr_at(self.step, settings.optim, settings.steps)
        phase("optimizer")
        if not skipped:
            self._update(grad_norm, lr)
        self.sync.finish_step()
        dt = time.perf_counter() - t0
        self.step += 1
        self.steps_run += 1
        tokens = settings.tokens_per_step
        return {
            **({"nonfinite": nonfinite_ranks(self.sync, self.ctx)} if skipped else {}),
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "step_time_s": dt,
            "tokens_per_s": tokens / dt,
            "peak_saved_bytes": self.tracker.step_peak_bytes,
            "wire_bytes": self.sync.wire_bytes_last_step,
            "tp_wire_bytes": self.tp_counter.bytes(),
            "link_bytes": self.sync.link_bytes_last_step(),
            "peak_rss_bytes": peak_rss_bytes(),
            "pp_rank": self.ctx.pp_rank,
            "dp_rank": self.ctx.dp_rank,
            "tp_rank": self.ctx.tp_rank,
        }

    def _update(self, grad_norm: float, lr: float) -> None:
        """Clip by the global gradient norm and step AdamW."""
        clip = self.settings.optim.grad_clip
        coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        self.optimizer.set_lr(lr)
        # Step in groups of at most step_group_bytes of gradients (a larger tensor a slice at a time
        # where the optimizer can).
        self.sync.step_optimizer(self.optimizer, coef, self.step_group_bytes)

    def _write(self, rec: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(rec)

    def train(self, after_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Train to ``settings.steps``: evaluate, log, checkpoint good steps, stop a run that stays
        non-finite; every step's record. ``after_step`` is called with each step's record first."""
        s = self.settings
        progress = Progress(s.steps, initial=self.step, enabled=self.ctx.rank == 0, every=s.log_every)
        records: list[dict[str, Any]] = []
        bad_in_a_row = 0
        while self.step < s.steps:
            rec = self.train_step()
            if after_step is not None:
                after_step(rec)
            if rec["skipped"]:
                progress.note(skipped_step_line(rec))
            # Loss and gradient norm are all-reduced, so every rank counts alike and stops together.
            bad_in_a_row = bad_in_a_row + 1 if rec["skipped"] or not math.isfinite(rec["loss"]) else 0
            if bad_in_a_row >= s.max_skipped_steps:
                self._write(rec)
                raise TrainingDiverged(
                    f"the loss or gradients were non-finite for {bad_in_a_row} steps in a row (steps {self.step - bad_in_a_row + 1}-{self.step}, "
                    f"train.max_skipped_steps={s.max_skipped_steps}); no checkpoint was written since. Lower optim.lr "
                    f"(now {s.optim.lr}), keep optim.grad_clip on, or resume from the last checkpoint"
                )
            last = self.step == s.steps
            if s.eval_every and (self.step % s.eval_every == 0 or last):
                rec["val_loss"] = self.evaluate()
            self._write(rec)
            records.append(rec)
            progress.update(self.step, rec["loss"], rec["tokens_per_s"])
            if len(records) == ESTIMATE_AFTER and not last:
                # The first step holds one-time setup and the second counts every allocation: the third
                # is the first ordinary one.
                left = (s.steps - self.step) * rec["step_time_s"]
                progress.note(f"agoq train: {rec['step_time_s']:.2f} s per step here; about {_duration(left)} to go")
            if self.checkpointer is not None and s.checkpoint_every and (self.step % s.checkpoint_every == 0 or last):
                if bad_in_a_row or not self.weights_finite():
                    # Skipped steps leave the weights as they were, but a checkpoint is only ever written
                    # from a good step: the good ones it would prune stay.
                    progress.note(f"agoq train: step {self.step} not saved: its loss, gradients or weights are not finite")
                    continue
                self.checkpointer.save(self.step, self.checkpoint_state(), self.extra_state())
        progress.close()
        return records

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every rank's parameters are finite (a collective: every rank must call it).

        The parameters are copies of the fp32 masters after each update, so a non-finite master
        shows here; non-finite optimizer moments show in the next step's update, hence its loss.
        """
        bad = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for _, p in self.params:
            bad += (~torch.isfinite(p)).sum()
        _sum_over_ranks(bad)
        return bad.item() == 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches (every rank gets it)."""
        for m in self.modules:
            m.eval()
        losses = []
        for x, y in self.val:
            if self.pipelined:
                out: list[torch.Tensor] = []
                args = (x.to(self.ctx.device),) if 0 in self.ctx.stages else ()
                self.pipeline.schedule.eval(*args, target=y.to(self.ctx.device) if self.last is not None else None, losses=out)
                self.pipeline.loss.initializing = True  # again at the next training step
                local = torch.stack([l.float() for l in out]).sum() if out else None
            else:
                local = self.modules[0](x.to(self.ctx.device), y.to(self.ctx.device))
            losses.append(self._global_loss(local))
        for m in self.modules:
            m.train()
        return sum(losses) / len(losses)

    # ---------------------------------------------------------------------------- state

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds for this rank: model weights (global names) and optimizer state."""
        return {"model": _NamedParams(self.params, self.components.model_config), "optimizer": self.optimizer}

    def extra_state(self) -> dict[str, Any]:
        """Step, data position, RNG and gradient-sync state (error-feedback residuals) of this rank."""
        from agoq.train.checkpoint import capture_rng_state

        return {"step": self.step, "sampler": self.sampler.state_dict(), "rng": capture_rng_state(), "gradient_sync": self.sync.state_dict()}

    def load_extra(self, step: int, extra: dict[str, Any]) -> None:
        """Continue from a checkpoint's step, data position, RNG and gradient-sync state."""
        self.step = int(step)
        self.sampler.load_state_dict(extra["sampler"])
        self.sync.load_state_dict(extra.get("gradient_sync", {}))  # error-feedback residuals, per rank
        if "rng" in extra:
            from agoq.train.checkpoint import restore_rng_state

            restore_rng_state(extra["rng"])


def measure_baseline(trainer: Trainer) -> dict[str, Any]:
    """Saved-activation peak of one step under the bf16 policy, on a held-out batch, with no update."""
    bf16 = make_policy("bf16")
    for m in trainer.modules:
        m.set_policy(bf16)
    try:
        x, y = trainer.val[0]
        trainer.sync.start_step()
        with trainer.tracker:
            trainer.forward_backward(x, y)
        peak = trainer.tracker.step_peak_bytes
        trainer.sync.finish_step()
    finally:
        for m in trainer.modules:
            m.set_policy(trainer.policy)
    return {"peak_saved_bytes": peak}


class _NamedParams(nn.Module):
    """The parameters of this rank's stages under their global names (a checkpointable module)."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], cfg: LlamaConfig | None) -> None:
        super().__init__()
        self._named = params
        self.cfg = cfg  # read by agoq.train.checkpoint into the manifest's model_config

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {n: p.detach() for n, p in self._named}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        for n, p in self._named:
            p.copy_(state[n])
