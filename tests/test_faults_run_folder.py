"""The run folder and what a resume trusts: no file agoq writes is followed through a link, and a
checkpoint pins the tokenizer and data it was trained on.

- every file and folder a run writes, replaced by a link to something elsewhere, is refused before
  launch with one line (exit 2) naming it and the fix; what the link names and the run folder are
  unchanged;
- the writers themselves never follow a link, so one made after that check is replaced or refused,
  and never written through;
- a resume with another tokenizer (ids permuted, valid JSON) is refused before launch, naming both
  fingerprints; the same tokenizer saved again matches; a checkpoint that records no fingerprint
  resumes with one line saying the tokenizer cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from agoq.launch.config import ConfigError, load_config
from tests._data import data_args, data_cache, train_corpus
from tests.test_faults_checkpoint import BASE, _one_line

TARGET = b"keep me: not agoq's\n"


@pytest.fixture(autouse=True)
def _no_early_forkserver(monkeypatch):
    # Nearly every case here stops before any worker: the fork server would only take CPU.
    import agoq.launch.forkserver

    monkeypatch.setattr(agoq.launch.forkserver, "start_early", lambda preload: None)


def _args(out: Path, tokenizer: Path, *extra: str) -> list[str]:
    return [
        "train",
        *BASE,
        "--precision.compute_dtype=fp32",
        *data_args(),
        f"--data.tokenizer={tokenizer}",
        f"--train.out_dir={out}",
        *extra,
    ]


def _train(out: Path, tokenizer: Path, *extra: str) -> int:
    from agoq.cli import main

    return main(_args(out, tokenizer, *extra))


def _listing(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` as it is, links not followed: a link's target, a file's size and SHA-256."""
    out: dict[str, tuple] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = ("link", os.readlink(path))
        elif path.is_dir():
            out[key] = ("dir",)
        else:
            data = path.read_bytes()
            out[key] = ("file", len(data), hashlib.sha256(data).hexdigest())
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, tokenizer file): 2 steps trained with the tokenizer file, checkpoints at steps 1 and 2."""
    from agoq.data.tokens import prepare_data

    root = tmp_path_factory.mktemp("trained")
    tokenizer = prepare_data(train_corpus(), None, 512, data_cache()).tokenizer.save(root / "tok.json")
    out = root / "run"
    assert _train(out, tokenizer, "--train.steps=2", "--checkpoint.every=1") == 0
    assert {"summary.json", "summary.md", "loss.png", "metrics", "checkpoints"} <= {p.name for p in out.iterdir()}
    return out, tokenizer


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# ------------------------------------------------------------------------------------ links


# Every name a run writes in its folder: the files, the folders, and what it writes in them. A
# checkpoint's temporary folder (.tmp) and the step folder of the next save are written at step 3.
RUN_WRITES = [
    ".lock",
    "summary.json",
    "summary.md",
    "loss.png",
    "logs",
    "logs/rank0.log",
    "logs/rank0.error",
    "metrics",
    "metrics/rank0.jsonl",
    "checkpoints",
    "checkpoints/latest",
    "checkpoints/step_000003.tmp",
    "checkpoints/step_000003",
]


def _link_to_elsewhere(out: Path, name: str, elsewhere: Path) -> Path:
    """Replace ``out/name`` with a symbolic link to a file or folder of ``elsewhere``; return what it names."""
    path = out / name
    folder = name in ("logs", "metrics", "checkpoints") or name.startswith("checkpoints/step_")
    target = elsewhere / name.replace("/", "_")
    if folder:
        if path.is_dir():
            shutil.move(path, target)  # the run's own folder, moved: the link looks like it
        else:
            target.mkdir()
        (target / "precious.txt").write_bytes(TARGET)
    else:
        target.write_bytes(TARGET)
        path.unlink(missing_ok=True)
    path.parent.mkdir(exist_ok=True)
    path.symlink_to(target, target_is_directory=folder)
    return target


@pytest.mark.parametrize("name", RUN_WRITES)
def test_each_file_a_run_writes_linked_elsewhere_is_refused_and_its_target_untouched(trained, tmp_path, capsys, name):
    run, tokenizer = trained
    out = _copy(run, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _link_to_elsewhere(out, name, elsewhere)
    before, targets = _listing(out), _listing(elsewhere)
    assert _train(out, tokenizer, "--train.steps=3", "--checkpoint.every=1") == 2
    line = _one_line(capsys.readouterr().err)
    path = out / name
    assert line.startswith(f"agoq train: {path} is a symbolic link, which agoq does not follow ("), line
    assert line.endswith(f"; delete the link (rm {path}) or write this run elsewhere with --train.out_dir=runs/NAME"), line
    assert _listing(elsewhere) == targets
    assert _listing(out) == before


@pytest.mark.parametrize("name", [".lock", "metrics/rank0.jsonl", "logs/rank0.log"])
def test_a_file_written_in_place_that_is_a_hard_link_is_refused_and_its_other_name_untouched(trained, tmp_path, capsys, name):
    run, tokenizer = trained
    out = _copy(run, tmp_path)
    other = tmp_path / "precious.txt"
    other.write_bytes(TARGET)
    (out / name).parent.mkdir(exist_ok=True)
    (out / name).unlink(missing_ok=True)
    os.link(other, out / name)
    before = _listing(out)
    assert _train(out, tokenizer, "--train.steps=3") == 2
    line = _one_line(capsys.readouterr().err)
    assert line == (
        f"agoq train: {out / name} has 2 names (a hard link to another file, which agoq would overwrite); "
        f"delete it (rm {out / name}) or write this run elsewhere with --train.out_dir=runs/NAME"
    )
    assert other.read_bytes() == TARGET and _listing(out) == before


def test_the_writers_never_follow_a_link_made_after_the_check(trained, tmp_path):
    """What each writer does where a link appeared after the launch's check: the summaries, the plot
    and a failure's log replace the link, the metrics refuse it; what it names stays as it was."""
    from agoq.train.metrics import JsonlWriter
    from agoq.launch.run import _RankLog, _write_summary

    run, _ = trained
    summary = json.loads((run / "summary.json").read_text())
    out = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    (out / "logs").mkdir(parents=True)
    (out / "metrics").mkdir()
    elsewhere.mkdir()
    names = ["summary.json", "summary.md", "loss.png", "logs/rank0.log", "logs/rank0.error", "metrics/rank0.jsonl"]
    for name in names:
        _link_to_elsewhere(out, name, elsewhere)
    targets = _listing(elsewhere)

    _write_summary(load_config(None, [f"--train.out_dir={out}"]), summary)
    for name in ("summary.json", "summary.md", "loss.png"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 100, name
    assert json.loads((out / "summary.json").read_text())["run"] == summary["run"]

    log = _RankLog(out / "logs", "0")  # the worker's logs, opened (and truncated) as it starts
    assert log.fds == []
    log.write("Traceback ...", "RuntimeError: boom")
    assert (out / "logs" / "rank0.log").read_text() == "Traceback ...\nRuntimeError: boom\n"
    with pytest.raises(ConfigError, match=f"{out / 'metrics' / 'rank0.jsonl'} is a symbolic link"):
        JsonlWriter(out / "metrics" / "rank0.jsonl")
    assert _listing(elsewhere) == targets


def test_a_checkpoint_save_replaces_a_linked_pointer_and_refuses_a_linked_temporary_folder(tmp_path):
    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.train.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint

    root = tmp_path / "checkpoints"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pointer").write_bytes(TARGET)
    (elsewhere / "folder").mkdir()
    (elsewhere / "folder" / "precious.txt").write_bytes(TARGET)
    (root / "latest").symlink_to(elsewhere / "pointer")
    (root / "step_000001.old").symlink_to(elsewhere / "folder", target_is_directory=True)
    targets = _listing(elsewhere)
    model = Llama(LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16))

    step1 = save_checkpoint(root, 1, model, None, {})
    assert not (root / "latest").is_symlink() and (root / "latest").read_text() == "step_000001\n"
    assert latest_checkpoint(root) == step1
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # the leftover's link went, not its folder
    (root / "step_000002.tmp").symlink_to(elsewhere / "folder", target_is_directory=True)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, 2, model, None, {})
    assert str(info.value).startswith(f"{root / 'step_000002.tmp'} is a symbolic link, which agoq does not follow (files would be written")
    assert _listing(elsewhere) == targets
    assert latest_checkpoint(root) == step1


def test_the_data_cache_never_writes_through_a_link(tmp_path, capsys):
    """Cached files linked elsewhere (other bytes: each fails its digest) are rebuilt in place of the
    links; a linked lock file is refused with one line. What the links name is untouched."""
    from agoq.data.tokens import prepare_data

    built = prepare_data(train_corpus(), None, 512, data_cache())
    tokenizer = Path(built.tokenizer.source.split("(", 1)[1].rstrip(")"))
    cache = tmp_path / "cache"
    files = [tokenizer, tokenizer.with_name(tokenizer.name + ".sha256"), built.packed.path, built.packed.path.with_suffix(".json")]
    names = [str(f.relative_to(data_cache())) for f in files]
    for f, name in zip(files, names):
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, cache / name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in names:
        _link_to_elsewhere(cache, name, elsewhere)
    targets = _listing(elsewhere)
    data = prepare_data(train_corpus(), None, 512, cache)
    assert data.packed.meta["sha256"] == built.packed.meta["sha256"] and _listing(elsewhere) == targets
    assert not any((cache / name).is_symlink() for name in names)
    assert "rebuilt" in capsys.readouterr().err

    lock = data.packed.path.with_name(data.packed.path.name + ".lock")
    _link_to_elsewhere(cache, str(lock.relative_to(cache)), elsewhere)
    targets = _listing(elsewhere)
    with pytest.raises(ConfigError) as info:
        prepare_data(train_corpus(), None, 512, cache)
    assert str(info.value) == (
        f"{lock} is a symbolic link, which agoq does not follow (the file it points to would be overwritten); "
        f"delete the link (rm {lock}) or use another cache folder with --data.cache_dir=PATH"
    )
    assert _listing(elsewhere) == targets


# ------------------------------------------------------------------------- what a resume pins


def _permuted(tokenizer: Path, dst: Path) -> Path:
    """The tokenizer file with the ids of its merged tokens rotated: valid, same tokens, other ids."""
    spec = json.loads(tokenizer.read_text())
    vocab = spec["model"]["vocab"]
    merged = sorted((i for i in vocab.values() if i >= 257), key=int)
    moved = dict(zip(merged, merged[1:] + merged[:1]))
    spec["model"]["vocab"] = {token: moved.get(i, i) for token, i in vocab.items()}
    dst.write_text(json.dumps(spec, ensure_ascii=False, indent=2))
    return dst


def test_a_resume_with_a_permuted_tokenizer_is_refused_before_launch_and_changes_nothing(trained, tmp_path, capfd):
    from agoq.data.tokenizer import load_tokenizer

    run, tokenizer = trained
    out = _copy(run, tmp_path)
    permuted = _permuted(tokenizer, tmp_path / "tok.json")
    old, new = load_tokenizer(tokenizer).vocab_fingerprint, load_tokenizer(permuted).vocab_fingerprint
    assert old != new and load_tokenizer(permuted).vocab_size == load_tokenizer(tokenizer).vocab_size
    step2 = out / "checkpoints" / "step_000002"
    assert json.loads((step2 / "manifest.json").read_text())["data"]["tokenizer_fingerprint"] == old
    before = _listing(out)
    capfd.readouterr()
    assert _train(out, permuted, "--train.steps=4") == 2
    printed = capfd.readouterr()
    assert _one_line(printed.err) == (
        f"agoq train: data.tokenizer='{permuted}' is not the tokenizer checkpoint {step2} was trained with "
        f"(vocabulary fingerprint {new[:12]} here, {old[:12]} in the checkpoint); resume with the original tokenizer file, "
        "or start a new run with --train.out_dir=runs/NAME"
    )
    assert "resuming" not in printed.out and "local process" not in printed.out  # no worker started
    assert _listing(out) == before


def test_the_same_tokenizer_saved_again_matches_its_checkpoint(trained, tmp_path, capsys):
    """Reformatted, its keys in another order, its merges in the older "a b" form: the same tokenizer."""
    from agoq.data.tokens import prepare_data
    from agoq.launch.run import check_resume_data

    run, tokenizer = trained
    spec = json.loads(tokenizer.read_text())
    spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
    again = tmp_path / "tok.json"
    again.write_text(json.dumps(dict(reversed(spec.items())), indent=4))
    assert again.read_bytes() != tokenizer.read_bytes()
    cfg = load_config(None, [f"--train.out_dir={run}", f"--data.corpus={train_corpus()}", f"--data.tokenizer={again}", "--data.vocab_size=512"])
    check_resume_data(cfg, prepare_data(train_corpus(), again, 512, data_cache()))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "key, line",
    [
        (
            "corpus_fingerprint",
            "data.corpus='{corpus}' is not the corpus checkpoint {step} was trained on (fingerprint {here} here, {saved} in the checkpoint); resume with the original corpus",
        ),
        (
            "tokens_sha256",
            "data.tokenizer='{tok}' splits the corpus into other tokens than checkpoint {step} was trained on (token file SHA-256 {here} here, {saved} in the checkpoint); resume with the original tokenizer file",
        ),
    ],
)
def test_a_resume_on_other_data_is_refused_before_launch(trained, tmp_path, capsys, key, line):
    run, tokenizer = trained
    out = _copy(run, tmp_path)
    step2 = out / "checkpoints" / "step_000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    here, manifest["data"][key] = manifest["data"][key], "0123456789ab" * 5  # what another corpus or tokenization would have left
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    before = _listing(out)
    assert _train(out, tokenizer, "--train.steps=4") == 2
    expected = line.format(step=step2, here=here[:12], saved="0123456789ab", tok=tokenizer, corpus=train_corpus())
    assert _one_line(capsys.readouterr().err) == f"agoq train: {expected}, or start a new run with --train.out_dir=runs/NAME"
    assert _listing(out) == before


def test_a_checkpoint_without_fingerprints_resumes_with_one_line_of_notice(trained, tmp_path, capfd):
    run, tokenizer = trained
    out = _copy(run, tmp_path)
    step2 = out / "checkpoints" / "step_000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    del manifest["data"]  # as an earlier agoq wrote it
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    capfd.readouterr()
    assert _train(out, tokenizer, "--train.steps=3") == 0
    printed = capfd.readouterr().out
    notice = (
        f"agoq train: checkpoint {step2} records no tokenizer or corpus fingerprint (saved by an earlier agoq, or without its manifest): "
        "the tokenizer and corpus of this run cannot be verified against the ones it was trained on"
    )
    assert printed.count(notice) == 1, printed[-3000:]
    assert f"resuming from {step2} (step 2 of 3; every file's checksum verified)" in printed
    saved = json.loads((out / "checkpoints" / "step_000003" / "manifest.json").read_text())["data"]
    assert (
        saved["tokenizer_fingerprint"]
        == json.loads((run / "checkpoints" / "step_000002" / "manifest.json").read_text())["data"]["tokenizer_fingerprint"]
    )
