"""What a run computes with when the config says ``auto``: the dtype (bf16 only where it is
faster) and the quantization backend (compiled CPU code only where it pays for its compile).

GPUs with bf16 support get bf16. On CPUs the answer depends on the instruction set, and a wrong
default is expensive: on a CPU without bf16 instructions torch emulates every bf16 operation, and
even with them bf16 was not faster on every CPU (benchmarks/train_dtype.py). So a CPU whose
/proc/cpuinfo lists neither ``avx512_bf16`` nor ``amx_bf16`` gets fp32 at once, and one
with them gets bf16 only if a probe (forward + backward of a SwiGLU MLP at the model's width, on as
many threads as each worker will use) runs at least ``BF16_MIN_SPEEDUP`` faster in bf16.

The probe is a fact of the machine, not of its load at one moment: it is measured once per CPU model,
bf16 flags, torch version and capability, thread count and model width, and recorded in
``compute_dtype.json`` in the agoq cache folder; later runs read the record. A run that resumes a
checkpoint keeps the checkpoint's dtype when the config says ``auto``, and one that asks for another
dtype explicitly is refused before it starts (:func:`check_resume_dtype`): converting would either
drop the fp32 master weights or invent them.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
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
# Alternating fp32/bf16 rounds of the probe, of which each dtype's median is kept: a burst of load
# from other processes then slows both dtypes alike, or only one round of one of them.
PROBE_ROUNDS = 5
# The file in the agoq cache folder that holds each machine's probe result.
PROBE_RECORD = "compute_dtype.json"
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


@functools.lru_cache(maxsize=None)
def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else the platform's processor string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def cpu_flags(names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of ``names`` this CPU has (e.g. 'avx2', 'avx512_bf16', 'amx_bf16')."""
    return tuple(f for f in names if f in _cpuinfo_flags())


def cpu_bf16_flags() -> tuple[str, ...]:
    """The bf16 instruction-set flags of this CPU (``avx512_bf16``, ``amx_bf16``) that /proc/cpuinfo lists."""
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


def bf16_speedup(hidden: int, intermediate: int, threads: int, rounds: int = PROBE_ROUNDS) -> tuple[float, float, float]:
    """(fp32 seconds / bf16 seconds, fp32 seconds, bf16 seconds) of the MLP probe: the medians of
    ``rounds`` alternating rounds (fp32 first in even rounds, bf16 first in odd ones)."""
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    for i in range(rounds):
        order = (torch.float32, torch.bfloat16) if i % 2 == 0 else (torch.bfloat16, torch.float32)
        for dtype in order:
            times[dtype].append(probe_seconds(dtype, hidden, intermediate, threads, repeats=2))
    t32, t16 = statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16])
    return t32 / t16, t32, t16


def probe_record_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where this machine's probe results are recorded: ``compute_dtype.json`` in the agoq cache folder
    (``cache``, else $AGOQ_CACHE_DIR, else ~/.cache/agoq)."""
    from agoq.train.tokenizer import cache_dir

    return cache_dir(cache) / PROBE_RECORD


def probe_key(hidden: int, intermediate: int, threads: int) -> dict[str, Any]:
    """What a probe result depends on: the CPU model and its bf16 flags, torch and the capability its
    kernels run at, the threads of each worker and the model's width."""
    return {
        "cpu": cpu_model_name(),
        "bf16_flags": list(cpu_bf16_flags()),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "hidden": hidden,
        "intermediate": intermediate,
    }


def _read_records(path: Path) -> list[dict[str, Any]]:
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        return []  # no record yet, or an unreadable one: measure again and rewrite it
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("key"), dict)]


def recorded_speedup(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The probe result recorded in ``path`` for ``key`` (speedup, fp32_s, bf16_s, measured), or None."""
    for entry in _read_records(path):
        if entry["key"] == key and isinstance(entry.get("speedup"), (int, float)) and entry["speedup"] > 0:
            return entry
    return None


def record_speedup(path: Path, key: dict[str, Any], speedup: float, t32: float, t16: float) -> dict[str, Any]:
    """Add (or replace) the probe result of ``key`` in ``path``, written atomically; return the entry."""
    from agoq.train.nofollow import write_atomic

    entry = {"key": key, "speedup": speedup, "fp32_s": t32, "bf16_s": t16, "measured": datetime.date.today().isoformat()}
    entries = [e for e in _read_records(path) if e["key"] != key] + [entry]
    write_atomic(path, json.dumps({"format": 1, "entries": entries}, indent=1) + "\n")
    return entry


def _measured_once(hidden: int, intermediate: int, threads: int, record: Path | None) -> tuple[float, str]:
    """(bf16 speedup of the probe, where it comes from in words): the record's, else measured now and recorded."""
    key = probe_key(hidden, intermediate, threads)
    found = recorded_speedup(record, key) if record is not None else None
    if found is not None:
        return float(found["speedup"]), f"measured once on this machine on {found['measured']}, recorded in {record}"
    ratio, t32, t16 = bf16_speedup(hidden, intermediate, threads)
    if record is None:
        return ratio, "measured now"
    try:
        record_speedup(record, key, ratio, t32, t16)
    except OSError as e:
        return ratio, f"measured now; not recorded ({record}: {e.strerror or e})"
    return ratio, f"measured now and recorded in {record} for the next runs on this machine"


@functools.lru_cache(maxsize=None)
def choose_compute_dtype(requested: str, device_type: str, hidden: int, intermediate: int, threads: int, record: Path | None = None) -> DtypeChoice:
    """The dtype for ``requested`` ('auto', 'bf16' or 'fp32') on ``device_type``, with the reason.

    ``record``: the JSON file where the probe's result for this machine is kept (read if there,
    else measured and written); None measures without recording.
    """
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
    ratio, where = _measured_once(hidden, intermediate, threads, record)
    names = "+".join(f.upper().replace("_", "-") for f in flags)
    verdict = f"CPU with {names}: a bf16 MLP probe ran {ratio:.2f}x the fp32 speed"
    if ratio >= BF16_MIN_SPEEDUP:
        return DtypeChoice("bf16", f"{verdict}; {where}")
    return DtypeChoice("fp32", f"{verdict} (bf16 needs >= {BF16_MIN_SPEEDUP}x); {where}")


def compute_dtype_for(cfg: "TrainConfig", device_type: str, threads: int) -> DtypeChoice:
    """choose_compute_dtype for a training config's compute_dtype and model width, recorded in its cache folder."""
    mc = cfg.model_config()
    record = probe_record_path(cfg.data.cache_dir)
    return choose_compute_dtype(cfg.precision.compute_dtype, device_type, mc.hidden, mc.intermediate, threads, record)


# What a checkpoint's weights are, in the config's words.
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}


def checkpoint_compute_dtype(cfg: "TrainConfig") -> tuple[str, Path] | None:
    """(compute dtype, step folder) of the checkpoint a run of ``cfg`` resumes, or None (not resuming,
    no checkpoint, or one that does not say). Problems with the checkpoint are left to its load."""
    from agoq.train.resume import resumed_manifest

    found = resumed_manifest(cfg)
    if found is None:
        return None
    latest, manifest = found
    if manifest is None:
        # No manifest: latest_checkpoint returned it only with the user's consent (trust_unverified),
        # which covers reading DCP's index; the weights' dtype there is the run's.
        from agoq.train.checkpoint import saved_weights_dtype

        saved = _DTYPE_NAMES.get(str(saved_weights_dtype(latest)))
        return (saved, latest) if saved else None
    saved = ((manifest.get("run_config") or {}).get("precision") or {}).get("compute_dtype")
    if saved not in ("bf16", "fp32"):
        saved = _DTYPE_NAMES.get(str(manifest.get("weights_dtype")))
    return (saved, latest) if saved else None


def check_resume_dtype(cfg: "TrainConfig") -> None:
    """ConfigError when ``cfg`` sets a compute dtype other than the one of the checkpoint it resumes.

    A bf16 checkpoint holds bf16 weights and fp32 master weights in the optimizer state, an fp32 one
    fp32 weights and no masters: loading either into the other dtype would drop the masters or find
    none, so the run is refused before it starts, naming the saved dtype.
    """
    from agoq.train.config import ConfigError

    saved = checkpoint_compute_dtype(cfg)
    asked = cfg.precision.compute_dtype
    if saved is None or asked in ("auto", saved[0]):
        return
    dtype, step_dir = saved
    layout = "bf16 weights with fp32 master weights" if dtype == "bf16" else "fp32 weights without separate master weights"
    raise ConfigError(
        f"precision.compute_dtype={asked} but the checkpoint this run resumes ({step_dir}) was trained in {dtype} ({layout}); "
        f"resume with --precision.compute_dtype={dtype} (or auto, which keeps it), or start a new run with --train.out_dir=runs/NAME"
    )


# On CPUs `auto` compiles the formulas where a C++ compiler is found: on the embedded default they
# beat eager torch (benchmarks/results/train_ratio.json, mode "eager" against "default").


def choose_quant_backend(requested: str, device_type: str) -> DtypeChoice:
    """The quantization backend for ``requested`` ('auto' or a name of agoq.quant.backend.BACKENDS), with the reason."""
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
        return DtypeChoice("torch", "eager: no C++ compiler for torch.compile here (g++, c++ or clang++); install one for the compiled formulas")
    return DtypeChoice(
        "compiled",
        "the reference formulas under torch.compile; the first run on a machine compiles them, later runs read inductor's cache; "
        "precision.quant_backend=torch runs them eagerly",
    )


def quant_backend_for(cfg: "TrainConfig", device_type: str) -> DtypeChoice:
    """choose_quant_backend for a training config (the compute dtype does not change the rule)."""
    return choose_quant_backend(cfg.precision.quant_backend, device_type)


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
    for the dtype probe). A resumed run's ``auto`` dtype is its checkpoint's. The config itself is
    left as validated."""
    pr = cfg.precision
    saved = checkpoint_compute_dtype(cfg) if pr.compute_dtype == "auto" else None
    if saved is not None:
        # Never the probe's answer for a resumed run: a run keeps the precision it was trained in.
        dtype = DtypeChoice(saved[0], f"kept from the checkpoint this run resumes, {saved[1]}: auto never changes a run's precision")
    else:
        dtype = compute_dtype_for(cfg, device_type, threads)
    if pr.compute_dtype == "auto":
        print(f"agoq train: compute dtype {dtype.name} ({dtype.reason})", flush=True)
    quant = quant_backend_for(cfg, device_type)
    if pr.quant_backend == "auto":
        print(f"agoq train: quantization {quant.name} ({quant.reason})", flush=True)
    return ResolvedChoices(dtype.name, quant.name)


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
    "BF16_MIN_SPEEDUP",
    "PROBE_RECORD",
    "DtypeChoice",
    "ResolvedChoices",
    "bf16_speedup",
    "check_resume_dtype",
    "checkpoint_compute_dtype",
    "choose_compute_dtype",
    "choose_quant_backend",
    "compute_dtype_for",
    "cpu_bf16_flags",
    "cpu_cores",
    "cpu_flags",
    "cpu_model_name",
    "probe_key",
    "probe_record_path",
    "probe_seconds",
    "quant_backend_for",
    "record_speedup",
    "recorded_speedup",
    "resolve_choices",
    "worker_threads",
]
