"""torch.compile(fullgraph=True) over agoq's fused ops: one graph, the eager gradients.

The fused ops are torch.library custom ops with fake kernels and registered autograd, so Dynamo
sees each as one node and AOTAutograd traces its backward op without running it. The eager ops are
the definition: compiled gradients must equal them. Sizes are small (2 layers, hidden 64) and fp32;
``aot_eager`` checks graph capture and gradients without inductor's code generation, and one test
(``agoq train --train.compile=true``) compiles with inductor, the trainer's default.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from agoq.activation import make_policy
from agoq.models.config import LlamaConfig
from agoq.models.llama import IGNORE_INDEX, Llama
from agoq.launch.config import ConfigError, load_config
from tests._data import SMALL_MODEL, data_args
from tests._dist import run_distributed

transformers = pytest.importorskip("transformers")

from agoq.integrations.hf import apply_agoq  # noqa: E402

# fp32 GEMMs in one graph or op by op differ at most by summation order: well below 1e-5 relative.
GRAD_RTOL = 1e-5

HF_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=160,  # not a multiple of the 128-value block: the last block is partial
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _ids(batch: int = 2, seq: int = 24, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_rel(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert grads.keys() == ref.keys()
    return max(float((grads[n] - ref[n]).norm() / ref[n].norm()) for n in ref)


def _hf_model(arch: str) -> nn.Module:
    config = getattr(transformers, f"{arch}Config")(**HF_SIZES)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).float()
    apply_agoq(model)
    return model


@pytest.mark.parametrize("arch", ["Llama", "Qwen3"])
def test_patched_hf_model_compiles_fullgraph_to_one_graph_with_the_eager_gradients(arch):
    torch._dynamo.reset()
    model = _hf_model(arch)
    ids = _ids()

    def loss_fn(ids):
        return model(ids, labels=ids).loss

    explained = torch._dynamo.explain(loss_fn)(ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [r.reason for r in explained.break_reasons]
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    # The fused ops reach the graph as single custom-op nodes, not as their insides.
    assert {"agoq.norm_linear.default", "agoq.swiglu_linear.default", "agoq.saved_input_linear.default", "agoq.normed_loss.default"} <= ops

    eager_loss, eager = _grads(model, lambda: loss_fn(ids))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = _grads(model, lambda: compiled(ids, labels=ids).loss)
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    assert len(grads) == len(list(model.parameters()))
    assert _worst_rel(grads, eager) <= GRAD_RTOL


def _llama(policy: str = "agoq") -> Llama:
    cfg = LlamaConfig(vocab_size=128, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=160, max_seq_len=64)
    return Llama(cfg, make_policy(policy))


@pytest.mark.parametrize("policy", ["agoq", "bf16"])
def test_agoq_model_compiled_per_block_fullgraph_has_the_eager_gradients(policy):
    torch._dynamo.reset()
    model = _llama(policy)
    ids = _ids(seq=25)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    layer = model.layers["0"]
    cos, sin = model._rope_for(inputs.shape[1], inputs.device)
    x = torch.randn(2, inputs.shape[1], 64, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x, cos, sin, model.policy)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [r.reason for r in explained.break_reasons]

    eager_loss, eager = _grads(model, lambda: model(inputs, targets))
    model.compile_layers(backend="aot_eager")
    loss, grads = _grads(model, lambda: model(inputs, targets))
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    assert _worst_rel(grads, eager) <= GRAD_RTOL
    # Compiled in place: the checkpoint names are the eager model's.
    assert list(model.state_dict()) == list(_llama(policy).state_dict())


def test_chunked_loss_compiles_fullgraph_with_the_eager_gradients():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 20, 64, generator=gen, requires_grad=True)
    weight = torch.randn(96, 64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 96, (2, 20), generator=gen)
    targets[0, :3] = IGNORE_INDEX
    from agoq.activation.loss import chunked_lm_head_cross_entropy

    for kwargs in (dict(), dict(recompute=True), dict(reduction="sum", chunk_size=16)):

        def fn(h, w):
            return chunked_lm_head_cross_entropy(
                h, w, targets, chunk_size=kwargs.get("chunk_size", 8), **{k: v for k, v in kwargs.items() if k != "chunk_size"}
            )

        ref = torch.autograd.grad(fn(hidden, weight), (hidden, weight))
        explained = torch._dynamo.explain(fn)(hidden, weight)
        assert explained.graph_break_count == 0, (kwargs, [r.reason for r in explained.break_reasons])
        got = torch.autograd.grad(torch.compile(fn, fullgraph=True, backend="aot_eager")(hidden, weight), (hidden, weight))
        for g, r in zip(got, ref):
            assert float((g - r).norm() / r.norm()) <= GRAD_RTOL, kwargs


def test_bad_targets_still_raise_from_inside_the_op():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    from agoq.activation.loss import chunked_lm_head_cross_entropy

    with pytest.raises(ValueError, match="target 16 is out of range for vocab 16"):
        chunked_lm_head_cross_entropy(hidden, weight, torch.full((1, 4), 16))


# ---- agoq train --train.compile=true ------------------------------------------------------------

TRAIN = [
    *SMALL_MODEL,
    "--data.batch_size=4",
    "--parallel.pp=1",
    "--parallel.dp=1",
    "--parallel.microbatches=1",
    "--precision.compute_dtype=fp32",
    "--optim.warmup_steps=0",
    "--train.steps=3",
    "--train.eval_every=0",
    "--train.baseline=false",
    "--checkpoint.every=0",
    "--checkpoint.resume=false",
]


def _train_runs(rank: int, world: int, cfgs: dict) -> dict:
    from torch._dynamo.utils import counters

    from agoq.launch.run import train_worker

    out = {}
    for name, cfg in cfgs.items():
        counters.clear()
        res = train_worker(cfg)
        out[name] = {"losses": [r["loss"] for r in res["records"]], "graphs": counters["stats"]["unique_graphs"]}
    return out


def test_train_compile_compiles_each_block_and_keeps_the_eager_losses(tmp_path):
    common = TRAIN + [*data_args()]
    cfgs = {
        "eager": load_config(None, common + [f"--train.out_dir={tmp_path / 'eager'}"]),
        "compiled": load_config(None, common + [f"--train.out_dir={tmp_path / 'compiled'}", "--train.compile=true"]),
    }
    assert cfgs["compiled"].train.compile and not cfgs["eager"].train.compile
    (runs,) = run_distributed(_train_runs, 1, cfgs)
    # Each decoder layer is compiled (the two share one graph, guarded per layer); nothing is eagerly.
    assert runs["eager"]["graphs"] == 0 and runs["compiled"]["graphs"] >= 1
    eager, compiled = runs["eager"]["losses"], runs["compiled"]["losses"]
    assert len(eager) == len(compiled) == 3
    # Step 1's loss is a forward of the same weights; later steps follow compiled gradients
    # (inductor's fp32 kernels reorder sums): equal within 1e-5 relative after two AdamW steps.
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_train_compile_at_tp2_keeps_the_eager_losses(tmp_path):
    # The tensor-parallel ops are custom ops that take the tp group and the byte counter by name,
    # so tp = 2 compiles each sharded decoder layer with fullgraph=True as tp = 1 does.
    common = TRAIN + ["--parallel.tp=2", *data_args()]
    cfgs = {
        "eager": load_config(None, common + [f"--train.out_dir={tmp_path / 'eager'}"]),
        "compiled": load_config(None, common + [f"--train.out_dir={tmp_path / 'compiled'}", "--train.compile=true"]),
    }
    assert cfgs["compiled"].parallel.tp == 2 and cfgs["compiled"].train.compile
    runs = run_distributed(_train_runs, 2, cfgs)
    for r in runs:
        assert r["eager"]["graphs"] == 0 and r["compiled"]["graphs"] >= 1
        eager, compiled = r["eager"]["losses"], r["compiled"]["losses"]
        assert len(eager) == len(compiled) == 3
        # The GEMMs and collectives run inside the ops, eagerly, in both runs; what inductor
        # compiles around them (rotary, residual adds, SDPA) may reorder fp32 sums: 1e-6 relative
        # over three steps (measured equal here).
        assert compiled == pytest.approx(eager, rel=1e-6)
    assert runs[0]["compiled"]["losses"] == runs[1]["compiled"]["losses"]


def test_train_compile_refuses_what_it_cannot_trace(tmp_path):
    common = TRAIN + [*data_args(), f"--train.out_dir={tmp_path}", "--train.compile=true"]
    with pytest.raises(ConfigError, match="uniform4"):
        load_config(None, common + ["--precision.activations=uniform4"])
