"""What a run computes with when the config says ``auto``: the dtype (bf16 only where it is
faster) and the quantization backend (compiled CPU code only where it pays for its compile).

GPUs with bf16 support get bf16. On CPUs the answer depends on the instruction set, and a wrong
default is expensive: measured with the embedded default run, a bf16 step was 0.86x the fp32 step on
one AMD EPYC (flags not recorded), 1.45x on an Intel Xeon with AVX512-BF16 and no AMX, and 10.7x on
an AVX2-only AMD EPYC (torch then emulates every bf16 operation). So a CPU without AVX512-BF16 or AMX-BF16 gets fp32 at once, and one
with them gets bf16 only if a sub-second probe (forward + backward of a SwiGLU MLP at the model's
width, on as many threads as each worker will use) runs at least ``BF16_MIN_SPEEDUP`` faster in bf16.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from agoq.train.config import TrainConfig

# bf16 must beat fp32 by this factor to be chosen on a CPU: within noise, fp32 is the safer choice
# (exact master-weight arithmetic, no conversion passes).
BF16_MIN_SPEEDUP = 1.1
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
PROBE_TOKENS = 512
# torch.backends.cpu.get_cpu_capability() values whose kernels have no native bf16 arithmetic.
TORCH_CAPABILITIES_WITHOUT_BF16 = ("DEFAULT", "NO AVX", "AVX2", "ZVECTOR", "VSX")


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype a run uses and why, in words for the run's opening lines."""

    name: str  # "bf16" | "fp32"
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
    """The bf16 instruction-set flags of this CPU (AVX512-BF16, AMX-BF16) that /proc/cpuinfo lists."""
    return cpu_flags(BF16_CPU_FLAGS)


def probe_seconds(dtype: torch.dtype, hidden: int, intermediate: int, threads: int, repeats: int = 3) -> float:
    """Fastest of ``repeats`` forward+backward passes of a SwiGLU MLP over PROBE_TOKENS tokens in ``dtype``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(PROBE_TOKENS, hidden, generator=gen).to(dtype).requires_grad_()
        w_in = (torch.randn(2 * intermediate, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_()
        w_out = (torch.randn(hidden, intermediate, generator=gen) / intermediate**0.5).to(dtype).requires_grad_()
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms up allocator and kernels
            t0 = time.perf_counter()
            gate, up = F.linear(x, w_in).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, w_out).float().square().mean().backward()
            best = min(best, time.perf_counter() - t0)
            x.grad = w_in.grad = w_out.grad = None
        return best
    finally:
        torch.set_num_threads(saved)


@functools.lru_cache(maxsize=None)
def choose_compute_dtype(requested: str, device_type: str, hidden: int, intermediate: int, threads: int) -> DtypeChoice:
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
        # ATEN_CPU_CAPABILITY (or the build) holds torch's kernels below AVX512: they would emulate bf16.
        return DtypeChoice(
            "fp32", f"torch runs this CPU's kernels at {capability} (ATEN_CPU_CAPABILITY), so bf16 would be emulated (about 10x slower)"
        )
    t32 = probe_seconds(torch.float32, hidden, intermediate, threads)
    t16 = probe_seconds(torch.bfloat16, hidden, intermediate, threads)
    ratio = t32 / t16
    names = "+".join(f.upper().replace("_", "-") for f in flags)
    verdict = f"CPU with {names}: a bf16 MLP probe ran {ratio:.2f}x the fp32 speed"
    if ratio >= BF16_MIN_SPEEDUP:
        return DtypeChoice("bf16", verdict)
    return DtypeChoice("fp32", f"{verdict} (bf16 needs >= {BF16_MIN_SPEEDUP}x)")


def compute_dtype_for(cfg: "TrainConfig", device_type: str, threads: int) -> DtypeChoice:
    """choose_compute_dtype for a training config's compute_dtype and model width."""
    mc = cfg.model_config()
    return choose_compute_dtype(cfg.precision.compute_dtype, device_type, mc.hidden, mc.intermediate, threads)


# The compiled CPU path saves about 0.12 s per step of the default run held to AVX2 (4 workers on a
# 2-core AMD EPYC: 0.81 s eager, 0.69 s compiled) and 0.19 s on a 2-core Xeon. It costs about 9 s of
# each run where inductor's on-disk cache holds its kernels already, and 35-45 s where nothing is
# compiled yet (the first compiled run of a configuration on a machine): `python -m benchmarks.run_time`,
# benchmarks/results/run_time.json (held to AVX2: the eager first run 166 s, a compiling run 180 s,
# the run after it 156 s). So a run compiles where its kernels are cached and it has
# COMPILE_MIN_STEPS steps, and where they are not only from FIRST_COMPILE_MIN_STEPS steps, below
# which eager is faster overall (35-45 s / 0.12 s a step: 300-400 steps).
COMPILE_MIN_STEPS = 100
FIRST_COMPILE_MIN_STEPS = 400


def compiled_kernels_key(cfg: "TrainConfig", compute_dtype: str) -> str:
    """What decides which kernels a run compiles: torch, the instruction set it runs at, the compute
    dtype and everything that picks formats or ops (the sizes are dynamic, but a model's are kept too)."""
    pr = {k: v for k, v in cfg.to_dict()["precision"].items() if k not in ("compute_dtype", "quant_backend")}
    p = cfg.parallel
    return json.dumps(
        {
            "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "compute_dtype": compute_dtype,
            "precision": pr,
            "parallel": [p.pp, p.tp, p.schedule, p.virtual_stages, p.zero1],
            "optimizer": cfg.optim.name,
            "model": cfg.model_config().to_dict(),
        },
        sort_keys=True,
    )


def choose_quant_backend(requested: str, device_type: str, steps: int, compiled_before: bool = False) -> DtypeChoice:
    """The quantization backend for ``requested`` ('auto' or a name of agoq.quant.backend.BACKENDS), with the reason.

    ``compiled_before``: whether an earlier run of this configuration left its compiled kernels in
    inductor's cache on this machine (agoq.inductor_cache.compiled_before).
    """
    from agoq.quant import backend

    if requested != "auto":
        return DtypeChoice(requested, "set in the config")
    if os.environ.get(backend.ENV_VAR):
        return DtypeChoice(backend.get_backend(), f"set by {backend.ENV_VAR}")
    if device_type == "cuda":
        return (
            DtypeChoice("auto", "Triton kernels where installed") if backend.triton_available() else DtypeChoice("torch", "triton is not installed")
        )
    if not backend.compiler_available():
        return DtypeChoice("torch", "no C++ compiler for torch.compile")
    if steps < COMPILE_MIN_STEPS:
        return DtypeChoice("torch", f"eager: a {steps}-step run is shorter than the {COMPILE_MIN_STEPS} steps that repay compiling")
    if compiled_before:
        return DtypeChoice("compiled", "torch.compile'd kernels, from inductor's cache on this machine")
    if steps < FIRST_COMPILE_MIN_STEPS:
        return DtypeChoice(
            "torch",
            f"eager: this configuration's kernels are not compiled on this machine yet, and compiling them (about 45 s) repays "
            f"only from {FIRST_COMPILE_MIN_STEPS} steps; a run of that length, or with precision.quant_backend=compiled, "
            f"compiles them for the next runs of {COMPILE_MIN_STEPS}+ steps",
        )
    return DtypeChoice("compiled", "torch.compile'd kernels, compiled in this first run and cached on disk for the next ones")


def quant_backend_for(cfg: "TrainConfig", device_type: str, compute_dtype: str) -> DtypeChoice:
    """choose_quant_backend for a training config, knowing whether its kernels are compiled on this machine."""
    from agoq.inductor_cache import compiled_before

    warm = device_type == "cpu" and compiled_before(compiled_kernels_key(cfg, compute_dtype))
    return choose_quant_backend(cfg.precision.quant_backend, device_type, cfg.train.steps, warm)


@dataclass(frozen=True)
class ResolvedChoices:
    """What a run computes with: the config's compute_dtype and quant_backend with ``auto`` decided.

    Decided once, by the local launcher before the workers start (agoq.train.run.resolve_auto_choices)
    or, under torchrun, by the workers themselves, and passed beside the config, which keeps what
    was asked for; what a run records as its config (summary.json, checkpoints) has these in place.
    """

    compute_dtype: str  # "bf16" | "fp32"
    quant_backend: str  # a name of agoq.quant.backend.BACKENDS ("auto" on a GPU: Triton where installed)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype as a torch dtype."""
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.compute_dtype]

    def config_dict(self, cfg: "TrainConfig") -> dict[str, Any]:
        """``cfg.to_dict()`` with the decided compute_dtype and quant_backend: the config the run effectively trained with."""
        out = cfg.to_dict()
        out["precision"].update(compute_dtype=self.compute_dtype, quant_backend=self.quant_backend)
        return out


def resolve_choices(cfg: "TrainConfig", device_type: str, threads: int) -> ResolvedChoices:
    """The config's compute dtype and quantization backend with ``auto`` decided for this machine and
    run, each ``auto`` saying which and why in the run's opening lines (``threads``: each worker's,
    for the dtype probe). The config itself is left as validated."""
    pr = cfg.precision
    dtype = compute_dtype_for(cfg, device_type, threads)
    if pr.compute_dtype == "auto":
        print(f"agoq train: compute dtype {dtype.name} ({dtype.reason})", flush=True)
    quant = quant_backend_for(cfg, device_type, dtype.name)
    if pr.quant_backend == "auto":
        print(f"agoq train: quantization {quant.name} ({quant.reason})", flush=True)
    return ResolvedChoices(dtype.name, quant.name)


def worker_threads(world_size: int) -> int:
    """Threads each of ``world_size`` local CPU workers gets (the cores shared evenly)."""
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


__all__ = [
    "BF16_MIN_SPEEDUP",
    "COMPILE_MIN_STEPS",
    "DtypeChoice",
    "FIRST_COMPILE_MIN_STEPS",
    "ResolvedChoices",
    "choose_compute_dtype",
    "choose_quant_backend",
    "compiled_kernels_key",
    "compute_dtype_for",
    "cpu_bf16_flags",
    "cpu_flags",
    "probe_seconds",
    "quant_backend_for",
    "resolve_choices",
    "worker_threads",
]
