"""One run per output folder: a lock on ``out_dir/.lock``, held by the run's launcher and by each of its workers.

Two runs writing one folder delete each other's checkpoints in progress and interleave their
metrics. The lock is ``fcntl.flock`` on a file in the folder: the kernel releases it when the
holding process exits, however it exits, so a lock file left by a killed run blocks nothing. The
file records who holds it (pid, host, start time) for the message a second run prints.

A run claims the folder with an exclusive lock, then holds it shared, and each of its workers
takes it shared too (:func:`join_run_lock`): another run's exclusive claim fails as long as any
process of this one lives, the launcher or a worker it left. The file is opened as every file
written in place in the run folder is (agoq.nofollow.open_in_place): never through a
symbolic link, and refused if it is a hard link, since ``.lock`` naming another file would have
that file truncated and overwritten.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from agoq.nofollow import open_in_place

LOCK_NAME = ".lock"


class FolderInUse(RuntimeError):
    """Another live process holds the run folder; the message names the folder and the process."""


def _open(out_dir: str | os.PathLike[str]) -> tuple[Path, int]:
    """The lock file of ``out_dir`` (folder and file created if missing), opened for reading and writing."""
    from agoq.errors import ConfigError

    folder = Path(out_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = open_in_place(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise ConfigError(f"train.out_dir={str(out_dir)!r} cannot be written ({e.strerror}); choose a folder you can write") from None
    return folder, fd


def _in_use(folder: Path, fd: int) -> FolderInUse:
    holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "an unknown process"
    return FolderInUse(
        f"{folder} is in use by another agoq run ({holder}, or a worker of it); wait for it to finish, "
        f"or write this run elsewhere with --train.out_dir=runs/NAME"
    )


def _lock(folder: Path, fd: int, operation: int) -> None:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _in_use(folder, fd)
        os.close(fd)
        raise error from None


@contextmanager
def run_lock(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold the lock of ``out_dir`` (created if missing) for the body; FolderInUse if another run holds it."""
    folder, fd = _open(out_dir)
    _lock(folder, fd, fcntl.LOCK_EX)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    # Shared from here on, so that the workers can join it. The change is not atomic: a run that
    # claims the folder in between wins, and this one is refused.
    _lock(folder, fd, fcntl.LOCK_SH)
    try:
        yield folder / LOCK_NAME
    finally:
        os.close(fd)  # releases this process's share


def check_not_in_use(out_dir: str | os.PathLike[str]) -> None:
    """FolderInUse now if another run holds ``out_dir``, creating nothing: a launcher asks before
    the minutes its data preparation can take, then claims the folder with :func:`run_lock`."""
    folder = Path(out_dir)
    try:
        fd = open_in_place(folder / LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        return  # no run has held this folder
    except OSError:
        return  # run_lock names what is wrong with the file when it claims it
    _lock(folder, fd, fcntl.LOCK_EX)  # raises, closing fd, while any process of another run holds it
    os.close(fd)


_joined: list[int] = []  # descriptors a worker holds until it exits


def join_run_lock(out_dir: str | os.PathLike[str]) -> None:
    """Take a share of the lock of ``out_dir``, which this worker's launcher holds, until this process exits."""
    folder, fd = _open(out_dir)
    _lock(folder, fd, fcntl.LOCK_SH)
    _joined.append(fd)
