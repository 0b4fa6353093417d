"""The benchmarks package (benchmarks/, outside agoq): how it is run, and where its results go."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _committed() -> dict[str, bytes]:
    """Every file of the committed results folder, by path, with its bytes."""
    return {str(p.relative_to(RESULTS)): p.read_bytes() for p in sorted(RESULTS.rglob("*")) if p.is_file()}


def _benchmarks() -> list[str]:
    from benchmarks.__main__ import benchmark_names

    return [n for n in benchmark_names() if n != "readme"]


def _parser(name: str):
    import argparse
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}")
    module.add_arguments(parser)
    return parser


def test_every_benchmark_is_listed_and_runnable_as_a_module():
    from benchmarks.__main__ import listing

    names = _benchmarks()
    assert {"allreduce", "train_dtype", "loss", "kernels"} <= set(names)
    text = listing()
    for name in [*names, "readme"]:
        module = __import__(f"benchmarks.{name}", fromlist=["main"])
        for attr in ("DESCRIPTION", "add_arguments", "run", "main"):
            assert hasattr(module, attr), f"benchmarks.{name} has no {attr}"
        assert f"  {name} " in text and module.DESCRIPTION in text
        # `python -m benchmarks.NAME` must hand main()'s status to the shell.
        source = Path(module.__file__).read_text()
        assert source.rstrip().endswith('if __name__ == "__main__":\n    raise SystemExit(main())'), name


def test_python_dash_m_benchmarks_lists_and_dispatches(capsys):
    from benchmarks.__main__ import main

    assert main([]) == 0
    assert "train_dtype" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["train-dtype", "--help"])  # '-' or '_'
    assert e.value.code == 0
    assert "python -m benchmarks.train_dtype" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["no-such-benchmark"])
    assert e.value.code == 2


def test_agoq_bench_says_where_the_benchmarks_went(capsys):
    from agoq.cli import main

    assert main(["bench", "allreduce", "--only", "local"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "python -m benchmarks.NAME" in err


def test_results_dir_is_beside_the_package_whatever_the_working_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "AGOQ_RESULTS_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = "from benchmarks._common import RESULTS_DIR; print(RESULTS_DIR)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()) == RESULTS
    env["AGOQ_RESULTS_DIR"] = str(tmp_path / "elsewhere")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()) == tmp_path / "elsewhere"


@pytest.mark.parametrize("name", _benchmarks())
def test_every_benchmark_takes_out_dir(name):
    assert _parser(name).parse_args(["--out-dir", "x"]).out_dir == "x"
    assert _parser(name).parse_args([]).out_dir is None


# Cheap settings of benchmarks that also draw a PNG; each writes only into --out-dir.
CHEAP = {
    "loss": (["--tokens", "16", "--hidden", "8", "--vocabs", "32", "--repeats", "1"], ["loss.json"]),
    "activation": (["--batch", "1", "--seq", "8", "--presets="], ["activation.json", "activation.png"]),
    "quant_throughput": (
        ["--numel", "4K", "--formats", "int4,int8", "--repeats", "1", "--backends", "torch"],
        ["quant_throughput.json", "quant_throughput.png"],
    ),
}


@pytest.mark.parametrize("name", sorted(CHEAP))
def test_out_dir_gets_the_results_and_the_committed_ones_stay(name, tmp_path, capsys):
    import importlib

    pytest.importorskip("matplotlib")
    argv, files = CHEAP[name]
    before = _committed()
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main([*argv, "--out-dir", str(tmp_path)]) == 0
    assert _committed() == before, "a benchmark given --out-dir wrote into benchmarks/results"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    assert json.loads((tmp_path / files[0]).read_text())["benchmark"] == name


def test_train_dtype_writes_runs_and_result_only_into_out_dir(tmp_path, monkeypatch, capsys):
    # The two training runs are replaced by a stand-in (a real pair takes a minute on 2 cores): what
    # is checked is where the runs and the result go, and that the tracked train_dtype.json stays.
    import agoq.launch.run
    from benchmarks import train_dtype

    out_dirs = []

    def launch(cfg, **kw):
        out_dirs.append(Path(cfg.train.out_dir))
        return {"run": {"step_time_s": 1.0 + len(out_dirs), "tokens_per_s": 100.0, "final_loss": 5.0}}

    monkeypatch.setattr(agoq.launch.run, "launch", launch)
    tracked = (RESULTS / "train_dtype.json").read_bytes()
    before = _committed()
    assert train_dtype.main(["--steps", "2", "--out-dir", str(tmp_path)]) == 0
    assert (RESULTS / "train_dtype.json").read_bytes() == tracked
    assert _committed() == before
    assert out_dirs == [tmp_path / "bf16", tmp_path / "fp32"]
    written = json.loads((tmp_path / "train_dtype.json").read_text())
    assert written["command"] == f"python -m benchmarks.train_dtype --steps 2 --out-dir {tmp_path}"
    assert [r["compute_dtype"] for r in written["results"]["rows"]] == ["bf16", "fp32"]
    # Beside the runs, the probe of the same question at the model's width; auto itself times nothing.
    from agoq.launch.choices import choose_compute_dtype

    probe = written["results"]["probe"]
    assert probe["bf16_speedup"] == pytest.approx(probe["fp32_s"] / probe["bf16_s"]) and probe["fp32_s"] > 0
    assert written["results"]["auto"] == choose_compute_dtype("auto", "cpu").name
    assert "ran bf16 at" in train_dtype.readme_markdown(written["results"])


def test_the_dtype_probe_alternates_its_rounds_and_restores_threads(monkeypatch):
    import torch

    from benchmarks import train_dtype

    threads = torch.get_num_threads()
    seconds = train_dtype.probe_seconds(torch.float32, 256, 688, 1)
    assert 0 < seconds < 5.0 and torch.get_num_threads() == threads
    calls = []
    # One round of each dtype is slowed by other load: the medians of alternating rounds ignore it.
    times = {torch.float32: iter([1.0, 1.0, 9.0, 1.0, 1.0]), torch.bfloat16: iter([0.5, 0.5, 0.5, 7.0, 0.5])}

    def probe(dtype, *a, **k):
        calls.append(dtype)
        return next(times[dtype])

    monkeypatch.setattr(train_dtype, "probe_seconds", probe)
    assert train_dtype.bf16_speedup(256, 688, 1) == (2.0, 1.0, 0.5)
    assert calls[:4] == [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32] and len(calls) == 2 * train_dtype.PROBE_ROUNDS


def test_old_agoq_bench_commands_render_as_the_module_that_runs_them():
    from benchmarks.readme import current_command

    assert current_command("agoq bench train-dtype --steps 12") == "python -m benchmarks.train_dtype --steps 12"
    assert current_command("agoq bench plan-vs-paper") == "python -m benchmarks.plan_vs_paper"
    assert (
        current_command("agoq bench quant-throughput --formats int4/128,fp8/128")
        == "python -m benchmarks.quant_throughput --formats int4/128,fp8/128"
    )
    # Today's spelling, and anything that is not an old benchmark command, stay as they are.
    for command in (
        "python -m benchmarks.loss --repeats 3",
        "agoq train --train.steps=5",
        "agoq benchmark x",
        "python benchmarks/gpu/gpu_check.py --dry-run",
    ):
        assert current_command(command) == command
    # Every committed result file's command, rendered, parses with the options of the benchmark it names.
    import shlex

    # A command may start with the environment it ran in (NAME=value words, as a shell reads them).
    for path in sorted(RESULTS.glob("*.json")):
        words = shlex.split(current_command(json.loads(path.read_text())["command"]))
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        assert words[:2] == ["python", "-m"] and words[2].startswith("benchmarks."), (path.name, words)
        _parser(words[2].removeprefix("benchmarks.")).parse_args(words[3:])


def test_the_installed_package_carries_no_benchmarks():
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("agoq.bench")


def test_op_overhead_times_each_fused_op_both_ways_and_keeps_the_earlier_ratios(tmp_path, capsys):
    from benchmarks import op_overhead

    argv = ["--model", "tiny", "--tokens", "128", "--rounds", "1", "--backend", "torch", "--out-dir", str(tmp_path)]
    before = _committed()
    assert op_overhead.main(argv) == 0 and op_overhead.main(argv) == 0
    assert _committed() == before
    written = json.loads((tmp_path / "op_overhead.json").read_text())["results"]
    assert [r["op"] for r in written["rows"]] == ["norm + q/k/v GEMMs", "norm + gate/up GEMMs", "SwiGLU + down GEMM"]
    for r in written["rows"]:
        assert r["bf16_policy_ms"] > 0 and r["agoq_ms"] > 0
        assert r["ratio"] == pytest.approx(r["agoq_ms"] / r["bf16_policy_ms"])
    # The second invocation keeps the first's ratios as its history.
    assert len(written["history"]) == 1 and set(written["history"][0]["ratio_same_round"]) == {r["op"] for r in written["rows"]}
    assert "Earlier, revision" in capsys.readouterr().out


def _run_here(run_one, spec: dict) -> dict:
    """What benchmarks._finetune.spawn() returns for ``spec``, run in this process: the spec and the
    result go through JSON as the child reads and writes them."""
    return json.loads(json.dumps(run_one(json.loads(json.dumps(spec)))))


def test_lora_runs_each_variant_through_spawn_into_out_dir(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from benchmarks import lora

    spawned = []
    real_spawn = lora.spawn

    def one_in_a_process(module, spec, tmp, name):
        # Plain LoRA goes through the real spawn (a process importing torch, transformers and peft
        # costs seconds of a 2-core run); agoq's variant runs the same run_one in this process.
        spawned.append(spec["variant"])
        if spec["variant"] == "lora":
            return real_spawn(module, spec, tmp, name)
        return _run_here(lora.run_one, spec)

    monkeypatch.setattr(lora, "spawn", one_in_a_process)
    tiny = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--hidden", "64", "--intermediate", "128", "--layers", "2"]
    argv = [*tiny, "--seq-len", "16", "--batch-size", "2", "--eval-windows", "2", "--variants", "lora,agoq_lora", "--out-dir", str(tmp_path)]
    before = _committed()
    assert lora.main(argv) == 0
    assert sorted(spawned) == ["agoq_lora", "lora"]
    assert _committed() == before
    payload = json.loads((tmp_path / "lora_hidden64.json").read_text())  # another width: a file of its own
    assert payload["benchmark"] == "lora_hidden64" and payload["command"] == "python -m benchmarks.lora " + " ".join(argv)
    written = payload["results"]
    rows = written["rows"]
    assert set(rows) == {"lora", "agoq_lora"} and set(written["ratios"]) == {"agoq_lora/lora"}
    for r in rows.values():
        assert r["peak_tensor_bytes"] > 0 and r["peak_rss_bytes"] > 0 and r["step_s"] > 0
    # The fused ops keep 4-bit copies where plain LoRA keeps fp32 ones.
    assert written["ratios"]["agoq_lora/lora"]["saved_bytes_per_layer"] < 0.3
    assert "| agoq_lora / lora |" in lora.readme_markdown(written)


def test_finetune_scale_measures_each_run_beside_its_plan_into_out_dir(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from agoq.plan.finetune import checkpoint_input_bytes
    from benchmarks import finetune_scale

    def in_this_process(module, spec, tmp, name):
        # A process per run costs seconds of imports each; the LoRA benchmark's test runs the same spawn().
        assert module == "benchmarks.finetune_scale" and callable(finetune_scale._child_main)
        if spec["variant"] == "qlora":  # as spawn() reports a run that failed
            return {"error": "ModuleNotFoundError: No module named 'bitsandbytes'", "stderr": "Traceback ..."}
        return _run_here(finetune_scale.run_one, spec)

    monkeypatch.setattr(finetune_scale, "spawn", in_this_process)
    shape = ["--hidden", "128", "--intermediate", "352", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--vocab-size", "1024"]
    runs = [
        "--layers",
        "2",
        "--seq-lens",
        "128",
        "--steps",
        "2",
        "--modes",
        "full,lora",
        "--variants",
        "plain,agoq_ckpt8,qlora",
        "--text-vocab",
        "512",
    ]
    argv = [*shape, *runs, "--out-dir", str(tmp_path)]
    before = _committed()
    assert finetune_scale.main(argv) == 0
    assert _committed() == before
    payload = json.loads((tmp_path / "finetune_scale_128.json").read_text())
    assert payload["command"] == "python -m benchmarks.finetune_scale " + " ".join(argv) and "cpu_flags" in payload["machine"]
    results = payload["results"]
    rows = {(r["mode"], r["variant"]): r for r in results["rows"]}
    # QLoRA is LoRA's alone; a run that fails is a row with its error, the others go on.
    failed = rows.pop(("lora", "qlora"))
    assert failed["note"] == "failed: ModuleNotFoundError: No module named 'bitsandbytes'" and failed["planned_peak_bytes"] > 0
    assert set(rows) == {(m, v) for m in ("full", "lora") for v in ("plain", "agoq_ckpt8")} and len(results["runs"]) == 4
    for key, r in rows.items():
        assert "note" not in r, (key, r)
        assert r["seq_len"] == 128 and r["peak_rss_bytes"] > r["peak_tensor_bytes"] > 0 and r["step_s"] > 0
        # The planner's peak for the same step is the measured one within 10%.
        assert r["planned_over_measured"] == pytest.approx(r["planned_peak_bytes"] / r["peak_tensor_bytes"])
        assert abs(r["planned_over_measured"] - 1) <= 0.10, (key, r["planned_over_measured"], r["planned_phase"])
        assert sorted(r["saved_bytes_per_layer"]) == ["0", "1"]
    for mode in ("full", "lora"):
        plain, ckpt8 = rows[(mode, "plain")], rows[(mode, "agoq_ckpt8")]
        # A compressed checkpoint keeps only the layer's input, at int8/128: what the planner counts.
        spec = {"hidden": 128, "intermediate": 352, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab_size": 1024}
        ft = finetune_scale.fine_tune({**spec, "mode": mode, "seq_len": 128, "variant": "agoq_ckpt8"})
        assert set(ckpt8["saved_bytes_per_layer"].values()) == {checkpoint_input_bytes(ft, "agoq_ckpt8")}
        assert plain["step_time_vs_plain"] == 1.0 and ckpt8["step_time_vs_plain"] > 0
        # The same data, weights and steps: the losses agree (the saved tensors' rounding only).
        assert ckpt8["loss_after_steps"] == pytest.approx(plain["loss_after_steps"], rel=0.01)
        assert results["ratios"][f"{mode}/128/agoq_ckpt8/plain"]["peak_tensor_bytes"] < 1
    table = finetune_scale.readme_markdown(results)
    assert "| lora | 128 | agoq_ckpt8 (" in table and "| lora | 128 | qlora (QLoRA (nf4 base)) | failed: ModuleNotFoundError" in table


def test_the_convergence_command_names_every_option_that_changes_its_file():
    import argparse

    from benchmarks import convergence

    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    default = parser.parse_args([])
    assert "--runs" not in convergence.reproducing_command(default)  # the default runs all of them
    subset = parser.parse_args(["--runs", "bf16,agoq", "--seeds", "1", "--steps", "4", "--out-dir", "/tmp/x"])
    assert convergence.reproducing_command(subset) == (
        "python -m benchmarks.convergence --steps 4 --seeds 1 --eval-every " + str(subset.eval_every) + " --runs bf16,agoq --out-dir /tmp/x"
    )
    small = parser.parse_args(["--model", "small", "--runs", "bf16,agoq"])
    assert " --model small --runs bf16,agoq" in convergence.reproducing_command(small)


def test_step_profile_files_the_fused_custom_ops_under_their_category():
    # The profiler names a custom op "agoq::<name>" and its autograd node "GeneratedBackwardFor_agoq_...":
    # a profiled agoq step must put the fused ops' own (self) time in their category.
    import torch

    from agoq.activation import make_policy
    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from benchmarks.step_profile import _category

    cfg = LlamaConfig(vocab_size=128, hidden=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate=128, max_seq_len=64)
    model = Llama(cfg, make_policy("agoq"))
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile() as prof:
        model(ids[:, :-1], ids[:, 1:]).backward()
    keys = {ev.key for ev in prof.key_averages()}
    fused = {k for k in keys if _category(k) == "fused ops' Python and autograd"}
    for op in ("norm_linear", "swiglu_linear"):
        assert {f"agoq::{op}", f"agoq::{op}_backward"} <= fused, sorted(fused)
        assert any(k.startswith(f"GeneratedBackwardFor_agoq_{op}") for k in fused), sorted(fused)
    # No agoq op is left in the catch-all.
    assert not {k for k in keys if "agoq" in k and k not in fused}
