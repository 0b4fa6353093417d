"""Learning-rate schedule and the fp32-master AdamW used by the trainer."""

import math

import pytest
import torch
import torch.nn as nn

from agoq.launch.config import OptimSection
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


def test_steps_whole_and_by_slices_match_torchs_own_fused_adamw_step_bit_for_bit():
    # MasterWeightOptimizer.step updates only the handed masters (torch's step looks at every
    # parameter), and large tensors (a 128K x 4096 embedding) are stepped a slice of their gradient
    # at a time so that no whole fp32 gradient is read back from 8 bits; neither may change the update.
    torch_model, whole_model, sliced_model = _model(torch.bfloat16), _model(torch.bfloat16), _model(torch.bfloat16)
    cfg = OptimSection(lr=1e-2, weight_decay=0.1)
    reference = MasterWeightOptimizer(torch_model.named_parameters(), cfg)
    whole = MasterWeightOptimizer(whole_model.named_parameters(), cfg)
    sliced = MasterWeightOptimizer(sliced_model.named_parameters(), cfg)
    assert sliced.steps_slices
    for _ in range(3):
        grads = [torch.randn_like(m) for m in whole.masters]
        for i, g in enumerate(grads):
            reference.masters[i].grad = g.clone()
        reference.optimizer.step()  # torch's own fused AdamW step over every group
        for i, g in enumerate(grads[:2]):
            whole.set_grad(i, g.clone())
        whole.step()  # two groups' worth of steps, as the syncs hand them
        whole.set_grad(2, grads[2].clone())
        whole.step()
        for i, g in enumerate(grads):
            flat, n = g.reshape(-1), g.numel()
            # Uneven slices on whole blocks, as the gradient syncs cut them. (A slice ending inside a
            # SIMD vector may round exp_avg_sq's last bit differently in the kernel's scalar tail.)
            bounds = [0, 256, 4096, n] if n > 4096 else [0, 64, n]
            sliced.step_slices(i, ((a, b, flat[a:b].clone()) for a, b in zip(bounds, bounds[1:])))
    for ref, a, b in zip(reference.masters, whole.masters, sliced.masters):
        assert torch.equal(ref, a) and torch.equal(ref, b)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            expected = reference.optimizer.state[ref][key]
            assert torch.equal(expected, whole.optimizer.state[a][key]) and torch.equal(expected, sliced.optimizer.state[b][key]), key
    for ref, p, q in zip(reference.masters, whole_model.parameters(), sliced_model.parameters()):
        assert torch.equal(p, ref.to(torch.bfloat16)) and torch.equal(p, q)


def test_slices_must_cover_the_parameter_in_order_and_need_fused_adamw():
    opt = MasterWeightOptimizer(_model(torch.float32).named_parameters(), OptimSection())
    n = opt.masters[0].numel()
    with pytest.raises(ValueError, match="cover it in order"):
        opt.step_slices(0, [(0, 10, torch.zeros(10)), (20, n, torch.zeros(n - 20))])
    with pytest.raises(ValueError, match=f"covered 10 of its {n} values"):
        opt.step_slices(0, [(0, 10, torch.zeros(10))])
    pytest.importorskip("torchao", reason="8-bit AdamW needs torchao (the dev extra installs it)")
    opt8 = MasterWeightOptimizer(_model(torch.float32).named_parameters(), OptimSection(name="adamw8bit"))
    assert not opt8.steps_slices
    with pytest.raises(RuntimeError, match="adamw8bit"):
        opt8.step_slices(0, [(0, n, torch.zeros(n))])


def test_step_slices_lets_each_slice_go_before_the_next_is_read():
    # The slices are gradients read back from 8 bits: two alive at once would double the optimizer
    # phase's temporaries.
    import weakref

    opt = MasterWeightOptimizer(_model(torch.float32).named_parameters(), OptimSection())
    n = opt.masters[0].numel()
    alive: list[weakref.ref] = []

    def read(numel: int) -> torch.Tensor:
        assert all(ref() is None for ref in alive), "the previous slice is still referenced"
        grad = torch.ones(numel)
        alive.append(weakref.ref(grad))
        return grad

    opt.step_slices(0, ((a, min(a + 1024, n), read(min(a + 1024, n) - a)) for a in range(0, n, 1024)))
    assert len(alive) == -(-n // 1024) > 1
