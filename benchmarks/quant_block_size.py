"""Which block size? Quantization error against stored bits, on activations and gradients of a real model.

A small Hugging Face LlamaForCausalLM (built from a LlamaConfig, no download) trains for a few
dozen AdamW steps on the King James Bible (byte-level BPE), so the tensors are no longer init
noise; then one more batch is captured: the inputs of every RMSNorm, the SwiGLU gate and up
projections (the tensors LAAQ saves at 4 bits), and every weight gradient (what QuanGrad stores at
8 bits). Each is quantized at every block size; the table gives the relative L2 error
||x - deq(q(x))|| / ||x|| over all tensors of a kind, and the bits stored per value.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "relative L2 error vs bits per value by block size: 4-bit formats on real activations, int8 on real gradients"

DEFAULT_BLOCKS = "32,64,128,256,512,1024"
ACTIVATION_FORMATS = "int4,nf4,fp4"
GRADIENT_FORMATS = "int8,fp8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.quant_block_size``."""
    parser.add_argument("--blocks", default=DEFAULT_BLOCKS, help=f"comma-separated block sizes (default {DEFAULT_BLOCKS})")
    parser.add_argument("--activation-formats", default=ACTIVATION_FORMATS, help="formats tried on activations")
    parser.add_argument("--gradient-formats", default=GRADIENT_FORMATS, help="formats tried on weight gradients")
    parser.add_argument("--hidden", type=int, default=512, help="model hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--vocab", type=int, default=4096, help="byte-level BPE vocabulary trained on the corpus")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps before capturing")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of markdown tables")
    add_out_dir(parser)


def _model_and_batches(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """A trained LlamaForCausalLM, a function giving token batches, and what training did."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agoq.data.tokens import open_corpus
    from agoq.data.tokenizer import train_bpe

    docs = list(open_corpus(None).documents())
    tok = train_bpe(docs, args.vocab)
    ids = torch.tensor([i for d in tok.encode_batch(docs) for i in d + [tok.eos_id]], dtype=torch.long)
    gen = torch.Generator().manual_seed(0)

    def batch() -> torch.Tensor:
        starts = torch.randint(0, ids.numel() - args.seq - 1, (args.batch,), generator=gen)
        return torch.stack([ids[s : s + args.seq] for s in starts.tolist()])

    heads = max(1, args.hidden // 64)
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3 + 63) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x = batch()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "config": {
            k: getattr(config, k)
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        },
        "steps": args.steps,
        "tokens_per_step": args.batch * args.seq,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "train_seconds": time.perf_counter() - t0,
    }
    return model, batch, info


def _capture(model: Any, batch: Any) -> dict[str, list[Any]]:
    """RMSNorm inputs, SwiGLU gate/up outputs (bf16, as a bf16 run saves them) and weight gradients of one batch."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    found: dict[str, list[torch.Tensor]] = {"rmsnorm_input": [], "swiglu_gate": [], "swiglu_up": [], "weight_grad": []}
    hooks = []
    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            hooks.append(module.register_forward_pre_hook(lambda m, a: found["rmsnorm_input"].append(a[0].detach().to(torch.bfloat16))))
        elif isinstance(module, LlamaMLP):
            hooks.append(module.gate_proj.register_forward_hook(lambda m, a, out: found["swiglu_gate"].append(out.detach().to(torch.bfloat16))))
            hooks.append(module.up_proj.register_forward_hook(lambda m, a, out: found["swiglu_up"].append(out.detach().to(torch.bfloat16))))
    x = batch()
    model(input_ids=x, labels=x).loss.backward()
    for h in hooks:
        h.remove()
    found["weight_grad"] = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None and p.dim() == 2]
    model.zero_grad(set_to_none=True)
    return found


def _rel_l2(tensors: list[Any], fmt: Any) -> tuple[float, float]:
    """(relative L2 error over all tensors together, stored bits per value) of one format."""
    from agoq.quant import dequantize, quantize

    err2 = ref2 = 0.0
    stored = numel = 0
    for t in tensors:
        q = quantize(t, fmt)
        x = t.double()
        err2 += float((x - dequantize(q, x.dtype)).square().sum())
        ref2 += float(x.square().sum())
        stored += q.nbytes
        numel += t.numel()
    return (err2 / ref2) ** 0.5, 8 * stored / numel


def run(args: argparse.Namespace) -> int:
    """Train, capture, sweep block sizes; print tables, write quant_block_size.json/.png."""
    import json

    import torch

    from benchmarks._common import write_result
    from agoq.quant import parse_format
    from agoq.quant.formats import DEFAULT_ACTIVATION_BLOCK, DEFAULT_GRADIENT_BLOCK

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
        act_formats = [f.strip() for f in args.activation_formats.split(",") if f.strip()]
        grad_formats = [f.strip() for f in args.gradient_formats.split(",") if f.strip()]
        for f in act_formats + grad_formats:
            parse_format(f)
    except ValueError as e:
        raise SystemExit(f"bad --blocks or format list: {e}")
    if args.steps < 0 or args.hidden < 64 or args.layers < 1:
        raise SystemExit("--steps must be >= 0, --hidden >= 64 and --layers >= 1")

    model, batch, info = _model_and_batches(args)
    tensors = _capture(model, batch)
    plan = [(kind, f) for kind in ("rmsnorm_input", "swiglu_gate", "swiglu_up") for f in act_formats]
    plan += [("weight_grad", f) for f in grad_formats]
    rows = []
    for kind, base in plan:
        for block in blocks:
            fmt = parse_format(base, block)
            err, bits = _rel_l2(tensors[kind], fmt)
            # Bits plus log2(error): one more bit halves a uniform grid's error, so this is the
            # cost of an error level in bits, comparable across block sizes (lower is better).
            rows.append(
                {
                    "tensor": kind,
                    "format": base,
                    "block": block,
                    "rel_l2_error": err,
                    "bits_per_value": bits,
                    "bits_plus_log2_error": bits + math.log2(err),
                }
            )
    results = {
        "model": info,
        "captured": {
            k: {"tensors": len(v), "numel": sum(t.numel() for t in v), "dtype": str(v[0].dtype).replace("torch.", "")}
            for k, v in tensors.items()
            if v
        },
        "defaults": {"activation_block": DEFAULT_ACTIVATION_BLOCK, "gradient_block": DEFAULT_GRADIENT_BLOCK},
        "rows": rows,
    }
    command = "python -m benchmarks.quant_block_size " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items()) if k != "json" and not (k == "out_dir" and v is None)
    )
    path = write_result("quant_block_size", results, command=command, out_dir=args.out_dir)
    _plot(rows, path.with_suffix(".png"))
    print(json.dumps(results, indent=2) if args.json else _markdown(rows, blocks, info))
    print(f"\nwritten: {path}")
    return 0


def _markdown(rows: list[dict[str, Any]], blocks: list[int], info: dict[str, Any]) -> str:
    out = [
        f"LlamaForCausalLM {info['params'] / 1e6:.1f}M params after {info['steps']} AdamW steps on KJV "
        f"(loss {info['loss_first']:.2f} -> {info['loss_last']:.2f}); relative L2 error, bits per value in parentheses",
        "",
        "| tensor | format | " + " | ".join(f"block {b}" for b in blocks) + " |",
        "|---|---|" + "---:|" * len(blocks),
    ]
    keys = list(dict.fromkeys((r["tensor"], r["format"]) for r in rows))
    for tensor, fmt in keys:
        cells = {r["block"]: r for r in rows if r["tensor"] == tensor and r["format"] == fmt}
        out.append(f"| {tensor} | {fmt} | " + " | ".join(f"{cells[b]['rel_l2_error']:.4f} ({cells[b]['bits_per_value']:.3f})" for b in blocks) + " |")
    out += [
        "",
        "bits per value + log2(relative error): the cost of an error level in bits (lower is better)",
        "",
        "| tensor | format | " + " | ".join(f"block {b}" for b in blocks) + " | best |",
        "|---|---|" + "---:|" * (len(blocks) + 1),
    ]
    for tensor, fmt in keys:
        cells = {r["block"]: r["bits_plus_log2_error"] for r in rows if r["tensor"] == tensor and r["format"] == fmt}
        best = min(cells, key=cells.__getitem__)
        out.append(f"| {tensor} | {fmt} | " + " | ".join(f"{cells[b]:.3f}" for b in blocks) + f" | {best} |")
    return "\n".join(out)


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tensors = list(dict.fromkeys(r["tensor"] for r in rows))
    fig, axes = plt.subplots(1, len(tensors), figsize=(4 * len(tensors), 3.6))
    for ax, tensor in zip(axes if len(tensors) > 1 else [axes], tensors):
        for fmt in dict.fromkeys(r["format"] for r in rows if r["tensor"] == tensor):
            pts = [r for r in rows if r["tensor"] == tensor and r["format"] == fmt]
            ax.plot([p["bits_per_value"] for p in pts], [p["rel_l2_error"] for p in pts], marker="o", label=fmt)
            for p in pts:
                ax.annotate(str(p["block"]), (p["bits_per_value"], p["rel_l2_error"]), fontsize=6, textcoords="offset points", xytext=(2, 2))
        ax.set_title(tensor)
        ax.set_xlabel("stored bits per value")
        ax.set_ylabel("relative L2 error")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.quant_block_size``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_block_size", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
