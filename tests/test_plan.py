"""`agoq plan`: the memory model's values, its tensor/pipeline arithmetic, recompute, budget mode, JSON and errors.

The agreement with what the trainer measures is in tests/test_plan_train.py; here the planner's
numbers are checked against the formulas they must reuse and against their own invariants.
"""

from __future__ import annotations

import json

import pytest
import torch

from agoq.activation import make_policy
from agoq.activation.accounting import U_bytes, layer_saved_bytes
from agoq.activation.loss import loss_saved_bytes
from agoq.models import PRESETS
from agoq.parallel import PipelineLayout, stage_layer_bits
from agoq.plan import PlanError, make_plan_config, plan_memory
from agoq.plan.config import parse_setup, parse_size
from agoq.plan.accounting import PlanAccounting
from agoq.plan.report import verdict

GiB = 2**30


def _plan(model="llama2-13b", fields=None, **kw):
    return plan_memory(make_plan_config(model, fields, **kw))


# ---------------------------------------------------------------- parameters, tp and pp


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameters_over_pp_ranks_add_up_to_the_model(name):
    cfg = PRESETS[name]
    pp = 2 if not cfg.tie_embeddings else 1
    plan = _plan(name, seq_len=256, pp=pp, global_batch=pp, setups=("baseline",))
    assert sum(r.parameters for r in plan.setups[0].ranks) == 2 * cfg.num_parameters()


def test_tensor_parallel_splits_every_matrix_and_replicates_the_norms():
    cfg = PRESETS["llama2-13b"]
    norms = cfg.n_layers * 2 * cfg.hidden + cfg.hidden
    (rank,) = _plan(seq_len=4096, tp=8, setups=("baseline",)).setups[0].ranks
    assert rank.parameters == 2 * ((cfg.num_parameters() - norms) // 8 + norms)
    # fp32 main gradients and fp32 master + two fp32 moments + a step counter per tensor: 4 and 12 bytes per parameter.
    assert rank.gradients == 2 * rank.parameters
    assert rank.optimizer == 6 * rank.parameters + 4 * (cfg.n_layers * 9 + 3)


def test_sequence_parallel_divides_the_saved_activations_by_tp():
    from agoq.parallel.tensor_ops import vocab_parallel_loss_saved_bytes

    one = _plan(seq_len=8192, pp=2, global_batch=2, setups=("baseline", "A")).setups
    eight = _plan(seq_len=8192, pp=2, global_batch=2, tp=8, setups=("baseline", "A")).setups
    cfg = PRESETS["llama2-13b"]
    for a, b in zip(one, eight):
        # A stage without the loss: only the token ids and their vocab mask (well under 0.1%) are
        # kept whole on every tp rank.
        assert b.ranks[0].activations_per_microbatch * 8 == pytest.approx(a.ranks[0].activations_per_microbatch, rel=1e-3)
        # The last stage: its layers and final norm / 8, and the sequence- and vocab-parallel loss
        # (whatever loss tp = 1 would take: a tp > 1 model always takes this one).
        policy = PlanAccounting(make_plan_config("llama2-13b", None, seq_len=8192, pp=2, global_batch=2)).activations.policy(a.setup)
        loss_one = loss_saved_bytes(8192, cfg.hidden, cfg.vocab_size, torch.bfloat16, policy.fused_loss, recompute=policy._loss_recompute)
        loss_eight = vocab_parallel_loss_saved_bytes(8192, cfg.hidden, torch.bfloat16, 8)
        layers_one = a.ranks[1].activations_per_microbatch - loss_one
        assert b.ranks[1].activations_per_microbatch - loss_eight == pytest.approx(layers_one / 8, rel=1e-3)


def test_activations_reuse_the_layer_and_loss_accounting():
    mb, seq = 2, 4096
    cfg = PRESETS["llama3-8b"]
    plan = _plan("llama3-8b", seq_len=seq, micro_batch=mb, setups=("baseline",))
    layer = sum(
        layer_saved_bytes(
            mb, seq, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, torch.bfloat16, make_policy("bf16").formats
        ).values()
    )
    tokens = mb * seq
    final_norm = tokens * cfg.hidden * 2 + tokens * 4
    ids = tokens * 8
    rope = 2 * seq * cfg.head_dim * 4
    expected = cfg.n_layers * layer + loss_saved_bytes(tokens, cfg.hidden, cfg.vocab_size, torch.bfloat16, False) + final_norm + ids
    rank = plan.setups[0].ranks[0]
    assert rank.activations_per_microbatch == expected
    assert rank.activations_peak == expected + rope  # pp = 1: one micro-batch in flight
    assert plan.layer_units["baseline"] == pytest.approx(layer / U_bytes(mb, seq, cfg.hidden), abs=1e-4)


def test_agoq_layer_is_about_a_third_of_the_baseline_layer():
    units = _plan(seq_len=12288, tp=8).layer_units
    cfg = PRESETS["llama2-13b"]

    def layer_units(policy) -> float:
        per_kind = layer_saved_bytes(
            1, 12288, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, torch.bfloat16, policy.formats
        )
        return sum(per_kind.values()) / U_bytes(1, 12288, cfg.hidden)

    # The planner's units are the layer accounting's (the one the meter is checked against to the byte).
    assert units["baseline"] == pytest.approx(layer_units(make_policy("bf16")), abs=1e-4)  # the plan rounds to 4 decimals
    assert units["A"] == pytest.approx(layer_units(make_policy("agoq")), abs=1e-4)
    # LLaMA2-13B (MHA, intermediate 2.7h): the 4-bit layer keeps about a third of the bf16 one,
    # because attention's inputs and outputs (4U of MHA) stay bf16.
    assert 0.30 < units["A"] / units["baseline"] < 0.34


# ---------------------------------------------------------------- pipeline: in flight, DBCA


def test_interleaved_peaks_and_dbca_bits_come_from_the_trainers_functions():
    kw = dict(seq_len=16384, tp=8, pp=4, dp=2, global_batch=16, schedule="interleaved-1f1b")
    plan = _plan(**kw, setups=("A",))
    assert plan.inflight == (11, 9, 7, 5)  # METHOD.md's figures, read off torch's schedule
    cfg = PRESETS["llama2-13b"]
    policy = make_policy("agoq", formats={k: "int4/128" for k in ("norm_input", "act_input", "out_proj_input")})
    layout = PipelineLayout("interleaved1f1b", pp=4, microbatches=8, virtual_stages=2, dp=2)
    layer_bits = stage_layer_bits(cfg, layout, 1, 16384 // 8, policy, 4)
    got = [b for r in plan.setups[0].ranks for b in r.bits]
    want = [layer_bits[s * 5] for r in range(4) for s in (r, r + 4)]
    assert got == want and got[:2] == [4, 4] and max(got) > 4


def test_dbca_raises_bits_without_raising_the_peak():
    kw = dict(seq_len=16384, tp=8, pp=4, global_batch=8, schedule="1f1b", setups=("A",))
    dbca = _plan(**kw).setups[0].ranks
    uniform = _plan(**kw, stage_bits="uniform").setups[0].ranks
    assert [r.inflight for r in dbca] == [4, 3, 2, 1]
    assert max(r.activations_peak for r in dbca) <= max(r.activations_peak for r in uniform)
    raised = [i for i, r in enumerate(dbca) if r.bits[0] > 4]
    assert raised and all(dbca[i].activations_peak > uniform[i].activations_peak for i in raised)


# ---------------------------------------------------------------- fit, recompute, budget


def test_baseline_recomputes_the_fewest_layers_that_fit_and_agoq_needs_none():
    kw = dict(seq_len=81920, tp=8, pp=4, dp=2, global_batch=16, schedule="interleaved-1f1b", gpu_memory=48 * GiB)
    cfg = make_plan_config("llama2-13b", **kw)
    plan = plan_memory(cfg)
    base, agoq = plan.get("baseline"), plan.get("A+G+O")
    cap = 46 * GiB
    assert base.peak_without_recompute > cap and base.recompute_layers > 0 and base.peak <= cap and base.fits
    planner = PlanAccounting(cfg)
    fewer = [
        planner.rank_memory(r, parse_setup("baseline"), planner.policy(parse_setup("baseline")), [16] * 8, base.recompute_layers - 1)
        for r in range(4)
    ]
    assert max(r.total for r in fewer) > cap  # one layer fewer does not fit
    assert agoq.recompute_layers == 0 and agoq.fits and agoq.peak < cap
    speedup = plan.speedup_estimate("A+G+O")
    assert speedup == pytest.approx(base.relative_time / agoq.relative_time)
    assert 1.1 < speedup < 1.4  # 4 of 5 layers per chunk recomputed (+27% work) against +3% for quantization
    # Each row says what it means in words.
    assert verdict(base) == f"fits with {base.recompute_layers} layers per stage recomputed"
    assert verdict(agoq) == "fits as is"


def test_a_configuration_that_cannot_fit_says_so():
    plan = _plan(seq_len=131072, tp=8, gpu_memory=24 * GiB, setups=("baseline", "A+G+O"))
    base = plan.get("baseline")
    assert base.recompute_layers is None and base.fits is False
    assert verdict(base) == "**does not fit**, even recomputing every layer"
    assert verdict(_plan(seq_len=4096, setups=("baseline",)).get("baseline")) == "no memory limit given (--gpu-memory)"
    assert plan.speedup_estimate("A+G+O") is None


def test_budget_mode_spends_room_on_bits_and_stays_within_the_budget():
    kw = dict(seq_len=32768, tp=8, pp=4, global_batch=8, schedule="1f1b", setups=("A+G+O",))
    roomy = _plan(**kw, memory_budget=80 * GiB).setups[0]
    assert all(r.bits == (16,) for r in roomy.ranks) and roomy.recompute_layers == 0
    base = _plan(**kw).setups[0]
    tight = base.peak + 2 * GiB
    mid = _plan(**kw, memory_budget=tight).setups[0]
    assert all(r.total <= tight for r in mid.ranks)
    bits = [r.bits[0] for r in mid.ranks]
    assert bits == sorted(bits) and bits[-1] > bits[0]  # later ranks hold fewer micro-batches: more bits
    small = _plan(**kw, memory_budget=base.peak - 1 * GiB).setups[0]
    assert small.recompute_layers > 0 and all(r.bits == (4,) for r in small.ranks) and small.peak <= base.peak - GiB


def test_each_part_of_agoq_lowers_the_peak():
    plan = _plan(seq_len=12288, tp=8, dp=8, global_batch=8)
    peaks = [plan.get(n).peak for n in ("baseline", "A", "A+G", "A+G+O", "A+G+O+zero1")]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 5
    assert plan.get("baseline+zero1").peak < plan.get("baseline").peak
    assert peaks[3] / peaks[0] < 0.55  # the paper measured 22.3 / 46.1 = 0.48 here


def test_eight_bit_gradients_and_optimizer_bytes():
    (g,) = _plan(seq_len=4096, tp=8, setups=("A+G",)).setups[0].ranks
    (f,) = _plan(seq_len=4096, tp=8, setups=("A",)).setups[0].ranks
    # int8 block 256 with an fp32 scale: 1 + 4/256 bytes per value (each tensor rounded to whole blocks).
    assert g.gradients / (f.gradients / 4) == pytest.approx(1 + 4 / 256, rel=1e-4)


def test_eight_bit_optimizer_state_matches_torchao():
    torchao_optim = pytest.importorskip("torchao.optim")
    from agoq.train.optim import tensor_bytes

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (256 * 40, 4096, 1000, 300 * 256)]
    opt = torchao_optim.AdamW8bit(params)
    measured = sum(tensor_bytes(opt._new_buffer(p, s)) for p in params for s in (True, False))
    planner = PlanAccounting(make_plan_config("tiny", seq_len=64, dtype="fp32", setups=("O",)))
    predicted = planner.optimizer_bytes([p.numel() for p in params], parse_setup("O")) - 4 * len(params)  # less the step counters
    assert predicted == measured


# ---------------------------------------------------------------- CLI, JSON, errors


def test_json_schema_is_stable(capsys):
    from agoq.cli import main

    assert (
        main(
            ["plan", "--model", "llama3-8b", "--tp", "2", "--pp", "2", "--seq-len", "8192", "--global-batch", "4", "--gpu-memory", "80GiB", "--json"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "agoq.plan/1"
    assert set(doc) == {
        "schema",
        "model",
        "parallel",
        "precision",
        "memory",
        "inflight_per_rank",
        "layer_saved_units",
        "configurations",
        "gradient_link_bytes",
    }
    assert [c["name"] for c in doc["configurations"]] == ["baseline", "baseline+zero1", "A", "A+G", "A+G+O", "A+G+O+zero1"]
    conf = doc["configurations"][0]
    assert set(conf) == {
        "name",
        "description",
        "activations",
        "gradients",
        "optimizer",
        "zero1",
        "peak_bytes",
        "peak_bytes_without_recompute",
        "fits",
        "recompute_layers",
        "relative_iteration_time_estimate",
        "ranks",
    }
    rank = conf["ranks"][0]
    assert set(rank) == {"pp_rank", "stages", "layers", "bits", "inflight", "recompute_layers", "bytes"}
    assert set(rank["bytes"]) == {
        "parameters",
        "gradients",
        "optimizer",
        "activations_per_microbatch",
        "activations_peak",
        "pipeline_buffers",
        "temporary",
        "total",
        "total_without_recompute",
    }
    assert rank["bytes"]["total"] == sum(
        v for k, v in rank["bytes"].items() if k not in ("activations_per_microbatch", "total", "total_without_recompute")
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_command_works_for_every_preset(name, capsys):
    from agoq.cli import main

    pp = 1 if PRESETS[name].tie_embeddings else 2
    assert main(["plan", "--model", name, "--pp", str(pp), "--seq-len", "2048", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "| A+G+O+zero1 |" in out and "estimate" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama2-13b", "--tp", "16"], "n_heads=40 is not divisible by tp=16"),
        (["--model", "llama3-8b", "--tp", "64"], "n_heads=32 is not divisible by tp=64"),
        (["--model", "codellama-34b", "--tp", "16"], "n_kv_heads=8 is not divisible by tp=16"),
        (["--model", "llama2-13b", "--pp", "3"], "40 layers cannot be cut into pp * virtual_stages = 3 * 1"),
        (
            ["--model", "llama2-13b", "--pp", "4", "--schedule", "interleaved-1f1b", "--global-batch", "8", "--virtual-stages", "3"],
            "40 layers cannot be cut into pp * virtual_stages = 4 * 3",
        ),
        (["--model", "llama5-1t"], "unknown model 'llama5-1t'"),
        (["--model", "tiny", "--global-batch", "3", "--dp", "2"], "global-batch=3 is not a multiple"),
        (["--model", "tiny", "--seq-len", "101", "--tp", "2"], "seq-len=101 is not divisible by tp=2"),
        (["--model", "tiny", "--gpu-memory", "lots"], "cannot read the size 'lots'"),
        (["--model", "tiny", "--configs", "A+Z"], "unknown configuration 'A+Z'"),
        (["--model", "tiny", "--model-field", "layers=3"], "--model-field 'layers=3' must be KEY=VALUE"),
        (["--model", "llama2-13b", "--gpu-memory", "1e400"], "size '1e400' is beyond any machine"),
        (["--model", "llama2-13b", "--memory-budget", "1e30"], "size '1e30' is beyond any machine"),
        (["--model", "llama2-13b", "--model-field", "n_layers=1000000000"], "n_layers=1000000000 cannot be planned"),
    ],
)
def test_impossible_configurations_get_one_line(argv, message, capsys):
    from agoq.cli import main

    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_node_size_that_does_not_divide_dp_and_a_boolean_that_is_not_one_get_one_line(capsys):
    from agoq.cli import main

    for argv, line in (
        (
            ["--dp", "8", "--node-size=3"],
            "agoq plan: node-size=3 does not divide dp=8; give the dp ranks per node, a divisor of 8 (e.g. --node-size 2) or at least 8 for one node",
        ),
        (
            ["--model", "tiny", "--model-field", "tie_embeddings=maybe"],
            "agoq plan: --model-field tie_embeddings='maybe' is not a boolean; use true or false (or yes/no, 1/0)",
        ),
    ):
        assert main(["plan", *argv]) == 2
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", line + "\n")
    assert main(["plan", "--dp", "8", "--node-size=16", "--json"]) == 0  # one node of all 8 ranks
    links = json.loads(capsys.readouterr().out)["gradient_link_bytes"]
    assert links["node_size"] == 16 and all(b["inter_node"] == 0 for b in links["per_rank_per_step"].values())


def test_model_fields_read_booleans_and_numbers_as_agoq_train_does():
    from agoq.plan.cli import _fields
    from agoq.launch.config import load_config
    from agoq.values import BOOLEAN_SPELLINGS

    for word in BOOLEAN_SPELLINGS + ("TRUE", "No"):
        expected = word.lower() in ("true", "yes", "1")
        assert _fields([f"tie_embeddings={word}"]) == {"tie_embeddings": expected}
        cfg = load_config(None, ["--parallel.pp=1", f"--model.tie_embeddings={word}"])
        assert cfg.model_config().tie_embeddings is expected
    assert _fields(["hidden=512", "norm_eps=1e-6", "rope_theta=500000"]) == {"hidden": 512, "norm_eps": 1e-6, "rope_theta": 500000.0}


def test_a_small_model_is_counted_in_millions_not_as_zero_billions(capsys):
    from agoq.cli import main
    from agoq.models.config import PRESETS, parameter_count_text

    assert main(["plan", "--model", "tiny", "--seq-len", "256"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "# agoq plan: tiny (5.0 M parameters)"
    assert parameter_count_text(PRESETS["llama2-13b"].num_parameters()) == "13.02 B parameters"
    assert parameter_count_text(4321) == "4,321 parameters"


def test_sizes():
    assert parse_size("48GiB") == 48 * 2**30
    assert parse_size("46.1GB") == 46_100_000_000
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size(1000) == 1000
    assert parse_size("0", allow_zero=True) == 0
    with pytest.raises(PlanError, match="must be positive"):
        parse_size("0")


def test_a_sequence_beyond_the_models_context_is_planned_with_a_warning(capsys):
    from agoq.cli import main

    assert main(["plan", "--model", "llama2-13b", "--seq-len", "8192", "--tp", "8"]) == 0
    captured = capsys.readouterr()
    assert "--seq-len 8192 is beyond llama2-13b's max_seq_len 4096" in captured.err and captured.err.count("\n") == 1
    assert "| baseline |" in captured.out


# ---------------------------------------------------------------- gradient bytes by link class


def test_gradient_link_bytes_split_each_modes_total_and_the_two_hop_one_is_its_own_count():
    from agoq.gradient.counter import ring_all_reduce_bytes
    from agoq.gradient.hierarchical import hierarchical_bytes, hierarchical_layout
    from agoq.plan.links import gradient_link_bytes

    numel, dp = 10_000_000, 16
    links = gradient_link_bytes(numel, dp, node_size=8)
    fp32 = links["fp32"]
    assert fp32["intra_node"] + fp32["inter_node"] == ring_all_reduce_bytes(4 * numel, dp)
    assert fp32["inter_node"] == ring_all_reduce_bytes(4 * numel, dp) // 8  # the ring leaves each node once
    hops = hierarchical_bytes(hierarchical_layout(numel, 8, 2, "int8/256", "int4/64"))
    assert links["hier-8/4"]["inter_node"] == sum(hops["hier_inter_all_reduce"])
    assert sum(links["hier-8/4"].values()) == sum(sum(v) for v in hops.values())
    # Only 1/8 of the gradients crosses, in 4 bits: well under 0.15x of the fp32 ring's crossing bytes,
    # while the flat all-to-all sends 8 of its 15 rows straight to the other node.
    assert links["hier-8/4"]["inter_node"] < 0.15 * fp32["inter_node"] < links["int8"]["inter_node"]
    # One node: nothing crosses.
    assert all(b["inter_node"] == 0 for b in gradient_link_bytes(numel, 8, node_size=8).values())
    with pytest.raises(ValueError, match="node-size=3 does not divide dp=16"):
        gradient_link_bytes(numel, dp, node_size=3)


def test_plan_reports_gradient_bytes_by_link_in_markdown_and_json():
    from agoq.plan.report import markdown

    plan = _plan("llama3-8b", seq_len=1024, dp=16, node_size=8)
    text = markdown(plan)
    assert "Gradient bytes per rank and step by link, dp=16 in nodes of 8 ranks" in text
    data = plan.to_dict()["gradient_link_bytes"]
    assert data["node_size"] == 8 and set(data["per_rank_per_step"]) == {"fp32", "int8", "int4", "hier-8/4"}
    assert "Gradient bytes per rank" not in markdown(_plan("llama3-8b", seq_len=1024))  # dp = 1: nothing to reduce


def test_zero1_at_one_dp_rank_shards_nothing_and_adds_no_temporaries(capsys):
    from agoq.cli import main

    plan = _plan("llama3-8b", seq_len=8192, gpu_memory=80 * GiB)
    for sharded, unsharded in (("baseline+zero1", "baseline"), ("A+G+O+zero1", "A+G+O")):
        z, u = plan.get(sharded), plan.get(unsharded)
        assert [r.to_dict() for r in z.ranks] == [r.to_dict() for r in u.ranks]
        assert (z.fits, z.recompute_layers, z.relative_time) == (u.fits, u.recompute_layers, u.relative_time)
    assert plan.get("A+G+O").fits is True and plan.get("A+G+O+zero1").fits is True
    # From dp=2 on ZeRO-1 shards the optimizer state.
    two = _plan("llama3-8b", seq_len=8192, dp=2, global_batch=2, gpu_memory=80 * GiB)
    assert two.get("A+G+O+zero1").ranks[0].optimizer < two.get("A+G+O").ranks[0].optimizer
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "8192", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "At dp=1 ZeRO-1 has one rank to shard over and shards nothing: each +zero1 row is the configuration without it" in out
    assert main(["plan", "--model", "llama3-8b", "--dp", "2", "--global-batch", "2"]) == 0
    assert "At dp=1" not in capsys.readouterr().out
