"""``agoq plan --hf-config``: the fine-tuning plan is held to a real transformers model's step.

A small LlamaForCausalLM (random init, fp32, on this CPU), LoRA r=8 on every projection and a full
fine-tune, each variant: the planned saved activations equal the saved-tensor meter's count within
2%, and the planned peak the step's peak tensor bytes (torch.profiler) within 10%, the model built,
stepped and measured by benchmarks/_finetune.py as the fine-tuning benchmarks do. Then real-shaped
8B configs: the longest contexts order as the variants' savings say, and bad configs get one clear
line.
"""

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from agoq.activation.meter import SavedBytesMeter  # noqa: E402
from agoq.plan.finetune import VARIANTS, FineTune, HFModel, plan_variant  # noqa: E402
from agoq.quant.backend import use_backend  # noqa: E402
from benchmarks._finetune import LORA, build_model, plan_build_options, step_peak, train_step, trainer_optimizer  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 256, 704, 2, 4, 2, 4096, 256
LORA_R, DROPOUT = LORA["r"], LORA["dropout"]  # the benchmarks' adapters


def _config_dict(**over: object) -> dict:
    cfg = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    return {**cfg, **over}


def _measure(variant: str, lora: bool) -> tuple[int, int]:
    """(activation bytes the meter counts in one forward, peak tensor bytes of one training step) of a
    real model, built, stepped and measured as benchmarks/finetune_scale.py does."""
    import tempfile
    from pathlib import Path

    cfg = {**{k: v for k, v in _config_dict().items() if k != "model_type"}, "max_position_embeddings": SEQ}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(cfg, seed=0, tmp=Path(tmp), lora=lora, **plan_build_options(variant))
    optimizer = trainer_optimizer(model, lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 1, SEQ), generator=torch.Generator().manual_seed(0))
    meter = SavedBytesMeter(model)
    train_step(model, optimizer, ids[0], meter)  # also makes the optimizer's state
    peak, _ = step_peak(model, optimizer, ids[1])
    return meter.activation_bytes, peak


@contextmanager
def _as_committed():
    """The committed runs' threads (at most 2) and the torch reference path: the same bytes kept on
    every backend, and no compilation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        with use_backend("torch"):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, bool], tuple[int, int]]:
    with _as_committed():
        return {(v, lora): _measure(v, lora) for lora in (True, False) for v in VARIANTS}


def _planned(variant: str, lora: bool):
    model = HFModel("llama", HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HIDDEN // HEADS, VOCAB, False, False, False)
    ft = FineTune(model, SEQ, 1, "fp32", lora_r=LORA_R if lora else 0, lora_dropout=DROPOUT, device="cpu")
    return plan_variant(ft, variant)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_planned_peak_is_the_measured_step_peak_within_10_percent(measured, variant, lora):
    saved, peak = measured[(variant, lora)]
    plan = _planned(variant, lora)
    # What the forward keeps (the plan's saved activations and the loss's kept tensors) is what the meter counts.
    planned_saved = _planned_forward_kept(variant, lora)
    assert abs(planned_saved - saved) <= 0.02 * saved, (variant, lora, planned_saved, saved)
    assert abs(plan.peak - peak) <= 0.10 * peak, (variant, lora, plan.peak, peak, plan.phase, plan.components)


# ---- held at a user's size: the committed runs of benchmarks.finetune_scale (llama3.2-1b widths,
# vocabulary 128,256, 2,048 and 8,192 tokens), each planned again by today's planner.

SCALE_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _scale_rows() -> dict[tuple[str, int, str], tuple[dict, dict]]:
    rows = {}
    for seq in (2048, 8192):
        results = json.loads((SCALE_RESULTS / f"finetune_scale_{seq}.json").read_text())["results"]
        for r in results["rows"]:
            rows[(r["mode"], r["seq_len"], r["variant"])] = (results["model"], r)
    return rows


@pytest.mark.parametrize("seq", [2048, 8192])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_planned_peak_is_within_10_percent_of_each_peak_finetune_scale_measured(mode, seq):
    from benchmarks.finetune_scale import QLORA, plan

    rows = _scale_rows()
    for variant in VARIANTS + (QLORA if mode == "lora" else ()):
        model, row = rows[(mode, seq, variant)]
        assert "note" not in row, (variant, row["note"])
        planned = plan({**model, "mode": mode, "seq_len": seq, "variant": variant}).peak
        measured = row["peak_tensor_bytes"]
        assert abs(planned - measured) <= 0.10 * measured, (variant, planned / measured, row["planned_phase"])


@pytest.mark.parametrize("seq", [2048, 8192])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_at_llama_widths_agoq_with_checkpoints_keeps_at_most_checkpointings_layer_bytes(mode, seq):
    """The saved-tensor meter's count per decoder layer in the committed runs: agoq + AC keeps what
    AC keeps (the layer's input), compressed checkpoints at most 0.6x of it."""
    rows = _scale_rows()
    ac, agoq_ac, ckpt8 = (rows[(mode, seq, v)][1]["saved_bytes_per_layer"] for v in ("ac", "agoq_ac", "agoq_ckpt8"))
    assert set(ac) == set(agoq_ac) == set(ckpt8) == {"0", "1"}
    layer_input = seq * 2048 * 4  # one fp32 [tokens, hidden] tensor
    for layer in ac:
        assert ac[layer] == layer_input and agoq_ac[layer] <= ac[layer]
        assert ckpt8[layer] <= 0.6 * ac[layer]


@pytest.mark.parametrize("variant, lora", [("agoq", True), ("agoq_ac", True), ("agoq", False)], ids=["agoq-lora", "agoq_ac-lora", "agoq-full"])
def test_at_a_long_context_the_planned_peak_counts_the_attentions_backward(variant, lora):
    """4,096 tokens at hidden 256: under agoq a layer's peak is its attention's backward, not its MLP's."""
    import tempfile
    from pathlib import Path

    seq, vocab = 4096, 128
    cfg = {**{k: v for k, v in _config_dict(vocab_size=vocab).items() if k != "model_type"}, "max_position_embeddings": seq}
    with _as_committed():
        with tempfile.TemporaryDirectory() as tmp:
            model = build_model(cfg, seed=0, tmp=Path(tmp), lora=lora, **plan_build_options(variant))
        optimizer = trainer_optimizer(model, lr=1e-3)
        ids = torch.randint(0, vocab, (2, 1, seq), generator=torch.Generator().manual_seed(0))
        train_step(model, optimizer, ids[0], None)
        peak, _ = step_peak(model, optimizer, ids[1])
    model_shape = HFModel("llama", HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HIDDEN // HEADS, vocab, False, False, False)
    plan = plan_variant(FineTune(model_shape, seq, 1, "fp32", lora_r=LORA_R if lora else 0, lora_dropout=DROPOUT, device="cpu"), variant)
    assert plan.phase.startswith("backward of layer") and abs(plan.peak - peak) <= 0.10 * peak, (plan.peak / peak, plan.components)


def _planned_forward_kept(variant: str, lora: bool) -> int:
    from agoq.plan.finetune import checkpoint_input_bytes, layer_bytes, outside_saved_bytes, rotary_bytes

    model = HFModel("llama", HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HIDDEN // HEADS, VOCAB, False, False, False)
    ft = FineTune(model, SEQ, 1, "fp32", lora_r=LORA_R if lora else 0, lora_dropout=DROPOUT, device="cpu")
    if variant in ("ac", "agoq_ac", "agoq_ckpt8"):
        layers = LAYERS * checkpoint_input_bytes(ft, variant)
        rotary = 0  # held by the checkpoints' arguments, not saved through autograd
    else:
        layers = layer_bytes(ft, variant, first=True) + (LAYERS - 1) * layer_bytes(ft, variant)
        rotary = rotary_bytes(ft)
    return layers + rotary + sum(outside_saved_bytes(ft, variant))


QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
LLAMA31_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def _plan_cli(tmp_path, config: dict, *args: str) -> tuple[int, str, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from agoq.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["plan", "--hf-config", str(path), *args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("config", [QWEN3_8B, LLAMA31_8B], ids=["qwen3-8b", "llama-3.1-8b"])
def test_8b_lora_longest_contexts_order_as_the_variants_savings(tmp_path, config):
    longest = {}
    for gpu in ("24GiB", "80GiB"):
        code, out, _ = _plan_cli(tmp_path, config, "--seq-len", "4096", "--gpu-memory", gpu, "--json")
        assert code == 0
        plan = json.loads(out)
        assert plan["schema"] == "agoq.plan.finetune/1" and plan["fine_tune"]["method"] == "lora"
        variants = plan["variants"]
        for v in VARIANTS:
            parts = variants[v]["components"]
            assert variants[v]["peak_bytes"] == sum(parts.values()) and all(b >= 0 for b in parts.values())
            # An 8B model's bf16 weights, 15-16 GiB, are in every variant.
            assert 14 * 2**30 < parts["weights"] < 16 * 2**30
        longest[gpu] = {v: variants[v]["max_seq_len"] for v in VARIANTS}
        ctx = {v: n or 0 for v, n in longest[gpu].items()}
        assert ctx["agoq_ckpt8"] >= ctx["agoq_ac"] >= ctx["ac"] >= ctx["plain"]
        assert all(n % 256 == 0 for n in ctx.values())
    for v in VARIANTS:
        assert (longest["80GiB"][v] or 0) > (longest["24GiB"][v] or 0)
    # 80 GiB holds a long context for every variant; compressed checkpoints reach far beyond plain LoRA.
    assert longest["80GiB"]["plain"] >= 4096 and longest["80GiB"]["agoq_ckpt8"] >= 16 * longest["80GiB"]["plain"]
    # The markdown says so plainly where a variant does not fit.
    code, out, _ = _plan_cli(tmp_path, config, "--seq-len", "1048576", "--gpu-memory", "24GiB")
    assert code == 0 and "| plain |" in out and "does not fit" in out


def test_qwen3_keeps_its_head_norms_and_a_full_fine_tune_trains_every_weight(tmp_path):
    from agoq.plan.finetune import HFModel

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_8B))
    model = HFModel.from_config(path)
    assert model.qk_norm and model.head_dim == 128 and not model.qkv_bias
    lora = FineTune(model, 4096, lora_r=16)
    full = FineTune(model, 4096, lora_r=0)
    assert "qk_norm" in _terms(lora, "plain") and "qk_norm" in _terms(lora, "agoq")
    p_lora, p_full = plan_variant(lora, "agoq_ckpt8"), plan_variant(full, "agoq_ckpt8")
    # Full: fp32 m and v for all 8.19 B parameters; LoRA r=16: adapters only.
    assert p_full.components["optimizer"] >= 8 * model.parameters() and p_full.components["adapters"] == 0
    assert p_lora.components["optimizer"] < p_lora.components["weights"] / 40
    qlora = plan_variant(FineTune(model, 4096, lora_r=16, qlora=True), "agoq_ckpt8")
    assert qlora.components["weights"] < 0.4 * p_lora.components["weights"]


def _terms(ft, variant):
    from agoq.plan.finetune import layer_terms

    return layer_terms(ft, variant)


@pytest.mark.parametrize(
    "config, message",
    [
        ({**LLAMA31_8B, "model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({k: v for k, v in LLAMA31_8B.items() if k != "intermediate_size"}, "intermediate_size is missing"),
        ({**LLAMA31_8B, "num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
    ],
    ids=["model_type", "missing", "zero"],
)
def test_a_config_the_plan_cannot_read_gets_one_line_and_exit_2(tmp_path, config, message):
    code, out, err = _plan_cli(tmp_path, config, "--gpu-memory", "24GiB")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err
