"""Checkpoints: exact resume, atomic publish, pruning, clear errors (one process and pp=2 x dp=2)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.models.config import LlamaConfig
from agoq.models.llama import Llama
from agoq.train import checkpoint as ckpt
from agoq.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from tests._dist import run_distributed

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)
SEQ, BATCH = 16, 2
DATA = torch.randint(0, CFG.vocab_size, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn from the global RNG on purpose: resuming is only exact if the RNG state round-trips.
    rows = DATA[torch.randint(0, DATA.shape[0], (BATCH,))]
    return rows[:, :-1], rows[:, 1:]


class _Run:
    """A tiny LLaMA (or one pipeline stage of it) with AdamW, trained on random rows of DATA."""

    def __init__(self, seed: int, layers: range | None = None) -> None:
        self.model = Llama(CFG, layers=layers)
        self.model.reset_parameters(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(self) -> float:
        x, y = _batch()
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def moments(self) -> dict[str, torch.Tensor]:
        names = {p: n for n, p in self.model.named_parameters()}
        return {names[p]: s["exp_avg"].clone() for p, s in self.opt.state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert info.value.__cause__ is None and info.value.__suppress_context__ or info.value.__context__ is None
    return msg


# --------------------------------------------------------------------------------- one process


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    torch.manual_seed(1)
    a = _Run(seed=0)
    for _ in range(3):
        a.step()
    path = save_checkpoint(tmp_path, 3, a.model, a.opt, {"rng": capture_rng_state(), "sampler": {"pos": 3}})
    assert path == tmp_path / "step_000003" and (tmp_path / "latest").read_text() == "step_000003\n"
    losses_a = [a.step() for _ in range(4)]

    torch.manual_seed(99)
    b = _Run(seed=5)  # different weights and RNG: everything must come from the checkpoint
    step, extra = load_checkpoint(tmp_path, b.model, b.opt)
    assert step == 3 and extra["sampler"] == {"pos": 3}
    restore_rng_state(extra["rng"])
    losses_b = [b.step() for _ in range(4)]
    assert losses_a == losses_b
    assert _same(a.params(), b.params()) and _same(a.moments(), b.moments())


def test_saving_before_the_first_step_does_not_touch_the_optimizer(tmp_path):
    torch.manual_seed(1)
    a = _Run(seed=0)
    save_checkpoint(tmp_path, 0, a.model, a.opt, {"rng": capture_rng_state()})
    assert not a.opt.state  # torch's helper would have made a zero step (AdamW step count 1)
    losses = [a.step() for _ in range(2)]
    b = _Run(seed=5)
    _, extra = load_checkpoint(tmp_path, b.model, b.opt)
    assert not b.opt.state
    restore_rng_state(extra["rng"])
    assert [b.step() for _ in range(2)] == losses and _same(a.moments(), b.moments())


def test_pipeline_chunks_of_one_rank_load_by_global_name(tmp_path):
    full = _Run(seed=0)
    full.step()
    save_checkpoint(tmp_path, 1, full.model, full.opt, {})
    chunks = [Llama(CFG, layers=range(0, 1)), Llama(CFG, layers=range(3, 4))]
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-2, weight_decay=0.1)
    # Two non-adjacent chunks (as in interleaved 1F1B) are a subset of the saved keys: a layout
    # change, which must be refused rather than loaded partially.
    msg = _error(load_checkpoint, tmp_path, chunks, opt)
    assert "different parallel layout" in msg and "rank 0 held 39 model keys" in msg and "holds 21" in msg

    chunks = [Llama(CFG, layers=range(0, 2)), Llama(CFG, layers=range(2, 4))]
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-2, weight_decay=0.1)
    load_checkpoint(tmp_path, chunks, opt)
    got = {n: p for c in chunks for n, p in c.named_parameters()}
    assert _same(full.params(), {n: p.detach() for n, p in got.items()})
    names = {p: n for n, p in got.items()}
    assert _same(full.moments(), {names[p]: s["exp_avg"] for p, s in opt.state.items()})


class _ParamView(nn.Module):
    """Parameters of a bf16 model under global names, not registered (like a trainer's stage view)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self._named = named

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return {n: p.detach() for n, p in self._named}

    @torch.no_grad()
    def load_state_dict(self, state, strict=True, assign=False):  # type: ignore[override]
        for n, p in self._named:
            p.copy_(state[n])


class _MasterAdamW:
    """AdamW on fp32 master copies of bf16 weights; state_dict keyed by global parameter names."""

    def __init__(self, model: nn.Module) -> None:
        self.named = list(model.named_parameters())
        self.masters = [p.detach().float().clone().requires_grad_(True) for _, p in self.named]
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-2, weight_decay=0.1)

    @torch.no_grad()
    def step(self) -> None:
        for (_, p), m in zip(self.named, self.masters):
            m.grad, p.grad = p.grad.float(), None
        self.optimizer.step()
        for (_, p), m in zip(self.named, self.masters):
            p.copy_(m)

    def state_dict(self) -> dict:
        return {n: {"master": m.detach(), **self.optimizer.state.get(m, {})} for (n, _), m in zip(self.named, self.masters)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for (n, _), m in zip(self.named, self.masters):
            entry = dict(state[n])
            m.copy_(entry.pop("master"))
            if entry:
                self.optimizer.state[m] = entry


def test_objects_with_their_own_state_dict_resume_exactly(tmp_path):
    """Fallback path: a bf16 model seen through a view, and an optimizer over fp32 masters."""

    def build(seed: int) -> tuple[Llama, _MasterAdamW]:
        m = Llama(CFG)
        m.reset_parameters(seed)
        m = m.to(torch.bfloat16)
        return m, _MasterAdamW(m)

    def step(m: Llama, opt: _MasterAdamW) -> float:
        x, y = _batch()
        loss = m(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    torch.manual_seed(1)
    m, opt = build(0)
    step(m, opt)
    save_checkpoint(tmp_path, 1, _ParamView(list(m.named_parameters())), opt, {"rng": capture_rng_state()})
    losses_a = [step(m, opt) for _ in range(3)]
    m2, opt2 = build(4)
    assert not opt2.optimizer.state  # fresh: the moments must come from the checkpoint's index
    _, extra = load_checkpoint(tmp_path, _ParamView(list(m2.named_parameters())), opt2)
    restore_rng_state(extra["rng"])
    assert [step(m2, opt2) for _ in range(3)] == losses_a
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, opt2.masters))


def test_a_crash_before_publishing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    run = _Run(seed=0)
    run.step()
    save_checkpoint(tmp_path, 1, run.model, run.opt, {"at": 1})
    saved = run.params()
    run.step()

    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed  # the process dies after its data is written, before the rename

    with monkeypatch.context() as m:
        m.setattr(ckpt, "_publish", die)
        with pytest.raises(Killed):
            save_checkpoint(tmp_path, 2, run.model, run.opt, {"at": 2})
    assert (tmp_path / "step_000002.tmp" / ".metadata").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"

    # A write that fails half way (disk full) is reported, and also leaves step 1 the latest.
    original = torch.distributed.checkpoint.FileSystemWriter.write_data

    def half_write(self, plan, planner):
        original(self, plan, planner)
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data", half_write)
        msg = _error(save_checkpoint, tmp_path, 2, run.model, run.opt, {"at": 2})
    assert "step_000002.tmp" in msg and "No space left on device" in msg and "previous checkpoint is untouched" in msg

    fresh = _Run(seed=3)
    assert load_checkpoint(tmp_path, fresh.model, fresh.opt) == (1, {"at": 1})
    assert _same(fresh.params(), saved)
    # The next save clears the crashed one's leftovers.
    save_checkpoint(tmp_path, 2, run.model, run.opt, {"at": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000002"]


def test_keep_prunes_old_checkpoints_and_a_stale_pointer_falls_back(tmp_path):
    run = _Run(seed=0)
    assert latest_checkpoint(tmp_path / "nothing") is None and latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, run.model, run.opt, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]
    save_checkpoint(tmp_path, 3, run.model, run.opt, {"step": "again"}, keep=2)  # same step again
    assert load_checkpoint(tmp_path, run.model, run.opt)[1] == {"step": "again"}
    (tmp_path / "step_000009.tmp").mkdir()  # a crashed save is never "latest"
    shutil.rmtree(tmp_path / "step_000003")  # pointer now names a missing folder
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert load_checkpoint(tmp_path / "step_000002", run.model, None) == (2, {"step": 2})


def test_unusable_checkpoints_give_one_line_errors_naming_path_and_fix(tmp_path):
    run = _Run(seed=0)
    run.step()
    step_dir = save_checkpoint(tmp_path / "ck", 1, run.model, run.opt, {})

    msg = _error(load_checkpoint, tmp_path / "nope", run.model, run.opt)
    assert str(tmp_path / "nope") in msg and "does not exist" in msg
    (tmp_path / "empty").mkdir()
    assert "no finished checkpoint" in _error(load_checkpoint, tmp_path / "empty", run.model, run.opt)

    def damaged(edit) -> str:
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(step_dir, bad)
        edit(bad)
        return _error(load_checkpoint, bad, run.model, run.opt)

    def truncate(d: Path) -> None:
        f = d / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:1000])

    msg = damaged(truncate)
    assert "__0_0.distcp" in msg and "truncated" in msg and "1000 bytes" in msg
    assert "missing .metadata" in damaged(lambda d: (d / ".metadata").unlink())
    # A published folder always has its manifest: without it, nothing can be verified.
    msg = damaged(lambda d: (d / "manifest.json").unlink())
    assert "has no manifest.json" in msg and "cannot be verified" in msg and "trust_unverified=True" in msg
    (tmp_path / "ck" / "step_000002.tmp").mkdir()
    assert "unfinished save" in _error(load_checkpoint, tmp_path / "ck" / "step_000002.tmp", run.model, run.opt)

    def scramble(d: Path) -> None:
        # Same size, so only the reader can notice: DCP's failure must come out as one line.
        f = d / "__0_0.distcp"
        data = bytearray(f.read_bytes())
        data[:64] = bytes(64)
        f.write_bytes(bytes(data))

    msg = damaged(scramble)
    assert "__0_0.distcp of step 1 is damaged" in msg and "SHA-256" in msg

    other = Llama(LlamaConfig(**{**CFG.to_dict(), "intermediate": 96}))
    msg = _error(load_checkpoint, tmp_path / "ck", other, None)
    assert "intermediate=64 (checkpoint) vs 96 (model)" in msg

    sgd = torch.optim.SGD(run.model.parameters(), lr=0.1)
    msg = _error(load_checkpoint, tmp_path / "ck", run.model, sgd)
    assert "torch.optim.adamw.AdamW" in msg and "torch.optim.sgd.SGD" in msg


def test_mismatched_models_name_the_key_and_both_shapes(tmp_path):
    save_checkpoint(tmp_path, 0, nn.Sequential(nn.Linear(4, 3)), None, {})
    msg = _error(load_checkpoint, tmp_path, nn.Sequential(nn.Linear(4, 5)), None)
    assert "model key '0.weight' has shape (3, 4)" in msg and "but (5, 4) here" in msg
    msg = _error(load_checkpoint, tmp_path, nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), None)
    assert "has no model key '1.weight'" in msg
    msg = _error(load_checkpoint, tmp_path, nn.Sequential(nn.Linear(4, 3)), torch.optim.AdamW(nn.Linear(1, 1).parameters()))
    assert "not the model's registered parameters" in msg
    with pytest.raises(CheckpointError, match="keep=0"):
        save_checkpoint(tmp_path, 1, nn.Linear(1, 1), None, {}, keep=0)
    with pytest.raises(CheckpointError, match="cannot be stored as tensors and plain values"):
        save_checkpoint(tmp_path, 1, nn.Linear(1, 1), None, {"f": lambda: 0})


@pytest.mark.slow
def test_torchao_adamw8bit_state_resumes_exactly(tmp_path):
    pytest.importorskip("torchao.optim")
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    cfg = LlamaConfig(vocab_size=64, hidden=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate=128, max_seq_len=16)

    def build(seed: int) -> tuple[Llama, AdamW8bit]:
        m = Llama(cfg)
        m.reset_parameters(seed)
        return m, AdamW8bit(m.parameters(), lr=1e-2, block_size=256)

    def step(m: Llama, opt: AdamW8bit) -> float:
        x, y = _batch()
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    # Eager execution: torch.compile of the 8-bit step costs ~50 s on this CPU; the state is the same.
    with torch.compiler.set_stance("force_eager"):
        torch.manual_seed(1)
        m, opt = build(0)
        step(m, opt)
        save_checkpoint(tmp_path, 1, m, opt, {"rng": capture_rng_state()})
        losses = [step(m, opt) for _ in range(2)]
        m2, opt2 = build(2)
        _, extra = load_checkpoint(tmp_path, m2, opt2)
        assert isinstance(opt2.state[m2.embed.weight]["exp_avg"], OptimState8bit)
        restore_rng_state(extra["rng"])
        assert [step(m2, opt2) for _ in range(2)] == losses
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


# ------------------------------------------------------------------------------ pp=2 x dp=2


def _pp_dp_checks(rank: int, world: int, root: str) -> dict:
    """One gloo job: rank = 2 * dp_index + pp_index; stage 0 holds layers 0-1, stage 1 layers 2-3."""
    root_p = Path(root)
    pp_i, dp_i, peer = rank % 2, rank // 2, rank ^ 1
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_group = dp_groups[pp_i]
    stage = range(0, 2) if pp_i == 0 else range(2, 4)
    layout = {"pp": 2, "dp": 2}

    def step(run: _Run) -> tuple[float | None, float]:
        x, y = _batch()  # the two stages of a replica share an RNG stream, so they draw the same rows
        if pp_i == 0:
            h = run.model(x)
            dist.send(h.detach(), peer)
            g = torch.empty_like(h)
            dist.recv(g, peer)
            h.backward(g)
            loss = None
        else:
            h = torch.empty(BATCH, SEQ, CFG.hidden)
            dist.recv(h, peer)
            h.requires_grad_(True)
            out = run.model(h, y)
            out.backward()
            dist.send(h.grad, peer)
            loss = out.item()
        for p in run.model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= 2
        run.opt.step()
        run.opt.zero_grad()
        return loss, random.random()  # a per-rank stream: rank-local extra state must round-trip

    out: dict = {}
    torch.manual_seed(1000 + dp_i)
    random.seed(rank)
    a = _Run(seed=0, layers=stage)
    for _ in range(3):
        step(a)
    extra = {"rank": rank, "rng": capture_rng_state(), "sampler": {"dp_rank": dp_i, "pos": 3}}
    save_checkpoint(root_p, 3, a.model, a.opt, extra, layout=layout)
    trace_a = [step(a) for _ in range(2)]

    # Rank 1 dies of a full disk half way through the next save: every rank gets the error.
    original = torch.distributed.checkpoint.FileSystemWriter.write_data

    def half_write(self, plan, planner):
        fut = original(self, plan, planner)
        if rank == 1:
            raise OSError(28, "No space left on device")
        return fut

    torch.distributed.checkpoint.FileSystemWriter.write_data = half_write
    try:
        save_checkpoint(root_p, 5, a.model, a.opt, {}, layout=layout)
    except CheckpointError as e:
        out["failed_save"] = str(e)
    finally:
        torch.distributed.checkpoint.FileSystemWriter.write_data = original
    trace_a.append(step(a))
    out["latest_after_failure"] = str(latest_checkpoint(root_p))
    out["tmp_left"] = (root_p / "step_000005.tmp").is_dir()
    dist.barrier()

    torch.manual_seed(7)
    random.seed(12345)
    b = _Run(seed=9, layers=stage)
    step_b, extra_b = load_checkpoint(root_p, b.model, b.opt, layout=layout)
    restore_rng_state(extra_b["rng"])
    trace_b = [step(b) for _ in range(3)]
    out.update(
        step=step_b,
        extra_rank=extra_b["rank"],
        sampler=extra_b["sampler"],
        same_trace=trace_a == trace_b,
        trace=trace_b,
        same_params=_same(a.params(), b.params()),
        same_moments=_same(a.moments(), b.moments()),
        numel=sum(p.numel() for p in a.model.parameters()),
    )

    if rank == 0:
        md = torch.distributed.checkpoint.FileSystemReader(root_p / "step_000003").read_metadata()
        copies: dict[str, int] = {}
        for index in md.storage_data:
            copies[index.fqn] = copies.get(index.fqn, 0) + 1
        out["copies"] = sorted(set(copies.values()))
        out["files"] = json.loads((root_p / "step_000003" / "manifest.json").read_text())["files"]
        out["writers"] = sorted({info.relative_path for info in md.storage_data.values()})

    def refused(fn) -> str:
        try:
            fn()
        except CheckpointError as e:
            return str(e)
        return "loaded"

    # Two processes where four saved: a different world.
    out["world_error"] = refused(lambda: load_checkpoint(root_p, b.model, b.opt, process_group=pp_groups[dp_i]))
    # pp=4 x dp=1: every key exists with its shape, but ranks hold other layers than they saved.
    c = _Run(seed=0, layers=range(rank, rank + 1))
    out["layout_error"] = refused(lambda: load_checkpoint(root_p, c.model, c.opt))
    # Only rank 2 is wrong (it builds stage 1); every rank must still raise, none may hang.
    d = _Run(seed=0, layers=range(2, 4) if rank == 2 else stage)
    out["one_rank_error"] = refused(lambda: load_checkpoint(root_p, d.model, d.opt))
    return out


def test_pp2_dp2_resume_is_exact_deduplicated_and_refuses_other_layouts(tmp_path):
    results = run_distributed(_pp_dp_checks, 4, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["extra_rank"] == rank and r["sampler"] == {"dp_rank": rank // 2, "pos": 3}
        assert r["same_trace"] and r["same_params"] and r["same_moments"], rank
        assert "rank 1:" in r["failed_save"] and "No space left on device" in r["failed_save"]
        assert r["latest_after_failure"].endswith("step_000003") and r["tmp_left"]
        assert "saved by 4 processes" in r["world_error"] and "this job has 2" in r["world_error"]
        assert "different parallel layout" in r["layout_error"] and "{'pp': 2, 'dp': 2}" in r["layout_error"]
        assert r["one_rank_error"].startswith("rank 2: ") and "different parallel layout" in r["one_rank_error"]
    assert all(loss is None for r in results[0::2] for loss, _ in r["trace"])  # only the last stage has a loss
    assert all(loss > 0 for r in results[1::2] for loss, _ in r["trace"])
    assert results[0]["trace"][0][1] != results[1]["trace"][0][1]  # per-rank streams differ

    r0 = results[0]
    assert r0["copies"] == [1]  # every saved key is stored once, dp replicas included
    # The data of one replica, saved by one process, is what the 4 ranks must write (2x without
    # de-duplication). Per-entry serialization overhead is the same in both.
    one = _Run(seed=0)
    one.step()
    ref = save_checkpoint(tmp_path / "one_replica", 1, one.model, one.opt, {"rank": 0, "rng": capture_rng_state()})
    ref_data = sum(f.stat().st_size for f in ref.glob("*.distcp"))
    data = sum(size for name, size in r0["files"].items() if name.endswith(".distcp"))
    assert 12 * (results[0]["numel"] + results[1]["numel"]) < data  # fp32 weight + 2 moments, one replica
    assert abs(data - ref_data) < 0.05 * ref_data, (data, ref_data)
    assert len(r0["writers"]) == 4  # the planner spreads the replicated keys over the replicas

    # The same checkpoint in one process: refused, naming both world sizes.
    run = _Run(seed=0, layers=range(0, 2))
    msg = _error(load_checkpoint, tmp_path, run.model, run.opt)
    assert "saved by 4 processes (layout {'pp': 2, 'dp': 2}), this job has 1" in msg
