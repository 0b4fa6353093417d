"""Which implementation runs quantization: the torch reference, compiled CPU code, or Triton.

- ``auto`` (default): Triton for CUDA tensors when triton is importable; on CPUs the compiled
  formulas where a C++ compiler is found (else torch, with one warning); torch on other devices;
- ``torch``: always the torch reference (eager, the definition the others must equal);
- ``compiled`` (CPUs): :mod:`agoq.quant.compiled`, the reference's formulas under torch.compile
  (inductor's C++/OpenMP code) for quantize, dequantize, the gradient fold and the all-reduce's
  local sum; the activation ops also compile their recompute formulas (RMSNorm, SwiGLU);
- ``triton``: the kernels wherever they apply. On CPU tensors Triton runs only under its
  interpreter (``TRITON_INTERPRET=1`` set before triton is first imported): that is for tests.

The choice comes from :func:`set_backend` / :func:`use_backend`, else from the environment variable
``AGOQ_QUANT_BACKEND`` (auto|torch|compiled|triton). Calls the kernels do not cover always take the
torch path: stochastic rounding, and formats whose block size is not a multiple of 8 (or above
``agoq.quant.triton.MAX_BLOCK``). Every path gives bit-identical codes and scales (tests check it),
so switching changes speed, not results.

This module imports triton only when the Triton backend is actually used.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import warnings
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from agoq.compat import current_dispatch_mode
from agoq.quant.formats import QuantFormat

BACKENDS = ("auto", "torch", "compiled", "triton")
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


@functools.lru_cache(maxsize=None)
def compiler_available() -> bool:
    """Whether torch.compile can build CPU code here: a C++ compiler on PATH (inductor's requirement)."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


@functools.lru_cache(maxsize=None)
def _warn_no_compiler() -> None:
    warnings.warn(
        "no C++ compiler found (g++, c++ or clang++): quantization runs on the eager torch path, slower; "
        "install one (e.g. apt-get install g++) or set AGOQ_QUANT_BACKEND=torch to silence this",
        RuntimeWarning,
        stacklevel=3,
    )


def get_backend() -> str:
    """The configured choice: 'auto', 'torch', 'compiled' or 'triton' (set_backend, else AGOQ_QUANT_BACKEND, else auto)."""
    if _choice is not None:
        return _choice
    env = os.environ.get(ENV_VAR)
    return "auto" if not env else _check_name(env, f"environment variable {ENV_VAR}")


def set_backend(name: str | None) -> None:
    """Choose 'auto', 'torch', 'compiled' or 'triton' for this process; None returns the choice to AGOQ_QUANT_BACKEND."""
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


def _compiled_cpu() -> str:
    # Compiled code cannot run under a Python dispatch mode (torch's MemTracker, agoq's count of a
    # step's temporaries): there the reference runs, and what is counted is its allocations.
    if current_dispatch_mode() is not None:
        return "torch"
    if compiler_available():
        return "compiled"
    _warn_no_compiler()
    return "torch"


def resolve(device: torch.device | str) -> str:
    """'torch', 'compiled' or 'triton': the backend quantization of tensors on ``device`` uses now."""
    choice = get_backend()
    device = torch.device(device)
    if choice == "torch":
        return "torch"
    if choice == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return _compiled_cpu() if device.type == "cpu" else "torch"
    if choice == "compiled":
        return _compiled_cpu() if device.type == "cpu" else "torch"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed: pip install 'agoq[triton]', or set {ENV_VAR}=torch")
    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"the Triton backend runs on CUDA (or CPU under TRITON_INTERPRET=1), not on {device.type}; use the torch backend")
    return "triton"


def kernels(device: torch.device | str, fmt: QuantFormat | None = None) -> ModuleType | None:
    """The kernel module (agoq.quant.compiled or agoq.quant.triton) that should quantize ``fmt`` on ``device``, else None.

    Both offer quantize, quantize_rows_into (rows of a wire buffer written in place), dequantize,
    dequantize_rows (rows of a wire buffer read in place), accumulate_ (the gradient fold) and
    reduce_rows (the 8-bit all-reduce's local sum) with the reference's exact results, and
    swiglu_quantize (the fused SwiGLU forward: the product, and gate and up quantized as quantize
    does).
    """
    which = resolve(device)
    if which == "torch":
        return None
    if which == "compiled":
        import agoq.quant.compiled as kernel_module
    else:
        import agoq.quant.triton as kernel_module  # type: ignore[no-redef]

    if fmt is not None and not kernel_module.supports(fmt):
        return None
    return kernel_module


def layer_kernels(device: torch.device | str, fmt: QuantFormat | None = None) -> ModuleType | None:
    """The Triton module when its fused RMSNorm kernels and SwiGLU backward should run, else None
    (the fused SwiGLU forward, which compiled code has too, comes from :func:`kernels`)."""
    if resolve(device) != "triton":
        return None
    return kernels(device, fmt)


def formula(fn: Callable[..., Any], device: torch.device | str, **constants: Any) -> Callable[..., Any]:
    """``fn`` with keyword ``constants`` fixed: torch.compile'd under the compiled backend, else as it is."""
    if resolve(device) == "compiled":
        from agoq.quant.compiled import compiled

        return compiled(fn, **constants)
    return functools.partial(fn, **constants)


def formula_reading_codes(
    fn: Callable[..., Any], device: torch.device | str, fmt: QuantFormat, positions: tuple[int, ...], **constants: Any
) -> Callable[..., Any] | None:
    """Under the compiled backend, elementwise ``fn`` with ``constants`` fixed whose arguments at
    ``positions`` are QTensors of whole blocks, dequantized inside its graph (see
    agoq.quant.compiled.reading_codes); None elsewhere (dequantize first, then call :func:`formula`)."""
    if resolve(device) != "compiled":
        return None
    import agoq.quant.compiled as kernel_module

    return kernel_module.reading_codes(fn, fmt, positions, **constants) if kernel_module.supports(fmt) else None


__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "compiler_available",
    "formula",
    "formula_reading_codes",
    "get_backend",
    "kernels",
    "layer_kernels",
    "resolve",
    "set_backend",
    "triton_available",
    "use_backend",
]
