"""Fine-tuning at a user's scale: a llama3.2-1b-shaped model, full fine-tune and LoRA at 2,048 and
8,192 tokens, agoq against plain training and activation checkpointing, each measured peak beside
the planner's (``agoq plan --hf-config``).

The model is Llama-3.2-1B's shape (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim
64, vocabulary 128,256, tied embeddings) built from a ``LlamaConfig`` (seeded random weights, fp32,
nothing downloaded), with 2 decoder layers by default instead of 16 (``--layers``): per layer the
bytes are the real model's; the embedding, head and loss over 128,256 tokens are all there. Modes:
``full`` (every weight trains) and ``lora`` (PEFT LoRA r=8, alpha 16, dropout 0.05 on all seven
projections, as ``benchmarks/lora.py``). Variants, by the planner's names:

- ``plain``: transformers (and PEFT) as they are;
- ``ac``: transformers' activation checkpointing of every decoder layer (non-reentrant);
- ``agoq``: ``apply_agoq``;
- ``agoq_ac``: both;
- ``agoq_ckpt8``: ``apply_agoq(checkpoint_format="int8/128")``, every layer's input kept at 8 bits;
- ``qlora``, ``agoq_qlora``: the base projections in bitsandbytes nf4, without and with agoq (LoRA
  mode only: a full fine-tune has no adapters to put over 4-bit weights).

Data: the bundled KJV text through a byte-level BPE of ``--text-vocab`` tokens (8192). A BPE of
128,256 tokens cannot be learned from 4 MB of text, so the ids fall in the vocabulary's first 8192
rows; the head, the logits and the loss still span all 128,256 (the memory and the work are the full
vocabulary's). One sequence per step (micro-batch 1), windows in a seeded order.

Each run is its own process (its RSS is its own): steps 1..N (``--steps``; the first ``--warmup``
untimed, the first one's forward under agoq's saved-tensor meter for the saved bytes per layer),
then step N+1 under ``torch.profiler``. Its peak of live tensors (what is alive at its start:
parameters, buffers, optimizer state, plus the largest rise of allocated bytes during it) is the
measured peak, taken as tests/test_plan_finetune.py holds the planner to it (both through
benchmarks/_finetune.py): fused AdamW, the Trainer's default, and the loss dropped before the
optimizer steps. Its loss, on a window no step trained on, is the loss after N steps. Peak RSS
(``ru_maxrss``) is read before it. The plan is ``agoq.plan.finetune.plan_variant`` for the same
model and tokens, fp32, on a CPU. Round i runs every variant of each mode and context once, seed i,
in an order rotated by i; step-time ratios against ``plain`` are the median over rounds of each
round's own ratio.

A run that fails (bitsandbytes missing, an error, the kernel's OOM killer) is a row with its error.
A run whose planned peak plus 1 GiB exceeds the memory available when it would start is not
started, and its row says so: the OOM killer may pick another process than the one that overran
(``--no-memory-check`` starts every run).

Cost: fp32 steps at a 128K vocabulary are slow on a CPU. On a shared 2-core AVX2 machine one plain
LoRA step at 2,048 tokens took 44 s and building the model 19 s; a step at 8,192 tokens is about
five times that (four times the GEMMs, and attention's quadratic part), a full fine-tune's about
1.5 times LoRA's. So the defaults are 3 steps (1 of warm-up) and 1 round, and the whole default
invocation, 24 runs of 4 steps each, takes hours there (about 3 to 5); ``--modes``, ``--seq-lens``
and ``--variants`` pick a part. The result file is named by the contexts run
(``finetune_scale_8192.json`` for ``--seq-lens 8192``), so each context is committed with the
command that measured it.
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
from benchmarks._finetune import (
    LORA,
    build_model,
    child_main,
    decoder_layers,
    example,
    plan_build_options,
    spawn,
    step_peak,
    train_step,
    trainer_optimizer,
)

DESCRIPTION = "Fine-tuning a llama3.2-1b-shaped model, full and LoRA at 2K/8K tokens: agoq against checkpointing, measured beside the plan"
MODES = ("full", "lora")
VARIANTS = ("plain", "ac", "agoq", "agoq_ac", "agoq_ckpt8", "qlora", "agoq_qlora")
QLORA = ("qlora", "agoq_qlora")
WHAT = {
    "plain": "transformers / PEFT as they are",
    "ac": "activation checkpointing, every layer",
    "agoq": "apply_agoq",
    "agoq_ac": "apply_agoq + activation checkpointing",
    "agoq_ckpt8": "apply_agoq, checkpoints at int8/128",
    "qlora": "QLoRA (nf4 base)",
    "agoq_qlora": "apply_agoq on QLoRA",
}
# Pairs compared per mode and context (bytes, and each round's step times); the first is the README's.
COMPARED = (("agoq", "ac"), ("agoq_ckpt8", "ac"), ("agoq", "plain"), ("agoq_ckpt8", "plain"), ("agoq_qlora", "qlora"))
HEADROOM = 2**30  # beyond the planned tensors: the libraries' own memory (a run's RSS before its first step)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=128256, help="the model's vocabulary (its embedding, head and loss)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3.2-1B has 16)")
    parser.add_argument("--seq-lens", default="2048,8192", help="comma-separated tokens per step (one sequence each)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run before the profiled one (the warm-up included)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of its step time")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every run; round i uses seed i")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--text-vocab", type=int, default=8192, help="the BPE the text is tokenized with (at most --vocab-size)")
    parser.add_argument("--quant-backend", default=None, help="agoq's quantization backend in the runs (default: AGOQ_QUANT_BACKEND, else auto)")
    parser.add_argument("--no-memory-check", action="store_true", help="start a run even where its planned peak exceeds the memory available")
    add_out_dir(parser)


def _csv(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    unknown = sorted(set(values) - set(allowed))
    if unknown or not values:
        raise SystemExit(f"{option}: unknown {', '.join(unknown) or '(none given)'}; choose from {','.join(allowed)}")
    return values


def _llama_config(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"],
        "tie_word_embeddings": True,
        "max_position_embeddings": spec["seq_len"],
    }


def _shape(spec: dict[str, Any]) -> Any:
    """The model as the planner reads a config.json (agoq.plan.finetune.HFModel)."""
    from agoq.plan.finetune import HFModel

    return HFModel(
        model_type="llama",
        hidden=spec["hidden"],
        intermediate=spec["intermediate"],
        n_layers=spec["layers"],
        n_heads=spec["heads"],
        n_kv_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        vocab=spec["vocab_size"],
        tie_embeddings=True,
        qkv_bias=False,
        qk_norm=False,
        name="llama3.2-1b shape",
    )


def fine_tune(spec: dict[str, Any]) -> Any:
    """One run as the planner describes it (agoq.plan.finetune.FineTune): the same model and tokens, fp32, on a CPU."""
    from agoq.plan.finetune import FineTune

    lora = spec["mode"] == "lora"
    return FineTune(
        _shape(spec),
        spec["seq_len"],
        1,
        "fp32",
        lora_r=LORA["r"] if lora else 0,
        lora_dropout=LORA["dropout"],
        qlora=spec["variant"] in QLORA,
        device="cpu",
    )


def plan(spec: dict[str, Any]) -> Any:
    """The planner's VariantPlan for one run."""
    from agoq.plan.finetune import plan_variant

    variant = {"qlora": "plain", "agoq_qlora": "agoq"}.get(spec["variant"], spec["variant"])
    return plan_variant(fine_tune(spec), variant)


# ---- one run (in its own process) ----------------------------------------------------------------


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one variant for ``spec['steps']`` steps in this process, then profile one more; its figures."""
    import torch

    from agoq.activation.meter import SavedBytesMeter
    from agoq.quant.backend import resolve, use_backend
    from agoq.data.tokens import prepare_data

    data = prepare_data(vocab_size=spec["text_vocab"], cache=spec["cache"])
    windows = example().Windows(data.train, spec["seq_len"])
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(spec["seed"]))
    batches = [windows[int(i)]["input_ids"][None] for i in order[: spec["steps"] + 1]]
    with use_backend(spec["quant_backend"]):
        with tempfile.TemporaryDirectory() as tmp_name:
            model = build_model(
                _llama_config(spec), seed=spec["seed"], tmp=Path(tmp_name), lora=spec["mode"] == "lora", **plan_build_options(spec["variant"])
            )
        optimizer = trainer_optimizer(model, spec["lr"])
        layers = decoder_layers(model)
        times, losses = [], []
        for s in range(spec["steps"]):
            meter = SavedBytesMeter(model, dict(enumerate(layers))) if s == 0 else None
            t0 = time.perf_counter()
            losses.append(train_step(model, optimizer, batches[s], meter))
            times.append(time.perf_counter() - t0)
            if meter is not None:
                saved = meter.summary()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peak, loss_after = step_peak(model, optimizer, batches[spec["steps"]])
        backend = resolve("cpu")
    timed = times[spec["warmup"] :] or times
    return {
        "mode": spec["mode"],
        "seq_len": spec["seq_len"],
        "variant": spec["variant"],
        "seed": spec["seed"],
        "peak_tensor_bytes": peak,
        "peak_rss_bytes": rss,
        "saved_bytes_per_layer": {k: sum(v.values()) for k, v in saved["layers"].items()},
        "saved_bytes_outside_layers": sum(saved["outside"].values()) + saved["shared"],
        "step_s": statistics.median(timed),
        "step_times_s": times,
        "train_losses": losses,
        "loss_after_steps": loss_after,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "quant_backend": backend,
    }


def _child_main(spec_path: str, out_path: str) -> None:
    child_main(run_one, spec_path, out_path)


# ---- the invocation --------------------------------------------------------------------------------


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _row(spec: dict[str, Any], runs: list[dict[str, Any]], note: str | None) -> dict[str, Any]:
    """One row of the table: the plan beside what the rounds measured (their worst peaks, median step, mean loss), or the note."""
    p = plan(spec)
    row: dict[str, Any] = {
        "mode": spec["mode"],
        "seq_len": spec["seq_len"],
        "variant": spec["variant"],
        "what": WHAT[spec["variant"]],
        "planned_peak_bytes": p.peak,
        "planned_phase": p.phase,
        "planned_components": p.components,
    }
    if note is not None:
        return {**row, "note": note}
    first = runs[0]
    peak = max(r["peak_tensor_bytes"] for r in runs)
    losses = [r["loss_after_steps"] for r in runs]
    return {
        **row,
        "peak_tensor_bytes": peak,
        "planned_over_measured": p.peak / peak,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "saved_bytes_per_layer": first["saved_bytes_per_layer"],
        "saved_bytes_outside_layers": first["saved_bytes_outside_layers"],
        "step_s": statistics.median(r["step_s"] for r in runs),
        "loss_after_steps": statistics.mean(losses),
        "loss_after_steps_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "first_loss": statistics.mean(r["train_losses"][0] for r in runs),
        "trainable_parameters": first["trainable_parameters"],
        "quant_backend": first["quant_backend"],
    }


def _layer_mean(row: dict[str, Any]) -> float:
    return statistics.mean(row["saved_bytes_per_layer"].values())


Key = tuple[str, int, str]  # mode, tokens, variant


def _measure_all(args: argparse.Namespace, groups: list[tuple[str, int, list[str]]], base: dict[str, Any]) -> tuple[dict[Key, list], dict[Key, str]]:
    """(each run's results by mode, tokens and variant; a note for each that was not run or failed)."""
    from agoq.data.tokens import prepare_data

    runs: dict[Key, list[dict[str, Any]]] = {(m, s, v): [] for m, s, vs in groups for v in vs}
    notes: dict[Key, str] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = {**base, "cache": str(tmp / "cache")}
        prepare_data(vocab_size=base["text_vocab"], cache=base["cache"])  # the tokenizer trained once, read by every run
        for r in range(args.rounds):
            for mode, seq, vs in groups:
                for v in vs[r % len(vs) :] + vs[: r % len(vs)]:
                    key = (mode, seq, v)
                    if key in notes:
                        continue
                    spec = {**base, "mode": mode, "seq_len": seq, "variant": v, "seed": r}
                    planned, available = plan(spec).peak, _available_bytes()
                    if not args.no_memory_check and available is not None and planned + HEADROOM > available:
                        notes[key] = f"not run: planned {planned / 2**30:.1f} GiB + 1 GiB exceeds the {available / 2**30:.1f} GiB available"
                        print(f"round {r} {mode} {seq} {v}: {notes[key]}", flush=True)
                        continue
                    t0 = time.perf_counter()
                    result = spawn("benchmarks.finetune_scale", spec, tmp, f"{mode}_{seq}_{v}_{r}")
                    if "error" in result:
                        notes[key] = f"failed: {result['error']}"
                        print(f"round {r} {mode} {seq} {v}: {notes[key]}\n{result['stderr']}", flush=True)
                        continue
                    runs[key].append(result)
                    print(
                        f"round {r} {mode} {seq} {v}: peak {result['peak_tensor_bytes'] / 2**30:.2f} GiB (planned {planned / 2**30:.2f}), "
                        f"step {result['step_s']:.1f} s, loss {result['loss_after_steps']:.3f} ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
    return runs, notes


def _step_times(runs: dict[Key, list[dict[str, Any]]], mode: str, seq: int, variant: str) -> list[float]:
    return [r["step_s"] for r in runs[(mode, seq, variant)]]


def _comparisons(groups: list[tuple[str, int, list[str]]], rows: dict[Key, dict[str, Any]], runs: dict[Key, list]) -> dict[str, dict[str, float]]:
    """Each pair of COMPARED measured in a mode and context: the ratios of its figures."""
    ratios = {}
    for mode, seq, _ in groups:
        for a, b in COMPARED:
            ra, rb = rows.get((mode, seq, a), {"note": ""}), rows.get((mode, seq, b), {"note": ""})
            if "note" in ra or "note" in rb:
                continue
            ratios[f"{mode}/{seq}/{a}/{b}"] = {
                "peak_tensor_bytes": ra["peak_tensor_bytes"] / rb["peak_tensor_bytes"],
                "planned_peak_bytes": ra["planned_peak_bytes"] / rb["planned_peak_bytes"],
                "peak_rss_bytes": ra["peak_rss_bytes"] / rb["peak_rss_bytes"],
                "saved_bytes_per_layer": _layer_mean(ra) / _layer_mean(rb),
                "step_time": same_round_ratio(_step_times(runs, mode, seq, a), _step_times(runs, mode, seq, b)),
                "loss_after_steps": ra["loss_after_steps"] / rb["loss_after_steps"],
            }
    return ratios


def result_name(seq_lens: list[int]) -> str:
    """The result file of an invocation, by its contexts (finetune_scale_2048.json, finetune_scale_2048_8192.json):
    one context is an invocation of its own on a 2-core machine, and each file keeps the command that made it."""
    return "finetune_scale_" + "_".join(str(s) for s in seq_lens)


def run(args: argparse.Namespace) -> int:
    from benchmarks._common import write_result

    modes = _csv(args.modes, MODES, "--modes")
    variants = _csv(args.variants, VARIANTS, "--variants")
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    from agoq.quant.backend import BACKENDS

    if args.quant_backend is not None and args.quant_backend not in BACKENDS:
        raise SystemExit(f"--quant-backend {args.quant_backend!r} is unknown; choose from {', '.join(BACKENDS)}")
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: a run needs at least one step before the profiled one")
    if args.text_vocab > args.vocab_size:
        raise SystemExit(f"--text-vocab {args.text_vocab} is above --vocab-size {args.vocab_size}: the token ids must index the model's vocabulary")
    groups = [(m, s, [v for v in variants if m == "lora" or v not in QLORA]) for m in modes for s in seq_lens]
    model = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab_size")}
    base = {**model, "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "text_vocab": args.text_vocab, "quant_backend": args.quant_backend}
    runs, notes = _measure_all(args, groups, base)
    rows = {key: _row({**model, "mode": key[0], "seq_len": key[1], "variant": key[2]}, rs, notes.get(key)) for key, rs in runs.items()}
    for (mode, seq, v), row in rows.items():
        if "note" not in row and "note" not in rows.get((mode, seq, "plain"), {"note": ""}):
            row["step_time_vs_plain"] = same_round_ratio(_step_times(runs, mode, seq, v), _step_times(runs, mode, seq, "plain"))
    results = {
        "model": {**model, "tie_word_embeddings": True, "parameters": _shape(model).parameters()},
        "modes": modes,
        "seq_lens": seq_lens,
        "variants": variants,
        "micro_batch": 1,
        "dtype": "fp32",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "lr": args.lr,
        "optimizer": "AdamW (fused)",
        "text_vocab": args.text_vocab,
        "lora": {**LORA, "targets": list(example().TARGETS)},
        "peak_tensor_source": "torch.profiler profile_memory over training step steps+1, plus parameters, buffers and optimizer state at its start",
        "rows": list(rows.values()),
        "runs": [r for rs in runs.values() for r in rs],
        "ratios": _comparisons(groups, rows, runs),
    }
    path = write_result(result_name(seq_lens), results, command=command_line("finetune_scale", getattr(args, "argv", None)), out_dir=args.out_dir)
    print(readme_markdown(results))
    print(f"\nwritten: {path}")
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}" if n >= 2**28 else f"{n / 2**30:.4f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}" if n >= 2**20 else f"{n / 2**20:.3f}"


def _backend(results: dict[str, Any]) -> str:
    names = sorted({r["quant_backend"] for r in results["rows"] if "quant_backend" in r and r["variant"].startswith("agoq")})
    return "/".join(names) or "(no agoq run)"


def replanned(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with each row's plan made again by today's planner, and the ratios' planned peaks
    with it: the docs hold the planner as it is to the measurements as they were."""
    rows = []
    for r in results["rows"]:
        p = plan({**results["model"], "mode": r["mode"], "seq_len": r["seq_len"], "variant": r["variant"]})
        row = {**r, "planned_peak_bytes": p.peak, "planned_phase": p.phase, "planned_components": p.components}
        if "note" not in r:
            row["planned_over_measured"] = p.peak / r["peak_tensor_bytes"]
        rows.append(row)
    by_key = {(r["mode"], r["seq_len"], r["variant"]): r for r in rows}
    ratios = {}
    for name, q in results["ratios"].items():
        mode, seq, a, b = name.split("/")
        ratios[name] = {
            **q,
            "planned_peak_bytes": by_key[(mode, int(seq), a)]["planned_peak_bytes"] / by_key[(mode, int(seq), b)]["planned_peak_bytes"],
        }
    return {**results, "rows": rows, "ratios": ratios}


def readme_markdown(results: dict[str, Any]) -> str:
    """The results table (one row per mode, context and variant), then agoq against checkpointing."""
    results = replanned(results)
    m, n = results["model"], results["steps"]
    head = (
        f"Llama-3.2-1B's shape with {m['layers']} decoder layers ({m['parameters'] / 1e6:.0f} M parameters, vocabulary {m['vocab_size']:,}), "
        f"fp32, one sequence per step, {results['rounds']} round(s), agoq's quantization backend {_backend(results)}; "
        "peaks and RSS in GiB, saved bytes per decoder layer in MiB; planned: `agoq plan --hf-config`'s model of the same step, by today's planner."
    )
    lines = [
        head,
        "",
        f"| mode | tokens | variant | peak tensors | planned peak | planned / measured | peak RSS | saved / layer | step (s) | step vs plain | loss after {n} steps |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        cells = [r["mode"], f"{r['seq_len']:,}", f"{r['variant']} ({r['what']})"]
        if "note" in r:
            lines.append("| " + " | ".join([*cells, r["note"], _gib(r["planned_peak_bytes"]), "", "", "", "", "", ""]) + " |")
            continue
        vs_plain = r.get("step_time_vs_plain")
        cells += [
            _gib(r["peak_tensor_bytes"]),
            _gib(r["planned_peak_bytes"]),
            f"{r['planned_over_measured']:.3f}",
            _gib(r["peak_rss_bytes"]),
            _mib(_layer_mean(r)),
            f"{r['step_s']:.2f}",
            "" if vs_plain is None else f"{vs_plain:.2f}x",
            f"{r['loss_after_steps']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if results["ratios"]:
        lines += [
            "",
            "| mode | tokens | compared | peak tensors | planned peak | peak RSS | saved / layer | step time | loss |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, q in results["ratios"].items():
            mode, seq, a, b = name.split("/")
            lines.append(
                f"| {mode} | {int(seq):,} | {a} / {b} | {q['peak_tensor_bytes']:.3f}x | {q['planned_peak_bytes']:.3f}x | {q['peak_rss_bytes']:.3f}x "
                f"| {q['saved_bytes_per_layer']:.3f}x | {q['step_time']:.2f}x | {q['loss_after_steps']:.4f}x |"
            )
    return "\n".join(lines)


def _recorded_ratio(results: dict[str, Any], mode: str, seq: int, a: str, b: str) -> float:
    """The step-time ratio of ``a`` to ``b`` from a result file's runs, round by round."""
    runs: dict[Key, list[dict[str, Any]]] = {}
    for r in sorted(results["runs"], key=lambda r: r["seed"]):
        runs.setdefault((r["mode"], r["seq_len"], r["variant"]), []).append(r)
    return same_round_ratio(_step_times(runs, mode, seq, a), _step_times(runs, mode, seq, b))


# The README's columns: checkpointing, then agoq with it.
AGAINST_CHECKPOINTING = {"ac": "checkpointing", "agoq_ac": "agoq + checkpointing", "agoq_ckpt8": "agoq, int8 checkpoints"}


def against_checkpointing_markdown(results: dict[str, Any]) -> str:
    """The README's row: for each mode at the longest context, the peak and step of checkpointing
    against agoq with checkpointing and agoq with int8 checkpoints (rows that did not run are left out)."""
    seq = max(results["seq_lens"])
    rows = {(r["mode"], r["variant"]): r for r in results["rows"] if r["seq_len"] == seq and "note" not in r}
    m = results["model"]
    lines = [
        f"Fine-tuning Llama-3.2-1B's shape ({m['layers']} of its 16 layers, vocabulary {m['vocab_size']:,}), one sequence of {seq:,} tokens, "
        "fp32: agoq against transformers' activation checkpointing of every layer.",
        "",
        f"| {seq:,} tokens | " + " | ".join(AGAINST_CHECKPOINTING.values()) + " |",
        "|---|" + "---:|" * len(AGAINST_CHECKPOINTING),
    ]
    for mode in results["modes"]:
        ac = rows.get((mode, "ac"))
        if ac is None:
            continue
        mode_name = "LoRA" if mode == "lora" else "full fine-tune"
        peak, step = [f"{mode_name}: peak tensors (GiB)"], [f"{mode_name}: step time (s)"]
        for v in AGAINST_CHECKPOINTING:
            r = rows.get((mode, v))
            if r is None:
                peak.append("not run")
                step.append("")
                continue
            same = v == "ac"
            peak.append(_gib(r["peak_tensor_bytes"]) + ("" if same else f" ({r['peak_tensor_bytes'] / ac['peak_tensor_bytes']:.2f}x)"))
            step.append(f"{r['step_s']:.1f}" + ("" if same else f" ({_recorded_ratio(results, mode, seq, v, 'ac'):.2f}x)"))
        lines += ["| " + " | ".join(peak) + " |", "| " + " | ".join(step) + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.finetune_scale", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the command this file records, not the caller's
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
