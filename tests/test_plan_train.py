"""The planner against the trainer: predicted bytes per rank equal what `agoq train` measures.

A tiny (hidden 256) and a medium (hidden 512) model train for a step or two under bf16 (bf16
activations, fp32 gradients) and agoq (4-bit activations with DBCA stage bits, 8-bit gradients) in
one process; the tiny one also as pp=2 x dp=2 on a real gloo group (there also agoq with ZeRO-1),
where what changes is the schedule's in-flight micro-batches, the stage bits and the sharding, not
the per-layer formulas the medium model checks. For every
rank the planner's saved-activation peak (one pipelined step with its in-flight micro-batches), gradient buffer,
optimizer state and parameter bytes must be within 5% of the trainer's own numbers, and its stage
bits equal to the bits the trainer chose; its temporaries, an estimate, must bound the trainer's
count within a stated band.
"""

from __future__ import annotations

import pydoc_data.topics

import pytest

from agoq.plan import from_train_config, plan_memory
from agoq.launch.config import load_config
from tests._dist import run_distributed
from tests._data import data_cache

TOLERANCE = 0.05
# tiny: hidden 256, 4 layers; medium: the "small" preset's layer (hidden 512, intermediate 1376), 2 layers.
MODELS = {"tiny": ["--model.preset=tiny"], "medium": ["--model.preset=small", "--model.n_layers=2"]}
POLICIES = {
    "bf16": ["--precision.activations=bf16", "--precision.gradients=fp32"],
    "agoq": ["--precision.activations=agoq", "--precision.gradients=int8"],
}
# (pp, dp, micro-batches, steps): the trainer counts temporaries on the second step (a pipelined run
# needs it anyway: the first holds torch's shape inference).
LAYOUTS = {"single": (1, 1, 1, 2), "pp2xdp2": (2, 2, 2, 2)}
MODELS_OF = {"single": ("tiny", "medium"), "pp2xdp2": ("tiny",)}


def _train_all(rank: int, world: int, cfgs: dict) -> dict:
    from agoq.launch.run import train_worker

    out = {}
    for name, cfg in cfgs.items():
        res = train_worker(cfg)
        if rank == 0:
            out[name] = {"ranks": res["ranks"], "vocab": res["model"]["vocab_size"]}
    return out


def _configs(tmp, layout: str) -> dict:
    pp, dp, microbatches, steps = LAYOUTS[layout]
    common = [
        f"--data.corpus={tmp / 'corpus.txt'}",
        f"--data.cache_dir={data_cache()}",
        "--data.vocab_size=512",
        "--data.seq_len=64",
        "--data.batch_size=4",
        f"--parallel.microbatches={microbatches}",
        f"--parallel.pp={pp}",
        f"--parallel.dp={dp}",
        f"--train.steps={steps}",
        "--optim.warmup_steps=0",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--train.baseline=false",
        "--checkpoint.every=0",
        "--checkpoint.resume=false",
        "--precision.compute_dtype=bf16",
    ]
    runs = {f"{model}/{policy}": MODELS[model] + flags for model in MODELS_OF[layout] for policy, flags in POLICIES.items()}
    if dp > 1:
        runs["tiny/agoq+zero1"] = MODELS["tiny"] + POLICIES["agoq"] + ["--parallel.zero1=true"]
    return {name: load_config(None, common + [*flags, f"--train.out_dir={tmp / layout / name.replace('/', '-')}"]) for name, flags in runs.items()}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from agoq.data.tokens import prepare_data

    tmp = tmp_path_factory.mktemp("plan_train")
    (tmp / "corpus.txt").write_text("\n\n".join(pydoc_data.topics.topics.values())[:200_000])
    prepare_data(str(tmp / "corpus.txt"), None, 512, data_cache(), 0.01)  # once, before any rank starts
    out = {}
    for layout, (pp, dp, _, _) in LAYOUTS.items():
        cfgs = _configs(tmp, layout)
        results = run_distributed(_train_all, pp * dp, cfgs)[0]
        out[layout] = {name: (cfgs[name], results[name]) for name in cfgs}
    return out


CASES = [(layout, f"{m}/{p}") for layout in LAYOUTS for m in MODELS_OF[layout] for p in POLICIES] + [("pp2xdp2", "tiny/agoq+zero1")]


@pytest.mark.parametrize("layout, run", CASES)
def test_predicted_bytes_per_rank_match_the_trainer_within_5_percent(measured, layout, run):
    cfg, result = measured[layout][run]
    plan = plan_memory(from_train_config(cfg, result["vocab"]))
    (sp,) = plan.setups
    assert len(result["ranks"]) == cfg.world_size
    for stats in result["ranks"]:
        predicted = sp.ranks[stats["pp_rank"]]
        pairs = {
            "saved activations (peak)": (predicted.activations_peak, stats["peak_saved_bytes"]),
            "gradient buffer": (predicted.gradients, stats["grad_buffer_bytes"]),
            "optimizer state": (predicted.optimizer, stats["optimizer_bytes"]),
        }
        for what, (pred, meas) in pairs.items():
            assert meas > 0
            assert abs(pred - meas) <= TOLERANCE * meas, f"{run} {layout} rank {stats['rank']} {what}: predicted {pred}, measured {meas}"
        assert predicted.parameters == stats["param_bytes"]
        if stats["layer_bits"] == "bf16":
            assert predicted.bits is None
        else:
            assert set(stats["layer_bits"]) == set(predicted.bits), "the planner's stage bits are the trainer's DBCA bits"


def test_agoq_saves_what_the_plan_says_it_saves(measured):
    """The measured bf16 / agoq ratio of the peak saved activations equals the predicted ratio within 5%."""
    for layout in LAYOUTS:
        for model in MODELS_OF[layout]:
            (cb, rb), (ca, ra) = measured[layout][f"{model}/bf16"], measured[layout][f"{model}/agoq"]
            pb, pa = plan_memory(from_train_config(cb, rb["vocab"])).setups[0], plan_memory(from_train_config(ca, ra["vocab"])).setups[0]
            meas = max(s["peak_saved_bytes"] for s in rb["ranks"]) / max(s["peak_saved_bytes"] for s in ra["ranks"])
            pred = max(r.activations_peak for r in pb.ranks) / max(r.activations_peak for r in pa.ranks)
            assert meas > 2.0, f"{model} {layout}: agoq should keep well under half of bf16's activations, measured {meas:.2f}x"
            assert pred == pytest.approx(meas, rel=TOLERANCE)


@pytest.mark.parametrize("layout, run", CASES)
def test_predicted_temporaries_bound_the_measured_ones(measured, layout, run):
    """Temporaries are an estimate (docs/plan.md): within -15% / +60% of the trainer's count on
    every rank, and the total per rank (what a GPU's peak allocation would be) within 20%."""
    cfg, result = measured[layout][run]
    plan = plan_memory(from_train_config(cfg, result["vocab"]))
    (sp,) = plan.setups
    for stats in result["ranks"]:
        predicted = sp.ranks[stats["pp_rank"]]
        meas = stats["peak_temporary_bytes"]
        assert 0.85 * meas <= predicted.temporary <= 1.6 * meas, (
            run,
            layout,
            stats["rank"],
            predicted.temporary,
            meas,
            stats["peak_temporary_bytes_by_phase"],
        )
        total = stats["peak_tensor_bytes"]
        assert abs(predicted.total - total) <= 0.2 * total, (run, layout, stats["rank"], predicted.total, total)
