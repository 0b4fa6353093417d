"""Every environment variable named AGOQ_*, in one list, and the check of each before a run starts.

Settings belong in the config (``--section.key=value``). The environment holds only what must reach
code without a config: the quantization backend of library use, the cache folder, and what the
local launcher tells its workers. ``agoq train`` refuses a bad value in one line before anything
starts, and names the AGOQ_* variables it does not read (an old or misspelt name would otherwise
do nothing, silently). docs/training.md lists them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from agoq.quant.backend import BACKENDS, ENV_VAR as QUANT_BACKEND_ENV
from agoq.launch.forkserver import LAUNCHER_ENV, LOOPBACK_ENV
from agoq.data.tokenizer import CACHE_ENV

PREFIX = "AGOQ_"


@dataclass(frozen=True)
class Variable:
    """One AGOQ_* variable: what it means, what it accepts, and its check (None: the value is fine)."""

    name: str
    accepted: str
    meaning: str
    problem: Callable[[str], str | None]


def _backend_problem(value: str) -> str | None:
    # The same reading as agoq.quant.backend.get_backend: case and spaces aside, empty meaning auto.
    return None if not value or value.strip().lower() in BACKENDS else f"is not a quantization backend; use one of {', '.join(BACKENDS)}, or unset it"


def _cache_problem(value: str) -> str | None:
    if not value:
        return None  # unset or empty: ~/.cache/agoq (agoq.data.tokenizer.cache_dir)
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        return "is not a folder; name a folder (it is made if missing), or unset it and pass --data.cache_dir=PATH"
    return None


def _launcher_only(value: str) -> str | None:
    return "is set only by agoq's local launcher, in its workers' environment; unset it"


VARIABLES = (
    Variable(
        QUANT_BACKEND_ENV,
        " | ".join(BACKENDS),
        "how quantization runs, in library use and in `agoq train` (it takes precedence over precision.quant_backend)",
        _backend_problem,
    ),
    Variable(CACHE_ENV, "a folder", "the tokenizer and token-file cache where data.cache_dir is unset (default ~/.cache/agoq)", _cache_problem),
    Variable(LOOPBACK_ENV, "(internal)", "set by the local launcher for its workers: host the process-group store on 127.0.0.1", _launcher_only),
    Variable(LAUNCHER_ENV, "(internal)", "set by the local launcher for what it starts: its pid, so that they die with it", _launcher_only),
)
# Read by a checkout's benchmarks and tests, never by the agoq package: no notice names them.
CHECKOUT_VARIABLES = (
    "AGOQ_RESULTS_DIR",
    "AGOQ_REVISION",
    "AGOQ_NETNS_TAG",
    "AGOQ_TEST_DATA_CACHE",
    "AGOQ_TEST_TRITON_DEVICE",
    "AGOQ_TEST_LARGE_NUMEL",
)


def environment_problem(env: Mapping[str, str] | None = None) -> str | None:
    """The one line refusing the first AGOQ_* variable of ``env`` (default: this process's) whose
    value agoq cannot use, naming it, its value and what it accepts; None when every one is fine."""
    env = os.environ if env is None else env
    for var in VARIABLES:
        if var.name in env:
            problem = var.problem(env[var.name])
            if problem is not None:
                return f"environment variable {var.name}={env[var.name]!r} {problem}"
    return None


def unread_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The AGOQ_* variables of ``env`` (default: this process's) that nothing in agoq reads."""
    env = os.environ if env is None else env
    known = {v.name for v in VARIABLES} | set(CHECKOUT_VARIABLES)
    return {k: v for k, v in sorted(env.items()) if k.startswith(PREFIX) and k not in known}


def unread_notice(env: Mapping[str, str] | None = None) -> str | None:
    """The opening line naming the AGOQ_* variables agoq does not read, or None."""
    unread = unread_variables(env)
    if not unread:
        return None
    found = ", ".join(f"{k}={v}" for k, v in unread.items())
    read = " and ".join(v.name for v in VARIABLES if v.accepted != "(internal)")
    return f"agoq train: {found} in the environment ignored: agoq reads no such variable (it reads {read}; docs/training.md)"
