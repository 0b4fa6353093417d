"""FSDP2's 8-bit reduce-scatter keeps every parameter within the int8 bound of its own blocks.

FSDP2 reduce-scatters a module's gradients as one flat buffer of W rows, the parameters' shards
end to end. Quantized as it is, a block spanning two parameters shares one scale: a gradient 1e4
smaller than its neighbour's keeps almost no digits. The bound (agoq.gradient.collectives): per
element, sum_i s_i / 2 over the W ranks' input blocks plus s_out / 2 of the re-quantized block
(s = block absmax / 127), divided by W for the average, against the fp32 average of the inputs.
It is computed here per parameter, from blocks that start where each parameter's shard starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from agoq.gradient.collectives import reduce_scatter_8bit
from agoq.quant.formats import round_up

from tests._dist import run_distributed

BLOCK = 256  # the default 8-bit gradient format's block (int8/256)
SMALL = 3e-6  # the small branch's loss weight: its gradients are at least 1e4 below the big linear's
# Slack on the bound: the reference is an fp64 sum, the 8-bit path sums dequantized values in fp32.
SLACK = 1 + 1e-4


class Unit(nn.Module):
    """One fully_shard unit: a 37x37 linear on a small branch, a 250x250 linear and a 37-value weight.

    FSDP2 lays them out small, big, scale (a module's own parameters follow its children's; scale is
    registered first, so a layout in named_parameters() order misplaces every segment). Per-rank
    shards end mid-block at 2 and 3 ranks (703 / 31250 / 19 and 481 / 21000 / 13 values), so in
    FSDP2's flat rows the small linear's last block and the weight's only one hold big values too.
    """

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(37))
        self.small = nn.Linear(37, 37, bias=False)
        self.big = nn.Linear(250, 250, bias=False)
        self.unused = nn.Parameter(torch.ones(5)) if unused else None

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.big(x).square().mean() + SMALL * self.small(z * self.scale).square().mean()


def _unit(unused: bool = False) -> Unit:
    torch.manual_seed(0)
    return Unit(unused)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 250, generator=g), torch.randn(8, 37, generator=g) + 1.0


def _bound(inputs: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """Per-element int8 bound of the average of ``inputs`` (ranks x rows x n, a row one shard of one
    parameter) against ``result`` (rows x n), the blocks starting at each row's start."""
    n = inputs.shape[-1]

    def scales(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t.double(), (0, round_up(n, BLOCK) - n)).unflatten(-1, (-1, BLOCK)).abs().amax(-1) / 127

    half_steps = scales(inputs).sum(0) / 2 / inputs.shape[0] + scales(result) / 2
    return half_steps.repeat_interleave(BLOCK, -1)[..., :n]


def _shard_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t`` as FSDP2's W reduce-scatter rows: padded on dim 0 to a multiple of W, one row per shard."""
    c0 = -(-t.shape[0] // world)
    return F.pad(t.reshape(t.shape[0], -1), (0, 0, 0, world * c0 - t.shape[0])).reshape(world, -1)


class _Unaligned(ReduceScatter):
    """The reduce-scatter as it was: FSDP2's flat buffer quantized as it is, blocks spanning parameters."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        output_tensor.copy_(reduce_scatter_8bit(input_tensor, op, group).view(output_tensor.shape))


def _unit_checks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from agoq.compat import fsdp_can_reduce_unused_params
    from agoq.gradient.fsdp import QuantizedReduceScatter, fsdp_group_parameters, use_quantized_reduce_scatter

    mesh = init_device_mesh("cpu", (world,))
    x, z = _batch(rank)
    out: dict = {}

    # Every rank's unsharded gradients, in fp32: the reference and the inputs of the bound.
    local = _unit()
    local(x, z).backward()
    names = [n for n, _ in local.named_parameters()]
    grads = {}
    for n, p in local.named_parameters():
        gathered = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(gathered, p.grad)
        grads[n] = torch.stack(gathered)
    out["grad_absmax"] = {n: float(g.abs().max()) for n, g in grads.items()}

    for kind in ("aligned", "unaligned"):
        m = _unit()
        fully_shard(m, mesh=mesh)
        if kind == "aligned":
            use_quantized_reduce_scatter(m)
            by_id = {id(p): n for n, p in m.named_parameters()}
            out["order"] = [by_id[id(p)] for p in fsdp_group_parameters(m)]
            out["shard_numels"] = QuantizedReduceScatter(m).shard_numels(world)
            # torch's own per-rank shard sizes (private; read here only to check the formula).
            out["torch_shard_numels"] = [fp.padded_sharded_param_size.numel() for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
        else:
            m.set_custom_reduce_scatter(_Unaligned())
        m(x, z).backward()
        params = dict(m.named_parameters())
        stats = {}
        for n in names:
            result = params[n].grad.full_tensor()
            ref = grads[n].double().mean(0)
            err = _shard_rows((result.double() - ref), world)
            bound = _bound(torch.stack([_shard_rows(g, world) for g in grads[n]]), _shard_rows(result, world))
            stats[n] = {
                "bound_ratio": float((err.abs() / (bound * SLACK).clamp_min(1e-30)).max()),
                "rel_err": float(err.abs().max() / ref.abs().max()),
            }
        out[kind] = stats

    # Mixed precision: bf16 compute, the reduction in reduce_dtype; the bound against the fp32
    # average of what arrives at the reduce-scatter (recorded), on this rank's row.
    class Recording(QuantizedReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.seen = (input_tensor.clone(), op)
            super().__call__(output_tensor, input_tensor, group, op, async_op)
            self.seen += (output_tensor.clone(),)

    out["mixed"] = {}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        m = _unit()
        fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
        comm = Recording(m)
        m.set_custom_reduce_scatter(comm)
        m(x, z).backward()
        inp, op, output = comm.seen
        inputs = [torch.empty_like(inp) for _ in range(world)]
        dist.all_gather(inputs, inp)
        rows = torch.stack(inputs).view(world, world, -1)[:, rank]  # every rank's row for this rank
        ratios, offset = {}, 0
        names_of = {id(p): n for n, p in m.named_parameters()}
        for p in fsdp_group_parameters(m):
            k = -(-p.shape[0] // world) * math.prod(p.shape[1:])
            n = names_of[id(p)]
            seg_in, seg_out = rows[:, None, offset : offset + k], output[None, offset : offset + k]
            bound = _bound(seg_in, seg_out) * SLACK
            if reduce_dtype == torch.bfloat16:
                bound = bound + seg_out.double().abs() * 2**-8  # the bf16 output's rounding (half an ulp)
            err = (seg_out.double() - seg_in.double().mean(0)).abs()
            ratios[n] = float((err / bound.clamp_min(1e-30)).max())
            offset += k
        out["mixed"][str(reduce_dtype)] = {"input_dtype": str(inp.dtype), "op": str(op), "bound_ratio": ratios, "covered": offset == output.numel()}

    # A parameter without a gradient: FSDP2 leaves it out of the buffer, the sizes no longer add up.
    m = _unit(unused=True)
    fully_shard(m, mesh=mesh)
    use_quantized_reduce_scatter(m)
    try:
        m(x, z).backward()
        out["unused_error"] = None
    except ValueError as e:
        out["unused_error"] = str(e)
    out["can_reduce_unused"] = fsdp_can_reduce_unused_params(m)
    if not out["can_reduce_unused"]:
        return out
    m = _unit(unused=True)
    fully_shard(m, mesh=mesh)
    use_quantized_reduce_scatter(m)
    m.set_reduce_scatter_unused_params(True)
    m(x, z).backward()
    params = dict(m.named_parameters())
    out["unused_fixed_err"] = max(float((params[n].grad.full_tensor() - grads[n].mean(0)).abs().max() / grads[n].abs().max()) for n in names)
    out["unused_grad_zero"] = float(params["unused"].grad.full_tensor().abs().max()) == 0.0
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def unit(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_unit_checks, request.param)


def test_the_shards_are_laid_out_in_fsdp2s_order_and_sizes(unit):
    world, results = unit
    expected = [-(-37 // world) * 37, -(-250 // world) * 250, -(-37 // world)]  # ceil(dim0 / W) * prod(rest)
    for r in results:
        assert r["order"] == ["small.weight", "big.weight", "scale"]
        assert r["shard_numels"] == r["torch_shard_numels"] == expected
        assert all(n % BLOCK for n in expected)  # every shard ends mid-block


def test_every_parameter_stays_within_the_int8_bound_of_its_own_blocks(unit):
    world, results = unit
    for r in results:
        amax = r["grad_absmax"]
        # The setup: gradients at least 1e4 apart in scale.
        assert amax["big.weight"] / amax["small.weight"] >= 1e4 and amax["big.weight"] / amax["scale"] >= 1e4, amax
        for name, s in r["aligned"].items():
            assert s["bound_ratio"] <= 1.0, (world, name, s)
            assert s["rel_err"] <= (world + 1) / 254, (world, name, s)  # W + 1 half-steps of the parameter's absmax


def test_the_unaligned_buffer_would_have_broken_the_small_parameters_bound(unit):
    world, results = unit
    for r in results:
        old = r["unaligned"]
        # The big linear dominates the blocks it shares: within W + 1 half-steps of its own absmax
        # (its blocks are not the aligned ones, so the per-block bound does not apply to it). The
        # small parameters' values in those blocks round to the big one's scale, far past theirs.
        assert old["big.weight"]["rel_err"] <= (world + 1) / 254, (world, old)
        for name in ("small.weight", "scale"):
            assert old[name]["bound_ratio"] > 10.0, (world, name, old)
            assert old[name]["rel_err"] > 0.05, (world, name, old)


def test_mixed_precision_reduces_the_dtype_that_arrives_within_the_bound(unit):
    world, results = unit
    for r in results:
        for reduce_dtype, m in r["mixed"].items():
            assert m["input_dtype"] == reduce_dtype and m["covered"], m
            assert max(m["bound_ratio"].values()) <= 1.0, (world, reduce_dtype, m)


def test_a_parameter_without_a_gradient_is_a_clear_error_and_the_named_fix_works(unit):
    world, results = unit
    for r in results:
        msg = r["unused_error"]
        assert msg is not None and "\n" not in msg
        # FSDP2 sent the three used parameters' shards; the four that require grad shard to more.
        used = [-(-37 // world) * 37, -(-250 // world) * 250, -(-37 // world)]
        assert f"sent {sum(used)} values per rank" in msg and f"shard to {sum(used) + -(-5 // world)}" in msg, msg
        # The fix named is one this torch has (FSDP2 on torch 2.11 cannot reduce unused parameters).
        assert ("set_reduce_scatter_unused_params(True)" in msg) == r["can_reduce_unused"], msg
        assert "requires_grad=False" in msg, msg
        if not r["can_reduce_unused"]:
            continue
        assert r["unused_grad_zero"]
        assert r["unused_fixed_err"] <= (world + 1) / 254, r["unused_fixed_err"]


TRAINER_RUN = Path(__file__).resolve().parent / "fsdp_trainer_run.py"


def _trainers(tmp: Path, *gradients: str) -> dict[str, dict]:
    """One 2-process Trainer run per gradient path, all in one torchrun's processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAINER_RUN)]
    cmd += ["--gradients", ",".join(gradients), "--out", str(tmp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {g: json.loads((tmp / f"{g}.json").read_text()) for g in gradients}


@pytest.mark.slow
def test_hf_trainer_under_fsdp2_with_8bit_reduce_scatter_reaches_the_fp32_loss(tmp_path):
    runs = _trainers(tmp_path, "int8", "fp32")
    int8, fp32 = runs["int8"], runs["fp32"]
    # Accelerate 1.14 shards the tail (final norm and LM head) as one group of two modules; before
    # it each is its own unit.
    import accelerate

    from agoq.compat import major_minor

    tail_groups = 1 if major_minor(accelerate.__version__) >= (1, 14) else 0
    for run in (int8, fp32):
        # Accelerate's FSDP2 (not DDP): the decoder layers, the embedding, the tail and the root.
        assert run["fsdp_units"] >= 3 and run["multi_module_groups"] == tail_groups, run
    # Every parameter group went through the aligned 8-bit reduce-scatter, the tail group
    # (fully_shard([norm, lm_head])) included: the bytes are those of the aligned rows.
    assert fp32["wire_bytes"] == 0 and int8["wire_bytes"] == int8["expected_wire_bytes"] > 0, int8
    # The last 5 steps' mean training loss (single steps are noisy); both start at ln(96) = 4.56.
    tail = {k: sum(r["losses"][-5:]) / 5 for k, r in (("int8", int8), ("fp32", fp32))}
    assert tail["fp32"] < 0.6 * math.log(96), tail
    assert abs(tail["int8"] - tail["fp32"]) <= 0.01 * tail["fp32"], tail
