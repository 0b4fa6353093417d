"""agoq.integrations.hf: a transformers model patched in place keeps its outputs, files and no-grad path,
saves what agoq's own model saves, and gets agoq's gradients."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from agoq.activation.meter import SavedBytesMeter  # noqa: E402
from agoq.integrations.hf import agoq_patch, apply_agoq, remove_agoq  # noqa: E402
from agoq.models.hf import config_from_hf, from_hf_state_dict  # noqa: E402
from agoq.models.llama import Llama  # noqa: E402
from agoq.activation.policy import make_policy  # noqa: E402

# Odd sizes on purpose: GQA 3:1, head_dim 16, an intermediate size that is not a multiple of the
# 128-value block, untied head, non-default rope_theta and rms_norm_eps.
ODD = dict(
    vocab_size=301,
    hidden_size=96,
    intermediate_size=200,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=50000.0,
    rms_norm_eps=3e-6,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)
ARCHS = ("Llama", "Mistral", "Qwen2", "Qwen3")


def _model(arch: str = "Llama", seed: int = 0, **overrides) -> nn.Module:
    config = getattr(transformers, f"{arch}Config")(**{**ODD, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).float()
    with torch.no_grad():  # biases start at zero; make them matter (Qwen2's q/k/v)
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _ids(batch: int = 2, seq: int = 37, vocab: int = ODD["vocab_size"], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _grads(model: nn.Module, ids: torch.Tensor, **kw) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, **kw).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved(model: nn.Module, ids: torch.Tensor) -> dict:
    with SavedBytesMeter(model, dict(enumerate(model.model.layers))) as meter:
        out = model(ids, labels=ids)
    summary = meter.summary()
    del out
    return summary


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_loss_equal_the_unpatched_model_in_fp32(arch):
    model, ids = _model(arch), _ids()
    with torch.enable_grad():
        ref_logits = model(ids).logits.detach()
        ref_loss = model(ids, labels=ids).loss.detach()
    apply_agoq(model)
    with torch.enable_grad():  # the fused path runs under autograd
        out = model(ids)
        loss = model(ids, labels=ids)
    assert _rel(out.logits.detach(), ref_logits) <= 1e-6
    assert loss.logits is None  # the fused loss keeps and returns no logits
    assert abs(float(loss.loss.detach()) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_policy_gradients_equal_the_unpatched_gradients(arch):
    # The 'bf16' policy quantizes nothing: every gradient must be the model's own (biases, untied
    # head, Qwen3's q/k norms, the deferred final norm and the loss's label shift included).
    model, ids = _model(arch), _ids()
    ref_loss, ref = _grads(model, ids)
    apply_agoq(model, "bf16")
    loss, got = _grads(model, ids)
    assert got.keys() == ref.keys()
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    worst = max(_rel(got[n], ref[n]) for n in ref)
    assert worst <= 1e-5, worst


def test_agoq_gradients_equal_those_of_agoq_own_model_with_the_same_weights():
    # agoq's own Llama with the same policy is what the fused-op tests bound; the patched HF model
    # runs the same ops, so its gradients must agree with it to float rounding, not merely to the
    # int4 error (which is ~0.1-0.2 relative on this tiny random model). One difference is by
    # design: agoq's attention keeps its output, which o_proj then saves as a view (no copy), while
    # transformers' attention hands o_proj a fresh copy, which the patch keeps in int4; o_proj's
    # input stays unquantized here so that both sides save the same tensors.
    hf = _model("Llama")
    ids = _ids()
    cfg = config_from_hf(hf.config)
    policy = make_policy("agoq", {"out_proj_input": None})
    ours = Llama(cfg, policy).float()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    targets = F.pad(ids, (0, 1), value=-100)[:, 1:]
    ours_loss = ours(ids, targets)
    ours_loss.backward()
    apply_agoq(hf, policy)
    _, got = _grads(hf, ids)
    ref_loss, ref = _grads(_unpatched_copy(hf), ids)
    mine = {n: p.grad for n, p in ours.named_parameters()}
    from agoq.models.hf import to_hf_state_dict

    ours_as_hf = to_hf_state_dict(mine, cfg)
    quant_error = max(_rel(got[n], ref[n]) for n in ref)
    assert 0.01 < quant_error < 0.5, quant_error  # int4 really is on, and bounded
    for name, g in ours_as_hf.items():
        assert _rel(got[name], g) <= 1e-4, name


def _unpatched_copy(model: nn.Module) -> nn.Module:
    clone = type(model)(model.config).float()
    clone.load_state_dict(model.state_dict())
    return clone


def test_saved_bytes_per_layer_are_at_most_030_of_the_unpatched_model():
    model, ids = _model("Llama"), _ids(seq=128)
    before = _saved(model, ids)
    apply_agoq(model)
    after = _saved(model, ids)
    for layer in before["layers"]:
        ratio = sum(after["layers"][layer].values()) / sum(before["layers"][layer].values())
        assert ratio <= 0.30, (layer, ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_outside_the_layers_do_not_grow_with_the_vocabulary(dtype):
    # What the loss keeps is the final norm's input and the labels: the same bytes at any vocab,
    # and at most 0.1 of the unpatched model's logits path from vocab = 8 x hidden (LLaMA-2's 32000
    # over 4096; Qwen's and LLaMA-3's are larger) upward.
    kept = {}
    for vocab in (8 * 96, 32 * 96):
        model = _model("Llama", vocab_size=vocab).to(dtype)
        ids = _ids(seq=64, vocab=vocab)
        before = sum(_saved(model, ids)["outside"].values())
        apply_agoq(model)
        kept[vocab] = sum(_saved(model, ids)["outside"].values())
        assert kept[vocab] <= 0.1 * before, (vocab, kept[vocab], before)
    assert kept[8 * 96] == kept[32 * 96]


def test_no_grad_calls_and_generate_run_the_model_own_code():
    model, ids = _model("Llama"), _ids(batch=1, seq=9)
    with torch.no_grad():
        ref = model(ids).logits
    ref_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    apply_agoq(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref_tokens)


def test_save_pretrained_writes_the_same_files_and_remove_restores_the_model(tmp_path):
    model, ids = _model("Qwen2"), _ids()
    model.save_pretrained(tmp_path / "before")
    with torch.enable_grad():
        ref = model(ids).logits.detach()
    patch = apply_agoq(model, layer_bits=[4, 8, 16])
    assert agoq_patch(model) is patch and agoq_patch(nn.Sequential(model)) is None
    model.save_pretrained(tmp_path / "after")
    for f in sorted((tmp_path / "before").iterdir()):
        assert f.read_bytes() == (tmp_path / "after" / f.name).read_bytes(), f.name
    with pytest.raises(ValueError, match="already patched"):
        apply_agoq(model)
    remove_agoq(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.enable_grad():
        assert torch.equal(model(ids).logits.detach(), ref)
    apply_agoq(model)  # and it can be patched again


def test_layer_bits_set_each_layer_format_as_agoq_train_does():
    model, ids = _model("Llama"), _ids(seq=128)
    apply_agoq(model, layer_bits=[4, 8, 16])
    layers = _saved(model, ids)["layers"]
    quantized = {k: layers[k]["norm_input"] + layers[k]["act_input"] + layers[k]["out_proj_input"] for k in layers}
    # int8 keeps about twice the int4 bytes; 16 bits keeps the unquantized tensors (no norm_input copy).
    assert 1.8 < quantized["1"] / quantized["0"] < 2.2
    assert layers["2"]["gemm_input"] > 0 and layers["0"]["gemm_input"] == 0
    with pytest.raises(ValueError, match="3 decoder layers"):
        apply_agoq(_model("Llama"), layer_bits=[4, 4])


def test_num_items_in_batch_gives_the_trainer_sum_reduction():
    model, ids = _model("Llama"), _ids()
    labels = ids.clone()
    labels[0, :10] = -100
    n = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)  # as under gradient accumulation
    with torch.enable_grad():
        ref = model(ids, labels=labels, num_items_in_batch=n).loss
        apply_agoq(model)
        got = model(ids, labels=labels, num_items_in_batch=n).loss
    assert abs(float(got.detach()) - float(ref.detach())) <= 1e-6 * abs(float(ref.detach()))


def _structure(out) -> tuple:
    """What a caller reads of an output: its kind, and each field's name (or place) and type."""
    if isinstance(out, tuple):
        return ("tuple", tuple(type(v).__name__ for v in out))
    return (type(out).__name__, tuple((k, type(v).__name__) for k, v in out.items()))


def _without_logits(structure: tuple) -> tuple:
    """The unpatched model's structure with the logits absent, as the fused loss never forms them."""
    kind, fields = structure
    if kind == "tuple":  # the logits' place is kept, holding None
        return kind, (fields[0], "NoneType", *fields[2:])
    return kind, tuple(f for f in fields if f[0] != "logits")


@pytest.mark.parametrize("use_cache", [None, True, False])
@pytest.mark.parametrize("return_dict", [None, True, False])
def test_every_return_dict_and_use_cache_gives_the_unpatched_structure_and_loss(return_dict, use_cache):
    kw = {k: v for k, v in (("return_dict", return_dict), ("use_cache", use_cache)) if v is not None}
    model, ids = _model("Llama"), _ids()
    with torch.enable_grad():
        ref = model(ids, labels=ids, **kw)
        patched = _unpatched_copy(model)
        apply_agoq(patched)
        got = patched(ids, labels=ids, **kw)
    assert _structure(got) == _without_logits(_structure(ref))
    assert abs(float(got[0].detach()) - float(ref[0].detach())) <= 1e-5 * float(ref[0].detach())
    got[0].backward()  # the loss a tuple carries is the one that trains
    assert all(p.grad is not None for p in patched.parameters())


def test_config_return_dict_false_gives_the_tuple_that_return_dict_false_gives():
    # transformers 5.25's own forward fails under config.return_dict=False (its decoder returns a
    # tuple it then reads as a dataclass), so the reference is the argument form on a default config.
    model, ids = _model("Llama"), _ids()
    with torch.enable_grad():
        ref = model(ids, labels=ids, return_dict=False)
        patched = _model("Llama", return_dict=False)
        apply_agoq(patched)
        got = patched(ids, labels=ids)
        as_dataclass = patched(ids, labels=ids, return_dict=True)
    assert _structure(got) == _without_logits(_structure(ref))
    assert abs(float(got[0].detach()) - float(ref[0].detach())) <= 1e-5 * float(ref[0].detach())
    assert type(as_dataclass).__name__ == "CausalLMOutputWithPast" and as_dataclass.logits is None


class _Adapter(nn.Module):
    """A LoRA-like wrapper: the base projection plus a small trainable low-rank update."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.a = nn.Linear(base.in_features, 2, bias=False)
        self.b = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.b(self.a(x))


def test_a_layer_with_adapter_wrapped_projections_runs_unpatched_with_a_warning():
    model, ids = _model("Llama"), _ids()
    model.model.layers[1].self_attn.q_proj = _Adapter(model.model.layers[1].self_attn.q_proj)
    with torch.enable_grad():
        ref = model(ids).logits.detach()
    apply_agoq(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.enable_grad():
            out = model(ids).logits.detach()
    assert [str(w.message) for w in caught if "agoq" in str(w.message)] == [
        "agoq: decoder layer 1 runs unpatched (no saving): self_attn.q_proj is a _Adapter agoq cannot fuse"
    ]
    assert _rel(out, ref) <= 1e-6


def test_unsupported_models_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="mlp_bias must be False"):
        apply_agoq(_model("Llama", mlp_bias=True))
    with pytest.raises(ValueError, match="needs SiLU"):
        apply_agoq(_model("Llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="no decoder layers"):
        apply_agoq(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown activation policy"):
        apply_agoq(_model("Llama"), "int3")


def _ddp_loop(rank: int, world: int) -> dict:
    # The README's own-loop recipe: patch, wrap in DDP, switch the reduction, train a step.
    import hashlib

    from torch.nn.parallel import DistributedDataParallel

    from agoq.integrations.hf_trainer import use_8bit_gradients

    grads, counter = {}, None
    for mode in ("fp32", "int8"):
        model = _model("Llama")
        apply_agoq(model)
        ddp = DistributedDataParallel(model)
        if mode == "int8":
            counter = use_8bit_gradients(ddp)
        ids = _ids(seed=10 + rank)  # each rank its own data
        ddp(ids, labels=ids).loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    # Tensors do not travel back through the result queue: plain numbers and digests do.
    return {
        "worst_rel": max(_rel(grads["int8"][n], g) for n, g in grads["fp32"].items()),
        "digest": hashlib.sha256(b"".join(g.numpy().tobytes() for g in grads["int8"].values())).hexdigest(),
        "bytes": counter.bytes(),
        "params": sum(g.numel() for g in grads["int8"].values()),
    }


def test_use_8bit_gradients_under_ddp_averages_like_ddp_within_the_int8_error():
    from tests._dist import run_distributed

    ranks = run_distributed(_ddp_loop, 2)
    assert ranks[0]["digest"] == ranks[1]["digest"]  # identical on every rank
    # int8/256 blocks, each within one parameter's gradient (norm weights included), quantized
    # twice (all-to-all, all-gather): every gradient within 2% (the flat bucket gave 21% on a norm).
    assert 0 < ranks[0]["worst_rel"] <= 0.02
    expected = 2 * (2 - 1) / 2 * ranks[0]["params"] * (1 + 4 / 256)
    assert expected <= ranks[0]["bytes"] <= 1.02 * expected  # each gradient's last block padded
