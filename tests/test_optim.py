"""Learning-rate schedule and the fp32-master AdamW used by the trainer."""

import math

import pytest
import torch
import torch.nn as nn

from agoq.train.config import OptimSection
from agoq.train.optim import MasterWeightOptimizer, lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimSection(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert lr_at(0, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(9, cfg, 110) == pytest.approx(1e-3)
    assert lr_at(60, cfg, 110) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, cfg, 110) == pytest.approx(1e-4)


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.LayerNorm(128)).to(dtype)


def test_bf16_model_follows_fp32_masters_like_plain_adamw():
    ref = _model(torch.float32)
    model = _model(torch.bfloat16)
    opt = MasterWeightOptimizer(model.named_parameters(), OptimSection(lr=1e-2, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(
        [{"params": [ref[0].weight], "weight_decay": 0.1}, {"params": list(ref[1].parameters()), "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    with torch.no_grad():
        for p, q in zip(ref.parameters(), opt.masters):
            p.copy_(q)
    for _ in range(3):
        grads = [torch.randn_like(m) for m in opt.masters]
        for i, g in enumerate(grads):
            opt.set_grad(i, g)
        opt.step()
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        ref_opt.step()
    for m, p, r in zip(opt.masters, model.parameters(), ref.parameters()):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))


def test_adamw8bit_takes_a_scheduled_lr_and_keeps_8bit_state():
    pytest.importorskip("torchao", reason="8-bit AdamW needs torchao (the dev extra installs it)")
    model = nn.Linear(256, 256, bias=False)
    opt = MasterWeightOptimizer(model.named_parameters(), OptimSection(name="adamw8bit", lr=1e-3))
    before = model.weight.detach().clone()
    opt.set_lr(5e-4)  # torchao keeps lr as a tensor: a float assignment would break its step
    opt.set_grad(0, torch.ones(256, 256))
    opt.step()
    assert float(opt.optimizer.param_groups[0]["lr"]) == pytest.approx(5e-4)
    assert not torch.equal(model.weight, before)
    # 2 bytes per value for both moments (1 byte each) plus block scales, far below AdamW's 8.
    assert opt.state_bytes() < 256 * 256 * 3
