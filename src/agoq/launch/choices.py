"""What a run computes with when the config says ``auto``, decided by rule from the device and
its instruction-set flags alone: the compute dtype and the quantization backend, each with the
reason in words.

GPUs with bf16 support get bf16. A CPU gets bf16 where it computes it natively: /proc/cpuinfo lists
``avx512_bf16`` or ``amx_bf16`` and torch's kernels are not held below avx512
(TORCH_CAPABILITIES_WITHOUT_BF16). Anywhere else torch emulates every bf16 operation, so the CPU
gets fp32. No timing is read or recorded: a run's arithmetic follows from the machine it names in
its opening lines, so a loss curve is reproduced from the flags alone. Whether bf16 pays on a given CPU is what ``python -m benchmarks.train_dtype``
measures. A run that resumes a checkpoint keeps the checkpoint's dtype
(:func:`agoq.launch.resume.checkpoint_compute_dtype`).

Nothing here prints: :func:`resolve_choices` returns the opening lines for its caller to print.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from agoq.launch.config import TrainConfig

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# torch.backends.cpu.get_cpu_capability() values whose kernels have no native bf16 arithmetic.
TORCH_CAPABILITIES_WITHOUT_BF16 = ("DEFAULT", "NO AVX", "AVX2", "ZVECTOR", "VSX")


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype a run uses and why, in words for the run's opening lines."""

    name: str  # "bf16" | "fp32"
    reason: str


@dataclass(frozen=True)
class BackendChoice:
    """The quantization backend a run uses and why, in words for the run's opening lines."""

    name: str  # a name of agoq.quant.backend.BACKENDS ("auto" on a GPU: Triton where installed)
    reason: str


@functools.lru_cache(maxsize=None)
def _cpuinfo_flags() -> frozenset[str]:
    """Every flag /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags(names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of ``names`` this CPU has (e.g. 'avx2', 'avx512_bf16', 'amx_bf16')."""
    return tuple(f for f in names if f in _cpuinfo_flags())


def cpu_bf16_flags() -> tuple[str, ...]:
    """The bf16 instruction-set flags of this CPU (``avx512_bf16``, ``amx_bf16``) that /proc/cpuinfo lists."""
    return cpu_flags(BF16_CPU_FLAGS)


def choose_compute_dtype(requested: str, device_type: str) -> DtypeChoice:
    """The dtype for ``requested`` ('auto', 'bf16' or 'fp32') on ``device_type``, with the reason."""
    if requested != "auto":
        return DtypeChoice(requested, "set in the config")
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice("bf16", "the GPU supports bf16")
        return DtypeChoice("fp32", "this GPU has no bf16 support")
    if device_type != "cpu":
        return DtypeChoice("bf16", f"{device_type} device")
    flags = cpu_bf16_flags()
    if not flags:
        return DtypeChoice("fp32", "this CPU has no AVX512-BF16 or AMX-BF16 instructions, so bf16 would be emulated (about 10x slower)")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in TORCH_CAPABILITIES_WITHOUT_BF16:
        # ATEN_CPU_CAPABILITY (or the build) holds torch's kernels below avx512: they would emulate bf16.
        return DtypeChoice(
            "fp32", f"torch runs this CPU's kernels at {capability} (ATEN_CPU_CAPABILITY), so bf16 would be emulated (about 10x slower)"
        )
    names = "+".join(f.upper().replace("_", "-") for f in flags)
    return DtypeChoice("bf16", f"this CPU computes bf16 natively ({names}); --precision.compute_dtype=fp32 keeps fp32")


def compute_dtype_for(cfg: "TrainConfig", device_type: str) -> DtypeChoice:
    """choose_compute_dtype for a training config's compute_dtype."""
    return choose_compute_dtype(cfg.precision.compute_dtype, device_type)


# On CPUs `auto` compiles the formulas where a C++ compiler is found: on the embedded default they
# beat eager torch (benchmarks/results/train_ratio.json, mode "eager" against "default").


def choose_quant_backend(requested: str, device_type: str) -> BackendChoice:
    """The quantization backend for ``requested`` ('auto' or a name of agoq.quant.backend.BACKENDS), with the reason."""
    from agoq.quant import backend

    if requested != "auto":
        return BackendChoice(requested, "set in the config")
    if os.environ.get(backend.ENV_VAR):
        return BackendChoice(backend.get_backend(), f"set by {backend.ENV_VAR}")
    if device_type == "cuda":
        return (
            BackendChoice("auto", "Triton kernels where installed")
            if backend.triton_available()
            else BackendChoice("torch", "triton is not installed")
        )
    if not backend.compiler_available():
        return BackendChoice("torch", "eager: no C++ compiler for torch.compile here (g++, c++ or clang++); install one for the compiled formulas")
    return BackendChoice(
        "compiled",
        "the reference formulas under torch.compile; the first run on a machine compiles them, later runs read inductor's cache; "
        "precision.quant_backend=torch runs them eagerly",
    )


def quant_backend_for(cfg: "TrainConfig", device_type: str) -> BackendChoice:
    """choose_quant_backend for a training config (the compute dtype does not change the rule)."""
    return choose_quant_backend(cfg.precision.quant_backend, device_type)


@dataclass(frozen=True)
class ResolvedChoices:
    """What a run computes with: the config's compute_dtype and quant_backend with ``auto`` decided.

    Decided once, by the local launcher before the workers start (agoq.launch.run.resolve_auto_choices)
    or, under torchrun, by the workers themselves, and passed beside the config, which keeps what
    was asked for; what a run records as its config (summary.json, checkpoints) has these in place.
    """

    compute_dtype: str  # "bf16" | "fp32"
    quant_backend: str  # a name of agoq.quant.backend.BACKENDS ("auto" on a GPU: Triton where installed)
    # What the run's opening lines say of each ``auto`` decided, for the caller to print.
    lines: tuple[str, ...] = field(default=(), compare=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype as a torch dtype."""
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.compute_dtype]

    def config_dict(self, cfg: "TrainConfig") -> dict[str, Any]:
        """``cfg.to_dict()`` with the decided compute_dtype and quant_backend: the config the run effectively trained with."""
        out = cfg.to_dict()
        out["precision"].update(compute_dtype=self.compute_dtype, quant_backend=self.quant_backend)
        return out


def resolve_choices(cfg: "TrainConfig", device_type: str) -> ResolvedChoices:
    """The config's compute dtype and quantization backend with ``auto`` decided for this machine and
    run, with a line for each ``auto`` saying which and why. A resumed run's ``auto`` dtype is its
    checkpoint's. The config itself is left as validated."""
    from agoq.launch.resume import checkpoint_compute_dtype

    pr = cfg.precision
    saved = checkpoint_compute_dtype(cfg) if pr.compute_dtype == "auto" else None
    if saved is not None:
        # Never the machine's answer for a resumed run: a run keeps the precision it was trained in.
        dtype = DtypeChoice(saved[0], f"kept from the checkpoint this run resumes, {saved[1]}: auto never changes a run's precision")
    else:
        dtype = compute_dtype_for(cfg, device_type)
    quant = quant_backend_for(cfg, device_type)
    lines = []
    if pr.compute_dtype == "auto":
        lines.append(f"agoq train: compute dtype {dtype.name} ({dtype.reason})")
    if pr.quant_backend == "auto":
        lines.append(f"agoq train: quantization {quant.name} ({quant.reason})")
    return ResolvedChoices(dtype.name, quant.name, tuple(lines))


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says, as in a container)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_threads(world_size: int) -> int:
    """Threads each of ``world_size`` local CPU workers gets (the cores shared evenly)."""
    return max(1, cpu_cores() // max(1, world_size))


__all__ = [
    "BF16_CPU_FLAGS",
    "BackendChoice",
    "DtypeChoice",
    "ResolvedChoices",
    "choose_compute_dtype",
    "choose_quant_backend",
    "compute_dtype_for",
    "cpu_bf16_flags",
    "cpu_cores",
    "cpu_flags",
    "quant_backend_for",
    "resolve_choices",
    "worker_threads",
]
