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
