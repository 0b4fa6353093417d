"""The front door: what ``import agoq`` gives a user, one name per concept, and what the package declares."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = [
    "AgoqMixin",
    "AgoqTrainer",
    "TrainConfig",
    "apply_agoq",
    "dequantize",
    "load_config",
    "make_policy",
    "quantize",
    "remove_agoq",
    "use_8bit_gradients",
]
# `agoq --help` reads presets and option lists only; importing torch alone costs seconds of CPU.
HELP_CPU_S = 1.5


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports agoq from this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_agoq_does_not_import_torch_and_lists_the_user_names():
    out = _python(
        "import sys, agoq; print('torch' in sys.modules); print(','.join(agoq.__all__)); print(','.join(n for n in dir(agoq) if not n.startswith('_')))"
    )
    assert out.returncode == 0, out.stderr
    imported_torch, listed, shown = out.stdout.split()
    assert imported_torch == "False"
    assert listed.split(",") == PUBLIC
    assert shown.split(",") == PUBLIC


def test_the_user_names_import_from_agoq_and_are_their_homes_objects():
    code = (
        "from agoq import apply_agoq, AgoqTrainer, use_8bit_gradients, quantize, dequantize, make_policy, remove_agoq, TrainConfig, load_config\n"
        "import agoq.integrations.hf as hf, agoq.integrations.hf_trainer as hft, agoq.quant as q, agoq.activation.policy as pol, agoq.launch.config as c\n"
        "same = [apply_agoq is hf.apply_agoq, remove_agoq is hf.remove_agoq, AgoqTrainer is hft.AgoqTrainer,\n"
        "        use_8bit_gradients is hft.use_8bit_gradients, quantize is q.quantize, dequantize is q.dequantize,\n"
        "        make_policy is pol.make_policy, TrainConfig is c.TrainConfig, load_config is c.load_config]\n"
        "print(sum(same))"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "9"


def test_an_unknown_name_is_an_attribute_error():
    import agoq

    with pytest.raises(AttributeError, match="module 'agoq' has no attribute 'nope'"):
        agoq.nope  # noqa: B018


def test_agoq_help_stays_under_its_cpu_budget():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "agoq", "--help"], capture_output=True, text=True, env=env, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr
    assert "train" in out.stdout and "plan" in out.stdout
    assert cpu <= HELP_CPU_S, f"agoq --help took {cpu:.2f} s of CPU"


def test_formats_is_the_one_name_for_per_kind_formats():
    from agoq.activation.policy import make_policy
    from agoq.quant import parse_format

    policy = make_policy("agoq", formats={"act_input": "fp4/64", "norm_input": None})
    assert policy.formats.act_input == parse_format("fp4/64")
    assert policy.formats.norm_input is None
    assert policy.formats.out_proj_input == parse_format("int4/128")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current spelling warns about nothing
        make_policy("agoq", formats={"act_input": "fp4/64"})


def test_the_deprecated_overrides_spelling_warns_and_gives_the_same_policy():
    from agoq.activation.policy import make_policy

    spec = {"act_input": "nf4/64", "attention": "int8/32"}
    with pytest.warns(DeprecationWarning, match=r"make_policy\(overrides=...\) is deprecated; pass formats="):
        old = make_policy("uniform4", overrides=spec)
    assert old == make_policy("uniform4", formats=spec)
    with pytest.raises(ValueError, match="both formats and overrides"):
        make_policy("agoq", formats=spec, overrides=spec)


def test_the_trainers_loss_path_is_not_a_make_policy_argument():
    import inspect

    from agoq.activation.policy import make_policy, with_loss_path

    params = set(inspect.signature(make_policy).parameters)
    assert params == {"name", "formats", "layer_bits", "fused_loss", "fmt", "checkpoint_format", "overrides"}
    policy = make_policy("agoq")
    assert (policy._loss_recompute, policy._loss_weight_grad_in_forward) == (True, False)  # a user's loop: recompute
    trainers = with_loss_path(policy, recompute=True, weight_grad_in_forward=True)
    assert (trainers._loss_recompute, trainers._loss_weight_grad_in_forward) == (True, True)
    assert trainers.formats == policy.formats


def test_apply_agoq_and_the_trainer_spell_formats_alike():
    import inspect

    pytest.importorskip("transformers")
    from agoq.integrations.hf import apply_agoq
    from agoq.integrations.hf_trainer import AgoqTrainer

    patch_kwargs = [p for p in inspect.signature(apply_agoq).parameters if p not in ("model", "policy")]
    trainer_kwargs = [p for p in inspect.signature(AgoqTrainer.__init__).parameters if p.startswith("agoq_")]
    assert patch_kwargs == ["formats", "layer_bits", "fused_loss", "checkpoint_format"]
    assert trainer_kwargs == ["agoq_policy", "agoq_formats", "agoq_layer_bits", "agoq_fused_loss", "agoq_checkpoint_format", "agoq_gradients"]


def test_ring8_is_refused_with_one_line_naming_its_new_home():
    from agoq.launch.config import GRADIENT_MODES, ConfigError, load_config

    assert "ring8" not in GRADIENT_MODES
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--precision.gradients=ring8"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("precision.gradients='ring8'")
    assert "python -m benchmarks.allreduce" in message


def test_the_gradient_sync_factory_has_no_ring8():
    import torch

    from agoq.gradient.build import make_gradient_sync

    params = [("w", torch.nn.Parameter(torch.ones(4)))]
    with pytest.raises(ValueError, match="ring8"):
        make_gradient_sync("ring8", params, None, torch.device("cpu"), microbatches=1, block=256)


def test_torch_is_declared_as_the_tested_range_not_a_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_reqs = [r for r in project["dependencies"] if r.replace(" ", "").startswith("torch") and r.replace(" ", "")[5:6] in "<>=!~,"]
    assert len(torch_reqs) == 1, project["dependencies"]
    spec = torch_reqs[0].replace(" ", "")[len("torch") :]
    clauses = spec.split(",")
    assert not any(c.startswith("==") for c in clauses), spec
    # The floor is the compatibility module's, and the ceiling admits the newest torch that the
    # compatibility run (benchmarks/compat.py) tests, and nothing newer.
    from agoq.compat import TORCH_FLOOR, major_minor
    from benchmarks.compat import ENVS

    newest = max(major_minor(pin.removeprefix("torch==")) for e in ENVS for pin in e.pins if pin.startswith("torch=="))
    assert sorted(clauses) == [f"<{newest[0]}.{newest[1] + 1}", f">={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"], spec


PACKAGE_NAMES = {
    "agoq.activation": 13,
    "agoq.gradient": 10,
    "agoq.models": 4,
    "agoq.parallel": 12,
    "agoq.plan": 8,
    "agoq.quant": 7,
}


@pytest.mark.parametrize("package", sorted(PACKAGE_NAMES))
def test_each_package_advertises_a_short_list_that_resolves(package):
    import importlib

    module = importlib.import_module(package)
    assert len(module.__all__) == PACKAGE_NAMES[package], module.__all__
    for name in module.__all__:
        value = getattr(module, name)
        assert getattr(value, "__name__", name) == name or not callable(value), (package, name)
    assert set(module.__all__) <= set(dir(module))
