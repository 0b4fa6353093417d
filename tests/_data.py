"""The tokenizer and token cache that the suite's training runs share.

Tokenizers and token files are cached by the corpus's content and the vocabulary size, so one
folder serves every test that trains on the same corpus: the BPE of KJV at vocabulary 512 is built
once (about 2 s) instead of in each test's own folder. tests/conftest.py makes the folder for the
session and names it in the environment, which the ranks of distributed checks inherit.
"""

from __future__ import annotations

import os
from pathlib import Path

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
