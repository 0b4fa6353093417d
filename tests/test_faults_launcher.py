"""Faults of the local launcher and its workers: each ends with one line on stderr and the right exit
status, leaves no process behind, and loses nothing the run had written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agoq.launch.lock import LOCK_NAME, FolderInUse, join_run_lock, run_lock
from tests._data import data_args
from tests.test_faults import SMALL

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's process table")
# Rank 0's estimate of the time left, printed once on stderr at the third step of a long run.
ESTIMATE = re.compile(r"^agoq train: [\d.]+ s per step here; about .* to go$")


def _lines(err: str) -> list[str]:
    """stderr's lines, without rank 0's progress output."""
    return [line for line in err.splitlines() if line.strip() and not ESTIMATE.match(line)]


def _assert_no_leak_report(err: str) -> None:
    """Python's resource tracker reports a multiprocessing lock that a process left registered."""
    assert "resource_tracker" not in err and "leaked" not in err, err


def _args(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "agoq",
        "train",
        *SMALL,
        *data_args(),
        f"--train.out_dir={out}",
        "--precision.quant_backend=torch",  # eager: what is checked is the launch, not compiling
        "--train.log_every=1000000",
        # Two workers (dp=2): what is checked is how the launcher and its workers stop, which one
        # peer shows as well as three; four processes on a test machine's two cores only take longer.
        "--parallel.pp=1",
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "TQDM_DISABLE": "1", **extra}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _start(out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(_args(out, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env or _env())


def _wait_for_steps(proc: subprocess.Popen, out: Path, rows: int = 1, timeout: float = 180) -> None:
    metrics = out / "metrics" / "rank0.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= rows:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the run did not train (status {proc.poll()}): {proc.communicate()[1][-3000:]}")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _descendants(root: int) -> dict[int, str]:
    """Every live process below ``root``, with its start time (a pid reused later is another process)."""
    children: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
                starts[int(entry)] = fields[19]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def _alive(procs: dict[int, str]) -> list[int]:
    """Those of ``procs`` still running (a zombie has exited: it only waits to be reaped)."""
    alive = []
    for pid, start in procs.items():
        fields = _stat(pid)
        if fields and fields[19] == start and fields[0] != "Z":
            alive.append(pid)
    return alive


def _rank_of(pid: int) -> int | None:
    """The rank of a worker: it holds its rank log (logs/rank<R>.log) open from its start."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            found = re.search(r"/logs/rank(\d+)\.log$", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if found:
            return int(found.group(1))
    return None


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's workers."""
    ranks = {}
    for pid in _descendants(launcher):
        if (rank := _rank_of(pid)) is not None:
            ranks[rank] = pid
    return ranks


def _lock_holders(path: Path) -> set[int]:
    """Pids of the processes that hold a flock on ``path`` (/proc/locks)."""
    ino = os.stat(path).st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if fields[1] == "FLOCK" and int(fields[5].rsplit(":", 1)[1]) == ino:
            holders.add(int(fields[4]))
    return holders


@linux_only
def test_a_killed_launcher_takes_its_workers_with_it_and_they_held_the_folder(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--train.steps=100000", "--checkpoint.every=0")
    try:
        _wait_for_steps(proc, out)
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1], workers
        # Forked from the fork server that agoq train started early (agoq.launch.forkserver), which
        # serves the launch only if the workers' environment is still the one it started in.
        assert all(int(_stat(pid)[1]) != proc.pid for pid in workers.values())
        # Every worker holds a share of the folder's lock, as the launcher does: a second run is
        # refused as long as any of them lives.
        assert set(workers.values()) | {proc.pid} <= _lock_holders(out / LOCK_NAME)
        with pytest.raises(FolderInUse, match=f"{out} is in use by another agoq run \\(pid {proc.pid} "):
            with run_lock(out):
                pass
        everything = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while _alive(everything) and time.time() < deadline:
            time.sleep(0.1)
        assert _alive(everything) == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in _alive(everything)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _alive(_descendants(proc.pid)):
            os.kill(pid, signal.SIGKILL)
    # Nothing writes the folder any more, and a new run may have it.
    rows = (out / "metrics" / "rank0.jsonl").read_text()
    assert rows and all(json.loads(line)["step"] >= 1 for line in rows.splitlines())
    with run_lock(out):
        pass


JOIN = (
    "import subprocess, sys, time\n"
    "from agoq.launch.lock import run_lock\n"
    "with run_lock(sys.argv[1]):\n"
    # A worker, left behind when its launcher dies: it holds its own share of the lock.
    "    code = 'import sys, time; from agoq.launch.lock import join_run_lock; join_run_lock(sys.argv[1]); print(1, flush=True); time.sleep(60)'\n"
    "    worker = subprocess.Popen([sys.executable, '-c', code, sys.argv[1]], stdout=subprocess.PIPE, text=True)\n"
    "    worker.stdout.readline(); print(worker.pid, flush=True); time.sleep(60)\n"
)


def test_a_worker_left_without_its_launcher_still_keeps_a_second_run_out(tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", JOIN, str(out)], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    try:
        launcher.kill()
        launcher.wait()
        proc = subprocess.run(_args(out, "--train.steps=1"), capture_output=True, text=True, env=_env(), timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = _lines(proc.stderr)
        assert len(lines) == 1 and f"agoq train: {out} is in use by another agoq run (pid {launcher.pid} " in lines[0], proc.stderr
        assert "--train.out_dir=" in lines[0]
        assert not (out / "metrics").exists()  # refused before it wrote anything
    finally:
        os.kill(worker, signal.SIGKILL)
    time.sleep(0.5)
    with run_lock(out):  # the last holder gone, the folder is free
        pass


def test_a_run_holds_its_folder_shared_with_its_workers_and_no_one_else(tmp_path):
    import fcntl

    from agoq.launch import lock

    with run_lock(tmp_path):
        fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # what a second run's claim does
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        join_run_lock(tmp_path)  # the launcher's share and a worker's coexist
        os.close(lock._joined.pop())


def test_a_lock_file_that_is_a_symlink_is_refused_and_what_it_names_is_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(target)
    proc = subprocess.run(_args(out, "--train.steps=1"), capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and f"agoq train: {out / LOCK_NAME} is a symbolic link" in lines[0] and f"rm {out / LOCK_NAME}" in lines[0], proc.stderr
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_a_lock_file_that_is_a_hard_link_is_refused_and_its_other_name_untouched(tmp_path):
    from agoq.launch.config import ConfigError

    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out = tmp_path / "run"
    out.mkdir()
    os.link(target, out / LOCK_NAME)
    for take in (run_lock, join_run_lock):
        with pytest.raises(ConfigError) as info:
            with take(out) if take is run_lock else contextlib.nullcontext(take(out)):
                pass
        assert f"{out / LOCK_NAME} has 2 names (a hard link" in str(info.value) and f"rm {out / LOCK_NAME}" in str(info.value)
    assert target.read_text() == "keep me\n"


def test_stray_rank_variables_are_ignored_and_named(tmp_path):
    out = tmp_path / "run"
    env = _env(RANK="3", WORLD_SIZE="8")
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        _args(out, "--train.steps=2", "--parallel.pp=1", "--checkpoint.every=0"), capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc.stderr) == [], proc.stderr
    assert "agoq train: RANK=3, WORLD_SIZE=8 in the environment ignored: no launcher started this process" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary["records"]] == [1, 2] and len(summary["ranks"]) == 2


def test_the_launcher_vars_of_a_real_launcher_still_mean_a_worker(monkeypatch):
    from agoq.launch import forkserver

    for name in ("TORCHELASTIC_RUN_ID", *forkserver.RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not forkserver.under_torchrun() and forkserver.stray_rank_variables() == {"RANK": "1", "WORLD_SIZE": "2"}
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert forkserver.under_torchrun() and forkserver.stray_rank_variables() == {}
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert forkserver.under_torchrun()


def test_an_inherited_gloo_interface_is_named_in_the_opening_lines(monkeypatch, capsys):
    from agoq.launch import forkserver
    from agoq.launch.config import load_config
    from agoq.launch.run import announce

    for name in ("TORCHELASTIC_RUN_ID", *forkserver.RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(None, [])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert forkserver.local_worker_env()["GLOO_SOCKET_IFNAME"] == "eth7"  # the user's choice is kept
    announce(cfg, "4 local processes")
    out = capsys.readouterr().out
    assert "agoq train: GLOO_SOCKET_IFNAME=eth7 from the environment: gloo's connections between the workers use that interface, not loopback" in out
    if forkserver.loopback_interface():
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", forkserver.loopback_interface())
        announce(cfg, "4 local processes")
        assert "GLOO_SOCKET_IFNAME" not in capsys.readouterr().out


@pytest.mark.parametrize("when", ["0.5", "1.5", "2.5", "workers"])
def test_a_ctrl_c_while_the_run_starts_prints_one_line(tmp_path, when):
    out = tmp_path / "run"
    proc = _start(out, "--train.steps=100000", "--checkpoint.every=0")
    try:
        if when == "workers":  # just after the opening lines: the workers are being started
            line = proc.stdout.readline()
            assert line.startswith("agoq train: model "), line
        else:
            time.sleep(float(when))
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    lines = _lines(err)
    assert len(lines) == 1 and lines[0].startswith("agoq train: interrupted"), err
    _assert_no_leak_report(err)


@linux_only
def test_sigint_to_one_worker_names_that_worker(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--train.steps=100000", "--checkpoint.every=0")
    try:
        _wait_for_steps(proc, out)
        workers = _workers(proc.pid)
        os.kill(workers[1], signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    lines = _lines(err)
    assert lines == [f"agoq train: rank 1 (pid {workers[1]}) was interrupted (SIGINT), and the run stopped with it"], err
    _assert_no_leak_report(err)
    assert "KeyboardInterrupt" in (out / "logs" / "rank1.log").read_text()


@linux_only
@pytest.mark.parametrize("target", ["group", "rank 1"])
def test_a_ctrl_c_while_the_workers_join_their_group_stops_at_once_with_one_line(tmp_path, target):
    """A worker joining the process group waits in C++, where no Python handler runs: interrupted
    there, each used to wait for peers that never came until the launcher killed them 30 s later,
    printing the store's C++ warnings."""
    out = tmp_path / "run"
    proc = _start(out, "--train.steps=100000", "--checkpoint.every=0")
    try:
        deadline = time.time() + 180
        while len(workers := _workers(proc.pid)) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.005)  # every worker has begun: its rank log is open
        assert len(workers) == 2, proc.poll()
        started = time.time()
        os.killpg(proc.pid, signal.SIGINT) if target == "group" else os.kill(workers[1], signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    line = "agoq train: interrupted; checkpoints" if target == "group" else f"agoq train: rank 1 (pid {workers[1]}) was interrupted (SIGINT)"
    lines = _lines(err)
    assert len(lines) == 1 and lines[0].startswith(line), err
    _assert_no_leak_report(err)
    assert time.time() - started < 25  # not the launcher's 30 s wait before it kills its workers


@linux_only
def test_sigterm_to_the_launcher_stops_every_process_with_one_line(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--train.steps=100000", "--checkpoint.every=0")
    try:
        _wait_for_steps(proc, out)
        everything = _descendants(proc.pid)
        assert len(_workers(proc.pid)) == 2
        os.kill(proc.pid, signal.SIGTERM)  # what a job scheduler sends the launcher alone
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert _lines(err) == [
        f"agoq train: interrupted; checkpoints already written in {out / 'checkpoints'} are intact, and running the same command resumes from the newest"
    ], err
    _assert_no_leak_report(err)
    # The fork server and the resource tracker leave as the launcher's death reaches them.
    deadline = time.time() + 60
    while _alive(everything) and time.time() < deadline:
        time.sleep(0.1)
    assert _alive(everything) == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in _alive(everything)]
    rows = (out / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert rows and all(json.loads(row)["step"] >= 1 for row in rows)  # what was written stays


@linux_only
def test_a_worker_killed_by_a_signal_is_named_and_leaves_no_lock_behind(tmp_path):
    """Rank 0 holds the progress bar's lock; killed, it can release nothing: none may be registered."""
    out = tmp_path / "run"
    proc = _start(out, "--train.steps=100000", "--checkpoint.every=0")
    try:
        _wait_for_steps(proc, out)
        workers = _workers(proc.pid)
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err
    # Not the other ranks' "Connection reset by peer", which follows from it.
    assert _lines(err) == [
        f"agoq train: rank 0 (pid {workers[0]}) was killed by SIGKILL without a Python error (by another process, or the out-of-memory killer)"
    ], err
    _assert_no_leak_report(err)


def test_a_lock_made_in_a_worker_is_unnamed_so_no_exit_can_leave_it_registered():
    code = (
        "import multiprocessing as mp, sys\n"
        "mp.set_start_method(sys.argv[1], force=True)  # what a worker started by the launcher has\n"
        "named = mp.RLock()._semlock.name is not None\n"
        "from agoq.launch.forkserver import unnamed_locks\n"
        "unnamed_locks()\n"
        "print(named, mp.RLock()._semlock.name)\n"
    )
    for method in ("forkserver", "spawn"):
        proc = subprocess.run([sys.executable, "-c", code, method], capture_output=True, text=True, timeout=60)
        assert (proc.stdout, proc.stderr) == ("True None\n", ""), proc.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: room for the run's metrics, not for its first checkpoint."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_is_named_in_the_line_and_in_the_rank_log(small_disk):
    out = small_disk / "run"
    proc = subprocess.run(
        _args(out, "--train.steps=3", "--checkpoint.every=1", "--parallel.pp=2"), capture_output=True, text=True, env=_env(), timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    found = re.fullmatch(rf"agoq train: rank (\d) failed: no space left on device \(ENOSPC\) writing ({re.escape(str(out))}\S*); .*", lines[0])
    assert found, lines
    rank, path = found.groups()
    log = (out / "logs" / f"rank{rank}.log").read_text()
    assert "No space left on device" in log and "Traceback" in log and f"(ENOSPC) writing {path};" in log
    # The step trained before the disk filled is in the metrics.
    assert json.loads((out / "metrics" / "rank0.jsonl").read_text().splitlines()[0])["step"] == 1


def test_a_full_disk_behind_a_one_line_checkpoint_error_is_in_the_line_and_the_log():
    """Which rank's write meets the full disk first varies: the rank that reports may hold only the
    DCP failure, its ENOSPC carried as another rank's, under a CheckpointError raised ``from None``."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from agoq.train.checkpoint import CheckpointError
    from agoq.launch.config import TrainConfig
    from agoq.launch.run import _full_traceback, error_line

    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/checkpoints/step_3.tmp/__1_0.distcp")
    try:
        try:
            raise CheckpointException("save", {1: (enospc, None)})
        except CheckpointException:
            raise CheckpointError("writing checkpoint failed (rank 0: RuntimeError: unexpected pos 704 vs 598); save again") from None
    except CheckpointError as e:
        error = e
    assert error_line(error, TrainConfig()).startswith("no space left on device (ENOSPC) writing /runs/x/checkpoints/step_3.tmp/__1_0.distcp; ")
    log = _full_traceback(error)
    assert "No space left on device" in log and "unexpected pos 704 vs 598" in log and log.startswith("Traceback")
    assert "/runs/x/checkpoints/step_3.tmp/__1_0.distcp" in log


def test_a_full_disk_is_the_line_even_when_a_peers_checkpoint_error_was_logged_first(tmp_path):
    """At dp=2 the rank whose DCP collective fails on its peer's ENOSPC may log first, and its
    error need not carry the ENOSPC; the line names the full disk."""
    from types import SimpleNamespace

    from agoq.launch.run import failure_line

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.error").write_text("100.0 CheckpointError: writing checkpoint step 1 failed on another rank\n")
    enospc = "no space left on device (ENOSPC) writing /runs/x/checkpoints/step_1.tmp/__1_0.distcp; free space on that disk"
    (logs / "rank1.error").write_text(f"100.5 {enospc}\n")
    line = failure_line(tmp_path, {0: SimpleNamespace(exitcode=1, pid=10)}, 2)
    assert line == f"rank 1 failed: {enospc} (full traceback: {logs / 'rank1.log'})"
    # Without a full disk, the first failure by time is the line.
    (logs / "rank1.error").write_text("100.5 RuntimeError: Connection closed by peer\n")
    assert failure_line(tmp_path, {0: SimpleNamespace(exitcode=1, pid=10)}, 2).startswith("rank 0 failed: CheckpointError: writing checkpoint step 1")


def test_a_worker_killed_without_a_log_is_named_with_its_signal(tmp_path):
    from types import SimpleNamespace

    from agoq.launch.run import failure_line

    line = failure_line(tmp_path, {1: SimpleNamespace(exitcode=-signal.SIGKILL, pid=4242)}, 4)
    assert line == "rank 1 (pid 4242) was killed by SIGKILL without a Python error (by another process, or the out-of-memory killer)"
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank3.error").write_text("100.0 interrupted (pid 77)\n")  # rank 3 failed first, though torch reports rank 1
    (logs / "rank1.error").write_text("101.0 RuntimeError: Connection closed by peer\n")
    (logs / "rank0.error").write_text("")  # reserved at start, never written: killed
    assert (
        failure_line(tmp_path, {1: SimpleNamespace(exitcode=1, pid=4242)}, 4)
        == "rank 3 (pid 77) was interrupted (SIGINT), and the run stopped with it"
    )
    # Interrupted while joining the process group, where a Ctrl-C ends a worker at once
    # (worker_entry): named as interrupted, before rank 1's error that follows from it.
    (logs / "rank3.error").write_text("")
    assert (
        failure_line(tmp_path, {2: SimpleNamespace(exitcode=-signal.SIGINT, pid=55)}, 4)
        == "rank 2 (pid 55) was interrupted (SIGINT), and the run stopped with it"
    )
    # Killed before the launcher stopped anyone: the cause, though the others' errors are logged first.
    (logs / "rank3.error").unlink()
    assert (
        failure_line(tmp_path, {0: SimpleNamespace(exitcode=-signal.SIGKILL, pid=99)}, 4)
        == "rank 0 (pid 99) was killed by SIGKILL without a Python error (by another process, or the out-of-memory killer)"
    )
