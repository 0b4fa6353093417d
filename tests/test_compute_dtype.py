"""compute_dtype='auto' and quant_backend='auto', decided by rule from the device and its flags (agoq.launch.choices)."""

from __future__ import annotations

import pytest
import torch

from agoq.launch import choices as cd
from agoq.launch.config import ConfigError, load_config


def test_default_is_auto_and_bad_values_are_refused():
    assert load_config().precision.compute_dtype == "auto"
    with pytest.raises(ConfigError, match="compute_dtype='fp16' is unknown; use auto, bf16 or fp32"):
        load_config(None, ["--precision.compute_dtype=fp16"])


@pytest.fixture
def no_file_read(monkeypatch):
    """auto's dtype reads no file but the CPU's flags: any other open fails the test."""
    import builtins
    import io

    def refuse(*a, **k):
        raise AssertionError(f"auto's dtype read a file: {a[:1]}")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(io, "open", refuse)


@pytest.mark.parametrize(
    "flags, capability, expected",
    [
        ((), "AVX512", "fp32"),  # no bf16 instructions: torch would emulate bf16
        (("avx512_bf16",), "AVX512", "bf16"),
        (("amx_bf16",), "AVX512", "bf16"),
        (("avx512_bf16", "amx_bf16"), "AVX512", "bf16"),
        (("avx512_bf16",), "AVX2", "fp32"),  # ATEN_CPU_CAPABILITY=avx2 holds torch's kernels below avx512
    ],
    ids=["avx2-only", "avx512-bf16", "amx", "both", "torch-held-at-avx2"],
)
def test_auto_on_a_cpu_is_a_function_of_its_flags_alone(monkeypatch, no_file_read, flags, capability, expected):
    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    choices = [cd.choose_compute_dtype("auto", "cpu") for _ in range(2)]
    assert choices[0] == choices[1] and choices[0].name == expected
    reason = choices[0].reason
    if expected == "bf16":
        assert reason.startswith("this CPU computes bf16 natively (") and "--precision.compute_dtype=fp32 keeps fp32" in reason
    elif flags:
        assert "at AVX2 (ATEN_CPU_CAPABILITY)" in reason
    else:
        assert "no AVX512-BF16 or AMX-BF16" in reason


def test_auto_on_a_gpu_is_bf16_where_it_is_supported_and_an_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert cd.choose_compute_dtype("auto", "cuda") == cd.DtypeChoice("bf16", "the GPU supports bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert cd.choose_compute_dtype("auto", "cuda").name == "fp32"
    assert cd.choose_compute_dtype("bf16", "cpu") == cd.DtypeChoice("bf16", "set in the config")
    assert cd.choose_compute_dtype("fp32", "cuda").name == "fp32"


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
    from agoq.launch.run import resolve_auto_choices

    monkeypatch.setattr(cd, "cpu_bf16_flags", lambda: ("amx_bf16",))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    cfg = load_config(None, ["--train.out_dir=runs/x"])
    asked = cfg.to_dict()
    choices = resolve_auto_choices(cfg)
    assert cfg.to_dict() == asked and asked["precision"]["compute_dtype"] == asked["precision"]["quant_backend"] == "auto"
    assert (choices.compute_dtype, choices.quant_backend, choices.dtype) == ("bf16", "torch", torch.bfloat16)
    out = capsys.readouterr().out.splitlines()
    assert out == list(choices.lines)  # the launcher prints what the library returns; the library prints nothing
    assert out[0] == "agoq train: compute dtype bf16 (this CPU computes bf16 natively (AMX-BF16); --precision.compute_dtype=fp32 keeps fp32)"
    assert out[1] == f"agoq train: quantization torch (set by {backend.ENV_VAR})"
    cd.resolve_choices(cfg, "cpu")
    assert capsys.readouterr().out == ""
    # What the run records as its config: the one asked for, with the decided values in place of auto.
    recorded = choices.config_dict(cfg)
    assert recorded["precision"] == {**asked["precision"], "compute_dtype": "bf16", "quant_backend": "torch"}
    assert {k: v for k, v in recorded.items() if k != "precision"} == {k: v for k, v in asked.items() if k != "precision"}
    # A value set in the config is kept as it is, and said nothing about.
    fixed = load_config(None, ["--precision.compute_dtype=fp32", "--precision.quant_backend=compiled", "--train.out_dir=runs/x"])
    assert resolve_auto_choices(fixed) == cd.ResolvedChoices("fp32", "compiled") and capsys.readouterr().out == ""
