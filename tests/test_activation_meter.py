"""The saved-bytes meter counts what autograd really holds, and the analytical count equals it to the byte."""

from __future__ import annotations

import gc

import pytest
import torch

from agoq.activation import SavedBytesMeter, make_policy
from agoq.activation.accounting import U_bytes, layer_saved_bytes
from agoq.activation.meter import METER_KINDS, meter_scope
from agoq.models import Llama, get_config


def _meter_for(model: Llama) -> SavedBytesMeter:
    return SavedBytesMeter(model, layers={layer.index: layer for layer in model.layers.values()})


def test_meter_counts_each_storage_once_and_whole() -> None:
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 32))
    with SavedBytesMeter() as meter:
        y = x * 2  # saves nothing (constant factor)
        with meter_scope(layer=0, kind="gemm_input"):
            a = y @ w  # saves y and a view of w
            b = y[:16] @ w  # a view of y: the storage is already counted
        with meter_scope(layer=0, kind="act_input"):
            c = torch.sigmoid(a)  # saves its 64x32 fp32 output
    assert meter.layer_bytes(0)["gemm_input"] == 64 * 32 * 4
    assert meter.layer_bytes(0)["act_input"] == 64 * 32 * 4
    assert meter.parameter_bytes == 32 * 32 * 4
    assert meter.activation_bytes == 2 * 64 * 32 * 4
    del b, c


def test_storage_saved_by_two_layers_is_shared() -> None:
    table = torch.randn(8, 8)
    x = torch.randn(8, 8, requires_grad=True)
    with SavedBytesMeter() as meter:
        with meter_scope(layer=0):
            y = x * table
        with meter_scope(layer=1):
            z = y * table
    assert meter.shared_bytes == 8 * 8 * 4
    assert meter.layer_bytes(0)["other"] == 0
    assert meter.activation_bytes == 8 * 8 * 4
    del z


def test_meter_scope_is_a_no_op_without_a_meter() -> None:
    assert meter_scope(layer=3, kind="attention") is meter_scope(kind="norm_input")
    with pytest.raises(ValueError, match="unknown saved-tensor kind 'weights'"):
        with SavedBytesMeter():
            meter_scope(kind="weights")


@pytest.mark.parametrize("policy", ["bf16", "agoq", "uniform4"])
def test_meter_agrees_with_torch_memtracker(policy: str) -> None:
    """An independent count: MemTracker's activation memory alive after forward (output freed)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = get_config("tiny", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, intermediate=344, vocab_size=512)
    model = Llama(cfg, make_policy(policy, fused_loss=False)).to(torch.bfloat16)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        ids = torch.randint(0, cfg.vocab_size, (2, 48))
        with _meter_for(model) as meter:
            hidden = model.hidden_states(ids)
        graph = hidden.grad_fn  # keeps what backward needs alive, frees the output itself
        del hidden
        gc.collect()
        snapshot = tracker.get_tracker_snapshot("current")
    activations = sum(v for dev in snapshot.values() for k, v in dev.items() if str(getattr(k, "value", k)) == "Activation")
    # MemTracker also sees the input ids and the rotary tables (created inside it); the meter sees
    # them too: the ids as saved by the embedding, the tables as shared by every layer.
    assert meter.activation_bytes == activations
    assert meter.shared_bytes == 2 * 48 * cfg.head_dim * 4
    del graph


SHAPES = [
    # (batch, seq, model overrides)
    (2, 48, dict(hidden=128, n_heads=4, n_kv_heads=2, intermediate=344)),  # GQA, LLaMA-like 8/3 h
    (1, 37, dict(hidden=96, n_heads=3, n_kv_heads=3, intermediate=200)),  # MHA, odd seq, 37*96 % 128 != 0
    (3, 20, dict(hidden=192, n_heads=6, n_kv_heads=1, intermediate=512)),  # MQA, head_dim 32
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,seq,overrides", SHAPES)
def test_meter_equals_accounting_to_the_byte(batch: int, seq: int, overrides: dict, dtype: torch.dtype) -> None:
    cfg = get_config("tiny", n_layers=2, vocab_size=256, **overrides)
    policies = [
        make_policy("bf16"),
        make_policy("agoq"),
        make_policy("uniform4"),
        make_policy("agoq", layer_bits=[5, 8]),
        make_policy("agoq", formats={"act_input": "nf4/64", "norm_input": None}),
        make_policy("uniform4", formats={"out_proj_input": None, "attention": "int8/32"}),
    ]
    model = Llama(cfg, policies[0]).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    for policy in policies:
        model.set_policy(policy)
        with _meter_for(model) as meter:
            loss = model(ids, ids)
        for index in model.layer_range:
            expected = layer_saved_bytes(
                batch, seq, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, dtype, policy.layer(index)
            )
            assert meter.layer_bytes(index) == expected, (policy, index)
        loss.backward()


def test_agoq_keeps_under_30_percent_of_the_baseline_per_layer() -> None:
    """The per-layer target (paper: 7.75U / 28U = 0.277) for the tiny model and LLaMA-3 8B shapes."""
    for name in ("tiny", "llama3-8b"):
        cfg = get_config(name)
        args = (2, 512, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, torch.bfloat16)
        base = sum(layer_saved_bytes(*args, make_policy("bf16").layer(0)).values())
        agoq = sum(layer_saved_bytes(*args, make_policy("agoq").layer(0)).values())
        assert agoq / base <= 0.30, (name, agoq / base)
        assert base / U_bytes(2, 512, cfg.hidden) > 15


def test_accounting_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="seq must be a positive integer, got 0"):
        layer_saved_bytes(1, 0, 64, 4, 4, 16, 128, torch.bfloat16, make_policy("agoq").layer(0))
    assert set(layer_saved_bytes(1, 4, 64, 4, 4, 16, 128, torch.bfloat16, make_policy("agoq").layer(0))) == set(METER_KINDS)


def test_out_projection_copy_is_quantized_when_attention_output_is_not_a_view() -> None:
    """If the caller copies the attention output, the out-projection saves a 4-bit copy (0.25U + scales)."""
    from agoq.activation import causal_attention, saved_input_linear
    from agoq.quant import parse_format

    fmt = parse_format("int4/128")
    q, k, v = (torch.randn(2, h, 16, 32, requires_grad=True) for h in (4, 2, 2))
    w = torch.nn.Parameter(torch.randn(128, 128))
    with SavedBytesMeter() as meter:
        o = causal_attention(q, k, v, None).transpose(1, 2).reshape(2, 16, 128)
        y_view = saved_input_linear(o, w, fmt)
    assert meter.layer_bytes(None)["out_proj_input"] == 0
    with SavedBytesMeter() as meter:
        o = causal_attention(q, k, v, None).transpose(1, 2).contiguous().clone().reshape(2, 16, 128)
        y_copy = saved_input_linear(o, w, fmt)
    assert meter.layer_bytes(None)["out_proj_input"] == fmt.nbytes(2 * 16 * 128)
    torch.testing.assert_close(y_view, y_copy)
