"""The AGOQ_* environment variables: one list of them, each refused in one line before launch when
its value cannot work, and every other AGOQ_* name said to be ignored instead of ignored silently."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agoq.launch.environment import CHECKOUT_VARIABLES, VARIABLES, environment_problem, unread_notice

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"AGOQ_[A-Z0-9_]+")


def _names_in_strings(folder: Path) -> set[str]:
    """The AGOQ_* names in the string literals of every .py file under ``folder`` (not identifiers)."""
    found = set()
    for path in folder.rglob("*.py"):
        if path.resolve() == Path(__file__).resolve():  # this file names unread ones on purpose
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(NAME.findall(node.value))
    return found


def test_every_agoq_variable_of_the_project_is_in_the_one_list_and_documented():
    read = {v.name for v in VARIABLES}
    assert read == {"AGOQ_QUANT_BACKEND", "AGOQ_CACHE_DIR", "AGOQ_LOOPBACK", "AGOQ_LAUNCHER_PID"}
    assert _names_in_strings(ROOT / "src" / "agoq") == read | set(CHECKOUT_VARIABLES)
    assert _names_in_strings(ROOT / "tests") | _names_in_strings(ROOT / "benchmarks") <= read | set(CHECKOUT_VARIABLES)
    docs = (ROOT / "docs" / "training.md").read_text()
    assert all(f"`{name}`" in docs for name in read | set(CHECKOUT_VARIABLES))


@pytest.mark.parametrize(
    "name, value, line",
    [
        (
            "AGOQ_QUANT_BACKEND",
            "bogus",
            "environment variable AGOQ_QUANT_BACKEND='bogus' is not a quantization backend; use one of auto, torch, compiled, triton, or unset it",
        ),
        (
            "AGOQ_CACHE_DIR",
            "{file}",
            "environment variable AGOQ_CACHE_DIR='{file}' is not a folder; name a folder (it is made if missing), or unset it and pass --data.cache_dir=PATH",
        ),
        ("AGOQ_LOOPBACK", "1", "environment variable AGOQ_LOOPBACK='1' is set only by agoq's local launcher, in its workers' environment; unset it"),
        (
            "AGOQ_LAUNCHER_PID",
            "123",
            "environment variable AGOQ_LAUNCHER_PID='123' is set only by agoq's local launcher, in its workers' environment; unset it",
        ),
    ],
)
def test_a_bad_value_is_refused_before_launch_in_one_line(name, value, line, tmp_path, monkeypatch, capsys):
    from agoq.cli import main
    from agoq.launch import run

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    monkeypatch.setenv(name, value.format(file=a_file))
    monkeypatch.setattr(run, "launch", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "run"
    assert main(["train", f"--train.out_dir={out}"]) == 2
    assert capsys.readouterr().err == "agoq train: " + line.format(file=a_file) + "\n"
    assert not out.exists()


def test_good_values_and_no_values_pass(tmp_path):
    assert environment_problem({}) is None
    assert environment_problem({"AGOQ_QUANT_BACKEND": " Torch ", "AGOQ_CACHE_DIR": str(tmp_path / "new")}) is None
    assert environment_problem({"AGOQ_QUANT_BACKEND": "", "AGOQ_CACHE_DIR": ""}) is None  # empty: the default, as when unset


def test_variables_agoq_does_not_read_are_named_in_the_opening_lines(monkeypatch, capsys):
    from agoq.launch.config import load_config
    from agoq.launch.run import announce

    env = {"AGOQ_SIMD": "bogus", "AGOQ_MAX_BLOCK": "-5", "AGOQ_TEST_DATA_CACHE": "/tmp/x", "HOME": "/root"}
    line = (
        "agoq train: AGOQ_MAX_BLOCK=-5, AGOQ_SIMD=bogus in the environment ignored: agoq reads no such variable "
        "(it reads AGOQ_QUANT_BACKEND and AGOQ_CACHE_DIR; docs/training.md)"
    )
    assert environment_problem(env) is None and unread_notice(env) == line
    monkeypatch.setenv("AGOQ_SIMD", "bogus")
    monkeypatch.setenv("AGOQ_MAX_BLOCK", "-5")
    announce(load_config(None, []), "4 local processes")
    assert line in capsys.readouterr().out.splitlines()
