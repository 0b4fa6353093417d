"""Checkpoint faults and what `agoq train` does about each: refuse with one line naming the fix
(exit code 2, before any worker starts), or go on with nothing lost or silently changed.

- a resumed run keeps its checkpoint's compute dtype (``auto`` never changes it; an explicit other
  dtype is refused naming the saved one), and the ``auto`` probe is measured once per machine;
- a checkpoint without its manifest, with one that is not valid JSON (said as such), or with files
  lacking digests, loads only with checkpoint.trust_unverified=true, and is never replaced by an
  older step;
- a fresh run into a folder with checkpoints is refused unless checkpoint.overwrite=true, which
  deletes them first: two runs' checkpoints never mix.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from agoq.launch import choices as cd
from agoq.launch.resume import checkpoint_compute_dtype
from tests._data import SMALL_MODEL, data_args

# One process, eager quantization, a model of a few hundred thousand parameters: what is checked
# is what the run loads and says, not its speed or layout.
BASE = [
    *SMALL_MODEL,
    "--data.batch_size=8",
    "--parallel.microbatches=2",
    "--parallel.pp=1",
    "--parallel.dp=1",
    "--optim.warmup_steps=0",
    # A constant learning rate: the schedule depends on train.steps, which a resumed run raises.
    "--optim.lr=3e-3",
    "--optim.min_lr=3e-3",
    "--train.eval_every=0",
    "--train.baseline=false",
    "--precision.quant_backend=torch",
]


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", *BASE, *data_args(), f"--train.out_dir={out}", *extra]


def _train(out: Path, *extra: str) -> int:
    from agoq.cli import main

    return main(_args(out, *extra))


def _folder_digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under a folder, by relative path: to show a refused run changed nothing."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _state(step_dir: Path) -> dict[str, object]:
    """Every model and optimizer tensor of a checkpoint (dotted keys), and each rank's step and sampler."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = step_dir.parent.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, dst)
    state = torch.load(dst, weights_only=False)
    dst.unlink()
    flat: dict[str, object] = {}

    def walk(value: object, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        else:
            flat[key] = value

    walk(state["model"], "model")
    walk(state["optim"], "optim")
    for rank, blob in state["extra"].items():
        extra = torch.load(io.BytesIO(blob), weights_only=True)
        flat[f"extra.{rank}.step"] = extra["step"]
        flat[f"extra.{rank}.sampler"] = extra["sampler"]
    return flat


def _assert_same_state(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory) -> Path:
    """An fp32 run of 2 steps with checkpoints at steps 1 and 2: copied by each test that damages one."""
    out = tmp_path_factory.mktemp("fp32") / "run"
    assert _train(out, "--precision.compute_dtype=fp32", "--train.steps=2", "--checkpoint.every=1") == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# ------------------------------------------------------------------------------- compute dtype (A)


def test_a_bf16_run_resumed_with_auto_where_auto_says_fp32_keeps_bf16_exactly(tmp_path, monkeypatch, capfd):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    every = ["--precision.compute_dtype=bf16", "--checkpoint.every=2"]
    assert _train(straight, *every, "--train.steps=4") == 0
    assert _train(resumed, *every, "--train.steps=2") == 0
    capfd.readouterr()
    # This machine's auto now says fp32 (no bf16 instructions). The choices are decided in this
    # process, the launcher's, before the workers start.
    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: ())
    assert cd.choose_compute_dtype("auto", "cpu").name == "fp32"
    assert _train(resumed, "--precision.compute_dtype=auto", "--checkpoint.every=2", "--train.steps=4") == 0
    out = capfd.readouterr().out
    step2 = resumed / "checkpoints" / "step_000002"
    assert f"agoq train: compute dtype bf16 (kept from the checkpoint this run resumes, {step2}: auto never changes a run's precision)" in out
    assert "compute bf16" in out  # the announced precision is the kept one
    assert f"resuming from {step2} (step 2 of 4; every file's checksum verified)" in out, out[-3000:]
    # Every tensor of model and optimizer (bf16 weights, fp32 masters and moments) as if it never stopped.
    a, b = _state(straight / "checkpoints" / "step_000004"), _state(resumed / "checkpoints" / "step_000004")
    assert any(k.endswith(".master") and v.dtype == torch.float32 for k, v in b.items() if isinstance(v, torch.Tensor))
    assert all(v.dtype == torch.bfloat16 for k, v in b.items() if k.startswith("model.") and isinstance(v, torch.Tensor))
    _assert_same_state(a, b)
    manifest = json.loads((resumed / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert manifest["run_config"]["precision"]["compute_dtype"] == "bf16"
    assert manifest["weights_dtype"] == "torch.bfloat16" and manifest["master_weights"] is True

    # Asking for fp32 explicitly is refused before any worker starts: it would drop the fp32 masters.
    before = _folder_digest(resumed)
    assert _train(resumed, "--precision.compute_dtype=fp32", "--checkpoint.every=2", "--train.steps=6") == 2
    line = _one_line(capfd.readouterr().err)
    assert "precision.compute_dtype=fp32 but the checkpoint this run resumes" in line and "was trained in bf16" in line
    assert "--precision.compute_dtype=bf16" in line
    assert _folder_digest(resumed) == before


def test_an_fp32_run_resumed_in_bf16_is_refused_naming_the_saved_dtype(fp32_run, tmp_path, capsys):
    out = _copy(fp32_run, tmp_path)
    before = _folder_digest(out)
    assert _train(out, "--precision.compute_dtype=bf16", "--train.steps=4", "--checkpoint.every=1") == 2
    line = _one_line(capsys.readouterr().err)
    assert "was trained in fp32 (fp32 weights without separate master weights)" in line and "--precision.compute_dtype=fp32" in line
    assert "master'" not in line  # not the misleading missing-optimizer-key error
    assert _folder_digest(out) == before


def test_resuming_another_layout_or_model_is_refused_before_any_worker_starts(fp32_run, tmp_path, capsys, monkeypatch):
    from agoq.launch import run

    out = _copy(fp32_run, tmp_path)
    before = _folder_digest(out)
    monkeypatch.setattr(run, "_launch_local", lambda *a: pytest.fail("the workers were started"))
    step = out / "checkpoints" / "step_000002"
    where = f"agoq train: train.out_dir='{out}' resumes checkpoint {step}"
    new = "or start a new run with --train.out_dir=runs/NAME"
    assert _train(out, "--parallel.dp=2", "--train.steps=4") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"{where}, saved by the layout pp=1 x dp=1 x tp=1 (1f1b, virtual_stages=1), but this run is pp=1 x dp=2 x tp=1 "
        f"(1f1b, virtual_stages=1); resume with that layout (--parallel.dp=1), {new}"
    )
    assert _train(out, "--model.preset=llama3.2-1b", "--train.steps=4") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"{where}, which holds another model (this run: model.preset='llama3.2-1b'): max_seq_len=256 (checkpoint) vs 131072, "
        f"rope_theta=10000.0 (checkpoint) vs 500000.0, tie_embeddings=False (checkpoint) vs True; "
        f"resume with model.preset='tiny' and its overrides, {new}"
    )
    assert _train(out, "--model.n_layers=4", "--train.steps=4") == 2
    assert ": n_layers=2 (checkpoint) vs 4; resume with model.preset='tiny' and its overrides" in _one_line(capsys.readouterr().err)
    assert _folder_digest(out) == before


def _saved_run(out: Path, dtype: torch.dtype) -> Path:
    """A checkpoint of a small model in ``dtype`` where `agoq train --train.out_dir=out` looks for it."""
    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.train.checkpoint import save_checkpoint

    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)
    return save_checkpoint(out / "checkpoints", 3, Llama(cfg).to(dtype), None, {})


def _resume_cfg(out: Path, *extra: str):
    from agoq.launch.config import load_config

    return load_config(None, [f"--train.out_dir={out}", "--parallel.pp=1", "--parallel.dp=1", "--precision.quant_backend=torch", *extra])


@pytest.mark.parametrize(
    "saved, machine_flags", [(torch.bfloat16, ()), (torch.float32, ("amx_bf16",))], ids=["bf16-where-auto-says-fp32", "fp32-where-auto-says-bf16"]
)
def test_auto_keeps_the_checkpoints_dtype_both_ways_and_without_a_manifest(tmp_path, monkeypatch, saved, machine_flags):
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[saved]
    other = {"bf16": "fp32", "fp32": "bf16"}[name]
    step = _saved_run(tmp_path, saved)
    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: machine_flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fresh = _resume_cfg(tmp_path / "fresh")
    assert cd.resolve_choices(fresh, "cpu").compute_dtype == other  # what auto says on this machine
    resumed = cd.resolve_choices(_resume_cfg(tmp_path), "cpu")
    assert resumed.compute_dtype == name
    assert f"compute dtype {name} (kept from the checkpoint this run resumes, {step}" in resumed.lines[0]

    # Without its manifest the checkpoint loads only with consent; then DCP's index says the dtype.
    (step / "manifest.json").unlink()
    assert checkpoint_compute_dtype(_resume_cfg(tmp_path)) is None  # refused at load, not guessed
    trusted = _resume_cfg(tmp_path, "--checkpoint.trust_unverified=true")
    assert checkpoint_compute_dtype(trusted) == (name, step)
    assert cd.resolve_choices(trusted, "cpu").compute_dtype == name


def test_the_library_refuses_loading_weights_into_another_dtype(tmp_path):
    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)
    model = Llama(cfg).to(torch.bfloat16)
    save_checkpoint(tmp_path, 1, model, None, {})
    fp32 = Llama(cfg)
    before = {n: p.detach().clone() for n, p in fp32.named_parameters()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, fp32, None)
    msg = str(info.value)
    assert "is torch.bfloat16 in checkpoint" in msg and "but torch.float32 here" in msg and "\n" not in msg
    assert all(torch.equal(before[n], p) for n, p in fp32.named_parameters())


# --------------------------------------------------------------------------- unverifiable (B)


def test_a_checkpoint_without_its_manifest_is_refused_not_replaced_by_an_older_step(fp32_run, tmp_path, capfd):
    out = _copy(fp32_run, tmp_path)
    step2 = out / "checkpoints" / "step_000002"
    (step2 / "manifest.json").unlink()
    before = _folder_digest(out)
    args = ["--precision.compute_dtype=fp32", "--train.steps=3", "--checkpoint.every=0"]
    assert _train(out, *args) == 2
    line = _one_line(capfd.readouterr().err)
    assert line.startswith(f"agoq train: checkpoint {step2} has no manifest.json") and "--checkpoint.trust_unverified=true" in line
    assert _folder_digest(out) == before  # no worker started: no metrics, no logs, nothing loaded

    # With consent it loads step 2 (not step 1) and says that nothing was verified.
    assert _train(out, *args, "--checkpoint.trust_unverified=true") == 0
    printed = capfd.readouterr().out
    assert f"resuming from {step2} (step 2 of 3; NOT verified: it has no manifest.json" in printed
    assert "checksum verified" not in printed
    records = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]


def test_a_manifest_without_digests_and_a_damaged_shard_is_refused(fp32_run, tmp_path, capsys):
    out = _copy(fp32_run, tmp_path)
    step2 = out / "checkpoints" / "step_000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    del manifest["sha256"]
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    shard = step2 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64])
    shard.write_bytes(bytes(data))  # same size: only a digest could tell
    before = _folder_digest(out)
    assert _train(out, "--precision.compute_dtype=fp32", "--train.steps=3", "--checkpoint.every=0") == 2
    line = _one_line(capsys.readouterr().err)
    assert f"checkpoint {step2} has 2 files without a SHA-256 digest in its manifest.json" in line
    assert "--checkpoint.trust_unverified=true" in line
    assert _folder_digest(out) == before


def test_a_manifest_that_is_not_valid_json_is_refused_as_exactly_that(fp32_run, tmp_path, capsys):
    out = _copy(fp32_run, tmp_path)
    step2 = out / "checkpoints" / "step_000002"
    text = (step2 / "manifest.json").read_text()
    (step2 / "manifest.json").write_text(text[: len(text) // 2])  # a copy cut short
    with pytest.raises(json.JSONDecodeError) as parse:
        json.loads(text[: len(text) // 2])
    before = _folder_digest(out)
    assert _train(out, "--precision.compute_dtype=fp32", "--train.steps=3", "--checkpoint.every=0") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"agoq train: checkpoint {step2} is damaged: manifest.json is not valid JSON ({parse.value}), so its files cannot be verified; "
        "restore the folder from a good copy, delete it to resume from an earlier checkpoint, or load it anyway with --checkpoint.trust_unverified=true"
    )
    assert _folder_digest(out) == before


def test_the_library_reads_a_manifest_that_is_not_valid_json_as_none_at_all(tmp_path):
    """Refused naming the parser's message; with consent it loads as a folder without its manifest does."""
    from agoq.train.checkpoint import UnverifiedCheckpoint, load_checkpoint

    step_dir, model, opt, fresh = _tiny_saved(tmp_path / "ck")
    (step_dir / "manifest.json").write_text('{"format_version": 1, "step": 2,')
    m, o = fresh()
    with pytest.raises(UnverifiedCheckpoint) as info:
        load_checkpoint(tmp_path / "ck", m, o)
    assert f"checkpoint {step_dir} is damaged: manifest.json is not valid JSON (Expecting property name enclosed in double quotes: " in str(
        info.value
    )
    assert load_checkpoint(tmp_path / "ck", m, o, trust_unverified=True) == (2, {"at": 2})
    _assert_same_model_and_optimizer(model, opt, m, o)


def _tiny_saved(root: Path):
    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.train.checkpoint import save_checkpoint

    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)
    model = Llama(cfg)
    model.reset_parameters(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x).backward()
    opt.step()
    save_checkpoint(root, 1, model, opt, {"at": 1})
    model(x, x).backward()
    opt.step()
    step_dir = save_checkpoint(root, 2, model, opt, {"at": 2})

    def fresh():
        m = Llama(cfg)
        m.reset_parameters(1)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    return step_dir, model, opt, fresh


def _assert_same_model_and_optimizer(model, opt, m, o) -> None:
    """Every parameter, and every optimizer state tensor and value (step, moments), equal and of one dtype."""
    for p, q in zip(model.parameters(), m.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
        assert opt.state[p].keys() == o.state[q].keys()
        for key, value in opt.state[p].items():
            other = o.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda m: m.pop("sha256"), "has 2 files without a SHA-256 digest in its manifest.json (.metadata, __0_0.distcp)"),
        (lambda m: m["sha256"].pop("__0_0.distcp"), "has 1 file without a SHA-256 digest in its manifest.json (__0_0.distcp)"),
        # Both the file's size and its digest taken out of the manifest: the file is still in the folder.
        (lambda m: (m["sha256"].pop("__0_0.distcp"), m["files"].pop("__0_0.distcp")), "(__0_0.distcp)"),
    ],
)
def test_the_library_refuses_unverifiable_checkpoints_unless_trusted(tmp_path, damage, problem):
    from agoq.train.checkpoint import UnverifiedCheckpoint, latest_checkpoint, load_checkpoint

    step_dir, model, opt, fresh = _tiny_saved(tmp_path / "ck")
    manifest = json.loads((step_dir / "manifest.json").read_text())
    damage(manifest)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    m, o = fresh()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(UnverifiedCheckpoint) as info:
        load_checkpoint(tmp_path / "ck", m, o)
    assert problem in str(info.value) and "trust_unverified=True" in str(info.value) and "\n" not in str(info.value)
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    # Consent loads it, every tensor as saved.
    assert latest_checkpoint(tmp_path / "ck") == step_dir
    assert load_checkpoint(tmp_path / "ck", m, o, trust_unverified=True) == (2, {"at": 2})
    _assert_same_model_and_optimizer(model, opt, m, o)


def test_the_library_never_falls_back_past_a_folder_without_its_manifest(tmp_path):
    from agoq.train.checkpoint import UnverifiedCheckpoint, latest_checkpoint, load_checkpoint

    step_dir, model, opt, fresh = _tiny_saved(tmp_path / "ck")
    (step_dir / "manifest.json").unlink()
    with pytest.raises(UnverifiedCheckpoint, match="step_000002 has no manifest.json"):
        latest_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "latest").unlink()  # without the pointer, the highest step is still step 2
    with pytest.raises(UnverifiedCheckpoint, match="step_000002 has no manifest.json"):
        latest_checkpoint(tmp_path / "ck")
    m, o = fresh()
    with pytest.raises(UnverifiedCheckpoint):
        load_checkpoint(tmp_path / "ck", m, o)
    assert latest_checkpoint(tmp_path / "ck", trust_unverified=True) == step_dir
    # Loaded with consent: the step from its folder's name, every tensor as saved.
    assert load_checkpoint(tmp_path / "ck", m, o, trust_unverified=True) == (2, {"at": 2})
    _assert_same_model_and_optimizer(model, opt, m, o)
    # A whole folder deleted (what the damage messages advise) leaves the earlier one as the latest.
    shutil.rmtree(step_dir)
    assert latest_checkpoint(tmp_path / "ck") == tmp_path / "ck" / "step_000001"


# ------------------------------------------------------------------------------ fresh runs (C)


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_and_overwrite_starts_clean(fp32_run, tmp_path, capfd):
    out = _copy(fp32_run, tmp_path)
    before = _folder_digest(out)
    fresh = ["--precision.compute_dtype=fp32", "--checkpoint.resume=false", "--train.steps=1", "--checkpoint.every=1"]
    assert _train(out, *fresh) == 2
    line = _one_line(capfd.readouterr().err)
    assert "holds checkpoints of an earlier run (newest step_000002)" in line
    assert "--train.out_dir=runs/NAME" in line and "--checkpoint.overwrite=true" in line
    assert _folder_digest(out) == before
    # overwrite with resume would delete what it resumes: refused as a config error.
    assert _train(out, "--checkpoint.overwrite=true", "--train.steps=3") == 2
    assert "needs --checkpoint.resume=false" in _one_line(capfd.readouterr().err)

    assert _train(out, *fresh, "--checkpoint.overwrite=true") == 0
    assert "deleted 2 checkpoint(s) of the earlier run" in capfd.readouterr().out
    root = out / "checkpoints"
    # Only the new run's checkpoint: deleting it later cannot bring back the old run's step 2.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert json.loads((root / "step_000001" / "manifest.json").read_text())["run_config"]["train"]["steps"] == 1
