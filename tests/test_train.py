"""`agoq train` end to end on a real gloo group of 4 ranks (pp=2 x dp=2).

One process group runs every run (spawning costs seconds); the tests assert on what it returned:
each schedule lowers the loss, the pipelined loss equals the unpipelined model's on the same batch,
a resumed run continues exactly like an uninterrupted one, and stage-aware bits raise precision
without raising the peak over ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agoq.train.config import ConfigError, load_config
from tests._dist import run_distributed

BASE = [
    "--model.hidden=64", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.intermediate=160",
    "--data.vocab_size=512", "--data.seq_len=32", "--data.batch_size=8", "--parallel.microbatches=2",
    "--optim.warmup_steps=0", "--optim.lr=3e-3", "--optim.min_lr=3e-3",
    "--train.eval_every=0", "--train.baseline=false", "--checkpoint.every=0", "--checkpoint.resume=false",
]


def _cfg(tmp, name, *extra):
    cfg = load_config(None, BASE + [f"--data.cache_dir={tmp / 'cache'}", f"--train.out_dir={tmp / name}", *extra])
    return cfg


def _losses(result: dict) -> list[float]:
    return [r["loss"] for r in result["records"]]


def _runs(rank: int, world: int, cfgs: dict) -> dict:
    from agoq.train.run import train_worker

    torch.manual_seed(0)
    out = {}
    for name, cfg in cfgs.items():
        res = train_worker(cfg)
        out[name] = {"losses": _losses(res), "stats": res["ranks"][rank] if "ranks" in res else res["stats"]}
        if "config" in res:
            out[name]["vocab"] = res["config"]["model"]["overrides"]["vocab_size"]
        if "ranks" in res:
            out[name]["all_stats"] = res["ranks"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from agoq.train.data import prepare_data

    tmp = tmp_path_factory.mktemp("train")
    prepare_data(None, None, 512, tmp / "cache", 0.01)  # build the cache once, before the ranks start
    fp32_plain = ["--precision.compute_dtype=fp32", "--precision.activations=bf16", "--precision.gradients=fp32"]
    cfgs = {
        "1f1b_fp32": _cfg(tmp, "a", "--train.steps=4", *fp32_plain),
        "gpipe_agoq": _cfg(tmp, "b", "--train.steps=3", "--parallel.schedule=gpipe"),
        "interleaved_agoq": _cfg(tmp, "c", "--train.steps=3", "--parallel.schedule=interleaved-1f1b", "--parallel.virtual_stages=2"),
        "ring8_recompute": _cfg(tmp, "g", "--train.steps=3", "--precision.activations=bf16", "--precision.gradients=ring8", "--precision.recompute_layers=1"),
        "resume_first_half": _cfg(tmp, "d", "--train.steps=2", "--checkpoint.every=2", *fp32_plain),
        "resume_second_half": _cfg(tmp, "d", "--train.steps=4", "--checkpoint.resume=true", *fp32_plain),
        "uniform4": _cfg(tmp, "e", "--train.steps=1", "--precision.stage_bits=uniform", "--precision.compute_dtype=fp32"),
        "dbca": _cfg(tmp, "f", "--train.steps=1", "--precision.stage_bits=dbca", "--precision.compute_dtype=fp32"),
        # torchao's step is torch.compile'd: the step that counts temporaries runs it eagerly.
        "adamw8bit": _cfg(tmp, "h", "--train.steps=2", "--optim.name=adamw8bit"),
    }
    results = run_distributed(_runs, 4, cfgs)
    return {"cfgs": cfgs, "results": results, "tmp": tmp}


@pytest.mark.parametrize("name", ["1f1b_fp32", "gpipe_agoq", "interleaved_agoq", "ring8_recompute"])
def test_each_schedule_lowers_the_loss(runs, name):
    losses = runs["results"][0][name]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    # Every rank reports the same global loss.
    for r in runs["results"]:
        assert r[name]["losses"] == losses


def test_pipelined_loss_equals_the_unpipelined_model(runs):
    from agoq.activation import make_policy
    from agoq.models import Llama
    from agoq.train.data import TrainSampler, prepare_data

    cfg = runs["cfgs"]["1f1b_fp32"]
    data = prepare_data(None, None, 512, runs["tmp"] / "cache", 0.01)
    mc = dataclasses.replace(cfg.model_config(), vocab_size=data.tokenizer.vocab_size)
    model = Llama(mc, make_policy("bf16"))
    model.reset_parameters(cfg.train.seed)
    x, y = TrainSampler(data.train, cfg.data.seq_len, cfg.data.batch_size, 0, 1, cfg.train.seed).next_batch()
    with torch.no_grad():
        expected = float(model(x, y))
    assert runs["results"][0]["1f1b_fp32"]["losses"][0] == pytest.approx(expected, rel=1e-5)


def test_resume_continues_exactly_like_an_uninterrupted_run(runs):
    straight = runs["results"][0]["1f1b_fp32"]["losses"]
    first = runs["results"][0]["resume_first_half"]["losses"]
    second = runs["results"][0]["resume_second_half"]["losses"]
    assert first == straight[:2]
    assert second == straight[2:]  # bit-identical on CPU


def test_stage_aware_bits_raise_precision_without_raising_the_peak(runs):
    uni = {s["rank"]: s for s in runs["results"][0]["uniform4"]["all_stats"]}
    dbca = {s["rank"]: s for s in runs["results"][0]["dbca"]["all_stats"]}
    assert all(b == 4 for s in uni.values() for b in s["layer_bits"])
    assert any(b > 4 for s in dbca.values() for b in s["layer_bits"]), dbca
    peak_uni = max(s["peak_saved_bytes"] for s in uni.values())
    peak_dbca = max(s["peak_saved_bytes"] for s in dbca.values())
    assert peak_dbca <= peak_uni
    # The rank that got more bits really holds more bytes than under uniform 4 bits.
    raised = [r for r, s in dbca.items() if max(s["layer_bits"]) > 4]
    assert all(dbca[r]["peak_saved_bytes"] > uni[r]["peak_saved_bytes"] for r in raised)


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.n_layers=3"], "model.n_layers=3 is not divisible"),
        (["--parallel.schedule=zigzag"], "parallel.schedule='zigzag' is unknown"),
        (["--precision.activation_format=int7"], "int7"),
        (["--data.corpus=/no/such/file.txt"], "data.corpus='/no/such/file.txt' does not exist"),
        (["--parallel.microbatches=1"], "parallel.microbatches=1 is fewer than parallel.pp=2"),
        (["--data.batch_size=6"], "data.batch_size=6 is not divisible"),
        (["--train.steps=ten"], "train.steps='ten' is not an integer"),
        (["--optim.name=sgd"], "optim.name='sgd' is unknown"),
    ],
)
def test_invalid_config_values_stop_with_one_line_naming_them(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_config(None, override)
    assert "\n" not in str(e.value)


def test_cli_reports_config_errors_before_starting_processes(capsys):
    from agoq.cli import main

    assert main(["train", "--parallel.pp=0"]) == 2
    assert "parallel.pp=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["1f1b_fp32", "gpipe_agoq", "interleaved_agoq", "ring8_recompute", "resume_second_half", "adamw8bit"])
def test_every_rank_reports_its_temporaries(runs, name):
    """The second step run counts temporaries; they include at least one full-precision gradient of
    the rank's embedding or head (vocab x hidden) before it folds into the gradient buffer."""
    cfg = runs["cfgs"][name]
    elem = 4 if cfg.precision.compute_dtype == "fp32" else 2
    vocab_by_hidden = runs["results"][0][name]["vocab"] * cfg.model_config().hidden * elem
    for stats in runs["results"][0][name]["all_stats"]:
        assert stats["peak_temporary_bytes"] >= vocab_by_hidden, (name, stats)
    # One-step runs have no second step to count.
    assert all(s["peak_temporary_bytes"] is None for s in runs["results"][0]["dbca"]["all_stats"])
