"""The README's two commands are the ones CI runs, and the CLI they call exists."""

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


def test_readme_main_command_is_a_real_subcommand():
    readme = (ROOT / "README.md").read_text()
    main_cmd = _bash_blocks(readme)[0]
    assert main_cmd.endswith("agoq train")
    parser = build_parser()
    args, extra = parser.parse_known_args(["train"])
    assert args.command == "train" and extra == []


def test_readme_result_tables_match_the_committed_json(tmp_path):
    from agoq.bench.readme import update_readme

    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    update_readme(copy, ROOT / "benchmarks" / "results")
    assert copy.read_text() == (ROOT / "README.md").read_text(), "README tables are stale: run `agoq bench readme`"


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
