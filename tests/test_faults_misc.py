"""Smaller defects, each a value assertion: the planner at sizes beyond any machine, saving an
HF model patched by apply_agoq, nested patching, and the CLI's stderr at exit."""

from __future__ import annotations

import json
import pickle
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agoq.gradient.layout import Segment, bucket_runs, plan_buckets
from agoq.plan import make_plan_config
from agoq.plan.config import parse_setup
from agoq.plan.accounting import PlanAccounting
from agoq.quant import QuantFormat
from agoq.quant.formats import round_up

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *args`` with agoq importable, its stdout and stderr captured."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


# ---------------------------------------------------------------- the bucket layout at any size


def _reference_buckets(numels: list[int], block: int, bucket_numel: int, world: int) -> list[tuple[int, list[Segment]]]:
    """The layout rule bucket by bucket, segment by segment, as the docstring of plan_buckets states it."""
    cap = round_up(bucket_numel, block)
    per_bucket: list[list[Segment]] = [[]]
    fill = 0
    for pi in reversed(range(len(numels))):
        remaining, poff = numels[pi], 0
        while remaining > 0:
            if fill >= cap:
                per_bucket.append([])
                fill = 0
            take = min(remaining, cap - fill)
            per_bucket[-1].append(Segment(pi, len(per_bucket) - 1, fill, poff, take))
            fill += round_up(take, block)
            remaining -= take
            poff += take
    out = []
    for segs in per_bucket:
        used = max((s.offset + round_up(s.numel, block) for s in segs), default=block)
        out.append((round_up(used, world * block), segs))
    return out


@pytest.mark.parametrize("block, cap, world", [(1, 7, 1), (4, 10, 3), (64, 1000, 2), (256, 1024, 4)])
def test_bucket_runs_are_the_bucket_by_bucket_layout(block, cap, world):
    c = round_up(cap, block)
    cases = [[], [0], [1], [c], [c + 1], [5 * c], [3 * c + 1, 2, c - 1 if c > 1 else 1], [c // 2 + 1, 4 * c, 7, 0, 2 * c]]
    for numels in cases:
        runs = bucket_runs(numels, block, cap, world)
        assert plan_buckets(numels, block, cap, world) == _reference_buckets(numels, block, cap, world)
        assert len(runs) <= 2 * len(numels) + 1


def test_bucket_runs_of_a_trillion_values_are_one_run():
    cap = 25 * 2**20 // 4
    (run,) = bucket_runs([4096 * 10**9], 256, cap, 8)
    assert (run.count, run.padded, run.segments) == (4096 * 10**9 // cap, cap, (Segment(0, 0, 0, 0, cap),))
    assert 4096 * 10**9 % cap == 0


def test_planner_bytes_from_runs_equal_the_bytes_of_every_bucket():
    # A vocabulary that spans a few hundred buckets, small enough to list them all.
    acc = PlanAccounting(make_plan_config("tiny", {"vocab_size": 2_000_003}, seq_len=64, dp=2, global_batch=2))
    numels = acc.states.rank_numels(0)
    buckets = plan_buckets(numels, acc.cfg.gradient_block, 25 * 2**20 // 4, 2)
    assert len(buckets) > 100
    fmt = QuantFormat("int", 8, acc.cfg.gradient_block)
    assert acc.states.gradient_bytes(numels, parse_setup("A+G")) == sum(fmt.nbytes(n) for n, _ in buckets)
    assert acc.states.gradient_bytes(numels, parse_setup("baseline+zero1")) == 4 * sum(n for n, _ in buckets)
    # fp32 master + two fp32 moments of dp rank 0's shard of each bucket, a step counter per piece of it.
    shard = sum(n // 2 for n, _ in buckets)
    pieces = sum(1 for n, segs in buckets for s in segs if s.offset < n // 2)
    assert acc.states.optimizer_bytes(numels, parse_setup("baseline+zero1")) == 12 * shard + 4 * pieces
    assert acc.states.bucket_sizes(0) == tuple((r.count, r.padded) for r in acc.states.buckets(numels))


_RSS_SCRIPT = """
import argparse, contextlib, io, json, resource, sys, time
import agoq.models.llama, agoq.plan.memory, agoq.plan.report  # imported before the baseline: not the plan's memory
from agoq.plan.cli import add_arguments, run
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = io.StringIO()
start = time.perf_counter()
with contextlib.redirect_stdout(out):
    code = run(args)
seconds = time.perf_counter() - start
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
print(json.dumps({"code": code, "seconds": seconds, "grown_kib": grown, "plan": json.loads(out.getvalue())}))
"""


@pytest.mark.parametrize("field", ["vocab_size=1000000000", "intermediate=1000000000"])
def test_plan_of_a_billion_wide_model_is_bounded(field):
    proc = _python("-c", _RSS_SCRIPT, "--model", "llama3-8b", "--model-field", field, "--gpu-memory", "80GiB", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["code"] == 0
    # Bucket by bucket, these models list millions of segments; their runs are a few per parameter.
    assert doc["grown_kib"] < 200 * 1024 and doc["seconds"] < 60
    key, value = field.split("=")
    model = make_plan_config("llama3-8b", {key: int(value)}, seq_len=4096).model
    (rank,) = doc["plan"]["configurations"][0]["ranks"]
    assert rank["bytes"]["parameters"] == 2 * model.num_parameters()
    assert doc["plan"]["configurations"][0]["fits"] is False


def test_plan_command_with_a_billion_vocabulary_answers():
    proc = _python("-m", "agoq", "plan", "--model", "llama3-8b", "--model-field", "vocab_size=1000000000", timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "| A+G+O+zero1 |" in proc.stdout


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--model-field", "intermediate=1000000000000000000"],
            "agoq plan: llama3-8b(intermediate=1000000000000000000): intermediate=1000000000000000000 x hidden=4096 = 4.1e+21 "
            "values in one parameter tensor, beyond any machine in fp32 (the limit is 1 EiB); check --model-field intermediate",
        ),
        (
            ["--model-field", "vocab_size=1000000000000000"],
            "agoq plan: llama3-8b(vocab_size=1000000000000000): vocab_size=1000000000000000 x hidden=4096 = 4.1e+18 "
            "values in one parameter tensor, beyond any machine in fp32 (the limit is 1 EiB); check --model-field vocab_size",
        ),
        (
            ["--pp", "2", "--global-batch", "100000000"],
            "agoq plan: global-batch=100000000 makes 100000000 micro-batches per step, which cannot be planned "
            "(the limit is 16384); lower --global-batch or raise --micro-batch",
        ),
    ],
)
def test_plan_refuses_what_it_cannot_plan_in_one_line(argv, line, capsys):
    from agoq.cli import main

    assert main(["plan", "--model", "llama3-8b", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == line + "\n"


# ---------------------------------------------------------------- the CLI's stderr at exit


@pytest.mark.parametrize(
    "argv, code, err",
    [
        (["plan", "--help"], 0, ""),
        (["plan", "--model", "llama3-8b", "--seq-len", "8192", "--gpu-memory", "80GiB"], 0, ""),
        (
            ["plan", "--model", "llama3-8b", "--tp", "64"],
            2,
            "agoq plan: llama3-8b: n_heads=32 is not divisible by tp=64; pick a tp that divides 32\n",
        ),
        (["train", "--optim.lr=nan"], 2, "agoq train: optim.lr=nan must be a finite number\n"),
    ],
)
def test_cli_stderr_has_no_nanobind_leak_report(argv, code, err):
    proc = _python("-m", "agoq", *argv)
    assert "nanobind" not in proc.stderr
    assert (proc.returncode, proc.stderr) == (code, err)


# ---------------------------------------------------------------- saving and nesting a patched HF model


def _hf_model(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def _ids() -> torch.Tensor:
    return torch.randint(0, 101, (2, 19), generator=torch.Generator().manual_seed(3))


def _loss(model) -> torch.Tensor:
    with torch.enable_grad():  # the patched path runs under autograd
        return model(_ids(), labels=_ids()).loss.detach()


def _module_attributes(model) -> dict[str, set[str]]:
    return {name: set(m.__dict__) for name, m in model.named_modules()}


def test_torch_save_of_a_patched_model_loads_still_patched_with_the_same_loss(tmp_path):
    from agoq.integrations.hf import agoq_patch, apply_agoq, remove_agoq

    model = _hf_model()
    apply_agoq(model)
    loss = _loss(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    patch = agoq_patch(loaded)
    assert patch is not None and patch.model is loaded and patch.layers[0] is loaded.model.layers[0]
    assert torch.equal(_loss(loaded), loss)
    remove_agoq(loaded)
    assert not any("forward" in m.__dict__ or "_agoq_owner" in m.__dict__ for m in loaded.modules())
    assert torch.equal(_loss(loaded), _loss(_hf_model()))
    # weights_only=True reads tensors and containers, never a whole module, patched or not; a
    # state dict loads that way.
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(tmp_path / "model.pt", weights_only=True)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in _hf_model().state_dict().items())


def test_state_dict_of_a_patched_model_is_the_unpatched_one():
    from agoq.integrations.hf import apply_agoq

    plain, model = _hf_model(), _hf_model()
    apply_agoq(model)
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_patching_inside_a_patched_model_is_refused_in_one_line():
    from agoq.integrations.hf import apply_agoq, remove_agoq

    model = _hf_model()
    apply_agoq(model)
    with pytest.raises(ValueError) as caught:
        apply_agoq(model.model)
    assert str(caught.value) == (
        "this LlamaModel is inside a LlamaForCausalLM already patched by agoq; patch once at the top "
        "(the LlamaForCausalLM, already done), or call remove_agoq on the LlamaForCausalLM first"
    )
    remove_agoq(model)
    apply_agoq(model.model)  # once the outer patch is gone
    remove_agoq(model.model)
    assert _module_attributes(model) == _module_attributes(_hf_model())


def test_patching_around_a_patched_model_is_refused_in_one_line():
    from agoq.integrations.hf import apply_agoq, remove_agoq

    model = _hf_model()
    apply_agoq(model.model)
    with pytest.raises(ValueError) as caught:
        apply_agoq(model)
    assert str(caught.value) == (
        "its submodule 'model' (LlamaModel) is already patched by agoq; call remove_agoq(model.model) first, then patch once at the top"
    )
    remove_agoq(model.model)
    apply_agoq(model)


@pytest.mark.parametrize("target", ["model", "model.model"])
def test_remove_agoq_restores_the_never_patched_model(target):
    from agoq.integrations.hf import apply_agoq, remove_agoq

    never, model = _hf_model(), _hf_model()
    patched = model if target == "model" else model.model
    apply_agoq(patched)
    _loss(model)
    remove_agoq(patched)
    assert _module_attributes(model) == _module_attributes(never)
    with torch.enable_grad():
        assert torch.equal(model(_ids()).logits, never(_ids()).logits)
    assert torch.equal(_loss(model), _loss(never))
    ours, theirs = model.state_dict(), never.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
