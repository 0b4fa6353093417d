"""The local launcher's worker start: forked from the fork server only where the server's
environment is the launch's, never rewriting it, and no process outliving the launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agoq.launch.forkserver as forkserver

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_fork_server_is_reused_only_in_the_environment_it_was_started_in(monkeypatch):
    monkeypatch.setattr(forkserver, "_forkserver_env", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert forkserver.start_method() == "forkserver"  # the first launch starts it
    monkeypatch.setenv("AGOQ_QUANT_BACKEND", "something else")  # read at run time: a worker would not see it
    assert forkserver.start_method() == "spawn"
    monkeypatch.undo()
    monkeypatch.setattr(forkserver, "_forkserver_env", dict(os.environ))
    assert forkserver.start_method() == "forkserver"


def test_a_test_process_forks_its_later_tests_workers_from_the_same_server(monkeypatch):
    """pytest renames the running test in PYTEST_CURRENT_TEST: each test's launch still forks."""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_one (call)")
    monkeypatch.setattr(forkserver, "_forkserver_env", dict(os.environ))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_two (call)")
    assert forkserver.start_method() == "forkserver"
    monkeypatch.setenv("SOMETHING_OF_THE_USER", "x")  # any other difference still spawns
    assert forkserver.start_method() == "spawn"


def test_a_process_that_ran_a_compiled_graph_still_forks_its_launchs_workers(monkeypatch):
    """Inductor writes a variable of its own into os.environ when it loads a compiled kernel: a test
    process or notebook that compiled something still forks its later launches' workers."""
    import torch

    from agoq.quant import backend

    if not backend.compiler_available():
        pytest.skip("no C++ compiler for torch.compile")
    monkeypatch.setattr(forkserver, "_forkserver_env", dict(os.environ))
    before = dict(os.environ)
    torch._dynamo.reset()  # a graph compiled and loaded here, not one an earlier test left in memory
    x = torch.arange(8.0)
    assert torch.equal(torch.compile(lambda t: t * 3 + 1)(x), x * 3 + 1)
    changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
    assert forkserver.start_method() == "forkserver", changed
    monkeypatch.setenv("SOMETHING_OF_THE_USER", "x")  # what the launch's workers would see differently still spawns
    assert forkserver.start_method() == "spawn"


def _print_line(text: str, output: forkserver.LauncherOutput) -> None:
    output.install()
    print(text, flush=True)


def test_a_forked_worker_writes_where_its_launcher_writes_now(tmp_path):
    """The server started with this process's output; the launch has redirected it since (what
    pytest's capfd and a notebook do): the worker's line lands in the new place, not the old."""
    import multiprocessing as mp

    with forkserver.workers_environment():
        method = forkserver.start_method()
        ctx = mp.get_context(method)
        warm = ctx.Process(target=_print_line, args=("before", forkserver.LauncherOutput()))
        warm.start()  # the server (if this process had none) starts with the output as it is now
        warm.join(60)
    saved = os.dup(1)
    try:
        with open(tmp_path / "out", "w") as f:
            os.dup2(f.fileno(), 1)
            with forkserver.workers_environment():
                assert forkserver.start_method() == method  # a redirect alone does not change how workers start
                p = ctx.Process(target=_print_line, args=("from the worker", forkserver.LauncherOutput()))
                p.start()
                p.join(60)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert p.exitcode == 0
    assert (tmp_path / "out").read_text() == "from the worker\n"


def test_inductors_own_default_cache_folder_set_after_the_server_started_changes_nothing(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(forkserver, "_forkserver_env", dict(os.environ))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor does when first asked
    assert forkserver.start_method() == "forkserver"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    assert forkserver.start_method() == "spawn"


def test_the_workers_environment_is_the_launchers_plus_the_local_variables(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("SOMETHING_OF_THE_USER", "x")
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    before = dict(os.environ)
    with forkserver.workers_environment():
        inside = dict(os.environ)
        # What torch's elastic launcher sets in the launching process: kept, it made every later
        # launch of this process differ from the fork server's environment and spawn.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        os.environ["SOMETHING_OF_THE_USER"] = "changed during the launch"
    assert dict(os.environ) == before
    added = {k: v for k, v in inside.items() if before.get(k) != v}
    assert added == forkserver.local_worker_env() and added[forkserver.LOOPBACK_ENV] == "1"
    assert added[forkserver.LAUNCHER_ENV] == str(os.getpid()) and inside["SOMETHING_OF_THE_USER"] == "x"
    if forkserver.loopback_interface():
        assert added["GLOO_SOCKET_IFNAME"] == forkserver.loopback_interface()


def test_the_fork_server_started_early_serves_the_launch_that_follows(monkeypatch):
    # agoq train starts it before importing torch, held to AVX2 here (the case whose cache folder
    # is set at import): the launch must then find the same environment and fork from it.
    import multiprocessing.forkserver

    started = []
    monkeypatch.setattr(forkserver, "_forkserver_env", None)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: started.append(dict(os.environ)))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    for name in ("TORCHELASTIC_RUN_ID", *forkserver.RANK_VARS, *forkserver.local_worker_env()):
        monkeypatch.delenv(name, raising=False)
    from agoq.inductor_cache import use_capability_cache

    use_capability_cache()  # what agoq.cli.main does first
    forkserver.start_early(forkserver.FORKSERVER_PRELOAD)
    assert len(started) == 1
    server_env = started[0]
    assert server_env[forkserver.LOOPBACK_ENV] == "1"  # the workers' variables were in the server's environment
    assert forkserver.LOOPBACK_ENV not in os.environ  # and only there
    assert server_env["TORCHINDUCTOR_CACHE_DIR"].endswith(os.sep + "aten-cpu-capability-avx2")
    # The launch (agoq.launch.run._launch_local) sets the workers' variables and asks how to start them.
    import agoq.quant  # noqa: F401  (what the launcher imports before it launches changes nothing)
    import agoq.launch.run  # noqa: F401

    with forkserver.workers_environment():
        assert dict(os.environ) == server_env and forkserver.start_method() == "forkserver"
    forkserver.start_early(forkserver.FORKSERVER_PRELOAD)  # a second launch in this process starts nothing more
    assert len(started) == 1


def test_the_fork_server_imports_what_the_run_needs():
    from agoq.launch.config import read_config

    def preload(*args: str) -> tuple[str, ...]:
        return forkserver.worker_preload(read_config(None, list(args)))

    every = forkserver.FORKSERVER_PRELOAD
    assert "torch._dynamo" in every  # torch.optim imports it in every worker
    assert preload("--parallel.pp=1", "--precision.quant_backend=torch") == every
    assert preload("--parallel.pp=2", "--precision.quant_backend=torch") == every + forkserver.PIPELINE_PRELOAD
    assert preload("--parallel.pp=1", "--precision.quant_backend=torch", "--train.compile=true") == every + forkserver.COMPILE_PRELOAD
    assert preload("--parallel.pp=1", "--precision.quant_backend=compiled") == every + forkserver.COMPILE_PRELOAD
    # The default run: pp = 2, and `auto`, which compiles on CPUs.
    assert preload() == every + forkserver.PIPELINE_PRELOAD + forkserver.COMPILE_PRELOAD


# agoq train's launcher up to its fork server's start, then its memory check of a pp = 1 run.
LAUNCH_IMPORTS = """
import sys
import agoq.launch.forkserver as fs
started = []
fs.start_early = lambda preload: started.append(("torch" in sys.modules, preload))
from agoq.cli import main
# train.steps=0 reads, then fails validation: the launch stops after the server's start.
assert main(["train", "--parallel.pp=1", "--precision.quant_backend=torch", "--train.steps=0"]) == 2
from agoq.launch.config import load_config
from agoq.launch.planning import check_memory
check_memory(load_config(None, ["--parallel.pp=1"]))
print(started == [(False, fs.FORKSERVER_PRELOAD)], "torch.distributed.pipelining" in sys.modules)
"""


def test_the_fork_server_starts_before_torch_is_imported_and_a_pp1_launcher_never_imports_pipelining():
    # The server's imports overlap the launcher's only if it starts first; torch's pipelining
    # imports Dynamo, which neither the launcher's checks nor a pp = 1 plan use.
    out = subprocess.run([sys.executable, "-c", LAUNCH_IMPORTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"], out.stdout


def test_no_fork_server_is_started_under_torchrun(monkeypatch):
    import multiprocessing.forkserver

    started = []
    monkeypatch.setattr(forkserver, "_forkserver_env", None)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: started.append(True))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    forkserver.start_early(forkserver.FORKSERVER_PRELOAD)
    assert started == [] and forkserver._forkserver_env is None


def test_nothing_in_the_package_rewrites_the_environment_or_freezes_the_collector():
    sources = {p: p.read_text() for p in (SRC / "agoq").rglob("*.py")}
    assert [p for p, text in sources.items() if "os.environ.clear(" in text or "gc.freeze(" in text] == []


LAUNCHER = """
import subprocess, sys, time
code = '''
import os, sys, time
sys.path.insert(0, sys.argv[2])
import agoq.launch.forkserver as fs
if sys.argv[3] == "poll":
    fs._set_parent_death_signal = lambda sig: False
fs.die_with_launcher(int(sys.argv[1]))
print(os.getpid(), flush=True)
time.sleep(60)
'''
import os
worker = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(worker.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited, waiting to be reaped


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's process table")
@pytest.mark.parametrize("how", ["prctl", "poll"])
def test_a_worker_dies_with_its_launcher(how):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(SRC), how], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    try:
        assert not _gone(worker)
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 5
        while not _gone(worker) and time.time() < deadline:
            time.sleep(0.05)
        assert _gone(worker)
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_whose_launcher_died_before_it_asked_dies_at_once():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    code = f"import sys; sys.path.insert(0, {str(SRC)!r}); import agoq.launch.forkserver as fs; fs.die_with_launcher({gone.stdout.strip()}); print('survived')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout


SERVER = """
import os, subprocess, sys, time
env = {**os.environ, "AGOQ_LAUNCHER_PID": str(os.getpid())}
code = "import sys, time; sys.path.insert(0, sys.argv[1]); import agoq.launch.forkserver_guard; print(1, flush=True); time.sleep(60)"
server = subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True)
server.stdout.readline()
print(server.pid, flush=True)
if sys.argv[2] == "interrupt":
    os.kill(server.pid, 2)
    print(server.wait(), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's process table")
def test_the_fork_server_dies_with_its_launcher_and_leaves_quietly_on_ctrl_c():
    launcher = subprocess.Popen([sys.executable, "-c", SERVER, str(SRC), "interrupt"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        int(launcher.stdout.readline())
        assert int(launcher.stdout.readline()) == 128 + signal.SIGINT  # no KeyboardInterrupt
    finally:
        launcher.kill()
    assert "Traceback" not in launcher.communicate()[1]
    launcher = subprocess.Popen([sys.executable, "-c", SERVER, str(SRC), "kill"], stdout=subprocess.PIPE, text=True)
    server = int(launcher.stdout.readline())
    try:
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 5
        while not _gone(server) and time.time() < deadline:
            time.sleep(0.05)
        assert _gone(server)
    finally:
        if not _gone(server):
            os.kill(server, signal.SIGKILL)
