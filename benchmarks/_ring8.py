"""The FP8-LM-style ring ablation, trained: agoq's trainer with its fp32 gradient all-reduce replaced
by :func:`agoq.gradient.collectives.ring_all_reduce_8bit` (one shared scale, partial sums re-rounded
to 8 bits at every hop).

It is a baseline that the benchmarks measure, not a training option (no ``precision.gradients``
selects it), so the hook lives here: each local rank swaps the trainer's gradient-sync factory for
the ring before it trains a config whose ``precision.gradients`` is fp32.
"""

from __future__ import annotations

import os
import queue as queue_module
import traceback
from typing import Any

# A whole run of benchmarks.convergence's default length on the 4 local ranks, with room to spare.
TIMEOUT_S = 6 * 3600


def _ring_sync(mode: str, params: list, group: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
    """The trainer's gradient sync for a config asking fp32: the same fp32 buffer, reduced along the 8-bit ring."""
    import torch

    from agoq.gradient.sync import PlainGradientSync

    if mode != "fp32" or kwargs.get("sharded"):
        raise ValueError(f"the ring8 ablation replaces the fp32 all-reduce; got precision.gradients={mode!r} (zero1: {bool(kwargs.get('sharded'))})")
    return PlainGradientSync(params, group, device, torch.float32, ring=True)


def _worker(rank: int, world: int, port: int, cfg: Any, env: dict[str, str], queue: Any) -> None:
    # Forked from agoq's fork server, a worker has the server's environment: the launcher's is this one.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    import agoq.train.trainer as trainer_module
    from agoq.train.run import train_worker

    torch.set_num_threads(1)  # a forked child's OpenMP pool, inherited from a parent that ran one, hangs in its first matmul
    trainer_module.make_gradient_sync = _ring_sync
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, "ok", train_worker(cfg)))
    except BaseException:  # every failure goes to the launcher, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def train_ring8(cfg: Any, timeout_s: float = TIMEOUT_S) -> dict[str, Any] | None:
    """Train ``cfg`` (precision.gradients = fp32) on local processes with the ring all-reduce; rank 0's summary."""
    import torch.multiprocessing as mp

    from agoq.train.data import prepare_data
    from agoq.train.forkserver import start_method, workers_environment
    from agoq.train.loopback import free_port

    if cfg.precision.gradients != "fp32":
        raise ValueError(f"the ring8 ablation replaces the fp32 all-reduce; set precision.gradients=fp32, not {cfg.precision.gradients!r}")
    d = cfg.data
    # The tokenizer and token file once, here: the workers only read the cache (as `agoq train` does).
    prepare_data(d.corpus if d.corpus != "kjv" else None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction)
    world = cfg.world_size
    with workers_environment():
        ctx = mp.get_context(start_method())
        env = dict(os.environ)
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, env, queue)) for r in range(world)]
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    except queue_module.Empty:
        errors.append(f"no answer from ranks {sorted(set(range(world)) - set(results))} within {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("the ring8 run failed\n" + "\n".join(errors))
    return results.get(0)
