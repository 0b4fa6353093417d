"""4-bit wire format and error feedback for the 8-bit gradient buffer (agoq.gradient.feedback).

Single process: what is sent plus the staged residual equals what the bucket holds (within the
residual's 8-bit rounding); over repeated steps the mean of what error feedback sends converges to
the true gradient where plain 4-bit rounding keeps its bias; a skipped step leaves the residual as it
was; the state round-trips. On a real gloo group of 3 ranks: identical results on every rank, the
4-bit wire bytes, ZeRO-1's reduce-scatter, and a non-finite step that leaves the residual unchanged.
Through `agoq train`: a run with int4-ef resumed from a checkpoint continues exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from agoq.gradient import QuantGradBuffer
from agoq.gradient.bucket import allocate_buckets
from agoq.gradient.collectives import gradient_format, int8_gradient_format
from agoq.gradient.feedback import WireEncoder
from agoq.gradient.layout import GradLayout
from agoq.quant import dequantize, quantize
from agoq.launch.config import load_config
from tests._dist import run_distributed
from tests.test_train import BASE as TRAIN_BASE
from tests._data import data_args, data_cache, train_corpus

WIRE = "int4/64"
STORAGE = int8_gradient_format(256)


def _filled_buckets(seed: int = 0, world: int = 2):
    buckets = allocate_buckets(GradLayout([1000, 3000], STORAGE, 4096, world))
    g = torch.Generator().manual_seed(seed)
    for b in buckets:
        b.load_flat(quantize(torch.randn(b.numel, generator=g), STORAGE))
    return buckets


def test_sent_plus_residual_is_what_the_bucket_holds():
    buckets = _filled_buckets()
    enc = WireEncoder(buckets, gradient_format(WIRE), error_feedback=True)
    b = buckets[0]
    held = dequantize(b.flat(), torch.float32)
    wire, layout = enc.encode(b)
    assert layout.fmt.name == WIRE and layout.padded_chunk == b.layout.padded_chunk
    enc.commit()
    sent, residual = dequantize(wire, torch.float32), dequantize(enc.residuals[0], torch.float32)
    # The 4-bit rounding is large; the residual holds it up to its own 8-bit rounding (half a step
    # of a scale 1/127 of the block's largest residual), about 1/18 of a 4-bit step.
    four_bit_error = (sent - held).abs().max()
    assert four_bit_error > 0.05
    assert (sent + residual - held).abs().max() <= four_bit_error / 16


def test_error_feedback_sends_the_true_mean_over_steps_and_plain_rounding_keeps_its_bias():
    steps = 20
    fed, plain = _filled_buckets(), _filled_buckets()
    with_ef = WireEncoder(fed, gradient_format(WIRE), error_feedback=True)
    without = WireEncoder(plain, gradient_format(WIRE), error_feedback=False)
    true = dequantize(fed[0].flat(), torch.float32)
    sum_ef, sum_plain = torch.zeros_like(true), torch.zeros_like(true)
    for _ in range(steps):
        sum_ef += dequantize(with_ef.encode(fed[0])[0], torch.float32)
        with_ef.commit()
        sum_plain += dequantize(without.encode(plain[0])[0], torch.float32)
    err_ef = float((sum_ef / steps - true).norm() / true.norm())
    err_plain = float((sum_plain / steps - true).norm() / true.norm())
    assert err_plain > 0.08  # int4/64 on Gaussian values: about 11% per step, every step alike
    # With feedback the sum telescopes: steps * g - the last residual, so the mean's error is 1/steps.
    assert err_ef < 1.5 * err_plain / steps


def test_a_discarded_step_leaves_the_residual_and_the_state_round_trips():
    buckets = _filled_buckets()
    enc = WireEncoder(buckets, gradient_format(WIRE), error_feedback=True)
    enc.encode(buckets[0])
    enc.commit()
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in enc.state_dict().items()}
    enc.encode(buckets[0])
    enc.discard()
    after = enc.state_dict()
    assert all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    fresh = WireEncoder(_filled_buckets(seed=1), gradient_format(WIRE), error_feedback=True)
    fresh.load_state_dict(before)
    assert all(torch.equal(fresh.state_dict()[k][n], before[k][n]) for k in before for n in before[k])
    with pytest.raises(ValueError, match="another bucket layout"):
        WireEncoder(allocate_buckets(GradLayout([100, 300], STORAGE, 512, 2)), gradient_format(WIRE), True).load_state_dict(
            {f"residual{b}": before["residual0"] for b in range(len(allocate_buckets(GradLayout([100, 300], STORAGE, 512, 2))))}
        )


def test_the_wire_block_must_divide_the_storage_block():
    with pytest.raises(ValueError, match="block size dividing the storage block 256"):
        WireEncoder(_filled_buckets(), gradient_format("int4/96"), error_feedback=False)
    with pytest.raises(ValueError, match="error_feedback needs a wire_fmt"):
        QuantGradBuffer([torch.nn.Parameter(torch.zeros(10))], error_feedback=True)


# ---- a real gloo group -------------------------------------------------------------------------


def _buffer_checks(rank: int, world: int) -> dict:
    from agoq.gradient import CommCounter

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3000, 700)]
    out = {}
    for name, kwargs in {"int8": {}, "int4": {"wire_fmt": WIRE}, "int4-ef": {"wire_fmt": WIRE, "error_feedback": True}}.items():
        counter = CommCounter()
        buf = QuantGradBuffer(params, bucket_numel=2048, counter=counter, op="avg", **kwargs)
        grads = []
        for step in range(3):
            buf.zero_grad()
            g = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(100 * step + rank + i)) for i, p in enumerate(params)]
            for i in reversed(range(len(params))):
                buf.fold(i, g[i])
            assert buf.finish()
            grads.append([buf.grad(i).numpy().copy() for i in range(len(params))])  # numpy: tensors do not outlive the process
        out[name] = {
            "grads": grads,
            "wire_bytes": counter.bytes("grad_all_reduce_8bit") // 3,
            "storage": buf.storage_bytes,
            "state": sorted(buf.state_dict()),
        }
    # A non-finite gradient on one rank: every rank skips, and no residual changes.
    counter = CommCounter()
    buf = QuantGradBuffer(params, bucket_numel=2048, counter=counter, wire_fmt=WIRE, error_feedback=True)
    buf.zero_grad()
    for i in reversed(range(len(params))):
        buf.fold(i, torch.ones(params[i].numel()))
    assert buf.finish()
    kept = {k: {n: t.clone() for n, t in v.items()} for k, v in buf.state_dict().items()}
    buf.zero_grad()
    for i in reversed(range(len(params))):
        g = torch.full((params[i].numel(),), 3.0)
        if rank == 1 and i == 0:
            g[5] = float("nan")
        buf.fold(i, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        skipped = not buf.finish()
    state = buf.state_dict()
    out["skip"] = {"skipped": skipped, "unchanged": all(torch.equal(kept[k][n], state[k][n]) for k in kept for n in kept[k])}
    # ZeRO-1's reduce-scatter with error feedback: each rank's fp32 shard.
    zero = QuantGradBuffer(params, bucket_numel=2048, collective="reduce_scatter", wire_fmt=WIRE, error_feedback=True)
    zero.zero_grad()
    for i in reversed(range(len(params))):
        zero.fold(i, torch.full((params[i].numel(),), float(rank + 1)))
    assert zero.finish()
    out["zero1_shards"] = [s.numpy().copy() for *_, s in zero.local_shards()]
    return out


@pytest.fixture(scope="module")
def group3():
    return run_distributed(_buffer_checks, 3)


@pytest.mark.parametrize("name", ["int8", "int4", "int4-ef"])
def test_every_rank_ends_with_identical_gradients(group3, name):
    for r in group3[1:]:
        for a, b in zip(r[name]["grads"], group3[0][name]["grads"]):
            assert all((x == y).all() for x, y in zip(a, b))


def test_the_4bit_wire_sends_its_bytes_and_error_feedback_keeps_one_8bit_residual(group3):
    r = group3[0]
    # int8/256 sends 1 + 4/256 bytes per value, int4/64 0.5 + 4/64: the same rows, in fewer bits.
    assert r["int4"]["wire_bytes"] / r["int8"]["wire_bytes"] == pytest.approx((0.5 + 4 / 64) / (1 + 4 / 256))
    assert r["int4-ef"]["wire_bytes"] == r["int4"]["wire_bytes"]
    assert r["int4"]["storage"] == r["int8"]["storage"]
    assert r["int4-ef"]["storage"] == 2 * r["int8"]["storage"]  # the residual is stored like the gradients
    assert r["int8"]["state"] == [] and r["int4-ef"]["state"] == ["residual0", "residual1"]


def test_a_skipped_step_leaves_every_ranks_residual_as_it_was(group3):
    for r in group3:
        assert r["skip"] == {"skipped": True, "unchanged": True}


def test_zero1_shards_with_error_feedback_are_the_mean(group3):
    # Constant gradients (1, 2, 3 on the three ranks) lie on every grid: the mean is 2 up to fp32 rounding.
    for r in group3:
        for shard in r["zero1_shards"]:
            values = torch.from_numpy(shard)
            values = values[values != 0]  # padding
            assert values.numel() > 0 and torch.allclose(values, torch.full_like(values, 2.0), rtol=1e-6, atol=0)


# ---- agoq train: the residual is resumed ---------------------------------------------------------


def _resume_runs(rank: int, world: int, cfgs: dict) -> dict:
    from agoq.launch.run import train_worker

    return {name: [r["loss"] for r in train_worker(cfg)["records"]] for name, cfg in cfgs.items()}


def test_an_int4_ef_run_resumed_from_a_checkpoint_continues_exactly(tmp_path):
    from agoq.data.tokens import prepare_data

    prepare_data(train_corpus(), None, 512, data_cache(), 0.01)
    common = [*TRAIN_BASE, "--parallel.pp=1", "--parallel.dp=2", "--precision.gradients=int4-ef", "--precision.compute_dtype=fp32"]

    def cfg(folder, *extra):
        return load_config(None, [*common, *data_args(), f"--train.out_dir={tmp_path / folder}", *extra])

    cfgs = {
        "straight": cfg("a", "--train.steps=4"),
        "first": cfg("b", "--train.steps=2", "--checkpoint.every=2"),
        "second": cfg("b", "--train.steps=4", "--checkpoint.resume=true"),
    }
    losses = run_distributed(_resume_runs, 2, cfgs)[0]
    assert losses["first"] == losses["straight"][:2]
    assert losses["second"] == losses["straight"][2:]  # bit-identical: the residuals were resumed
