"""A whole training run: launch the ranks, train, evaluate, checkpoint, summarise."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agoq.train.config import TrainConfig
from agoq.train.metrics import Progress, peak_rss_bytes, plot_loss, summary_table


def _describe(cfg: TrainConfig) -> str:
    p, pr = cfg.parallel, cfg.precision
    return (
        f"model {cfg.model.preset}, pp={p.pp} x dp={p.dp} ({p.schedule}, {p.microbatches} micro-batches), "
        f"activations {pr.activations} ({pr.activation_format}, stage bits {pr.stage_bits}), gradients {pr.gradients}, "
        f"{cfg.train.steps} steps of {cfg.data.batch_size} x {cfg.data.seq_len} tokens"
    )


def _measure_baseline(trainer: Any) -> dict[str, Any]:
    """Saved-activation peak of one step under the bf16 policy, on a held-out batch, no update."""
    from agoq.activation import make_policy

    policy = trainer.policy
    for m in trainer.modules:
        m.set_policy(make_policy("bf16"))
    x, y = trainer.val[0]
    trainer.sync.start_step()
    with trainer.tracker:
        trainer.forward_backward(x, y)
    peak = trainer.tracker.step_peak_bytes
    trainer.sync.finish_step()
    for m in trainer.modules:
        m.set_policy(policy)
    return {"peak_saved_bytes": peak}


def train_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Entry point of every rank; rank 0 returns the run summary, the others their records and stats."""
    from agoq.train.trainer import Trainer

    trainer = Trainer(cfg)
    ctx = trainer.ctx
    ckpt_root = Path(cfg.train.out_dir) / "checkpoints"
    state = trainer.checkpoint_state()
    if cfg.checkpoint.every or cfg.checkpoint.resume:
        from agoq.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    if cfg.checkpoint.resume and latest_checkpoint(ckpt_root) is not None:
        step, extra = load_checkpoint(ckpt_root, state["model"], state["optimizer"], layout=trainer.layout())
        trainer.load_extra(step, extra)
    progress = Progress(cfg.train.steps, initial=trainer.step, enabled=ctx.rank == 0)
    records: list[dict[str, Any]] = []
    while trainer.step < cfg.train.steps:
        rec = trainer.train_step()
        last = trainer.step == cfg.train.steps
        if cfg.train.eval_every and (trainer.step % cfg.train.eval_every == 0 or last):
            rec["val_loss"] = trainer.evaluate()
        trainer.metrics.write(rec)
        records.append(rec)
        progress.update(trainer.step, rec["loss"], rec["tokens_per_s"])
        if cfg.checkpoint.every and (trainer.step % cfg.checkpoint.every == 0 or last):
            save_checkpoint(
                ckpt_root, trainer.step, state["model"], state["optimizer"], trainer.extra_state(),
                keep=cfg.checkpoint.keep, layout=trainer.layout(), config=cfg.to_dict(),
            )
    progress.close()
    # After training, so torch's one-off first-step shape inference is behind both measurements.
    baseline = _measure_baseline(trainer) if cfg.train.baseline and cfg.precision.activations != "bf16" else None
    # The first step also holds the graph of torch's shape inference; later steps do not.
    measured = records[1:] or records
    peak_saved = max((r["peak_saved_bytes"] for r in measured), default=0)
    probe = next((r for r in records if r.get("memory_probe")), {})
    mine = {
        "rank": ctx.rank,
        "pp_rank": ctx.pp_rank,
        "dp_rank": ctx.dp_rank,
        "stages": ctx.stages,
        "layer_bits": trainer.stage_layer_bits(),
        "peak_saved_bytes": peak_saved,
        "peak_temporary_bytes": probe.get("peak_temporary_bytes"),
        "peak_temporary_bytes_by_phase": probe.get("peak_temporary_bytes_by_phase"),
        "peak_step_bytes": probe.get("peak_step_bytes"),
        "wire_bytes_per_step": trainer.sync.wire_bytes_last_step,
        "fp32_wire_bytes_per_step": trainer.sync.fp32_wire_bytes(),
        "grad_buffer_bytes": trainer.sync.buffer_bytes(),
        "optimizer_bytes": trainer.optimizer.state_bytes(),
        "param_bytes": sum(p.numel() * p.element_size() for _, p in trainer.params),
        "peak_tensor_bytes": None,
        "peak_rss_bytes": peak_rss_bytes(),
        "baseline_peak_saved_bytes": None if baseline is None else baseline["peak_saved_bytes"],
    }
    if mine["peak_step_bytes"] is not None:
        # Close to what a GPU's max_memory_allocated reports, counted on any device: the persistent
        # state plus the step's joint peak of saved activations and temporaries (small persistent
        # buffers, such as the pipeline's receive buffers, are not included).
        mine["peak_tensor_bytes"] = mine["param_bytes"] + mine["grad_buffer_bytes"] + mine["optimizer_bytes"] + mine["peak_step_bytes"]
    gathered: list[Any] = [None] * ctx.world
    dist.all_gather_object(gathered, mine)
    summary = None
    if ctx.rank == 0 and records:
        # The first step includes one-time setup; the memory probe step counts every allocation.
        timed = [r for r in records[1:] if not r.get("memory_probe")] or records
        run = {
            "final_loss": records[-1]["loss"],
            "val_loss": next((r["val_loss"] for r in reversed(records) if r.get("val_loss") is not None), None),
            "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
            "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
            "steps": trainer.step,
        }
        base = None
        if baseline is not None:
            base = {"ranks": {str(g["rank"]): {"peak_saved_bytes": g["baseline_peak_saved_bytes"]} for g in gathered}}
        summary = {"description": _describe(cfg), "config": cfg.to_dict(), "run": run, "ranks": gathered, "baseline": base, "records": records}
        out = Path(cfg.train.out_dir)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_loss(records, out / "loss.png", f"agoq train: {cfg.model.preset}, {cfg.precision.activations} activations, {cfg.precision.gradients} gradients")
        print("\n" + summary_table(summary), flush=True)
        print(f"\nmetrics: {out / 'metrics'}/rank*.jsonl, summary: {out / 'summary.json'}, loss curve: {out / 'loss.png'}", flush=True)
    trainer.metrics.close()
    dist.barrier()
    if ctx.owns_group:
        dist.destroy_process_group()
    return summary if ctx.rank == 0 else {"rank": ctx.rank, "records": records, "stats": mine}


def resolve_auto_choices(cfg: TrainConfig) -> None:
    """Replace compute_dtype and quant_backend 'auto' by what suits this machine and run, and say which and why."""
    from agoq.train.compute_dtype import choose_quant_backend, compute_dtype_for, worker_threads

    pr = cfg.precision
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if pr.compute_dtype == "auto":
        choice = compute_dtype_for(cfg, device, worker_threads(cfg.world_size))
        pr.compute_dtype = choice.name
        print(f"agoq train: compute dtype {choice.name} ({choice.reason})", flush=True)
    if pr.quant_backend == "auto":
        quant = choose_quant_backend("auto", device, cfg.train.steps)
        pr.quant_backend = quant.name
        print(f"agoq train: quantization {quant.name} ({quant.reason})", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: TrainConfig, max_restarts: int = 0) -> dict[str, Any] | None:
    """Run the training: in place under torchrun, else spawn pp x dp local processes with torch's launcher."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return train_worker(cfg)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    Path(cfg.train.out_dir).mkdir(parents=True, exist_ok=True)
    # Build the tokenizer and token file once, here: a bad corpus fails before any worker starts,
    # and the workers only read the cache.
    from agoq.train.data import prepare_data

    d = cfg.data
    prepare_data(d.corpus if d.corpus != "kjv" else None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction)
    resolve_auto_choices(cfg)
    # torch 2.13 shares one rendezvous store across restart rounds, which can hand restarted gloo
    # workers the dead round's addresses ("Connection refused"); a fresh store per round avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"agoq-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=max_restarts,
        start_method="spawn",
        monitor_interval=0.5,
    )
    results = elastic_launch(config, train_worker)(cfg)
    return results.get(0)
