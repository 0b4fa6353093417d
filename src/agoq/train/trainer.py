"""The training loop of one rank: pipeline x data x tensor parallel, AGoQ activations and gradients.

Reads top to bottom: set up the process groups, the run's decided ``auto`` choices (compute dtype,
quantization backend) and data, build this rank's pipeline stage(s) under the activation policy
(with tp > 1, this rank's tensor/sequence-parallel shard of each, agoq.parallel.tensor_model) and
its gradient path, then for each step run the pipeline schedule, reduce gradients over the
data-parallel group (8-bit or plain), clip by the global norm, and step AdamW on fp32 masters.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.activation.policy import ActivationPolicy, make_policy, with_loss_path
from agoq.models import Llama, LlamaConfig
from agoq.parallel.layout import PipelineLayout
from agoq.gradient.counter import CommCounter
from agoq.train.compute_dtype import ResolvedChoices, resolve_choices, worker_threads
from agoq.train.config import TrainConfig
from agoq.gradient.build import make_gradient_sync
from agoq.gradient.sync import GradientSync
from agoq.train.metrics import JsonlWriter, peak_rss_bytes
from agoq.train.optim import MasterWeightOptimizer, largest_layer_values, lr_at, step_group_bytes
from agoq.train.saved import SavedActivationTracker, StepAllocations


class StageForward(nn.Module):
    """What a pipeline stage runs: the Llama slice's hidden states (the loss takes the last one)."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(x)


@dataclass
class RankContext:
    """Where this process sits in the (pp, dp, tp) layout."""

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
    stages: list[int] = field(default_factory=list)
    owns_group: bool = False  # this run created the process group (and destroys it at the end)


def layer_bits_for(
    cfg: TrainConfig, model_cfg: LlamaConfig, micro_batch: int, policy: ActivationPolicy, layout: PipelineLayout, dtype: torch.dtype
) -> tuple[int, ...] | None:
    """Per-layer bit widths: uniform, or stage-aware (DBCA) from the schedule's in-flight counts under ``policy``."""
    pr, p = cfg.precision, cfg.parallel
    if pr.activations == "bf16":
        return None
    from agoq.quant import parse_format

    fmt = parse_format(pr.activation_format)
    if pr.stage_bits == "uniform" or p.pp == 1 or fmt.kind != "int":
        return None
    from agoq.parallel.dbca import stage_layer_bits

    seq_per_rank = cfg.data.seq_len // p.tp  # sequence parallelism: each tp rank holds seq / tp tokens
    return tuple(stage_layer_bits(model_cfg, layout, micro_batch, seq_per_rank, policy, fmt.bits, dtype=dtype, tp=p.tp))


def pipeline_layout(cfg: TrainConfig) -> PipelineLayout:
    """The run's pipeline layout, from its parallel section."""
    p = cfg.parallel
    return PipelineLayout(p.schedule, p.pp, p.microbatches, p.virtual_stages, p.dp)


def make_policy_for(cfg: TrainConfig, layer_bits: tuple[int, ...] | None = None) -> ActivationPolicy:
    """The activation policy a config asks for."""
    pr = cfg.precision
    from agoq.parallel.inflight import loss_recompute_needed, loss_weight_grad_in_forward

    recompute = loss_recompute_needed(cfg.parallel.pp)
    policy = make_policy(
        pr.activations, fmt=pr.activation_format, layer_bits=layer_bits, fused_loss=pr.fused_loss, checkpoint_format=pr.checkpoint_format
    )
    return with_loss_path(policy, recompute=recompute, weight_grad_in_forward=loss_weight_grad_in_forward(cfg.parallel.pp, cfg.parallel.tp))


def rank_policy(
    cfg: TrainConfig, model_cfg: LlamaConfig, micro_batch: int, layout: PipelineLayout, dtype: torch.dtype
) -> tuple[tuple[int, ...] | None, ActivationPolicy]:
    """The run's layer bits and activation policy, built once: the config's policy, and the same
    policy with the DBCA bits it sizes (None: every layer keeps the config's format)."""
    policy = make_policy_for(cfg)
    layer_bits = layer_bits_for(cfg, model_cfg, micro_batch, policy, layout, dtype)
    return layer_bits, policy if layer_bits is None else replace(policy, layer_bits=layer_bits)


def _setup_distributed(cfg: TrainConfig) -> RankContext:
    """Join the process group that torchrun (or the local launcher) described in the environment."""
    from agoq.parallel.pipeline import make_mesh, rank_stages

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Share the cores: more threads than cores per process only thrashes.
        torch.set_num_threads(worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))))
    owns_group = not dist.is_initialized()
    if owns_group:
        from agoq.train.forkserver import LOOPBACK_ENV
        from agoq.train.loopback import process_group_store

        if os.environ.get(LOOPBACK_ENV) == "1":  # a local run: every endpoint on 127.0.0.1
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=process_group_store(), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend)
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(
            f"the launcher started {world} processes but parallel.pp x parallel.dp x parallel.tp = {cfg.world_size}; "
            f"launch with --nproc-per-node x nodes = {cfg.world_size} or change the config"
        )
    mesh = make_mesh(world, cfg.parallel.pp, device.type, tp=cfg.parallel.tp)
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    return RankContext(
        rank=dist.get_rank(),
        world=world,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        device=device,
        tp_rank=mesh["tp"].get_local_rank(),
        tp_group=mesh["tp"].get_group(),
        tp=cfg.parallel.tp,
        stages=rank_stages(cfg.parallel.schedule, pp_rank, cfg.parallel.pp, cfg.parallel.virtual_stages),
        owns_group=owns_group,
    )


def worker_choices(cfg: TrainConfig, device: torch.device, choices: ResolvedChoices | None) -> ResolvedChoices:
    """The run's decided compute dtype and quantization backend, with this process's backend set to it.

    The local launcher decides before the workers start and passes its choices; under torchrun
    nothing decided before launch (agoq.train.run.resolve_auto_choices), so the workers do, alike
    on every rank. The config is left as validated.
    """
    if choices is None:
        # rank 0 decides (the backend from what this machine has installed), so that every rank
        # computes alike; its lines go with the choices, for the caller to print.
        decided = [resolve_choices(cfg, device.type) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(decided, src=0)
        choices = decided[0]
    # Process-wide: every quantize, fold and reduction of this worker takes this path.
    from agoq.quant import backend as quant_backend

    quant_backend.set_backend(choices.quant_backend)
    return choices


def _prepare_data(cfg: TrainConfig, ctx: RankContext):
    """Tokenizer and packed tokens; rank 0 builds the cache, the others then read it."""
    from agoq.train.data import prepare_data

    d = cfg.data

    def build():
        # The launcher (or, under torchrun, rank 0) verified the token file's digest: the others only read it.
        return prepare_data(d.corpus if d.corpus != "kjv" else None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction, verify=ctx.rank == 0)

    if ctx.rank == 0:
        data = build()
        dist.barrier()
    else:
        dist.barrier()
        data = build()
    return data


def build_stage_modules(
    cfg: TrainConfig,
    ctx: RankContext,
    model_cfg: LlamaConfig,
    policy: ActivationPolicy,
    layout: PipelineLayout,
    dtype: torch.dtype,
    tp_counter: CommCounter | None = None,
) -> list[nn.Module]:
    """This rank's Llama slices, one per pipeline stage it runs, initialised from the run's seed
    (under tp > 1, this rank's tp shard of each: the same initial model at every tp)."""
    ranges = layout.stage_ranges(model_cfg.n_layers)
    modules: list[nn.Module] = []
    for s in ctx.stages:
        m = Llama(model_cfg, policy, layers=ranges[s], embed=s == 0, head=s == layout.num_stages - 1)
        m.reset_parameters(cfg.train.seed)
        m.recompute = set(list(ranges[s])[: cfg.precision.recompute_layers])
        m = m.to(device=ctx.device, dtype=dtype)
        if ctx.tp > 1:
            from agoq.parallel.tensor_model import shard_llama

            m = shard_llama(m, ctx.tp_group, tp_counter)
        if cfg.train.compile:
            m.compile_layers()
        modules.append(m)
    return modules


def replicated_over_tp(modules: list[nn.Module], ctx: RankContext) -> set[int]:
    """Indices (in :func:`named_parameters_of`'s order) of the parameters every tp rank holds whole."""
    if ctx.tp == 1:
        return set()
    from agoq.parallel.tensor_model import split_dim

    return {i for i, (n, _) in enumerate((n, p) for m in modules for n, p in m.named_parameters()) if split_dim(n) is None}


def named_parameters_of(modules: list[nn.Module], ctx: RankContext) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters under their global names; under tp > 1 each name carries its shard
    (agoq.parallel.tensor_model.shard_name), so checkpoints keep every shard."""
    if ctx.tp == 1:
        return [(n, p) for m in modules for n, p in m.named_parameters()]
    from agoq.parallel.tensor_model import shard_name

    return [(shard_name(n, ctx.tp_rank, ctx.tp), p) for m in modules for n, p in m.named_parameters()]


def build_gradient_path(cfg: TrainConfig, params: list[tuple[str, nn.Parameter]], ctx: RankContext) -> tuple[GradientSync, Any]:
    """The gradient sync over the dp group and the optimizer that reads it: ZeRO-1's sharded pair, or
    the full buffer (8-bit, fp32 or bf16 all-reduce) with AdamW on fp32 masters."""
    p, pr = cfg.parallel, cfg.precision
    node_size = p.node_size or min(p.dp, int(os.environ.get("LOCAL_WORLD_SIZE", p.dp)))  # hier-8/4; the 8-bit all-gather at pp = tp = 1
    sync = make_gradient_sync(pr.gradients, params, ctx.dp_group, ctx.device, p.microbatches, pr.gradient_block, sharded=p.zero1, node_size=node_size)
    if p.zero1:
        from agoq.train.zero1 import Zero1Optimizer

        return sync, Zero1Optimizer(params, cfg.optim, sync)
    return sync, MasterWeightOptimizer(params, cfg.optim)


def build_pipeline(cfg: TrainConfig, ctx: RankContext, modules: list[Llama], num_stages: int, loss: Any) -> tuple[list[Any], Any]:
    """This rank's torch pipeline stages and the schedule that runs them, with ``loss`` on the last stage."""
    from agoq.parallel.pipeline import build_schedule, build_stages

    p = cfg.parallel
    stages = build_stages([StageForward(m) for m in modules], ctx.stages, num_stages, group=ctx.pp_group, device=ctx.device)
    # Every rank passes the loss: torch enables the backward passes only where one is given.
    # Gradients leave p.grad as soon as they accumulate (into the fp32 or 8-bit buffer), so
    # torch's post-step division by the micro-batch count would find nothing: the loss is
    # divided instead, and the recorded losses are summed back.
    return stages, build_schedule(p.schedule, stages, p.microbatches, loss, scale_grads=False)


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
    every: list[Any] = [None] * ctx.world
    dist.all_gather_object(every, mine)
    return [r for r in every if r["parameter"] is not None]


class Trainer:
    """One rank's share of a training run."""

    def __init__(self, cfg: TrainConfig, choices: ResolvedChoices | None = None, group_ready: Callable[[], object] | None = None) -> None:
        from agoq.train.data import TrainSampler, validation_batches

        self.cfg = cfg
        self.ctx = ctx = _setup_distributed(cfg)
        if group_ready is not None:
            group_ready()
        self.choices = worker_choices(cfg, ctx.device, choices)
        torch.manual_seed(cfg.train.seed)
        self.data = _prepare_data(cfg, ctx)
        p = cfg.parallel
        # The model the opening lines announce: its vocabulary is data.vocab_size or the tokenizer
        # file's (a BPE that found fewer tokens on a small corpus leaves the last rows unused).
        self.model_cfg = cfg.model_config()
        self.local_batch = cfg.data.batch_size // p.dp
        self.micro_batch = self.local_batch // p.microbatches
        layout = pipeline_layout(cfg)
        self.layer_bits, self.policy = rank_policy(cfg, self.model_cfg, self.micro_batch, layout, self.choices.dtype)
        self.tp_counter = CommCounter()  # the bytes this rank sends over its tp group
        self.modules = build_stage_modules(cfg, ctx, self.model_cfg, self.policy, layout, self.choices.dtype, self.tp_counter)
        num_stages = layout.num_stages
        self.last = self.modules[-1] if ctx.stages[-1] == num_stages - 1 else None
        self.params = named_parameters_of(self.modules, ctx)
        # tp-replicated parameters (norm weights): every tp rank holds the same reduced gradient.
        self.replicated = replicated_over_tp(self.modules, ctx)
        self.pipelined = p.pp > 1
        if self.pipelined:
            self.stages, self.schedule = build_pipeline(cfg, ctx, self.modules, num_stages, self._stage_loss)
            self._schedule_initializing = True
        self.sync, self.optimizer = build_gradient_path(cfg, self.params, ctx)
        self.sampler = TrainSampler(self.data.train, cfg.data.seq_len, cfg.data.batch_size, ctx.dp_rank, p.dp, cfg.train.seed)
        self.val = (
            validation_batches(self.data.val, cfg.data.seq_len, cfg.data.batch_size, ctx.dp_rank, p.dp, cfg.train.eval_batches)
            if cfg.uses_validation()
            else []
        )
        self.tracker = SavedActivationTracker([prm for _, prm in self.params])
        self.out_dir = Path(cfg.train.out_dir)
        self.metrics = JsonlWriter(self.out_dir / "metrics" / f"rank{ctx.rank}.jsonl")
        self.step = 0
        self.steps_run = 0  # by this process (a resumed run starts at a later step)

    # ---------------------------------------------------------------------------- one step

    def _stage_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss on the last stage, divided there: it sees grad_output 1 (see inflight.loss_weight_grad_in_forward)."""
        if self.last is None:
            raise RuntimeError("the loss runs on the last pipeline stage only")
        in_forward, self._schedule_initializing = not self._schedule_initializing, False
        return self.last.loss(hidden, targets, divisor=self.cfg.parallel.microbatches, weight_grad_in_forward=in_forward)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Run every micro-batch forward and backward; the mean loss on the last stage, else None (fp64, on the device)."""
        p = self.cfg.parallel
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        if self.pipelined:
            losses: list[torch.Tensor] = []
            first = 0 in self.ctx.stages
            args = (inputs,) if first else ()
            self.schedule.step(*args, target=targets if self.last is not None else None, losses=losses)
            return torch.stack([l.detach().float() for l in losses]).sum().to(torch.float64) if losses else None
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        model = self.modules[0]
        for x, y in zip(inputs.chunk(p.microbatches), targets.chunk(p.microbatches)):
            loss = model(x, y)
            (loss / p.microbatches).backward()
            total += loss.detach().to(torch.float64) / p.microbatches
        return total

    def _global_loss(self, loss: torch.Tensor | None) -> float:
        """The mean over dp replicas of a loss known on the last stage, on every rank."""
        t = _loss_terms(loss, self.ctx.device)
        dist.all_reduce(t)
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

        cfg = self.cfg
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
        sq = grad_sq if self.sync.sharded else grad_sq / cfg.parallel.dp
        agree = torch.cat([torch.stack([sq, nonfinite]), _loss_terms(local_loss, self.ctx.device)])
        dist.all_reduce(agree)
        sq_sum, nonfinite_sum, loss_sum, loss_count = agree.tolist()
        loss = loss_sum / loss_count
        grad_norm = math.sqrt(sq_sum) if nonfinite_sum == 0 and math.isfinite(sq_sum) else float("nan")
        skipped = not math.isfinite(grad_norm)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        phase("optimizer")
        if not skipped:
            self._update(grad_norm, lr)
        self.sync.finish_step()
        dt = time.perf_counter() - t0
        self.step += 1
        self.steps_run += 1
        tokens = cfg.data.batch_size * cfg.data.seq_len
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
        clip = self.cfg.optim.grad_clip
        coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        self.optimizer.set_lr(lr)
        # Step in groups of at most step_group_bytes of gradients (a larger tensor a slice at a
        # time where the optimizer can), so fp32 gradients read back from 8 bits never all exist at once.
        self.sync.step_optimizer(self.optimizer, coef, step_group_bytes(self.ctx.device, largest_layer_values(self.modules)))

    def measure_baseline(self) -> dict[str, Any]:
        """Saved-activation peak of one step under the bf16 policy, on a held-out batch, with no update."""
        bf16 = make_policy("bf16")
        for m in self.modules:
            m.set_policy(bf16)
        try:
            x, y = self.val[0]
            self.sync.start_step()
            with self.tracker:
                self.forward_backward(x, y)
            peak = self.tracker.step_peak_bytes
            self.sync.finish_step()
        finally:
            for m in self.modules:
                m.set_policy(self.policy)
        return {"peak_saved_bytes": peak}

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every rank's parameters are finite (a collective: every rank must call it).

        The parameters are copies of the fp32 masters after each update, so a non-finite master
        shows here; non-finite optimizer moments show in the next step's update, hence its loss.
        """
        bad = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for _, p in self.params:
            bad += (~torch.isfinite(p)).sum()
        dist.all_reduce(bad)
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
                self.schedule.eval(*args, target=y.to(self.ctx.device) if self.last is not None else None, losses=out)
                self._schedule_initializing = True  # again at the next training step
                local = torch.stack([l.float() for l in out]).sum() if out else None
            else:
                local = self.modules[0](x.to(self.ctx.device), y.to(self.ctx.device))
            losses.append(self._global_loss(local))
        for m in self.modules:
            m.train()
        return sum(losses) / len(losses)

    # ---------------------------------------------------------------------------- state

    def my_layer_bits(self) -> list[int] | str:
        """Bit width of each of this rank's layers (16 = kept bf16), or the policy name if uniform."""
        if self.policy.name == "bf16":
            return "bf16"
        layers = [i for m in self.modules for i in m.layer_range]
        if self.layer_bits is None:
            from agoq.quant import parse_format

            return [parse_format(self.cfg.precision.activation_format).bits] * len(layers)
        return [self.layer_bits[i] for i in layers]

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds for this rank: model weights (global names) and optimizer state."""
        return {"model": _NamedParams(self.params, self.model_cfg), "optimizer": self.optimizer}

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


class _NamedParams(nn.Module):
    """The parameters of this rank's stages under their global names (a checkpointable module)."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], cfg: LlamaConfig) -> None:
        super().__init__()
        self._named = params
        self.cfg = cfg

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {n: p.detach() for n, p in self._named}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        for n, p in self._named:
            p.copy_(state[n])
