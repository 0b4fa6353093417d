"""``agoq plan``: its options and what it runs."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = (
    "Bytes per pipeline rank (parameters, gradients, optimizer, activations per micro-batch and at the in-flight "
    "peak, buffers, total) for the bf16 baseline, +ZeRO-1, AGoQ activations (A), A+G (8-bit gradients), A+G+O "
    "(8-bit optimizer), A+G+O+ZeRO-1; the recomputation each needs to fit and an iteration-time estimate."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``agoq plan``."""
    from agoq.models.config import PRESETS

    parser.add_argument("--model", default="llama2-13b", help=f"model preset: {', '.join(PRESETS)} (default llama2-13b)")
    parser.add_argument(
        "--model-field",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an architecture field, e.g. n_layers=36 or hidden=6144 (repeatable): any custom LLaMA",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size, with sequence parallelism (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument("--node-size", type=int, default=8, help="dp ranks per node, for the gradient bytes by link class (default 8)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step over all dp ranks (default: micro-batch x dp x pp)"
    )
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved-1f1b (default 1f1b)")
    parser.add_argument("--virtual-stages", type=int, default=None, help="model chunks per pp rank (default 2 for interleaved-1f1b, else 1)")
    parser.add_argument("--gpu-memory", default=None, help="memory of one GPU, e.g. 48GiB, 80GB (enables fit and recompute)")
    parser.add_argument(
        "--reserved", default="2GiB", help="kept off --gpu-memory for the CUDA context, NCCL and allocator fragmentation (default 2GiB)"
    )
    parser.add_argument(
        "--memory-budget", default=None, help="budget mode: per-stage bits (4..8, 16) and recompute chosen so every rank fits this many bytes"
    )
    parser.add_argument(
        "--configs", default=None, help="comma-separated configurations (default baseline,baseline+zero1,A,A+G,A+G+O,A+G+O+zero1; also e.g. O, G+O)"
    )
    parser.add_argument("--activation-format", default="int4/128", help="format of quantized saved activations (default int4/128)")
    parser.add_argument("--stage-bits", choices=("dbca", "uniform"), default="dbca", help="pipeline stage bits: dbca (default) or uniform")
    parser.add_argument("--gradient-block", type=int, default=256, help="values per scale of the 8-bit gradients (default 256)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (schema agoq.plan/1, docs/plan.md)")
    ft = parser.add_argument_group(
        "fine-tuning plans", "one GPU fine-tuning a Hugging Face model: plain, ac, agoq, agoq_ac, agoq_ckpt8 (docs/plan.md)"
    )
    ft.add_argument("--hf-config", default=None, metavar="CONFIG_JSON", help="a Llama, Mistral, Qwen2 or Qwen3 config.json: plan its fine-tune")
    ft.add_argument("--lora-r", type=int, default=16, help="LoRA rank; 0 trains every weight (default 16)")
    ft.add_argument("--lora-targets", default=None, help="comma-separated projections given adapters (default: all seven, q_proj through down_proj)")
    ft.add_argument("--lora-dropout", type=float, default=0.05, help="LoRA dropout; above 0 PEFT keeps each adapter's dropped input (default 0.05)")
    ft.add_argument("--qlora", action="store_true", help="base projections in bitsandbytes nf4 (QLoRA)")
    ft.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step; above 1 gradients are held throughout (default 1)")


def _fields(items: list[str]) -> dict[str, object]:
    """KEY=VALUE strings as typed LlamaConfig overrides, each value read as ``agoq train --model.KEY=VALUE`` reads it."""
    import typing

    from agoq.models.config import LlamaConfig
    from agoq.plan.config import PlanError
    from agoq.errors import ConfigError
    from agoq.values import parse_value

    types = typing.get_type_hints(LlamaConfig)
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise PlanError(f"--model-field {item!r} must be KEY=VALUE with KEY one of {', '.join(types)}")
        try:
            out[key] = parse_value(value.strip(), types[key], key)
        except ConfigError as e:
            raise PlanError(f"--model-field {e}") from None
    return out


def run_finetune(args: argparse.Namespace) -> int:
    """The fine-tuning plan of ``--hf-config``; a one-line error and exit status 2 for one that cannot be planned."""
    import json

    from agoq.plan.config import PlanError, parse_size
    from agoq.plan.finetune import PROJECTIONS, FineTune, HFModel, markdown, plan_finetune, to_dict

    try:
        ignored = [f"--{k}" for k in ("tp", "pp", "dp") if getattr(args, k) != 1] + (["--memory-budget"] if args.memory_budget else [])
        if ignored:
            raise PlanError(f"--hf-config plans one GPU; drop {', '.join(ignored)}")
        ft = FineTune(
            model=HFModel.from_config(args.hf_config),
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            lora_r=args.lora_r,
            lora_targets=PROJECTIONS if args.lora_targets is None else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
            lora_dropout=args.lora_dropout,
            qlora=args.qlora,
            grad_accum=args.grad_accum,
            gpu_memory=None if args.gpu_memory is None else parse_size(args.gpu_memory),
            reserved=parse_size(args.reserved, allow_zero=True),
        )
        plans = plan_finetune(ft)
    except PlanError as e:
        print(f"agoq plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_dict(ft, plans), indent=2) if args.json else markdown(ft, plans))
    return 0


def run(args: argparse.Namespace) -> int:
    """Plan and print; a one-line error and exit status 2 for a configuration that cannot run."""
    if getattr(args, "hf_config", None) is not None:
        return run_finetune(args)
    from agoq.plan.config import DEFAULT_SETUPS, PlanError, make_plan_config, parse_size
    from agoq.plan.memory import plan_memory
    from agoq.plan.report import markdown, to_json

    try:
        setups = tuple(s.strip() for s in args.configs.split(",") if s.strip()) if args.configs else DEFAULT_SETUPS
        global_batch = args.global_batch if args.global_batch is not None else args.micro_batch * args.dp * args.pp
        fields = _fields(args.model_field)
        cfg = make_plan_config(
            args.model,
            fields,
            seq_len=args.seq_len,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            micro_batch=args.micro_batch,
            global_batch=global_batch,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
            dtype=args.dtype,
            activation_format=args.activation_format,
            stage_bits=args.stage_bits,
            gradient_block=args.gradient_block,
            node_size=args.node_size,
            gpu_memory=None if args.gpu_memory is None else parse_size(args.gpu_memory),
            reserved=parse_size(args.reserved, allow_zero=True),
            memory_budget=None if args.memory_budget is None else parse_size(args.memory_budget),
            setups=setups,
        )
        from agoq.models.config import PRESETS

        # The model's own context: a --model-field max_seq_len, else the preset's (make_plan_config
        # raises the config's to fit the sequence, so cfg.model cannot tell).
        limit = cfg.model.max_seq_len if "max_seq_len" in fields else PRESETS[args.model].max_seq_len
        if args.seq_len > limit:
            print(
                f"agoq plan: warning: --seq-len {args.seq_len} is beyond {args.model}'s max_seq_len {limit} "
                "(the longest context it was built for); planned anyway",
                file=sys.stderr,
            )
        plan = plan_memory(cfg)
    except PlanError as e:
        print(f"agoq plan: {e}", file=sys.stderr)
        return 2
    print(to_json(plan) if args.json else markdown(plan))
    return 0
