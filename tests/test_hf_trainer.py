"""examples/hf_trainer.py in a short form: 2 processes, the HF Trainer with AGoQ (patched model, 8-bit DDP gradients)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
RUN_EXAMPLES = Path(__file__).resolve().parent / "run_examples.py"
WORLD = 2


def _runs(tmp: Path, runs: dict[str, list[str]]) -> dict[str, dict]:
    """The example's summary of each run (name -> extra arguments), all in one torchrun's processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(RUN_EXAMPLES), str(EXAMPLE)]
    for name, extra in runs.items():
        cmd += ["--", "--steps", "3", "--batch-size", "2", "--seq-len", "64", "--vocab-size", "512", "--eval-windows", "4"]
        cmd += ["--cache-dir", str(tmp / "cache"), "--out-dir", str(tmp / name), "--summary", str(tmp / f"{name}.json"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in runs}


@pytest.mark.slow
def test_the_trainer_example_trains_with_8bit_gradients_and_matches_the_plain_run(tmp_path):
    runs = _runs(tmp_path, {"agoq": [], "plain": ["--plain"]})
    agoq, plain = runs["agoq"], runs["plain"]
    # The 8-bit reduction sends each parameter's 1/W share to W-1 peers twice (all-to-all, then
    # all-gather): 2 (W-1)/W bytes per parameter, plus one fp32 scale per 256 values (int8/256) and
    # the padding of each DDP bucket to whole blocks (under 1% here).
    expected = 2 * (WORLD - 1) / WORLD * agoq["parameters"] * (1 + 4 / 256)
    assert expected <= agoq["wire_bytes_per_step"] <= 1.01 * expected
    assert plain["wire_bytes_per_step"] == 0  # the plain run keeps DDP's own fp32 all-reduce
    # Three steps from the same seed and data: the losses start at ln(vocab) and move together.
    for run in (agoq, plain):
        assert math.isfinite(run["val_loss"]) and run["val_loss"] < math.log(512)
    assert abs(agoq["val_loss"] - plain["val_loss"]) <= 0.01 * plain["val_loss"]
