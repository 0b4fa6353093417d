"""Data pipeline: corpus readers, tokenizer, packed token file, split, samplers, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from agoq.data import tokens as data_mod
from agoq.data.tokens import (
    TrainSampler,
    corpus_files,
    open_corpus,
    open_packed,
    pack_corpus,
    prepare_data,
    split_tokens,
    token_dtype,
    validation_batches,
)
from agoq.data.tokenizer import (
    CACHE_ENV,
    EOS_TOKEN,
    cache_dir,
    load_or_train_bpe,
    load_tokenizer,
    train_bpe,
)


@pytest.fixture(scope="session")
def kjv(tmp_path_factory):
    """The default data (KJV, BPE 4096), built once per test session in a private cache."""
    cache = tmp_path_factory.mktemp("agoq-cache")
    return prepare_data(cache=cache), cache


@pytest.fixture(scope="session")
def small_tok(kjv):
    """A small BPE (vocab 300) for quick user-corpus tests."""
    return train_bpe(list(kjv[0].corpus.documents())[:50], vocab_size=300)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- corpus, tokenizer


def test_kjv_is_found_and_has_over_4m_characters(kjv):
    d, _ = kjv
    assert d.corpus.builtin and d.corpus.files[0].name == "kjv.jsonl"
    assert d.corpus.num_chars > 4_000_000
    assert d.corpus.num_documents == 1189  # one document per chapter
    first = next(d.corpus.documents())
    assert first.startswith("In the beginning God created the heaven and the earth.\n")


def test_bpe_round_trips_text_exactly_and_compresses(kjv):
    tok = kjv[0].tokenizer
    assert tok.vocab_size == 4096 and tok.eos_id == tok.backend.token_to_id(EOS_TOKEN)
    for text in [list(kjv[0].corpus.documents())[100], "  héllo\twörld\n\n日本 🎉 <tag> x  "]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids
        assert max(ids) < tok.vocab_size
        assert tok.decode(ids) == text
    # Byte-level BPE with 4096 ids: about 4 characters per token on English prose.
    assert len(kjv[0].packed) / kjv[0].corpus.num_chars < 0.3


def test_bpe_is_cached_by_corpus_and_vocab_and_training_is_deterministic(kjv):
    d, cache = kjv
    again = load_or_train_bpe(None, d.corpus.fingerprint, 4096, cache)  # None: must hit the cache
    assert again.fingerprint == d.tokenizer.fingerprint
    with pytest.raises(ValueError, match="no cached tokenizer"):
        load_or_train_bpe(None, d.corpus.fingerprint, 4000, cache)
    docs = list(d.corpus.documents())[:200]
    assert train_bpe(docs, 512).fingerprint == train_bpe(docs, 512).fingerprint


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == Path.home() / ".cache" / "agoq"


def test_user_tokenizer_json_is_loaded_with_its_eos(kjv, small_tok, tmp_path):
    path = small_tok.save(tmp_path / "tok" / "tokenizer.json")
    tok = load_tokenizer(path.parent)  # a folder holding tokenizer.json works too
    assert tok.fingerprint == small_tok.fingerprint and tok.eos_token == EOS_TOKEN
    assert tok.vocab_size == 300
    corpus = _write(tmp_path / "c.txt", "Hello there, world.\n")
    d = prepare_data(corpus, tokenizer=path, cache=tmp_path / "cache", val_fraction=0.0)
    assert d.packed.meta["tokenizer_fingerprint"] == small_tok.fingerprint
    assert list(d.packed.tokens) == small_tok.encode("Hello there, world.\n") + [small_tok.eos_id]


# ------------------------------------------------------------------------------- packed tokens


def test_packed_file_equals_direct_encoding(kjv):
    d, _ = kjv
    expected = []
    for ids in d.tokenizer.encode_batch(list(d.corpus.documents())):
        expected += ids + [d.tokenizer.eos_id]
    tokens = d.packed.tokens
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert np.array_equal(tokens, np.asarray(expected, dtype=np.uint16))
    assert d.packed.path.stat().st_size == 2 * len(expected)
    meta = json.loads(d.packed.path.with_suffix(".json").read_text())
    assert meta["num_tokens"] == len(expected) and meta["num_documents"] == 1189
    assert int((tokens == d.tokenizer.eos_id).sum()) == 1189
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_packing_crash_leaves_no_file_and_truncation_is_detected(small_tok, tmp_path, monkeypatch):
    for i in range(4):
        _write(tmp_path / "c" / f"{i}.txt", f"Document number {i}. " * 20)
    corpus = open_corpus(tmp_path / "c")
    cache = tmp_path / "cache"
    monkeypatch.setattr(data_mod, "_PACK_CHUNK_CHARS", 10)  # one encode call per document
    calls = {"n": 0}
    real = small_tok.encode_batch

    def failing(texts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # a crash mid-write
        return real(texts)

    monkeypatch.setattr(small_tok, "encode_batch", failing)
    with pytest.raises(KeyboardInterrupt):
        pack_corpus(corpus, small_tok, cache)
    assert [p for p in (cache / "tokens").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(small_tok, "encode_batch", real)

    packed = pack_corpus(corpus, small_tok, cache)
    good = np.array(packed.tokens)
    n_text = sum(len(small_tok.encode(t)) for t in corpus.documents())
    assert len(good) == corpus.num_documents + n_text
    with open(packed.path, "r+b") as f:
        f.truncate(packed.path.stat().st_size - 2)
    with pytest.raises(ValueError, match="truncated or stale"):
        open_packed(packed.path)
    assert np.array_equal(pack_corpus(corpus, small_tok, cache).tokens, good)  # rebuilt


# ------------------------------------------------------------------------------ user corpora


def test_txt_jsonl_and_folder_corpora_read_in_sorted_order(tmp_path):
    root = tmp_path / "data"
    _write(root / "b.txt", "second file")
    _write(root / "a.jsonl", '{"text": "one"}\n\n{"text": "two", "id": 7}\n{"text": ""}\n')
    _write(root / "sub" / "c.txt", "nested")
    _write(root / "notes.md", "ignored: not a corpus extension")
    _write(root / ".hidden" / "x.txt", "ignored: hidden")
    c = open_corpus(root)
    assert list(c.documents()) == ["one", "two", "second file", "nested"]
    assert (c.num_documents, c.num_chars) == (4, len("onetwosecond filenested"))
    assert [p.name for p in corpus_files(root / "a.jsonl")] == ["a.jsonl"]
    assert list(open_corpus(root / "b.txt").documents()) == ["second file"]
    # Same documents, same fingerprint; any change (even a boundary) changes it.
    rows = "".join(json.dumps({"text": t}) + "\n" for t in ["one", "two", "second file", "nested"])
    copy = _write(tmp_path / "copy.jsonl", rows)
    assert open_corpus(copy).fingerprint == c.fingerprint
    _write(copy, '{"text":"onetwo"}\n{"text":"second file"}\n{"text":"nested"}\n')
    assert open_corpus(copy).fingerprint != c.fingerprint


@pytest.mark.parametrize(
    "name, content, error, message",
    [
        ("missing.txt", None, FileNotFoundError, "does not exist"),
        ("bad.jsonl", '{"text": "ok"}\n{"title": "x"}\n', ValueError, r'l:2: no "text" field'),
        ("bad.jsonl", '{"text": "ok"}\n\n{"text": oops}\n', ValueError, r"l:3: not valid JSON"),
        ("bad.jsonl", '{"text": 12}\n', ValueError, r'bad\.jsonl:1: "text" is a int'),
        ("empty.txt", "", ValueError, "is empty"),
        ("empty.jsonl", '\n{"text": ""}\n', ValueError, "is empty"),
        ("data.csv", "a,b\n", ValueError, r"unsupported extension '\.csv'"),
        ("latin1.txt", b"caf\xe9", ValueError, "not UTF-8"),
    ],
)
def test_corpus_errors_name_the_file_and_the_fix(tmp_path, name, content, error, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        _write(path, content)
    with pytest.raises(error, match=message) as info:
        open_corpus(path)
    assert name in str(info.value)


def test_folder_and_tokenizer_errors(tmp_path):
    _write(tmp_path / "d" / "readme.md", "x")
    with pytest.raises(ValueError, match=r"no \.txt or \.jsonl files \(found extensions: \.md\)"):
        open_corpus(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    _write(tmp_path / "broken.json", "{not json")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "broken.json")


def test_tokenizer_without_known_eos_needs_eos_token(small_tok, tmp_path):
    spec = json.loads(small_tok.backend.to_str())
    spec["added_tokens"][0]["content"] = "<end>"
    spec["model"]["vocab"]["<end>"] = spec["model"]["vocab"].pop(EOS_TOKEN)
    path = _write(tmp_path / "tokenizer.json", json.dumps(spec))
    with pytest.raises(ValueError, match="eos_token="):
        load_tokenizer(path)
    assert load_tokenizer(path, eos_token="<end>").eos_id == small_tok.eos_id
    with pytest.raises(ValueError, match="has no token '<nope>'"):
        load_tokenizer(path, eos_token="<nope>")


# ------------------------------------------------------------------------- split and sampling


def test_train_and_validation_are_disjoint(kjv):
    d, _ = kjv
    n = len(d.packed)
    assert len(d.val) == math.ceil(0.015 * n) and len(d.train) + len(d.val) == n
    assert np.shares_memory(d.train, d.packed.tokens)  # views of the memory map, no copy
    # Every token a training window touches lies before the split, every validation one after.
    s = TrainSampler(d.train, seq_len=256, global_batch=8, seed=1)
    last = max(int(s.global_starts(0, i).max()) for i in range(s.batches_per_epoch(0)))
    assert last + 256 + 1 <= len(d.train)
    val = validation_batches(d.val, 256, 8)
    flat = np.asarray(d.val, dtype=np.int64)
    for i, (x, y) in enumerate(val):
        for r in range(8):
            start = (i * 8 + r) * 256
            assert torch.equal(x[r], torch.from_numpy(flat[start : start + 256]))
            assert torch.equal(y[r], torch.from_numpy(flat[start + 1 : start + 257]))
    assert (len(val) + 1) * 8 * 256 + 1 > len(d.val)  # only the partial last batch is left out
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(d.packed.tokens, 1.0)


def test_an_epoch_visits_every_window_once_and_epochs_differ():
    tokens = np.arange(1000, dtype=np.uint32)
    s = TrainSampler(tokens, seq_len=10, global_batch=4, seed=0)
    offset = int(s.global_starts(0, 0)[0]) % 10
    starts = np.concatenate([s.global_starts(0, i) for i in range(s.batches_per_epoch(0))])
    n_windows = (1000 - 1 - offset) // 10
    assert s.batches_per_epoch(0) == n_windows // 4
    assert len(set(starts.tolist())) == len(starts) == 4 * (n_windows // 4)
    assert set(((starts - offset) // 10).tolist()) <= set(range(n_windows))
    assert not np.array_equal(s.global_starts(0, 0), s.global_starts(1, 0))
    other = TrainSampler(tokens, seq_len=10, global_batch=4, seed=1)
    assert not np.array_equal(s.global_starts(0, 0), other.global_starts(0, 0))
    x, y = s.next_batch()
    assert x.shape == (4, 10) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    assert torch.equal(x[:, 0], torch.from_numpy(s.global_starts(0, 0).astype(np.int64)))


def test_dp_shards_are_disjoint_and_together_equal_the_global_batch():
    tokens = np.arange(5000, dtype=np.uint32)
    ref = TrainSampler(tokens, seq_len=16, global_batch=8, seed=5)
    ranks = {w: [TrainSampler(tokens, 16, 8, r, w, seed=5) for r in range(w)] for w in (2, 4, 8)}
    for _ in range(45):  # crosses the epoch boundary (38 batches in epoch 0)
        full = ref.next_windows()
        for w, samplers in ranks.items():
            parts = [s.next_windows() for s in samplers]
            assert all(p.shape == (8 // w, 17) for p in parts)
            assert torch.equal(torch.cat(parts), full)
            assert len({int(p[i, 0]) for p in parts for i in range(len(p))}) == 8  # disjoint
    assert ref.epoch == 1
    with pytest.raises(ValueError, match="not divisible by dp_size 3"):
        TrainSampler(tokens, 16, 8, 0, 3)
    with pytest.raises(ValueError, match="dp_rank must be in"):
        TrainSampler(tokens, 16, 8, 2, 2)
    with pytest.raises(ValueError, match="fewer than the"):
        TrainSampler(tokens[:100], 16, 8)


def test_resumed_sampler_gives_exactly_the_uninterrupted_batches():
    tokens = np.arange(3000, dtype=np.uint16)
    straight = TrainSampler(tokens, 32, 8, dp_rank=1, dp_size=2, seed=7)
    expected = [straight.next_batch() for _ in range(20)]  # 11 batches per epoch: crosses one
    first = TrainSampler(tokens, 32, 8, dp_rank=1, dp_size=2, seed=7)
    got = [first.next_batch() for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = TrainSampler(tokens, 32, 8, dp_rank=1, dp_size=2, seed=7)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(11)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
    # Resuming on 4 ranks instead of 2 keeps the same global batches.
    wide = [TrainSampler(tokens, 32, 8, r, 4, seed=7) for r in range(4)]
    for s in wide:
        s.load_state_dict(state)
    ref = TrainSampler(tokens, 32, 8, seed=7)
    ref.load_state_dict(state)
    assert torch.equal(torch.cat([s.next_windows() for s in wide]), ref.next_windows())
    with pytest.raises(ValueError, match="seed=7 but this run has seed=8"):
        TrainSampler(tokens, 32, 8, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="num_tokens"):
        TrainSampler(tokens[:2000], 32, 8, seed=7).load_state_dict(state)


def test_validation_batches_are_fixed_and_sharded():
    tokens = np.arange(700, dtype=np.uint16)
    full = validation_batches(tokens, 20, 4)
    assert len(full) == (699 // 20) // 4 == 8
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, validation_batches(tokens, 20, 4)))
    shards = [validation_batches(tokens, 20, 4, r, 2) for r in range(2)]
    for i, (x, y) in enumerate(full):
        assert torch.equal(torch.cat([shards[0][i][0], shards[1][i][0]]), x)
        assert torch.equal(y, x + 1)
    assert len(validation_batches(tokens, 20, 4, max_batches=3)) == 3
    with pytest.raises(ValueError, match="raise val_fraction"):
        validation_batches(tokens[:50], 20, 4)
