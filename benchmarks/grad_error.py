"""Relative L2 error of every gradient when saved activations are quantized (the paper's Table 13 analogue).

The same model (trained briefly on KJV text with the baseline so its activations look like
training ones), the same batch: gradients under each quantized policy are compared with the
gradients of the unquantized policy (``bf16``, i.e. nothing compressed) computed in the same dtype
(fp32 by default, so that only quantization separates them). Errors are grouped by layer kind:
weight gradients, and the gradients of the inputs of each op (norm inputs, q/k/v, gate/up, the
out-projection input), aggregated over layers as sqrt(sum ||g - g_ref||^2 / sum ||g_ref||^2).

Besides ``agoq`` and ``uniform4``, single-kind policies quantize only one kind of saved tensor to
4 bits, which isolates what each kind costs (the paper: ~0.003 for norms, 0.05 for SiLU, 0.14 /
0.15 for Q / K).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator

from benchmarks._common import add_out_dir

DESCRIPTION = "relative L2 gradient error by layer kind under agoq / uniform4 / single-kind 4-bit, vs the unquantized baseline"

# (column name, make_policy name, overrides) - the loss path is the plain one for every column.
POLICY_COLUMNS: list[tuple[str, str, dict[str, str | None]]] = [
    ("agoq", "agoq", {}),
    # Same bytes as int4/128 (4 bits + one fp32 scale per 128); NF4's grid fits bell-shaped blocks.
    ("agoq nf4", "agoq", {"norm_input": "nf4/128", "act_input": "nf4/128", "out_proj_input": "nf4/128"}),
    ("uniform4", "uniform4", {}),
    ("norm_input only", "bf16", {"norm_input": "int4/128"}),
    ("act_input only", "bf16", {"act_input": "int4/128"}),
    ("attention only", "bf16", {"attention": "int4/128"}),
]

# Parameter names inside a decoder layer ("layers.<i>.<name>") by group; outside: the last two.
WEIGHT_GROUPS = {
    "weights: q/k/v": ("attn.q.weight", "attn.k.weight", "attn.v.weight"),
    "weights: out-proj": ("attn.o.weight",),
    "weights: gate/up": ("mlp.gate.weight", "mlp.up.weight"),
    "weights: down": ("mlp.down.weight",),
    "weights: norms": ("attn_norm.weight", "mlp_norm.weight"),
    "weights: embedding": ("embed.weight",),
    "weights: LM head + final norm": ("head.weight", "norm.weight"),
}
INPUT_GROUPS = {
    "inputs: norm inputs": ("attn_norm_input", "mlp_norm_input"),
    "inputs: q": ("q",),
    "inputs: k": ("k",),
    "inputs: v": ("v",),
    "inputs: out-proj input": ("out_proj_input",),
    "inputs: gate": ("gate",),
    "inputs: up": ("up",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.grad_error``."""
    parser.add_argument("--model", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype of every policy (default fp32)")
    parser.add_argument("--train-steps", type=int, default=30, help="baseline AdamW steps on KJV before measuring (default 30)")
    parser.add_argument("--batches", type=int, default=2, help="measured batches, errors pooled over them (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a markdown table")
    add_out_dir(parser)


class _InputRecorder:
    """Keeps the gradients of the decoder ops' inputs by (layer, name) during one backward."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[int, str], Any] = {}
        self.layer = -1
        self.norm_calls = 0

    def keep(self, name: str, t: Any) -> None:
        if t.requires_grad:
            t.retain_grad()
            self.tensors[(self.layer, name)] = t

    def grads(self) -> dict[tuple[int, str], Any]:
        return {k: t.grad.detach().float().clone() for k, t in self.tensors.items() if t.grad is not None}


@contextlib.contextmanager
def _record_inputs(model: Any) -> Iterator[_InputRecorder]:
    """Wrap the ops the decoder layer calls so their inputs keep their gradients."""
    import agoq.models.llama as llama

    rec = _InputRecorder()
    originals = {n: getattr(llama, n) for n in ("rms_norm_linear", "causal_attention", "swiglu_linear", "saved_input_linear")}

    def norm_linear(x, *args, **kwargs):
        rec.keep("attn_norm_input" if rec.norm_calls % 2 == 0 else "mlp_norm_input", x)
        rec.norm_calls += 1
        return originals["rms_norm_linear"](x, *args, **kwargs)

    def attention(q, k, v, *args, **kwargs):
        for name, t in (("q", q), ("k", k), ("v", v)):
            rec.keep(name, t)
        return originals["causal_attention"](q, k, v, *args, **kwargs)

    def swiglu(gate, up, *args, **kwargs):
        rec.keep("gate", gate)
        rec.keep("up", up)
        return originals["swiglu_linear"](gate, up, *args, **kwargs)

    def out_proj(x, *args, **kwargs):
        rec.keep("out_proj_input", x)
        return originals["saved_input_linear"](x, *args, **kwargs)

    def enter(index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            rec.layer = index
            rec.norm_calls = 0

        return hook

    handles = [layer.register_forward_pre_hook(enter(layer.index)) for layer in model.layers.values()]
    for name, fn in (("rms_norm_linear", norm_linear), ("causal_attention", attention), ("swiglu_linear", swiglu), ("saved_input_linear", out_proj)):
        setattr(llama, name, fn)
    try:
        yield rec
    finally:
        for name, fn in originals.items():
            setattr(llama, name, fn)
        for h in handles:
            h.remove()


def _gradients(model: Any, tokens: Any) -> tuple[dict[str, Any], dict[tuple[int, str], Any], float]:
    """(parameter gradients by name, op-input gradients by (layer, name), loss) for one batch."""
    model.zero_grad(set_to_none=True)
    with _record_inputs(model) as rec:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    params = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return params, rec.grads(), loss.item()


def _tokens(args: argparse.Namespace, vocab: int, count: int, gen: Any) -> tuple[list[Any], str]:
    """count batches of [batch, seq + 1] token windows from KJV, or random tokens if it is unavailable."""
    import numpy as np
    import torch

    try:
        from agoq.data.tokens import prepare_data

        data = prepare_data(vocab_size=vocab)
        source = "KJV (byte-level BPE)"
        train = data.train
    except Exception as exc:  # the corpus or tokenizer cache is missing: say so in the result
        train, source = None, f"random tokens ({type(exc).__name__}: {exc})"
    out = []
    for _ in range(count):
        if train is None:
            out.append(torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen))
            continue
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=gen).tolist()
        out.append(torch.from_numpy(np.stack([train[s : s + args.seq + 1].astype(np.int64) for s in starts])))
    return out, source


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Train briefly, then the relative gradient errors of each policy column, by group and by layer."""
    import torch

    from agoq.activation import make_policy
    from agoq.models import Llama, get_config

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = get_config(args.model)
    if args.seq > cfg.max_seq_len:
        cfg = get_config(args.model, max_seq_len=args.seq)
    gen = torch.Generator().manual_seed(args.seed)
    batches, source = _tokens(args, cfg.vocab_size, args.train_steps + args.batches, gen)
    model = Llama(cfg, make_policy("bf16", fused_loss=False))
    model.reset_parameters(seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in batches[: args.train_steps]:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model = model.to(dtype)
    measured = batches[args.train_steps :]

    model.set_policy(make_policy("bf16", fused_loss=False))
    refs = [_gradients(model, t) for t in measured]
    columns: dict[str, Any] = {}
    for column, base, overrides in POLICY_COLUMNS:
        model.set_policy(make_policy(base, overrides=overrides, fused_loss=False))
        sums: dict[str, list[float]] = {}
        per_layer: dict[str, dict[int, list[float]]] = {}
        for tokens, (ref_p, ref_i, ref_loss) in zip(measured, refs):
            got_p, got_i, loss = _gradients(model, tokens)
            if loss != ref_loss:
                raise RuntimeError(f"forward of {column} differs from the baseline ({loss} vs {ref_loss}); only backward may")
            for name, ref in ref_p.items():
                _add(sums, per_layer, _weight_group(name), _layer_of(name), got_p[name], ref)
            for group, names in INPUT_GROUPS.items():
                for (layer, name), ref in ref_i.items():
                    if name in names:
                        _add(sums, per_layer, group, layer, got_i[(layer, name)], ref)
        columns[column] = {
            "policy": {"name": base, "overrides": overrides},
            "relative_error": {g: (s[0] / s[1]) ** 0.5 if s[1] > 0 else 0.0 for g, s in sums.items()},
            "relative_error_by_layer": {
                g: {str(k): (v[0] / v[1]) ** 0.5 if v[1] > 0 else 0.0 for k, v in sorted(d.items())} for g, d in per_layer.items()
            },
        }
    return {
        "model": args.model,
        "config": cfg.to_dict(),
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "reference": f"policy 'bf16' (nothing quantized), same weights, same batches, same dtype ({args.dtype})",
        "data": source,
        "train_steps": args.train_steps,
        "train_loss_first_last": [losses[0], losses[-1]] if losses else None,
        "measured_batches": len(measured),
        "groups": list(WEIGHT_GROUPS) + list(INPUT_GROUPS),
        "columns": columns,
    }


def _weight_group(name: str) -> str:
    parts = name.split(".", 2)
    local = parts[2] if parts[0] == "layers" else name
    for group, names in WEIGHT_GROUPS.items():
        if local in names and (parts[0] == "layers") == (group not in ("weights: embedding", "weights: LM head + final norm")):
            return group
    raise KeyError(f"parameter {name!r} belongs to no gradient group; add it to WEIGHT_GROUPS")


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else -1


def _add(sums: dict, per_layer: dict, group: str, layer: int, got: Any, ref: Any) -> None:
    err = float((got - ref).pow(2).sum())
    norm = float(ref.pow(2).sum())
    s = sums.setdefault(group, [0.0, 0.0])
    s[0] += err
    s[1] += norm
    lay = per_layer.setdefault(group, {}).setdefault(layer, [0.0, 0.0])
    lay[0] += err
    lay[1] += norm


def _markdown(res: dict[str, Any]) -> str:
    cols = list(res["columns"])
    lines = [
        f"Relative L2 gradient error vs {res['reference']}: {res['model']}, batch {res['batch']} x seq {res['seq']}, "
        f"data {res['data']}, after {res['train_steps']} baseline steps",
        "",
        "| gradient | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for group in res["groups"]:
        lines.append(f"| {group} | " + " | ".join(f"{res['columns'][c]['relative_error'].get(group, 0.0):.4f}" for c in cols) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure, print a table (or JSON), write grad_error.json (into --out-dir or benchmarks/results)."""
    import json

    from benchmarks._common import write_result

    for name in ("batch", "seq", "batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.train_steps < 0:
        raise SystemExit(f"--train-steps must be >= 0, got {args.train_steps}")
    res = measure(args)
    write_result("grad_error", res, out_dir=args.out_dir)
    print(json.dumps(res, indent=2) if args.json else _markdown(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.grad_error``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_error", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
