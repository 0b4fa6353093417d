"""A Trainer composed from parts, in one process with no process group and no config, against the
same steps run through the components `agoq train` builds (agoq.launch.components.build_run)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from agoq.activation.policy import make_policy, with_loss_path
from agoq.gradient.sync import PlainGradientSync
from agoq.models import Llama
from agoq.models.config import get_config
from agoq.train.optim import MasterWeightOptimizer
from agoq.train.optim_section import OptimSection
from agoq.train.trainer import Components, LoopSettings, RankContext, Trainer
from tests._data import data_args
from tests._dist import run_distributed

# Two layers of the tiny preset's shape at hidden 64; 3 steps of 4 sequences of 32 tokens in 2 micro-batches.
MODEL = {"hidden": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "intermediate": 160, "vocab_size": 512}
SEQ, BATCH, MICRO, STEPS, SEED = 32, 4, 2, 3, 0
OPTIM = OptimSection(lr=3e-3, min_lr=3e-3, warmup_steps=0)


class FakeLoader:
    """Fixed random token windows: inputs and the next tokens."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.windows = [torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
        self.taken = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.windows[self.taken]
        self.taken += 1
        return w[:, :-1], w[:, 1:]


def _cli_args(out_dir: str) -> list[str]:
    model = [f"--model.{k}={v}" for k, v in MODEL.items() if k != "vocab_size"]
    return [
        *model,
        *data_args(),
        f"--data.vocab_size={MODEL['vocab_size']}",
        f"--data.seq_len={SEQ}",
        f"--data.batch_size={BATCH}",
        "--parallel.pp=1",
        "--parallel.dp=1",
        f"--parallel.microbatches={MICRO}",
        "--precision.gradients=fp32",
        "--precision.compute_dtype=fp32",
        "--precision.quant_backend=torch",
        f"--optim.lr={OPTIM.lr}",
        f"--optim.min_lr={OPTIM.min_lr}",
        "--optim.warmup_steps=0",
        f"--train.steps={STEPS}",
        f"--train.seed={SEED}",
        "--train.eval_every=0",
        "--train.baseline=false",
        "--checkpoint.every=0",
        "--checkpoint.resume=false",
        f"--train.out_dir={out_dir}",
    ]


def _through_agoq_trains_components(rank: int, world: int, out_dir: str) -> dict:
    from agoq.launch.components import build_run
    from agoq.launch.config import load_config

    run = build_run(load_config(None, _cli_args(out_dir)))
    # The same loader as the hand-built Trainer's: everything else is what agoq train built.
    trainer = Trainer(dataclasses.replace(run.trainer.components, loader=FakeLoader()), run.trainer.settings)
    records = trainer.train()
    return {
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "policy": trainer.policy,
        "model": run.model_cfg,
        "threads": torch.get_num_threads(),
        "sync": type(trainer.sync).__name__,
    }


def _hand_built(threads: int) -> tuple[Trainer, list[dict]]:
    model_cfg = dataclasses.replace(get_config("tiny"), **MODEL)
    # The loss path of one stage without tensor parallelism (agoq.parallel.inflight): no recompute,
    # the LM head's weight gradient in backward.
    policy = with_loss_path(make_policy("agoq"), recompute=False, weight_grad_in_forward=False)
    model = Llama(model_cfg, policy, layers=range(model_cfg.n_layers), embed=True, head=True)
    model.reset_parameters(SEED)
    params = list(model.named_parameters())
    components = Components(
        ctx=RankContext.single("cpu"),
        modules=[model],
        params=params,
        policy=policy,
        sync=PlainGradientSync(params, None, torch.device("cpu"), torch.float32),
        optimizer=MasterWeightOptimizer(params, OPTIM),
        loader=FakeLoader(),
    )
    settings = LoopSettings(steps=STEPS, microbatches=MICRO, tokens_per_step=BATCH * SEQ, optim=OPTIM)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the worker's: a GEMM's sums may depend on how many threads split it
    try:
        made = set(os.listdir("."))
        trainer = Trainer(components, settings)
        assert set(os.listdir(".")) == made, "the Trainer's constructor wrote a file"
        return trainer, trainer.train()
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def agoq_train(tmp_path_factory):
    return run_distributed(_through_agoq_trains_components, 1, str(tmp_path_factory.mktemp("components")))[0]


def test_a_trainer_from_parts_runs_without_a_process_group_or_a_config_and_equals_agoq_trains_steps(agoq_train, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized()
    trainer, records = _hand_built(agoq_train["threads"])
    assert not dist.is_initialized(), "the Trainer joined a process group"
    assert agoq_train["sync"] == "PlainGradientSync" and agoq_train["model"] == trainer.modules[0].cfg
    assert agoq_train["policy"] == trainer.policy, "the hand-built policy is the one agoq train builds for this layout"
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert losses == agoq_train["losses"], f"from parts {losses}, agoq train's components {agoq_train['losses']}"
    assert [r["grad_norm"] for r in records] == agoq_train["grad_norms"]
    assert losses[-1] < losses[0], "three steps at lr 3e-3 lower the loss on fixed batches"
    assert trainer.step == STEPS and trainer.metrics is None and trainer.checkpointer is None
