"""A tiny HF Trainer run under FSDP2 (Accelerate's plugin) for tests/test_fsdp_exact.py; run it under torchrun.

    torchrun --standalone --nproc-per-node=2 tests/fsdp_trainer_run.py --gradients int8 --out OUT.json

``--gradients int8`` reduce-scatters with agoq's 8 bits (fp32 sum), ``fp32`` with FSDP2's own.
Rank 0 writes the losses, the FSDP2 units and the 8-bit wire bytes to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from agoq.integrations.hf_trainer import AgoqTrainer

VOCAB, SEQ = 96, 32


class Sequences(torch.utils.data.Dataset):
    """Seeded sequences with a learnable rule (each token is the previous one plus a per-sequence step)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    """The training loss of every logged step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def _fsdp_on_cpu() -> None:
    """Let Accelerate's FSDP plugin apply to a multi-process CPU job.

    Accelerate's AcceleratorState switches to DistributedType.FSDP only for accelerator types
    (MULTI_GPU, MULTI_XPU, ...); a MULTI_CPU job keeps DDP and drops the plugin without a word, so
    the Trainer would wrap the model in DDP. This sets the FSDP type after the state's own
    initialization, as it does for a GPU job; the rest (fully_shard of every decoder layer and
    of the root, by Accelerate's fsdp2_prepare_model) is Accelerate's own code.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gradients", required=True, help="comma-separated: int8 and/or fp32, one run each in these processes")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True, help="a folder: each run writes GRADIENTS.json there")
    args = p.parse_args()
    _fsdp_on_cpu()
    for gradients in args.gradients.split(","):
        _run(gradients, args.steps, os.path.join(args.out, f"{gradients}.json"))


def _run(gradients: str, steps: int, out: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(out), f"trainer_{gradients}"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        seed=0,
        data_seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_drop_last=True,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True},
    )
    losses = Losses()
    trainer = AgoqTrainer(
        model=model,
        args=training,
        train_dataset=Sequences(steps * 4 * 2),
        agoq_policy=None,  # the saved activations as they are: only the reduction differs between the two runs
        agoq_gradients=gradients,
        callbacks=[losses],
    )
    trainer.train()
    from torch.distributed.fsdp import FSDPModule

    wrapped = trainer.model_wrapped
    units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    # The bytes the 8-bit reduce-scatter should send per step, from torch's own per-rank shard sizes
    # (private, read here only for the check): one all-to-all row to the other rank per parameter
    # group, each shard padded to whole 256-value blocks, one byte a value plus a 4-byte scale a block.
    groups = {id(g): g for g in (m._get_fsdp_state()._fsdp_param_group for m in units) if g is not None}
    rows = [sum(-(-fp.padded_sharded_param_size.numel() // 256) * 256 for fp in g.fsdp_params) for g in groups.values()]
    summary = {
        "losses": losses.losses,
        "fsdp_units": len(units),
        "groups": len(groups),
        "multi_module_groups": sum(sum(m._get_fsdp_state()._fsdp_param_group is g for m in units) > 1 for g in groups.values()),
        "expected_wire_bytes": steps * sum(r + 4 * r // 256 for r in rows),
        "wire_bytes": trainer.agoq_comm.bytes(),
        "parameters": sum(p.numel() for p in wrapped.parameters()),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
    # Every rank leaves the process group together (an exit with gloo's threads running can abort a rank).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
