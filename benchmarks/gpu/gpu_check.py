"""The single-GPU check of agoq: kernel bandwidth, one llama3-8b decoder layer, a llama3.2-1b training run.

Writes kernels.json (+ .png), layer.json and train.json into --out-dir. Every phase compares the
modes side by side in one run:

- layer: one decoder layer with llama3-8b dimensions, forward + backward, for the bf16 baseline,
  agoq on the torch path and agoq on the Triton path: median times, the activation bytes kept
  between forward and backward, and the peak of torch.cuda.max_memory_allocated above the weights;
- train: a llama3.2-1b-sized model (agoq.models preset) for a few dozen AdamW steps on bytes of
  the standard library's pydoc topics text, bf16 baseline vs full agoq (4-bit activations, 8-bit
  gradient buffer, Triton backend): loss per step, tokens/s after warm-up, peak memory.

``--dry-run`` shrinks every size so the whole script runs in a minute on CPU (Triton under
TRITON_INTERPRET=1); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# agoq from this checkout's src/, and the benchmarks package at its root (run_h200.sh also sets PYTHONPATH).
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


def train_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A few dozen AdamW steps of a llama3.2-1b-sized model, bf16 baseline vs full agoq."""
    import copy

    from agoq.activation import make_policy
    from agoq.models.config import get_config
    from agoq.models.llama import Llama
    from agoq.train.config import OptimSection
    from agoq.gradient.sync import PlainGradientSync, QuantizedGradientSync
    from agoq.train.optim import MasterWeightOptimizer
    from agoq.train.saved import SavedActivationTracker

    overrides: dict[str, Any] = dict(max_seq_len=args.train_seq)
    if args.dry_run:
        overrides.update(vocab_size=512, hidden=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=256)
    cfg = get_config("llama3.2-1b", **overrides)
    steps = 3 if args.dry_run else args.train_steps
    micro, mb, seq = args.train_microbatches, args.train_batch, args.train_seq
    tokens = _text_tokens()
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, tokens.numel() - seq - 1, (steps, micro, mb), generator=gen)
    template = Llama(cfg).to(device=device, dtype=torch.bfloat16)
    optim_cfg = OptimSection(lr=args.lr, min_lr=args.lr, warmup_steps=0, weight_decay=0.0)
    # The Triton path wherever it can run (on CPU only a dry run under the interpreter).
    agoq_backend = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    results = []
    for mode in ("bf16", "agoq"):
        model = copy.deepcopy(template)
        model.set_policy(make_policy(mode))
        named = list(model.named_parameters())
        opt = MasterWeightOptimizer(named, optim_cfg)
        # The trainer's gradient paths: Megatron-style fp32 main grads, or QuanGrad's 8-bit buffer.
        sync = QuantizedGradientSync(named, None, micro, 256) if mode == "agoq" else PlainGradientSync(named, None, device, torch.float32)
        losses, times = [], []
        _sync(device)
        _reset_peak(device)
        counted: dict[str, int | None] = {}
        with backend.use_backend(agoq_backend if mode == "agoq" else "torch"):
            for step in range(steps):
                # The second step is counted tensor by tensor, as the trainer does on every device
                # (agoq.train.saved), beside CUDA's own peak over the same step: the check that the
                # CPU-measured temporaries and totals mean what a GPU allocator reports.
                probe = step == 1
                if probe:
                    _sync(device)
                    before, earlier_peak = _allocated(device), _peak(device)
                    _reset_peak(device)
                    allocations = SavedActivationTracker().temporaries()
                    allocations.__enter__()
                t0 = time.perf_counter()
                sync.start_step()
                loss_sum = 0.0
                for m in range(micro):
                    idx = starts[step, m][:, None] + torch.arange(seq + 1)
                    batch = tokens[idx].to(device)
                    loss = model(batch[:, :-1], batch[:, 1:]) / micro
                    loss.backward()
                    loss_sum += float(loss.detach())
                nonfinite, sq = torch.stack([sync.reduce(), sync.local_grad_sq_norm()]).tolist()  # one host read
                if nonfinite:
                    raise SystemExit(f"{mode}: non-finite gradient at step {step}")
                norm = math.sqrt(sq)
                clip = min(1.0, args.clip / (norm + 1e-6)) if args.clip > 0 else 1.0
                for i, g in sync.gradients():
                    opt.set_grad(i, g * clip)
                opt.step()
                sync.finish_step()
                _sync(device)
                times.append(time.perf_counter() - t0)
                losses.append(loss_sum)
                if probe:
                    allocations.__exit__(None, None, None)
                    step_peak = _peak(device)
                    counted = {"counted_step_peak_bytes": allocations.peak_bytes, "cuda_step_peak_bytes": _sub(step_peak, before)}
        timed = times[args.warmup :] or times
        results.append(
            {
                "mode": mode,
                "quant_backend": agoq_backend if mode == "agoq" else None,
                "steps": steps,
                "losses": losses,
                "final_loss_mean_last5": statistics.mean(losses[-5:]),
                "step_s_median": statistics.median(timed),
                "tokens_per_s": micro * mb * seq / statistics.median(timed),
                "peak_bytes": None if device.type != "cuda" else max(_peak(device), earlier_peak if steps > 1 else 0),
                "grad_buffer_bytes": sync.buffer_bytes(),
                **counted,
            }
        )
        del model, named, opt, sync
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results[0]
    for r in results:
        r["tokens_per_s_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["peak_vs_bf16"] = None if r["peak_bytes"] is None else r["peak_bytes"] / base["peak_bytes"]
        r["final_loss_minus_bf16"] = r["final_loss_mean_last5"] - base["final_loss_mean_last5"]
    return {
        "model": "llama3.2-1b" + (" (dry run: shrunk)" if args.dry_run else ""),
        "config": cfg.to_dict(),
        "parameters": cfg.num_parameters(),
        "tokens_per_step": micro * mb * seq,
        "data": "UTF-8 bytes of pydoc_data.topics as token ids, random windows, same order in both modes",
        "optimizer": f"AdamW on fp32 masters, lr {args.lr}, global-norm clip {args.clip}",
        "gradients": "bf16: fp32 main-grad buffer; agoq: int8/256 block-wise buffer (QuanGrad), micro-batch folds",
        "unigram_entropy_nats": _entropy(tokens),
        "rows": results,
    }


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
        "| mode | steps | final loss (last 5) | tokens/s | x bf16 | peak GiB | x bf16 | step peak GiB, counted | step peak GiB, CUDA |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def gib(v: int | None) -> str:
        return "-" if v is None else f"{v / 2**30:.3f}"

    for r in res["rows"]:
        pv = "-" if r["peak_vs_bf16"] is None else f"{r['peak_vs_bf16']:.3f}"
        lines.append(
            f"| {r['mode']} | {r['steps']} | {r['final_loss_mean_last5']:.4f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_vs_bf16']:.3f} | "
            f"{gib(r['peak_bytes'])} | {pv} | {gib(r.get('counted_step_peak_bytes'))} | {gib(r.get('cuda_step_peak_bytes'))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the phases asked for and write their JSON into --out-dir."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    p.add_argument("--phases", default="kernels,layer,train", help="comma-separated: kernels, layer, train")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on whatever device there is (numbers meaningless)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kernel-numel", type=int, default=64 * 2**20)
    p.add_argument("--kernel-tiles", default="", help="Triton tiles to compare in the kernel phase, e.g. 1024,2048,4096")
    p.add_argument("--layer-seqs", default="4096,8192")
    p.add_argument("--layer-batch", type=int, default=1)
    p.add_argument("--layer-repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=30)
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
        args.train_seq, args.train_batch, args.warmup, args.layer_repeats = 64, 2, 1, 1
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
        elif phase == "train":
            res = train_check(args, device)
            write_result("train", res, command=command, out_dir=out)
            print(_markdown_train(res))
            if any(not math.isfinite(r["final_loss_mean_last5"]) for r in res["rows"]):
                raise SystemExit("training produced a non-finite loss")
        else:
            raise SystemExit(f"--phases: unknown phase {phase!r}; use kernels, layer, train")
        print(f"[{phase}: {time.perf_counter() - t0:.1f} s]\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
