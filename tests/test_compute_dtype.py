"""compute_dtype='auto': bf16 only where this machine runs it faster (agoq.train.compute_dtype)."""

from __future__ import annotations

import pytest
import torch

from agoq.train import compute_dtype as cd
from agoq.train.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch, tmp_path):
    # The probe's record goes to the agoq cache folder: a faked probe must not land in the user's.
    monkeypatch.setenv("AGOQ_CACHE_DIR", str(tmp_path))
    cd.choose_compute_dtype.cache_clear()
    yield
    cd.choose_compute_dtype.cache_clear()


def test_default_is_auto_and_bad_values_are_refused():
    assert load_config().precision.compute_dtype == "auto"
    with pytest.raises(ConfigError, match="compute_dtype='fp16' is unknown; use auto, bf16 or fp32"):
        load_config(None, ["--precision.compute_dtype=fp16"])


def test_cpu_without_bf16_instructions_gets_fp32_without_probing(monkeypatch):
    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: ())
    monkeypatch.setattr(cd, "probe_seconds", lambda *a, **k: pytest.fail("no probe on an AVX2-only CPU"))
    choice = cd.choose_compute_dtype("auto", "cpu", 256, 688, 1)
    assert choice.name == "fp32" and "AVX512-BF16" in choice.reason


@pytest.mark.parametrize("t32,t16,expected", [(1.0, 0.5, "bf16"), (1.0, 0.95, "fp32"), (1.0, 1.8, "fp32")])
def test_cpu_with_bf16_instructions_follows_the_probe(monkeypatch, t32, t16, expected):
    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: ("amx_bf16",))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cd, "probe_seconds", lambda dtype, *a, **k: t32 if dtype == torch.float32 else t16)
    choice = cd.choose_compute_dtype("auto", "cpu", 256, 688, 1)
    assert choice.name == expected
    assert f"{t32 / t16:.2f}x" in choice.reason and "AMX-BF16" in choice.reason


def test_torch_held_below_avx512_gets_fp32_without_probing(monkeypatch):
    # ATEN_CPU_CAPABILITY=avx2 on an AVX512-BF16 CPU: torch's kernels then emulate bf16.
    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cd, "probe_seconds", lambda *a, **k: pytest.fail("no probe when torch runs at AVX2"))
    choice = cd.choose_compute_dtype("auto", "cpu", 256, 688, 1)
    assert choice.name == "fp32" and "at AVX2 (ATEN_CPU_CAPABILITY)" in choice.reason


def test_an_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(cd, "probe_seconds", lambda *a, **k: pytest.fail("no probe when the dtype is set"))
    assert cd.choose_compute_dtype("bf16", "cpu", 256, 688, 1).name == "bf16"
    assert cd.choose_compute_dtype("fp32", "cuda", 256, 688, 1).name == "fp32"


def test_the_probe_is_sub_second_and_restores_threads():
    threads = torch.get_num_threads()
    seconds = cd.probe_seconds(torch.float32, 256, 688, 1)
    assert 0 < seconds < 1.0
    assert torch.get_num_threads() == threads


def test_quantization_compiles_only_for_runs_that_repay_it(monkeypatch):
    from agoq.quant import backend

    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setattr(backend, "compiler_available", lambda: True)
    short = cd.choose_quant_backend("auto", "cpu", cd.COMPILE_MIN_STEPS - 1, compiled_before=True)
    assert short.name == "torch" and f"{cd.COMPILE_MIN_STEPS - 1}-step run" in short.reason
    # Kernels in the cache: from COMPILE_MIN_STEPS. None yet: eager below FIRST_COMPILE_MIN_STEPS.
    assert cd.choose_quant_backend("auto", "cpu", cd.COMPILE_MIN_STEPS, compiled_before=True).name == "compiled"
    first = cd.choose_quant_backend("auto", "cpu", cd.FIRST_COMPILE_MIN_STEPS - 1)
    assert first.name == "torch" and "not compiled on this machine yet" in first.reason
    assert f"only from {cd.FIRST_COMPILE_MIN_STEPS} steps" in first.reason
    long_first = cd.choose_quant_backend("auto", "cpu", cd.FIRST_COMPILE_MIN_STEPS)
    assert long_first.name == "compiled" and "first run" in long_first.reason
    monkeypatch.setattr(backend, "compiler_available", lambda: False)
    assert cd.choose_quant_backend("auto", "cpu", 10_000, compiled_before=True).name == "torch"
    assert cd.choose_quant_backend("compiled", "cpu", 5).name == "compiled"  # the config decides when set
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert cd.choose_quant_backend("auto", "cpu", 10_000).reason == f"set by {backend.ENV_VAR}"


def test_a_compiled_run_is_noted_in_inductors_cache_for_its_configuration_only(monkeypatch, tmp_path):
    import tempfile

    from agoq.inductor_cache import _user, compiled_before, inductor_cache_folder, note_compiled
    from agoq.quant import backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setattr(backend, "compiler_available", lambda: True)
    assert inductor_cache_folder() == tmp_path / "inductor"
    cfg = load_config(None, ["--train.out_dir=runs/x"])
    key = cd.compiled_kernels_key(cfg, "fp32")
    assert cd.quant_backend_for(cfg, "cpu", "fp32").name == "torch"  # 200 steps, nothing compiled yet
    note_compiled(key)
    assert compiled_before(key) and cd.quant_backend_for(cfg, "cpu", "fp32").name == "compiled"
    # What does not change the kernels keeps the note: the length, the output folder, the data
    # parallel width, the batch; what does change them is a configuration of its own.
    same = load_config(None, ["--train.out_dir=runs/y", "--train.steps=150", "--parallel.dp=1", "--data.batch_size=8"])
    assert cd.compiled_kernels_key(same, "fp32") == key
    for other in (["--precision.activation_format=nf4/64"], ["--precision.gradients=int4"], ["--optim.name=adamw8bit"], ["--parallel.tp=2"]):
        assert not compiled_before(cd.compiled_kernels_key(load_config(None, ["--train.out_dir=runs/x", *other]), "fp32")), other
    assert not compiled_before(cd.compiled_kernels_key(cfg, "bf16"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # held to another instruction set
    assert not compiled_before(cd.compiled_kernels_key(cfg, "fp32"))
    # Held by ATEN_CPU_CAPABILITY with no folder chosen, the note goes to the capability's own folder.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert inductor_cache_folder() == tmp_path / "tmp" / f"agoq_inductor_{_user()}" / "aten-cpu-capability-avx2"
    # A folder that cannot be written: nothing noted, nothing raised.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")
    note_compiled(key)
    assert not compiled_before(key)


def test_a_bad_quant_backend_is_refused_before_launch():
    with pytest.raises(ConfigError, match="precision.quant_backend='fast' is unknown; use one of auto, torch, compiled, triton"):
        load_config(None, ["--precision.quant_backend=fast"])


def test_the_launchers_choices_leave_the_config_as_validated(monkeypatch, capsys):
    from agoq.quant import backend
    from agoq.train.run import resolve_auto_choices

    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: ("amx_bf16",))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cd, "probe_seconds", lambda dtype, *a, **k: 1.0 if dtype == torch.float32 else 0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    cfg = load_config(None, ["--train.out_dir=runs/x"])
    asked = cfg.to_dict()
    choices = resolve_auto_choices(cfg)
    assert cfg.to_dict() == asked and asked["precision"]["compute_dtype"] == asked["precision"]["quant_backend"] == "auto"
    assert (choices.compute_dtype, choices.quant_backend, choices.dtype) == ("bf16", "torch", torch.bfloat16)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("agoq train: compute dtype bf16 (") and out[1] == f"agoq train: quantization torch (set by {backend.ENV_VAR})"
    # What the run records as its config: the one asked for, with the decided values in place of auto.
    recorded = choices.config_dict(cfg)
    assert recorded["precision"] == {**asked["precision"], "compute_dtype": "bf16", "quant_backend": "torch"}
    assert {k: v for k, v in recorded.items() if k != "precision"} == {k: v for k, v in asked.items() if k != "precision"}
    # A value set in the config is kept as it is, and said nothing about.
    fixed = load_config(None, ["--precision.compute_dtype=fp32", "--precision.quant_backend=compiled", "--train.out_dir=runs/x"])
    assert resolve_auto_choices(fixed) == cd.ResolvedChoices("fp32", "compiled") and capsys.readouterr().out == ""


def test_only_a_run_that_compiled_on_the_cpu_leaves_the_note(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from agoq.inductor_cache import compiled_before
    from agoq.train.run import _note_compiled_kernels

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg = load_config(None, ["--train.out_dir=runs/x"])
    key = cd.compiled_kernels_key(cfg, "fp32")

    def run(backend: str, device: str) -> bool:
        _note_compiled_kernels(cfg, SimpleNamespace(choices=cd.ResolvedChoices("fp32", backend), ctx=SimpleNamespace(device=torch.device(device))))
        return compiled_before(key)

    assert not run("torch", "cpu") and not run("compiled", "cuda")
    assert run("compiled", "cpu")
