"""The planner's per-GPU peaks beside the memory the AGoQ paper measured, with every difference decomposed.

The paper (arXiv 2605.00539) measured peak memory per GPU on A6000s for LLaMA2-13B (TP=8, PP=1,
seq 12K) under Megatron-LM and its own system, and for LLaMA3-8B variants at 32K (36 layers) and
64K (16 layers). The planner is run on the same configurations (micro-batch 1, dp 1, TP=8 with
sequence parallelism, PP=1 for all three: the 8B runs' layout is our assumption). Each difference
is split into its known parts: the per-layer saved activations (the planner's accounting, which
the tests check against the trainer's measurements, vs the paper's Table 1: 28U / 7.75U), the LM
head's fp32 log-softmax that the paper's system keeps and agoq's fused loss does not, and what
remains. "Paper's accounting" re-adds them to the planner's peak, and, where the paper measured
the 8-bit optimizer with and without 8-bit gradients, the gradient memory its system kept beyond
an int8 buffer.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "agoq plan's per-GPU peaks beside the paper's measurements (LLaMA2-13B 12K, LLaMA3-8B 32K/64K), differences explained"

# Paper Table 1 per decoder layer, in U = batch x seq x hidden x 2 bytes.
PAPER_LAYER_U = {"baseline": 28.0, "agoq": 7.75}
# (case, model, model fields, seq, {configuration: paper GB})
CASES = [
    ("LLaMA2-13B, TP=8, PP=1, seq 12K", "llama2-13b", {}, 12288, {"baseline": 46.1, "O": 37.7, "G+O": 35.3, "A+G+O": 22.3}),
    ("LLaMA3-8B (36 layers), seq 32K", "llama3-8b", {"n_layers": 36}, 32768, {"baseline": 48.6, "A+G+O": 16.6}),
    ("LLaMA3-8B (16 layers), seq 64K", "llama3-8b", {"n_layers": 16}, 65536, {"baseline": 46.7, "A+G+O": 19.3}),
]
LABELS = {
    "baseline": "Megatron-LM (bf16 baseline)",
    "O": "8-bit optimizer only",
    "G+O": "8-bit gradients + optimizer",
    "A+G+O": "AGoQ (A+G+O)",
}
GiB = 2**30
THRESHOLD = 0.10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.plan_vs_paper``."""
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel size assumed for every case (default 8)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of markdown")
    add_out_dir(parser)


def compare(tp: int = 8) -> dict[str, Any]:
    """Planner peaks, the paper's, and the decomposition of their difference, per case and configuration."""
    import torch

    from agoq.activation.accounting import U_bytes
    from agoq.activation.loss import loss_saved_bytes
    from agoq.plan import make_plan_config, plan_memory

    rows, layers_u = [], []
    for case, model, fields, seq, paper in CASES:
        cfg = make_plan_config(model, fields, seq_len=seq, tp=tp, setups=tuple(paper))
        plan = plan_memory(cfg)
        m = cfg.model
        unit_tp = U_bytes(1, seq, m.hidden) / tp
        tokens_tp = seq // tp
        layers_u.append(
            {
                "case": case,
                "baseline_U": plan.layer_units["baseline"],
                "agoq_U": plan.layer_units["A"],
                "paper_baseline_U": PAPER_LAYER_U["baseline"],
                "paper_agoq_U": PAPER_LAYER_U["agoq"],
            }
        )
        for name, paper_gb in paper.items():
            sp = plan.get(name)
            act = sp.setup.activations
            ours_u = plan.layer_units["A" if act else "baseline"]
            layer_delta = m.n_layers * (PAPER_LAYER_U["agoq" if act else "baseline"] - ours_u) * unit_tp
            # The paper's system keeps Megatron's loss: an fp32 log-softmax of [tokens, vocab / tp].
            loss_delta = (
                (
                    loss_saved_bytes(tokens_tp, m.hidden, m.vocab_size, torch.bfloat16, False)
                    - loss_saved_bytes(tokens_tp, m.hidden, m.vocab_size, torch.bfloat16, True, recompute=True)
                )
                if act
                else 0
            )
            planner = sp.peak
            paper_bytes = paper_gb * GiB
            rebuilt = planner + layer_delta + loss_delta
            rows.append(
                {
                    "case": case,
                    "configuration": name,
                    "label": LABELS[name],
                    "paper_gib": paper_gb,
                    "planner_gib": round(planner / GiB, 2),
                    "difference": round(planner / paper_bytes - 1, 4),
                    "layer_accounting_gib": round(layer_delta / GiB, 2),
                    "fused_loss_gib": round(loss_delta / GiB, 2),
                    "paper_accounting_gib": round(rebuilt / GiB, 2),
                    "residual": round(rebuilt / paper_bytes - 1, 4),
                    "breakdown_gib": {k: round(v / GiB, 2) for k, v in sp.ranks[0].to_dict()["bytes"].items()},  # type: ignore[union-attr]
                }
            )
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = {r["configuration"]: r for r in rows if r["case"] == case}
        if "O" in mine and "G+O" in mine:
            # What 8-bit gradients saved, measured by the paper (O -> G+O) and in the planner (fp32 -> int8 buffer):
            # the difference is gradient-path memory the paper's system kept and the planner does not model.
            paper_g = mine["O"]["paper_gib"] - mine["G+O"]["paper_gib"]
            planner_g = mine["O"]["planner_gib"] - mine["G+O"]["planner_gib"]
            for r in mine.values():
                if "G" in r["configuration"].split("+"):
                    r["gradient_path_gib"] = round(planner_g - paper_g, 2)
                    r["paper_accounting_gib"] = round(r["paper_accounting_gib"] + r["gradient_path_gib"], 2)
                    r["residual"] = round(r["paper_accounting_gib"] / r["paper_gib"] - 1, 4)
        if "baseline" in mine and "A+G+O" in mine:
            for who in ("paper", "planner"):
                mine["A+G+O"][f"{who}_reduction"] = round(1 - mine["A+G+O"][f"{who}_gib"] / mine["baseline"][f"{who}_gib"], 4)
    return {
        "tp": tp,
        "pp": 1,
        "dp": 1,
        "micro_batch": 1,
        "gib_per_paper_gb": 1.0,
        "rows": rows,
        "layer_units": layers_u,
        "explanations": explain(rows, layers_u),
    }


def explain(rows: list[dict[str, Any]], layer_units: list[dict[str, Any]]) -> list[str]:
    """One sentence per difference larger than 10%, from the decomposition."""
    out = []
    lu = layer_units[0]
    out.append(
        f"Per layer the planner counts {lu['baseline_U']:.2f}U (baseline) and {lu['agoq_U']:.2f}U (AGoQ) for LLaMA2-13B against the "
        f"paper's 28U and 7.75U: agoq's bf16 path keeps the two RMSNorm inputs in bf16 (2U, the paper counts fp32: 4U), the "
        f"attention core as q, k, v, output and an fp32 log-sum-exp (4U + 0.02U, the paper 5U), the out-projection input as a "
        f"view of the attention output (0, the paper 1U), and the SwiGLU tensors at LLaMA2-13B's real intermediate size 2.7h "
        f"(gate, up, SiLU(gate) and the product: 10.8U, the paper's table assumes 4h: 16U); the 4-bit tensors carry an fp32 "
        f"scale per 128 values (+1/32 of a byte per value). These counts are checked to the byte against measurement."
    )
    for r in rows:
        if abs(r["difference"]) <= THRESHOLD:
            if abs(r["residual"]) > THRESHOLD:
                out.append(
                    f"{r['case']}, {r['label']}: the planner agrees within {abs(r['difference']) * 100:.0f}%, but the paper's own "
                    f"per-layer table would predict {r['paper_accounting_gib']:.1f} GiB ({r['residual'] * 100:+.0f}%), more than the "
                    "paper measured: its run cannot have used the layout we assume (TP=8, PP=1, micro-batch 1, no recomputation), "
                    "which the paper's text we reproduce does not state; the agreement here is partly coincidental."
                )
            continue
        parts = [
            f"{r['case']}, {r['label']}: the planner's {r['planner_gib']:.1f} GiB is {abs(r['difference']) * 100:.0f}% "
            f"{'below' if r['difference'] < 0 else 'above'} the paper's {r['paper_gib']} GB"
        ]
        parts.append(f"the per-layer accounting accounts for {r['layer_accounting_gib']:+.1f} GiB")
        if r["fused_loss_gib"]:
            parts.append(
                f"agoq's fused loss, which keeps no fp32 log-softmax where the paper's system kept Megatron's, for {r['fused_loss_gib']:+.1f} GiB"
            )
        if r.get("gradient_path_gib"):
            parts.append(
                f"the gradient path for {r['gradient_path_gib']:+.1f} GiB (the paper's 8-bit gradients saved "
                f"{r['gradient_path_gib']:.1f} GiB less than the planner's fp32 -> int8 buffer: its system kept more "
                "gradient memory beside the 8-bit buffer, e.g. compute-dtype .grad tensors or communication buffers)"
            )
        parts.append(f"with these re-added the planner gives {r['paper_accounting_gib']:.1f} GiB ({r['residual'] * 100:+.0f}% from the paper)")
        if abs(r["residual"]) > THRESHOLD:
            parts.append(
                "the remaining gap is outside the planner's model: the paper's exact parallel layout, micro-batch and "
                "allocator state for this run are not stated in what we reproduce (we assume TP=8, PP=1, micro-batch 1)"
            )
        out.append("; ".join(parts) + ".")
    return out


def markdown(res: dict[str, Any]) -> str:
    """The comparison table and the explanations."""
    lines = [
        f"Planner assumptions for every row: TP={res['tp']} with sequence parallelism, PP=1, DP=1, micro-batch 1; paper figures read as GiB.",
        "",
        "| case | configuration | paper | agoq plan | difference | plan + the paper's accounting | vs paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        red = ""
        if "paper_reduction" in r:
            red = f" (-{r['paper_reduction'] * 100:.1f}% / -{r['planner_reduction'] * 100:.1f}%)"
        lines.append(
            f"| {r['case']} | {r['label']}{red} | {r['paper_gib']} GB | {r['planner_gib']:.1f} GiB | {r['difference'] * 100:+.0f}% "
            f"| {r['paper_accounting_gib']:.1f} GiB | {r['residual'] * 100:+.0f}% |"
        )
    lines += ["", "| model | baseline per layer | AGoQ per layer | paper (Table 1) |", "|---|---|---|---|"]
    seen = set()
    for lu in res["layer_units"]:
        key = (lu["baseline_U"], lu["agoq_U"])
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"| {lu['case'].split(',')[0]} | {lu['baseline_U']:.2f}U | {lu['agoq_U']:.2f}U | 28U -> 7.75U |")
    lines += [""] + [f"- {e}" for e in res["explanations"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Compare, print, write plan_vs_paper.json (into --out-dir or benchmarks/results)."""
    import json

    from benchmarks._common import write_result

    res = compare(args.tp)
    write_result("plan_vs_paper", res, out_dir=args.out_dir)
    print(json.dumps(res, indent=2) if args.json else markdown(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.plan_vs_paper``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_vs_paper", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
