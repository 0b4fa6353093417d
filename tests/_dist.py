"""Run a function on a real gloo process group of several local processes."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Call fn(rank, world_size, *args) on each rank of a gloo group; return the results by rank.

    ``fn`` must be a module-level function (it is pickled into spawned processes). Any exception on
    any rank fails the caller with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join()
    if errors:
        raise AssertionError("distributed check failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
