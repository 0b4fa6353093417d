"""Importing agoq changes nothing in the user's process: the environment, Dynamo's, inductor's and
torch.fx's settings, and the filesystem stay as they were; and src/ comments say why, not how fast."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Imports every agoq module in a fresh process and prints what changed (entry points that run a
# command when imported are skipped: agoq.__main__).
_PROBE = r"""
import importlib, json, os, pkgutil, sys
import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config

def configs():
    return {name: {k: repr(v) for k, v in c.get_config_copy().items()} for name, c in
            (("dynamo", dynamo_config), ("inductor", inductor_config), ("fx", fx_config))}

env, before = dict(os.environ), configs()
import agoq
names = ["agoq"]
for info in pkgutil.walk_packages(agoq.__path__, "agoq."):
    if info.name != "agoq.__main__":
        importlib.import_module(info.name)
        names.append(info.name)
after = configs()
changed = {name: sorted(k for k in set(before[name]) | set(after[name]) if before[name].get(k) != after[name].get(k)) for name in before}
env_changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
print(json.dumps({"modules": names, "config": changed, "env": env_changed}))
"""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_importing_every_agoq_module_changes_no_setting_no_variable_and_no_file(tmp_path: Path) -> None:
    folders = {name: tmp_path / name for name in ("home", "tmp", "inductor")}
    for folder in folders.values():
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE"))}
    env.update(
        HOME=str(folders["home"]),
        TMPDIR=str(folders["tmp"]),
        TORCHINDUCTOR_CACHE_DIR=str(folders["inductor"]),
        ATEN_CPU_CAPABILITY=os.environ.get("ATEN_CPU_CAPABILITY", "default"),  # the case that once set a cache folder
        PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
        PYTHONDONTWRITEBYTECODE="1",
    )
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"agoq.quant.compiled", "agoq.quant.backend", "agoq.inductor_cache", "agoq.cli", "agoq.launch.run"} <= set(report["modules"])
    assert report["config"] == {"dynamo": [], "inductor": [], "fx": []}
    assert report["env"] == []
    for name, folder in folders.items():
        assert _files(folder) == [], (name, _files(folder))


def test_the_capability_folder_is_the_launchers_choice_and_a_users_folder_stands(monkeypatch) -> None:
    from agoq import inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    inductor_cache.use_capability_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith(os.sep + "aten-cpu-capability-avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/x")
    inductor_cache.use_capability_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/x"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert inductor_cache.capability_cache_folder() is None


# A duration (a number and a unit of time), a speed ratio, or a CPU's name.
# (``s^2`` is a variance's unit, not seconds.) CPU features as code, the lowercase flag strings of
# /proc/cpuinfo and ATEN_CPU_CAPABILITY that the dtype rule reads ('avx2', 'amx_bf16'), may stand.
_TIMING = re.compile(
    r"(?<![\w.^])\d+(\.\d+)?\s*(ms|us|µs|s|sec|seconds|min|minutes)(?![\w^])|\d(\.\d+)?x\s+(faster|slower)|\b(faster|slower)\s+\d|µs|microsecond"
)
_MACHINE = re.compile(r"\b(Xeon|EPYC|Sapphire Rapids|Ryzen|Skylake|Ice ?Lake|Zen ?\d|AMX|AVX(\d+|-512)?)")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal that stands as a statement (docstrings)."""
    found: list[tuple[int, str]] = []
    with path.open("rb") as f:
        tokens = list(tokenize.tokenize(f.readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING:
            prev = next((t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL, tokenize.COMMENT)), None)
            if prev is None or prev.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
                for k, line in enumerate(tok.string.splitlines()):
                    found.append((tok.start[0] + k, line))
    return found


def test_no_comment_or_docstring_in_src_carries_a_timing_or_a_machine_name() -> None:
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        for line, text in _comments_and_docstrings(path):
            if _TIMING.search(text) or _MACHINE.search(text):
                hits.append(f"{path.relative_to(SRC)}:{line}: {text.strip()[:120]}")
    assert hits == [], "\n".join(hits)
