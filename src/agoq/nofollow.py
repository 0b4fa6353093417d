"""Writing files without following links: every file agoq writes in a run folder or its data cache.

Both folders are agoq's. A symbolic link placed in one, naming a file elsewhere, would have that
file overwritten, truncated or appended to by a write that follows it, and a link standing for a
folder would have agoq's files (and its pruning of old checkpoints) land in the folder it names.
So a file is written here in one of two ways:

- whole (:func:`write_atomic`): into a new temporary file of the same folder, created with
  ``O_EXCL`` (which never follows a link), then renamed over the name. A rename replaces a link
  that stands there; it never writes to what the link names.
- in place (:func:`open_in_place`: logs, metrics, locks): opened with ``O_NOFOLLOW``, and refused
  if it is not a regular file or has other names (a hard link shares its bytes with another file).

The folders written into are made by :func:`ensure_folder`, which refuses one that is a link. The
run folder itself may be one: it is the user's choice of where the run goes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from agoq.errors import ConfigError

# The second half of each refusal: where else the same work can go.
RUN_ELSEWHERE = "write this run elsewhere with --train.out_dir=runs/NAME"
CACHE_ELSEWHERE = "use another cache folder with --data.cache_dir=PATH"


def link_error(path: str | os.PathLike[str], elsewhere: str = RUN_ELSEWHERE) -> ConfigError:
    """The one-line refusal of a symbolic link at ``path``, naming it and the fix."""
    what = "files would be written into the folder it points to" if os.path.isdir(path) else "the file it points to would be overwritten"
    return ConfigError(f"{path} is a symbolic link, which agoq does not follow ({what}); delete the link (rm {path}) or {elsewhere}")


def hard_link_error(path: str | os.PathLike[str], names: int, elsewhere: str = RUN_ELSEWHERE) -> ConfigError:
    """The one-line refusal of a file at ``path`` that has other names, which writing it in place would change too."""
    return ConfigError(f"{path} has {names} names (a hard link to another file, which agoq would overwrite); delete it (rm {path}) or {elsewhere}")


def refuse_link(path: str | os.PathLike[str], elsewhere: str = RUN_ELSEWHERE, in_place: bool = False) -> None:
    """ConfigError if ``path`` is a symbolic link (or, for a file written ``in_place``, a hard link); nothing if it is missing."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet: whatever is written there is checked then
        return
    if stat.S_ISLNK(info.st_mode):
        raise link_error(path, elsewhere)
    if in_place and stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise hard_link_error(path, info.st_nlink, elsewhere)


def ensure_folder(path: str | os.PathLike[str], elsewhere: str = RUN_ELSEWHERE) -> Path:
    """``path`` as a folder (created with its parents if missing); ConfigError if it is a symbolic link."""
    path = Path(path)
    refuse_link(path, elsewhere)  # before mkdir: exist_ok would accept a link to a folder
    path.mkdir(parents=True, exist_ok=True)
    refuse_link(path, elsewhere)
    return path


def open_in_place(path: str | os.PathLike[str], flags: int, mode: int = 0o644, elsewhere: str = RUN_ELSEWHERE) -> int:
    """``os.open`` of a regular file with a single name, never through a symbolic link.

    ConfigError (one line naming ``path`` and the fix) for a link, a hard link or something that is
    not a regular file; other failures raise their OSError. ``O_TRUNC`` is applied only once the
    file is known to be this one file.
    """
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):  # EMLINK: O_NOFOLLOW's error on FreeBSD
            raise link_error(path, elsewhere) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path} is not a regular file; delete it or {elsewhere}")
        if info.st_nlink > 1:
            raise hard_link_error(path, info.st_nlink, elsewhere)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def temp_file_beside(path: str | os.PathLike[str]) -> tuple[int, str]:
    """An open (fd, name) of a new temporary file in ``path``'s folder, for ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    # mkstemp makes the file private (0600); agoq's files are shared like any other file.
    os.chmod(tmp, 0o644)
    return fd, tmp


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], durable: bool = True) -> Iterator[BinaryIO]:
    """A new file, open for writing, that becomes ``path`` whole when the block ends (replacing,
    never following, a link there) and is removed if the block raises.

    ``durable``: on disk before the rename (fsync), so a crash leaves the old file or the new one.
    """
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes, durable: bool = True) -> None:
    """Make ``path`` a regular file holding ``data``, whole or not at all (:func:`atomic_file`)."""
    with atomic_file(path, durable) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
