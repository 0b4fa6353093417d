"""The launch and host-sync budget of a training step: device operations and host syncs, per phase.

A GPU step pays a fixed cost for every kernel it launches and stalls its queue every time the host
waits for a device value. Both are counts of what the code asks for, not of how fast a machine runs
it, so they are counted here on CPU, for a GPU to pay. A dispatch mode sees every ATen operator below
autograd; each one that touches data is one device operation (at least one kernel launch on a GPU).
Views, shape queries and empty allocations launch nothing and are left out (METADATA_OPS). agoq's
fused ops are ``torch.library`` custom ops: the count looks inside them, at the operators and Triton
kernels they run. A Triton kernel launch is one device operation; under Triton's interpreter the
interpreter's own tensor work is not counted. Host syncs are the operators and tensor methods that
make the host wait for a device value, by category (HOST_SYNC_OPS, HOST_READ_METHODS), each with
the line of agoq (else of the library) that asked for it.

Two subjects. ``agoq train``'s own step (the Trainer in gloo process groups), the bf16 policy
against AGoQ, by phase: step start (data, buffers), forward, backward (gradient folds included),
gradient sync (the dp reduction and the gradient norm), agreement (the one all-reduce of the norm,
the non-finite flag and the loss, and its host read), optimizer, step end (the step's record). And
a Hugging Face LlamaForCausalLM, one forward and backward, unpatched against ``apply_agoq`` on the
default, torch and Triton quantization paths.

Under a dispatch mode agoq's compiled CPU code cannot run (agoq.quant.backend runs the reference
instead), so there the default path counts the torch reference; the HF default path is counted
again, as it runs, from the profiler's event tree (profiled_count), beside the unpatched model
counted alike. The Triton rows count what a GPU's default path launches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import multiprocessing
import os
import queue as queue_module
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks._common import add_out_dir

DESCRIPTION = "device operations (kernel launches on a GPU) and host syncs per step, by phase: agoq train and a patched HF Llama, bf16 policy vs AGoQ"

# Operators that only make or reinterpret a tensor's metadata (views, shape and size queries) or
# allocate without writing: no kernel runs for them on a GPU, so they are no launch. Any other
# operator whose schema says it returns a view of its input is left out alike (OpOverload.is_view).
METADATA_OPS = (
    "aten.view",
    "aten._unsafe_view",
    "aten._reshape_alias",
    "aten.as_strided",
    "aten.as_strided_",
    "aten.t",
    "aten.transpose",
    "aten.expand",
    "aten.permute",
    "aten.slice",
    "aten.select",
    "aten.narrow",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.unfold",
    "aten.diagonal",
    "aten.detach",
    "aten.detach_",
    "aten.alias",
    "aten.lift_fresh",
    "aten.split",
    "aten.split_with_sizes",
    "aten.unbind",
    "aten.chunk",
    "aten.view_as_real",
    "aten.view_as_complex",
    "aten._conj",
    "aten._neg_view",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.empty_permuted",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.resize_",
    "aten.set_",
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
    "aten.sym_storage_offset",
    "aten.sym_is_contiguous",
    "aten.is_same_size",
    "aten.dim",
    "aten.size",
    "aten.stride",
    "aten.numel",
    # A read of one value to the host: no kernel, a copy the host waits for (counted as a host sync).
    "aten._local_scalar_dense",
)

# Operators that make the host wait for the device, by category. Each but the scalar read also runs
# a kernel, so it counts as a device operation too.
HOST_SYNC_OPS = {
    "scalar read (item/float/int/bool of a tensor)": ("aten._local_scalar_dense",),
    "nonzero (output size depends on values)": ("aten.nonzero",),
    "value-dependent output size (masked_select, unique, repeat_interleave, bincount)": (
        "aten.masked_select",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.repeat_interleave",
        "aten.bincount",
    ),
    "comparison read on the host (equal, allclose, is_nonzero)": ("aten.equal", "aten.allclose", "aten.is_nonzero"),
}
# Boolean-mask indexing runs nonzero inside its kernel (a host sync the dispatcher does not show).
BOOL_INDEX_CATEGORY = "boolean-mask index (nonzero inside)"
BOOL_INDEX_OPS = ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_")
# Tensor methods that copy device memory to the host without an operator the dispatcher shows
# (on a CPU tensor they are free, so only the method call can be counted).
HOST_READ_CATEGORY = "host read (tolist/cpu/numpy)"
HOST_READ_METHODS = ("tolist", "cpu", "numpy")
TRITON_PREFIX = "triton:"

# Phases of agoq train's step, in order (see the module docstring).
TRAIN_PHASES = ("step_start", "forward", "backward", "gradient_sync", "agreement", "optimizer", "step_end")
# What the trainer's own phase names (Trainer._train_step's enter_phase calls) are counted as.
_TRAINER_PHASE = {"data": "step_start", "forward_backward": "forward", "gradient_sync": "gradient_sync", "optimizer": "optimizer"}

# Namespaces whose operators are leaf operators (a kernel each); collectives are one launch each.
_LEAF_NAMESPACES = ("aten", "prims", "c10d", "_c10d_functional", "_dtensor", "quantized_decomposed")

_SYNC_CATEGORY = {op: category for category, ops in HOST_SYNC_OPS.items() for op in ops}


def _packet_name(func: Any) -> str:
    """'aten.mm' of aten.mm.default: the name without its overload."""
    return f"{func.namespace}.{func._opname}"


def _is_bool_index(args: tuple, kwargs: dict) -> bool:
    import torch

    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}triton{os.sep}", f"{os.sep}numpy{os.sep}")
_STDLIB = sysconfig.get_paths()["stdlib"]


def _short(filename: str) -> str:
    for marker in (f"{os.sep}agoq{os.sep}", f"site-packages{os.sep}"):
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + (1 if marker.startswith(os.sep) else len(marker)) :]
    return os.path.basename(filename)


def call_site(skip: int = 2) -> str:
    """Where the running operator was asked for: the innermost frame in agoq's source, else the
    innermost frame outside torch, triton, numpy and the standard library (a model library's line)."""
    frame = sys._getframe(skip)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}agoq{os.sep}" in name and f"{os.sep}benchmarks{os.sep}" not in name:
            return f"{_short(name)}:{frame.f_lineno} {frame.f_code.co_name}"
        if fallback is None and not any(p in name for p in _LIBRARY_PARTS) and not name.startswith(("<", _STDLIB)):
            fallback = f"{_short(name)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "?"


def _site(phase: str) -> str:
    """call_site of the operator running now; in backward with the autograd node that runs it (a
    backward written in C++ has no Python frame of its own: the line is the backward() call)."""
    site = call_site(4)
    if phase == "backward":
        import torch

        node = torch._C._current_autograd_node()
        if node is not None:
            site += f" [{node.name()}]"
    return site


def _dispatch_mode_base() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class LaunchCounter(_dispatch_mode_base()):  # type: ignore[misc]
    """A dispatch mode that counts device operations and host syncs by phase (see the module docstring).

    ``phase`` names where the step is; inside an autograd backward pass a phase named "forward"
    counts as "backward". Use it as a context manager: :meth:`counting` also counts Triton launches
    and the host-read tensor methods.
    """

    def __init__(self, phase: str = "forward", sources: bool = True) -> None:
        super().__init__()
        self.phase = phase
        self.sources = sources  # record each device operation's call site (a frame walk per operator)
        self.device_ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.syncs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sync_sites: collections.Counter = collections.Counter()  # (phase, category, op, site)
        self.op_sites: collections.Counter = collections.Counter()  # (phase, op, site)
        self.opaque: collections.Counter = collections.Counter()  # custom ops counted as one, unopened
        self._suspended = 0

    # ---- bookkeeping

    def current_phase(self) -> str:
        """The phase an operator running now counts in."""
        import torch

        if self.phase == "forward" and torch._C._current_graph_task_id() != -1:
            return "backward"
        return self.phase

    def count_op(self, name: str) -> None:
        """One device operation called ``name`` in the current phase."""
        phase = self.current_phase()
        self.device_ops[phase][name] += 1
        if self.sources:
            self.op_sites[(phase, name, _site(phase))] += 1

    def count_sync(self, category: str, name: str) -> None:
        """One host sync of ``category`` (by operator or method ``name``) in the current phase."""
        phase = self.current_phase()
        self.syncs[phase][category] += 1
        self.sync_sites[(phase, category, name, _site(phase))] += 1

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Count nothing inside (a Triton launch: its interpreter's tensor work is no device operation)."""
        from torch.utils._python_dispatch import _disable_current_modes

        self._suspended += 1
        try:
            with _disable_current_modes():
                yield
        finally:
            self._suspended -= 1

    # ---- the dispatch mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace not in _LEAF_NAMESPACES:
            body = _custom_op_body(func, args, kwargs)
            if body is not None:
                with self:  # count what the custom op runs, not the op itself
                    return body(*args, **kwargs)
            self.opaque[str(func)] += 1
        if _composite_implicit(func, args, kwargs):
            # Below autograd (inside a custom op) a composite operator reaches this mode whole;
            # above it, autograd has already split it: split it here too, so both count alike.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = _packet_name(func)
        category = _SYNC_CATEGORY.get(name)
        if category is None and name in BOOL_INDEX_OPS and _is_bool_index(args, kwargs):
            category = BOOL_INDEX_CATEGORY
        if category is not None:
            self.count_sync(category, name)
        if name not in METADATA_OPS and not func.is_view:
            self.count_op(name)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def counting(self) -> Iterator["LaunchCounter"]:
        """This mode, with Triton launches and host-read methods counted too."""
        with _count_triton_launches(self), _count_host_reads(self), self:
            yield self

    # ---- results

    def totals(self) -> dict[str, Any]:
        """Device operations and host syncs per phase, and their sums."""
        ops = {p: sum(c.values()) for p, c in self.device_ops.items()}
        syncs = {p: sum(c.values()) for p, c in self.syncs.items()}
        return {"device_ops": ops, "host_syncs": syncs, "device_ops_total": sum(ops.values()), "host_syncs_total": sum(syncs.values())}

    def summary(self, top: int = 10, top_sites: int = 12) -> dict[str, Any]:
        """What a result file keeps of this count (plain values)."""
        all_ops: collections.Counter = collections.Counter()
        for c in self.device_ops.values():
            all_ops.update(c)
        return {
            **self.totals(),
            "host_syncs_by_category": {p: dict(c) for p, c in self.syncs.items()},
            "sync_sources": [
                {"phase": p, "category": cat, "op": op, "source": site, "count": n}
                for (p, cat, op, site), n in sorted(self.sync_sites.items(), key=lambda kv: -kv[1])
            ],
            "top_ops": [[name, n] for name, n in all_ops.most_common(top)],
            "triton_launches": sum(n for name, n in all_ops.items() if name.startswith(TRITON_PREFIX)),
            "collectives": sum(n for name, n in all_ops.items() if name.startswith(("c10d.", "_c10d_functional."))),
            "top_op_sources": {phase: _top_sites(self.op_sites, phase, top_sites) for phase in self.device_ops},
            "opaque_custom_ops": dict(self.opaque),
        }


def _top_sites(op_sites: collections.Counter, phase: str, top: int) -> list[list[Any]]:
    """[op, call site, count] of one phase's most frequent device operations."""
    mine = collections.Counter({(op, site): n for (p, op, site), n in op_sites.items() if p == phase})
    return [[op, site, n] for (op, site), n in mine.most_common(top)]


_COMPOSITE: dict[tuple[Any, str], bool] = {}


def _composite_implicit(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` has no kernel of its own for its tensors' device, only a definition by
    other operators (CompositeImplicitAutograd): e.g. aten.linear, but not aten.silu_backward,
    which has both and runs its own kernel."""
    import torch

    device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
    key = (func, device)
    known = _COMPOSITE.get(key)
    if known is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        name = func.name()
        known = _COMPOSITE[key] = has(name, torch._C.DispatchKey.CompositeImplicitAutograd) and not has(name, device.upper())
    return known


def _custom_op_body(func: Any, args: tuple, kwargs: dict) -> Callable[..., Any] | None:
    """The Python function a ``torch.library.custom_op`` runs for these arguments' device, else None."""
    import torch
    from torch._library.custom_ops import _maybe_get_opdef

    try:
        opdef = _maybe_get_opdef(func)
    except (AttributeError, RuntimeError, ValueError):
        return None
    if opdef is None:
        return None
    device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return opdef._backend_fns.get(device) or opdef._init_fn


@contextlib.contextmanager
def _count_triton_launches(counter: LaunchCounter) -> Iterator[None]:
    """Each Triton kernel launch (compiled or interpreted) counts as one device operation, and what
    runs inside it counts as nothing. Patches triton only where triton is imported already."""
    if "triton" not in sys.modules:
        yield
        return
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    saved = {cls: cls.__dict__["run"] for cls in classes if "run" in cls.__dict__}

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if counter._suspended or kwargs.get("warmup"):
                return run(self, *args, **kwargs)
            counter.count_op(TRITON_PREFIX + getattr(getattr(self, "fn", None), "__name__", type(self).__name__))
            with counter.suspended():
                return run(self, *args, **kwargs)

        return counted

    for cls, run in saved.items():
        setattr(cls, "run", wrap(run))
    try:
        yield
    finally:
        for cls, run in saved.items():
            setattr(cls, "run", run)


@contextlib.contextmanager
def _count_host_reads(counter: LaunchCounter) -> Iterator[None]:
    """Count Tensor.tolist/cpu/numpy calls as host syncs (on a GPU each copies device memory to the host)."""
    import torch

    saved = {m: torch.Tensor.__dict__.get(m) for m in HOST_READ_METHODS}

    def wrap(method: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, method)

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not counter._suspended:
                counter.count_sync(HOST_READ_CATEGORY, f"Tensor.{method}")
            return original(self, *args, **kwargs)

        return counted

    for m in HOST_READ_METHODS:
        setattr(torch.Tensor, m, wrap(m))
    try:
        yield
    finally:
        for m, original in saved.items():
            if original is None:
                delattr(torch.Tensor, m)
            else:
                setattr(torch.Tensor, m, original)


# ---------------------------------------------------------------------------- agoq train


# (name, activations, gradients, quantization backend)
CONFIGS = {
    "bf16": ("bf16 policy", "bf16", "fp32", "torch"),
    "agoq": ("agoq", "agoq", "int8", "torch"),
    "agoq-triton": ("agoq, Triton kernels", "agoq", "int8", "triton"),
    # No kernel of agoq's runs under the bf16 policy: the Triton backend here gives it the sizes
    # (optimizer groups, pieces) it has on a GPU, the baseline the Triton rows compare with.
    "bf16-triton": ("bf16 policy, a GPU's sizes", "bf16", "fp32", "triton"),
}
# (agoq configuration, bf16 baseline, what they count): the CPU formulas at a CPU's sizes, and the
# GPU's kernels at a GPU's sizes (agoq.quant.pieces), the figure a GPU would show.
PAIRS = (("agoq", "bf16", "CPU formulas"), ("agoq-triton", "bf16-triton", "Triton kernels, a GPU's sizes"))
# Sizes: (model arguments, layouts they run at: None = every --layouts entry, else pp x dp 1 x 1 only).
LLAMA_1B_WIDTHS = ["--model.preset=llama3.2-1b"]
SIZES = {
    "tiny": ["--model.preset=tiny"],
    "1b-2l": [*LLAMA_1B_WIDTHS, "--model.n_layers=2"],
    "1b-4l": [*LLAMA_1B_WIDTHS, "--model.n_layers=4"],
    # Half the 1B widths (hidden and intermediate), heads and vocabulary the same: with 1b-2l, the
    # doubling of hidden at fixed layers and vocabulary.
    "1b-half-2l": [*LLAMA_1B_WIDTHS, "--model.n_layers=2", "--model.hidden=1024", "--model.intermediate=4096"],
}
# The Triton kernels run under the interpreter here (about 1.5 ms a program): one rank only, and
# not at 1b-4l (the doubling of hidden needs 1b-half-2l and 1b-2l; 1b-2l gives the bf16 ratio).
TRITON_SIZES = ("tiny", "1b-half-2l", "1b-2l")


def _layout(text: str) -> tuple[int, int]:
    pp, dp = (int(v) for v in text.lower().split("x"))
    return pp, dp


def trainer_arguments(size: str, config: str, pp: int, dp: int, args: argparse.Namespace, run_dir: Path, corpus: Path) -> list[str]:
    """``agoq train`` arguments of one job: the size's model, the configuration's precision, the layout."""
    _, acts, grads, which = CONFIGS[config]
    vocab = args.tiny_vocab if size == "tiny" else args.vocab
    return [
        *SIZES[size],
        f"--precision.activations={acts}",
        f"--precision.gradients={grads}",
        f"--precision.quant_backend={which}",
        "--precision.compute_dtype=fp32",
        f"--parallel.pp={pp}",
        f"--parallel.dp={dp}",
        f"--parallel.microbatches={args.microbatches}",
        f"--data.batch_size={args.microbatches * dp}",
        f"--data.seq_len={args.seq}",
        f"--data.vocab_size={vocab}",
        f"--data.corpus={corpus}",
        f"--data.cache_dir={run_dir / 'cache'}",
        "--train.eval_every=0",
        "--train.baseline=false",
        "--checkpoint.every=0",
        "--checkpoint.resume=false",
        f"--train.out_dir={run_dir / f'{size}_{config}_pp{pp}dp{dp}'}",
    ]


class _TrainerPhases:
    """Hands Trainer._train_step an object with enter_phase (its phase marks), and splits its
    gradient-sync phase where the agreement starts and its optimizer phase where the step ends."""

    def __init__(self, trainer: Any, counter: LaunchCounter) -> None:
        self.counter = counter
        sync = trainer.sync
        for method, after in (("local_grad_sq_norm", "agreement"), ("finish_step", "step_end")):
            original = getattr(sync, method, None)
            if original is not None:
                setattr(sync, method, self._then(original, after))

    def _then(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.counter.phase = phase
            return out

        return wrapped

    def enter_phase(self, name: str) -> None:
        """The trainer's phase mark, as this count names it."""
        self.counter.phase = _TRAINER_PHASE.get(name, name)


def count_trainer_step(trainer: Any, warmup: int) -> dict[str, Any]:
    """Run ``warmup`` steps, then count one step of ``trainer`` by phase."""
    for _ in range(warmup):  # the first step infers shapes and creates optimizer state
        trainer._train_step(None)
    counter = LaunchCounter(phase="step_start")
    marks = _TrainerPhases(trainer, counter)
    with counter.counting():
        trainer._train_step(marks)
    return {
        "summary": counter.summary(),
        "op_sites": [[phase, op, site, n] for (phase, op, site), n in counter.op_sites.items()],
        "rank": trainer.ctx.rank,
        "pp_rank": trainer.ctx.pp_rank,
        "dp_rank": trainer.ctx.dp_rank,
    }


def _trainer_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from agoq.launch.config import load_config
    from agoq.launch.components import build_run

    if job["config"].endswith("-triton"):
        import triton  # noqa: F401 - imported before counting, so that its launches are counted

    cfg = load_config(None, job["argv"])
    run = build_run(cfg)
    trainer = run.trainer
    t0 = time.perf_counter()
    out = count_trainer_step(trainer, job["warmup"])
    out["seconds"] = time.perf_counter() - t0
    out["parameters"] = sum(p.numel() for _, p in trainer.params)
    out["model"] = run.model_cfg.to_dict()
    del trainer, run
    gc.collect()
    torch.manual_seed(0)
    return out


def _rank_main(rank: int, world: int, port: int, jobs: list[dict[str, Any]], env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for j, job in enumerate(jobs):
            results.put((rank, j, _trainer_job(job)))  # as each ends: the parent's deadline is per job
    except BaseException:  # every failure goes to the parent, which reports it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _child_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # Triton binds its kernels to the interpreter when they are defined: set before triton loads.
    env["TRITON_INTERPRET"] = "1"
    env.pop("AGOQ_QUANT_BACKEND", None)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, jobs: list[dict[str, Any]], timeout: float = 3600) -> list[list[dict[str, Any]]]:
    """Each job's count on each of ``world`` gloo ranks (fresh processes): results[rank][job].

    ``timeout`` bounds each job, not the group: the 1b-width rows under Triton's interpreter take
    most of an hour each on two cores, and one deadline for every 1x1 job lost them all.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, jobs, _child_environment(), results)) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, list[Any]] = {r: [] for r in range(world)}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while sum(len(v) for v in done.values()) + len(errors) * len(jobs) < world * len(jobs):
            try:
                rank, status, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                late = sorted(r for r in range(world) if len(done[r]) < len(jobs))
                job = jobs[min(len(done[r]) for r in late)]
                raise RuntimeError(f"ranks {late} did not finish {job['size']}/{job['config']} within {timeout:.0f} s") from None
            if status != "error":
                done[rank].append(value)
                deadline = time.monotonic() + timeout
            else:
                errors.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + 20)  # the others wait in a collective
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a counted step failed\n" + "\n".join(errors))
    return [done[r] for r in range(world)]


def _merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's row: each rank's counts, and per phase the largest rank's (what one GPU pays)."""
    ranks = [{"rank": r["rank"], "pp_rank": r["pp_rank"], "dp_rank": r["dp_rank"], **r["summary"]} for r in per_rank]
    phases = list(dict.fromkeys(p for r in ranks for key in ("device_ops", "host_syncs") for p in r[key]))
    order = [p for p in TRAIN_PHASES if p in phases] + [p for p in phases if p not in TRAIN_PHASES]
    busiest = max(ranks, key=lambda r: r["device_ops_total"])
    sync_sources: collections.Counter = collections.Counter()
    for r in ranks:
        for s in r["sync_sources"]:
            sync_sources[(s["phase"], s["category"], s["op"], s["source"])] += s["count"]
    return {
        "device_ops": {p: max(r["device_ops"].get(p, 0) for r in ranks) for p in order},
        "host_syncs": {p: max(r["host_syncs"].get(p, 0) for r in ranks) for p in order},
        "device_ops_total": max(r["device_ops_total"] for r in ranks),
        "host_syncs_total": max(r["host_syncs_total"] for r in ranks),
        "busiest_rank": busiest["rank"],
        "top_ops": busiest["top_ops"],
        "sync_sources_all_ranks": [
            {"phase": p, "category": c, "op": o, "source": s, "count": n} for (p, c, o, s), n in sorted(sync_sources.items(), key=lambda kv: -kv[1])
        ],
        "ranks": ranks,
    }


def _op_sites(per_rank: list[dict[str, Any]]) -> collections.Counter:
    """(op, site) counts of the rank with the most device operations."""
    busiest = max(per_rank, key=lambda r: r["summary"]["device_ops_total"])
    return _sites(busiest["op_sites"])


def _sites(op_sites: list[list[Any]]) -> collections.Counter:
    """(op, site) counts, the phases summed."""
    out: collections.Counter = collections.Counter()
    for _, op, site, n in op_sites:
        out[(op, site)] += n
    return out


def growth(smaller: collections.Counter, larger: collections.Counter, top: int = 30) -> list[dict[str, Any]]:
    """Device operations by (op, call site) whose count changes from ``smaller`` to ``larger``, largest change first."""
    keys = set(smaller) | set(larger)
    rows = [{"op": op, "source": site, "before": smaller.get((op, site), 0), "after": larger.get((op, site), 0)} for op, site in keys]
    rows = [r for r in rows if r["before"] != r["after"]]
    rows.sort(key=lambda r: (-abs(r["after"] - r["before"]), r["op"], r["source"]))
    return rows[:top]


def _by_op(sites: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for (op, _), n in sites.items():
        out[op] += n
    return out


def trainer_rows(args: argparse.Namespace, run_dir: Path, corpus: Path) -> tuple[list[dict[str, Any]], dict[str, collections.Counter]]:
    """Count every (size, layout, configuration) job asked for; the rows and each job's (op, site) counts."""
    layouts = [_layout(t) for t in args.layouts.split(",") if t]
    sizes = [s for s in args.sizes.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    groups: dict[tuple[int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for size in sizes:
        for pp, dp in layouts if size == "tiny" else [(1, 1)]:
            for config in configs:
                if config.endswith("-triton") and (size not in TRITON_SIZES or (pp, dp) != (1, 1)):
                    continue
                argv = trainer_arguments(size, config, pp, dp, args, run_dir, corpus)
                groups[(pp, dp)].append({"size": size, "config": config, "pp": pp, "dp": dp, "argv": argv, "warmup": args.warmup})
    rows, sites = [], {}
    for (pp, dp), jobs in groups.items():
        t0 = time.perf_counter()
        per_rank = run_ranks(pp * dp, jobs)
        print(f"pp={pp} dp={dp}: {len(jobs)} job(s) counted in {time.perf_counter() - t0:.0f} s", flush=True)
        for j, job in enumerate(jobs):
            ranks = [per_rank[r][j] for r in range(pp * dp)]
            m = ranks[0]["model"]
            row = {
                "size": job["size"],
                "config": job["config"],
                "name": CONFIGS[job["config"]][0],
                "pp": pp,
                "dp": dp,
                "quant_backend": CONFIGS[job["config"]][3],
                "model": {k: m[k] for k in ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "tie_embeddings")},
                "parameters": sum(r["parameters"] for r in ranks if r["dp_rank"] == 0),
                "seconds": max(r["seconds"] for r in ranks),
                **_merge_ranks(ranks),
            }
            rows.append(row)
            sites[f"{job['size']}/{job['config']}/pp{pp}dp{dp}"] = _op_sites(ranks)
    return rows, sites


# ---------------------------------------------------------------------------- compiled code

INDUCTOR_KERNEL = "inductor kernel"
# Dispatch keys under which an operator runs a kernel of its own (not a definition by others).
_KERNEL_KEYS = ("CPU", "CUDA", "CompositeExplicitAutograd")


@functools.lru_cache(maxsize=None)
def _profiled_op(name: str) -> str | None:
    """What a profiler event counts as: an ATen operator with a kernel of its own that touches data
    (what the dispatch mode counts), an inductor kernel, or None."""
    import torch

    if "cpp_fused" in name:
        return INDUCTOR_KERNEL
    if not name.startswith("aten::"):
        return None
    short = name[len("aten::") :]
    op = f"aten.{short}"
    packet = getattr(torch.ops.aten, short, None)
    if op in METADATA_OPS or packet is None:
        return None
    has, keys = torch._C._dispatch_has_kernel_for_dispatch_key, torch._C.DispatchKey
    own = False
    for overload in packet.overloads():
        if "out" in overload:  # an out= variant may have a kernel where the operator itself is composite
            continue
        try:
            func = getattr(packet, overload)
            qualified = func.name()
            if func.is_view:
                return None
            if not has(qualified, keys.CompositeImplicitAutograd):
                own = own or any(has(qualified, getattr(keys, key)) for key in _KERNEL_KEYS)
        except RuntimeError:  # an overload listed but not registered in this build
            continue
    return op if own else None


def profiled_count(step: Callable[[], Any]) -> dict[str, Any]:
    """One call of ``step`` counted from torch.profiler's event tree, where compiled graphs run (a
    dispatch mode sees none of their work, and agoq's compiled CPU path gives way to the reference
    under one). The dispatch mode's rule, from the top of each call: an operator with a kernel of its
    own is one device operation and what it runs inside is its kernel's business; a composite one
    counts its parts; views and metadata count nothing. Each kernel inductor generated is one (its
    graphs compiled with ``torch._inductor.config.cpp.enable_kernel_profile``). Host syncs are the
    HOST_SYNC_OPS operators anywhere in the tree, but a scalar read under ``aten._assert_async``:
    on a GPU that assert runs on the device (agoq.compat.assert_on_device)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        step()
    ops: collections.Counter = collections.Counter()
    syncs: collections.Counter = collections.Counter()
    sync_names = {"aten::" + op.split(".", 1)[1] for op in _SYNC_CATEGORY}

    def source(event: Any) -> str:
        while event is not None:
            name = event.name
            if f"agoq{os.sep}" in name and f"benchmarks{os.sep}" not in name:
                return name[name.rfind(f"agoq{os.sep}") :]
            event = event.cpu_parent
        return "?"

    def visit(event: Any, inside_op: bool, under_assert: bool) -> None:
        under_assert = under_assert or event.name == "aten::_assert_async"
        if event.name in sync_names and not under_assert:
            syncs[(event.name.replace("::", "."), source(event))] += 1
        op = None if inside_op else _profiled_op(event.name)
        if op is not None:
            ops[op] += 1
        for child in event.cpu_children:
            visit(child, inside_op or op is not None, under_assert)

    for event in prof.events():
        if event.cpu_parent is None:
            visit(event, False, False)
    return {
        "device_ops_total": sum(ops.values()),
        "host_syncs_total": sum(syncs.values()),
        "inductor_kernels": ops[INDUCTOR_KERNEL],
        "top_ops": [[name, n] for name, n in ops.most_common(10)],
        "sync_sources": [{"op": op, "source": src, "count": n} for (op, src), n in syncs.most_common()],
    }


# ---------------------------------------------------------------------------- Hugging Face

# (name, AGOQ_QUANT_BACKEND or None for the default, patched)
HF_VARIANTS = {
    "unpatched": ("unpatched", None, False),
    "default": ("apply_agoq, default backend", None, True),
    "torch": ("apply_agoq, AGOQ_QUANT_BACKEND=torch", "torch", True),
    "triton": ("apply_agoq, AGOQ_QUANT_BACKEND=triton (interpreted)", "triton", True),
}


# The variants also counted by profiled_count: the default path's compiled graphs, and its baseline.
PROFILED_VARIANTS = ("unpatched", "default")


def _hf_main(variants: list[str], shape: dict[str, int], env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    try:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True  # before any graph is built: profiled_count sees each kernel
        results.put(("ok", [hf_count(v, shape) for v in variants]))
    except BaseException:  # the parent reports it
        results.put(("error", traceback.format_exc()))


def hf_count(variant: str, shape: dict[str, int]) -> dict[str, Any]:
    """One forward + backward of a LlamaForCausalLM (after one uncounted), counted by phase."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    name, backend_env, patched = HF_VARIANTS[variant]
    if backend_env is None:
        os.environ.pop("AGOQ_QUANT_BACKEND", None)
    else:
        os.environ["AGOQ_QUANT_BACKEND"] = backend_env
    if backend_env == "triton":
        import triton  # noqa: F401 - imported before counting, so that its launches are counted
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=shape["vocab"],
        max_position_embeddings=shape["tokens"],
    )
    model = LlamaForCausalLM(cfg).float()
    if patched:
        from agoq import apply_agoq

        apply_agoq(model)
    ids = torch.randint(0, shape["vocab"], (1, shape["tokens"]), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # lazily built tables and caches
    counter = LaunchCounter(phase="forward")
    t0 = time.perf_counter()
    from agoq.quant import backend

    with counter.counting():
        step()
        counted_backend = backend.resolve("cpu")
    profiled = profiled_count(step) if variant in PROFILED_VARIANTS else None
    return {
        "variant": variant,
        "name": name,
        "backend_env": backend_env,
        # Outside a dispatch mode, and under the count (where compiled CPU code gives way to the torch reference).
        "resolved_backend": backend.resolve("cpu") if patched else None,
        "counted_backend": counted_backend if patched else None,
        "seconds": time.perf_counter() - t0,
        **counter.summary(),
        "op_sites": [[phase, op, site, n] for (phase, op, site), n in counter.op_sites.items()],
        # What runs outside a count, compiled graphs included (the default path on a CPU): profiled_count.
        **({"profiled": profiled} if profiled else {}),
    }


def hf_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each Hugging Face variant asked for, counted in one fresh process."""
    variants = [v for v in args.hf_variants.split(",") if v]
    if not variants:
        return []
    shape = hf_shape(args)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_hf_main, args=(variants, shape, _child_environment(), results))
    t0 = time.perf_counter()
    proc.start()
    try:
        status, value = results.get(timeout=3600)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"the Hugging Face count failed\n{value}")
    print(f"Hugging Face: {len(variants)} variant(s) counted in {time.perf_counter() - t0:.0f} s", flush=True)
    return value


def hf_shape(args: argparse.Namespace) -> dict[str, int]:
    """The Hugging Face model's shape and tokens."""
    return {
        "hidden": args.hf_hidden,
        "intermediate": 4 * args.hf_hidden,
        "layers": args.hf_layers,
        "heads": args.hf_hidden // 64,
        "kv_heads": args.hf_hidden // 256,
        "vocab": args.hf_vocab,
        "tokens": args.hf_tokens,
    }


# ---------------------------------------------------------------------------- claims


def _row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


NO_SYNC_PHASES = ("forward", "backward", "gradient_sync")
MAX_STEP_SYNCS = 2  # the agreement on non-finite gradients and the logged loss
# The two reads a step may make, by the function that makes them: the dp group's agreement on
# non-finite gradients (which decides whether the 8-bit buffer is reset) and the step's agreement
# on norm, non-finite flag and loss.
ALLOWED_SYNCS = ("agree_nonfinite", "_train_step")


def _claim(claim: str, holds: bool, measured: str) -> dict[str, Any]:
    """One budget line of the result: what is claimed, whether the counts meet it, and the figures read."""
    return {"claim": claim, "holds": holds, "measured": measured}


def hf_budget_pair(hf: list[dict[str, Any]], variant: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str]:
    """(the count of ``variant`` the budget reads, the unpatched count it is compared with, what it
    counts): the default path as it runs on a CPU, its compiled graphs profiled, against the
    unpatched model profiled alike; the Triton path by the dispatch-mode count."""
    by_variant = {r["variant"]: r for r in hf}
    row, base = by_variant.get(variant), by_variant.get("unpatched")
    if variant == "default":
        if row is None or base is None or "profiled" not in row or "profiled" not in base:
            return None, None, variant
        return row["profiled"], base["profiled"], "default: compiled CPU formulas, profiled"
    return row, base, variant


def acceptance(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each budget line, whether the counts meet it, and the figures it reads."""
    rows = results["trainer"]
    lines = []
    for agoq, bf16, what in PAIRS:
        half, full = _row(rows, size="1b-half-2l", config=agoq), _row(rows, size="1b-2l", config=agoq)
        if half and full:
            change = full["device_ops_total"] / half["device_ops_total"] - 1
            lines.append(
                _claim(
                    f"agoq's device ops per step change by at most 10% when hidden doubles (fixed layers and vocabulary; {what})",
                    abs(change) <= 0.10,
                    f"{half['device_ops_total']} -> {full['device_ops_total']} ({change:+.1%})",
                )
            )
        for size in ("1b-2l", "1b-4l"):
            a, b = _row(rows, size=size, config=agoq), _row(rows, size=size, config=bf16)
            if a and b:
                ratio = a["device_ops_total"] / b["device_ops_total"]
                lines.append(
                    _claim(
                        f"agoq's device ops per step at most 1.5x the bf16 policy's ({size}; {what})",
                        ratio <= 1.5,
                        f"{a['device_ops_total']} vs {b['device_ops_total']} ({ratio:.2f}x)",
                    )
                )
    for r in rows:
        if r["config"].startswith("agoq") and r["dp"] >= 2:
            in_phases = {p: r["host_syncs"].get(p, 0) for p in NO_SYNC_PHASES}
            unnamed = [s for s in r["sync_sources_all_ranks"] if s["phase"] in NO_SYNC_PHASES and s["source"].rsplit(" ", 1)[-1] not in ALLOWED_SYNCS]
            lines.append(
                _claim(
                    f"agoq train pp={r['pp']} dp={r['dp']} ({r['size']}, {r['config']}): no host sync in forward, backward or "
                    "gradient sync but the dp group's agreement on non-finite gradients",
                    not unnamed and in_phases["forward"] == in_phases["backward"] == 0 and in_phases["gradient_sync"] <= 1,
                    ", ".join(f"{p} {n}" for p, n in in_phases.items()),
                )
            )
            lines.append(
                _claim(
                    f"agoq train pp={r['pp']} dp={r['dp']} ({r['size']}, {r['config']}): at most {MAX_STEP_SYNCS} host syncs per step",
                    r["host_syncs_total"] <= MAX_STEP_SYNCS,
                    f"{r['host_syncs_total']} ({', '.join(f'{p} {n}' for p, n in r['host_syncs'].items() if n)})",
                )
            )
    for variant in ("default", "triton"):
        r, base, what = hf_budget_pair(results["hf"], variant)
        if base and r:
            ratio = r["device_ops_total"] / base["device_ops_total"]
            lines.append(
                _claim(
                    f"patched HF forward + backward ({what}): at most 1.5x the unpatched device ops",
                    ratio <= 1.5,
                    f"{r['device_ops_total']} vs {base['device_ops_total']} ({ratio:.2f}x)",
                )
            )
            lines.append(
                _claim(
                    f"patched HF forward + backward ({what}): no more host syncs than unpatched",
                    r["host_syncs_total"] <= base["host_syncs_total"],
                    f"{r['host_syncs_total']} vs {base['host_syncs_total']}",
                )
            )
    return lines


# ---------------------------------------------------------------------------- the benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """What to count (parts, sizes, layouts, configurations, HF variants), shapes and output folder."""
    parser.add_argument("--parts", default="trainer,hf", help="comma-separated: trainer (agoq train's step), hf (a patched Hugging Face Llama)")
    parser.add_argument(
        "--sizes",
        default="tiny,1b-half-2l,1b-2l,1b-4l",
        help=f"comma-separated trainer sizes: {', '.join(SIZES)} (tiny runs at every --layouts entry, the others at pp = dp = 1)",
    )
    parser.add_argument("--layouts", default="1x1,1x2,2x2", help="comma-separated PPxDP layouts of the tiny size (gloo ranks, one process each)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated: {', '.join(CONFIGS)} (the -triton ones: {', '.join(TRITON_SIZES)} at 1x1 only, interpreted)",
    )
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary of the 1b-width sizes (the BPE trained on the corpus)")
    parser.add_argument("--tiny-vocab", type=int, default=4096, help="vocabulary of the tiny size")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (the counts do not depend on it)")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (one sequence each)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted steps before the counted one")
    parser.add_argument("--hf-variants", default=",".join(HF_VARIANTS), help=f"comma-separated: {', '.join(HF_VARIANTS)}")
    parser.add_argument("--hf-hidden", type=int, default=1024)
    parser.add_argument("--hf-layers", type=int, default=4)
    parser.add_argument("--hf-tokens", type=int, default=512)
    parser.add_argument("--hf-vocab", type=int, default=32768)
    add_out_dir(parser, "the trainer's runs and data cache, in OUT_DIR/run (default: runs/bench_launches)")


def _corpus(run_dir: Path) -> Path:
    """pydoc's topics as a text file (they ship with Python): the corpus every run trains its BPE on."""
    import pydoc_data.topics

    path = run_dir / "pydoc_topics.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(pydoc_data.topics.topics.values()))
    return path


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    """What every row shares: shapes, and what counts as a device operation and as a host sync."""
    return {
        "trainer": (
            f"agoq train's Trainer, one counted step after {args.warmup} uncounted, {args.microbatches} micro-batches of one "
            f"{args.seq}-token sequence per dp rank, fp32 compute, AdamW, a BPE of pydoc's topics; tiny at vocabulary {args.tiny_vocab}, "
            f"the 1b sizes (llama3.2-1b's widths: 32 heads, 8 kv heads, tied embeddings) at vocabulary {args.vocab}, one rank"
        ),
        "hf": "transformers LlamaForCausalLM from a LlamaConfig, fp32, one forward + backward with labels after one uncounted",
        "hf_shape": hf_shape(args),
        "vocab": args.vocab,
        "tiny_vocab": args.tiny_vocab,
        "seq": args.seq,
        "microbatches": args.microbatches,
        "device_op": "an ATen operator that touches data (metadata_ops and other views excluded), a collective, or a Triton launch",
        "metadata_ops": list(METADATA_OPS),
        "host_sync_categories": {
            **{c: list(ops) for c, ops in HOST_SYNC_OPS.items()},
            BOOL_INDEX_CATEGORY: list(BOOL_INDEX_OPS),
            HOST_READ_CATEGORY: [f"Tensor.{m}" for m in HOST_READ_METHODS],
        },
    }


def _growth(sites: dict[str, collections.Counter], hf_sites: dict[str, collections.Counter]) -> dict[str, Any]:
    """Which device operations change in number from one size to the next, by operator (and by call site where hidden doubles)."""
    out: dict[str, Any] = {}
    for config in ("agoq", "bf16", "agoq-triton"):
        half, full, deep = (sites.get(f"{s}/{config}/pp1dp1") for s in ("1b-half-2l", "1b-2l", "1b-4l"))
        if half is not None and full is not None:
            out[f"{config}: hidden doubles (1b-half-2l -> 1b-2l)"] = {
                "by_op": _op_growth(_by_op(half), _by_op(full)),
                "by_source": growth(half, full),
            }
        if full is not None and deep is not None:
            out[f"{config}: two more layers (1b-2l -> 1b-4l)"] = {"by_op": _op_growth(_by_op(full), _by_op(deep))}
    for variant in ("default", "triton"):
        if "unpatched" in hf_sites and variant in hf_sites:
            out[f"hf: unpatched -> {variant}"] = {"by_op": _op_growth(_by_op(hf_sites["unpatched"]), _by_op(hf_sites[variant]))}
    return out


def run(args: argparse.Namespace) -> int:
    """Count every job asked for, write launches.json and print the tables."""
    from benchmarks._common import command_line, write_result

    t0 = time.perf_counter()
    parts = {p for p in args.parts.split(",") if p}
    run_dir = Path(args.out_dir) / "run" if args.out_dir else Path("runs/bench_launches")
    rows, sites = trainer_rows(args, run_dir, _corpus(run_dir)) if "trainer" in parts else ([], {})
    hf = hf_rows(args) if "hf" in parts else []
    hf_sites = {r["variant"]: _sites(r.pop("op_sites")) for r in hf}
    results: dict[str, Any] = {"setup": _setup(args), "trainer": rows, "hf": hf, "growth": _growth(sites, hf_sites)}
    results["acceptance"] = acceptance(results)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    path = write_result("launches", results, command=command_line("launches", getattr(args, "argv", None)), out_dir=args.out_dir)
    print(readme_markdown(results))
    print(f"\n{path} written in {results['seconds']:.0f} s")
    return 0


def _op_growth(before: collections.Counter, after: collections.Counter, top: int = 12) -> list[list[Any]]:
    """[op, before, after] of the operators whose count changes most."""
    keys = set(before) | set(after)
    changed = [[op, before.get(op, 0), after.get(op, 0)] for op in keys if before.get(op, 0) != after.get(op, 0)]
    changed.sort(key=lambda r: (-abs(r[2] - r[1]), r[0]))
    return changed[:top]


# ---------------------------------------------------------------------------- tables


def _cells(r: dict[str, Any], phases: tuple[str, ...]) -> str:
    return " | ".join(f"{r['device_ops'].get(p, 0)} / {r['host_syncs'].get(p, 0)}" for p in phases)


def _trainer_table(rows: list[dict[str, Any]]) -> list[str]:
    phases = tuple(p for p in TRAIN_PHASES if any(p in r["device_ops"] or p in r["host_syncs"] for r in rows))
    lines = [
        "| size | layout | configuration | params | " + " | ".join(p.replace("_", " ") for p in phases) + " | device ops | host syncs |",
        "|---|---|---|---:|" + "---:|" * len(phases) + "---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | pp {r['pp']} x dp {r['dp']} | {r['name']} | {r['parameters'] / 1e6:.1f} M | {_cells(r, phases)} "
            f"| {r['device_ops_total']} | {r['host_syncs_total']} |"
        )
    return lines + ["", "Each phase: device operations / host syncs of one step, on the rank with the most."]


def _hf_table(results: dict[str, Any]) -> list[str]:
    sh = results["setup"]["hf_shape"]
    lines = [
        f"{results['setup']['hf']}: hidden {sh['hidden']}, {sh['layers']} layers, {sh['tokens']} tokens, vocabulary {sh['vocab']}.",
        "",
        "| variant | quantization counted | forward | backward | device ops | Triton launches | host syncs | vs unpatched |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = next((r for r in results["hf"] if r["variant"] == "unpatched"), None)
    for r in results["hf"]:
        ratio = f"{r['device_ops_total'] / base['device_ops_total']:.2f}x" if base else "-"
        counted = r.get("counted_backend") or "-"
        if r.get("resolved_backend") not in (None, counted):
            counted += f" ({r['resolved_backend']} outside a count)"
        lines.append(
            f"| {r['name']} | {counted} | {_cells(r, ('forward', 'backward'))} | {r['device_ops_total']} | {r['triton_launches']} "
            f"| {r['host_syncs_total']} | {ratio} |"
        )
    profiled = [r for r in results["hf"] if "profiled" in r]
    if base and "profiled" in base and len(profiled) > 1:
        lines += ["", "Profiled, compiled graphs included (what runs outside a dispatch mode):", ""]
        lines += ["| variant | device ops | inductor kernels | host syncs | vs unpatched |", "|---|---:|---:|---:|---:|"]
        b = base["profiled"]["device_ops_total"]
        for r in profiled:
            x = r["profiled"]
            lines.append(
                f"| {r['name']} | {x['device_ops_total']} | {x['inductor_kernels']} | {x['host_syncs_total']} | {x['device_ops_total'] / b:.2f}x |"
            )
    return lines


def _sync_table(results: dict[str, Any]) -> list[str]:
    """Where AGoQ's rows wait for the device: per call site, the most in one step of one rank, and in how many rows."""
    most: collections.Counter = collections.Counter()
    seen: collections.Counter = collections.Counter()
    counted = [rank for row in results["trainer"] if not row["config"].startswith("bf16") for rank in row["ranks"]]
    counted += [row for row in results["hf"] if row["variant"] != "unpatched"]
    for r in counted:
        for x in r["sync_sources"]:
            key = (x["phase"], x["op"], x["source"])
            most[key] = max(most[key], x["count"])
            seen[key] += 1
    if not most:
        return []
    lines = ["Host syncs on AGoQ's paths:", "", "| phase | op | asked for at | per step | ranks and variants |", "|---|---|---|---:|---:|"]
    return lines + [f"| {p} | {op} | `{src}` | {n} | {seen[(p, op, src)]} |" for (p, op, src), n in most.most_common(12)]


def _growth_table(results: dict[str, Any]) -> list[str]:
    key = next((k for k in results.get("growth", {}) if k.startswith("agoq: hidden doubles")), None)
    if key is None:
        return []
    lines = [f"Device operations that grow with the parameters (agoq, {key.split(': ', 1)[1]}), by call site:", "", "| op | at | before | after |"]
    lines.append("|---|---|---:|---:|")
    return lines + [f"| {g['op']} | `{g['source']}` | {g['before']} | {g['after']} |" for g in results["growth"][key]["by_source"][:10]]


def readme_markdown(results: dict[str, Any]) -> str:
    """Device operations and host syncs per phase, where the syncs and the growth come from, and the budget lines."""
    blocks = []
    if results["trainer"]:
        blocks.append([f"{results['setup']['trainer']}.", "", *_trainer_table(results["trainer"])])
    if results["hf"]:
        blocks.append(_hf_table(results))
    blocks += [b for b in (_sync_table(results), _growth_table(results)) if b]
    # The budget read from the rows again: a claim's wording or rule may be newer than the counts.
    claims = acceptance(results)
    if claims:
        blocks.append(["| budget | holds | measured |", "|---|---|---|"])
        blocks[-1] += [f"| {a['claim']} | {'yes' if a['holds'] else 'no'} | {a['measured']} |" for a in claims]
    return "\n\n".join("\n".join(b) for b in blocks)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.launches``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launches", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
