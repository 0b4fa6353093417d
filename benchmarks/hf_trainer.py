"""A transformers model under the HF Trainer, unpatched vs patched by agoq, side by side in one invocation.

Every run is ``examples/hf_trainer.py`` under ``torchrun --nproc-per-node=2`` (same data, seed and
steps for both; 3 seeds each): validation and final training loss, the median step time after the
first three steps (which include one-off compilation), and the gradient bytes each rank sends per
step. The per-layer and loss saved bytes (agoq's meter) and the peak tensors of one step (one
process: parameters, gradients, AdamW state, saved activations and temporaries) are measured in
this process on the example's model and one micro-batch of its data.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "HF Trainer on 2 CPU processes: the transformers model unpatched vs patched by agoq (memory, wire bytes, speed, loss)"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
WORLD = 2
MODES = ("unpatched", "agoq")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=100, help="training steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per mode")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--seq-len", type=int, default=128)
    add_out_dir(parser)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example_args(args: argparse.Namespace, cache: str, extra: list[str] | None = None) -> list[str]:
    return ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--cache-dir", cache, *(extra or [])]


def _train(args: argparse.Namespace, mode: str, seed: int, cache: str, tmp: Path) -> dict[str, Any]:
    summary = tmp / f"{mode}_{seed}.json"
    extra = ["--seed", str(seed), "--out-dir", str(tmp / f"{mode}_{seed}"), "--summary", str(summary)]
    if mode == "unpatched":
        extra.append("--plain")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(EXAMPLE)]
    proc = subprocess.run(cmd + _example_args(args, cache, extra), capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def _memory(args: argparse.Namespace, mode: str, cache: str) -> dict[str, Any]:
    """Saved bytes by layer and outside (meter), and the peak tensors of one training step, in this process."""
    import torch

    from agoq.activation.meter import SavedBytesMeter
    from agoq.integrations.hf import apply_agoq
    from agoq.train.saved import SavedActivationTracker

    example = _example()
    model, train, _ = example.build(example.parse_args(_example_args(args, cache)))
    if mode == "agoq":
        apply_agoq(model)
    batch = torch.stack([train[i]["input_ids"] for i in range(args.batch_size)])
    with torch.enable_grad():
        with SavedBytesMeter(model, dict(enumerate(model.model.layers))) as meter:
            out = model(batch, labels=batch)
        saved = meter.summary()
        del out
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Two steps inside the count: the optimizer creates its state in the first. Eager, so the
        # dispatch mode sees every tensor (compiled code would hide its allocations).
        with torch.compiler.set_stance("force_eager"), SavedActivationTracker().temporaries() as allocations:
            for _ in range(2):
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
    layers = {k: sum(v.values()) for k, v in saved["layers"].items()}
    return {
        "saved_bytes_per_layer": layers,
        "saved_bytes_outside_layers": sum(saved["outside"].values()),
        "peak_tensor_bytes": param_bytes + allocations.peak_bytes,
    }


def run(args: argparse.Namespace) -> int:
    from benchmarks._common import write_result

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = str(tmp / "cache")
        rows: dict[str, Any] = {}
        for mode in MODES:
            runs = [_train(args, mode, seed, cache, tmp) for seed in range(args.seeds)]
            rows[mode] = {"runs": runs, **_memory(args, mode, cache)}
            for key in ("val_loss", "train_loss", "step_s_median_after_3", "wire_bytes_per_step"):
                values = [r[key] for r in runs]
                rows[mode][key] = statistics.mean(values)
                rows[mode][f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    base, agoq = rows["unpatched"], rows["agoq"]
    layer_ratio = {k: agoq["saved_bytes_per_layer"][k] / v for k, v in base["saved_bytes_per_layer"].items()}
    # The unpatched run's wire bytes are DDP's own fp32 ring all-reduce: 2 (W-1)/W x 4 bytes per
    # parameter per rank (computed; agoq's counter sees only its own collectives).
    params = agoq["runs"][0]["parameters"]
    base["wire_bytes_per_step"] = 2 * (WORLD - 1) / WORLD * 4 * params
    results = {
        "world_size": WORLD,
        "steps": args.steps,
        "seeds": args.seeds,
        "batch_size_per_process": args.batch_size,
        "seq_len": args.seq_len,
        "parameters": params,
        "rows": rows,
        "agoq_vs_unpatched": {
            "saved_bytes_per_layer": layer_ratio,
            "saved_bytes_outside_layers": agoq["saved_bytes_outside_layers"] / base["saved_bytes_outside_layers"],
            "peak_tensor_bytes": agoq["peak_tensor_bytes"] / base["peak_tensor_bytes"],
            "wire_bytes_per_step": agoq["wire_bytes_per_step"] / base["wire_bytes_per_step"],
            "step_time": agoq["step_s_median_after_3"] / base["step_s_median_after_3"],
            "val_loss": agoq["val_loss"] / base["val_loss"],
        },
    }
    path = write_result("hf_trainer", results, out_dir=args.out_dir)
    print(readme_markdown(results))
    print(f"\nwritten: {path}")
    return 0


def readme_markdown(results: dict[str, Any]) -> str:
    """The README table: one row per mode, and the ratio row."""
    rows, ratio = results["rows"], results["agoq_vs_unpatched"]
    lines = [
        "| model | saved / layer (KiB) | saved outside layers (KiB) | peak tensors (MiB) | wire bytes / step (MiB) | step (s, 3 seeds) | train loss | val loss (3 seeds) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        r = rows[mode]
        per_layer = statistics.mean(r["saved_bytes_per_layer"].values()) / 1024
        lines.append(
            f"| {mode} | {per_layer:.0f} | {r['saved_bytes_outside_layers'] / 1024:.0f} | {r['peak_tensor_bytes'] / 2**20:.1f} "
            f"| {r['wire_bytes_per_step'] / 2**20:.2f} | {r['step_s_median_after_3']:.3f} ± {r['step_s_median_after_3_std']:.3f} | {r['train_loss']:.3f} "
            f"| {r['val_loss']:.3f} ± {r['val_loss_std']:.3f} |"
        )
    layer = max(ratio["saved_bytes_per_layer"].values())
    lines.append(
        f"| agoq / unpatched | {layer:.2f} (worst layer) | {ratio['saved_bytes_outside_layers']:.2f} | {ratio['peak_tensor_bytes']:.2f} "
        f"| {ratio['wire_bytes_per_step']:.3f} | {ratio['step_time']:.2f} | | {ratio['val_loss']:.4f} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_trainer", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
