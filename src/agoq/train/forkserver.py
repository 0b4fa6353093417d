"""The fork server that a local run's workers start from, and the environment they run in.

Local workers fork from one server process that has torch, its compiler and agoq imported, instead
of importing them each (which cost every worker its own import time at the start).
:func:`start_early` starts it when ``agoq train`` begins, so that this happens on a second core
while the launcher imports, reads its config and prepares the data, instead of after it.

Standard library only, so that importing it costs nothing before the server is started.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
from contextlib import contextmanager
from typing import Iterator

# The environment this module was imported with: in a worker forked from the fork server, the
# server's; the launcher's per-rank variables are what differs from it (adopt_launcher_env).
_ENV_AT_IMPORT = dict(os.environ)
# What the fork server imports once, before any worker forks from it.
FORKSERVER_PRELOAD = ("agoq.train.run", "agoq.train.trainer", "agoq.quant.compiled", "torch._dynamo", "torch._inductor.compile_fx")
# Variables that libraries read when they are imported (thread pools, CPU capability, compiler
# and cache settings): a fork server started with other values cannot serve this launch.
_IMPORT_TIME_ENV = ("TORCH", "ATEN_", "ONEDNN", "DNNL", "OMP_", "GOMP", "KMP_", "MKL", "CUDA", "NCCL", "GLOO", "TRITON", "PYTHON", "LD_", "AGOQ")
_forkserver_env: dict[str, str] | None = None
# Set by the local launcher in its workers' environment: host the process-group store on loopback
# (agoq.train.loopback).
LOOPBACK_ENV = "AGOQ_LOOPBACK"


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (or another launcher) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def loopback_interface() -> str | None:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def local_worker_env() -> dict[str, str]:
    """The variables a local run adds to its workers' environment (the rest is the launcher's)."""
    iface = loopback_interface()
    return {
        # torch 2.13 shares one rendezvous store across restart rounds, which can hand restarted
        # gloo workers the dead round's addresses ("Connection refused"); a fresh one per round avoids it.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
        LOOPBACK_ENV: "1",
        **({"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", iface)} if iface else {}),
    }


@contextmanager
def workers_environment() -> Iterator[None]:
    """This process's environment plus :func:`local_worker_env` for the block, then as it was."""
    extra = local_worker_env()
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_ENV)}


def start_method() -> str:
    """'forkserver' (workers fork from a process that has torch and agoq imported) when this
    process's fork server was, or is about to be, started with the variables read at import that
    this launch has; 'spawn' otherwise (a long-lived process launching with a changed environment)."""
    global _forkserver_env
    if _forkserver_env is None:
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        _forkserver_env = _import_time_env()
    return "forkserver" if _forkserver_env == _import_time_env() else "spawn"


def start_early() -> None:
    """Start the fork server now, in the environment the local launcher will give its workers.

    It imports FORKSERVER_PRELOAD in the background; the launch later forks its workers from it
    (start_method() says 'forkserver' as long as the import-time variables are unchanged). Nothing
    happens under torchrun, which starts its workers itself, or where a server already runs.
    """
    if under_torchrun() or _forkserver_env is not None:
        return
    with workers_environment():
        if start_method() == "forkserver":
            multiprocessing.forkserver.ensure_running()


def adopt_launcher_env(launcher_env: dict[str, str]) -> None:
    """Make this worker's environment the launcher's, plus the per-rank variables the elastic agent set.

    A worker forked from the fork server inherits the server's environment, which is the one of the
    first launch in this process; later launches (tests, notebooks) may differ in what is read at
    run time (AGOQ_QUANT_BACKEND, ...).
    """
    per_rank = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(per_rank)
