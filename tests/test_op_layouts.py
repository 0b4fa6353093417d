"""Each fused custom op declares what it saves and returns once (agoq.activation.layouts): the
declarations round-trip, refuse a mismatch, and torch.library.opcheck finds every op's fake kernel,
schema and autograd consistent with its real kernel, adapters included."""

from __future__ import annotations

import pytest
import torch

from agoq.activation import ops
from agoq.activation.layouts import Layout, SavedAdapter, adapter_arguments, saved_adapters
from agoq.activation.lora import LoraAdapter
from agoq.parallel import tensor_ops

FMT = "int4/32"


def test_a_layout_flattens_in_order_and_unflattens_each_group_to_its_length():
    layout = Layout("payload", "masks*", "weight", "lora_a*")
    flat, lengths = layout.flatten(payload="p", masks=["m0", "m1"], weight="w", lora_a=["a0"])
    assert flat == ["p", "m0", "m1", "w", "a0"] and lengths == (2, 1)
    back = layout.unflatten(flat, lengths)
    assert (back.payload, back.masks, back.weight, back.lora_a) == ("p", ["m0", "m1"], "w", ["a0"])
    empty, no_lists = layout.flatten(payload="p", masks=[], weight="w", lora_a=[])
    assert empty == ["p", "w"] and no_lists == (0, 0) and layout.unflatten(empty, no_lists).masks == []


def test_a_layout_refuses_a_missing_group_and_lengths_that_do_not_cover_the_items():
    layout = Layout("payload", "weights*")
    with pytest.raises(TypeError, match="got"):
        layout.flatten(payload=1)
    with pytest.raises(ValueError, match="covers 3 items, not 4"):
        layout.unflatten([1, 2, 3, 4], (2,))


def test_adapter_records_become_an_ops_lists_and_back():
    a0, b0, a1, b1 = (torch.randn(2, 3) for _ in range(4))
    records = [SavedAdapter(LoraAdapter(a0, b0, 2.0, 0.1), target=1, need_a=True), SavedAdapter(LoraAdapter(a1, b1, 0.5), target=0, need_b=True)]
    args = adapter_arguments(records, "lora_a", "lora_b", "lora_target", "lora_scale", "lora_p", "need_a", "need_b")
    assert args["lora_target"] == [1, 0] and args["lora_scale"] == [2.0, 0.5] and args["lora_p"] == [0.1, 0.0]
    assert args["need_a"] == [True, False] and args["need_b"] == [False, True] and args["lora_a"][1] is a1
    back = saved_adapters(**args)
    assert [(r.target, r.need_a, r.need_b, r.adapter.scale, r.adapter.dropout) for r in back] == [
        (1, True, False, 2.0, 0.1),
        (0, False, True, 0.5, 0.0),
    ]
    assert back[0].adapter.a is a0 and back[1].adapter.b is b1


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).requires_grad_()


# opcheck compares runs of an op: dropout (a random mask each run) stays off; the masks' path is
# covered by tests/test_lora.py against PEFT.
@pytest.mark.parametrize("adapters", [0, 2], ids=["plain", "two-adapters"])
def test_opcheck_passes_for_the_fused_ops_with_and_without_adapters(adapters):
    torch.manual_seed(0)
    hidden, rank = 64, 4
    x = _leaf(2, 8, hidden)
    weights = [_leaf(32, hidden), _leaf(48, hidden)]
    lora_a = [_leaf(rank, hidden) for _ in range(adapters)]
    lora_b = [_leaf(48 if t else 32, rank) for t in range(adapters)]
    targets, scales, ps = list(range(adapters)), [2.0] * adapters, [0.0] * adapters
    torch.library.opcheck(ops._norm_linear_op, (x, _leaf(hidden), weights, 1e-5, FMT, lora_a, lora_b, targets, scales, ps))
    gate, up, down = _leaf(2, 8, 96), _leaf(2, 8, 96), _leaf(hidden, 96)
    swiglu_a = [_leaf(rank, 96) for _ in range(adapters)]
    swiglu_b = [_leaf(hidden, rank) for _ in range(adapters)]
    torch.library.opcheck(ops._swiglu_linear_op, (gate, up, down, FMT, swiglu_a, swiglu_b, scales, ps))
    torch.library.opcheck(
        ops._saved_input_linear_op, (x, _leaf(32, hidden), FMT, lora_a[:1], [_leaf(32, rank)] * min(adapters, 1), scales[:1], ps[:1])
    )


@pytest.mark.parametrize("adapters", [0, 2], ids=["plain", "two-adapters"])
def test_opcheck_passes_for_the_backward_ops_on_what_their_forward_saved(adapters):
    torch.manual_seed(0)
    hidden, rank, f = 64, 4, ops.parse_format(FMT)
    x, nw = torch.randn(2, 8, hidden), torch.randn(hidden)
    weights = [torch.randn(32, hidden), torch.randn(48, hidden)]
    lora_a = [torch.randn(rank, hidden) for _ in range(adapters)]
    lora_b = [torch.randn(48 if t else 32, rank) for t in range(adapters)]
    targets, scales, ps = list(range(adapters)), [2.0] * adapters, [0.0] * adapters
    out = ops._norm_linear_op(x, nw, weights, 1e-5, FMT, lora_a, lora_b, targets, scales, ps)
    payload, scales_x, *masks = out[2:]
    grads = [torch.randn(2, 8, 32), None]  # the second output unused: its weight and adapter get no gradient
    need_a, need_b = [True] * adapters, [t == 0 for t in range(adapters)]
    torch.library.opcheck(
        ops._norm_linear_backward_op,
        (grads, payload, scales_x, nw, weights, [2, 8, hidden], torch.float32, 1e-5, FMT, True, [True, True],
         lora_a, lora_b, targets, scales, ps, masks, need_a, need_b),
    )  # fmt: skip
    gate, up, down = torch.randn(2, 8, 96), torch.randn(2, 8, 96), torch.randn(hidden, 96)
    sa, sb = [torch.randn(rank, 96) for _ in range(adapters)], [torch.randn(hidden, rank) for _ in range(adapters)]
    gp, gs, up_p, up_s, *smasks = ops._swiglu_linear_op(gate, up, down, FMT, sa, sb, scales, ps)[1:]
    torch.library.opcheck(
        ops._swiglu_linear_backward_op,
        (torch.randn(2, 8, hidden), gp, gs, up_p, up_s, down, [2, 8, 96], torch.float32, [2, 8, 96], torch.float32, FMT, False,
         sa, sb, scales, ps, smasks, need_a, need_b),
    )  # fmt: skip
    q = ops._quantize_saved(x, f)
    la, lb = lora_a[:1], [torch.randn(32, rank)] * min(adapters, 1)
    lmasks = [torch.empty(0, dtype=torch.uint8)] * len(la)
    torch.library.opcheck(
        ops._saved_input_lora_grads_op,
        (
            torch.randn(2, 8, 32),
            q.payload,
            q.scales,
            [2, 8, hidden],
            torch.float32,
            FMT,
            la,
            lb,
            scales[:1],
            ps[:1],
            lmasks,
            need_a[:1],
            [False] * len(la),
        ),
    )


def _sp_norm_linear_opcheck(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from agoq.gradient.counter import CommCounter

    torch.manual_seed(0)
    counter = CommCounter()
    group, key = tensor_ops.register_group(dist.group.WORLD), tensor_ops.register_counter(counter)
    x = _leaf(2, 8, 64)
    nw, weights = _leaf(64), [_leaf(32, 64), _leaf(16, 64)]
    torch.library.opcheck(tensor_ops._sp_norm_linear_op, (x, nw, weights, 1e-5, FMT, group, key))
    payload, scales = tensor_ops._sp_norm_linear_op(x.detach(), nw.detach(), [w.detach() for w in weights], 1e-5, FMT, group, key)[-2:]
    args = (
        [torch.randn(2, 8, 32), None],
        payload,
        scales,
        nw.detach(),
        [w.detach() for w in weights],
        [2, 8, 64],
        torch.float32,
        1e-5,
        FMT,
        group,
        key,
    )
    torch.library.opcheck(tensor_ops._sp_norm_linear_backward_op, (*args, True, [True, True]))
    return True


def test_opcheck_passes_for_the_sequence_parallel_norm_linear_on_a_one_rank_group():
    from tests._dist import run_distributed

    assert run_distributed(_sp_norm_linear_opcheck, 1) == [True]
