"""The same model and data trained by peers: plain PyTorch DDP, DeepSpeed ZeRO-1, and ``agoq train``.

Every run trains agoq.models.Llama (tiny preset) on the KJV with the same sampler, seed and tokens
per step, data parallel over 2 gloo processes, AdamW with the same warmup + cosine schedule and
gradient clipping. The peers run the plain (unfused) loss with bf16 compute; ``agoq train`` runs
pp=1 x dp=2 with the bf16 policy, as full AGoQ, and as full AGoQ with ZeRO-1. A peer that cannot
run records its error. Each run is then repeated for a few steps with every tensor it allocates
counted, the same way for all of them, for a peak-memory figure that the torch runtime's own
resident memory does not drown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "plain torch DDP and DeepSpeed ZeRO-1 vs agoq train (pp=1 x dp=2) on the same model, data and tokens per step"

DP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length and where runs go."""
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (the first two are not timed)")
    add_out_dir(parser, "agoq train's runs (default: under runs/bench_peers)")


# agoq train at pp=1 x dp=2, one micro-batch per step (the peers' batch), per precision policy.
AGOQ_RUNS = {
    "agoq_train_bf16": ["--precision.activations=bf16", "--precision.gradients=fp32"],
    "agoq_train_agoq": ["--precision.activations=agoq", "--precision.gradients=int8"],
    "agoq_train_agoq_zero1": ["--precision.activations=agoq", "--precision.gradients=int8", "--parallel.zero1=true"],
}
MEMORY_STEPS = 3  # steps run under the tensor count (the peak is reached by the second)


def _peer_worker(rank: int, peer: str, steps: int, port: int, queue: Any, count_tensors: bool = False) -> None:
    """One data-parallel rank of a run; puts (rank, result-or-error) on the queue.

    With ``count_tensors`` the run is short and every tensor it allocates, from before the model
    is built, is counted (agoq.train.saved.StepAllocations): its peak is what a GPU's
    max_memory_allocated would report, measured the same way for every framework.
    """
    import torch

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(DP), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(DP)
    )
    try:
        if count_tensors:
            from agoq.train.saved import SavedActivationTracker

            with SavedActivationTracker().temporaries() as allocations:
                _run_loop(rank, peer, MEMORY_STEPS)
            queue.put((rank, {"peak_tensor_bytes": allocations.peak_bytes}))
        else:
            queue.put((rank, _run_loop(rank, peer, steps)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))


def _run_loop(rank: int, peer: str, steps: int) -> dict[str, Any]:
    return _agoq_loop(peer, steps) if peer in AGOQ_RUNS else _peer_loop(rank, peer, steps)


def _agoq_loop(label: str, steps: int) -> dict[str, Any]:
    """``agoq train`` in this process, as one rank of the dp group."""
    import tempfile

    from agoq.launch.run import train_worker

    with tempfile.TemporaryDirectory() as out:
        return train_worker(_agoq_config(label, steps, Path(out)))


def _agoq_config(label: str, steps: int, out_dir: Path) -> Any:
    """``agoq train`` at pp=1 x dp=2, one micro-batch per step (the peers' batch), under ``label``'s policy."""
    from agoq.launch.config import load_config

    return load_config(
        None,
        [
            *AGOQ_RUNS[label],
            "--parallel.pp=1",
            f"--parallel.dp={DP}",
            "--parallel.microbatches=1",
            f"--train.steps={steps}",
            "--train.eval_every=0",
            "--train.baseline=false",
            "--checkpoint.every=0",
            "--checkpoint.resume=false",
            f"--train.out_dir={out_dir}",
        ],
    )


def _peer_loop(rank: int, peer: str, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from agoq.gradient.buffer import DEFAULT_BUCKET_BYTES
    from agoq.models import Llama
    from agoq.launch.config import load_config
    from agoq.data.tokens import TrainSampler, prepare_data
    from agoq.train.optim import lr_at, no_weight_decay

    cfg = load_config(None, [])
    d, o = cfg.data, cfg.optim
    data = prepare_data(None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction)
    sampler = TrainSampler(data.train, d.seq_len, d.batch_size, rank, DP, cfg.train.seed)
    model = Llama(cfg.model_config())  # the bf16 policy and the plain loss: what a peer trains
    model.reset_parameters(cfg.train.seed)

    def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
        named = list(m.named_parameters())
        return [
            {"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": o.weight_decay},
            {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0},
        ]

    if peer == "ddp":
        dist.init_process_group("gloo", rank=rank, world_size=DP)
        engine = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(groups(model), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)

        def train_step(x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = engine(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    elif peer == "deepspeed_zero1":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        ds_config = {
            "train_micro_batch_size_per_gpu": d.batch_size // DP,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": o.grad_clip,
            "bf16": {"enabled": True},
            # Buckets of DDP's and agoq's size (25 MiB of fp32): DeepSpeed's default of 5e8 values
            # allocates a 1 GiB bucket whatever the model.
            "zero_optimization": {"stage": 1, "reduce_bucket_size": DEFAULT_BUCKET_BYTES // 4, "allgather_bucket_size": DEFAULT_BUCKET_BYTES // 4},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        # torch's AdamW, not DeepSpeedCPUAdam: the same optimizer as the other runs, and no C++ build.
        opt = torch.optim.AdamW(groups(model), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

        def train_step(x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
            for g in opt.param_groups:
                g["lr"] = lr
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
    else:
        raise ValueError(f"unknown peer {peer!r}; use ddp or deepspeed_zero1")

    from agoq.train.metrics import peak_rss_bytes

    losses, times = [], []
    for step in range(steps):
        x, y = sampler.next_batch()
        t0 = time.perf_counter()
        loss = train_step(x, y, lr_at(step, o, steps))
        times.append(time.perf_counter() - t0)
        t = torch.tensor([loss])
        dist.all_reduce(t)
        losses.append(t.item() / DP)
    out = {
        "losses": losses,
        "step_time_s": statistics.fmean(times[2:] or times),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    dist.barrier()
    dist.destroy_process_group()
    return out


def _spawn(peer: str, steps: int, count_tensors: bool) -> dict[int, dict[str, Any]]:
    """Run DP ranks of one run in fresh processes; rank -> result."""
    import torch.multiprocessing as mp

    from agoq.launch.loopback import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_peer_worker, args=(r, peer, steps, port, queue, count_tensors)) for r in range(DP)]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in range(DP))
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return got


def tensor_peaks(run: str) -> dict[str, Any]:
    """A short run of ``run`` with every tensor counted: the largest peak over ranks, or the error."""
    got = _spawn(run, MEMORY_STEPS, count_tensors=True)
    errors = [got[r]["error"] for r in sorted(got) if "error" in got[r]]
    if errors:
        return {"tensor_count_error": errors[0]}
    peaks = [got[r]["peak_tensor_bytes"] for r in sorted(got)]
    return {"peak_tensor_bytes": max(peaks), "peak_tensor_bytes_per_rank": peaks}


def run_peer(peer: str, steps: int) -> dict[str, Any]:
    """Spawn DP ranks of one peer; per-rank results, or the first error."""
    got = _spawn(peer, steps, count_tensors=False)
    errors = [got[r]["error"] for r in sorted(got) if "error" in got[r]]
    if errors:
        return {"run": peer, "error": errors[0]}
    r0 = got[0]
    return {
        "run": peer,
        "final_loss": r0["losses"][-1],
        "losses": r0["losses"],
        "step_time_s": max(got[r]["step_time_s"] for r in got),
        "peak_rss_bytes": max(got[r]["peak_rss_bytes"] for r in got),
        "peak_rss_bytes_per_rank": [got[r]["peak_rss_bytes"] for r in sorted(got)],
    }


def run_agoq(label: str, steps: int, out_dir: Path) -> dict[str, Any]:
    """``agoq train`` launched as usual (its own processes), timed and summarised like a peer."""
    from agoq.launch.run import launch

    cfg = _agoq_config(label, steps, out_dir / label)
    s = launch(cfg)
    recs = s["records"]
    return {
        "run": label,
        "final_loss": s["run"]["final_loss"],
        "losses": [r["loss"] for r in recs],
        "step_time_s": statistics.fmean(r["step_time_s"] for r in (recs[2:] or recs)),
        "peak_rss_bytes": max(g["peak_rss_bytes"] for g in s["ranks"]),
        "peak_rss_bytes_per_rank": [g["peak_rss_bytes"] for g in s["ranks"]],
        "peak_saved_bytes": max(g["peak_saved_bytes"] for g in s["ranks"]),
        "optimizer_bytes": max(g["optimizer_bytes"] for g in s["ranks"]),
        "wire_bytes_per_step": max(g["wire_bytes_per_step"] for g in s["ranks"]),
    }


def run(args: argparse.Namespace) -> int:
    """Train with each peer and with agoq train, then write the JSON and a markdown table."""
    from benchmarks._common import write_result

    rows = [run_peer("ddp", args.steps), run_peer("deepspeed_zero1", args.steps)]
    out = Path(args.out_dir or "runs/bench_peers")
    rows += [run_agoq(label, args.steps, out) for label in AGOQ_RUNS]
    for r in rows:
        if "error" not in r:
            r.update(tensor_peaks(r["run"]))
    base = rows[0] if "error" not in rows[0] else None
    for r in rows:
        if base is not None and "error" not in r:
            r["step_time_vs_ddp"] = r["step_time_s"] / base["step_time_s"]
            r["peak_rss_vs_ddp"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
            if "peak_tensor_bytes" in r and "peak_tensor_bytes" in base:
                r["peak_tensor_vs_ddp"] = r["peak_tensor_bytes"] / base["peak_tensor_bytes"]
    results = {
        "config": f"tiny LLaMA (agoq.models.Llama), KJV, dp={DP} over gloo, 16 x 128 tokens per step (8 sequences per rank), AdamW 3e-3 warmup + cosine, clip 1.0, seed 0",
        "steps": args.steps,
        "rows": rows,
    }
    command = f"python -m benchmarks.peers --steps {args.steps}" + (f" --out-dir {args.out_dir}" if args.out_dir else "")
    write_result("peers", results, command=command, out_dir=args.out_dir)
    print(readme_markdown(results))
    return 0


def readme_markdown(results: dict[str, Any]) -> str:
    """Peak memory per rank, step time and final loss side by side."""
    mib = 2**20
    what = {
        "ddp": "PyTorch DDP, fp32 weights, bf16 autocast, torch AdamW",
        "deepspeed_zero1": "DeepSpeed ZeRO-1, bf16 weights, fp32 master shards, torch AdamW, 25 MiB buckets",
        "agoq_train_bf16": "agoq train, bf16 policy, fp32 all-reduce",
        "agoq_train_agoq": "agoq train, full AGoQ (4-bit activations, 8-bit gradients)",
        "agoq_train_agoq_zero1": "agoq train, full AGoQ + ZeRO-1 (optimizer state sharded, as DeepSpeed's)",
    }
    lines = [
        f"{results['config']}; {results['steps']} steps, mean step time after the first two. Peak tensors: every tensor "
        f"allocated from before the model is built, counted the same way for every run over a separate {MEMORY_STEPS}-step run "
        "(about what a GPU's max_memory_allocated would show); peak RSS includes the ~0.5 GiB of an imported torch. Both are the largest over ranks.",
        "",
        "| run | what | peak tensors MiB / rank | vs DDP | peak RSS MiB / rank | s / step | vs DDP | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        if "error" in r:
            last = [x for x in r["error"].strip().splitlines() if x.strip()][-1]
            lines.append(f"| {r['run']} | {what.get(r['run'], '')} | could not run: `{last[:160]}` | | | | | |")
            continue
        tensors = f"{r['peak_tensor_bytes'] / mib:.2f} | {r.get('peak_tensor_vs_ddp', 1):.2f}x" if "peak_tensor_bytes" in r else "not counted | "
        lines.append(
            f"| {r['run']} | {what.get(r['run'], '')} | {tensors} | {r['peak_rss_bytes'] / mib:.0f} | "
            f"{r['step_time_s']:.3f} | {r.get('step_time_vs_ddp', 1):.2f}x | {r['final_loss']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.peers``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
