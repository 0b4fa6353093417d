"""LoRA fine-tune of a small Llama-architecture model with AGoQ, on the bundled KJV text, on CPU.

    torchrun --nproc-per-node=2 examples/lora_finetune.py --steps 50                 # HF Trainer + AGoQ
    torchrun --nproc-per-node=2 examples/lora_finetune.py --steps 50 --trainer sft   # TRL's SFTTrainer + AGoQ
    torchrun --nproc-per-node=2 examples/lora_finetune.py --steps 50 --plain         # the same LoRA run without AGoQ

No downloads: the base model is built from a config (seeded), the tokenizer is trained on the text
(cached). The AGoQ lines are marked; everything else is ordinary transformers / PEFT / TRL code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from agoq.integrations.hf_trainer import AgoqMixin
from agoq.data.tokens import prepare_data

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import Windows  # noqa: E402  (the same fixed-length windows of the token stream)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--trainer", choices=("hf", "sft"), default="hf", help="transformers' Trainer or TRL's SFTTrainer")
    p.add_argument("--plain", action="store_true", help="no AGoQ: the unpatched LoRA model and fp32 gradients")
    p.add_argument(
        "--checkpoint-format", default=None, help="compressed checkpoints: every layer checkpointed, its input kept in this format (e.g. int8/128)"
    )
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process and step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out-dir", default="lora_finetune_out")
    p.add_argument("--summary", default=None, help="also write the summary JSON to this file (rank 0)")
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """(PEFT LoRA model over a seeded base model, tokenizer, train windows, validation windows)."""
    data = prepare_data(vocab_size=args.vocab_size, cache=args.cache_dir)
    config = LlamaConfig(
        vocab_size=data.tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(args.seed)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout, target_modules=TARGETS)
    val = Windows(data.val[: args.seq_len * args.eval_windows + 1], args.seq_len)
    return get_peft_model(base, lora), data.tokenizer, Windows(data.train, args.seq_len), val


def _training_args(args: argparse.Namespace, cls: type) -> TrainingArguments:
    extra = {"max_length": args.seq_len, "packing": False, "dataset_kwargs": {"skip_prepare_dataset": True}} if args.trainer == "sft" else {}
    return cls(
        output_dir=args.out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine",
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        dataloader_drop_last=True,
        **extra,
    )


def trainer_for(args: argparse.Namespace, model, tokenizer, train, val) -> Trainer:
    """The chosen trainer, given AGoQ through :class:`AgoqMixin` unless ``--plain``."""
    agoq = {} if args.plain else {"agoq_policy": "agoq", "agoq_gradients": "int8", "agoq_checkpoint_format": args.checkpoint_format}
    if args.trainer == "hf":
        base, config_cls, data = Trainer, TrainingArguments, {"train_dataset": train, "eval_dataset": val}
        extra = {}
    else:
        from datasets import Dataset
        from transformers import PreTrainedTokenizerFast
        from trl import SFTConfig, SFTTrainer

        base, config_cls = SFTTrainer, SFTConfig
        as_rows = lambda windows: Dataset.from_dict({"input_ids": [windows[i]["input_ids"].tolist() for i in range(len(windows))]})  # noqa: E731
        data = {"train_dataset": as_rows(train), "eval_dataset": as_rows(val)}
        eos = tokenizer.eos_token
        extra = {"processing_class": PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=eos, pad_token=eos)}
    # AGoQ: the mixin in front of any Trainer subclass patches the model and reduces gradients in 8 bits.
    cls = base if args.plain else type(f"Agoq{base.__name__}", (AgoqMixin, base), {})
    return cls(model=model, args=_training_args(args, config_cls), **data, **extra, **agoq)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, tokenizer, train, val = build(args)
    trainer = trainer_for(args, model, tokenizer, train, val)
    timer = StepTimer()
    trainer.add_callback(timer)
    result = trainer.train()
    summary = {
        "trainer": args.trainer,
        "agoq": not args.plain,
        "steps": args.steps,
        "train_loss": result.training_loss,
        "val_loss": trainer.evaluate()["eval_loss"],
        "step_s_median_after_3": statistics.median(timer.times[3:] or timer.times),
        "wire_bytes_per_step": trainer.agoq_comm.bytes() / args.steps if hasattr(trainer, "agoq_comm") else 0,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # every rank leaves the group together (gloo threads must not outlive exit)
        dist.barrier()
        dist.destroy_process_group()
