"""`agoq train` end to end on a real gloo group of 4 ranks (pp=2 x dp=2).

One process group runs every run (spawning costs seconds); the tests assert on what it returned:
each schedule lowers the loss, the pipelined loss equals the unpipelined model's on the same batch,
a resumed run continues exactly like an uninterrupted one, and stage-aware bits raise precision
without raising the peak over ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings

import pytest
import torch

from agoq.launch.config import ConfigError, load_config
from tests._dist import run_distributed
from tests._data import data_args, data_cache, train_corpus

BASE = [
    "--model.hidden=64",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.intermediate=160",
    "--data.vocab_size=512",
    "--data.seq_len=32",
    "--data.batch_size=8",
    "--parallel.microbatches=2",
    "--optim.warmup_steps=0",
    "--optim.lr=3e-3",
    "--optim.min_lr=3e-3",
    "--train.eval_every=0",
    "--train.baseline=false",
    "--checkpoint.every=0",
    "--checkpoint.resume=false",
]


def _cfg(tmp, name, *extra):
    cfg = load_config(None, BASE + [*data_args(), f"--train.out_dir={tmp / name}", *extra])
    return cfg


def _losses(result: dict) -> list[float]:
    return [r["loss"] for r in result["records"]]


def _runs(rank: int, world: int, cfgs: dict) -> dict:
    import agoq.parallel.inflight as inflight
    from agoq.launch.run import train_worker

    torch.manual_seed(0)
    out = {}
    in_forward = inflight.loss_weight_grad_in_forward
    for name, cfg in cfgs.items():
        asked = cfg.to_dict()
        # A run named *_loss_recompute takes the fused loss's recompute path on its last stage.
        inflight.loss_weight_grad_in_forward = (lambda pp, tp: False) if name.endswith("_loss_recompute") else in_forward
        stderr = io.StringIO()
        try:
            # torchao compiles its 8-bit step once per parameter shape (seconds per rank on 2
            # cores); the trainer's handling of it is the same eagerly, and tests/test_optim.py
            # runs the compiled step.
            with (
                torch.compiler.set_stance("force_eager" if name == "adamw8bit" else "default"),
                _nan_in_rank1_activations_at_step3(name == "nan_at_step3"),
                contextlib.redirect_stderr(stderr),
                warnings.catch_warnings(record=True) as caught,
            ):
                warnings.simplefilter("always")
                res = train_worker(cfg)
        finally:
            inflight.loss_weight_grad_in_forward = in_forward
        if name == "nan_at_step3":
            out["nan_at_step3_stderr"] = stderr.getvalue()
            out["nan_at_step3_warnings"] = [str(w.message) for w in caught]
            if "run" in res:
                out["nan_at_step3_summary"] = res
        # The tokenizer's vocabulary goes into the LlamaConfig the trainer builds, and the auto
        # choices into the value beside the config: the config stays as validated.
        assert cfg.to_dict() == asked, f"{name}: the run changed its config"
        if "config" in res:  # what the summary records: the decided compute dtype in place of auto
            dtype = res["config"]["precision"]["compute_dtype"]
            assert dtype == asked["precision"]["compute_dtype"] or (asked["precision"]["compute_dtype"] == "auto" and dtype in ("bf16", "fp32"))
        out[name] = {"losses": _losses(res), "grad_norms": [r["grad_norm"] for r in res["records"]]}
        out[name]["stats"] = res["ranks"][rank] if "ranks" in res else res["stats"]
        if "config" in res:
            out[name]["vocab"] = res["model"]["vocab_size"]
        if "ranks" in res:
            out[name]["all_stats"] = res["ranks"]
            out[name]["run"] = res["run"]
    # This worker's own high-water mark, read independently of agoq.train.metrics.
    status = open("/proc/self/status").read()
    out["_vmhwm_bytes"] = 1024 * int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
    return out


@contextlib.contextmanager
def _nan_in_rank1_activations_at_step3(active: bool):
    """Global rank 1 (pipeline stage 0, dp replica 1) turns its embedding output to NaN in step 3."""
    from agoq.train.trainer import Trainer

    original = Trainer.forward_backward

    def poisoned(self, inputs, targets):
        if self.step != 2 or self.ctx.rank != 1:
            return original(self, inputs, targets)
        handle = self.modules[0].embed.register_forward_hook(lambda module, args, output: output * float("nan"))
        try:
            return original(self, inputs, targets)
        finally:
            handle.remove()

    Trainer.forward_backward = poisoned if active else original
    try:
        yield
    finally:
        Trainer.forward_backward = original


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from agoq.data.tokens import prepare_data

    tmp = tmp_path_factory.mktemp("train")
    prepare_data(train_corpus(), None, 512, data_cache(), 0.01)  # build the cache once, before the ranks start
    fp32_plain = ["--precision.compute_dtype=fp32", "--precision.activations=bf16", "--precision.gradients=fp32"]
    cfgs = {
        "1f1b_fp32": _cfg(tmp, "a", "--train.steps=4", *fp32_plain),
        "gpipe_agoq": _cfg(tmp, "b", "--train.steps=3", "--parallel.schedule=gpipe"),
        # The same 1F1B run twice, the last stage's loss handing the head's gradient over in forward
        # or recomputing its logits in backward, through an eval() (the schedule initializes again).
        "1f1b_agoq": _cfg(tmp, "i", "--train.steps=3", "--train.eval_every=2", "--precision.compute_dtype=fp32"),
        "1f1b_agoq_loss_recompute": _cfg(tmp, "j", "--train.steps=3", "--train.eval_every=2", "--precision.compute_dtype=fp32"),
        "interleaved_agoq": _cfg(tmp, "c", "--train.steps=3", "--parallel.schedule=interleaved-1f1b", "--parallel.virtual_stages=2"),
        # Layer recompute with the plain fp32 buffer reduced in bf16 (the FP8-LM ring that also took
        # this path is a baseline of benchmarks/, tested in tests/test_gradient_collectives.py).
        "bf16_allreduce_recompute": _cfg(
            tmp, "g", "--train.steps=3", "--precision.activations=bf16", "--precision.gradients=bf16", "--precision.recompute_layers=1"
        ),
        "resume_first_half": _cfg(tmp, "d", "--train.steps=2", "--checkpoint.every=2", *fp32_plain),
        "resume_second_half": _cfg(tmp, "d", "--train.steps=4", "--checkpoint.resume=true", *fp32_plain),
        "uniform4": _cfg(tmp, "e", "--train.steps=1", "--precision.stage_bits=uniform", "--precision.compute_dtype=fp32", "--train.baseline=true"),
        "dbca": _cfg(tmp, "f", "--train.steps=1", "--precision.stage_bits=dbca", "--precision.compute_dtype=fp32"),
        # NaN activations on one rank at step 3 of 6: the step is skipped on every rank, reported once.
        "nan_at_step3": _cfg(tmp, "k", "--train.steps=6", "--precision.compute_dtype=fp32"),
        # torchao's step is torch.compile'd: the step that counts temporaries runs it eagerly.
        "adamw8bit": _cfg(tmp, "h", "--train.steps=2", "--optim.name=adamw8bit"),
    }
    results = run_distributed(_runs, 4, cfgs)
    return {"cfgs": cfgs, "results": results, "tmp": tmp}


@pytest.mark.parametrize("name", ["1f1b_fp32", "gpipe_agoq", "interleaved_agoq", "bf16_allreduce_recompute"])
def test_each_schedule_lowers_the_loss(runs, name):
    losses = runs["results"][0][name]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    # Every rank reports the same global loss.
    for r in runs["results"]:
        assert r[name]["losses"] == losses


def test_pipelined_loss_equals_the_unpipelined_model(runs):
    from agoq.activation import make_policy
    from agoq.models import Llama
    from agoq.data.tokens import TrainSampler, prepare_data

    cfg = runs["cfgs"]["1f1b_fp32"]
    data = prepare_data(train_corpus(), None, 512, data_cache(), 0.01)
    mc = dataclasses.replace(cfg.model_config(), vocab_size=data.tokenizer.vocab_size)
    model = Llama(mc, make_policy("bf16"))
    model.reset_parameters(cfg.train.seed)
    x, y = TrainSampler(data.train, cfg.data.seq_len, cfg.data.batch_size, 0, 1, cfg.train.seed).next_batch()
    with torch.no_grad():
        expected = float(model(x, y))
    assert runs["results"][0]["1f1b_fp32"]["losses"][0] == pytest.approx(expected, rel=1e-5)


def test_resume_continues_exactly_like_an_uninterrupted_run(runs):
    import json

    straight = runs["results"][0]["1f1b_fp32"]["losses"]
    first = runs["results"][0]["resume_first_half"]["losses"]
    second = runs["results"][0]["resume_second_half"]["losses"]
    assert first == straight[:2]
    assert second == straight[2:]  # bit-identical on CPU
    # Each rank's metrics hold every step once, first half and resumed half together.
    for rank in range(4):
        rows = (runs["tmp"] / "d" / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]


def test_stage_aware_bits_raise_precision_without_raising_the_peak(runs):
    uni = {s["rank"]: s for s in runs["results"][0]["uniform4"]["all_stats"]}
    dbca = {s["rank"]: s for s in runs["results"][0]["dbca"]["all_stats"]}
    assert all(b == 4 for s in uni.values() for b in s["layer_bits"])
    assert any(b > 4 for s in dbca.values() for b in s["layer_bits"]), dbca
    peak_uni = max(s["peak_saved_bytes"] for s in uni.values())
    peak_dbca = max(s["peak_saved_bytes"] for s in dbca.values())
    assert peak_dbca <= peak_uni
    # The rank that got more bits really holds more bytes than under uniform 4 bits.
    raised = [r for r, s in dbca.items() if max(s["layer_bits"]) > 4]
    assert all(dbca[r]["peak_saved_bytes"] > uni[r]["peak_saved_bytes"] for r in raised)


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.n_layers=3"], "model.n_layers=3 is not divisible"),
        (["--parallel.schedule=zigzag"], "parallel.schedule='zigzag' is unknown"),
        (["--precision.activation_format=int7"], "int7"),
        (["--data.corpus=/no/such/file.txt"], "data.corpus='/no/such/file.txt' does not exist"),
        (["--parallel.microbatches=1"], "parallel.microbatches=1 is fewer than parallel.pp=2"),
        (["--data.batch_size=6"], "data.batch_size=6 is not divisible"),
        (["--train.steps=ten"], "train.steps='ten' is not an integer"),
        (["--optim.name=sgd"], "optim.name='sgd' is unknown"),
    ],
)
def test_invalid_config_values_stop_with_one_line_naming_them(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_config(None, override)
    assert "\n" not in str(e.value)


def test_validation_is_checked_for_a_whole_batch_and_only_when_the_run_reads_it():
    """A long sequence leaves too little held-out text for one validation batch: the run stops before
    launch naming the fix, unless it neither evaluates nor measures the baseline."""
    from agoq.launch.run import check_data

    long = ["--data.seq_len=4096", "--model.max_seq_len=4096", "--data.batch_size=8"]
    with pytest.raises(ConfigError, match=r"10000 validation tokens .* fewer than one batch of .* = 32769; raise data.val_fraction") as e:
        check_data(load_config(None, long), 10**6, 10_000)
    assert "\n" not in str(e.value)
    check_data(load_config(None, [*long, "--train.eval_every=0", "--train.baseline=false"]), 10**6, 10_000)
    # The bf16 policy has no baseline to measure.
    check_data(load_config(None, [*long, "--train.eval_every=0", "--precision.activations=bf16"]), 10**6, 10_000)
    with pytest.raises(ConfigError, match="fewer than one batch"):
        check_data(load_config(None, [*long, "--train.eval_every=0"]), 10**6, 10_000)


def test_cli_reports_config_errors_before_starting_processes(capsys):
    from agoq.cli import main

    assert main(["train", "--parallel.pp=0"]) == 2
    assert "parallel.pp=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["1f1b_fp32", "gpipe_agoq", "interleaved_agoq", "bf16_allreduce_recompute", "resume_second_half", "adamw8bit"])
def test_every_rank_reports_its_temporaries(runs, name):
    """The second step run counts temporaries; they include at least one full-precision gradient of
    the rank's embedding or head (vocab x hidden) before it folds into the gradient buffer."""
    cfg = runs["cfgs"][name]
    elem = 4 if cfg.precision.compute_dtype == "fp32" else 2
    vocab_by_hidden = runs["results"][0][name]["vocab"] * cfg.model_config().hidden * elem
    for stats in runs["results"][0][name]["all_stats"]:
        assert stats["peak_temporary_bytes"] >= vocab_by_hidden, (name, stats)
    # One-step runs have no second step to count.
    assert all(s["peak_temporary_bytes"] is None for s in runs["results"][0]["dbca"]["all_stats"])


def test_each_rank_reports_its_own_peak_rss_not_the_launchers(runs):
    import resource

    launcher = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Ranks report at the end of each run; their high-water mark can only have grown since, but
    # Linux sums a process's RSS counters from per-CPU batches when it reads them (approximate to
    # a few pages per CPU), so a later read may come out a few pages lower.
    slack = 2**20
    reported = {s["rank"]: s["peak_rss_bytes"] for s in runs["results"][0]["adamw8bit"]["all_stats"]}
    for rank, result in enumerate(runs["results"]):
        vmhwm = result["_vmhwm_bytes"]
        assert 0.9 * vmhwm <= reported[rank] <= vmhwm + slack, (rank, reported[rank], vmhwm)
        assert reported[rank] != launcher
    assert len(set(reported.values())) > 1, reported  # four processes, four high-water marks


def test_tokens_per_second_is_tokens_per_step_over_the_mean_step_time(runs):
    cfg = runs["cfgs"]["1f1b_fp32"]
    run = runs["results"][0]["1f1b_fp32"]["run"]
    assert run["tokens_per_step"] == cfg.data.batch_size * cfg.data.seq_len
    assert run["tokens_per_s"] == pytest.approx(run["tokens_per_step"] / run["step_time_s"], rel=1e-12)
    losses = runs["results"][0]["1f1b_fp32"]["losses"]
    assert run["final_loss"] == losses[-1] and run["min_train_loss"] == min(losses)
    assert run["train_loss"] == pytest.approx(sum(losses[-10:]) / len(losses[-10:]), rel=1e-12)


def test_rerunning_a_finished_run_shows_its_summary_and_how_to_start_again(runs, capsys):
    from agoq.cli import main

    tmp = runs["tmp"]
    # Folder d holds resume_first_half's checkpoint of step 2 (and the summary of the run resumed from it).
    finished = BASE + [
        *data_args(),
        f"--train.out_dir={tmp / 'd'}",
        "--train.steps=2",
        "--checkpoint.resume=true",
        "--precision.compute_dtype=fp32",
    ]
    assert main(["train", *finished]) == 0
    out = capsys.readouterr().out
    assert "is already complete: its newest checkpoint is step 2 of train.steps=2" in out
    assert "train loss" in out and "saved activations (peak)" in out  # the summary, again
    assert "--train.out_dir=" in out and "--checkpoint.resume=false" in out


def test_train_help_lists_every_config_key(capsys):
    from agoq.cli import main
    from agoq.launch.config import TrainConfig

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for section in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else type(getattr(TrainConfig(), section.name))):
            assert f"{section.name}.{f.name} = " in out, f"{section.name}.{f.name} missing from agoq train --help"


def test_print_config_writes_toml_that_loads_back_to_the_same_config(tmp_path, capsys):
    from agoq.cli import main

    assert main(["train", "--print-config", "--parallel.pp=1", "--optim.lr=0.001", "--model.overrides={n_layers = 4}"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "effective.toml"
    path.write_text(text)
    expected = load_config(None, ["--parallel.pp=1", "--optim.lr=0.001", "--model.overrides={n_layers = 4}"])
    assert load_config(path) == expected


def test_the_terminal_summary_fits_a_terminal(runs):
    from agoq.train.metrics import summary_markdown, summary_text

    tmp = runs["tmp"]
    import json

    summary = json.loads((tmp / "d" / "summary.json").read_text())
    text = summary_text(summary)
    assert max(len(line) for line in text.splitlines()[3:]) <= 100, text  # the per-rank block (headline lines wrap)
    assert all(f"rank {r}" in text for r in range(4))
    table = summary_markdown(summary)
    assert table.count("\n| ") == 1 + 4  # header and one row per rank


def test_the_run_plot_shows_memory_per_rank_beside_the_bf16_baseline(tmp_path):
    from agoq.train.metrics import memory_bars, plot_run

    ranks = [
        {"rank": r, "param_bytes": 4000, "param_count": 1000, "grad_buffer_bytes": 1100, "optimizer_bytes": 8000, "peak_saved_bytes": 500 + r}
        for r in range(2)
    ]
    summary = {
        "ranks": ranks,
        "baseline": {"ranks": {"0": {"peak_saved_bytes": 2000}, "1": {"peak_saved_bytes": 1500}}},
        "records": [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5, "val_loss": 4.7}],
    }
    bars = memory_bars(summary)
    assert bars[1]["run"] == {"parameters": 4000, "gradients": 1100, "optimizer": 8000, "saved activations": 501}
    # The baseline keeps fp32 gradients (4 bytes per parameter) and its measured saved activations.
    assert bars[1]["baseline"] == {"parameters": 4000, "gradients": 4000, "optimizer": 8000, "saved activations": 1500}
    path = plot_run(summary, tmp_path / "loss.png", "t")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_opening_lines_say_what_will_run_and_where(capsys, monkeypatch):
    from agoq.launch import run
    from agoq.launch.run import announce

    monkeypatch.setattr(run, "cpu_cores", lambda: 4)  # as many cores as processes: no notice
    cfg = load_config(None, ["--precision.compute_dtype=fp32", "--precision.quant_backend=compiled", "--train.out_dir=runs/x"])
    announce(cfg, "4 local processes")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "agoq train: model tiny (5.0 M parameters), 4 local processes: pp=2 x dp=2 (1f1b, 4 micro-batches per step)",
        "agoq train: activations agoq (int4/128, stage bits dbca), gradients int8, optimizer adamw, compute fp32, quantization compiled",
        "agoq train: 200 steps of 16 x 128 tokens, then one bf16-policy step to measure the baseline; "
        "output in runs/x/ (summary.json, summary.md, loss.png, metrics/, checkpoints/)",
    ]


def test_more_processes_than_cores_get_a_one_line_notice_in_the_opening_lines(capsys, monkeypatch):
    from agoq.launch import run

    monkeypatch.setattr(run, "cpu_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, ["--parallel.pp=2", "--parallel.dp=4", "--data.batch_size=32"])
    run.announce(cfg, "8 local processes")
    out = capsys.readouterr().out.splitlines()
    assert out[3:] == [
        "agoq train: 8 processes share 2 CPU cores here, so they take turns and each step takes longer than the layout suggests; "
        "a layout of fewer processes (parallel.pp x dp x tp) runs faster on this machine"
    ]
    assert cfg.world_size == 8  # a notice: the layout asked for is kept


def test_without_matplotlib_the_plot_is_skipped_not_the_run(tmp_path, monkeypatch):
    import sys

    from agoq.train.metrics import plot_run

    # What an install without the plot extra sees (its submodules too, which this process may hold).
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    summary = {"ranks": [], "baseline": None, "records": [{"step": 1, "loss": 5.0}]}
    assert plot_run(summary, tmp_path / "loss.png", "t") is None
    assert not (tmp_path / "loss.png").exists()


def test_the_bf16_baseline_is_measured_in_the_same_run_and_keeps_more(runs):
    # uniform4 ran with train.baseline=true: one more forward/backward under the bf16 policy.
    for stats in runs["results"][0]["uniform4"]["all_stats"]:
        assert stats["baseline_peak_saved_bytes"] > 2 * stats["peak_saved_bytes"] > 0, stats


def test_the_last_stage_handing_the_head_gradient_over_in_forward_trains_bit_for_bit_as_the_recompute(runs):
    # pp=2: the last stage computes the loss's gradients once, in forward, instead of recomputing
    # the logits in backward. The same bits, through the schedule's first step and the one after
    # an eval() (each runs the loss once more for torch's metadata pass).
    got, ref = runs["results"][0]["1f1b_agoq"], runs["results"][0]["1f1b_agoq_loss_recompute"]
    assert len(got["losses"]) == 3 and got["losses"] == ref["losses"]
    assert got["grad_norms"] == ref["grad_norms"]
    # The last stage keeps the hidden-state gradient in place of the hidden states: the same bytes
    # (the targets are the batch's own tensor, allocated before the step).
    assert got["all_stats"][2]["peak_saved_bytes"] == ref["all_stats"][2]["peak_saved_bytes"]


def test_a_skipped_step_is_left_out_of_the_summary_and_named_by_global_rank_and_stage(runs):
    import json
    import math

    from agoq.train.metrics import summary_markdown, summary_text

    ranks = runs["results"]
    summary = ranks[0]["nan_at_step3_summary"]
    records = summary["records"]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert math.isnan(records[2]["loss"]) and all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    # Rank 1 (stage 0, replica 1) saw NaN, and so did rank 3 (stage 1, replica 1), which its
    # activations reach; ranks 0 and 2, of the other replica, did not.
    seen = records[2]["nonfinite"]
    assert [(r["rank"], r["stages"], r["dp_rank"]) for r in seen] == [(1, [0], 1), (3, [1], 1)]
    stage0 = {n for n, _ in _stage_parameter_names(runs, 0)}
    stage1 = {n for n, _ in _stage_parameter_names(runs, 1)}
    assert seen[0]["parameter"] in stage0 and seen[1]["parameter"] in stage1, seen
    trained = [r["loss"] for r in records if not r["skipped"]]
    run = summary["run"]
    assert run["skipped_steps"] == 1 and run["train_loss_window"] == 5
    assert run["train_loss"] == pytest.approx(sum(trained) / 5) and run["final_loss"] == records[-1]["loss"]
    assert run["min_train_loss"] == min(trained)
    written = json.loads((runs["tmp"] / "k" / "summary.json").read_text())["run"]
    assert written["skipped_steps"] == 1 and written["train_loss"] == pytest.approx(run["train_loss"])
    headline = "(mean of the last 5 steps that trained; last"
    skipped = "; 1 of 6 steps skipped (a non-finite loss or gradient), their losses left out"
    for text in (summary_text(summary), summary_markdown(summary), (runs["tmp"] / "k" / "summary.md").read_text()):
        line = next(line for line in text.splitlines() if line.startswith("train loss"))
        assert line.startswith(f"train loss {run['train_loss']:.4f} {headline}") and skipped in line and "nan" not in line, line
    # One line, on rank 0 only, naming global ranks and stages; no rank warns on its own.
    expected = (
        f"agoq train: step 3 skipped, the weights left as they were: non-finite gradients on rank 1 (pipeline stage 0, dp replica 1) "
        f"in {seen[0]['parameter']}; rank 3 (pipeline stage 1, dp replica 1) in {seen[1]['parameter']}"
    )
    assert [line for line in ranks[0]["nan_at_step3_stderr"].splitlines() if "skipped" in line] == [expected]
    for r in ranks:
        assert not [w for w in r["nan_at_step3_warnings"] if "non-finite" in w], r["nan_at_step3_warnings"]
        if r is not ranks[0]:
            assert "skipped" not in r["nan_at_step3_stderr"]


def _stage_parameter_names(runs, stage: int):
    from agoq.activation import make_policy
    from agoq.models import Llama

    cfg = runs["cfgs"]["nan_at_step3"]
    ranges = [range(0, 2), range(2, 4)]
    return Llama(cfg.model_config(), make_policy("bf16"), layers=ranges[stage], embed=stage == 0, head=stage == 1).named_parameters()


def test_the_summary_of_a_run_whose_every_step_was_skipped_says_so():
    from agoq.train.metrics import summary_text
    from agoq.launch.run import run_figures

    records = [{"step": s, "loss": float("nan"), "skipped": True, "step_time_s": 1.0} for s in (1, 2)]
    run = run_figures(records, records, 256)
    assert (run["train_loss"], run["final_loss"], run["min_train_loss"], run["skipped_steps"]) == (None, None, None, 2)
    summary = {"description": "d", "run": run, "ranks": [], "records": records}
    assert summary_text(summary).splitlines()[1] == "train loss: none, every one of the 2 steps was skipped (a non-finite loss or gradient)"
    records[1].update(loss=4.0, skipped=False)
    run = run_figures(records, records, 256)
    assert (run["train_loss"], run["train_loss_window"], run["skipped_steps"]) == (4.0, 1, 1)
