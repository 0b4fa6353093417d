"""Run a function on a real gloo process group of several local processes."""

from __future__ import annotations

import os
import queue as queue_module
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agoq.train.forkserver import start_method, workers_environment
from agoq.train.loopback import free_port


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, env: dict[str, str]) -> None:
    # Forked from the fork server, a worker has the server's environment: this check's is the caller's.
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# A whole distributed check; the slowest (tests/test_train.py's runs) take about a minute on 2 cores.
TIMEOUT_S = 600
# Once one rank has failed, the others are usually blocked in a collective that will never complete:
# they get this long to report their own failure, then are killed (the failure is the first rank's).
AFTER_FAILURE_S = 20


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = TIMEOUT_S) -> list[Any]:
    """Call fn(rank, world_size, *args) on each rank of a gloo group; return the results by rank.

    ``fn`` must be a module-level function (it is pickled into spawned processes). Any exception on
    any rank fails the caller with that rank's traceback; ranks that have not answered within
    ``timeout`` seconds (a hung collective) are killed and named in the failure.
    """
    # The workers fork from agoq's fork server, which has torch and agoq imported (spawning 4 ranks
    # that each import them took about 4.5 s on 2 cores), in the environment a local run gives its
    # workers; where this process's variables read at import differ from the server's, they spawn.
    with workers_environment():
        ctx = mp.get_context(start_method())
        env = dict(os.environ)
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env)) for r in range(world_size)]
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    for _ in range(world_size):
        try:
            rank, status, value = queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue_module.Empty:
            if errors:
                break
            silent = sorted(set(range(world_size)) - set(results) - {int(e.split()[1].rstrip(":")) for e in errors})
            for p in procs:
                p.kill()
            raise AssertionError(f"distributed check timed out after {timeout:.0f} s; ranks {silent} never answered (a hung collective?)") from None
        if status == "ok":
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
            deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
    for p in procs:
        p.join(timeout=5 if errors else 60)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed check failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
