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


def test_auto_compiles_on_cpus_with_a_compiler_and_the_config_or_environment_decides_otherwise(monkeypatch):
    from agoq.quant import backend

    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setattr(backend, "compiler_available", lambda: True)
    chose = cd.choose_quant_backend("auto", "cpu")
    assert chose.name == "compiled" and "precision.quant_backend=torch" in chose.reason
    cfg = load_config(None, ["--train.out_dir=runs/x"])
    assert cd.quant_backend_for(cfg, "cpu").name == "compiled"
    monkeypatch.setattr(backend, "compiler_available", lambda: False)
    chose = cd.choose_quant_backend("auto", "cpu")
    assert chose.name == "torch" and "no C++ compiler" in chose.reason
    assert cd.choose_quant_backend("compiled", "cpu").name == "compiled"  # the config decides when set
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert cd.choose_quant_backend("auto", "cpu").reason == f"set by {backend.ENV_VAR}"


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
