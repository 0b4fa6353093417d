"""The 8-bit gradient buffer: layout, accumulation bound, memory, reading back, non-finite handling,
and (on a real gloo group of 3 ranks) bucketed async reduction, ZeRO-1 shards, DDP and FSDP2."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from agoq.gradient import CommCounter, QuantGradBuffer, QuantHookState, quantized_allreduce_hook
from agoq.quant import dequantize, quantize
from tests._dist import run_distributed

BLOCK = 256


def _mlp(seed: int = 0, dims: tuple[int, ...] = (24, 300, 70, 5)) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


# ---- single process ---------------------------------------------------------------------------


def test_layout_aligns_parameters_to_blocks_and_splits_at_block_boundaries():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 3000, 700)]
    buf = QuantGradBuffer(params, bucket_numel=2048)
    # Reverse order: 700 at 0 (fills 768), 3000 split 1280 | 1720, then 10 after it at 1792.
    assert [(s.bucket, s.offset, s.param_offset, s.numel) for s in buf.segments[2]] == [(0, 0, 0, 700)]
    assert [(s.bucket, s.offset, s.param_offset, s.numel) for s in buf.segments[1]] == [(0, 768, 0, 1280), (1, 0, 1280, 1720)]
    assert [(s.bucket, s.offset, s.param_offset, s.numel) for s in buf.segments[0]] == [(1, 1792, 0, 10)]
    # Two buckets of 2048 one-byte codes plus 8 fp32 scales each.
    assert buf.storage_bytes == 2 * (2048 + 8 * 4)
    assert buf.memory_stats()["fp32_grad_bytes"] == 4 * 3710


def test_first_micro_batch_only_quantizes_and_k_micro_batches_stay_within_the_summed_half_steps():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 300)]
    k = 6
    buf = QuantGradBuffer(params, microbatches=k)
    exact = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    bound = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    for j in range(k):
        for i, p in enumerate(params):
            # Gradients of changing magnitude and a bf16 one: the block scales move between folds.
            g = torch.randn(p.numel()) * (1 + j)
            if i == 1:
                g = g.bfloat16()
            buf.fold(i, g)
            exact[i] += g.double()
            if j == 0:
                assert torch.equal(buf.grad(i), dequantize(quantize(g, "int8/256"), torch.float32))
            seg = buf.segments[i][0]
            scales = buf.buckets[seg.bucket].flat().scales[seg.offset // BLOCK :][: -(-p.numel() // BLOCK)]
            bound[i] += (scales / 2).repeat_interleave(BLOCK)[: p.numel()].double()
    for i in range(2):
        err = (buf.grad(i).double().reshape(-1) - exact[i]).abs()
        assert (err <= bound[i] * (1 + 1e-5) + 1e-6).all()
        # Not vacuous: the bound is approached (errors add up over re-quantizations).
        assert (err / bound[i]).max() > 0.3


def test_hooks_free_every_gradient_so_peak_full_precision_gradient_memory_is_one_parameter():
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak_grad_bytes(with_buffer: bool) -> tuple[int, QuantGradBuffer | None]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(6)])
        buf = QuantGradBuffer(model, bucket_numel=2 * 256 * 256) if with_buffer else None
        tracker = MemTracker()
        tracker.track_external(model)
        with warnings.catch_warnings(), tracker:
            warnings.simplefilter("ignore")  # MemTracker warns about the grads we set to None
            model(torch.randn(8, 256)).square().sum().backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        from torch.distributed._tools.mem_tracker import _MemRefType

        if with_buffer:
            assert all(p.grad is None for p in model.parameters())
        return peak[_MemRefType.GRAD], buf

    plain, _ = peak_grad_bytes(False)
    quant, buf = peak_grad_bytes(True)
    one = 256 * 256 * 4
    # At the moment of peak memory, plain backward holds 5 of the 6 gradients (MemTracker's
    # snapshot); the buffer holds one parameter's, folded and freed before the next one exists.
    assert plain >= 5 * one
    assert quant == one
    assert buf.peak_fp_grad_bytes == one
    assert buf.storage_bytes == 3 * (2 * 256 * 256) * (1 + 4 / BLOCK)


def test_step_runs_the_optimizer_bucket_by_bucket_exactly_like_one_step_on_dequantized_grads():
    model = _mlp()
    ref = copy.deepcopy(model)
    buf = QuantGradBuffer(model, bucket_numel=1024)
    assert len(buf.buckets) > 3
    torch.manual_seed(1)
    model(torch.randn(16, 24)).square().mean().backward()
    assert buf.finish()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        q.grad = buf.grad(name).clone()
    norm = torch.cat([q.grad.reshape(-1) for q in ref.parameters()]).norm()
    assert abs(buf.grad_norm() - float(norm)) <= 1e-6 * float(norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    buf.step(opt, grad_scale=0.5)
    for q in ref.parameters():
        q.grad.mul_(0.5)
    opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None
    assert all(s["step"] == 1 for s in opt.state.values())


def test_more_backward_passes_than_microbatches_is_an_error_that_says_what_to_do():
    model = _mlp()
    buf = QuantGradBuffer(model, microbatches=1)
    model(torch.randn(2, 24)).sum().backward()
    with pytest.raises(RuntimeError, match="microbatches=1.*zero_grad"):
        model(torch.randn(2, 24)).sum().backward()
    buf.finish()
    with pytest.raises(RuntimeError, match="'0.bias' received a gradient after.*finish\\(\\) already ran.*zero_grad"):
        buf.fold("0.bias", torch.zeros(300))
    buf.zero_grad()
    buf.fold("0.bias", torch.full((300,), 127.0))  # scale 1: exactly representable
    assert torch.equal(buf.grad("0.bias"), torch.full((300,), 127.0))
    with pytest.raises(ValueError, match="bucket_numel or bucket_bytes"):
        QuantGradBuffer(model, bucket_numel=10, bucket_bytes=10)


def test_nonfinite_gradient_skips_the_step_resets_the_buffer_and_names_the_parameter():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    buf = QuantGradBuffer(model, microbatches=2)
    model(torch.randn(4, 24)).sum().backward()
    model[2].weight.register_hook(lambda g: g * float("inf"))
    model(torch.randn(4, 24)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"'2\.weight' on rank 0.*skipping"):
        buf.step(opt)
    assert buf.skipped_steps == 1
    assert buf.grad_norm() == 0.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


# ---- a gloo group of 3 ranks ------------------------------------------------------------------


def _microbatch(rank: int, j: int) -> torch.Tensor:
    return torch.randn(8, 24, generator=torch.Generator().manual_seed(1000 * rank + j))


def _local_fp32_grads(model: torch.nn.Module, rank: int, k: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """fp32 accumulation over k micro-batches, and each parameter's largest partial-sum magnitude."""
    acc: dict[str, torch.Tensor] = {}
    peak: dict[str, float] = {}
    for j in range(k):
        model.zero_grad()
        model(_microbatch(rank, j)).square().mean().backward()
        for n, p in model.named_parameters():
            acc[n] = acc.get(n, 0) + p.grad
            peak[n] = max(peak.get(n, 0.0), float(acc[n].abs().max()))
    return acc, peak


def _group_checks(rank: int, world: int) -> dict:
    out: dict = {}
    k = 2

    # Bucketed async reduction during backward == the synchronous path, bit for bit, and within a
    # stated bound of the fp32 average of fp32-accumulated gradients.
    models = [_mlp() for _ in range(3)]
    seen_states: list[list[str]] = []
    # Registered before the buffer's own hook, so it sees the states just before the gradient that
    # backward produces last (the first layer's weight) is folded in.
    models[0][0].weight.register_post_accumulate_grad_hook(lambda p: seen_states.append(bufs[0].bucket_states()))
    bufs = [
        QuantGradBuffer(models[0], bucket_numel=1024, microbatches=k, overlap=True),
        QuantGradBuffer(models[1], bucket_numel=1024, microbatches=k, overlap=False),
    ]
    for j in range(k):
        for m in models[:2]:
            m(_microbatch(rank, j)).square().mean().backward()
    assert all(b.finish() for b in bufs)
    acc, peak = _local_fp32_grads(models[2], rank, k)
    out["overlap_equals_sync"] = all(torch.equal(bufs[0].grad(n), bufs[1].grad(n)) for n in bufs[0].names)
    out["states_at_last_grad"] = seen_states[-1]
    out["states_at_first_microbatch"] = seen_states[0]
    out["buckets"] = len(bufs[0].buckets)
    out["bound_ratio"] = {}
    for n in bufs[0].names:
        avg = acc[n].clone()
        dist.all_reduce(avg)
        avg /= world
        gmax = torch.tensor([peak[n]])
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        # k re-quantizations of partial sums on every rank (averaged), plus the output's.
        bound = (k * float(gmax) + float(avg.abs().max())) / 254 * 1.01
        out["bound_ratio"][n] = float((bufs[0].grad(n) - avg).abs().max()) / bound

    # ZeRO-1: reduce-scatter shards equal slices of the fp32 average of the local 8-bit buffers.
    model = _mlp()
    rs = QuantGradBuffer(model, bucket_numel=1024, collective="reduce_scatter", overlap=False)
    model(_microbatch(rank, 0)).square().mean().backward()
    local = [dequantize(_bucket_qtensor(b, rs.fmt)) for b in rs.buckets]
    assert rs.finish()
    ok = True
    for (b, start, end, shard), vals in zip(rs.local_shards(), local):
        gathered = [torch.empty_like(vals) for _ in range(world)]
        dist.all_gather(gathered, vals)
        total = gathered[0].clone()
        for g in gathered[1:]:
            total += g
        ok &= torch.equal(shard[: end - start], (total / world)[start:end])
    out["shards_equal"] = bool(ok)

    # Non-finite on rank 1 only: every rank skips the same step with a warning naming it, then a
    # clean step goes through.
    model = _mlp()
    buf = QuantGradBuffer(model, bucket_numel=1024)
    if rank == 1:
        handle = model[2].weight.register_hook(lambda g: g * float("nan"))
    model(_microbatch(rank, 0)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = buf.finish()
    out["nonfinite"] = {"ok": ok, "warnings": [str(w.message) for w in caught], "norm_after": buf.grad_norm()}
    if rank == 1:
        handle.remove()
    buf.zero_grad()
    model(_microbatch(rank, 0)).sum().backward()
    out["nonfinite"]["next_ok"] = buf.finish() and buf.grad_norm() > 0

    # DDP with the 8-bit hook against DDP without it, three iterations (DDP rebuilds its buckets
    # after the first).
    counter = CommCounter()
    plain = torch.nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=0.004)
    hooked = torch.nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=0.004)
    hooked.register_comm_hook(QuantHookState(counter=counter), quantized_allreduce_hook)
    local = _mlp()
    ddp = []
    for it in range(3):
        calls = counter.calls.get("all_reduce_8bit", 0)
        for m in (plain, hooked, local):
            m.zero_grad()
            m(_microbatch(rank, 10 + it)).square().mean().backward()
        gmax = torch.tensor([max(float(p.grad.abs().max()) for p in local.parameters())])
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        errs = [float((a.grad - b.grad).abs().max()) for a, b in zip(plain.parameters(), hooked.parameters())]
        # Blocks of a DDP bucket mix parameters, so the per-element bound uses the bucket-wide
        # largest local gradient: W input half-steps / W plus one output half-step.
        ddp.append({"max_err": max(errs), "bound": 2 * float(gmax) / 254, "buckets": counter.calls["all_reduce_8bit"] - calls})
    out["ddp"] = {"iters": ddp, "bytes": counter.bytes("all_reduce_8bit"), "calls": counter.calls.get("all_reduce_8bit", 0)}

    # Pipeline parallel: each rank is one stage of a 1F1B schedule over 4 micro-batches and folds
    # its own parameters (dp group of one rank); the 8-bit sums track the fp32 gradients.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dp_groups = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(world)]
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    whole = copy.deepcopy(torch.nn.Sequential(*layers))
    torch.nn.functional.mse_loss(whole(x), y, reduction="sum").backward()
    stage_module = layers[rank]
    buf = QuantGradBuffer(stage_module, microbatches=4, group=dp_groups[rank])
    schedule = Schedule1F1B(
        PipelineStage(stage_module, rank, world, torch.device("cpu")),
        n_microbatches=4,
        loss_fn=lambda out, target: torch.nn.functional.mse_loss(out, target, reduction="sum"),
        scale_grads=False,
    )
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    assert buf.finish()
    out["pipeline"] = {
        "grads_freed": all(p.grad is None for p in stage_module.parameters()),
        # 4 re-quantized partial sums: at most 4 half-steps of max/127 when the partial sums stay
        # below the final maximum (they do for these fixed seeds); the test allows 5.
        "max_rel_err": max(float((buf.grad(n) - p.grad).abs().max() / p.grad.abs().max()) for n, p in zip(buf.names, whole[rank].parameters())),
    }

    # FSDP2 with the 8-bit reduce-scatter against FSDP2 without it.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from agoq.gradient import use_quantized_reduce_scatter

    mesh = init_device_mesh("cpu", (world,))
    counter = CommCounter()
    sharded = []
    for quantized in (False, True):
        m = _mlp()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        if quantized:
            out["fsdp_modules"] = use_quantized_reduce_scatter(m, counter=counter)
        m(_microbatch(rank, 20)).square().mean().backward()
        sharded.append([p.grad.to_local().clone() for p in m.parameters()])
    local = _mlp()
    local(_microbatch(rank, 20)).square().mean().backward()
    gmax = torch.tensor([max(float(p.grad.abs().max()) for p in local.parameters())])
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
    out["fsdp"] = {
        "max_err": max(float((a - b).abs().max()) for a, b in zip(*sharded) if a.numel()),
        "bound": 2 * float(gmax) / 254,
        "bytes": counter.bytes("reduce_scatter_8bit"),
    }
    return out


def _bucket_qtensor(bucket, fmt):
    assert bucket.layout.fmt == fmt
    return bucket.flat()


@pytest.fixture(scope="module")
def group3() -> list[dict]:
    return run_distributed(_group_checks, 3)


def test_buckets_reduce_during_backward_and_equal_the_synchronous_path(group3):
    for r in group3:
        assert r["buckets"] >= 4
        assert r["overlap_equals_sync"]
        # During the first micro-batch nothing is sent. In the last one, before backward produces
        # its last gradient (the first layer's weight, spread over the last buckets), the earlier
        # buckets are reduced already ('done'), one has its all-gather in flight ('reducing'), one
        # its all-to-all ('launched'): no more than two buckets' communication buffers exist at once.
        assert set(r["states_at_first_microbatch"]) == {"open"}
        states = r["states_at_last_grad"]
        done, opened = states.count("done"), states.count("open")
        assert done >= 1 and opened >= 1
        assert states == ["done"] * done + ["reducing", "launched"] + ["open"] * opened, states


def test_k_micro_batch_average_stays_within_the_stated_bound_of_fp32(group3):
    for r in group3:
        ratios = r["bound_ratio"]
        assert max(ratios.values()) <= 1.0, ratios
        assert max(ratios.values()) > 0.05, ratios


def test_reduce_scatter_buffer_shards_equal_the_fp32_average(group3):
    assert all(r["shards_equal"] for r in group3)


def test_nonfinite_on_one_rank_makes_every_rank_skip_with_the_parameter_named(group3):
    for r in group3:
        nf = r["nonfinite"]
        assert nf["ok"] is False and nf["norm_after"] == 0.0
        assert len(nf["warnings"]) == 1 and "'2.weight' on rank 1" in nf["warnings"][0]
        assert nf["next_ok"]


def test_ddp_comm_hook_matches_ddp_without_it_within_the_bound(group3):
    for r in group3:
        for it in r["ddp"]["iters"]:
            assert 0 < it["max_err"] <= it["bound"], it
        # One 8-bit all-reduce per DDP bucket; after DDP rebuilds its buckets there are several
        # per iteration, so buckets were pipelined through the hook.
        assert [it["buckets"] for it in r["ddp"]["iters"]][1:] == [r["ddp"]["iters"][1]["buckets"]] * 2
        assert r["ddp"]["iters"][1]["buckets"] >= 2 and r["ddp"]["bytes"] > 0


def test_fsdp2_custom_reduce_scatter_matches_fsdp2_within_the_bound(group3):
    for r in group3:
        assert r["fsdp_modules"] == 4
        assert 0 < r["fsdp"]["max_err"] <= r["fsdp"]["bound"], r["fsdp"]
        assert r["fsdp"]["bytes"] > 0


def test_pipeline_stage_buffers_fold_every_micro_batch_of_a_1f1b_schedule(group3):
    for r in group3:
        assert r["pipeline"]["grads_freed"]
        assert 0 < r["pipeline"]["max_rel_err"] <= 5 / 254, r["pipeline"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_and_sum_of_squares_need_no_tensor_sized_temporaries(dtype):
    from agoq.gradient.buffer import all_finite, sum_of_squares

    big = torch.full((4096,), torch.finfo(dtype).max, dtype=dtype)  # squares overflow fp32, not fp64
    assert all_finite(big)
    assert float(sum_of_squares(big)) == pytest.approx(4096 * float(torch.finfo(dtype).max) ** 2, rel=1e-12)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = big.clone()
        t[1234] = bad
        assert not all_finite(t)


def test_step_optimizer_steps_after_groups_of_bounded_bytes_and_reads_each_gradient_only_when_handed_over() -> None:
    from agoq.gradient.sync import GradientSync

    class Units(GradientSync):
        sizes = {0: 300, 1: 500, 2: 2000, 3: 100, 4: 100}  # values per unit
        reads: list[int] = []

        def units(self):
            return list(self.sizes.items())

        def read(self, unit):
            self.reads.append(unit)
            return torch.ones(self.sizes[unit])

    class Optimizer:
        events: list[tuple] = []

        def set_grad(self, unit, grad):
            assert sync.reads == list(range(unit + 1))  # nothing read ahead of what is handed over
            self.events.append((unit, float(grad[0])))

        def step(self):
            self.events.append(("step",))

    sync = Units()
    assert list(sync.unit_groups(4 * 1000)) == [[0, 1], [2], [3, 4]]  # the 2000-value unit alone, the rest together
    sync.step_optimizer(Optimizer(), scale=0.5, group_bytes=4 * 1000)  # 1000 fp32 values per group
    assert Optimizer.events == [(0, 0.5), (1, 0.5), ("step",), (2, 0.5), ("step",), (3, 0.5), (4, 0.5), ("step",)]
    sync.reads.clear()
    Optimizer.events.clear()
    sync.step_optimizer(Optimizer())  # no bound: one group, one step
    assert Optimizer.events == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), ("step",)]


def test_a_unit_larger_than_a_group_is_read_and_stepped_a_slice_at_a_time_where_the_optimizer_can() -> None:
    from agoq.gradient.sync import GradientSync

    class Units(GradientSync):
        sizes = {0: 300, 1: 2100, 2: 100}
        slice_quantum = 64
        reads: list[tuple] = []

        def units(self):
            return list(self.sizes.items())

        def read(self, unit):
            self.reads.append((unit,))
            return torch.ones(self.sizes[unit])

        def read_slice(self, unit, start, end):
            self.reads.append((unit, start, end))
            return torch.ones(end - start)

    class SlicingOptimizer:
        steps_slices = True
        events: list[tuple] = []

        def set_grad(self, unit, grad):
            self.events.append((unit, float(grad[0])))

        def step(self):
            self.events.append(("step",))

        def step_slices(self, unit, slices):
            for start, end, grad in slices:  # each slice read only as it is used
                assert Units.reads[-1] == (unit, start, end) and float(grad[0]) == 0.5
                self.events.append((unit, start, end))
            self.events.append(("stepped", unit))

    Units().step_optimizer(SlicingOptimizer(), scale=0.5, group_bytes=4 * 1000)  # 1000 values: 960 in whole 64-value quanta
    assert SlicingOptimizer.events == [(0, 0.5), ("step",), (1, 0, 960), (1, 960, 1920), (1, 1920, 2100), ("stepped", 1), (2, 0.5), ("step",)]
    assert (1,) not in Units.reads


def test_sliced_optimizer_steps_from_the_8bit_buffer_match_whole_tensor_steps_exactly() -> None:
    from agoq.gradient.build import make_gradient_sync
    from agoq.launch.config import OptimSection
    from agoq.train.optim import MasterWeightOptimizer

    results = []
    for group_bytes in (None, 4 * 1024):  # 1024 values a slice: the 300 x 70 weight goes in 21 slices
        model = _mlp()
        params = list(model.named_parameters())
        sync = make_gradient_sync("int8", params, None, torch.device("cpu"), microbatches=1, block=256)
        opt = MasterWeightOptimizer(params, OptimSection(lr=1e-2))
        sliced: list[int] = []
        step_slices = opt.step_slices
        opt.step_slices = lambda unit, slices: (sliced.append(unit), step_slices(unit, slices))  # type: ignore[method-assign]
        for step in range(2):
            sync.start_step()
            torch.manual_seed(step)
            model(torch.randn(8, 24)).square().mean().backward()
            assert sync.reduce() == 0
            sync.step_optimizer(opt, 0.5, group_bytes)
            sync.finish_step()
        names = [n for n, _ in params]
        assert sorted({names[u] for u in sliced}) == ([] if group_bytes is None else ["0.weight", "2.weight"])
        results.append([p.detach().clone() for p in model.parameters()])
    for whole, by_slices in zip(*results):
        assert torch.equal(whole, by_slices)


def test_grad_slice_reads_a_range_of_one_parameter_across_buckets() -> None:
    model = _mlp()
    buf = QuantGradBuffer(model, microbatches=1, bucket_numel=5000)  # the 300 x 70 weight spans buckets
    model(torch.randn(8, 24)).square().mean().backward()
    buf.finish()
    name = "2.weight"
    assert len(buf.layout.segments[buf.names.index(name)]) > 1
    whole = buf.grad(name).reshape(-1)
    for start, end in [(0, 256), (4864, 9000), (20736, 21000), (0, 21000)]:
        assert torch.equal(buf.grad_slice(name, start, end), whole[start:end])
    with pytest.raises(ValueError, match="must start on a block of 256 values"):
        buf.grad_slice(name, 100, 400)
    with pytest.raises(ValueError, match="lie inside it"):
        buf.grad_slice(name, 0, 21001)


def test_bucket_storage_lives_on_the_parameters_device():
    # Buckets were allocated on the CPU whatever the parameters' device: on a GPU the 8-bit
    # buffer then sat in host memory and the collective got CPU tensors. The meta device stands in.
    buf = QuantGradBuffer(torch.nn.Linear(300, 70, device="meta"), microbatches=1)
    assert buf.buckets and all(b.wire.device.type == "meta" for b in buf.buckets)
