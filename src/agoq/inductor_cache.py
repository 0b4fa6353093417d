"""Inductor's cache folder: one of its own for a torch held to another instruction set
(ATEN_CPU_CAPABILITY), and agoq's note of which run configurations have compiled into it.

Inductor's on-disk cache does not tell code built for AVX512 from code built under
ATEN_CPU_CAPABILITY=avx2: with that variable set, a cache filled without it hands back AVX512
kernels that crash the process (measured: "free(): invalid pointer" in the first step). So, unless
the user chose a cache folder, the capability gets a folder of its own.

Standard library only: the launcher sets it before anything imports torch (its fork server is
started from that environment, agoq.train.forkserver), and agoq.quant sets it when imported, before
inductor fixes its folder (importing torch.distributed.pipelining does), so that every process of
a run agrees on it.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import tempfile
from pathlib import Path


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        return f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"


def use_capability_cache() -> None:
    """Point TORCHINDUCTOR_CACHE_DIR at the held capability's own folder (when held and not chosen)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        folder = os.path.join(tempfile.gettempdir(), f"agoq_inductor_{_user()}", f"aten-cpu-capability-{capability.lower()}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder


def inductor_cache_folder() -> Path:
    """The folder inductor keeps its compiled code in: TORCHINDUCTOR_CACHE_DIR, else its default
    (the temporary folder's ``torchinductor_<user>``), found without importing inductor."""
    use_capability_cache()  # a held capability's own folder, whatever was imported before
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen:
        return Path(chosen).absolute()
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", _user()))


# A run that compiled its quantization kernels leaves a file named by its configuration's key here,
# inside inductor's folder, so that the note goes wherever the compiled code goes (a wiped temporary
# folder takes both).
def _compiled_note(key: str) -> Path:
    return inductor_cache_folder() / "agoq_compiled_runs" / hashlib.sha256(key.encode()).hexdigest()[:24]


def compiled_before(key: str) -> bool:
    """Whether a run with configuration ``key`` compiled its kernels into this cache (they load from disk)."""
    return _compiled_note(key).is_file()


def note_compiled(key: str) -> None:
    """Record that a run with configuration ``key`` compiled its kernels into this cache (best effort:
    a cache folder that cannot be written only means the next run decides as if it were cold)."""
    note = _compiled_note(key)
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        partial = note.with_name(f"{note.name}.{os.getpid()}")  # every rank writes it: whole or not at all
        partial.write_text(key + "\n")
        os.replace(partial, note)
    except OSError:
        pass
