"""One run per output folder: an exclusive lock on ``out_dir/.lock``, held for the whole run.

Two runs writing one folder delete each other's checkpoints in progress and interleave their
metrics. The lock is ``fcntl.flock`` on a file in the folder: the kernel releases it when the
holding process exits, however it exits, so a lock file left by a killed run blocks nothing. The
file records who holds it (pid, host, start time) for the message a second run prints.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".lock"


class FolderInUse(RuntimeError):
    """Another live process holds the run folder; the message names the folder and the process."""


@contextmanager
def run_lock(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold the exclusive lock of ``out_dir`` (created if missing) for the body; FolderInUse if another process holds it."""
    from agoq.train.config import ConfigError

    folder = Path(out_dir)
    path = folder / LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"train.out_dir={str(out_dir)!r} cannot be written ({e.strerror}); choose a folder you can write") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "an unknown process"
            raise FolderInUse(
                f"{folder} is in use by another agoq run ({holder}); wait for it to finish, "
                f"or write this run elsewhere with --train.out_dir=runs/NAME"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
