"""Run one example's ``main(argv)`` several times in the same processes, one argument list after
each ``--``: ``torchrun --nproc-per-node=2 tests/run_examples.py examples/X.py -- ARGS -- ARGS``.

The tests compare an example's runs (with and without agoq, one Trainer and another); each process
imports torch, transformers and the example once instead of once per run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

WORLD = 2


def run_examples(example: Path, tmp: Path, common: list[str], runs: dict[str, list[str]], timeout: float) -> dict[str, dict]:
    """The summary of each run of ``example`` (name -> its arguments after ``common``), all in one
    ``torchrun --nproc-per-node=2``; each run writes to ``tmp/NAME`` and its summary to ``tmp/NAME.json``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", __file__, str(example)]
    for name, extra in runs.items():
        cmd += ["--", *common, "--out-dir", str(tmp / name), "--summary", str(tmp / f"{name}.json"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in runs}


def main() -> None:
    path, *rest = sys.argv[1:]
    runs, current = [], None
    for arg in rest:
        if arg == "--":
            current = []
            runs.append(current)
        else:
            current.append(arg)
    spec = importlib.util.spec_from_file_location("example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for argv in runs:
        example.main(argv)
    # Every rank leaves the process group together (an exit with gloo's threads running can abort a rank).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
