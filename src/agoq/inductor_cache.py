"""Inductor's cache folder for a torch held to another instruction set (ATEN_CPU_CAPABILITY).

Inductor's on-disk cache does not tell code built for the CPU's own instruction set from code
built under ATEN_CPU_CAPABILITY=avx2: with that variable set, a cache filled without it hands back
kernels for the wider instruction set that crash the process ("free(): invalid pointer" in the first step). So, unless the user
chose a cache folder, a run held to a capability compiles into a folder of its own.

Only agoq's own launcher applies it, for its workers: ``agoq train`` calls
:func:`use_capability_cache` before anything imports torch, so that the fork server and every
worker (local or under torchrun) agree on the folder. Importing agoq changes nothing.
Standard library only (tests/test_layering.py).
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


def capability_cache_folder() -> str | None:
    """The inductor cache folder for the held capability, or None (none held, or the user chose a folder)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return None
    return os.path.join(tempfile.gettempdir(), f"agoq_inductor_{_user()}", f"aten-cpu-capability-{capability.lower()}")


def use_capability_cache() -> None:
    """Point TORCHINDUCTOR_CACHE_DIR at the held capability's own folder (when held and not chosen):
    for agoq's launcher, before torch is imported."""
    folder = capability_cache_folder()
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
