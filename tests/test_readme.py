"""The README's two commands are the ones CI runs, the CLI they call exists, its result tables are what
the committed JSON gives, and every benchmark command it shows parses with that benchmark's options."""

import re
from pathlib import Path

from agoq.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, f"README test command {test_cmd!r} is not what .ci/run executes"


def test_readme_main_command_trains_the_default_the_quick_start_describes():
    from agoq.train.config import load_config

    readme = (ROOT / "README.md").read_text()
    main_cmd = _bash_blocks(readme)[0]
    assert main_cmd.endswith("agoq train")
    args, extra = build_parser().parse_known_args(["train"])
    assert args.command == "train" and extra == []
    # What the Quick start says the command trains is the config `agoq train` gets without arguments.
    cfg = load_config(None)
    quick_start = " ".join(readme[readme.index("## Quick start") : readme.index("## What is here")].split())
    p = cfg.parallel
    facts = [
        f"a {cfg.model.preset} LLaMA ({cfg.model_config().num_parameters() / 1e6:.1f} M parameters)",
        f"{p.pp * p.dp} local CPU processes as pipeline {p.pp} x data parallel {p.dp}",
        f"{cfg.train.steps} steps.",
        f"for the {cfg.train.steps} steps",
    ]
    for fact in facts:
        assert fact in quick_start, f"the Quick start does not say {fact!r}"
    assert p.schedule == "1f1b" and "with 1F1B" in quick_start
    assert cfg.precision.activations == "agoq" and cfg.precision.gradients == "int8" and "AGoQ activations and 8-bit gradients" in quick_start


def test_readme_result_tables_match_the_committed_json(tmp_path):
    from benchmarks.readme import update_readme

    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    update_readme(copy, ROOT / "benchmarks" / "results")
    assert copy.read_text() == (ROOT / "README.md").read_text(), "README tables are stale: run `python -m benchmarks.readme`"


def _benchmark_commands(text: str) -> list[str]:
    """Every `python -m benchmarks.NAME ...` code span of the README (placeholders like NAME left out)."""
    spans = re.findall(r"`(python -m benchmarks\.[^`]*)`", text)
    return [s for s in spans if not re.match(r"python -m benchmarks\.[A-Z]", s)]


def test_every_benchmark_command_in_the_readme_parses_with_that_benchmarks_options():
    import argparse
    import importlib
    import shlex

    from benchmarks.__main__ import benchmark_names

    readme = (ROOT / "README.md").read_text()
    commands = _benchmark_commands(readme)
    # One per result table's source line at least, plus the ones in the prose.
    assert len(commands) >= readme.count("<sub>Source: `benchmarks/results/"), commands
    for command in commands:
        words = shlex.split(command)
        module = words[2].removeprefix("benchmarks.")
        assert module in benchmark_names(), f"{command!r}: there is no benchmarks/{module}.py"
        parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", exit_on_error=False)
        importlib.import_module(f"benchmarks.{module}").add_arguments(parser)
        try:
            args, unknown = parser.parse_known_args(words[3:])
        except (argparse.ArgumentError, SystemExit) as e:
            raise AssertionError(f"README command {command!r} does not parse: {e}") from None
        assert not unknown, f"README command {command!r}: {module} has no option {unknown}"


def test_each_source_line_names_the_benchmark_that_writes_its_file():
    readme = (ROOT / "README.md").read_text()
    sources = re.findall(r"<sub>Source: `benchmarks/results/([a-z0-9_]+)\.json`, produced by `([^`]*)`", readme)
    assert len(sources) == len(re.findall(r"<!-- results:", readme)), "a results block without its source line"
    for name, command in sources:
        command = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S* )+", "", command)  # the environment it ran in, if any
        module = command.split()[2].removeprefix("benchmarks.") if command.startswith("python -m benchmarks.") else None
        assert module is not None, f"{name}: {command!r} is not a `python -m benchmarks.NAME` command"
        assert name == module or name.startswith(f"{module}_"), f"{name}.json is said to come from benchmarks.{module}"


def test_every_agoq_plan_command_in_the_readme_runs_as_written(capsys):
    import shlex

    from agoq.cli import main

    readme = (ROOT / "README.md").read_text()
    commands = [b.replace("\\\n", " ") for b in _bash_blocks(readme) if b.startswith("agoq plan")]
    assert commands, "the README shows no agoq plan command"
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
        out = capsys.readouterr().out
        # Each configuration says in words whether it fits (tests/test_plan.py checks the figures).
        assert "fits as is" in out or "fits with" in out or "does not fit" in out, out[-2000:]
