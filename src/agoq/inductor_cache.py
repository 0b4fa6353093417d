"""Inductor's cache folder for a torch held to another instruction set (ATEN_CPU_CAPABILITY).

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
import os
import tempfile


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
