"""Inductor's on-disk cache, kept from handing agoq's processes code that no longer fits.

Two ways the cache goes stale under agoq, each with its guard below.

The saved layout. Inductor and AOTAutograd key a cached graph by its code, which names agoq's
custom ops but not the output sizes their fake kernels declare; after a change to what the ops
keep (rows padded to whole blocks, say), a cache filled by the older agoq hands back a graph that
asserts the old sizes ("expected size 8192==4096"). :func:`use_layout_cache_tag` adds a digest of
the sources that declare those sizes to torch's cache key tag (TORCH_COMPILE_CACHE_KEY_TAG), so a
changed layout compiles anew and an unchanged one reuses the cache.

The instruction set (ATEN_CPU_CAPABILITY).

Inductor's on-disk cache does not tell code built for the CPU's own instruction set from code
built under ATEN_CPU_CAPABILITY=avx2: with that variable set, a cache filled without it hands back
kernels for the wider instruction set that crash the process ("free(): invalid pointer" in the first step). So, unless the user
chose a cache folder, a run held to a capability compiles into a folder of its own.

Only agoq's own launcher applies them, for its workers: ``agoq train`` calls both before anything
imports torch, so that the fork server and every worker (local or under torchrun) agree on the
folder and the tag. Importing agoq changes nothing; a user who compiles a patched model in their
own process can set the tag the same way (docs/ARCHITECTURE.md).
Standard library only (tests/test_layering.py).
"""

from __future__ import annotations

import getpass
import hashlib
import os
import tempfile
from pathlib import Path

TAG_ENV = "TORCH_COMPILE_CACHE_KEY_TAG"
# The modules whose custom ops' fake kernels declare the sizes of what the ops keep, and the
# formats and layout those sizes follow.
LAYOUT_SOURCES = (
    "activation/ops.py",
    "activation/loss.py",
    "activation/lora.py",
    "parallel/tensor_ops.py",
    "quant/formats.py",
    "quant/qtensor.py",
)


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


def layout_tag() -> str:
    """A short digest of the sources that declare the sizes agoq's custom ops keep."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in LAYOUT_SOURCES:
        digest.update((root / name).read_bytes())
    return f"agoq-{digest.hexdigest()[:16]}"


def use_layout_cache_tag() -> None:
    """Add :func:`layout_tag` to torch's cache key tag (a tag the user set is kept, ours appended):
    for agoq's launcher, before torch is imported."""
    tag, current = layout_tag(), os.environ.get(TAG_ENV, "")
    if tag not in current.split("+"):
        os.environ[TAG_ENV] = f"{current}+{tag}" if current else tag
