"""A quantization block never spans two rows (tokens), whatever the width.

Token norms can differ 50x and more (embedding rows of rare tokens, outlier tokens). When a block
spanned the end of one token and the start of the next, the small token's 4-bit codes rounded to
zero and the backward recomputed its RMS as about sqrt(eps): gradients 1000x off at hidden 64, 2x
at hidden 192, with the loss unchanged. Rows are now stored padded to whole blocks; these tests
hold the gradients of uneven token norms to those of even ones, at widths that are not whole blocks,
for the Hugging Face patch and for agoq's own model, and count the bytes that costs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agoq.activation.accounting import layer_saved_bytes
from agoq.activation.meter import SavedBytesMeter
from agoq.activation.policy import make_policy
from agoq.models.config import LlamaConfig
from agoq.models.llama import Llama
from agoq.quant import dequantize, parse_format, quantize
from agoq.quant.formats import SCALE_BYTES

# hidden: (heads, intermediate). SmolLM's 576 and 960 with their own intermediate sizes; 64 and
# 192 with blocks of 128 straddling every second and every row boundary.
WIDTHS = {64: (2, 160), 192: (3, 520), 576: (9, 1536), 960: (15, 2560)}
VOCAB, LARGE = 256, range(200, 256)  # embedding rows 200-255 get norms 50x the others
BATCH, SEQ = 2, 48
# The worst parameter's error with token norms 50x apart, against the worst with even norms.
# Measured: at most 1.09x (HF) and 1.02x (agoq's model) across these widths; before rows were
# padded, 6,700x / 19x at hidden 64, 2.5x / 2.2x at 192, 1.44x / 1.47x at 576.
WORST_RATIO = 1.3


def _embedding_init(weight: torch.Tensor, uneven: bool) -> None:
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * 0.02)
        if uneven:
            weight[LARGE.start : LARGE.stop].mul_(50.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_errors(hidden: int, uneven: bool) -> dict[str, float]:
    transformers = pytest.importorskip("transformers")
    from agoq.integrations.hf import apply_agoq

    heads, inter = WIDTHS[hidden]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).float()
    _embedding_init(reference.model.embed_tokens.weight, uneven)
    patched = copy.deepcopy(reference)
    apply_agoq(patched)
    ids = _ids(1)
    reference(ids, labels=ids).loss.backward()
    patched(ids, labels=ids).loss.backward()
    want = dict(reference.named_parameters())
    return {name: _rel(p.grad, want[name].grad) for name, p in patched.named_parameters()}


def _own_errors(hidden: int, uneven: bool) -> dict[str, float]:
    heads, inter = WIDTHS[hidden]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden=hidden, n_layers=2, n_heads=heads, n_kv_heads=heads, intermediate=inter, max_seq_len=SEQ)
    reference = Llama(cfg, make_policy("bf16")).float()
    _embedding_init(reference.embed.weight, uneven)
    agoq = copy.deepcopy(reference)
    agoq.set_policy(make_policy("agoq"))
    ids, targets = _ids(1), _ids(2)
    reference(ids, targets).backward()
    agoq(ids, targets).backward()
    want = dict(reference.named_parameters())
    return {name: _rel(p.grad, want[name].grad) for name, p in agoq.named_parameters()}


@pytest.mark.parametrize("model", ["hf", "agoq"])
@pytest.mark.parametrize("hidden", sorted(WIDTHS))
def test_token_norms_50x_apart_leave_every_gradient_as_close_as_even_norms(model: str, hidden: int) -> None:
    errors = _hf_errors if model == "hf" else _own_errors
    even, uneven = errors(hidden, False), errors(hidden, True)
    assert even.keys() == uneven.keys()
    even_worst = max(even.values())
    assert 0.02 < even_worst < 0.5, even_worst  # 4-bit saved tensors are on, and their error bounded
    for name, err in uneven.items():
        assert err <= WORST_RATIO * even_worst, (name, err, even_worst)


@pytest.mark.parametrize("hidden", sorted(WIDTHS))
def test_saved_bytes_are_4_25_bits_a_value_plus_at_most_one_block_tail_a_row(hidden: int) -> None:
    heads, inter = WIDTHS[hidden]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden=hidden, n_layers=2, n_heads=heads, n_kv_heads=heads, intermediate=inter, max_seq_len=SEQ)
    policy = make_policy("agoq")
    model = Llama(cfg, policy).float()
    with SavedBytesMeter(model, {layer.index: layer for layer in model.layers.values()}) as meter:
        loss = model(_ids(1), _ids(2))
    kept = meter.layer_bytes(0)
    # The meter counts the tensors the ops really keep; the accounting the planner uses agrees to the byte.
    assert kept == layer_saved_bytes(BATCH, SEQ, hidden, heads, heads, cfg.head_dim, inter, torch.float32, policy.layer(0))
    tokens, block = BATCH * SEQ, policy.layer(0).norm_input.block_size
    for kind, width in (("norm_input", hidden), ("act_input", inter)):
        fmt = getattr(policy.layer(0), kind)
        assert fmt.bits == 4 and fmt.block_size == block
        tail = -width % block  # padded values per row
        # Two saved tensors of each kind per layer (two norms; gate and up).
        assert kept[kind] == 2 * tokens * ((width + tail) // 2 + SCALE_BYTES * -(-width // block))
        assert kept[kind] <= 2 * tokens * (width * 4.25 / 8 + block * 4.25 / 8)
    loss.backward()


@pytest.mark.parametrize("spec", ["int4/128", "int5/64", "nf4/64", "fp8/32"])
@pytest.mark.parametrize("shape", [(3, 5, 72), (7, 200), (4, 128), (2, 3)])
def test_each_row_is_quantized_alone(spec: str, shape: tuple[int, ...]) -> None:
    """Rows quantized together equal rows quantized one at a time, bit for bit, and their values too."""
    fmt = parse_format(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-3, 3, x.shape[-2], base=10.0)[:, None]  # row norms 10^6 apart
    q = quantize(x, fmt)
    rows = x.reshape(-1, shape[-1])
    assert q.stored_numel == rows.shape[0] * -(-shape[-1] // fmt.block_size) * fmt.block_size
    assert q.nbytes == fmt.stored_nbytes(shape)
    values = dequantize(q)
    for r in range(rows.shape[0]):
        alone = quantize(rows[r], fmt)
        part = q.rows(r, r + 1)
        whole_bytes = shape[-1] * fmt.bits // 8  # the row's own codes; the rest is its padding
        assert torch.equal(part.payload[:whole_bytes], alone.payload[:whole_bytes]) and torch.equal(part.scales, alone.scales)
        assert torch.equal(values.reshape(-1, shape[-1])[r], dequantize(alone))
        assert torch.equal(dequantize(part).view(-1), dequantize(alone))
