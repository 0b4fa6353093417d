"""Tensor + sequence parallelism at tp = 2 (real gloo ranks) against the tp = 1 model in this process.

One spawned group runs every check (module fixture) and returns losses, gathered gradients, the
saved bytes per rank and the bytes counted on the wire; the references are the full
:class:`agoq.models.llama.Llama` computed here, in fp32 (and once in bf16 compute).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from agoq.activation import SavedBytesMeter, make_policy
from agoq.gradient.counter import CommCounter
from agoq.models.config import LlamaConfig
from agoq.models.llama import Llama
from agoq.parallel.tensor_model import check_tp_shapes, gather_gradients, gather_state_dict, shard_llama
from agoq.parallel.tensor_ops import NORM_INPUT_ALL_GATHER, all_gather_seq, reduce_scatter_seq, vocab_parallel_cross_entropy
from agoq.quant import parse_format
from tests._dist import run_distributed

TP = 2
CFG = LlamaConfig(vocab_size=128, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=256, max_seq_len=64)
BATCH = 2
# 16 tokens: a rank's shard of the sequence is 8 tokens; 10 tokens: shards of 5, so one shard
# ends inside the first sequence. Every token's row of 64 is one int4/128 block (zero-padded), so
# either way each rank keeps exactly the codes tp = 1 keeps for its tokens.
SEQ_ALIGNED, SEQ_MISALIGNED = 16, 10
INT4 = parse_format("int4/128")


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, seq + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, :3] = -100  # ignored tokens, on rank 0's shard only
    return tokens[:, :-1].contiguous(), targets


def _full_model(policy: str, dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(0)
    return Llama(CFG, make_policy(policy)).to(dtype)


def _tp_run(policy: str, seq: int, group: object, dtype: torch.dtype = torch.float32) -> dict:
    counter = CommCounter()
    tp_model = shard_llama(_full_model(policy, dtype), group, counter)
    tokens, targets = _batch(seq)
    with SavedBytesMeter(tp_model, layers={int(i): m for i, m in tp_model.layers.items()}) as meter:
        loss = tp_model(tokens, targets)
    saved = {i: meter.layer_bytes(i) for i in range(CFG.n_layers)}
    forward_bytes = counter.as_dict()
    loss.backward()
    return {
        "loss": loss.item(),
        # numpy: pickled by value (a tensor would travel as shared memory of an exiting process).
        "grads": {n: g.float().numpy() for n, g in gather_gradients(tp_model).items()},
        "saved": saved,
        "forward_comm": forward_bytes,
        "comm": counter.as_dict(),
        "state_equal": all(torch.equal(t, dict(_full_model(policy, dtype).named_parameters())[n]) for n, t in gather_state_dict(tp_model).items()),
    }


def _collectives_check(rank: int, world: int) -> dict:
    """all_gather_seq and reduce_scatter_seq (gloo's own reduce_scatter_single) against their definitions."""
    counter = CommCounter()
    xs = [torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    gathered = all_gather_seq(xs[rank], dist.group.WORLD, counter)
    full = [torch.randn(2, 3 * world, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    scattered = reduce_scatter_seq(full[rank], dist.group.WORLD, counter)
    want = sum(full)[:, 3 * rank : 3 * (rank + 1)]
    return {"gather": torch.equal(gathered, torch.cat(xs, dim=1)), "scatter_err": (scattered - want).abs().max().item(), "comm": counter.as_dict()}


LOSS_SHAPE, LOSS_VOCAB, LOSS_CHUNK = (3, 7, 16), 24, 5  # 21 tokens: chunks of 5, the last one short


def _loss_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(LOSS_SHAPE, generator=g)
    weight = torch.randn(LOSS_VOCAB, LOSS_SHAPE[-1], generator=g)
    targets = torch.randint(0, LOSS_VOCAB, LOSS_SHAPE[:-1], generator=g)
    targets[1, 2:5] = -100
    return hidden, weight, targets


def _vocab_loss_check(rank: int, world: int) -> dict:
    """The vocab-parallel loss over several chunks; the hidden gradient's shares summed over tp."""
    hidden, weight, targets = _loss_inputs()
    rows = LOSS_VOCAB // world
    hidden.requires_grad_(True)
    shard = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(hidden, shard, targets, rank * rows, dist.group.WORLD, CommCounter(), chunk_size=LOSS_CHUNK)
    loss.backward()
    grad_h = hidden.grad.clone()
    dist.all_reduce(grad_h)
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.grad)
    return {"loss": loss.item(), "grad_hidden": grad_h.numpy(), "grad_weight": torch.cat(parts).numpy()}


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(1234 + rank)  # nothing may depend on the rank's own random state
    group = dist.group.WORLD
    out = {"collectives": _collectives_check(rank, world), "vocab_loss": _vocab_loss_check(rank, world)}
    for policy in ("bf16", "agoq"):
        out[policy] = _tp_run(policy, SEQ_ALIGNED, group)
    out["agoq_misaligned"] = _tp_run("agoq", SEQ_MISALIGNED, group)
    out["agoq_bf16_dtype"] = _tp_run("agoq", SEQ_ALIGNED, group, torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, TP)


def _reference(policy: str, seq: int, dtype: torch.dtype = torch.float32) -> dict:
    model = _full_model(policy, dtype)
    tokens, targets = _batch(seq)
    with SavedBytesMeter(model, layers={int(i): m for i, m in model.layers.items()}) as m:
        loss = model(tokens, targets)
    loss.backward()
    return {
        "loss": loss.item(),
        "grads": {n: p.grad.float() for n, p in model.named_parameters()},
        "saved": {i: m.layer_bytes(i) for i in range(CFG.n_layers)},
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    assert grads.keys() == ref.keys()
    return {n: _rel(torch.as_tensor(grads[n]), ref[n]) for n in ref}


def _int4_bytes(rows: int, width: int) -> int:
    """Payload (two codes a byte, rows padded to whole blocks) and fp32 scales of an int4/128 [rows, width] tensor."""
    padded = -(-width // INT4.block_size) * INT4.block_size
    assert INT4.stored_nbytes((rows, width)) == rows * padded // 2 + rows * padded // INT4.block_size * 4
    return INT4.stored_nbytes((rows, width))


def test_sequence_collectives_equal_their_definitions(ranks):
    for r, out in enumerate(ranks):
        c = out["collectives"]
        assert c["gather"] and c["scatter_err"] < 1e-6
        # Each rank sends its [2, 3, 5] fp32 piece once to one peer, in each direction.
        assert c["comm"]["tp_seq_all_gather"]["total"] == c["comm"]["tp_seq_reduce_scatter"]["total"] == 2 * 3 * 5 * 4


def test_vocab_parallel_loss_equals_cross_entropy_of_full_logits(ranks):
    hidden, weight, targets = _loss_inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    ref = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    for out in (r["vocab_loss"] for r in ranks):
        assert abs(out["loss"] - ref.item()) <= 1e-6 * ref.item()
        assert _rel(torch.as_tensor(out["grad_hidden"]), hidden.grad) <= 1e-6
        assert _rel(torch.as_tensor(out["grad_weight"]), weight.grad) <= 1e-6


def test_bf16_loss_and_every_gradient_equal_tp1(ranks):
    ref = _reference("bf16", SEQ_ALIGNED)
    for out in (r["bf16"] for r in ranks):
        assert abs(out["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        errors = _grad_errors(out["grads"], ref["grads"])
        assert max(errors.values()) <= 1e-5, errors
        assert out["state_equal"]


def test_agoq_loss_equals_tp1_and_gradients_within_the_quantization_bound(ranks):
    ref_bf16 = _reference("bf16", SEQ_ALIGNED)
    ref = _reference("agoq", SEQ_ALIGNED)
    tp1_quant_err = _grad_errors(ref["grads"], ref_bf16["grads"])
    for out in (r["agoq"] for r in ranks):
        # Forward outputs do not depend on the quantization.
        assert abs(out["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        assert abs(out["loss"] - ref_bf16["loss"]) <= 1e-5 * abs(ref["loss"])
        # Block-aligned shards put the same tokens in each int4 block as tp = 1 and every value is
        # equal within fp32 reduction order, so the codes are tp = 1's (a code could flip only for a
        # value within ~1e-7 of a rounding boundary): the gradients equal tp = 1 agoq's to fp32 sums.
        errors = _grad_errors(out["grads"], ref["grads"])
        assert max(errors.values()) <= 1e-5, errors
        vs_bf16 = _grad_errors(out["grads"], ref_bf16["grads"])
        assert all(vs_bf16[n] <= 1.01 * tp1_quant_err[n] + 1e-6 for n in vs_bf16), (vs_bf16, tp1_quant_err)


def test_agoq_shards_ending_inside_a_sequence_keep_tp1_codes(ranks):
    ref = _reference("agoq", SEQ_MISALIGNED)
    for out in (r["agoq_misaligned"] for r in ranks):
        assert abs(out["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        # A block never spans two tokens, so however the sequence is cut each token's codes are
        # tp = 1's: the gradients equal tp = 1 agoq's to fp32 sums. (When blocks could span tokens,
        # a shard of 5 tokens put other pairs of tokens in a block than tp = 1, and tp = 2's
        # gradients were another draw of the quantization error, up to 0.9x of it away.)
        errors = _grad_errors(out["grads"], ref["grads"])
        assert max(errors.values()) <= 1e-5, errors


def test_agoq_in_bf16_compute_is_as_close_to_fp32_as_tp1_is(ranks):
    ref = _reference("agoq", SEQ_ALIGNED, torch.bfloat16)
    ref32 = _reference("agoq", SEQ_ALIGNED)
    tp1_err = _grad_errors(ref["grads"], ref32["grads"])
    for out in (r["agoq_bf16_dtype"] for r in ranks):
        # bf16 partial sums are rounded before the reduce-scatter adds them (tp = 1 rounds the whole
        # sum once): the losses agree to bf16 rounding (measured 2e-5 relative).
        assert abs(out["loss"] - ref["loss"]) <= 1e-3 * ref["loss"]
        # Those roundings move some values across 4-bit code boundaries, so tp = 2 and tp = 1 in
        # bf16 are two equally good draws (4.6% apart at most, measured): against the fp32 run,
        # tp = 2's error is tp = 1's size (measured at most 1.38x it, on a small one).
        err = _grad_errors(out["grads"], ref32["grads"])
        for n in err:
            assert err[n] <= 1.5 * tp1_err[n] + 2e-3, (n, err[n], tp1_err[n])


def test_saved_bytes_per_rank_are_one_tp_th_of_tp1(ranks):
    ref = _reference("agoq", SEQ_ALIGNED)["saved"]
    tokens = BATCH * SEQ_ALIGNED
    for out in (r["agoq"] for r in ranks):
        for i in range(CFG.n_layers):
            got, full = out["saved"][i], ref[i]
            # Two norm inputs per layer: the 4-bit copy of this rank's seq / tp tokens.
            assert full["norm_input"] == 2 * _int4_bytes(tokens, CFG.hidden)
            assert got["norm_input"] == 2 * _int4_bytes(tokens // TP, CFG.hidden)
            # Gate and up of this rank's intermediate / tp columns, every token.
            assert full["act_input"] == 2 * _int4_bytes(tokens, CFG.intermediate)
            assert got["act_input"] == 2 * _int4_bytes(tokens, CFG.intermediate // TP)
            # The attention core of this rank's heads (q, k, v, output, statistics), unquantized.
            assert full["attention"] > 0 and got["attention"] * TP == full["attention"]
            assert got["out_proj_input"] == full["out_proj_input"] == 0  # a view attention keeps
            assert got["gemm_input"] == full["gemm_input"] == 0


def test_bf16_baseline_saves_one_tp_th_of_every_kind(ranks):
    # Megatron-LM's sequence-parallel layer: the norm keeps its token shard, the column-parallel
    # GEMMs the sharded norm output (gathered again in backward), attention its heads, the MLP its
    # intermediate columns: every kind is exactly 1/tp of tp = 1's.
    ref = _reference("bf16", SEQ_ALIGNED)["saved"]
    for out in (r["bf16"] for r in ranks):
        for i in range(CFG.n_layers):
            assert ref[i]["norm_input"] > 0 and ref[i]["gemm_input"] > 0 and ref[i]["act_input"] > 0
            assert {k: v * TP for k, v in out["saved"][i].items()} == ref[i]


def test_backward_gathers_the_norm_input_as_4bit_codes_and_scales(ranks):
    shard = BATCH * SEQ_ALIGNED // TP * CFG.hidden
    stored = INT4.stored_numel((BATCH * SEQ_ALIGNED // TP, CFG.hidden))  # each row padded to a whole block
    gathers = 2 * CFG.n_layers  # two norms a layer
    for r in ranks:
        assert NORM_INPUT_ALL_GATHER not in r["bf16"]["comm"]  # the baseline gathers the norm output in forward
        out = r["agoq"]
        assert NORM_INPUT_ALL_GATHER not in out["forward_comm"]
        sent = out["comm"][NORM_INPUT_ALL_GATHER]
        assert sent["calls"] == gathers
        assert sent["payload"] == gathers * (TP - 1) * (stored // 2)
        assert sent["scales"] == gathers * (TP - 1) * (stored // INT4.block_size) * 4
        # The fp32 sequence collectives move one [batch, seq / tp, hidden] shard per call: forward
        # gathers before the 4 column-parallel norms and the head, scatters after the 4 row-parallel
        # GEMMs and the embedding; backward the same number the other way round, and the loss, which
        # keeps only its input's sequence shard, gathers it once more.
        for name, extra in (("tp_seq_all_gather", 1), ("tp_seq_reduce_scatter", 0)):
            assert out["comm"][name]["calls"] == 2 * (2 * CFG.n_layers + 1) + extra
            assert out["comm"][name]["total"] == out["comm"][name]["calls"] * (TP - 1) * shard * 4


def _compile_worker(rank: int, world: int) -> dict:
    """Each policy's tp = 2 model eagerly, then with its layers compiled (fullgraph, aot_eager)."""
    out = {}
    for policy in ("agoq", "bf16"):
        torch._dynamo.reset()
        model = shard_llama(_full_model(policy), dist.group.WORLD, CommCounter())
        tokens, targets = _batch(SEQ_ALIGNED)
        layer = model.layers["0"]
        cos, sin = torch.randn(SEQ_ALIGNED, CFG.head_dim), torch.randn(SEQ_ALIGNED, CFG.head_dim)
        x = torch.randn(BATCH, SEQ_ALIGNED // world, CFG.hidden, requires_grad=True)
        explained = torch._dynamo.explain(layer)(x, cos, sin, model.policy, model.group_name, model.counter_key)
        runs = []
        for compiled in (False, True):
            if compiled:
                model.compile_layers(backend="aot_eager")
            model.zero_grad(set_to_none=True)
            model.counter.reset()
            loss = model(tokens, targets)
            loss.backward()
            grads = {n: g.float().numpy() for n, g in gather_gradients(model).items()}
            runs.append({"loss": loss.item(), "grads": grads, "comm": model.counter.as_dict()})
        out[policy] = {
            "graphs": (explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]),
            "ops": sorted({str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}),
            "eager": runs[0],
            "compiled": runs[1],
        }
    return out


def test_tp_layers_compile_fullgraph_with_the_eager_loss_gradients_and_bytes():
    # The tp ops are custom ops taking the group and the counter by name: a tp decoder layer is one
    # graph, the ops single nodes, and compiled (aot_eager: the same kernels, one graph) its loss,
    # gradients and wire bytes are the eager ones.
    for r in run_distributed(_compile_worker, TP):
        for policy, out in r.items():
            assert out["graphs"][:2] == (1, 0), (policy, out["graphs"])
            fused = {"agoq.tp_sp_norm_linear.default"} if policy == "agoq" else {"agoq.tp_gathered_linear.default"}
            assert fused | {"agoq.tp_scatter_seq.default"} <= set(out["ops"]), (policy, out["ops"])
            eager, compiled = out["eager"], out["compiled"]
            assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-6)
            # fp32 throughout; one graph may order a sum differently: 1e-5 relative, as test_compile_native.
            errors = _grad_errors(compiled["grads"], {n: torch.as_tensor(g) for n, g in eager["grads"].items()})
            assert max(errors.values()) <= 1e-5, (policy, errors)
            assert compiled["comm"] == eager["comm"], policy


def test_shapes_that_do_not_split_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"n_heads=4 and n_kv_heads=2 must both be divisible by tp=4"):
        check_tp_shapes(CFG, 4)
    with pytest.raises(ValueError, match=r"vocab_size=127 must be divisible by tp=2"):
        check_tp_shapes(LlamaConfig(vocab_size=127, hidden=64, n_heads=4, n_kv_heads=2), 2)
    check_tp_shapes(CFG, 2)


@pytest.mark.parametrize("policy", ["agoq", "bf16"])
def test_saved_bytes_per_rank_at_tp2_equal_the_planners_prediction(ranks, policy):
    # agoq plan models TP + SP as the layer accounting at seq / tp tokens; here it meets a real
    # tp = 2 forward of the same configuration (same model, micro-batch, sequence, dtype).
    from agoq.plan.accounting import PlanAccounting
    from agoq.plan.config import PlanConfig, Setup

    plan = PlanAccounting(PlanConfig(model=CFG, seq_len=SEQ_ALIGNED, tp=TP, micro_batch=BATCH, dtype="fp32", device="cpu"))
    predicted = plan.activations.layer_bytes(plan.policy(Setup(activations=policy == "agoq")), 4 if policy == "agoq" else 16)
    for r in ranks:
        for i in range(CFG.n_layers):
            measured = sum(r[policy]["saved"][i].values())
            # Equal to the byte (agoq 17984, bf16 94592 per layer and rank); 5% would be the target.
            assert measured == predicted, (i, measured, predicted)
