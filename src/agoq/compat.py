"""Every torch API newer than agoq's floor (torch 2.11), and every private torch name agoq reads: here alone.

agoq runs on the torch a user already has, from 2.11 through 2.15 (``python -m benchmarks.compat``
checks each). Code elsewhere in ``src/agoq`` calls the names below instead of torch's, so that a
release moving or adding a name changes this file only; ``tests/test_compat.py`` checks that no
other module calls a name listed in :data:`NEWER_THAN_FLOOR` or reaches into a private torch module,
and that every ``torch.*`` name the package spells resolves on the installed torch.

Importing this module changes nothing in the process: it reads torch's attributes, nothing more.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

# The oldest torch the compatibility run passes on; pyproject.toml's floor.
TORCH_FLOOR = (2, 11)

# Public names agoq uses that torch added after TORCH_FLOOR, with the release that added them and
# what this module falls back to before it.
NEWER_THAN_FLOOR = {
    "all_gather_single": ("2.13", "dist.all_gather_into_tensor, the same collective under its older name"),
    "reduce_scatter_single": ("2.13", "dist.reduce_scatter_tensor, the same collective under its older name"),
    "set_reduce_scatter_unused_params": (
        "2.12 or 2.13 (2.11 lacks it, 2.13 has it; 2.12 untested)",
        "none: a parameter without a gradient needs requires_grad=False",
    ),
}


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu130' or '3.6.0'."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    return major_minor(torch.__version__)


def _newest(*names: str) -> Callable[..., Any]:
    """The first of ``names`` that torch.distributed has: 2.13 renamed the tensor collectives and
    deprecated the old names (a FutureWarning per call), which 2.11 and 2.12 alone have."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise ImportError(f"torch {torch.__version__} has none of torch.distributed.{', '.join(names)}")


# Gather each rank's same-size input into one output tensor (concatenated along dim 0).
all_gather_single: Callable[..., Any] = _newest("all_gather_single", "all_gather_into_tensor")
# Sum (or ``op``) the ranks' inputs and give each rank its own slice of dim 0.
reduce_scatter_single: Callable[..., Any] = _newest("reduce_scatter_single", "reduce_scatter_tensor")


def fsdp_can_reduce_unused_params(module: Any) -> bool:
    """Whether this FSDP2 module can reduce-scatter zeros for parameters that got no gradient
    (``set_reduce_scatter_unused_params``); before it, FSDP2 leaves them out of the buffer."""
    return hasattr(module, "set_reduce_scatter_unused_params")


# --- private torch names, each because no public API serves (docs/ARCHITECTURE.md lists why) ---


def current_dispatch_mode() -> Any:
    """The innermost active Python dispatch mode, or None (torch has no public query)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``: the extension point torch documents, exported by no public module."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def outer_saved_tensor_hooks() -> tuple[Any, Any] | None:
    """The saved-tensor hooks active outside agoq's own (a meter, an offloader), or None where
    torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def fsdp_reduce_scatter_base() -> type:
    """FSDP2's custom reduce-scatter protocol class, which ``set_custom_reduce_scatter`` takes but
    torch does not export."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


def fsdp_param_group(module: Any) -> Any:
    """``module``'s FSDP2 parameter group (None where it manages no parameters)."""
    return module._get_fsdp_state()._fsdp_param_group


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail with ``message`` unless ``condition`` (a bool scalar tensor) holds, without a host read.

    On a GPU the check is a device-side assert, reported at the next synchronization, so that a
    check in the hot path does not stall the queue; on a CPU it raises RuntimeError at once.
    ``torch._assert_async`` is the one operator that does this; torch has no public name for it.
    """
    torch._assert_async(condition, message)


def leave_dim_dynamic(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with dimension ``dim`` marked for torch.compile to keep symbolic from the first graph on
    (a size of 0 or 1 is still specialized), as automatic dynamic shapes would only after a second
    size. ``torch._dynamo.maybe_mark_dynamic`` is the one way to ask it; torch.compile's
    ``dynamic=True`` makes every integer symbolic instead. Returns ``t``."""
    torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def inductor_default_cache_dir() -> str:
    """The folder inductor caches into when TORCHINDUCTOR_CACHE_DIR is not set."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()
