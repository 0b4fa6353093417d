"""What every benchmark shares: machine description, git revision, and where results go."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

# The committed results beside this file (whatever the working directory), or $AGOQ_RESULTS_DIR.
RESULTS_DIR = Path(os.environ.get("AGOQ_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def add_out_dir(parser: argparse.ArgumentParser, what: str = "") -> None:
    """The --out-dir option: the folder of the result JSON (and PNG), and of ``what`` else the benchmark writes.

    Without it results go to RESULTS_DIR. With it nothing is written anywhere else
    (tests/test_benchmarks.py checks that the committed results stay as they are).
    """
    also = f" and {what}" if what else ""
    parser.add_argument(
        "--out-dir",
        default=None,
        help=f"folder for the result JSON (and PNG){also}; nothing is written elsewhere (default: the result in benchmarks/results, or $AGOQ_RESULTS_DIR)",
    )


def command_line(module: str, argv: list[str] | None = None) -> str:
    """How to run this benchmark again from the repository root: ``python -m benchmarks.MODULE ARGS``.

    ``argv`` defaults to this process's arguments (``python -m benchmarks NAME ...`` hands its
    benchmark only the arguments after NAME, so these are the benchmark's own either way).
    """
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", f"benchmarks.{module}", *args])


def machine_info() -> dict[str, Any]:
    """CPU/GPU, core count, memory and software versions of this machine."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        # The speed of bf16 and of vector code depends on these (README: compute dtype).
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": _cpu_flags(),
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _cpu_flags() -> list[str]:
    """Which of AVX2, AVX512F, AVX512-BF16 and AMX-BF16 this CPU has."""
    from agoq.launch.choices import cpu_flags

    return list(cpu_flags(("avx2", "avx512f", "avx512_bf16", "amx_bf16")))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    """The current commit (with '-dirty' if tracked files other than results have changes), or 'unknown'.

    Result files are left out: one benchmark writing its JSON must not mark the next one's
    revision as modified code. AGOQ_REVISION, where set, is the revision: a copy of the source
    without its .git (the GPU machine's) gets it from whoever copied it there.
    """
    if os.environ.get("AGOQ_REVISION"):
        return os.environ["AGOQ_REVISION"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", f":(exclude){RESULTS_DIR.resolve()}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return rev + ("-dirty" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def same_round_ratio(times: list[float], base_times: list[float]) -> float:
    """The median over rounds of ``times[i] / base_times[i]``: the sides take turns within each
    round, so a change in the machine's load cancels in each round's ratio."""
    return statistics.median(t / b for t, b in zip(times, base_times))


def result_history(
    path: Path,
    ratios: Callable[[list[dict[str, Any]]], dict[str, Any]],
    rows_of: Callable[[dict[str, Any]], list[dict[str, Any]]] = lambda r: r["rows"],
) -> list[dict[str, Any]]:
    """The earlier results' headlines from the result file at ``path``, oldest first, with that
    file's own last: its revision, date and machine, and what ``ratios`` picks from its rows
    (``rows_of`` its results; their "rows" unless given)."""
    try:
        previous = json.loads(path.read_text())
        rows = rows_of(previous["results"])
    except (OSError, ValueError, KeyError):
        return []
    machine = previous.get("machine", {})
    headline = {
        "git_revision": previous.get("git_revision"),
        "date": previous.get("date"),
        "processor": machine.get("processor"),
        "cpu_flags": machine.get("cpu_flags"),
        **ratios(rows),
    }
    return [*previous["results"].get("history", []), headline]


def write_result(name: str, results: Any, *, command: str | None = None, out_dir: Path | None = None) -> Path:
    """Write ``results`` with command, revision, machine and date to <out_dir>/<name>.json.

    ``out_dir`` defaults to RESULTS_DIR; ``command`` to :func:`command_line` of the module ``name``.
    """
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "command": command or command_line(name),
        "git_revision": git_revision(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "results": results,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
