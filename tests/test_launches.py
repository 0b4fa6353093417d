"""benchmarks/launches.py: the count of device operations and host syncs is exact on operators we can
enumerate, and the committed launches.json holds its rows and the launch budget AGoQ is held to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.launches import ALLOWED_SYNCS, HOST_READ_CATEGORY, LaunchCounter, hf_budget_pair, profiled_count
from tests._data import SMALL_MODEL, data_args
from tests._dist import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "launches.json"
SCALAR_READ = "scalar read (item/float/int/bool of a tensor)"


@torch.library.custom_op("agoq_launches_test::sin_cos", mutates_args=())
def _sin_cos(x: torch.Tensor) -> torch.Tensor:
    return x.sin().cos()


@_sin_cos.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _linear_step() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.randn(3, 8)


def test_a_linear_forward_and_backward_is_one_gemm_forward_and_two_kernels_backward():
    lin, x = _linear_step()
    grad = torch.ones(3, 4)
    with LaunchCounter().counting() as c:
        y = lin(x)  # addmm; the weight's transpose is a view
        y.backward(grad)  # the weight's gradient (mm) and the bias's (sum); x needs none
    assert {p: dict(n) for p, n in c.device_ops.items()} == {"forward": {"aten.addmm": 1}, "backward": {"aten.mm": 1, "aten.sum": 1}}
    assert c.totals()["host_syncs_total"] == 0


def test_item_and_tolist_are_one_host_sync_each_and_views_launch_nothing():
    x = torch.randn(4, 6)
    with LaunchCounter().counting() as c:
        x.view(24), x.t(), x[1:], x.unsqueeze(0).expand(2, 4, 6), torch.empty(5), x.detach()
        assert not c.device_ops
        x[0, 0].item()
        x.sum().tolist()  # the sum is one launch
    assert {p: dict(n) for p, n in c.device_ops.items()} == {"forward": {"aten.sum": 1}}
    assert dict(c.syncs["forward"]) == {SCALAR_READ: 1, HOST_READ_CATEGORY: 1}
    sites = {(op, site.split(":")[0]) for (_, _, op, site) in c.sync_sites}
    assert sites == {("aten._local_scalar_dense", "test_launches.py"), ("Tensor.tolist", "test_launches.py")}


def test_a_custom_op_counts_the_operators_it_runs_not_itself():
    x = torch.randn(5)
    with LaunchCounter().counting() as c:
        _sin_cos(x)
    assert dict(c.device_ops["forward"]) == {"aten.sin": 1, "aten.cos": 1} and not c.opaque


def test_a_triton_launch_is_one_device_op_and_nothing_inside_it_counts():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not bool(triton.knobs.runtime.interpret):
        pytest.skip("Triton runs on CPU tensors only under TRITON_INTERPRET=1")

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(40, device=device)
    with LaunchCounter().counting() as c:
        add_one[(3,)](x, 40, BLOCK=16)
    assert {p: dict(n) for p, n in c.device_ops.items()} == {"forward": {"triton:add_one": 1}}
    assert c.totals()["host_syncs_total"] == 0 and torch.equal(x, torch.ones(40, device=device))


def test_the_profiled_count_sees_a_compiled_graph_as_its_kernels_and_eager_ops_as_the_dispatch_mode_does():
    from agoq.quant import backend

    if not backend.compiler_available():
        pytest.skip("no C++ compiler for torch.compile")
    import torch._inductor.config

    lin, x = _linear_step()
    grad = torch.ones(3, 4)
    eager = profiled_count(lambda: lin(x).backward(grad))
    assert eager["device_ops_total"] == 3 and dict(eager["top_ops"]) == {"aten.addmm": 1, "aten.mm": 1, "aten.sum": 1}
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        fused = torch.compile(lambda v: (v.sin() + 1).cos().sum(), fullgraph=True)
        fused(x)
        graph = profiled_count(lambda: fused(x))
        # One kernel, no scalar read; the item() after it is one.
        read = profiled_count(lambda: fused(x).item())
    assert graph["inductor_kernels"] == graph["device_ops_total"] >= 1 and graph["host_syncs_total"] == 0
    assert read["host_syncs_total"] == 1 and read["sync_sources"][0]["op"] == "aten._local_scalar_dense"
    # A device-side assert reads its flag on a CPU, never on a GPU: not a host sync.
    assert profiled_count(lambda: torch._assert_async(torch.tensor(True), "never"))["host_syncs_total"] == 0


def _count_two_steps(rank: int, world: int, out_dir: str, extra: list[str]) -> list[dict]:
    from agoq.launch.config import load_config
    from agoq.launch.components import build_run
    from benchmarks.launches import count_trainer_step

    args = [*SMALL_MODEL, *data_args(), "--parallel.pp=1", "--parallel.dp=1", "--parallel.microbatches=2", "--data.batch_size=4"]
    args += ["--precision.compute_dtype=fp32", "--precision.quant_backend=torch", "--train.eval_every=0", "--train.baseline=false"]
    args += ["--checkpoint.every=0", "--checkpoint.resume=false", f"--train.out_dir={out_dir}", *extra]
    trainer = build_run(load_config(None, args)).trainer
    first = count_trainer_step(trainer, warmup=1)["summary"]
    return [first, count_trainer_step(trainer, warmup=0)["summary"]]


@pytest.mark.parametrize("precision", [["--precision.activations=bf16", "--precision.gradients=fp32"], []], ids=["bf16-policy", "agoq"])
def test_a_trainer_step_counts_the_same_every_step_and_reads_the_host_once_to_agree(tmp_path, precision):
    second, third = run_distributed(_count_two_steps, 1, str(tmp_path), precision)[0]
    assert second["device_ops"] == third["device_ops"] and second["host_syncs"] == third["host_syncs"]
    assert {"forward", "backward", "gradient_sync", "agreement", "optimizer"} <= set(second["device_ops"])
    assert sum(second["device_ops"].values()) == second["device_ops_total"]
    # The step's one agreement: a single all-reduce of norm, non-finite flag and loss, read once.
    agreement = [s for s in second["sync_sources"] if s["phase"] == "agreement"]
    assert [(s["op"], s["source"].split(":")[0], s["count"]) for s in agreement] == [("Tensor.tolist", "agoq/train/trainer.py", 1)]
    assert second["collectives"] >= 1 and second["triton_launches"] == 0


# ---- the committed result


def _result() -> dict:
    return json.loads(RESULT.read_text())["results"]


def _row(size: str, config: str, pp: int = 1, dp: int = 1) -> dict:
    return next(r for r in _result()["trainer"] if (r["size"], r["config"], r["pp"], r["dp"]) == (size, config, pp, dp))


def _hf(variant: str) -> dict:
    return next(r for r in _result()["hf"] if r["variant"] == variant)


def test_the_committed_result_has_every_row_phase_and_sync_source():
    r = _result()
    assert {(x["size"], x["config"], x["pp"], x["dp"]) for x in r["trainer"]} >= {
        *((s, c, 1, 1) for s in ("tiny", "1b-half-2l", "1b-2l", "1b-4l") for c in ("bf16", "agoq")),
        ("tiny", "agoq", 1, 2),
        ("tiny", "agoq", 2, 2),
        ("tiny", "agoq-triton", 1, 1),
        *((s, c, 1, 1) for s in ("1b-half-2l", "1b-2l") for c in ("agoq-triton", "bf16-triton")),
    }
    for row in r["trainer"]:
        assert {"forward", "backward", "gradient_sync", "optimizer"} <= set(row["device_ops"])
        assert row["device_ops_total"] == max(sum(rank["device_ops"].values()) for rank in row["ranks"])
        assert len(row["ranks"]) == row["pp"] * row["dp"] and len(row["top_ops"]) <= 10
        for s in row["sync_sources_all_ranks"]:
            assert s["category"] in r["setup"]["host_sync_categories"] and s["source"] != "?"
    assert _row("1b-2l", "agoq")["model"]["hidden"] == 2 * _row("1b-half-2l", "agoq")["model"]["hidden"]
    assert _row("1b-4l", "agoq")["model"]["n_layers"] == 2 * _row("1b-2l", "agoq")["model"]["n_layers"]
    assert {h["variant"] for h in r["hf"]} == {"unpatched", "default", "torch", "triton"}
    # The default path as it runs on a CPU, compiled, beside the unpatched model profiled alike.
    assert _hf("default")["profiled"]["inductor_kernels"] > 0 and _hf("unpatched")["profiled"]["inductor_kernels"] == 0
    assert _hf("triton")["triton_launches"] > 0 and _hf("unpatched")["triton_launches"] == 0


# ---- the budget. Lines src/ does not meet yet are strict xfails: the mark comes off as each is met.

FOLDS_PER_PIECE = (
    "the CPU formulas fold, read back and step the optimizer a cache-sized piece at a time, so their launches grow with the "
    "parameters; the GPU's kernels at a GPU's sizes are the -triton rows, held to the budget below"
)


@pytest.mark.xfail(strict=True, reason=FOLDS_PER_PIECE)
def test_agoq_device_ops_change_at_most_10_percent_when_hidden_doubles():
    half, full = _row("1b-half-2l", "agoq"), _row("1b-2l", "agoq")
    assert abs(full["device_ops_total"] / half["device_ops_total"] - 1) <= 0.10


@pytest.mark.xfail(strict=True, reason=FOLDS_PER_PIECE)
@pytest.mark.parametrize("size", ["1b-2l", "1b-4l"])
def test_agoq_device_ops_at_most_one_and_a_half_times_the_bf16_policys(size):
    assert _row(size, "agoq")["device_ops_total"] <= 1.5 * _row(size, "bf16")["device_ops_total"]


# The GPU's figures: the Triton kernels (interpreted) at a GPU's sizes, against the bf16 policy at a GPU's sizes.
def test_on_the_gpus_path_agoq_device_ops_change_at_most_10_percent_when_hidden_doubles():
    half, full = _row("1b-half-2l", "agoq-triton"), _row("1b-2l", "agoq-triton")
    assert full["model"]["hidden"] == 2 * half["model"]["hidden"] and full["model"]["vocab_size"] == half["model"]["vocab_size"]
    assert abs(full["device_ops_total"] / half["device_ops_total"] - 1) <= 0.10


def test_on_the_gpus_path_agoq_device_ops_are_at_most_one_and_a_half_times_the_bf16_policys():
    assert _row("1b-2l", "agoq-triton")["device_ops_total"] <= 1.5 * _row("1b-2l", "bf16-triton")["device_ops_total"]
    launches = {c: sum(r["triton_launches"] for r in _row("1b-2l", c)["ranks"]) for c in ("agoq-triton", "bf16-triton")}
    assert launches["agoq-triton"] > 0 and launches["bf16-triton"] == 0


@pytest.mark.parametrize("pp", [1, 2])
def test_agoq_train_never_waits_for_the_device_in_forward_backward_or_gradient_sync(pp):
    row = _row("tiny", "agoq", pp, 2)
    syncs = row["host_syncs"]
    assert (syncs.get("forward", 0), syncs.get("backward", 0)) == (0, 0)
    # Gradient sync reads nothing but the named agreement on non-finite gradients.
    assert syncs.get("gradient_sync", 0) <= 1
    sources = {s["source"].rsplit(" ", 1)[-1] for s in row["sync_sources_all_ranks"]}
    assert sources <= set(ALLOWED_SYNCS), sources


@pytest.mark.parametrize("pp", [1, 2])
def test_agoq_train_waits_at_most_twice_a_step_to_agree_on_gradients_and_loss(pp):
    assert _row("tiny", "agoq", pp, 2)["host_syncs_total"] <= 2


# The default path on a CPU is its compiled graphs (profiled); on a GPU it is the Triton path.
@pytest.mark.parametrize("variant", ["default", "triton"])
def test_patched_hf_launches_at_most_one_and_a_half_times_unpatched(variant):
    patched, unpatched, _ = hf_budget_pair(_result()["hf"], variant)
    assert patched["device_ops_total"] <= 1.5 * unpatched["device_ops_total"]


@pytest.mark.parametrize("variant", ["default", "triton"])
def test_patched_hf_waits_for_the_device_no_more_than_unpatched(variant):
    patched, unpatched, _ = hf_budget_pair(_result()["hf"], variant)
    assert patched["host_syncs_total"] <= unpatched["host_syncs_total"]
