"""LoRA and QLoRA fine-tuning under agoq against its peers, side by side in one invocation.

One small ``LlamaForCausalLM`` built from a ``LlamaConfig`` (seeded; vocabulary from the byte-level
BPE that ``examples/lora_finetune.py`` trains on the bundled KJV text), the same data, seed and
steps for every variant, LoRA r=8 (alpha 16) on q, k, v, o, gate, up and down, dropout 0.05,
AdamW on the adapters, fp32. The default width (256) is small enough for minutes on two cores,
and there the fixed cost of each call (agoq's fused ops make more, smaller ones) weighs more than
at the widths users fine-tune; ``--hidden 1024 --intermediate 2752 --heads 16 --kv-heads 4``
measures the same at a width where the work itself dominates (``lora_hidden1024.json``):

- ``lora``: plain PEFT LoRA;
- ``lora_ckpt``: the same with transformers' activation checkpointing on every decoder layer
  (``activation_checkpointing_enable`` with ``use_reentrant=False``; ``gradient_checkpointing_enable``
  is its deprecated alias in this transformers);
- ``lora_ckpt_offload``: the same with ``offload=True``, transformers' own option: it wraps each
  checkpoint in ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, which needs an accelerator's
  pinned-memory allocator, so on a machine without one the row is a note with the error;
- ``lora_inductor_fp8``: each decoder layer ``torch.compile``'d with inductor's activation
  quantization pass (``post_grad_fusion_options["activation_quantization_aten_pass"]``, scoped with
  ``torch._inductor.config.patch``): the tensors the compiled forward saves are kept as scaled
  float8_e5m2. Its defaults only take bf16 tensors of 100 MB or more, so it is given fp32 and
  size 0: every saved tensor qualifies;
- ``agoq_lora``: ``apply_agoq`` on the PEFT model;
- ``agoq_lora_ckpt``: ``apply_agoq`` and transformers' checkpointing as in ``lora_ckpt``: each
  layer keeps its input and recomputes through agoq's fused ops;
- ``agoq_lora_ckpt8``: ``apply_agoq(checkpoint_format="int8/128")``, compressed checkpoints:
  every layer checkpointed by agoq, its input kept at 8 bits;
- ``qlora``: the base model saved with ``save_pretrained`` and loaded back with bitsandbytes nf4
  (fp32 compute), ``prepare_model_for_kbit_training`` without checkpointing, then LoRA;
- ``agoq_qlora``: that QLoRA model under ``apply_agoq``.

Design (the model, the step and the peak's measurement are ``benchmarks/_finetune.py``'s, shared
with ``finetune_scale``): every run is its own subprocess, so its peak RSS (``ru_maxrss``) is its
own. The variants take turns: round ``i`` runs every variant once, with seed ``i``, in an order
rotated by ``i``; the step-time ratios are medians over rounds of each round's ratio (a change in the machine's load
cancels within a round), the losses mean ± std over the rounds' seeds. In each run: the first
``--warmup`` steps (compilation, first allocations) are not timed, the step time is the median of
the rest; the training loss is the mean of the last three steps, the validation loss is over
held-out windows (eval mode, no grad; the compiled variant runs it eagerly: the same function
without a second compilation). Saved bytes per decoder layer are agoq's meter
(``SavedBytesMeter``) on the first step's forward (non-reentrant checkpointing saves each layer's
inputs through the saved-tensor hooks, so the meter counts what it keeps). Peak tensor bytes
come from ``torch.profiler`` (``profile_memory``: every CPU allocation, compiled code included) on
one training step after the validation loss, plus the tensors alive when it starts (parameters,
buffers, optimizer state). RSS is read before that step, so the profiler's own memory is not in it.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir, command_line, same_round_ratio
from benchmarks._finetune import LORA, build_model, child_main, decoder_layers, example, spawn, state_bytes, step_peak, train_step

DESCRIPTION = "LoRA / QLoRA fine-tune: agoq against plain, checkpointing, offload and inductor's fp8 pass (memory, RSS, speed, loss)"
VARIANTS = (
    "lora",
    "lora_ckpt",
    "lora_ckpt_offload",
    "lora_inductor_fp8",
    "agoq_lora",
    "agoq_lora_ckpt",
    "agoq_lora_ckpt8",
    "qlora",
    "agoq_qlora",
)
WHAT = {
    "lora": "plain PEFT LoRA",
    "lora_ckpt": "LoRA + activation checkpointing (every layer, non-reentrant)",
    "lora_ckpt_offload": "LoRA + checkpointing with offload=True (save_on_cpu)",
    "lora_inductor_fp8": "LoRA, layers compiled with inductor's activation quantization pass (fp8 e5m2)",
    "agoq_lora": "apply_agoq on the LoRA model",
    "agoq_lora_ckpt": "apply_agoq + activation checkpointing (every layer, non-reentrant)",
    "agoq_lora_ckpt8": "apply_agoq with compressed checkpoints (every layer, input at int8/128)",
    "qlora": "plain QLoRA (bitsandbytes nf4 base weights)",
    "agoq_qlora": "apply_agoq on the QLoRA model",
}
CHECKPOINTED = ("lora_ckpt", "lora_ckpt_offload", "agoq_lora_ckpt")
# Peers that depend on what this machine and these versions offer: where one fails, its row is a
# note with the error instead of figures (every other failure stops the benchmark).
MAY_FAIL = ("lora_ckpt_offload", "lora_inductor_fp8")
# Inductor's pass, given every saved fp32 tensor (its defaults: bf16 only, 100 MB and up).
INDUCTOR_FP8 = {
    "activation_quantization_aten_pass": {
        "quant_type": "torch.float8_e5m2",
        "allowed_dtypes": "torch.float32",
        "size_in_mb": 0.0,
        "use_scaling": True,
    }
}
LAST_LOSSES = 3
DEFAULT_HIDDEN = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the warm-up included)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of its step time")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant; round i uses seed i")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--hidden", type=int, default=DEFAULT_HIDDEN, help=f"model width; other than {DEFAULT_HIDDEN}, results go to lora_hidden<H>.json"
    )
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-windows", type=int, default=8)
    add_out_dir(parser)


# ---- one run (in its own process) ----------------------------------------------------------------


def _model(spec: dict[str, Any], tmp: Path) -> Any:
    config = {
        "vocab_size": spec["vocab"],
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "max_position_embeddings": spec["seq_len"],
    }
    variant = spec["variant"]
    return build_model(
        config,
        seed=spec["seed"],
        tmp=tmp,
        qlora=variant in ("qlora", "agoq_qlora"),
        checkpointing=variant in CHECKPOINTED,
        offload=variant == "lora_ckpt_offload",
        agoq=variant.startswith("agoq_"),
        checkpoint_format="int8/128" if variant == "agoq_lora_ckpt8" else None,
        compile_layers=variant == "lora_inductor_fp8",
    )


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one variant for ``spec['steps']`` steps in this process; its figures as a dict."""
    import contextlib

    import torch

    from agoq.activation.meter import SavedBytesMeter
    from agoq.data.tokens import prepare_data

    data = prepare_data(vocab_size=spec["vocab_size"], cache=spec["cache"])
    spec = {**spec, "vocab": data.tokenizer.vocab_size}
    windows = example().Windows
    train = windows(data.train, spec["seq_len"])
    val = windows(data.val[: spec["seq_len"] * spec["eval_windows"] + 1], spec["seq_len"])
    with tempfile.TemporaryDirectory() as tmp_name:
        model = _model(spec, Path(tmp_name))
    layers = decoder_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec["lr"])
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(spec["seed"]))
    batches = [
        torch.stack([train[int(i)]["input_ids"] for i in order[s * spec["batch_size"] : (s + 1) * spec["batch_size"]]])
        for s in range(spec["steps"] + 1)
    ]
    scope = (
        torch._inductor.config.patch(post_grad_fusion_options=INDUCTOR_FP8) if spec["variant"] == "lora_inductor_fp8" else contextlib.nullcontext()
    )

    times, losses = [], []
    with scope:
        for s in range(spec["steps"]):
            meter = SavedBytesMeter(model, dict(enumerate(layers))) if s == 0 else None
            t0 = time.perf_counter()
            losses.append(train_step(model, optimizer, batches[s], meter))
            times.append(time.perf_counter() - t0)
            if meter is not None:
                saved = meter.summary()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        model.eval()
        for module in model.modules():
            # bitsandbytes repacks a 4-bit weight in place for its CPU inference kernel when called
            # in eval mode without grad; kept in training mode it computes what training computes.
            if type(module).__name__ == "Linear4bit":
                module.train()
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            val_losses = [float(model(input_ids=val[i]["input_ids"][None], labels=val[i]["input_ids"][None]).loss) for i in range(len(val))]
        model.train()
        at_start = state_bytes(model, optimizer)
        peak, _ = step_peak(model, optimizer, batches[spec["steps"]])
    per_layer = {k: sum(v.values()) for k, v in saved["layers"].items()}
    timed = times[spec["warmup"] :] or times
    return {
        "variant": spec["variant"],
        "seed": spec["seed"],
        "saved_bytes_per_layer": per_layer,
        "saved_bytes_outside_layers": sum(saved["outside"].values()) + saved["shared"],
        "peak_tensor_bytes": peak,
        "tensor_bytes_at_step_start": at_start,
        "peak_rss_bytes": rss,
        "step_s": statistics.median(timed),
        "step_times_s": times,
        "train_loss": statistics.mean(losses[-LAST_LOSSES:]),
        "val_loss": statistics.mean(val_losses),
        "trainable_parameters": sum(p.numel() for p in params),
    }


def _child_main(spec_path: str, out_path: str) -> None:
    child_main(run_one, spec_path, out_path)


# ---- the invocation --------------------------------------------------------------------------------


def _spawn(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    name = f"{spec['variant']}_{spec['seed']}"
    result = spawn("benchmarks.lora", spec, tmp, name)
    if "error" in result:
        if spec["variant"] in MAY_FAIL:
            return {"variant": spec["variant"], "seed": spec["seed"], "error": result["error"]}
        raise SystemExit(f"{name} failed:\n{result['stderr']}")
    return result


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _ratios(rows: dict[str, Any], runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, float]:
    layer = lambda r: statistics.mean(r["saved_bytes_per_layer"].values())  # noqa: E731
    return {
        "saved_bytes_per_layer": layer(rows[a]) / layer(rows[b]),
        "peak_tensor_bytes": rows[a]["peak_tensor_bytes"] / rows[b]["peak_tensor_bytes"],
        "peak_rss_bytes": rows[a]["peak_rss_bytes"] / rows[b]["peak_rss_bytes"],
        "step_time": same_round_ratio([r["step_s"] for r in runs[a]], [r["step_s"] for r in runs[b]]),
        "val_loss": rows[a]["val_loss"] / rows[b]["val_loss"],
    }


def run(args: argparse.Namespace) -> int:
    from agoq.data.tokens import prepare_data
    from benchmarks._common import write_result

    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = str(tmp / "cache")
        prepare_data(vocab_size=args.vocab_size, cache=cache)  # the tokenizer trained once, read by every run
        base = {
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab_size": args.vocab_size,
            "lr": args.lr,
            "eval_windows": args.eval_windows,
            "cache": cache,
        }
        notes: dict[str, str] = {}
        for r in range(args.rounds):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                if v in notes:
                    continue
                result = _spawn({**base, "variant": v, "seed": r}, tmp)
                if "error" in result:
                    notes[v] = result["error"]
                    print(f"round {r} {v}: failed, a note from now on: {result['error']}", flush=True)
                    continue
                runs[v].append(result)
                print(f"round {r} {v}: step {result['step_s']:.3f} s, val loss {result['val_loss']:.4f}", flush=True)
    rows: dict[str, Any] = {}
    for v, rs in runs.items():
        if v in notes:
            rows[v] = {"what": WHAT[v], "note": f"not measured: it fails here with {notes[v]}"}
            runs[v] = []
            continue
        first = rs[0]
        row = {
            "what": WHAT[v],
            "saved_bytes_per_layer": first["saved_bytes_per_layer"],
            "saved_bytes_outside_layers": first["saved_bytes_outside_layers"],
            "peak_tensor_bytes": max(r["peak_tensor_bytes"] for r in rs),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
            "step_s": statistics.median(r["step_s"] for r in rs),
            "trainable_parameters": first["trainable_parameters"],
        }
        for key in ("train_loss", "val_loss"):
            row[key], row[f"{key}_std"] = _mean_std([r[key] for r in rs])
        rows[v] = row
    ratios = {}
    compared = (
        ("agoq_lora", "lora"),
        ("agoq_qlora", "qlora"),
        ("agoq_lora", "lora_ckpt"),
        ("agoq_lora_ckpt", "lora_ckpt"),
        ("agoq_lora_ckpt8", "lora_ckpt"),
    )
    for a, b in compared:
        if "note" not in rows.get(a, {"note": ""}) and "note" not in rows.get(b, {"note": ""}):
            ratios[f"{a}/{b}"] = _ratios(rows, runs, a, b)
    results = {
        "model": {k: base[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab_size")},
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "eval_windows": args.eval_windows,
        "lora": {**LORA, "targets": list(example().TARGETS)},
        "peak_tensor_source": "torch.profiler profile_memory over one training step, plus parameters, buffers and optimizer state at its start",
        "rows": rows,
        "runs": runs,
        "ratios": ratios,
    }
    # Another model width is another result file (lora_hidden<H>.json), as convergence does per preset.
    name = "lora" if args.hidden == DEFAULT_HIDDEN else f"lora_hidden{args.hidden}"
    path = write_result(name, results, command=command_line("lora", getattr(args, "argv", None)), out_dir=args.out_dir)
    print(readme_markdown(results))
    print(f"\nwritten: {path}")
    return 0


def readme_markdown(results: dict[str, Any]) -> str:
    """The results table: one row per variant, then the ratio rows."""
    rows, n = results["rows"], results["rounds"]
    lines = [
        f"| variant | saved / layer (KiB) | peak tensors (MiB) | peak RSS (MiB) | step (s, median of {n} rounds) | train loss | val loss ({n} seeds) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        if v not in rows:
            continue
        r = rows[v]
        if "note" in r:
            lines.append(f"| {v} ({r['what']}) | {r['note']} | | | | | |")
            continue
        per_layer = statistics.mean(r["saved_bytes_per_layer"].values()) / 1024
        lines.append(
            f"| {v} ({r['what']}) | {per_layer:.0f} | {r['peak_tensor_bytes'] / 2**20:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} "
            f"| {r['step_s']:.3f} | {r['train_loss']:.3f} | {r['val_loss']:.4f} ± {r['val_loss_std']:.4f} |"
        )
    for name, q in results["ratios"].items():
        # Each round's own ratio too: with few rounds one loaded round moves the median a lot.
        a, b = name.split("/")
        per_round = ", ".join(f"{x['step_s'] / y['step_s']:.2f}" for x, y in zip(results["runs"][a], results["runs"][b]))
        lines.append(
            f"| {name.replace('/', ' / ')} | {q['saved_bytes_per_layer']:.3f}x | {q['peak_tensor_bytes']:.3f}x | {q['peak_rss_bytes']:.3f}x "
            f"| {q['step_time']:.2f}x (rounds: {per_round}) | | {q['val_loss']:.4f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the command this file records, not the caller's
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
