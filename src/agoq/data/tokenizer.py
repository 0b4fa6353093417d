"""Tokenizers: a byte-level BPE trained locally on the corpus (cached), or a user's tokenizer.json.

Byte-level BPE needs no download, never maps text to an unknown token, and decodes back to the
exact input string. Training it on the 4.1 M-character KJV takes about half a second; the result is
deterministic, so every process that builds it gets the same ids.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from agoq.nofollow import CACHE_ELSEWHERE, open_in_place, write_atomic

DEFAULT_VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files, tried in this order when the user does not
# name one.
KNOWN_EOS_TOKENS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
# Fewer ids than this cannot hold the 256 byte symbols plus the end-of-document token.
MIN_VOCAB_SIZE = 257
CACHE_ENV = "AGOQ_CACHE_DIR"
# Beside each cached tokenizer: the SHA-256 of its bytes, checked before it is used.
DIGEST_SUFFIX = ".sha256"


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: ``path`` if given, else $AGOQ_CACHE_DIR, else ~/.cache/agoq."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "agoq"


class Tokenizer:
    """Text <-> token ids, with the vocabulary size and the end-of-document id the packer needs."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token: str, source: str = "") -> None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer {source or '(in memory)'} has no token {eos_token!r}; name its end-of-document token with eos_token=...")
        self.backend = backend
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        self.source = source
        serialized = backend.to_str()
        # Names the token cache: everything that makes ids from text (normalizer, pre-tokenizer, ...).
        self.fingerprint: str = hashlib.sha256((serialized + "\0" + eos_token).encode("utf-8")).hexdigest()
        self.vocab_fingerprint: str = vocab_fingerprint(backend, eos_id, serialized)
        # Ids run 0..vocab_size-1; an embedding table needs this many rows.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS/EOS or any other added template tokens."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (as :meth:`encode`), encoded in parallel."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens such as EOS are dropped."""
        return self.backend.decode([int(i) for i in ids])

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the tokenizer as a tokenizer.json file (atomically) and return its path."""
        path = Path(path)
        write_atomic(path, self.backend.to_str())
        return path

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}->{self.eos_id}, source={self.source!r})"


def vocab_fingerprint(backend: tokenizers.Tokenizer, eos_id: int, serialized: str | None = None) -> str:
    """SHA-256 of what a token id means: the vocabulary (token of each id), the merges and the end-of-document id.

    What a checkpoint pins (agoq.launch.run.check_resume_data). Taken from the tokenizer's content,
    not its file: a file saved again, reformatted or with its keys in another order, matches, and
    so does one written by another ``tokenizers`` version (merges "a b" or ["a", "b"]).
    """
    model = json.loads(serialized if serialized is not None else backend.to_str()).get("model", {})
    vocab = sorted(backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges") or []]
    content: dict[str, Any] = {"type": model.get("type"), "vocab": vocab, "merges": merges, "eos_id": eos_id}
    if isinstance(model.get("vocab"), list):  # Unigram: the pieces' scores decide the segmentation
        content["scores"] = [piece[1] for piece in model["vocab"]]
    return hashlib.sha256(json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")).hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` ids (EOS included) trained on ``texts``."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + EOS), got {vocab_size!r}")
    backend = tokenizers.Tokenizer(models.BPE())
    # No prefix space: encode/decode must round-trip the exact text.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, EOS_TOKEN, source=f"bpe-{vocab_size}")


def load_tokenizer(path: str | os.PathLike[str], eos_token: str | None = None) -> Tokenizer:
    """A tokenizer read from a tokenizer.json file; EOS is ``eos_token`` or a known end token."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {str(path)!r} does not exist; point to a Hugging Face tokenizer.json "
            "or leave the tokenizer unset to train a BPE on the corpus"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception with a serde message
        raise ValueError(
            f"{str(path)!r} is not a readable tokenizer.json ({exc}); save one with tokenizers' Tokenizer.save or transformers' save_pretrained"
        ) from exc
    if eos_token is None:
        eos_token = next((t for t in KNOWN_EOS_TOKENS if backend.token_to_id(t) is not None), None)
        if eos_token is None:
            raise ValueError(
                f"tokenizer {str(path)!r} has none of the end-of-document tokens {', '.join(KNOWN_EOS_TOKENS)}; name its EOS token with eos_token=..."
            )
    return Tokenizer(backend, eos_token, source=str(path))


def load_or_train_bpe(
    texts: Iterable[str] | None,
    corpus_fingerprint: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """The BPE for (corpus, vocab size): from the cache, else trained on ``texts`` and cached."""
    path = cache_dir(cache) / "tokenizers" / f"bpe-{corpus_fingerprint[:16]}-v{vocab_size}.json"
    digest_path = path.with_name(path.name + DIGEST_SUFFIX)
    with file_lock(path):
        if path.is_file():
            data = path.read_bytes()
            try:
                recorded = digest_path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                recorded = None  # a cache written before digests were kept: rebuilt below, silently
            if recorded == hashlib.sha256(data).hexdigest():
                return _cached(path, vocab_size)
            if recorded is not None:
                notify(f"agoq train: tokenizer cache {path} did not match its digest; rebuilt")
        if texts is None:
            raise ValueError(f"no cached tokenizer at {str(path)!r} and no texts to train one on")
        tokenizer = train_bpe(texts, vocab_size)
        tokenizer.save(path)
        # The digest goes last: a tokenizer file without its digest is never trusted.
        write_atomic(digest_path, hashlib.sha256(path.read_bytes()).hexdigest() + "\n")
    return _cached(path, vocab_size)


def _cached(path: Path, vocab_size: int) -> Tokenizer:
    tokenizer = load_tokenizer(path, EOS_TOKEN)
    tokenizer.source = f"bpe-{vocab_size} ({path})"
    return tokenizer


def notify(line: str) -> None:
    """One line for the user about something the data preparation repaired (on stderr: stdout is the run's)."""
    print(line, file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=8)
def _vocab_size_of(path: str, mtime_ns: int, size: int) -> int:
    return load_tokenizer(path).vocab_size


def tokenizer_vocab_size(path: str | os.PathLike[str]) -> int:
    """The vocabulary of a tokenizer.json (loaded once per file version: configs ask for it repeatedly)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    st = p.stat()
    return _vocab_size_of(str(p), st.st_mtime_ns, st.st_size)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock beside ``path`` so concurrent processes build it only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no flock; atomic renames still keep the files whole
        yield
        return
    fd = open_in_place(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, elsewhere=CACHE_ELSEWHERE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
