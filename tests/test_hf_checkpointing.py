"""agoq under activation checkpointing: a patched HF model's checkpointed layers keep only their input
and recompute through agoq's fused ops, whichever way checkpointing is switched on; agoq's own model
does the same with precision.recompute_layers."""

import pytest
import torch

pytest.importorskip("transformers")

from agoq.activation.meter import SavedBytesMeter  # noqa: E402
from agoq.integrations.hf import apply_agoq  # noqa: E402
from tests.test_hf_integration import _grads, _ids, _model  # noqa: E402

# (order, use_reentrant): HF's gradient_checkpointing_enable before or after apply_agoq, either checkpoint.
WAYS = [("after", False), ("after", True), ("before", False), ("before", True)]


def _variant(agoq: bool, checkpointing: tuple[str, bool] | None, lora: bool = False) -> torch.nn.Module:
    model = _model()
    model.train()
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    order, reentrant = checkpointing or (None, None)
    enable = lambda: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})  # noqa: E731
    if order == "before":
        enable()
    if agoq:
        apply_agoq(model)
    if order == "after":
        enable()
    if lora and reentrant:
        model.enable_input_require_grads()  # PEFT's rule for reentrant checkpointing with frozen embeddings
    return model


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    with SavedBytesMeter(model) as meter:
        out = model(ids, labels=ids)
    total = meter.summary()["activation_total"]
    del out
    return total


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("way", WAYS, ids=[f"{o}-{'reentrant' if r else 'nonreentrant'}" for o, r in WAYS])
def test_agoq_with_checkpointing_keeps_less_than_checkpointing_alone_and_less_than_agoq_alone(way, lora):
    ids = _ids(seq=64)
    checkpointed = _saved_bytes(_variant(False, way, lora), ids)
    agoq = _saved_bytes(_variant(True, None, lora), ids)
    both = _saved_bytes(_variant(True, way, lora), ids)
    # Checkpointing keeps each layer's input; with agoq the logits are not kept either (the fused loss).
    assert both < checkpointed, (both, checkpointed)
    # And agoq's 4-bit tensors are kept for the layer being recomputed only, not for every layer.
    assert both < agoq, (both, agoq)


@pytest.mark.parametrize("way", WAYS, ids=[f"{o}-{'reentrant' if r else 'nonreentrant'}" for o, r in WAYS])
def test_checkpointing_leaves_agoqs_loss_and_gradients_unchanged(way):
    ids = _ids(seq=64)
    loss, grads = _grads(_variant(True, None), ids)
    loss_ac, grads_ac = _grads(_variant(True, way), ids)
    # The recompute runs the same fused ops on the same input: the same quantized tensors, the same gradients.
    assert loss_ac == loss
    assert grads_ac.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_agoqs_own_model_recomputes_its_checkpointed_layers_through_the_fused_ops():
    # precision.recompute_layers in agoq train: the first N layers of a stage checkpointed, agoq's policy inside.
    import torch.nn.functional as F

    from agoq.activation.policy import make_policy
    from agoq.models.hf import config_from_hf, from_hf_state_dict
    from agoq.models.llama import Llama

    hf, ids = _model(), _ids(seq=64)
    cfg = config_from_hf(hf.config)
    targets = F.pad(ids, (0, 1), value=-100)[:, 1:]
    runs = {}
    for recompute in (set(), {0, 1, 2}):
        ours = Llama(cfg, make_policy("agoq")).float()
        ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
        ours.recompute = recompute
        with SavedBytesMeter(ours) as meter:
            loss = ours(ids, targets)
        loss.backward()
        runs[bool(recompute)] = (meter.summary()["activation_total"], float(loss), {n: p.grad for n, p in ours.named_parameters()})
    (plain_bytes, plain_loss, plain), (ac_bytes, ac_loss, ac) = runs[False], runs[True]
    assert ac_loss == plain_loss and ac_bytes < plain_bytes
    for name in plain:
        torch.testing.assert_close(ac[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


# ---- compressed checkpoints: the checkpointed layer input kept at 8 bits ----------------------------

from agoq.activation.checkpoint import checkpoint_layer  # noqa: E402
from agoq.quant import parse_format  # noqa: E402
from tests.test_hf_integration import _model as _hf_model  # noqa: E402

INT8 = "int8/128"


def _layer_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """(bytes kept inside the decoder layers, all activation bytes) by the saved-tensors meter."""
    layers = dict(enumerate(model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers))
    with SavedBytesMeter(model, layers) as meter:
        out = model(ids, labels=ids)
    summary = meter.summary()
    del out
    return sum(sum(kinds.values()) for kinds in summary["layers"].values()), summary["activation_total"]


def _relative_error(grads: dict, reference: dict) -> float:
    """The gradients' error against the reference, all parameters together (relative Frobenius norm)."""
    err = sum(float((grads[n] - reference[n]).norm()) ** 2 for n in reference)
    return (err / sum(float(reference[n].norm()) ** 2 for n in reference)) ** 0.5


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compressed_checkpoints_keep_at_most_06x_of_checkpointings_bytes_in_the_layers(lora):
    # A width of whole 128-value blocks, in bf16 (what checkpointing keeps on a GPU): 8 bits plus a
    # scale per block against 16 bits.
    def variant(agoq_kw: dict | None) -> torch.nn.Module:
        model = _hf_model(hidden_size=128, num_attention_heads=8, head_dim=16).to(torch.bfloat16)
        model.train()
        if lora:
            peft = pytest.importorskip("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
        if agoq_kw is None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            apply_agoq(model, **agoq_kw)
        return model

    ids = _ids(seq=64)
    ac_layers, ac_total = _layer_bytes(variant(None), ids)
    int8_layers, int8_total = _layer_bytes(variant({"checkpoint_format": INT8}), ids)
    tokens, hidden = ids.numel(), 128
    assert ac_layers == 3 * tokens * hidden * 2  # each layer's bf16 input, nothing else
    assert int8_layers == 3 * (tokens * hidden + 4 * tokens * hidden // 128)  # codes and fp32 block scales
    assert int8_layers <= 0.6 * ac_layers and int8_total < ac_total


def test_compressed_checkpoints_gradient_error_is_within_1_5x_of_agoqs_activation_error():
    ids = _ids(seq=64)
    _, reference = _grads(_model(), ids)  # fp32, unpatched

    def error(**kw) -> float:
        model = _model()
        model.train()
        apply_agoq(model, **kw)
        return _relative_error(_grads(model, ids)[1], reference)

    agoq = error()
    compressed = error(checkpoint_format=INT8)
    assert 0 < agoq and 0 < compressed <= 1.5 * agoq, (compressed, agoq)
    # Alone (no 4-bit activations) the 8-bit input is a small error of its own.
    assert 0 < error(policy="bf16", checkpoint_format=INT8) <= 0.1 * agoq


def test_agoqs_own_model_keeps_its_recomputed_layers_inputs_in_the_checkpoint_format():
    import torch.nn.functional as F

    from agoq.activation.policy import make_policy
    from agoq.models.hf import config_from_hf, from_hf_state_dict
    from agoq.models.llama import Llama

    hf, ids = _model(), _ids(seq=64)
    cfg = config_from_hf(hf.config)
    targets = F.pad(ids, (0, 1), value=-100)[:, 1:]
    hf.zero_grad(set_to_none=True)
    _, reference = _grads(hf, ids)
    runs = {}
    for name, fmt in (("agoq", None), ("compressed", INT8)):
        ours = Llama(cfg, make_policy("agoq", checkpoint_format=fmt)).float()
        ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
        ours.recompute = {0, 1, 2} if fmt else set()
        with SavedBytesMeter(ours) as meter:
            loss = ours(ids, targets)
        loss.backward()
        ref = from_hf_state_dict({n: g for n, g in reference.items()}, cfg)
        grads = {n: p.grad for n, p in ours.named_parameters()}
        runs[name] = (meter.summary()["activation_total"], _relative_error(grads, {n: ref[n] for n in grads}))
    (agoq_bytes, agoq_err), (ckpt_bytes, ckpt_err) = runs["agoq"], runs["compressed"]
    assert ckpt_bytes < agoq_bytes
    assert 0 < agoq_err and 0 < ckpt_err <= 1.5 * agoq_err, (ckpt_err, agoq_err)


class _DropoutMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(128, 256), torch.nn.Linear(256, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.dropout(torch.relu(self.up(x)), p=0.3, training=True))


@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "frozen-input"])
def test_a_compressed_checkpoint_replays_the_forwards_dropout_and_autocast_and_runs_every_parameter_hook(input_grad):
    # Integers up to 127 in every 128-value block are exact at int8/128 (scale 1): the recompute then
    # starts from the very input, so its gradients are the uncheckpointed ones bit for bit, dropout
    # masks and bf16 autocast included.
    torch.manual_seed(0)
    layer = _DropoutMlp()
    x0 = torch.randint(-127, 128, (4, 16, 128)).float()
    x0[..., 0] = 127

    def run(checkpointed: bool) -> tuple[torch.Tensor, dict, torch.Tensor | None, list[str]]:
        layer.zero_grad(set_to_none=True)
        fired: list[str] = []
        handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n)) for n, p in layer.named_parameters()]
        x = x0.clone().requires_grad_(input_grad)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint_layer(layer, x, parse_format(INT8), layer.parameters()) if checkpointed else layer(x)
        torch.manual_seed(2)  # the recompute must not draw from the generator as it stands now
        (y.float() * torch.linspace(-1, 1, 128)).sum().backward()
        for h in handles:
            h.remove()
        return y, {n: p.grad for n, p in layer.named_parameters()}, x.grad, fired

    y, grads, gx, fired = run(False)
    y_ck, grads_ck, gx_ck, fired_ck = run(True)
    assert y_ck.dtype == torch.bfloat16 and torch.equal(y_ck, y)
    assert grads_ck.keys() == grads.keys() and all(torch.equal(grads_ck[n], grads[n]) for n in grads)
    assert (gx is None) == (gx_ck is None) == (not input_grad)
    if input_grad:
        assert torch.equal(gx_ck, gx)
    assert sorted(fired_ck) == sorted(fired) == sorted(n for n, _ in layer.named_parameters())


def test_compressed_checkpoints_keep_loras_dropout_masks_and_train_its_adapters():
    peft = pytest.importorskip("peft")
    ids = _ids(seq=64)

    def lora(**kw) -> tuple[float, dict]:
        model = _model()
        model.train()
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.2, target_modules="all-linear"))
        for name, p in model.named_parameters():  # B starts at zero: give the adapters an output
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(3))
        if kw is not None:
            apply_agoq(model, **kw)
        torch.manual_seed(5)
        return _grads(model, ids)

    loss_ref, reference = lora(policy="bf16")
    loss_agoq, agoq = lora()
    loss_ck, compressed = lora(checkpoint_format=INT8)
    # The same masks in forward (the same loss) and in the recompute (else the adapters' error jumps).
    assert loss_ck == loss_agoq == pytest.approx(loss_ref, rel=1e-6)
    assert set(compressed) == set(reference) and all("lora_" in n for n in reference)
    agoq_err = _relative_error(agoq, reference)
    assert 0 < agoq_err and _relative_error(compressed, reference) <= 1.5 * agoq_err


def test_agoq_train_takes_the_checkpoint_format_for_its_recomputed_layers_and_names_a_bad_one():
    from agoq.launch.config import ConfigError, load_config
    from agoq.launch.components import make_policy_for

    cfg = load_config(None, ["--precision.recompute_layers=1", f"--precision.checkpoint_format={INT8}"])
    assert make_policy_for(cfg.precision, cfg.parallel.pp, cfg.parallel.tp).checkpoint_input == parse_format(INT8)
    assert make_policy_for(load_config(None, ["--precision.recompute_layers=1"]).precision, 2, 1).checkpoint_input is None
    with pytest.raises(ConfigError, match=r"precision.checkpoint_format='int8/128' .* precision.recompute_layers=0; set precision.recompute_layers"):
        load_config(None, [f"--precision.checkpoint_format={INT8}"])
    with pytest.raises(ConfigError, match=r"precision.checkpoint_format='int9/128' is invalid"):
        load_config(None, ["--precision.recompute_layers=1", "--precision.checkpoint_format=int9/128"])


def test_the_trainer_mixin_passes_the_checkpoint_format_to_the_patch(tmp_path):
    from transformers import TrainingArguments

    from agoq.integrations.hf import agoq_patch
    from agoq.integrations.hf_trainer import AgoqTrainer

    model = _model()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    AgoqTrainer(model=model, args=args, agoq_checkpoint_format=INT8)
    assert agoq_patch(model).policy.checkpoint_input == parse_format(INT8)
