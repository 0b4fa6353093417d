"""Convergence of AGoQ against the bf16 baseline, and its ablations, at the same token budget.

Every run is the embedded default (tiny LLaMA on the KJV, pp=2 x dp=2, 1F1B) with one precision
setting changed; runs with the same seed see the same data in the same order. Each finished run's
summary is cached under the output folder, so an interrupted invocation resumes where it stopped.

The ``ring8`` ablation is no ``precision.gradients`` of agoq train: it trains the fp32 run with
the trainer's all-reduce swapped for the FP8-LM-style ring by a benchmark-local hook
(benchmarks/_ring8.py), so its summary records precision.gradients = fp32.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "loss, validation loss, grad norm, memory and step time of bf16 vs AGoQ and its ablations (pp=2 x dp=2)"

# name -> (what it is, config overrides). bf16 is the baseline: bf16 saved activations, fp32 all-reduce.
RUNS: dict[str, tuple[str, list[str]]] = {
    "bf16": ("bf16 baseline (bf16 saved activations, fp32 gradient all-reduce)", ["--precision.activations=bf16", "--precision.gradients=fp32"]),
    "agoq": (
        "full AGoQ: 4-bit activations + DBCA stage bits + 8-bit gradients",
        ["--precision.activations=agoq", "--precision.gradients=int8", "--precision.stage_bits=dbca"],
    ),
    "agoq_act": (
        "AGoQ activations only (fp32 gradients)",
        ["--precision.activations=agoq", "--precision.gradients=fp32", "--precision.stage_bits=dbca"],
    ),
    "agoq_int4": (
        "full AGoQ with the gradients sent in 4 bits (int4/64), no error feedback",
        ["--precision.activations=agoq", "--precision.gradients=int4", "--precision.stage_bits=dbca"],
    ),
    "agoq_int4_ef": (
        "full AGoQ with the gradients sent in 4 bits (int4/64) and error feedback",
        ["--precision.activations=agoq", "--precision.gradients=int4-ef", "--precision.stage_bits=dbca"],
    ),
    "agoq_grad": ("AGoQ gradients only (bf16 activations)", ["--precision.activations=bf16", "--precision.gradients=int8"]),
    "agoq_adamw8bit": (
        "full AGoQ + 8-bit AdamW (torchao)",
        ["--precision.activations=agoq", "--precision.gradients=int8", "--precision.stage_bits=dbca", "--optim.name=adamw8bit"],
    ),
    "uniform4": (
        "ablation: every saved tensor 4-bit, attention included (8-bit gradients)",
        ["--precision.activations=uniform4", "--precision.gradients=int8", "--precision.stage_bits=uniform"],
    ),
    "ring8": (
        "ablation: 8-bit gradients summed along a ring, FP8-LM style (bf16 activations)",
        ["--precision.activations=bf16", "--precision.gradients=fp32"],
    ),
}
# Runs whose fp32 all-reduce benchmarks/_ring8.py replaces with the 8-bit ring.
RING_RUNS = ("ring8",)
MULTI_SEED = ("bf16", "agoq", "agoq_int4", "agoq_int4_ef")
# Per-rank memory by category (agoq.launch.run.train_worker): persistent state, the step's peaks of
# saved activations and of temporaries, and all tensors at the step's joint peak.
MEMORY_KEYS = (
    "param_bytes",
    "grad_buffer_bytes",
    "optimizer_bytes",
    "peak_saved_bytes",
    "peak_temporary_bytes",
    "peak_tensor_bytes",
    "peak_rss_bytes",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length, seeds, which runs, and where runs go."""
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (the same token budget for every run)")
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds for the bf16 baseline, full AGoQ and its 4-bit-gradient variants (the ablations use seed 0)"
    )
    parser.add_argument("--eval-every", type=int, default=25, help="validation loss every N steps")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    add_out_dir(parser, "the runs with their cached summaries (default: under runs/bench_convergence, runs/bench_convergence_MODEL for other models)")
    parser.add_argument("--cached-only", action="store_true", help="write the result from the runs already cached, training none")
    parser.add_argument("--model", default="tiny", help="model preset; other than tiny, results go to convergence_<preset>.json")


def _plan(names: list[str], seeds: int) -> list[tuple[str, int]]:
    """(run, seed) pairs in the order that makes a partial result most useful: seed 0 pair, ablations, more seeds."""
    order = [(n, 0) for n in names if n in MULTI_SEED]
    order += [(n, 0) for n in names if n not in MULTI_SEED]
    for s in range(1, seeds):
        order += [(n, s) for n in names if n in MULTI_SEED]
    return order


def _trim(summary: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark keeps of a run's summary: totals, per-rank stats and per-step trajectories."""
    recs = summary["records"]
    return {
        "run": summary["run"],
        "ranks": summary["ranks"],
        "loss": [r["loss"] for r in recs],
        "grad_norm": [r["grad_norm"] for r in recs],
        "val": [[r["step"], r["val_loss"]] for r in recs if r.get("val_loss") is not None],
        "skipped_steps": sum(1 for r in recs if r.get("skipped")),
    }


def run_one(name: str, seed: int, steps: int, eval_every: int, out_dir: Path, train: bool = True, model: str = "tiny") -> dict[str, Any] | None:
    """Train one configuration (or read its cached result) and return the trimmed summary; None if not cached and not training."""
    from agoq.launch.config import load_config
    from agoq.launch.run import launch

    folder = out_dir / f"{name}_s{seed}"
    cached = folder / "result.json"
    if cached.is_file():
        data = json.loads(cached.read_text())
        if data.get("steps") == steps and data.get("eval_every") == eval_every:
            return data
    if not train:
        return None
    cfg = load_config(
        None,
        [
            *RUNS[name][1],
            f"--model.preset={model}",
            f"--train.seed={seed}",
            f"--train.steps={steps}",
            f"--train.eval_every={eval_every}",
            "--train.baseline=false",
            "--checkpoint.every=0",
            "--checkpoint.resume=false",
            f"--train.out_dir={folder}",
        ],
    )
    if name in RING_RUNS:
        from benchmarks._ring8 import train_ring8

        summary = train_ring8(cfg)
    else:
        summary = launch(cfg)
    if summary is None:
        raise RuntimeError(f"run {name} seed {seed} returned no summary; see {folder}")
    data = {"name": name, "seed": seed, "steps": steps, "eval_every": eval_every, **_trim(summary)}
    cached.write_text(json.dumps(data) + "\n")
    return data


def unigram_entropy_nats() -> float:
    """Entropy (nats/token) of the token frequencies of the tokenized KJV training split."""
    import numpy as np

    from agoq.launch.config import DataSection
    from agoq.data.tokens import prepare_data

    d = DataSection()
    data = prepare_data(None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction)
    counts = np.bincount(np.asarray(data.train, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def aggregate(done: dict[tuple[str, int], dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """One row per configuration: losses over seeds, max-over-ranks memory and wire bytes, timing, ratios vs bf16."""
    rows = []
    for name in names:
        seeds = sorted(s for (n, s) in done if n == name)
        if not seeds:
            continue
        runs = [done[(name, s)] for s in seeds]
        ranks = runs[0]["ranks"]
        rows.append(
            {
                "name": name,
                "what": RUNS[name][0],
                "seeds": seeds,
                "final_loss": _stats([r["run"]["final_loss"] for r in runs]),
                "val_loss": _stats([r["run"]["val_loss"] for r in runs]),
                "step_time_s": statistics.fmean(r["run"]["step_time_s"] for r in runs),
                "tokens_per_s": statistics.fmean(r["run"]["tokens_per_s"] for r in runs),
                "skipped_steps": sum(r["skipped_steps"] for r in runs),
                "max_rank": {k: max(g[k] for g in ranks) for k in MEMORY_KEYS + ("wire_bytes_per_step", "fp32_wire_bytes_per_step")},
                "per_rank": [
                    {
                        k: g[k]
                        for k in ("rank", "pp_rank", "dp_rank", "layer_bits", *MEMORY_KEYS, "peak_temporary_bytes_by_phase", "wire_bytes_per_step")
                    }
                    for g in ranks
                ],
            }
        )
    base = next((r for r in rows if r["name"] == "bf16"), None)
    if base is not None:
        for r in rows:
            # Against bf16 at the same seeds (same weights and data order): a one-seed ablation is
            # compared with the bf16 run it differs from in one setting only.
            same = [s for s in r["seeds"] if ("bf16", s) in done]
            r["bf16_seeds_compared"] = same
            b_val = statistics.fmean(done[("bf16", s)]["run"]["val_loss"] for s in same)
            b_time = statistics.fmean(done[("bf16", s)]["run"]["step_time_s"] for s in same)
            r["val_loss_vs_bf16"] = r["val_loss"]["mean"] / b_val - 1.0
            r["val_loss_diff_vs_bf16"] = r["val_loss"]["mean"] - b_val
            r["step_time_vs_bf16"] = r["step_time_s"] / b_time
            r["peak_saved_vs_bf16"] = r["max_rank"]["peak_saved_bytes"] / base["max_rank"]["peak_saved_bytes"]
            r["peak_tensor_vs_bf16"] = r["max_rank"]["peak_tensor_bytes"] / base["max_rank"]["peak_tensor_bytes"]
            r["wire_vs_bf16"] = r["max_rank"]["wire_bytes_per_step"] / base["max_rank"]["wire_bytes_per_step"]
    return rows


def targets(rows: list[dict[str, Any]], entropy: float) -> dict[str, Any]:
    """The claims checked against the measurements: parity of full AGoQ, and whether the ablations are worse."""
    by = {r["name"]: r for r in rows}
    out: dict[str, Any] = {"unigram_entropy_nats": entropy}
    if "bf16" not in by:
        return out
    b = by["bf16"]["val_loss"]
    out["bf16_final_loss_below_entropy_nats"] = entropy - by["bf16"]["final_loss"]["mean"]
    spreads = [by[n]["val_loss"]["std"] for n in MULTI_SEED if n in by and by[n]["val_loss"]["std"] is not None]
    spread = max(spreads) if spreads else None
    out["seed_std_val_loss"] = spread
    for n in ("agoq", "agoq_int4", "agoq_int4_ef"):
        if n in by:
            a = by[n]["val_loss"]
            rel = a["mean"] / b["mean"] - 1.0
            out[f"{n}_val_loss_rel_diff"] = rel
            out[f"{n}_within_1pct"] = abs(rel) < 0.01
            out[f"{n}_inside_seed_spread"] = None if spread is None else abs(a["mean"] - b["mean"]) <= spread
    for n in ("uniform4", "ring8"):
        if n in by:
            d = by[n]["val_loss_diff_vs_bf16"]
            out[f"{n}_val_loss_diff"] = d
            # "Measurably worse": above the baseline by more than twice the seed-to-seed std.
            out[f"{n}_measurably_worse"] = None if spread is None else d > 2 * spread
    return out


def plot(done: dict[tuple[str, int], dict[str, Any]], path: Path, entropy: float) -> None:
    """Loss curves of every run, and grad-norm curves of bf16 vs full AGoQ (all seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = dict(zip(RUNS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (name, seed), r in sorted(done.items()):
        steps = range(1, len(r["loss"]) + 1)
        ax1.plot(steps, r["loss"], color=colors[name], lw=1.0, alpha=1.0 if seed == 0 else 0.45, label=name if seed == 0 else None)
        if name in MULTI_SEED:
            ax2.plot(steps, r["grad_norm"], color=colors[name], lw=1.0, alpha=1.0 if seed == 0 else 0.45, label=f"{name} (seed {seed})")
    ax1.axhline(entropy, color="gray", ls="--", lw=0.8, label=f"unigram entropy {entropy:.2f}")
    ax1.set(xlabel="step", ylabel="training loss (nats/token)", title="training loss, same tokens and data order")
    ax1.set_ylim(top=min(ax1.get_ylim()[1], entropy + 1.5))
    ax1.legend(fontsize=8)
    ax2.set(xlabel="step", ylabel="global gradient norm (before clipping)", title="gradient norm: bf16 vs AGoQ", yscale="log")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproducing_command(args: argparse.Namespace) -> str:
    """The command line that produces the same result file: every option that changes it, a subset of runs included."""
    command = f"python -m benchmarks.convergence --steps {args.steps} --seeds {args.seeds} --eval-every {args.eval_every}"
    if args.model != "tiny":
        command += f" --model {args.model}"
    if args.runs != ",".join(RUNS):
        command += f" --runs {args.runs}"
    if args.out_dir:
        command += f" --out-dir {args.out_dir}"
    return command


def run(args: argparse.Namespace) -> int:
    """Train every configuration (cached), then write the JSON, the PNG and a markdown table."""
    from benchmarks._common import write_result

    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.out_dir:
        out_dir = Path(args.out_dir) if args.model == "tiny" else Path(args.out_dir) / args.model
    else:
        out_dir = Path("runs/bench_convergence" if args.model == "tiny" else f"runs/bench_convergence_{args.model}")
    out_dir.mkdir(parents=True, exist_ok=True)
    entropy = unigram_entropy_nats()
    result_name = "convergence" if args.model == "tiny" else f"convergence_{args.model.replace('-', '_').replace('.', '_')}"
    command = reproducing_command(args)
    done: dict[tuple[str, int], dict[str, Any]] = {}
    for name, seed in _plan(names, args.seeds):
        got = run_one(name, seed, args.steps, args.eval_every, out_dir, train=not args.cached_only, model=args.model)
        if got is None:
            continue
        done[(name, seed)] = got
        rows = aggregate(done, names)
        results = {
            "config": f"{args.model} LLaMA, KJV, pp=2 x dp=2, 1f1b, 4 micro-batches, 16 x 128 tokens per step, AdamW 3e-3 cosine",
            "steps": args.steps,
            "tokens_per_run": args.steps * 16 * 128,
            "complete": len(done) == len(_plan(names, args.seeds)),
            "rows": rows,
            "targets": targets(rows, entropy),
            "trajectories": {f"{n}_s{s}": {"loss": r["loss"], "grad_norm": r["grad_norm"], "val": r["val"]} for (n, s), r in done.items()},
        }
        path = write_result(result_name, results, command=command, out_dir=args.out_dir)
        plot(done, path.with_suffix(".png"), entropy)
    print(readme_markdown(results))
    return 0


def _pm(s: dict[str, Any]) -> str:
    return f"{s['mean']:.3f}" + (f" ± {s['std']:.3f}" if s["std"] is not None else "")


def readme_markdown(results: dict[str, Any]) -> str:
    """Loss, memory and time of every configuration, then the targets beside the measured figures."""
    mib = 2**20
    lines = [
        f"{results['config']}; {results['steps']} steps ({results['tokens_per_run']:,} tokens) per run. "
        "Losses are mean ± sample std over seeds; 'vs bf16' compares with bf16 at the same seeds (the one-seed "
        "ablations with bf16 seed 0).",
        "",
        "| run | what | seeds | final train loss | val loss | val vs bf16 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['name']} | {r['what']} | {len(r['seeds'])} | {_pm(r['final_loss'])} | {_pm(r['val_loss'])} | {r.get('val_loss_vs_bf16', 0):+.2%} |"
        )
    lines += [
        "",
        "Memory per rank by category, in MiB, the largest over the 4 ranks: parameters, gradient buffer, optimizer "
        "state (fp32 masters + moments), the step's peak of saved activations, its peak of temporaries (every other "
        "tensor the step allocates: forward intermediates, gradients before they reach the buffer, quantization "
        "scratch, loss chunks, communication and optimizer-step buffers; counted on each run's second step), and all "
        "tensors at the step's joint peak. Step times were taken under varying load from other work on the 2 shared "
        "cores: read them as rough.",
        "",
        "| run | params | grad buffer | optimizer | saved act. | vs bf16 | temporaries | all tensors | vs bf16 | wire / step | vs bf16 | s / step | time vs bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        m = r["max_rank"]
        lines.append(
            f"| {r['name']} | {m['param_bytes'] / mib:.2f} | {m['grad_buffer_bytes'] / mib:.2f} | {m['optimizer_bytes'] / mib:.2f} | "
            f"{m['peak_saved_bytes'] / mib:.2f} | {r.get('peak_saved_vs_bf16', 1):.2f}x | {m['peak_temporary_bytes'] / mib:.2f} | "
            f"{m['peak_tensor_bytes'] / mib:.2f} | {r.get('peak_tensor_vs_bf16', 1):.2f}x | "
            f"{m['wire_bytes_per_step'] / mib:.2f} | {r.get('wire_vs_bf16', 1):.2f}x | {r['step_time_s']:.2f} | {r.get('step_time_vs_bf16', 1):.2f}x |"
        )
    t = results["targets"]
    lines += ["", "| target | measured |", "|---|---|"]
    lines.append(
        f"| training loss well below the unigram entropy of the tokenized KJV train split ({t['unigram_entropy_nats']:.3f} nats) | "
        + (
            f"bf16 final loss {t['unigram_entropy_nats'] - t['bf16_final_loss_below_entropy_nats']:.3f}, {t['bf16_final_loss_below_entropy_nats']:.2f} nats below |"
            if "bf16_final_loss_below_entropy_nats" in t
            else "not measured |"
        )
    )
    spread = t.get("seed_std_val_loss")
    for n, label in (("agoq", "full AGoQ"), ("agoq_int4", "AGoQ, 4-bit gradients"), ("agoq_int4_ef", "AGoQ, 4-bit gradients + error feedback")):
        if f"{n}_val_loss_rel_diff" not in t:
            continue
        lines.append(f"| {label}: val loss within 1% of bf16 | {t[f'{n}_val_loss_rel_diff']:+.2%}: {'yes' if t[f'{n}_within_1pct'] else 'no'} |")
        lines.append(
            f"| {label}: inside the seed spread (difference of means <= the larger seed std) | "
            + (
                "one seed only |"
                if spread is None
                else f"{abs(_diff(results, n)):.4f} vs std {spread:.4f}: {'yes' if t[f'{n}_inside_seed_spread'] else 'no'} |"
            )
        )
    for n, label in (
        ("uniform4", "uniform 4-bit (attention quantized too) measurably worse"),
        ("ring8", "8-bit ring sum (FP8-LM style) measurably worse"),
    ):
        if f"{n}_val_loss_diff" in t:
            verdict = "n/a" if t[f"{n}_measurably_worse"] is None else ("yes" if t[f"{n}_measurably_worse"] else "no, not at this scale")
            lines.append(f"| {label} (val loss above bf16 by > 2 seed std) | {t[f'{n}_val_loss_diff']:+.4f}: {verdict} |")
    if not results.get("complete", True):
        lines += ["", "_Partial: not every planned run had finished when this file was written._"]
    return "\n".join(lines)


def _diff(results: dict[str, Any], name: str) -> float:
    return next(r["val_loss_diff_vs_bf16"] for r in results["rows"] if r["name"] == name)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.convergence``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
