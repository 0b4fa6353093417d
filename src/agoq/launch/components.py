"""From a training config to a Trainer: each component built from its own config section and
explicit values, as ``agoq train`` runs them.

:func:`build_run` joins the process group that torchrun or the local launcher described, decides
the ``auto`` choices, prepares the data, and builds this rank's activation policy (with its DBCA
stage bits), model parts, pipeline schedule, gradient sync with its optimizer, checkpointer and
metrics writer; the Trainer (agoq.train.trainer) gets them as one value and does no setup of its
own. This module and the rest of agoq.launch are the only readers of the whole ``TrainConfig``
(tests/test_layering.py checks it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.activation.policy import ActivationPolicy, make_policy, with_loss_path
from agoq.data.tokens import TokenData
from agoq.gradient.build import make_gradient_sync
from agoq.gradient.counter import CommCounter
from agoq.gradient.sync import GradientSync
from agoq.launch.choices import ResolvedChoices, resolve_choices, worker_threads
from agoq.launch.config import DataSection, ParallelSection, PrecisionSection, TrainConfig
from agoq.models import Llama, LlamaConfig
from agoq.parallel.layout import PipelineLayout
from agoq.train.checkpoint import Checkpointer
from agoq.train.metrics import JsonlWriter
from agoq.train.optim import MasterWeightOptimizer
from agoq.train.optim_section import OptimSection
from agoq.train.trainer import Components, LoopSettings, Pipeline, RankContext, StageLoss, Trainer


@dataclass
class LaunchedRun:
    """What the launch built for this rank: the Trainer with its components and loop settings, and
    what the run decided and read (its ``auto`` choices, the data and the model's architecture)."""

    trainer: Trainer
    choices: ResolvedChoices
    data: TokenData
    model_cfg: LlamaConfig


class StageForward(nn.Module):
    """What a pipeline stage runs: the Llama slice's hidden states (the loss takes the last one)."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(x)


def pipeline_layout(p: ParallelSection) -> PipelineLayout:
    """The run's pipeline layout, from its parallel section."""
    return PipelineLayout(p.schedule, p.pp, p.microbatches, p.virtual_stages, p.dp)


def make_policy_for(pr: PrecisionSection, pp: int, tp: int, layer_bits: tuple[int, ...] | None = None) -> ActivationPolicy:
    """The activation policy a precision section asks for, with the loss path pp and tp need."""
    from agoq.parallel.inflight import loss_recompute_needed, loss_weight_grad_in_forward

    policy = make_policy(
        pr.activations, fmt=pr.activation_format, layer_bits=layer_bits, fused_loss=pr.fused_loss, checkpoint_format=pr.checkpoint_format
    )
    return with_loss_path(policy, recompute=loss_recompute_needed(pp), weight_grad_in_forward=loss_weight_grad_in_forward(pp, tp))


def layer_bits_for(
    pr: PrecisionSection,
    p: ParallelSection,
    seq_len: int,
    model_cfg: LlamaConfig,
    micro_batch: int,
    policy: ActivationPolicy,
    layout: PipelineLayout,
    dtype: torch.dtype,
) -> tuple[int, ...] | None:
    """Per-layer bit widths: None (uniform), or stage-aware (DBCA) from the schedule's in-flight counts under ``policy``."""
    if pr.activations == "bf16":
        return None
    from agoq.quant import parse_format

    fmt = parse_format(pr.activation_format)
    if pr.stage_bits == "uniform" or p.pp == 1 or fmt.kind != "int":
        return None
    from agoq.parallel.dbca import stage_layer_bits

    seq_per_rank = seq_len // p.tp  # sequence parallelism: each tp rank holds seq / tp tokens
    return tuple(stage_layer_bits(model_cfg, layout, micro_batch, seq_per_rank, policy, fmt.bits, dtype=dtype, tp=p.tp))


def rank_policy(
    pr: PrecisionSection, p: ParallelSection, seq_len: int, model_cfg: LlamaConfig, micro_batch: int, layout: PipelineLayout, dtype: torch.dtype
) -> tuple[tuple[int, ...] | None, ActivationPolicy]:
    """The run's layer bits and activation policy, built once: the section's policy, and the same
    policy with the DBCA bits it sizes (None: every layer keeps the section's format)."""
    policy = make_policy_for(pr, p.pp, p.tp)
    layer_bits = layer_bits_for(pr, p, seq_len, model_cfg, micro_batch, policy, layout, dtype)
    return layer_bits, policy if layer_bits is None else replace(policy, layer_bits=layer_bits)


def rank_layer_bits(pr: PrecisionSection, layer_bits: tuple[int, ...] | None, layers: list[int]) -> list[int] | str:
    """Bit width of each of ``layers`` (16 = kept bf16), or "bf16" for the bf16 policy."""
    if pr.activations == "bf16":
        return "bf16"
    if layer_bits is None:
        from agoq.quant import parse_format

        return [parse_format(pr.activation_format).bits] * len(layers)
    return [layer_bits[i] for i in layers]


def setup_distributed(p: ParallelSection) -> RankContext:
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
        from agoq.launch.forkserver import LOOPBACK_ENV
        from agoq.launch.loopback import process_group_store

        if os.environ.get(LOOPBACK_ENV) == "1":  # a local run: every endpoint on 127.0.0.1
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=process_group_store(), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend)
    world = dist.get_world_size()
    wanted = p.pp * p.dp * p.tp
    if world != wanted:
        raise RuntimeError(
            f"the launcher started {world} processes but parallel.pp x parallel.dp x parallel.tp = {wanted}; "
            f"launch with --nproc-per-node x nodes = {wanted} or change the config"
        )
    mesh = make_mesh(world, p.pp, device.type, tp=p.tp)
    pp_rank = mesh["pp"].get_local_rank()
    return RankContext(
        rank=dist.get_rank(),
        world=world,
        pp_rank=pp_rank,
        dp_rank=mesh["dp"].get_local_rank(),
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        device=device,
        tp_rank=mesh["tp"].get_local_rank(),
        tp_group=mesh["tp"].get_group(),
        tp=p.tp,
        dp=p.dp,
        stages=rank_stages(p.schedule, pp_rank, p.pp, p.virtual_stages),
        owns_group=owns_group,
    )


def worker_choices(cfg: TrainConfig, device: torch.device, choices: ResolvedChoices | None) -> ResolvedChoices:
    """The run's decided compute dtype and quantization backend, with this process's backend set to it.

    The local launcher decides before the workers start and passes its choices; under torchrun
    nothing decided before launch (agoq.launch.run.resolve_auto_choices), so the workers do, alike
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


def prepare_rank_data(d: DataSection, rank: int) -> TokenData:
    """Tokenizer and packed tokens; rank 0 builds the cache, the others then read it."""
    from agoq.data.tokens import prepare_data

    def build() -> TokenData:
        # The launcher (or, under torchrun, rank 0) verified the token file's digest: the others only read it.
        return prepare_data(d.corpus if d.corpus != "kjv" else None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction, verify=rank == 0)

    if rank == 0:
        data = build()
        dist.barrier()
    else:
        dist.barrier()
        data = build()
    return data


def build_stage_modules(
    model_cfg: LlamaConfig,
    ctx: RankContext,
    policy: ActivationPolicy,
    layout: PipelineLayout,
    dtype: torch.dtype,
    seed: int,
    recompute_layers: int = 0,
    compile_layers: bool = False,
    tp_counter: CommCounter | None = None,
) -> list[Llama]:
    """This rank's Llama slices, one per pipeline stage it runs, initialised from ``seed`` (under
    tp > 1, this rank's tp shard of each: the same initial model at every tp); the first
    ``recompute_layers`` of each stage recompute in backward."""
    ranges = layout.stage_ranges(model_cfg.n_layers)
    modules: list[Llama] = []
    for s in ctx.stages:
        m = Llama(model_cfg, policy, layers=ranges[s], embed=s == 0, head=s == layout.num_stages - 1)
        m.reset_parameters(seed)
        m.recompute = set(list(ranges[s])[:recompute_layers])
        m = m.to(device=ctx.device, dtype=dtype)
        if ctx.tp > 1:
            from agoq.parallel.tensor_model import shard_llama

            m = shard_llama(m, ctx.tp_group, tp_counter)
        if compile_layers:
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


def build_gradient_path(
    pr: PrecisionSection, p: ParallelSection, optim: OptimSection, params: list[tuple[str, nn.Parameter]], ctx: RankContext
) -> tuple[GradientSync, Any]:
    """The gradient sync over the dp group and the optimizer that reads it: ZeRO-1's sharded pair, or
    the full buffer (8-bit, fp32 or bf16 all-reduce) with AdamW on fp32 masters."""
    node_size = p.node_size or min(p.dp, int(os.environ.get("LOCAL_WORLD_SIZE", p.dp)))  # hier-8/4; the 8-bit all-gather at pp = tp = 1
    sync = make_gradient_sync(pr.gradients, params, ctx.dp_group, ctx.device, p.microbatches, pr.gradient_block, sharded=p.zero1, node_size=node_size)
    if p.zero1:
        from agoq.train.zero1 import Zero1Optimizer

        return sync, Zero1Optimizer(params, optim, sync)
    return sync, MasterWeightOptimizer(params, optim)


def build_pipeline(p: ParallelSection, ctx: RankContext, modules: list[Llama], num_stages: int) -> Pipeline:
    """This rank's torch pipeline stages and the schedule that runs them, with the loss on the last stage."""
    from agoq.parallel.pipeline import build_schedule, build_stages

    last = modules[-1] if ctx.stages[-1] == num_stages - 1 else None
    loss = StageLoss(last, p.microbatches)
    stages = build_stages([StageForward(m) for m in modules], ctx.stages, num_stages, group=ctx.pp_group, device=ctx.device)
    # Every rank passes the loss: torch enables the backward passes only where one is given.
    # Gradients leave p.grad as soon as they accumulate (into the fp32 or 8-bit buffer), so
    # torch's post-step division by the micro-batch count would find nothing: the loss is
    # divided instead, and the recorded losses are summed back.
    return Pipeline(stages, build_schedule(p.schedule, stages, p.microbatches, loss, scale_grads=False), loss)


def loop_settings(cfg: TrainConfig) -> LoopSettings:
    """How the Trainer's loop runs, from the train, optim, parallel, data and checkpoint sections."""
    t = cfg.train
    return LoopSettings(
        steps=t.steps,
        microbatches=cfg.parallel.microbatches,
        tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
        optim=cfg.optim,
        eval_every=t.eval_every,
        log_every=t.log_every,
        max_skipped_steps=t.max_skipped_steps,
        checkpoint_every=cfg.checkpoint.every,
    )


def build_run(cfg: TrainConfig, choices: ResolvedChoices | None = None, group_ready: Callable[[], object] | None = None) -> LaunchedRun:
    """This rank's Trainer for ``cfg``, and what the launch decided on the way.

    ``choices``: the local launcher's decisions for the config's ``auto`` values (None under
    torchrun: the workers decide); ``group_ready`` is called once this rank has joined the group.
    """
    from agoq.data.tokens import TrainSampler, validation_batches
    from agoq.launch.resume import checkpoint_layout, checkpoint_root

    p, pr, d = cfg.parallel, cfg.precision, cfg.data
    ctx = setup_distributed(p)
    if group_ready is not None:
        group_ready()
    choices = worker_choices(cfg, ctx.device, choices)
    torch.manual_seed(cfg.train.seed)
    data = prepare_rank_data(d, ctx.rank)
    # The model the opening lines announce: its vocabulary is data.vocab_size or the tokenizer
    # file's (a BPE that found fewer tokens on a small corpus leaves the last rows unused).
    model_cfg = cfg.model_config()
    micro_batch = d.batch_size // p.dp // p.microbatches
    layout = pipeline_layout(p)
    layer_bits, policy = rank_policy(pr, p, d.seq_len, model_cfg, micro_batch, layout, choices.dtype)
    tp_counter = CommCounter()
    modules = build_stage_modules(model_cfg, ctx, policy, layout, choices.dtype, cfg.train.seed, pr.recompute_layers, cfg.train.compile, tp_counter)
    params = named_parameters_of(modules, ctx)
    pipeline = build_pipeline(p, ctx, modules, layout.num_stages) if p.pp > 1 else None
    sync, optimizer = build_gradient_path(pr, p, cfg.optim, params, ctx)
    val = validation_batches(data.val, d.seq_len, d.batch_size, ctx.dp_rank, p.dp, cfg.train.eval_batches) if cfg.uses_validation() else []
    components = Components(
        ctx=ctx,
        modules=modules,
        params=params,
        policy=policy,
        sync=sync,
        optimizer=optimizer,
        loader=TrainSampler(data.train, d.seq_len, d.batch_size, ctx.dp_rank, p.dp, cfg.train.seed),
        val_batches=val,
        pipeline=pipeline,
        layer_bits=rank_layer_bits(pr, layer_bits, [i for m in modules for i in m.layer_range]),
        # tp-replicated parameters (norm weights): every tp rank holds the same reduced gradient.
        replicated=replicated_over_tp(modules, ctx),
        tp_counter=tp_counter,
        model_config=model_cfg,
        checkpointer=Checkpointer(checkpoint_root(cfg), cfg.checkpoint.keep, checkpoint_layout(cfg), choices.config_dict(cfg), data.fingerprints()),
        metrics=JsonlWriter(Path(cfg.train.out_dir) / "metrics" / f"rank{ctx.rank}.jsonl"),
    )
    return LaunchedRun(Trainer(components, loop_settings(cfg)), choices, data, model_cfg)
