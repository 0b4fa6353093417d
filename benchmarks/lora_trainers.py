"""LoRA fine-tunes under the Trainers users run, with and without agoq, side by side in one invocation.

Every run is ``examples/lora_finetune.py`` under ``torchrun --nproc-per-node=2`` (same base model,
data, steps and seed on every side; several seeds each): plain LoRA under transformers' Trainer,
agoq's LoRA under ``AgoqTrainer``-style ``AgoqMixin`` with transformers' Trainer and with TRL's
``SFTTrainer``, plain LoRA under ``SFTTrainer``, and agoq's LoRA with compressed checkpoints
(``checkpoint_format="int8/128"``) under transformers' Trainer. Reported: validation loss (mean and spread over
seeds), the median step time after the first three steps, and the gradient bytes each rank sends.
Memory and saved bytes of the same fine-tune are :mod:`benchmarks.lora`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "LoRA fine-tunes on 2 CPU processes under transformers' Trainer and TRL's SFTTrainer, plain and with agoq (loss, speed, wire bytes)"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lora_finetune.py"
WORLD = 2
# name -> the example's arguments. "plain" is the reference every other run is compared with.
RUNS = {
    "plain": ["--plain"],
    "agoq": [],
    "plain_sft": ["--plain", "--trainer", "sft"],
    "agoq_sft": ["--trainer", "sft"],
    # Compressed checkpoints: every layer checkpointed, its input kept at 8 bits.
    "agoq_ckpt8": ["--checkpoint-format", "int8/128"],
}
# Each run against its reference: agoq against plain LoRA under the same Trainer, and the two
# plain runs against each other (what the Trainer alone changes).
COMPARED = {"agoq": "plain", "agoq_sft": "plain_sft", "plain_sft": "plain", "agoq_ckpt8": "plain"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run length, seeds and where the result goes."""
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per run")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process and step")
    parser.add_argument("--eval-windows", type=int, default=16)
    add_out_dir(parser)


def _train(args: argparse.Namespace, name: str, seed: int, cache: str, tmp: Path) -> dict[str, Any]:
    summary = tmp / f"{name}_{seed}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(EXAMPLE)]
    cmd += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--eval-windows", str(args.eval_windows), "--seed", str(seed)]
    cmd += ["--cache-dir", cache, "--out-dir", str(tmp / f"{name}_{seed}"), "--summary", str(summary), *RUNS[name]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def run(args: argparse.Namespace) -> int:
    from benchmarks._common import write_result

    rows: dict[str, Any] = {name: {"runs": []} for name in RUNS}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = str(tmp / "cache")
        # Seed by seed, every run of a seed in turn: a change in the machine's load falls on all of them.
        for seed in range(args.seeds):
            for name in RUNS:
                r = _train(args, name, seed, cache, tmp)
                rows[name]["runs"].append(r)
                print(f"seed {seed} {name}: val loss {r['val_loss']:.4f}, step {r['step_s_median_after_3']:.3f} s", flush=True)
    for row in rows.values():
        for key in ("val_loss", "train_loss", "step_s_median_after_3", "wire_bytes_per_step"):
            values = [r[key] for r in row["runs"]]
            row[key] = statistics.mean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    ratios = ratios_of(rows)
    results = {
        "world_size": WORLD,
        "steps": args.steps,
        "seeds": args.seeds,
        "batch_size_per_process": args.batch_size,
        "rows": rows,
        "ratios": ratios,
    }
    path = write_result("lora_trainers", results, out_dir=args.out_dir)
    print(readme_markdown(results))
    print(f"\nwritten: {path}")
    return 0


def ratios_of(rows: dict[str, Any]) -> dict[str, Any]:
    """Each compared run against its reference: mean validation loss, the worst seed's gap, and the median step-time ratio."""
    ratios = {}
    for name, base in COMPARED.items():
        a, b = rows[name], rows[base]
        ratios[f"{name}/{base}"] = {
            "val_loss": a["val_loss"] / b["val_loss"],
            # Per seed, then the worst: each seed's runs share base model, data and order.
            "val_loss_worst_seed": max(abs(x["val_loss"] / y["val_loss"] - 1) for x, y in zip(a["runs"], b["runs"])),
            "step_time": statistics.median(x["step_s_median_after_3"] / y["step_s_median_after_3"] for x, y in zip(a["runs"], b["runs"])),
        }
    return ratios


def readme_markdown(results: dict[str, Any]) -> str:
    """The docs table: one row per run, then each run against plain LoRA."""
    rows, n = results["rows"], results["seeds"]
    lines = [
        f"| run | val loss ({n} seeds) | train loss | step (s) | wire bytes / step (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['val_loss']:.4f} ± {r['val_loss_std']:.4f} | {r['train_loss']:.3f} | {r['step_s_median_after_3']:.3f} "
            f"| {r['wire_bytes_per_step'] / 2**20:.3f} |"
        )
    for key, q in results["ratios"].items():
        lines.append(f"| {key} | {q['val_loss']:.4f}x (worst seed {100 * q['val_loss_worst_seed']:.2f}% apart) | | {q['step_time']:.2f}x | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_trainers", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
