"""A Hugging Face LlamaForCausalLM under ``torch.compile(model, fullgraph=True)``: unpatched against
patched by ``apply_agoq``, both compiled (and both eager, for reference), taking turns step by step
in one process. Each step is forward + backward + AdamW on the same batch; the step time is the
median of the timed steps after the warm-up steps (which hold the compiles). Graph breaks of the
loss forward come from ``torch._dynamo.explain``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "HF Llama under torch.compile(fullgraph=True): patched by agoq against unpatched, step time and graph breaks"
VARIANTS = ("unpatched eager", "agoq eager", "unpatched compiled", "agoq compiled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and run sizes."""
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (they hold the compiles)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    add_out_dir(parser)


def _model(args: argparse.Namespace, patched: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agoq import apply_agoq

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=4096,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(cfg)
    if patched:
        apply_agoq(model)
    return model


def _breaks(model: Any, ids: Any) -> tuple[int, int]:
    """(graphs, graph breaks) of the loss forward under Dynamo."""
    import torch

    explained = torch._dynamo.explain(lambda i: model(input_ids=i, labels=i).loss)(ids)
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count


def run(args: argparse.Namespace) -> int:
    """Build the four variants, take turns step by step, write hf_compile.json."""
    import torch

    from benchmarks._common import write_result

    torch.manual_seed(0)
    ids = torch.randint(0, 4096, (args.batch_size, args.seq_len))
    graphs = {name: _breaks(_model(args, name.startswith("agoq")), ids) for name in ("unpatched", "agoq")}
    runs = {}
    for name in VARIANTS:
        model = _model(args, name.startswith("agoq"))
        step_of = torch.compile(model, fullgraph=True) if name.endswith("compiled") else model
        runs[name] = (model, step_of, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(name: str) -> tuple[float, float]:
        model, fn, opt = runs[name]
        t0 = time.perf_counter()
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(loss.detach())

    for _ in range(args.warmup):
        for name in VARIANTS:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, float] = {}
    for _ in range(args.steps):
        for name in VARIANTS:
            t, losses[name] = step(name)
            times[name].append(t)
    rows = [{"variant": name, "median_step_s": statistics.median(times[name]), "last_loss": losses[name]} for name in VARIANTS]
    by = {r["variant"]: r["median_step_s"] for r in rows}
    results = {
        "model": f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, vocab 4096, fp32",
        "batch": [args.batch_size, args.seq_len],
        "steps": args.steps,
        "warmup": args.warmup,
        "graphs": {k: {"graphs": g, "breaks": b} for k, (g, b) in graphs.items()},
        "rows": rows,
        "ratios": {
            "agoq_compiled_over_unpatched_compiled": by["agoq compiled"] / by["unpatched compiled"],
            "agoq_eager_over_unpatched_eager": by["agoq eager"] / by["unpatched eager"],
        },
    }
    write_result("hf_compile", results, out_dir=args.out_dir)
    print(readme_markdown(results))
    return 0


def readme_markdown(results: dict[str, Any]) -> str:
    """One row per variant, the graph counts and the ratios."""
    g = results["graphs"]
    lines = [
        f"{results['model']}, batch {results['batch'][0]} x {results['batch'][1]}, median of {results['steps']} steps per variant "
        f"after {results['warmup']} warm-up steps, the variants taking turns step by step. Loss forward under Dynamo: unpatched "
        f"{g['unpatched']['graphs']} graph / {g['unpatched']['breaks']} breaks, patched {g['agoq']['graphs']} graph / {g['agoq']['breaks']} breaks.",
        "",
        "| variant | s / step | loss after the steps |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['variant']} | {r['median_step_s']:.4f} | {r['last_loss']:.4f} |" for r in results["rows"]]
    q = results["ratios"]
    lines.append(f"| agoq / unpatched, compiled | {q['agoq_compiled_over_unpatched_compiled']:.2f}x | |")
    lines.append(f"| agoq / unpatched, eager | {q['agoq_eager_over_unpatched_eager']:.2f}x | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.hf_compile``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_compile", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
