"""examples/hf_trainer.py in a short form: 2 processes, the HF Trainer with AGoQ (patched model, 8-bit DDP gradients)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests._data import train_corpus
from tests.run_examples import WORLD, run_examples

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


@pytest.mark.slow
def test_the_trainer_example_trains_with_8bit_gradients_and_matches_the_plain_run(tmp_path):
    common = [
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--vocab-size",
        "512",
        "--eval-windows",
        "4",
        "--corpus",
        train_corpus(),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    runs = run_examples(EXAMPLE, tmp_path, common, {"agoq": [], "plain": ["--plain"]}, timeout=300)
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
