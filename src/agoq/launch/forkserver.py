"""How a local run's workers start, the environment they run in, and how they die with the launcher.

Local workers fork from one server process that has torch and agoq imported (and what the run
needs besides: torch's pipelining, its compiler), instead of importing them each (which cost every
worker its own import time at the start). :func:`start_early` starts it as soon as ``agoq train``
has read its config file and overrides, so that its imports run on a second core while the
launcher imports torch, validates the config and prepares the data. A worker runs in the server's
environment, unchanged: the server serves only a launch whose workers' environment is the one it
was started with (:func:`start_method`); any other launch spawns its workers, as torch's elastic
launcher does.

No process of a local run outlives its launcher: an orphan would go on writing the run folder after
the launcher, and its lock, were gone. The fork server dies with the launcher
(:func:`guard_fork_server`), and each worker with its parent, the server or the launcher
(:func:`die_with_launcher`).

Standard library only, so that importing it costs nothing before the server is started.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from agoq.launch.config import TrainConfig

# Set by the local launcher in its workers' environment: host the process-group store on loopback
# (agoq.launch.loopback).
LOOPBACK_ENV = "AGOQ_LOOPBACK"
# Set by the local launcher in the environment of what it starts: its pid (guard_fork_server).
LAUNCHER_ENV = "AGOQ_LAUNCHER_PID"
# What the fork server imports once, before any worker forks from it; its guard first. Every run's
# workers need these:
FORKSERVER_PRELOAD = (
    "agoq.launch.forkserver_guard",
    "agoq.launch.run",
    "agoq.launch.components",
    # torch.optim imports Dynamo as the optimizer takes its parameters (its add_param_group is
    # wrapped to stay out of Dynamo's traces): every worker does, compiling or not.
    "torch._dynamo",
    # Rank 0 draws loss.png at the end of a run (agoq.train.metrics.plot_run); a missing optional
    # package is skipped by the server's preload.
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)
# A run with pp > 1 builds torch's pipeline schedules (imported where used: agoq.parallel.pipeline).
PIPELINE_PRELOAD = ("torch.distributed.pipelining",)
# A run that may compile: the compiled quantization backend, or train.compile.
COMPILE_PRELOAD = ("agoq.quant.compiled", "torch._inductor.compile_fx")
_forkserver_env: dict[str, str] | None = None
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
        LAUNCHER_ENV: str(os.getpid()),
        **({"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", iface)} if iface else {}),
    }


@contextmanager
def workers_environment() -> Iterator[None]:
    """This process's environment plus :func:`local_worker_env` for the block, then as it was.

    As it was whole, not only the added variables: torch's elastic launcher sets
    TORCHELASTIC_SIGNALS_TO_HANDLE in the environment of the process that launches, and left there
    it made every later launch of a long-lived process (a notebook, a test session) differ from its
    fork server's environment, so each of them spawned its workers and imported torch in every one.
    """
    saved = dict(os.environ)
    os.environ.update(local_worker_env())
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in saved]:
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v


def start_method(preload: tuple[str, ...] = FORKSERVER_PRELOAD + PIPELINE_PRELOAD + COMPILE_PRELOAD) -> str:
    """'forkserver' when this process's fork server was, or is about to be, started in the
    environment this launch gives its workers (the block of :func:`workers_environment`); 'spawn'
    otherwise (a long-lived process launching in another environment).

    A server started here imports ``preload`` first: by default what any run needs, since a
    long-lived process (a notebook, a test session) forks the workers of every later launch from it.
    """
    global _forkserver_env
    if _forkserver_env is None:
        multiprocessing.set_forkserver_preload(list(preload))
        _forkserver_env = dict(os.environ)
    return "forkserver" if _same_for_workers(_forkserver_env, dict(os.environ)) else "spawn"


class LauncherOutput:
    """The launching process's standard output and error as they are at the launch, for a worker.

    A worker forked from the fork server inherits the server's, which are where the launcher's
    output went when the server started: a long-lived process that has redirected its own since
    (pytest's capfd, a notebook) would not see its workers' lines. Passed to the worker, this
    carries the launcher's two descriptors over (multiprocessing's DupFd, while the worker is
    started); the worker calls :meth:`install` first thing.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_ReceivedOutput, (reduction.DupFd(1), reduction.DupFd(2)))

    def install(self) -> None:
        """Nothing to do in the launching process itself."""


class _ReceivedOutput:
    """:class:`LauncherOutput` in the worker: the launcher's descriptors, not yet in place."""

    def __init__(self, out: Any, err: Any) -> None:
        self._fds = (out, err)

    def install(self) -> None:
        """Make this process's fds 1 and 2 the launcher's (Python's sys.stdout and sys.stderr write to them)."""
        for target, dup in zip((1, 2), self._fds):
            fd = dup.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


# Variables a host process rewrites between launches that nothing reads at import: pytest names the
# running test in PYTEST_CURRENT_TEST, so a launch from a test process's second test would spawn
# its workers (each importing torch and agoq anew) instead of forking them from the server.
# Inductor sets _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR (an address in this process's torch) each
# time it loads a compiled C++ kernel, just before the load that reads it: once a notebook or test
# process had run one compiled graph, every later launch from it spawned its workers.
PER_CALL_VARS = frozenset({"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})


def _same_for_workers(server: dict[str, str], launch: dict[str, str]) -> bool:
    """Whether workers forked in the ``server`` environment see what ``launch`` would give them.

    Inductor sets TORCHINDUCTOR_CACHE_DIR in the process that first asks for its cache folder (the
    launcher does, deciding its backend), to the folder it derives in any process: a worker that
    asks derives the same one.
    """
    differ = {k for k in set(server) | set(launch) if server.get(k) != launch.get(k)} - PER_CALL_VARS
    if not differ:
        return True
    if differ != {"TORCHINDUCTOR_CACHE_DIR"} or "TORCHINDUCTOR_CACHE_DIR" in server or "torch" not in sys.modules:
        return False
    from agoq.compat import inductor_default_cache_dir

    return launch["TORCHINDUCTOR_CACHE_DIR"] == inductor_default_cache_dir()


def worker_preload(cfg: TrainConfig) -> tuple[str, ...]:
    """What the fork server imports for the workers of a run of ``cfg``: what every run needs, torch's
    pipelining where pp > 1, and inductor where the run may compile (train.compile, or the
    quantization backend 'compiled' or 'auto', which compiles on CPUs). A module left out is
    imported by each worker that uses it, after its fork."""
    may_compile = cfg.train.compile or cfg.precision.quant_backend in ("auto", "compiled")
    return FORKSERVER_PRELOAD + (PIPELINE_PRELOAD if cfg.parallel.pp > 1 else ()) + (COMPILE_PRELOAD if may_compile else ())


def start_early(preload: tuple[str, ...]) -> None:
    """Start the fork server now, in the environment the local launcher will give its workers.

    It imports ``preload`` (:func:`worker_preload`) in the background; the launch later forks its
    workers from it. Nothing happens under torchrun, which starts its workers itself, or where a
    server already runs.
    """
    if under_torchrun() or _forkserver_env is not None:
        return
    with workers_environment():
        if start_method(preload) == "forkserver":
            # The server starts ignoring Ctrl-C (an ignored signal stays ignored across its exec):
            # pressed while it imports multiprocessing itself, before guard_fork_server can run, it
            # printed a KeyboardInterrupt traceback beside the launcher's one line. The guard then
            # sets the handler its workers inherit, as before.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                signal.signal(signal.SIGINT, previous)


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


def _launcher_alive(launcher_pid: int) -> bool:
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _watch_launcher(launcher_pid: int) -> None:
    while _launcher_alive(launcher_pid) and os.getppid() != 1:
        time.sleep(LIVENESS_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher(launcher_pid: int) -> None:
    """Make this worker die when its parent (the launcher ``launcher_pid``, or the fork server, which
    dies with it) dies, however it dies.

    On Linux the kernel kills it (PR_SET_PDEATHSIG). That signal follows the death of the parent
    *thread* that started the worker: the fork server has one thread, and the elastic agent starts
    spawned workers from the thread that called the launch, which waits in it until they end. The
    launcher may have died before the worker got here, too late for the signal. Without prctl a
    thread polls for the launcher.
    """
    if not _launcher_alive(launcher_pid):
        os.kill(os.getpid(), signal.SIGKILL)
    if _set_parent_death_signal(signal.SIGKILL):
        if not _launcher_alive(launcher_pid):  # died in between
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_watch_launcher, args=(launcher_pid,), name="agoq-launcher-watch", daemon=True).start()


def unnamed_locks() -> None:
    """In a worker: a multiprocessing lock that a library makes with the default context (tqdm's
    write lock, on rank 0) is unnamed from here, so no exit path leaves it behind.

    Python gives a process the start method it was started with as its default: 'forkserver' or
    'spawn' here, under which a lock is a named POSIX semaphore, registered with the launcher's
    resource tracker and unregistered only by a clean exit. A worker that the launcher stops
    (SIGTERM, then SIGKILL) or that leaves with os._exit never unregisters it, and the tracker then
    prints "There appear to be 1 leaked semaphore objects" beside the run's one line. Under 'fork',
    Linux's default, a lock's name is unlinked as it is made. What a worker starts (inductor's compile
    workers) names its own start method, so nothing else changes.
    """
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)


_interrupted = False


def _note_interrupt(signum: int, frame: object) -> None:
    global _interrupted
    _interrupted = True


def defer_interrupts() -> None:
    """Until :func:`raise_deferred_interrupt`, note a Ctrl-C instead of raising it where it lands.

    Raised inside code that an extension runs (as torch's import does), a KeyboardInterrupt can be
    swallowed there, and the run went on as if nothing had been pressed; or it marks the interpreter
    to kill itself with SIGINT at exit, whatever the exit status.
    """
    global _interrupted
    _interrupted = False
    signal.signal(signal.SIGINT, _note_interrupt)


def raise_deferred_interrupt() -> None:
    """KeyboardInterrupt if a Ctrl-C was noted since :func:`defer_interrupts`; from here on, a Ctrl-C raises at once."""
    if signal.getsignal(signal.SIGINT) is not _note_interrupt:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _interrupted:
        raise KeyboardInterrupt


def _quiet_exit(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def guard_fork_server() -> None:
    """In the local launcher's fork server (agoq.launch.forkserver_guard, which it imports first):
    die with the launcher, and leave without a traceback on a Ctrl-C.

    A Ctrl-C reaches every process of the terminal's group, the server too; it would print the
    traceback of whatever it was importing. Workers forked from the server inherit the handler,
    until :func:`agoq.launch.run.worker_entry` puts the interpreter's own back.
    """
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or launcher != str(os.getppid()) or launcher == str(os.getpid()):
        return
    signal.signal(signal.SIGINT, _quiet_exit)
    sys.excepthook = _quiet_abandoned_start(sys.excepthook)
    if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


def _quiet_abandoned_start(previous: Callable[..., Any]) -> Callable[..., Any]:
    """The fork server's excepthook, which its children call for an error before they run: silent
    for a worker whose launch the launcher had abandoned, as it does when interrupted while starting
    its workers. It then releases the launch's locks, and a worker forked after that fails to
    unpickle them (FileNotFoundError in multiprocessing.synchronize); the launcher's one line says
    what happened, and this worker never started."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        frames = traceback.extract_tb(tb)
        if issubclass(exc_type, FileNotFoundError) and frames and frames[-1].filename.endswith(os.path.join("multiprocessing", "synchronize.py")):
            return
        previous(exc_type, exc, tb)

    return hook
