"""Which implementation runs quantization: the torch reference path or the Triton kernels.

- ``auto`` (default): Triton for CUDA tensors when triton is importable, torch everywhere else;
- ``torch``: always the torch reference;
- ``triton``: the kernels wherever they apply. On CPU tensors Triton runs only under its
  interpreter (``TRITON_INTERPRET=1`` set before triton is first imported), about a thousand times
  slower than torch: that is for tests.

The choice comes from :func:`set_backend` / :func:`use_backend`, else from the environment variable
``AGOQ_QUANT_BACKEND`` (torch|triton|auto). Calls the kernels do not cover always take the torch
path: stochastic rounding, and formats whose block size is not a multiple of 8 (or above
``agoq.quant.triton.MAX_BLOCK``). Both paths give bit-identical codes and scales (see
agoq.quant.triton.kernels for how), so switching changes speed, not results.

This module imports triton only when the Triton backend is actually used.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import torch

from agoq.quant.formats import QuantFormat

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "AGOQ_QUANT_BACKEND"

_choice: str | None = None  # set_backend's choice; None: the environment decides


def _check_name(name: str, where: str) -> str:
    value = name.strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return value


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the triton package is installed (``pip install 'agoq[triton]'``)."""
    return importlib.util.find_spec("triton") is not None


def get_backend() -> str:
    """The configured choice: 'auto', 'torch' or 'triton' (set_backend, else AGOQ_QUANT_BACKEND, else auto)."""
    if _choice is not None:
        return _choice
    env = os.environ.get(ENV_VAR)
    return "auto" if not env else _check_name(env, f"environment variable {ENV_VAR}")


def set_backend(name: str | None) -> None:
    """Choose 'auto', 'torch' or 'triton' for this process; None returns the choice to AGOQ_QUANT_BACKEND."""
    global _choice
    if name is None:
        _choice = None
        return
    value = _check_name(name, "the quantization backend")
    if value == "triton" and not triton_available():
        raise RuntimeError("the Triton backend needs triton: pip install 'agoq[triton]', or use the torch backend")
    _choice = value


@contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Use backend ``name`` inside the block, then restore the previous choice."""
    global _choice
    saved = _choice
    set_backend(name)
    try:
        yield
    finally:
        _choice = saved


def resolve(device: torch.device | str) -> str:
    """'torch' or 'triton': the backend quantization of tensors on ``device`` uses now."""
    choice = get_backend()
    device = torch.device(device)
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed: pip install 'agoq[triton]', or set {ENV_VAR}=torch")
    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"the Triton backend runs on CUDA (or CPU under TRITON_INTERPRET=1), not on {device.type}; use the torch backend")
    return "triton"


def kernels(device: torch.device | str, fmt: QuantFormat | None = None) -> ModuleType | None:
    """The Triton kernel module (agoq.quant.triton) if it should handle ``fmt`` on ``device``, else None."""
    if resolve(device) != "triton":
        return None
    import agoq.quant.triton as kernel_module

    if fmt is not None and not kernel_module.supports(fmt):
        return None
    return kernel_module


__all__ = ["BACKENDS", "ENV_VAR", "get_backend", "kernels", "resolve", "set_backend", "triton_available", "use_backend"]
