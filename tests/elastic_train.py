"""A tiny data-parallel training job for the elastic restart test; run it under torchrun.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=1 \\
        tests/elastic_train.py \\
        --root CKPT --out OUT --steps 8 --save-every 2 [--kill-rank 1 --kill-in-save-at 6 --marker M]

Every start resumes from the latest finished checkpoint under --root. With --kill-* options the
given rank dies (os._exit) half way through writing the checkpoint of that step, once: a marker
file makes the restarted job run through. Each rank appends one JSON line per step to
OUT/rank<r>.jsonl and writes its final parameters to OUT/final_rank<r>.pt.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from agoq.models.config import LlamaConfig
from agoq.models.llama import Llama
from agoq.train.checkpoint import capture_rng_state, latest_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)


def main() -> None:
    """Train, checkpoint, and (once) die mid-save, as the arguments say."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-in-save-at", type=int, default=-1)
    ap.add_argument("--marker", type=Path)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.randint(0, CFG.vocab_size, (64, 17), generator=torch.Generator().manual_seed(0))
    model = Llama(CFG)
    model.reset_parameters(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(100 + rank)  # each dp rank draws its own batches

    step = 0
    resumed_from = None
    found = latest_checkpoint(args.root)
    if found is not None:
        step, extra = load_checkpoint(found, model, opt, layout={"dp": world})
        restore_rng_state(extra["rng"])
        resumed_from = step
    log = open(args.out / f"rank{rank}.jsonl", "a")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log.write(json.dumps({"event": "start", "restart": restarts, "resumed_from": resumed_from}) + "\n")
    log.flush()

    if rank == args.kill_rank and args.marker is not None and not args.marker.exists():
        original = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):  # the rank's data file is on disk, the save unfinished
            result = original(self, plan, planner)
            if Path(self.path).name == f"step_{args.kill_in_save_at:06d}.tmp":
                args.marker.write_text("killed\n")
                os._exit(17)
            return result

        dcp.FileSystemWriter.write_data = write_then_die

    while step < args.steps:
        rows = data[torch.randint(0, data.shape[0], (2,))]
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        step += 1
        log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        log.flush()
        if step % args.save_every == 0:
            save_checkpoint(args.root, step, model, opt, {"rng": capture_rng_state()}, layout={"dp": world})
    torch.save({n: p.detach() for n, p in model.named_parameters()}, args.out / f"final_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
