"""How a local run's workers start, the environment they run in, and how they die with the launcher.

The local launcher starts its workers as torch's elastic launcher does (spawned, each a fresh
interpreter that inherits the launcher's environment unchanged); what it adds to that environment
is :func:`local_worker_env`. A worker must never outlive its launcher: an orphan would go on
writing the run folder after the launcher, and its lock, were gone (:func:`die_with_launcher`).

Standard library only, so that importing it costs nothing before torch is needed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

# Set by the local launcher in its workers' environment: host the process-group store on loopback
# (agoq.train.loopback).
LOOPBACK_ENV = "AGOQ_LOOPBACK"
# What a launcher that is not torchrun (srun scripts, mpirun wrappers) must set for torch's env://
# initialisation; torchrun sets TORCHELASTIC_RUN_ID besides.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Per-rank variables a launcher sets; the elastic agent sets each of them for every local worker.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
# How often a worker without prctl checks that its launcher lives.
LIVENESS_POLL_S = 0.5


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (or another launcher) started.

    torchrun always sets TORCHELASTIC_RUN_ID; another launcher is recognised by the full set of
    env:// variables (LAUNCHER_VARS). RANK or WORLD_SIZE alone, left in a shell, are not a launcher:
    a local run ignores them (the elastic agent sets its own for each worker), and says so
    (:func:`stray_rank_variables`).
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in LAUNCHER_VARS)


def stray_rank_variables() -> dict[str, str]:
    """The per-rank variables set in this environment although no launcher started this process."""
    if under_torchrun():
        return {}
    return {k: os.environ[k] for k in RANK_VARS if k in os.environ}


def loopback_interface() -> str | None:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def inherited_gloo_interface() -> str | None:
    """GLOO_SOCKET_IFNAME from the environment when it names another interface than loopback:
    a local run keeps it (the user chose it), but gloo's connections then leave loopback."""
    value = os.environ.get("GLOO_SOCKET_IFNAME")
    return value if value and value != loopback_interface() else None


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


def start_method() -> str:
    """How local workers start: spawned, as torch's elastic launcher starts them."""
    return "spawn"


_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux prctl); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_launcher(launcher_pid: int) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(LIVENESS_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher(launcher_pid: int) -> None:
    """Make this worker die when the launcher ``launcher_pid`` (its parent) dies, however it dies.

    On Linux the kernel kills it (PR_SET_PDEATHSIG). That signal follows the death of the parent
    *thread* that started the worker: the elastic agent starts workers from the thread that called
    the launch, which waits in it until they end, so that thread lives as long as they do. The
    launcher may have died before the worker got here: it is then no longer the parent. Without
    prctl a thread polls for the same change of parent.
    """
    if _set_parent_death_signal(signal.SIGKILL):
        if os.getppid() != launcher_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        return
    if os.getppid() != launcher_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch_launcher, args=(launcher_pid,), name="agoq-launcher-watch", daemon=True).start()
