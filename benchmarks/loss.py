"""Step time and saved bytes of the LM head + cross-entropy: plain path vs chunked fused loss."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Iterable

from benchmarks._common import add_out_dir

DESCRIPTION = "LM head + cross-entropy: step time and bytes kept for backward, plain vs fused (chunked, no logits kept)"

_DTYPES = ("bf16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.loss``."""
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch x seq)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--vocabs", default="4096,32000,128256", help="comma-separated vocab sizes")
    parser.add_argument("--dtype", choices=_DTYPES, default="bf16", help="dtype of hidden states and head weight")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (fastest reported), after one warm-up round")
    parser.add_argument("--chunk-sweep", action="store_true", help="also time the fused loss over a range of chunk sizes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a markdown table")
    add_out_dir(parser)


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[Any] = ()) -> tuple[int, Any]:
    """Bytes of the tensors autograd saves while fn runs (by storage, once each, minus exclude's storages), and fn's result."""
    import torch

    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def run(args: argparse.Namespace) -> int:
    """Measure both paths for each vocab size, print a table, write loss.json (into --out-dir or benchmarks/results)."""
    import torch

    from agoq.activation.loss import (
        chunked_lm_head_cross_entropy,
        default_chunk_size,
        loss_saved_bytes,
        plain_lm_head_cross_entropy,
    )
    from benchmarks._common import write_result

    try:
        vocabs = [int(v) for v in args.vocabs.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--vocabs must be comma-separated integers, got {args.vocabs!r}")
    if args.tokens < 1 or args.hidden < 1 or args.repeats < 1 or not vocabs or min(vocabs) < 1:
        raise SystemExit("--tokens, --hidden, --repeats and every vocab must be positive")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    n, hdim = args.tokens, args.hidden

    paths = {
        "plain": lambda h, w, t, c: plain_lm_head_cross_entropy(h, w, t),
        "fused": lambda h, w, t, c: chunked_lm_head_cross_entropy(h, w, t, chunk_size=c),
        "fused_recompute": lambda h, w, t, c: chunked_lm_head_cross_entropy(h, w, t, chunk_size=c, recompute=True),
    }
    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    for vocab in vocabs:
        gen = torch.Generator().manual_seed(vocab)
        hidden = torch.randn(n, hdim, generator=gen).to(dtype).requires_grad_()
        weight = (torch.randn(vocab, hdim, generator=gen) * hdim**-0.5).to(dtype).requires_grad_()
        targets = torch.randint(0, vocab, (n,), generator=gen)
        chunk = default_chunk_size(vocab, hdim)
        row: dict[str, Any] = {"vocab": vocab, "tokens": n, "hidden": hdim, "dtype": args.dtype, "chunk_size": min(chunk, n)}
        for name, fn in paths.items():
            measured, loss = saved_bytes(lambda: fn(hidden, weight, targets, chunk), exclude=[weight])
            loss.backward()
            hidden.grad = weight.grad = None
            del loss
            fused, recompute = name != "plain", name == "fused_recompute"
            row[f"{name}_saved_bytes"] = measured
            row[f"{name}_saved_bytes_model"] = loss_saved_bytes(n, hdim, vocab, dtype, fused, recompute=recompute)
        steps = {name: (lambda fn=fn: fn(hidden, weight, targets, chunk)) for name, fn in paths.items()}
        seconds, losses = _time_steps(steps, hidden, weight, args.repeats)
        for name in paths:
            row[f"{name}_step_s"], row[f"{name}_step_cpu_s"] = seconds[name]
        row["fused_loss_rel_diff"] = abs(losses["fused"] - losses["plain"]) / abs(losses["plain"])
        row["saved_ratio"] = row["plain_saved_bytes"] / row["fused_saved_bytes"]
        row["saved_ratio_recompute"] = row["plain_saved_bytes"] / row["fused_recompute_saved_bytes"]
        row["time_ratio"] = row["fused_step_s"] / row["plain_step_s"]
        row["time_ratio_recompute"] = row["fused_recompute_step_s"] / row["plain_step_s"]
        row["cpu_ratio"] = row["fused_step_cpu_s"] / row["plain_step_cpu_s"]
        row["cpu_ratio_recompute"] = row["fused_recompute_step_cpu_s"] / row["plain_step_cpu_s"]
        rows.append(row)
        if args.chunk_sweep:
            chunks: dict[int, int] = {}  # effective chunk -> the smallest budget (MiB) giving it
            for mib in (64, 128, 256, 512, 1024):
                chunks.setdefault(min(n, default_chunk_size(vocab, hdim, logits_bytes=mib * 2**20, rows_per_hidden=None)), mib)
            sweep_steps: dict[Any, Callable[[], Any]] = {c: (lambda c=c: paths["fused"](hidden, weight, targets, c)) for c in chunks}
            sweep_steps["plain"] = steps["plain"]
            swept, _ = _time_steps(sweep_steps, hidden, weight, args.repeats)
            for c, mib in chunks.items():
                sweep.append(
                    {
                        "vocab": vocab,
                        "chunk_logits_mib": mib,
                        "chunk_size": c,
                        "fused_step_s": swept[c][0],
                        "plain_step_s": swept["plain"][0],
                        "time_ratio": swept[c][0] / swept["plain"][0],
                        "fused_step_cpu_s": swept[c][1],
                        "plain_step_cpu_s": swept["plain"][1],
                        "cpu_ratio": swept[c][1] / swept["plain"][1],
                    }
                )
        hidden = weight = targets = None  # free this vocabulary's tensors before the next one's

    results = {"rows": rows, "chunk_sweep": sweep}
    write_result("loss", results, out_dir=args.out_dir)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(_table(rows))
        if sweep:
            print()
            print(_sweep_table(sweep))
    mismatched = [r["vocab"] for r in rows for p in paths if r[f"{p}_saved_bytes"] != r[f"{p}_saved_bytes_model"]]
    if mismatched:
        print(f"saved bytes differ from loss_saved_bytes for vocab {sorted(set(mismatched))}")
        return 1
    return 0


def _time_steps(steps: dict[Any, Callable[[], Any]], hidden: Any, weight: Any, repeats: int) -> tuple[dict, dict]:
    """Fastest wall and CPU seconds of forward + backward of each step over ``repeats`` rounds, and its loss.

    The steps run in turns, after one warm-up round, so that load from other processes on a
    shared machine falls on all of them alike; the minimum is the run least disturbed by it. CPU
    seconds (this process, all threads) do not count time spent waiting for a core.
    """
    wall: dict[Any, list[float]] = {k: [] for k in steps}
    cpu: dict[Any, list[float]] = {k: [] for k in steps}
    losses: dict[Any, float] = {}
    for i in range(repeats + 1):
        for key, step in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = step()
            loss.backward()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            losses[key] = loss.item()
            hidden.grad = weight.grad = None
            del loss
            if i:
                wall[key].append(elapsed)
                cpu[key].append(elapsed_cpu)
    return {k: (min(wall[k]), min(cpu[k])) for k in steps}, losses


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of saved MiB and step times, with ratios."""
    lines = [
        "| vocab | chunk | saved MiB plain | saved MiB fused | (recompute) | plain / fused "
        "| step s plain | step s fused | (recompute) | fused / plain | CPU s plain | CPU s fused | (recompute) | fused / plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['chunk_size']} | {_mib(r['plain_saved_bytes'])} | {_mib(r['fused_saved_bytes'])} "
            f"| {_mib(r['fused_recompute_saved_bytes'])} | {r['saved_ratio']:.1f}x ({r['saved_ratio_recompute']:.0f}x) "
            f"| {r['plain_step_s']:.3f} | {r['fused_step_s']:.3f} | {r['fused_recompute_step_s']:.3f} "
            f"| {r['time_ratio']:.2f}x ({r['time_ratio_recompute']:.2f}x) "
            f"| {r['plain_step_cpu_s']:.3f} | {r['fused_step_cpu_s']:.3f} | {r['fused_recompute_step_cpu_s']:.3f} "
            f"| {r['cpu_ratio']:.2f}x ({r['cpu_ratio_recompute']:.2f}x) |"
        )
    r0 = rows[0]
    lines.append("")
    lines.append(
        f"{r0['tokens']} tokens, hidden {r0['hidden']}, {r0['dtype']}; step = forward + backward of the loss, "
        "fastest of the timed rounds (wall, and CPU seconds of this process); "
        "saved = bytes autograd keeps (parameters excluded)."
    )
    return "\n".join(lines)


def _sweep_table(sweep: list[dict[str, Any]]) -> str:
    """The markdown table of fused step time against the chunk's fp32-logit budget."""
    lines = [
        "| vocab | chunk fp32 logits MiB | chunk | step s fused | step s plain | fused / plain | CPU s fused | CPU s plain | fused / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sweep:
        lines.append(
            f"| {s['vocab']} | {s['chunk_logits_mib']} | {s['chunk_size']} | {s['fused_step_s']:.3f} "
            f"| {s['plain_step_s']:.3f} | {s['time_ratio']:.2f}x | {s['fused_step_cpu_s']:.3f} "
            f"| {s['plain_step_cpu_s']:.3f} | {s['cpu_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.loss``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
