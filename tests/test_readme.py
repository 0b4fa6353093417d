"""The README is a short front door: its two commands are the ones CI runs, the CLI they call exists,
its Hugging Face snippet runs as written, and every result table of README.md, docs/results.md and
docs/compat.md is what the committed JSON gives, with a command beside it that parses with that benchmark's options."""

import re
from pathlib import Path

import pytest

from agoq.cli import build_parser
from benchmarks.readme import GENERATED

ROOT = Path(__file__).resolve().parents[1]
# Front doors of projects we admire run 191-539 lines; the rest of ours lives in docs/.
README_MAX_LINES = 250


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, f"README test command {test_cmd!r} is not what .ci/run executes"


def test_readme_main_command_trains_the_default_the_quick_start_describes():
    from agoq.launch.config import load_config

    readme = (ROOT / "README.md").read_text()
    main_cmd = _bash_blocks(readme)[0]
    assert main_cmd.endswith("agoq train")
    args, extra = build_parser().parse_known_args(["train"])
    assert args.command == "train" and extra == []
    # What the Quick start says the command trains is the config `agoq train` gets without arguments.
    cfg = load_config(None)
    quick_start = " ".join(readme[readme.index("## Quick start") : readme.index("## Use it with Hugging Face")].split())
    p = cfg.parallel
    facts = [
        f"a {cfg.model.preset} LLaMA ({cfg.model_config().num_parameters() / 1e6:.1f} M parameters)",
        f"{p.pp * p.dp} local CPU processes as pipeline {p.pp} x data parallel {p.dp}",
        f"{cfg.train.steps} steps.",
        f"`{cfg.train.out_dir}/`",
    ]
    for fact in facts:
        assert fact in quick_start, f"the Quick start does not say {fact!r}"
    assert p.schedule == "1f1b" and "with 1F1B" in quick_start
    assert cfg.precision.activations == "agoq" and cfg.precision.gradients == "int8" and "AGoQ activations and 8-bit gradients" in quick_start


def test_the_readme_stays_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_prose_cites_no_commit_hashes():
    text = (ROOT / "README.md").read_text()
    # A revision is history; the JSON's git_revision and history fields keep it, docs/results.md shows it.
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, f"README.md names revisions {hashes}"


@pytest.mark.parametrize("name", GENERATED)
def test_result_tables_match_the_committed_json(name, tmp_path):
    from benchmarks.readme import update_file

    copy = tmp_path / Path(name).name
    copy.write_text((ROOT / name).read_text())
    update_file(copy, ROOT / "benchmarks" / "results")
    assert copy.read_text() == (ROOT / name).read_text(), f"{name}'s tables are stale: run `python -m benchmarks.readme`"


def test_every_number_in_the_results_page_sits_inside_a_generated_block():
    # Prose may name counts of things, never a measured figure: those come from the JSON.
    for name in GENERATED:
        text = (ROOT / name).read_text()
        outside = re.sub(r"<!-- (results:[a-z0-9_/]+|headline) -->.*?<!-- /\1 -->", "", text, flags=re.S)
        measured = re.findall(r"\b\d+\.\d+x\b|\b\d+(?:\.\d+)? ?(?:MiB|GiB|ms|s/step|tokens/s)\b|\b\d+\.\d+%", outside)
        measured = [m for m in measured if not re.fullmatch(r"\d+ ?GiB", m)]  # agoq plan's --gpu-memory 48GiB is an input
        assert not measured, f"{name}: figures outside the generated blocks: {measured}"


def test_the_headline_renders_from_train_ratio_when_it_exists_and_from_bytes_otherwise(tmp_path):
    import json
    import shutil

    from benchmarks.readme import headline

    results = ROOT / "benchmarks" / "results"
    for f in results.glob("*.json"):
        if f.name != "train_ratio.json":
            shutil.copy(f, tmp_path / f.name)
    bytes_only = headline(tmp_path)
    assert "python -m benchmarks.convergence" in bytes_only and "step time (s" not in bytes_only
    rows = [
        {"round": i, "side": side, "step_time_s": t, "compute_dtype": "fp32", "quant_backend": "torch", "val_loss": 5.0,
         "peak_saved_bytes": b, "peak_tensor_bytes": 4 * b, "wire_bytes_per_step": b}
        for i in range(2) for side, t, b in (("agoq", 1.2, 2**20), ("bf16", 1.0, 2**22))
    ]  # fmt: skip
    payload = {
        "benchmark": "train_ratio",
        "command": f"python -m benchmarks.train_ratio --steps 50 --repeats 2 --out-dir {tmp_path}",
        "git_revision": "x",
        "date": "2026-01-01T00:00:00+00:00",
        "machine": {"processor": "cpu", "cpu_count": 2, "cpu_flags": ["avx2"], "torch": "2.13.0"},
        "results": {"steps": 50, "repeats": 2, "rows": rows, "ratios": {"step_time_s": 1.2}},
    }
    (tmp_path / "train_ratio.json").write_text(json.dumps(payload))
    timed = headline(tmp_path)
    assert "| step time (s, median of 2 alternating runs each) | 1.000 | 1.200 | 1.20x |" in timed
    assert "| saved activations, peak (MiB, largest rank) | 4.00 | 1.00 | 0.250x |" in timed
    assert "`python -m benchmarks.train_ratio --steps 50 --repeats 2`" in timed and "flags AVX2" in timed


def _python_blocks(text: str) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def test_the_readme_hugging_face_snippet_runs_as_written_and_patches_the_model():
    """The first python block of the README: a tiny LlamaConfig, patched, one forward and backward."""
    pytest.importorskip("transformers")
    import torch

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it with Hugging Face") : readme.index("## Your own training loop")]
    snippet = _python_blocks(section)[0]
    assert len(snippet.strip().splitlines()) <= 10, "the README's Hugging Face snippet must fit 10 lines"
    assert "from agoq import apply_agoq" in snippet  # the public name, as a newcomer writes it
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    model, ids = scope["model"], scope["ids"]
    layer = model.model.layers[0]
    assert getattr(layer, "_agoq_policy", None) is not None, "apply_agoq did not patch the decoder layers"
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads), "not every parameter got a finite gradient"
    # The patch changes what is saved for backward, not the forward's values (fp32: within 1e-5).
    patched = float(model(input_ids=ids, labels=ids).loss.detach())
    scope["remove_agoq"](model)
    assert abs(float(model(input_ids=ids, labels=ids).loss.detach()) - patched) < 1e-4


def _benchmark_commands(text: str) -> list[str]:
    """Every `python -m benchmarks.NAME ...` code span of the README (placeholders like NAME left out)."""
    spans = re.findall(r"`(python -m benchmarks\.[^`]*)`", text)
    return [s for s in spans if not re.match(r"python -m benchmarks\.[A-Z]", s)]


def test_every_benchmark_command_in_the_readme_parses_with_that_benchmarks_options():
    import argparse
    import importlib
    import shlex

    from benchmarks.__main__ import benchmark_names

    text = "\n".join((ROOT / name).read_text() for name in GENERATED)
    commands = _benchmark_commands(text)
    # One per result table's source line at least, plus the ones in the prose.
    assert len(commands) >= text.count("<sub>Source: `benchmarks/results/"), commands
    for command in commands:
        words = shlex.split(command)
        module = words[2].removeprefix("benchmarks.")
        assert module in benchmark_names(), f"{command!r}: there is no benchmarks/{module}.py"
        parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", exit_on_error=False)
        importlib.import_module(f"benchmarks.{module}").add_arguments(parser)
        try:
            args, unknown = parser.parse_known_args(words[3:])
        except (argparse.ArgumentError, SystemExit) as e:
            raise AssertionError(f"command {command!r} does not parse: {e}") from None
        assert not unknown, f"command {command!r}: {module} has no option {unknown}"


def test_each_source_line_names_the_benchmark_that_writes_its_file():
    page = (ROOT / "docs" / "results.md").read_text()
    sources = re.findall(r"<sub>Source: `benchmarks/results/([a-z0-9_]+)\.json`, produced by `([^`]*)`", page)
    blocks = re.findall(r"<!-- results:([a-z0-9_]+) -->", page)
    measured = [b for b in blocks if (ROOT / "benchmarks" / "results" / f"{b}.json").exists()]
    assert len(sources) == len(measured), "a results block without its source line"
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
