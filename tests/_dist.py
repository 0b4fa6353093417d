"""Run a function on a real gloo process group of several local processes."""

from __future__ import annotations

import os
import queue as queue_module
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agoq.launch.forkserver import LauncherOutput, start_method, workers_environment
from agoq.launch.loopback import HOST, loopback_store


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, env: dict[str, str], output: LauncherOutput) -> None:
    # Forked from the fork server, a worker has the server's environment and output: this check's
    # are the caller's.
    output.install()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        # Every rank is a client of the parent's store: no rank binds a port that another process
        # could have taken since it was chosen (the race that hung a whole check until its timeout).
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# A whole distributed check; the slowest (tests/test_train.py's runs) take about a minute on 2 cores.
TIMEOUT_S = 600
# Once one rank has failed, the others are usually blocked in a collective that will never complete:
# they get this long to report their own failure, then are killed (the failure is the first rank's).
AFTER_FAILURE_S = 20
# How often the parent looks for a rank that died without reporting (killed, or crashed in C++).
POLL_S = 1.0


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
        store, port = loopback_store(timeout=timedelta(seconds=timeout))
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env, LauncherOutput())) for r in range(world_size)]
        for p in procs:
            p.start()
    try:
        return _collect(procs, queue, world_size, timeout)
    finally:
        del store  # the workers are gone: close its socket


def _collect(procs: list, queue: Any, world_size: int, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            if errors:
                break
            silent = sorted(set(range(world_size)) - set(results))
            for p in procs:
                p.kill()
            raise AssertionError(f"distributed check timed out after {timeout:.0f} s; ranks {silent} never answered (a hung collective?)")
        try:
            rank, status, value = queue.get(timeout=min(POLL_S, left))
        except queue_module.Empty:
            # A rank that exited without a word (killed, a crash below Python) fails the check now:
            # its peers would otherwise wait in a collective until the timeout.
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            _drain(queue, results, errors)  # a report may have landed since the wait ended
            for rank in dead:
                if rank not in results and rank not in errors:
                    errors[rank] = f"exited with code {procs[rank].exitcode} before reporting (its stderr is above)"
                    deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
            continue
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = value
            deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
    for p in procs:
        p.join(timeout=5 if errors else 60)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed check failed\n" + "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _drain(queue: Any, results: dict[int, Any], errors: dict[int, str]) -> None:
    while True:
        try:
            rank, status, value = queue.get_nowait()
        except queue_module.Empty:
            return
        (results if status == "ok" else errors)[rank] = value
