"""Bytes each decoder layer keeps for backward, by kind, under bf16 / agoq / uniform4 (METHOD.md part 1).

The bytes are measured: a real forward pass of the model under :class:`SavedBytesMeter`, which
sees every saved tensor and payload, once per storage. Beside each measurement the analytical
count (agoq.activation.accounting, the formula the planner uses) is checked to the byte. Rows
also give the paper's Table 1 for a Megatron LLaMA layer (MLP width 4h, MHA) for comparison.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "saved-for-backward bytes per decoder layer by kind: bf16 baseline vs agoq vs uniform4, measured and analytical"

POLICIES = ("bf16", "agoq", "uniform4")
# METHOD.md's Table 1 in U, mapped to the meter's kinds (gemm_input: QKV 1U + FFN1 1U + FFN2 4U).
PAPER_U = {
    "bf16": {"attention": 5.0, "norm_input": 4.0, "act_input": 12.0, "out_proj_input": 1.0, "gemm_input": 6.0, "other": 0.0},
    "agoq": {"attention": 5.0, "norm_input": 0.5, "act_input": 2.0, "out_proj_input": 0.25, "gemm_input": 0.0, "other": 0.0},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.activation``."""
    parser.add_argument("--model", default="tiny", help="model preset (agoq.models.PRESETS); default tiny")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers to build and measure (default 2; every layer keeps the same)")
    parser.add_argument("--vocab", type=int, default=None, help="override the vocab size (smaller embedding/head for large presets)")
    parser.add_argument(
        "--presets",
        default="llama2-13b,llama3-8b",
        help="comma-separated presets to also count analytically at --batch/--seq (empty: none)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of markdown tables")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    add_out_dir(parser)


def measure(model_name: str, batch: int, seq: int, dtype_name: str, layers: int, vocab: int | None) -> dict[str, Any]:
    """Measured per-layer bytes by kind for each policy, with the analytical count and outside bytes."""
    import torch

    from agoq.activation import SavedBytesMeter, make_policy
    from agoq.activation.accounting import U_bytes, layer_saved_bytes
    from agoq.activation.meter import METER_KINDS
    from agoq.models import Llama, get_config

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    overrides: dict[str, Any] = {"n_layers": layers}
    if vocab is not None:
        overrides["vocab_size"] = vocab
    cfg = get_config(model_name, **overrides)
    if seq > cfg.max_seq_len:
        cfg = get_config(model_name, **overrides, max_seq_len=seq)
    torch.manual_seed(0)
    model = Llama(cfg, make_policy("bf16")).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    unit = U_bytes(batch, seq, cfg.hidden)
    out: dict[str, Any] = {
        "model": model_name,
        "config": cfg.to_dict(),
        "batch": batch,
        "seq": seq,
        "dtype": dtype_name,
        "U_bytes": unit,
        "policies": {},
    }
    for name in POLICIES:
        policy = make_policy(name)
        model.set_policy(policy)
        with SavedBytesMeter(model, layers={layer.index: layer for layer in model.layers.values()}) as meter:
            loss = model(ids, ids)
        per_layer = [meter.layer_bytes(i) for i in model.layer_range]
        formula = [
            layer_saved_bytes(batch, seq, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, dtype, policy.layer(i))
            for i in model.layer_range
        ]
        row = per_layer[0]
        out["policies"][name] = {
            "policy": {"formats": {k: (str(v) if v is not None else None) for k, v in vars(policy.formats).items()}, "fused_loss": policy.fused_loss},
            "layer_bytes": row,
            "layer_total_bytes": sum(row.values()),
            "layer_U": {k: v / unit for k, v in row.items()},
            "layer_total_U": sum(row.values()) / unit,
            "all_layers_equal": all(r == row for r in per_layer),
            "formula_bytes": formula[0],
            "formula_matches": per_layer == formula,
            "outside_bytes": sum(meter.layer_bytes(None).values()),
            "outside_by_kind": {k: v for k, v in meter.layer_bytes(None).items() if v},
            "shared_bytes": meter.shared_bytes,
            "parameter_bytes_saved": meter.parameter_bytes,
        }
        del loss
    base = out["policies"]["bf16"]["layer_total_bytes"]
    for name in POLICIES:
        out["policies"][name]["ratio_to_bf16"] = out["policies"][name]["layer_total_bytes"] / base
    out["kinds"] = [k for k in METER_KINDS if k != "layer_input"]  # kept by compressed checkpoints only, none here
    return out


def analytical(presets: list[str], batch: int, seq: int) -> list[dict[str, Any]]:
    """The accounting formula for real model shapes (bf16 compute), per policy, in U."""
    import torch

    from agoq.activation import make_policy
    from agoq.activation.accounting import U_bytes, layer_saved_bytes
    from agoq.models import get_config

    rows = []
    for preset in presets:
        cfg = get_config(preset)
        unit = U_bytes(batch, seq, cfg.hidden)
        totals = {}
        for name in POLICIES:
            b = layer_saved_bytes(
                batch, seq, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, torch.bfloat16, make_policy(name).layer(0)
            )
            totals[name] = {"bytes": sum(b.values()), "U": sum(b.values()) / unit, "by_kind_U": {k: v / unit for k, v in b.items()}}
        rows.append(
            {"model": preset, "batch": batch, "seq": seq, "policies": totals, "agoq_ratio": totals["agoq"]["bytes"] / totals["bf16"]["bytes"]}
        )
    return rows


def _markdown(res: dict[str, Any], extra: list[dict[str, Any]]) -> str:
    kinds = res["kinds"]
    unit = res["U_bytes"]
    lines = [
        f"Saved for backward per decoder layer: {res['model']} (hidden {res['config']['hidden']}, "
        f"{res['config']['n_heads']}/{res['config']['n_kv_heads']} heads, intermediate {res['config']['intermediate']}), "
        f"batch {res['batch']} x seq {res['seq']}, {res['dtype']}; U = {unit} bytes",
        "",
        "| policy | " + " | ".join(kinds) + " | total | vs bf16 | formula = meter |",
        "|---|" + "---:|" * (len(kinds) + 2) + "---|",
    ]
    for name, p in res["policies"].items():
        cells = [f"{p['layer_U'][k]:.3f}U" for k in kinds]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {p['layer_total_U']:.3f}U ({p['layer_total_bytes']:,} B) | "
            f"{p['ratio_to_bf16']:.3f} | {'yes' if p['formula_matches'] else 'NO'} |"
        )
    for name, table in PAPER_U.items():
        cells = [f"{table[k]:g}U" for k in kinds]
        total = sum(table.values())
        lines.append(f"| paper {name} (Table 1) | " + " | ".join(cells) + f" | {total:g}U | {total / sum(PAPER_U['bf16'].values()):.3f} | |")
    lines += ["", "| policy | outside the layers (embedding, final norm, LM head, loss) | shared (rotary tables) |", "|---|---:|---:|"]
    for name, p in res["policies"].items():
        lines.append(
            f"| {name}{' (fused loss)' if p['policy']['fused_loss'] else ''} | {p['outside_bytes']:,} B = {p['outside_bytes'] / unit:.2f}U | {p['shared_bytes']:,} B |"
        )
    if extra:
        lines += [
            "",
            "Analytical (same formula), bf16 compute:",
            "",
            "| model | batch x seq | bf16 | agoq | uniform4 | agoq / bf16 |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in extra:
            t = r["policies"]
            lines.append(
                f"| {r['model']} | {r['batch']} x {r['seq']} | {t['bf16']['U']:.2f}U | {t['agoq']['U']:.2f}U | {t['uniform4']['U']:.2f}U | {r['agoq_ratio']:.3f} |"
            )
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = res["kinds"]
    names = list(res["policies"]) + [f"paper {n}" for n in PAPER_U]
    values = [[res["policies"][n]["layer_U"][k] for k in kinds] for n in res["policies"]] + [[PAPER_U[n][k] for k in kinds] for n in PAPER_U]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for j, kind in enumerate(kinds):
        heights = [v[j] for v in values]
        ax.bar(names, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("saved for backward per layer (U)")
    ax.set_title(f"{res['model']}, batch {res['batch']} x seq {res['seq']}, {res['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Measure, print a table (or JSON), write activation.json and .png (into --out-dir or benchmarks/results)."""
    import json

    from benchmarks._common import write_result

    for name in ("batch", "seq", "layers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be a positive integer, got {getattr(args, name)}")
    res = measure(args.model, args.batch, args.seq, args.dtype, args.layers, args.vocab)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    extra = analytical(presets, args.batch, args.seq) if presets else []
    results = {"measured": res, "analytical": extra}
    path = write_result("activation", results, out_dir=args.out_dir)
    if not args.no_plot:
        _plot(res, path.with_suffix(".png"))
    print(json.dumps(results, indent=2) if args.json else _markdown(res, extra))
    ok = all(p["formula_matches"] and p["all_layers_equal"] for p in res["policies"].values())
    if not ok:
        print(f"the meter disagrees with the analytical count; see {path}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.activation``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.activation", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
