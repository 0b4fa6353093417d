"""Faults in the data a run trains on, and in the values that shape it: a tampered cache is rebuilt
with one line, and every bad corpus, cache folder, sequence length or model override is refused
before launch with one line naming the value and the fix."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from agoq.launch.config import load_config
from agoq.data.tokens import CacheMismatch, open_packed, prepare_data
from tests._data import SMALL_MODEL

# A one-process run of a small model: the faults checked here are the launcher's, not the layout's.
SMALL = [
    *SMALL_MODEL,
    "--data.batch_size=4",
    "--parallel.pp=1",
    "--parallel.dp=1",
    "--parallel.microbatches=1",
    "--optim.warmup_steps=0",
    "--train.steps=2",
    "--train.eval_every=0",
    "--train.baseline=false",
    "--checkpoint.every=0",
    "--precision.compute_dtype=fp32",
    "--precision.quant_backend=torch",
]


@pytest.fixture(autouse=True)
def _no_early_forkserver(monkeypatch):
    # main() starts the workers' fork server as it begins; nearly every case here stops before any
    # worker, so it would only take CPU from the rest of the suite.
    import agoq.launch.forkserver

    monkeypatch.setattr(agoq.launch.forkserver, "start_early", lambda preload: None)


@pytest.fixture
def launches(monkeypatch):
    """Replaces the worker launch: records each launch's config and starts nothing."""
    import torch.distributed.launcher.api as api

    seen = []

    def fake(config, entry):
        def run(cfg, choices, launcher_pid, output):
            seen.append(cfg)
            return {0: None}

        return run

    monkeypatch.setattr(api, "elastic_launch", fake)
    return seen


def _corpus(folder):
    """A small .txt corpus of varied sentences (about 20 k characters)."""
    words = "in the beginning god created heaven and earth light was good evening morning day water".split()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=12)).capitalize() + "." for _ in range(250)]
    path = folder / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err.strip()


def _refused(capsys, args, launches=None) -> str:
    from agoq.cli import main

    assert main(["train", *args]) == 2
    if launches is not None:
        assert launches == []  # refused before any worker was started
    return _one_line(capsys)


# ---------------------------------------------------------------------------------- token cache


def test_a_token_cache_overwritten_with_one_id_is_rebuilt_with_one_line(tmp_path, capsys, launches):
    """Every token of the cached file overwritten by one id, size unchanged: the launcher finds the
    digest differs, says so in one line and rebuilds; the tokens the workers then read are a clean
    build's."""
    from agoq.cli import main

    corpus = _corpus(tmp_path)
    clean = prepare_data(corpus, vocab_size=512, cache=tmp_path / "clean")
    cache = tmp_path / "cache"
    args = [*SMALL, f"--data.corpus={corpus}", f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"]
    assert main(["train", *args]) == 0
    assert capsys.readouterr().err == ""
    (path,) = (cache / "tokens").glob("*.bin")
    assert np.array_equal(np.fromfile(path, dtype=np.uint16), np.asarray(clean.packed.tokens))
    size = path.stat().st_size
    np.full(size // 2, 7, dtype=np.uint16).tofile(path)
    assert path.stat().st_size == size
    with pytest.raises(CacheMismatch, match="does not match the SHA-256"):
        open_packed(path, verify=True)

    assert main(["train", *args]) == 0
    assert _one_line(capsys) == f"agoq train: token cache {path} did not match its digest; rebuilt"
    assert len(launches) == 2
    rebuilt = open_packed(path, verify=True)
    assert np.array_equal(np.asarray(rebuilt.tokens), np.asarray(clean.packed.tokens))
    # A worker reading it after the launcher (verify=False) gets the same tokens.
    assert np.array_equal(np.asarray(prepare_data(corpus, vocab_size=512, cache=cache, verify=False).packed.tokens), np.asarray(clean.packed.tokens))
    assert capsys.readouterr().err == ""


def test_a_tampered_cached_tokenizer_is_rebuilt_with_one_line(tmp_path, capsys, launches):
    """Two ids of the cached BPE swapped (still a tokenizer that loads): without a check the token
    file would be repacked with the wrong ids; the digest finds it and the BPE is trained again."""
    from agoq.cli import main

    corpus = _corpus(tmp_path)
    clean = prepare_data(corpus, vocab_size=512, cache=tmp_path / "clean")
    cache = tmp_path / "cache"
    args = [*SMALL, f"--data.corpus={corpus}", f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"]
    assert main(["train", *args]) == 0
    capsys.readouterr()
    (tok_path,) = (cache / "tokenizers").glob("*.json")
    original = tok_path.read_text()
    spec = json.loads(original)
    vocab = spec["model"]["vocab"]
    a, b = "e", "t"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_path.write_text(json.dumps(spec))

    assert main(["train", *args]) == 0
    assert _one_line(capsys) == f"agoq train: tokenizer cache {tok_path} did not match its digest; rebuilt"
    assert tok_path.read_text() == original
    data = prepare_data(corpus, vocab_size=512, cache=cache)
    assert data.tokenizer.fingerprint == clean.tokenizer.fingerprint
    assert np.array_equal(np.asarray(data.packed.tokens), np.asarray(clean.packed.tokens))


def test_a_run_trains_the_model_its_banner_announces_on_the_tokens_of_a_clean_build(tmp_path, capfd):
    """A real one-process run, its token cache tampered with first: the first step's loss is the
    loss of the announced model on a clean build's first batch, and the parameters trained are the
    banner's. The corpus is small enough that its BPE finds fewer tokens than data.vocab_size: the
    model keeps data.vocab_size rows, as announced, instead of shrinking to the tokenizer's."""
    import torch

    from agoq.activation import make_policy
    from agoq.cli import main
    from agoq.models import Llama
    from agoq.data.tokens import TrainSampler, split_tokens

    corpus = _corpus(tmp_path)
    cache = tmp_path / "cache"
    clean = prepare_data(corpus, vocab_size=4096, cache=tmp_path / "clean")
    assert clean.tokenizer.vocab_size < 4096
    prepare_data(corpus, vocab_size=4096, cache=cache)
    (path,) = (cache / "tokens").glob("*.bin")
    np.zeros(path.stat().st_size // 2, dtype=np.uint16).tofile(path)
    out = tmp_path / "run"
    args = [
        *[a for a in SMALL if not a.startswith("--data.vocab_size")],
        "--data.vocab_size=4096",
        "--precision.activations=bf16",
        "--precision.gradients=fp32",
        f"--data.corpus={corpus}",
        f"--data.cache_dir={cache}",
        f"--train.out_dir={out}",
    ]
    capfd.readouterr()
    assert main(["train", *args]) == 0
    captured = capfd.readouterr()
    assert [line for line in captured.err.splitlines() if line.startswith("agoq train:")] == [
        f"agoq train: token cache {path} did not match its digest; rebuilt"
    ], captured.err
    cfg = load_config(None, args)
    mc = cfg.model_config()
    banner = re.search(r"model tiny \(([\d.]+) M parameters\)", captured.out)
    assert banner and banner.group(1) == f"{mc.num_parameters() / 1e6:.1f}", captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == mc.to_dict() and summary["model"]["vocab_size"] == 4096
    assert sum(r["param_count"] for r in summary["ranks"]) == mc.num_parameters()
    model = Llama(mc, make_policy("bf16"))
    model.reset_parameters(cfg.train.seed)
    train, _ = split_tokens(clean.packed.tokens, cfg.data.val_fraction)
    x, y = TrainSampler(train, cfg.data.seq_len, cfg.data.batch_size, 0, 1, cfg.train.seed).next_batch()
    with torch.no_grad():
        expected = float(model(x, y))
    assert summary["records"][0]["loss"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------- sequence and model


def test_a_sequence_beyond_the_presets_context_is_refused_naming_the_override(capsys, launches):
    err = _refused(capsys, ["--data.seq_len=100000"], launches)
    assert "data.seq_len=100000 exceeds model tiny's max_seq_len=256" in err and "--model.overrides={max_seq_len=100000}" in err, err
    # With the context raised, the run is honoured: the model trained has that max_seq_len.
    assert load_config(None, ["--data.seq_len=512", "--model.overrides={max_seq_len=512}"]).model_config().max_seq_len == 512
    assert load_config(None, ["--data.seq_len=128"]).model_config().max_seq_len == 256  # the preset's, not raised to anything


def test_a_sequence_beyond_an_explicit_max_seq_len_is_refused_before_launch(capsys, launches):
    err = _refused(capsys, ["--model.overrides={max_seq_len=64}", "--data.seq_len=128"], launches)
    assert "data.seq_len=128 exceeds model.max_seq_len=64; lower data.seq_len or set --model.overrides={max_seq_len=128}" in err, err
    err = _refused(capsys, ["--model.max_seq_len=64", "--data.seq_len=128"], launches)
    assert "data.seq_len=128 exceeds model.max_seq_len=64" in err, err


def test_a_batch_longer_than_the_corpus_is_refused_before_launch(tmp_path, capsys, launches):
    corpus = _corpus(tmp_path)
    args = [*SMALL, f"--data.corpus={corpus}", f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={tmp_path / 'run'}"]
    err = _refused(capsys, [*args, "--data.seq_len=100000", "--model.overrides={max_seq_len=100000}"], launches)
    assert "training tokens, fewer than one batch of data.batch_size=4 x (data.seq_len=100000 + 1) = 400004" in err, err


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_launch(tmp_path, capsys, launches, monkeypatch):
    """The check compares agoq plan's estimate of every local process's tensors with the machine's
    memory; here the machine is made to report 64 MiB, less than the default run's four processes need."""
    import agoq.launch.planning as fit
    from agoq.launch.planning import from_train_config
    from agoq.plan.memory import plan_memory

    cfg = load_config(None, ["--precision.compute_dtype=fp32"])
    (setup,) = plan_memory(from_train_config(cfg)).setups
    need = sum(r.total for r in setup.ranks) * cfg.parallel.dp
    assert need > 64 * 2**20
    monkeypatch.setattr(fit, "machine_memory_bytes", lambda: 64 * 2**20)
    args = ["--precision.compute_dtype=fp32", f"--train.out_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    err = _refused(capsys, args, launches)
    assert (
        f"data.batch_size=16 x data.seq_len=128 needs about {need / 2**30:.1f} GiB over the 4 local processes (agoq plan's estimate), "
        "more than this machine's 0.1 GiB; lower data.seq_len or data.batch_size, or raise parallel.microbatches"
    ) in err, err
    assert not (tmp_path / "cache").exists()  # refused before the data was prepared


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--model.overrides={vocab_size=10}",
            "model.vocab_size=10 cannot be set: the model has one embedding row per id of the tokenizer; set data.vocab_size=N",
        ),
        ("--model.vocab_size=10", "model.vocab_size=10 cannot be set"),
        ("--model.overrides={layers=2}", "model.overrides has unknown field 'layers'; valid fields: hidden, n_layers, n_heads"),
        ("--model.overrides={tie_embeddings=2}", "model.tie_embeddings=2 is not a boolean; use true or false (or yes/no, 1/0)"),
        # 1 is true, as on the command line (--model.tie_embeddings=1): refused here for the layout only.
        ("--model.overrides={tie_embeddings=1}", "model.tie_embeddings=true is not supported with parallel.pp > 1"),
        ("--model.overrides={n_layers=2.5}", "model.n_layers=2.5 is not an integer"),
        ("--model.overrides={norm_eps=-1}", "model.norm_eps=-1.0 must be a finite number > 0"),
        ("--model.norm_eps=nan", "model.norm_eps=nan must be a finite number > 0"),
        (
            "--precision.recompute_layers=3",
            "precision.recompute_layers=3 exceeds the 2 decoder layers of each pipeline stage (model.n_layers=4 over parallel.pp x parallel.virtual_stages = 2); use at most 2",
        ),
    ],
)
def test_every_model_override_is_honoured_or_refused(override, message, capsys, launches):
    err = _refused(capsys, [override], launches)
    assert message in err, err


def test_every_model_field_reaches_the_model_trained():
    """Each LlamaConfig field set in model.overrides is the LlamaConfig the trainer builds, and the
    model built from it has the shapes, norm epsilon, rotary base and tied head it says."""
    import torch

    from agoq.models import Llama
    from agoq.models.config import LlamaConfig
    from agoq.models.llama import rope_tables

    asked = {
        "hidden": 48,
        "n_layers": 2,
        "n_heads": 6,
        "n_kv_heads": 3,
        "intermediate": 96,
        "max_seq_len": 64,
        "rope_theta": 5000.0,
        "norm_eps": 1e-6,
        "tie_embeddings": True,
    }
    assert set(asked) == set(LlamaConfig.__dataclass_fields__) - {"vocab_size"}
    table = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in asked.items()) + "}"
    cfg = load_config(None, [f"--model.overrides={table}", "--parallel.pp=1", "--data.seq_len=64", "--data.vocab_size=300"])
    mc = cfg.model_config()
    assert {k: getattr(mc, k) for k in asked} == asked and mc.vocab_size == 300
    model = Llama(mc)
    assert model.embed.weight.shape == (300, 48) and len(model.layers) == 2
    layer = model.layers["0"]
    assert layer.attn.k.weight.shape == (3 * 8, 48) and layer.mlp.gate.weight.shape == (96, 48)
    assert layer.attn_norm.eps == 1e-6 and model.norm.eps == 1e-6
    assert model.head.weight is model.embed.weight
    assert torch.equal(model._rope_for(64, torch.device("cpu"))[0], rope_tables(mc, 64)[0])
    assert not torch.equal(rope_tables(mc, 64)[0], rope_tables(LlamaConfig(hidden=48, n_heads=6, n_kv_heads=3), 64)[0])
    assert sum(p.numel() for p in model.parameters()) == mc.num_parameters()
    with pytest.raises(ValueError, match="sequence length 65 exceeds model.max_seq_len=64"):
        model._rope_for(65, torch.device("cpu"))


def test_a_tokenizer_files_vocabulary_is_the_models_and_data_vocab_size_may_not_contradict_it(tmp_path, capsys, launches):
    from agoq.data.tokenizer import train_bpe

    path = tmp_path / "tokenizer.json"
    tok = train_bpe(_corpus(tmp_path).read_text().splitlines(), vocab_size=300)
    tok.save(path)
    assert load_config(None, [f"--data.tokenizer={path}"]).model_config().vocab_size == tok.vocab_size
    err = _refused(capsys, [f"--data.tokenizer={path}", "--data.vocab_size=512"], launches)
    assert f"data.vocab_size=512 is not used with data.tokenizer='{path}', whose vocabulary is {tok.vocab_size}; drop data.vocab_size" in err, err


# ---------------------------------------------------------------------------- data preparation


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", "", "the corpus is empty: no text in {path}; add text or point to another corpus"),
        ("binary.txt", b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50, "{path!r} holds NUL bytes: it is a binary file, not text"),
        ("latin1.txt", "Caf\xe9 au lait. ".encode("latin-1") * 20, "{path!r} is not UTF-8 text ("),
        ("latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), "{path!r} is not UTF-8 text ("),
        (
            "lines.jsonl",
            '{"text": "ok"}\nnot json at all\n',
            '{path}:2: not valid JSON (Expecting value); each line of a .jsonl corpus must be a JSON object with a "text" field',
        ),
        ("notext.jsonl", '{"title": "x"}\n', "{path}:1: no \"text\" field (got keys ['title'])"),
        ("table.csv", "a,b\n1,2\n", "{path!r} has unsupported extension '.csv'"),
        ("folder/", None, "folder {path!r} holds no .txt or .jsonl files (it is empty); add some or point to another folder"),
    ],
)
def test_every_bad_corpus_is_refused_before_launch_with_one_line(tmp_path, capsys, launches, name, content, message):
    path = tmp_path / name.rstrip("/")
    if name.endswith("/"):
        path.mkdir()
    else:
        _write(path, content)
    cache = tmp_path / "cache"
    err = _refused(capsys, [*SMALL, f"--data.corpus={path}", f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"], launches)
    assert err.startswith(f"agoq train: data.corpus='{path}': "), err
    assert message.format(path=str(path)) in err, err
    assert not (cache / "tokens").exists() and not (cache / "tokenizers").exists()  # nothing was built from it


def test_a_txt_link_out_of_a_corpus_folder_is_refused_and_one_within_it_is_read(tmp_path, capsys, launches):
    folder = tmp_path / "corpus"
    folder.mkdir()
    _corpus(folder)
    outside = tmp_path / "private.txt"
    outside.write_text("not meant for training\n")
    (folder / "notes.txt").symlink_to(outside)
    cache = tmp_path / "cache"
    args = [*SMALL, f"--data.corpus={folder}", f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"]
    err = _refused(capsys, args, launches)
    assert err == (
        f"agoq train: data.corpus='{folder}': '{folder / 'notes.txt'}' is a symbolic link to '{outside}', outside the corpus folder; "
        "copy that file into the folder, or delete the link"
    )
    assert not (cache / "tokens").exists()  # nothing was built from it
    # A link to a file of the folder itself adds nothing from elsewhere: read as any file is.
    (folder / "notes.txt").unlink()
    (folder / "notes.txt").symlink_to("corpus.txt")
    from agoq.cli import main

    assert main(["train", *args]) == 0 and len(launches) == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "dev-zero-link.txt"])
def test_a_corpus_that_is_neither_a_file_nor_a_folder_is_refused_naming_what_it_is(tmp_path, capsys, launches, kind):
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
        what = "a named pipe (FIFO)"
    elif kind == "dev-zero":
        path = Path("/dev/zero")
        what = "a character device"
    else:
        path.symlink_to("/dev/zero")
        what = "a character device"
    if not path.exists():
        pytest.skip("no /dev/zero here")
    cache = tmp_path / "cache"
    err = _refused(capsys, [*SMALL, f"--data.corpus={path}", f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"], launches)
    assert err == (
        f"agoq train: data.corpus='{path}': '{path}' is {what}, not a regular file or folder; give a .txt or .jsonl file, or a folder of them"
    )
    assert not (cache / "tokens").exists()
    assert not (tmp_path / "run").exists()  # refused before the run folder was claimed


def test_a_corpus_that_does_not_exist_is_refused_naming_it(tmp_path, capsys, launches):
    missing = tmp_path / "nowhere.txt"
    err = _refused(capsys, [f"--data.corpus={missing}"], launches)
    assert f"data.corpus='{missing}' does not exist; pass a .txt/.jsonl file or folder, or 'kjv'" in err, err


def test_an_unwritable_cache_dir_is_refused_naming_it(tmp_path, capsys, launches):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    corpus = _corpus(tmp_path)
    cache = blocked / "cache"
    err = _refused(capsys, [*SMALL, f"--data.corpus={corpus}", f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"], launches)
    assert f"data.cache_dir='{cache}' cannot be written (" in err and "pass a writable folder with --data.cache_dir=PATH" in err, err
    assert blocked.read_text() == "a file where the cache folder should be"


def test_a_missing_tokenizer_file_is_refused_naming_it(tmp_path, capsys, launches):
    err = _refused(capsys, [f"--data.tokenizer={tmp_path / 'tokenizer.json'}"], launches)
    assert f"data.tokenizer='{tmp_path / 'tokenizer.json'}' is not a file" in err, err
