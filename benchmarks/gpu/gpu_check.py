"""The single-GPU check of agoq, one phase per call (benchmarks/gpu/run.sh runs each in a process of its own).

- nccl: a 1-rank NCCL group through every collective agoq calls, by the names it calls them
  (agoq.compat), and agoq's 8-bit all-reduce, reduce-scatter and bucket pipeline: nccl.json;
- kernels: each kernel's GB/s against a same-bytes device copy (benchmarks/kernels.py): kernels.json, .png;
- layer: one llama3-8b decoder layer, forward + backward, bf16 against agoq on the torch and
  Triton paths: median times, activation bytes kept, peak memory above the inputs: layer.json;
- train: a llama3.2-1b-sized model stepped as ``agoq train`` steps it (the loss summed on the device
  and read once a step with the gradient norm, the optimizer in groups of bounded bytes) in five
  modes: bf16, bf16 with every layer checkpointed, agoq activations only, agoq gradients only, and
  full agoq. Per mode: losses, per-phase times from CUDA events, max_memory_allocated and
  _reserved, the largest micro-batch that fits, and for full agoq one profiled step (top
  operators, kernel count): train.json, rewritten after each mode.

``--dry-run`` shrinks every size so that each phase runs in a minute on CPU (Triton under
TRITON_INTERPRET=1, gloo for NCCL); it exercises every phase's code, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# agoq from this checkout's src/, and the benchmarks package at its root (run.sh also sets PYTHONPATH).
for folder in (ROOT, ROOT / "src"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from agoq.quant import backend  # noqa: E402
from benchmarks._common import write_result  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _sub(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


# ---- one decoder layer ------------------------------------------------------------------------------------

LAYER_MODES = (("bf16", "bf16", "torch"), ("agoq-torch", "agoq", "torch"), ("agoq-triton", "agoq", "triton"))


def layer_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Forward+backward of one decoder layer per mode and sequence length: times and memory."""
    from agoq.activation import make_policy
    from agoq.models.config import get_config
    from agoq.models.llama import DecoderLayer, rope_tables

    overrides = dict(hidden=256, n_heads=4, n_kv_heads=2, intermediate=512) if args.dry_run else {}
    cfg = get_config("llama3-8b", **overrides)
    seqs = [128] if args.dry_run else [int(s) for s in args.layer_seqs.split(",")]
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    weights = _allocated(device)
    rows = []
    for seq in seqs:
        cos, sin = rope_tables(cfg, seq, device)
        x = torch.randn(args.layer_batch, seq, cfg.hidden, device=device, dtype=torch.bfloat16)
        gy = torch.randn_like(x)
        for mode, policy_name, backend_name in LAYER_MODES:
            policy = make_policy(policy_name)

            def step() -> tuple[float, float, int | None, int | None]:
                xi = x.detach().requires_grad_(True)
                for p in layer.parameters():
                    p.grad = None
                _sync(device)
                base = _allocated(device)
                _reset_peak(device)
                t0 = time.perf_counter()
                y = layer(xi, cos, sin, policy)
                _sync(device)
                t1 = time.perf_counter()
                kept = _sub(_allocated(device), base)
                kept = None if kept is None else kept - y.numel() * y.element_size()
                y.backward(gy)
                _sync(device)
                t2 = time.perf_counter()
                return t1 - t0, t2 - t1, kept, _sub(_peak(device), base)

            with backend.use_backend(backend_name):
                for _ in range(args.warmup):
                    step()
                runs = [step() for _ in range(args.layer_repeats)]
            fwd = statistics.median(r[0] for r in runs)
            bwd = statistics.median(r[1] for r in runs)
            rows.append(
                {
                    "seq": seq,
                    "batch": args.layer_batch,
                    "mode": mode,
                    "forward_ms": 1e3 * fwd,
                    "backward_ms": 1e3 * bwd,
                    "total_ms": 1e3 * (fwd + bwd),
                    "activation_bytes_kept": runs[-1][2],
                    "peak_bytes_above_inputs": runs[-1][3],
                }
            )
    for r in rows:
        base = next(b for b in rows if b["seq"] == r["seq"] and b["mode"] == "bf16")
        r["time_vs_bf16"] = r["total_ms"] / base["total_ms"]
        r["forward_vs_bf16"] = r["forward_ms"] / base["forward_ms"]
        r["backward_vs_bf16"] = r["backward_ms"] / base["backward_ms"]
        if r["activation_bytes_kept"] and base["activation_bytes_kept"]:
            r["activation_ratio_bf16_over_mode"] = base["activation_bytes_kept"] / r["activation_bytes_kept"]
    return {"model": "llama3-8b" + (" (dry run: shrunk)" if args.dry_run else ""), "config": cfg.to_dict(), "weights_bytes": weights, "rows": rows}


# ---- a short training run ---------------------------------------------------------------------------------


def _text_tokens() -> torch.Tensor:
    """Bytes of the standard library's pydoc topics (about 465 K characters) as token ids."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


# name: (activation policy, gradient path, every layer under activation checkpointing)
TRAIN_MODES = {
    "bf16": ("bf16", "fp32", False),
    "bf16+ac": ("bf16", "fp32", True),
    "agoq-activations": ("agoq", "fp32", False),
    "agoq-gradients": ("bf16", "int8", False),
    "agoq": ("agoq", "int8", False),
}
STEP_PHASES = ("forward_backward", "gradient_sync", "optimizer")


class _PhaseClock:
    """Marks between a step's phases: CUDA events on the device (the device's time, read once the
    step is done), the host clock on a CPU dry run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks (waits for the last one)."""
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class _TrainStep:
    """One mode's model, gradient path and optimizer, stepped as ``agoq train`` steps them: the loss
    summed on the device, one host read per step (the non-finite flag, the norm and the loss), the
    optimizer in groups of bounded gradient bytes."""

    def __init__(self, template: torch.nn.Module, mode: str, micro: int, args: argparse.Namespace, device: torch.device) -> None:
        import copy

        from agoq.activation import make_policy
        from agoq.gradient.sync import PlainGradientSync, QuantizedGradientSync
        from agoq.launch.config import OptimSection
        from agoq.train.optim import MasterWeightOptimizer

        acts, grads, recompute = TRAIN_MODES[mode]
        self.model = copy.deepcopy(template)
        self.model.set_policy(make_policy(acts))
        if recompute:
            self.model.recompute = set(range(len(self.model.layers)))
        named = list(self.model.named_parameters())
        self.layer_values = max(sum(p.numel() for p in layer.parameters()) for layer in self.model.layers.values())
        self.opt = MasterWeightOptimizer(named, OptimSection(lr=args.lr, min_lr=args.lr, warmup_steps=0, weight_decay=0.0))
        # The trainer's gradient paths: Megatron-style fp32 main grads, or QuanGrad's 8-bit buffer.
        int8 = grads == "int8"
        self.sync = QuantizedGradientSync(named, None, micro, 256) if int8 else PlainGradientSync(named, None, device, torch.float32)
        self.device, self.micro, self.clip = device, micro, args.clip

    def run(self, batches: list[torch.Tensor], clock: _PhaseClock | None = None) -> float:
        from agoq.train.optim import step_group_bytes

        mark = clock.mark if clock is not None else (lambda: None)
        mark()
        self.sync.start_step()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in batches:
            loss = self.model(batch[:, :-1], batch[:, 1:])
            (loss / self.micro).backward()
            total += loss.detach().to(torch.float64) / self.micro
        mark()
        flag = torch.stack([self.sync.reduce(), self.sync.local_grad_sq_norm(), total])
        mark()
        nonfinite, sq, loss_value = flag.tolist()  # the step's one host read
        if nonfinite or not math.isfinite(sq):
            raise SystemExit("non-finite gradient")
        norm = math.sqrt(sq)
        coef = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
        self.sync.step_optimizer(self.opt, coef, step_group_bytes(self.device, self.layer_values))
        self.sync.finish_step()
        mark()
        return loss_value


def _largest_microbatch(template: torch.nn.Module, mode: str, tokens: torch.Tensor, args: argparse.Namespace, device: torch.device) -> int | None:
    """The largest sequences per micro-batch (doubling from 1, up to --max-microbatch) with which one
    step of ``mode`` fits in the GPU's memory (a dry run tries 1 and 2: nothing runs out there)."""
    fits, b = 0, 1
    while b <= args.max_microbatch:
        step = None
        try:
            step = _TrainStep(template, mode, 1, args, device)
            step.run([_windows(tokens, b, args.train_seq, seed=b).to(device)])
            fits = b
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            del step
            torch.cuda.empty_cache()
        b *= 2
    return fits


def _windows(tokens: torch.Tensor, rows: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq - 1, (rows,), generator=gen)
    return tokens[starts[:, None] + torch.arange(seq + 1)]


def _profile_step(step: _TrainStep, batches: list[torch.Tensor], device: torch.device, top: int = 15) -> dict[str, Any]:
    """One profiled step: its top operators by device time (host time on a CPU) and its kernel count."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step.run(batches)
        _sync(device)
    events = prof.key_averages()
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    rows = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
    kernels = sum(1 for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return {
        "sorted_by": key,
        "kernels": kernels if device.type == "cuda" else None,
        "top": [{"op": e.key, "calls": e.count, "ms": getattr(e, key, 0.0) / 1e3} for e in rows],
    }


def train_check(args: argparse.Namespace, device: torch.device, out: Path | None = None, command: str = "") -> dict[str, Any]:
    """A few dozen AdamW steps of a llama3.2-1b-sized model in each mode, on the trainer's step."""
    from agoq.models.config import get_config
    from agoq.models.llama import Llama

    overrides: dict[str, Any] = dict(max_seq_len=args.train_seq)
    if args.dry_run:
        overrides.update(vocab_size=512, hidden=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=256)
    cfg = get_config("llama3.2-1b", **overrides)
    steps = 3 if args.dry_run else args.train_steps
    micro, mb, seq = args.train_microbatches, args.train_batch, args.train_seq
    tokens = _text_tokens()
    template = Llama(cfg).to(device=device, dtype=torch.bfloat16)
    # The Triton path wherever it can run (on CPU only a dry run under the interpreter).
    quant_backend = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    res: dict[str, Any] = {
        "model": "llama3.2-1b" + (" (dry run: shrunk)" if args.dry_run else ""),
        "config": cfg.to_dict(),
        "parameters": cfg.num_parameters(),
        "tokens_per_step": micro * mb * seq,
        "data": "UTF-8 bytes of pydoc_data.topics as token ids, random windows, same order in every mode",
        "optimizer": f"AdamW on fp32 masters in groups of bounded bytes (the trainer's), lr {args.lr}, global-norm clip {args.clip}",
        "modes": {m: {"activations": a, "gradients": g, "activation_checkpointing": r} for m, (a, g, r) in TRAIN_MODES.items()},
        "quant_backend": quant_backend,
        "unigram_entropy_nats": _entropy(tokens),
        "rows": [],
    }
    modes = [m for m in args.train_modes.split(",") if m]
    for mode in modes:
        with backend.use_backend(quant_backend if "agoq" in mode else "torch"):
            res["rows"].append(_train_mode(template, mode, tokens, args, device, steps))
        _finish_rows(res["rows"])
        if out is not None:  # written after every mode: a fault in a later one keeps these
            write_result("train", res, command=command, out_dir=out)
    return res


def _train_mode(
    template: torch.nn.Module, mode: str, tokens: torch.Tensor, args: argparse.Namespace, device: torch.device, steps: int
) -> dict[str, Any]:
    micro, mb, seq = args.train_microbatches, args.train_batch, args.train_seq
    step = _TrainStep(template, mode, micro, args, device)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _reset_peak(device)
    losses, phases = [], []
    for i in range(steps):
        clock = _PhaseClock(device)
        losses.append(step.run([_windows(tokens, mb, seq, seed=i * micro + m).to(device) for m in range(micro)], clock))
        phases.append(clock.seconds())
    row: dict[str, Any] = {"mode": mode, "steps": steps, "losses": losses, "final_loss_mean_last5": statistics.mean(losses[-5:])}
    timed = phases[args.warmup :] or phases
    row["phase_s_median"] = {p: statistics.median(t[k] for t in timed) for k, p in enumerate(STEP_PHASES)}
    row["step_s_median"] = statistics.median(sum(t) for t in timed)
    row["tokens_per_s"] = micro * mb * seq / row["step_s_median"]
    if device.type == "cuda":
        row["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        row["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    row["grad_buffer_bytes"] = step.sync.buffer_bytes()
    if mode == "agoq":
        row["profile"] = _profile_step(step, [_windows(tokens, mb, seq, seed=10**6 + m).to(device) for m in range(micro)], device)
    del step
    row["largest_microbatch"] = _largest_microbatch(template, mode, tokens, args, device)
    return row


def _finish_rows(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["mode"] == "bf16"), None)
    if base is None:
        return
    for r in rows:
        r["tokens_per_s_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        if "max_memory_allocated" in r:
            r["max_memory_allocated_vs_bf16"] = r["max_memory_allocated"] / base["max_memory_allocated"]
        r["final_loss_minus_bf16"] = r["final_loss_mean_last5"] - base["final_loss_mean_last5"]


# ---- NCCL: every collective agoq uses, on one rank ----------------------------------------------------------


def nccl_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A 1-rank process group (NCCL on a GPU, gloo on a dry run) through every collective agoq
    calls, by the names agoq calls them (agoq.compat), each checked against its expected value."""
    import tempfile

    import torch.distributed as dist

    from agoq import compat
    from agoq.gradient import QuantGradBuffer, all_reduce_8bit, reduce_scatter_8bit

    name = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.NamedTemporaryFile(delete=False) as f:
        init = f"file://{f.name}"
    dist.init_process_group(name, init_method=init, rank=0, world_size=1)
    x = torch.arange(4096, dtype=torch.float32, device=device) / 4096
    checks: dict[str, Any] = {}

    def check(what: str, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            ok = bool(fn())
            checks[what] = {"ok": ok, "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001  (every collective is reported, whatever fails)
            checks[what] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}

    def same(fn: Any) -> Any:
        def run() -> bool:
            out = torch.empty_like(x)
            fn(out, x.clone())
            _sync(device)
            return torch.equal(out, x)

        return run

    check("all_reduce", lambda: (lambda t: (dist.all_reduce(t), torch.equal(t, x))[1])(x.clone()))
    check("broadcast", lambda: (lambda t: (dist.broadcast(t, 0), torch.equal(t, x))[1])(x.clone()))
    check("all_to_all_single", same(lambda o, i: dist.all_to_all_single(o, i)))
    check("all_gather_single (agoq.compat)", same(lambda o, i: compat.all_gather_single(o, i)))
    check("reduce_scatter_single (agoq.compat)", same(lambda o, i: compat.reduce_scatter_single(o, i)))
    check("all_gather_into_tensor", same(lambda o, i: dist.all_gather_into_tensor(o, i)))
    check("async all_to_all_single + wait", same(lambda o, i: dist.all_to_all_single(o, i, async_op=True).wait()))
    # agoq's own: one rank's 8-bit all-reduce and reduce-scatter are a quantize round trip.
    bound = float(x.abs().max()) / 127
    check("all_reduce_8bit", lambda: (lambda t: (all_reduce_8bit(t, "sum"), float((t - x).abs().max()) <= bound)[1])(x.clone()))
    check("reduce_scatter_8bit", lambda: float((reduce_scatter_8bit(x.clone(), "sum")[: x.numel()] - x).abs().max()) <= bound)

    def buffer() -> bool:
        model = torch.nn.Linear(64, 64, device=device)
        buf = QuantGradBuffer(model, microbatches=1)
        model(torch.randn(8, 64, device=device)).square().sum().backward()
        return buf.finish()

    check("QuantGradBuffer.finish (bucket collectives, side stream)", buffer)
    dist.destroy_process_group()
    return {"backend": name, "world_size": 1, "torch": torch.__version__, "checks": checks, "all_ok": all(c["ok"] for c in checks.values())}


def _entropy(tokens: torch.Tensor) -> float:
    p = torch.bincount(tokens).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# ---- driver -----------------------------------------------------------------------------------------------


def _markdown_layer(res: dict[str, Any]) -> str:
    lines = [
        f"One {res['model']} decoder layer, forward + backward (median)",
        "",
        "| seq | mode | fwd ms | bwd ms | total ms | x bf16 | kept act. MiB | bf16 / mode | peak MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
        ratio = r.get("activation_ratio_bf16_over_mode")
        lines.append(
            f"| {r['seq']} | {r['mode']} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['total_ms']:.2f} | {r['time_vs_bf16']:.3f} "
            f"| {mib(r['activation_bytes_kept'])} | {'-' if ratio is None else f'{ratio:.2f}'} | {mib(r['peak_bytes_above_inputs'])} |"
        )
    return "\n".join(lines)


def _markdown_train(res: dict[str, Any]) -> str:
    lines = [
        f"{res['model']} ({res['parameters'] / 1e9:.2f} B parameters), {res['tokens_per_step']} tokens/step",
        "",
        "| mode | final loss (last 5) | tokens/s | x bf16 | fwd+bwd ms | sync ms | optimizer ms | max allocated GiB | x bf16 | reserved GiB | largest micro-batch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def gib(v: int | None) -> str:
        return "-" if v is None else f"{v / 2**30:.2f}"

    for r in res["rows"]:
        ph = r["phase_s_median"]
        ratio = r.get("max_memory_allocated_vs_bf16")
        lines.append(
            f"| {r['mode']} | {r['final_loss_mean_last5']:.4f} | {r['tokens_per_s']:.0f} | {r.get('tokens_per_s_vs_bf16', float('nan')):.3f} | "
            + " | ".join(f"{1e3 * ph[p]:.1f}" for p in STEP_PHASES)
            + f" | {gib(r.get('max_memory_allocated'))} | {'-' if ratio is None else f'{ratio:.3f}'} | {gib(r.get('max_memory_reserved'))} "
            + f"| {r['largest_microbatch'] if r['largest_microbatch'] is not None else '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the phases asked for and write their JSON into --out-dir."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    p.add_argument(
        "--phases", default="nccl,kernels,layer,train", help="comma-separated: nccl, kernels, layer, train (run.sh runs each in a process of its own)"
    )
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on whatever device there is (numbers meaningless)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kernel-numel", type=int, default=64 * 2**20)
    p.add_argument("--kernel-tiles", default="", help="Triton tiles to compare in the kernel phase, e.g. 1024,2048,4096")
    p.add_argument("--layer-seqs", default="4096,8192")
    p.add_argument("--layer-batch", type=int, default=1)
    p.add_argument("--layer-repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--train-modes", default=",".join(TRAIN_MODES), help=f"comma-separated, from: {', '.join(TRAIN_MODES)}")
    p.add_argument("--max-microbatch", type=int, default=64, help="the largest micro-batch tried when searching what fits")
    p.add_argument("--train-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--train-microbatches", type=int, default=2)
    p.add_argument("--train-seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        raise SystemExit("no GPU here: run with --dry-run to check the script on CPU")
    if args.dry_run:
        args.train_seq, args.train_batch, args.warmup, args.layer_repeats, args.max_microbatch = 64, 2, 1, 1, 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    for phase in phases:
        t0 = time.perf_counter()
        if phase == "kernels":
            from benchmarks import kernels

            kargs = argparse.Namespace(
                device=str(device),
                numel=args.kernel_numel,
                hidden=4096,
                world=8,
                formats=kernels.DEFAULT_FORMATS,
                backends="torch,triton",
                tiles=args.kernel_tiles,
                repeats=5,
                inner=10,
                dry_run=args.dry_run,
                out_dir=str(out),
            )
            kernels.run(kargs)
        elif phase == "layer":
            res = layer_check(args, device)
            write_result("layer", res, command=command, out_dir=out)
            print(_markdown_layer(res))
        elif phase == "nccl":
            res = nccl_check(args, device)
            write_result("nccl", res, command=command, out_dir=out)
            print(json.dumps(res["checks"], indent=1))
            if not res["all_ok"]:
                raise SystemExit("a collective failed its check (nccl.json names it)")
        elif phase == "train":
            res = train_check(args, device, out, command)
            print(_markdown_train(res))
            if any(not math.isfinite(r["final_loss_mean_last5"]) for r in res["rows"]):
                raise SystemExit("training produced a non-finite loss")
        else:
            raise SystemExit(f"--phases: unknown phase {phase!r}; use nccl, kernels, layer, train")
        print(f"[{phase}: {time.perf_counter() - t0:.1f} s]\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
