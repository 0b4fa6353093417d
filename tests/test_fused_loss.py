"""The chunked LM head + cross-entropy equals the plain path and keeps no [tokens, vocab] tensor."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from agoq.activation.loss import (
    CHUNK_LOGITS_BYTES,
    CHUNK_ROWS_PER_HIDDEN,
    chunked_lm_head_cross_entropy,
    default_chunk_size,
    loss_saved_bytes,
    plain_lm_head_cross_entropy,
)
from benchmarks.loss import saved_bytes

IGNORE = -100


def _problem(dtype: torch.dtype, shape=(2, 37), hidden=32, vocab=300, ignored=7, seed=0):
    """Random hidden states, head weight and targets with ``ignored`` ignore-index targets."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 4).to(dtype)
    t = torch.randint(0, vocab, shape, generator=gen)
    t.view(-1)[torch.randperm(t.numel(), generator=gen)[:ignored]] = IGNORE
    return h, w, t


def _run(fn, h, w, t, upstream=None, **kw):
    """Loss, hidden gradient and weight gradient of fn, backpropagating ``upstream`` (default 1.7)."""
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss = fn(h, w, t, **kw)
    if upstream is None:
        upstream = torch.full_like(loss, 1.7)
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 distance of x from ref."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_loss_and_gradients_equal_the_plain_path(reduction, label_smoothing, recompute):
    h, w, t = _problem(torch.float32)
    upstream = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, ignore_index=IGNORE)
    ref = _run(plain_lm_head_cross_entropy, h, w, t, upstream, **kw)
    # 16 does not divide the 74 tokens: the last chunk is partial.
    got = _run(chunked_lm_head_cross_entropy, h, w, t, upstream, chunk_size=16, recompute=recompute, **kw)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


def test_result_does_not_depend_on_chunk_size():
    h, w, t = _problem(torch.float32)
    ref = _run(chunked_lm_head_cross_entropy, h, w, t, chunk_size=1)
    for chunk in (5, 74, 1000, None):
        got = _run(chunked_lm_head_cross_entropy, h, w, t, chunk_size=chunk)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.0)])
def test_bf16_is_within_bf16_rounding_of_the_plain_path(reduction, label_smoothing, recompute):
    h, w, t = _problem(torch.bfloat16, shape=(3, 50), hidden=64, vocab=500)
    upstream = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    plain = _run(plain_lm_head_cross_entropy, h, w, t, upstream, **kw)
    fused = _run(chunked_lm_head_cross_entropy, h, w, t, upstream, chunk_size=32, recompute=recompute, **kw)
    exact = _run(plain_lm_head_cross_entropy, h.double(), w.double(), t, upstream, **kw)
    # The loss comes from the same bf16 logits in fp32: equal up to fp32 summation order.
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    for f, p, e in zip(fused[1:], plain[1:], exact[1:]):
        assert f.dtype == torch.bfloat16
        # bf16 has a relative spacing of 2**-8; the gradients may differ from the plain path's by
        # two roundings (chunk products rounded before their fp32 sum, the upstream scaling) ...
        assert _rel(f, p) < 2**-7
        # ... and are no further from the fp64 result than the plain path is, within one rounding.
        assert _rel(f, e) < _rel(p, e) + 2**-8


@pytest.mark.parametrize("recompute", [False, True])
def test_a_one_chunk_bf16_loss_holds_no_more_temporaries_than_the_plain_path(recompute):
    # One chunk (the micro-batch of the default run: 256 tokens, vocab 4096, hidden 256): the
    # weight gradient is the chunk's product itself, not an fp32 sum through blocks (which held
    # three weight-sized buffers more than the plain path: 12 MiB against 10 MiB here).
    from agoq.train.saved import SavedActivationTracker

    h, w, t = _problem(torch.bfloat16, shape=(2, 128), hidden=256, vocab=4096, ignored=0)
    peaks = {}
    for name, fn, kw in (
        ("plain", plain_lm_head_cross_entropy, {}),
        ("fused", chunked_lm_head_cross_entropy, {"recompute": recompute}),
    ):
        tracker = SavedActivationTracker()
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with tracker.temporaries() as temps:
            with tracker:
                loss = fn(hh, ww, t, **kw)
            loss.backward()
        peaks[name] = temps.peak_temporary_bytes
        if name == "plain":
            ref = ww.grad
        else:
            assert ww.grad.dtype == torch.bfloat16
            assert _rel(ww.grad, ref) < 2**-7
    assert peaks["fused"] <= peaks["plain"], peaks


def test_tied_embedding_weight_receives_both_gradients():
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(64, 16, generator=gen).requires_grad_()
    proj = torch.randn(16, 16, generator=gen) * 0.25
    tokens = torch.randint(0, 64, (4, 9), generator=gen)
    targets = torch.randint(0, 64, (4, 9), generator=gen)
    grads = []
    for fn in (plain_lm_head_cross_entropy, chunked_lm_head_cross_entropy):
        emb.grad = None
        hidden = torch.tanh(F.embedding(tokens, emb) @ proj)
        kw = {"chunk_size": 8} if fn is chunked_lm_head_cross_entropy else {}
        fn(hidden, emb, targets, **kw).backward()
        grads.append(emb.grad.clone())
    # Rows of tokens never seen at the input still get the head's gradient, and vice versa: the
    # sum of both uses must match.
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    head_only = torch.autograd.grad(plain_lm_head_cross_entropy(torch.tanh(F.embedding(tokens, emb.detach()) @ proj), emb, targets), emb)[0]
    assert (grads[1] - head_only).abs().max() > 1e-3  # the embedding use contributed too


@pytest.mark.parametrize("fn", [plain_lm_head_cross_entropy, chunked_lm_head_cross_entropy])
def test_all_targets_ignored_gives_nan_mean_zero_sum_and_zero_gradients(fn):
    h, w, _ = _problem(torch.float32)
    t = torch.full(h.shape[:-1], IGNORE)
    for reduction, expected in (("mean", math.nan), ("sum", 0.0)):
        for eps in (0.0, 0.2):
            loss, gh, gw = _run(fn, h, w, t, reduction=reduction, label_smoothing=eps)
            assert math.isnan(loss.item()) if math.isnan(expected) else loss.item() == expected
            assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_only_the_requested_gradients_are_computed():
    h, w, t = _problem(torch.float32)
    ref = _run(plain_lm_head_cross_entropy, h, w, t)
    hh = h.clone().requires_grad_()
    chunked_lm_head_cross_entropy(hh, w, t, chunk_size=16).backward(torch.tensor(1.7))
    torch.testing.assert_close(hh.grad, ref[1], rtol=1e-5, atol=1e-7)
    ww = w.clone().requires_grad_()
    chunked_lm_head_cross_entropy(h, ww, t, chunk_size=16).backward(torch.tensor(1.7))
    torch.testing.assert_close(ww.grad, ref[2], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        loss = chunked_lm_head_cross_entropy(h, w.requires_grad_(), t)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused,recompute", [(False, False), (True, False), (True, True)])
def test_loss_saved_bytes_equals_measured_bytes(dtype, fused, recompute):
    tokens, hidden, vocab = 96, 32, 500
    h, w, t = _problem(dtype, shape=(tokens,), hidden=hidden, vocab=vocab)
    h.requires_grad_()
    w.requires_grad_()
    if fused:
        measured, loss = saved_bytes(lambda: chunked_lm_head_cross_entropy(h, w, t, chunk_size=40, recompute=recompute), exclude=[w])
    else:
        measured, loss = saved_bytes(lambda: plain_lm_head_cross_entropy(h, w, t), exclude=[w])
    assert measured == loss_saved_bytes(tokens, hidden, vocab, dtype, fused, recompute=recompute)


def test_fused_saved_bytes_per_token_do_not_depend_on_vocab():
    hidden = 32

    def measured(fn, tokens, vocab):
        h, w, t = _problem(torch.bfloat16, shape=(tokens,), hidden=hidden, vocab=vocab)
        h.requires_grad_()
        w.requires_grad_()
        return saved_bytes(lambda: fn(h, w, t), exclude=[w])[0]

    fused = chunked_lm_head_cross_entropy
    recompute = lambda h, w, t: chunked_lm_head_cross_entropy(h, w, t, recompute=True)  # noqa: E731
    for vocab in (256, 4096):
        per_token = {
            name: (measured(fn, 128, vocab) - measured(fn, 64, vocab)) / 64
            for name, fn in (("plain", plain_lm_head_cross_entropy), ("fused", fused), ("recompute", recompute))
        }
        assert per_token["plain"] == hidden * 2 + 4 * vocab + 8  # the fp32 log-probs grow with vocab
        assert per_token["fused"] == hidden * 2  # only the bf16 hidden-state gradient
        assert per_token["recompute"] == hidden * 2 + 8  # the hidden states and the targets
        # Per step, the fused path adds only the [vocab, hidden] weight gradient; recompute nothing.
        assert measured(fused, 64, vocab) == 64 * hidden * 2 + vocab * hidden * 2
        assert measured(recompute, 64, vocab) == measured(recompute, 64, 256)


class _TinyLM(nn.Module):
    """Embedding -> linear + GELU -> LM head (optionally tied to the embedding)."""

    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Linear(hidden, hidden)
        self.head = self.embed.weight if tied else nn.Parameter(torch.randn(vocab, hidden) * hidden**-0.5)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, fused: bool) -> torch.Tensor:
        hidden = F.gelu(self.mlp(self.embed(tokens)))
        fn = chunked_lm_head_cross_entropy if fused else plain_lm_head_cross_entropy
        kw = {"chunk_size": 24} if fused else {}
        return fn(hidden, self.head, targets, label_smoothing=0.05, **kw)


@pytest.mark.parametrize("tied", [True, False])
def test_training_with_the_fused_loss_follows_the_plain_loss_step_for_step(tied):
    vocab, hidden, steps = 96, 24, 25
    data = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(steps):
        # A learnable stream: each token determines the next (x -> 5x + 3 mod vocab).
        cols = [torch.randint(0, vocab, (4,), generator=data)]
        for _ in range(16):
            cols.append((5 * cols[-1] + 3) % vocab)
        seq = torch.stack(cols, dim=1)
        targets = seq[:, 1:].clone()
        targets[:, :3] = IGNORE  # a masked prompt
        batches.append((seq[:, :-1], targets))
    curves, params = [], []
    for fused in (False, True):
        torch.manual_seed(0)
        model = _TinyLM(vocab, hidden, tied)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for tokens, targets in batches:
            loss = model(tokens, targets, fused)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert curves[0][-1] < curves[0][0] - 0.3  # it learns
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-5, atol=0.0)
    torch.testing.assert_close(params[1], params[0], rtol=0.0, atol=1e-5)


def test_default_chunk_keeps_fp32_logits_within_the_budget():
    for vocab, hidden in ((4096, 256), (32000, 4096), (128256, 4096), (256000, 8192)):
        chunk = default_chunk_size(vocab, hidden)
        assert chunk % 8 == 0
        assert chunk * vocab * 4 <= CHUNK_LOGITS_BYTES and chunk <= CHUNK_ROWS_PER_HIDDEN * hidden
        # the largest such multiple of 8
        assert chunk == CHUNK_ROWS_PER_HIDDEN * hidden or (chunk + 8) * vocab * 4 > CHUNK_LOGITS_BYTES
    assert default_chunk_size(4096, 256) == 512  # a small model: the row bound decides
    assert default_chunk_size(128256, 4096) == 520  # a large vocabulary: the byte budget decides
    assert default_chunk_size(4096, 256, rows_per_hidden=None) == CHUNK_LOGITS_BYTES // (4 * 4096)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(label_smoothing=1.5), "label_smoothing must be in"),
        (dict(chunk_size=0), "chunk_size must be a positive"),
        (dict(targets=torch.full((2, 37), 300)), "target 300 is out of range for vocab 300"),
        (dict(targets=torch.zeros(2, 36, dtype=torch.long)), "targets must have hidden's leading shape"),
        (dict(targets=torch.zeros(2, 37, dtype=torch.int32)), "targets.long()"),
        (dict(weight=torch.zeros(300, 31)), "hidden's last dimension must equal"),
        (dict(weight=torch.zeros(300, 32, dtype=torch.bfloat16)), "must share one floating dtype"),
    ],
)
def test_bad_arguments_raise_a_message_that_names_them(kwargs, message):
    h, w, t = _problem(torch.float32)
    args = {"hidden": h, "weight": w, "targets": t, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        chunked_lm_head_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


def _hooked_weight(w: torch.Tensor) -> tuple[nn.Parameter, list[torch.Tensor]]:
    """A leaf copy of ``w`` whose post-accumulate hook records each gradient and drops it, as a gradient buffer's fold does."""
    leaf = nn.Parameter(w.clone())
    delivered: list[torch.Tensor] = []

    def fold(p: torch.Tensor) -> None:
        delivered.append(p.grad)
        p.grad = None

    leaf.register_post_accumulate_grad_hook(fold)
    return leaf, delivered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [16, None])  # several chunks, and one
def test_the_weight_gradient_delivered_in_forward_is_the_recompute_paths_bit_for_bit(dtype, chunk_size):
    h, w, t = _problem(dtype, shape=(2, 37), hidden=32, vocab=300)
    divisor = 3
    hr = h.clone().requires_grad_()
    wr, from_recompute = _hooked_weight(w)
    loss_r = chunked_lm_head_cross_entropy(hr, wr, t, chunk_size=chunk_size, recompute=True) / divisor
    loss_r.backward()

    hf = h.clone().requires_grad_()
    wf, in_forward = _hooked_weight(w)
    loss_f = chunked_lm_head_cross_entropy(hf, wf, t, chunk_size=chunk_size, weight_grad_in_forward=True, divisor=divisor)
    assert len(in_forward) == 1, "the weight's gradient reaches its hook during forward"
    loss_f.backward()
    assert len(in_forward) == 1, "and only then: backward delivers nothing more"
    assert len(from_recompute) == 1
    assert torch.equal(in_forward[0], from_recompute[0])
    assert torch.equal(hf.grad, hr.grad)
    assert torch.equal(loss_f.detach(), loss_r.detach())


def test_a_loss_whose_weight_gradient_went_in_forward_refuses_another_grad_output():
    h, w, t = _problem(torch.float32)
    leaf, delivered = _hooked_weight(w)
    loss = chunked_lm_head_cross_entropy(h.clone().requires_grad_(), leaf, t, weight_grad_in_forward=True, divisor=2)
    with pytest.raises(RuntimeError, match="grad_output of 1.*divisor="):
        (loss * 2).backward()


def test_without_gradients_nothing_is_delivered_in_forward():
    h, w, t = _problem(torch.float32)
    leaf, delivered = _hooked_weight(w)
    with torch.no_grad():
        loss = chunked_lm_head_cross_entropy(h, leaf, t, weight_grad_in_forward=True, divisor=2)
    ref = chunked_lm_head_cross_entropy(h, w, t) / 2
    assert delivered == [] and torch.equal(loss, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_saved_bytes_with_the_weight_gradient_in_forward_equals_measured_bytes(dtype):
    tokens, hidden, vocab = 96, 32, 500
    h, w, t = _problem(dtype, shape=(tokens,), hidden=hidden, vocab=vocab)
    h.requires_grad_()
    leaf, _ = _hooked_weight(w)
    measured, _ = saved_bytes(
        lambda: chunked_lm_head_cross_entropy(h, leaf, t, chunk_size=40, weight_grad_in_forward=True, divisor=4), exclude=[leaf]
    )
    assert measured == loss_saved_bytes(tokens, hidden, vocab, dtype, True, recompute=True, weight_grad_in_forward=True)
    assert measured < loss_saved_bytes(tokens, hidden, vocab, dtype, True, recompute=True)  # the targets are not kept
