"""AGoQ's saved-activation savings for Hugging Face ``transformers`` models, patched in place.

``apply_agoq(model)`` gives a ``LlamaForCausalLM`` (and Mistral, Qwen2, Qwen3: their decoder layers
are built the same way) what ``agoq train`` gives agoq's own model:

- each decoder layer runs agoq's fused ops: RMSNorm + q/k/v and RMSNorm + gate/up keep only the
  quantized norm input, SwiGLU + down keeps quantized gate and up, o_proj keeps its input
  quantized. The attention core is the model's own (SDPA, eager, ...), unchanged, at full precision.
  Which tensor is kept at which format comes from :func:`agoq.activation.make_policy`, the recipe
  ``agoq train`` uses (``policy``, ``formats``, ``layer_bits``);
- with labels and autograd on, the final norm, LM head and cross-entropy run as one chunked op
  that keeps only the final norm's input and the labels, nothing vocab-sized
  (``outputs.logits`` is then None; :func:`agoq.activation.loss.normed_lm_head_cross_entropy`).

What does not change: the forward's values (fp32: equal to the unpatched model within float
rounding; bf16: agoq's norm multiplies by its weight in fp32 before one rounding, HF rounds twice),
the parameters and buffers (``save_pretrained`` writes the same files), and every call made without
autograd (``generate``, evaluation): it runs the model's own code. :func:`remove_agoq` undoes the patch.
A patched model pickles (``torch.save``) and loads (``torch.load(weights_only=False)``) still patched;
a model is patched once, at the top: patching a module inside a patched one, or around one, is refused.

PEFT LoRA (``peft.get_peft_model`` with a ``LoraConfig``) is fused: an adapter on q/k/v or gate/up
reads the norm output that the fused op recomputes in backward, one on o or down the input kept at
4 bits; PEFT's active adapters apply, with their dropout (its mask kept at 1 bit per element),
and disabled or merged adapters give the base projection. Base weights may be bitsandbytes 4-bit
(QLoRA): the fused ops dequantize them per GEMM. Call ``apply_agoq`` on the ``PeftModel`` (or on the
model inside it). A layer with a projection agoq cannot fuse (a DoRA or other LoRA variant, a
``lora_bias``, another adapter type) runs its own code, with a one-time warning naming it.
Biases on q/k/v/o (Qwen2) are added after the fused GEMMs; an MLP with biases or an activation other
than SiLU is refused when patching.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from agoq.activation.checkpoint import checkpoint_layer
from agoq.activation.lora import LoraAdapter
from agoq.activation.loss import normed_lm_head_cross_entropy
from agoq.activation.ops import rms_norm, rms_norm_linear, saved_input_linear, swiglu_linear
from agoq.activation.policy import ActivationPolicy, make_policy

# Decoder layers whose structure the patch relies on (pre-norm attention + SwiGLU MLP, HF RMSNorm).
SUPPORTED_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
_PATCH = "_agoq_patch"  # the model attribute holding the applied patch
# a projection's output (or its fused call) set by its layer for one call. Reset to None rather than
# popped, here and for _DEFERRED: torch 2.11's dynamo cannot trace ``module.__dict__.pop`` (a graph
# break per projection), while it traces the item read and write.
_PENDING = "_agoq_pending"
IGNORE_INDEX = -100  # transformers' label for "no loss here"
_DEFERRED = "_agoq_deferred"  # set on the final norm while the fused loss applies it itself
_OWNER = "_agoq_owner"  # every patched module's patch, to name the patched model when patching nests


@dataclass
class AgoqPatch:
    """What :func:`apply_agoq` changed on one model; :meth:`remove` restores it."""

    model: nn.Module
    policy: ActivationPolicy
    layers: dict[int, nn.Module]
    patched: list[nn.Module] = field(default_factory=list)  # modules given an instance ``forward``
    holders: list[nn.Module] = field(default_factory=list)  # wrappers (a PeftModel) that hold the patch too

    def remove(self) -> None:
        """Drop every patched forward (the modules' own class methods apply again)."""
        for module in self.patched:
            for name in ("forward", _PENDING, _DEFERRED, _OWNER):
                module.__dict__.pop(name, None)
        for layer in self.layers.values():
            for name in ("_agoq_index", "_agoq_policy", "_agoq_warned"):
                layer.__dict__.pop(name, None)
        for holder in (self.model, *self.holders):
            holder.__dict__.pop(_PATCH, None)
        self.patched.clear()
        self.holders.clear()


def apply_agoq(
    model: nn.Module,
    policy: str | ActivationPolicy = "agoq",
    *,
    formats: dict[str, str | None] | None = None,
    layer_bits: list[int] | tuple[int, ...] | None = None,
    fused_loss: bool | None = None,
    checkpoint_format: str | None = None,
) -> AgoqPatch:
    """Patch a transformers causal LM (or its base model) in place; returns the patch (``.remove()`` undoes it).

    ``policy``: 'agoq' (4-bit norm, SwiGLU and o_proj inputs), 'bf16' (the baseline's saved tensors
    through the same code), 'uniform4', or an :class:`ActivationPolicy`. ``formats`` overrides a
    kind's format (e.g. ``{"act_input": "fp4/128"}``); ``layer_bits`` gives each decoder layer its
    integer bit width (16 keeps it unquantized), as ``agoq train``'s stage bits do.
    ``checkpoint_format`` (e.g. 'int8/128'): compressed checkpoints. Every decoder layer is then
    checkpointed while training, keeping only its input, in that format, and running again from
    it in backward (HF's ``gradient_checkpointing_enable()`` is not needed for it).
    """
    _refuse_nested(model)
    outer, model = model, _unwrap_peft(model)
    layers = _decoder_layers(model)
    if isinstance(policy, str):
        policy = make_policy(policy, formats=formats, layer_bits=layer_bits, fused_loss=fused_loss, checkpoint_format=checkpoint_format)
    elif formats is not None or layer_bits is not None or fused_loss is not None or checkpoint_format is not None:
        raise ValueError("formats, layer_bits, fused_loss and checkpoint_format configure a policy by name; an ActivationPolicy already carries them")
    if policy.layer_bits is not None and len(policy.layer_bits) != len(layers):
        raise ValueError(f"layer_bits has {len(policy.layer_bits)} entries but the model has {len(layers)} decoder layers")
    for index, layer in layers.items():
        _check_layer(index, layer)
    patch = AgoqPatch(model, policy, layers)
    for index, layer in layers.items():
        layer._agoq_index, layer._agoq_policy = index, policy
        _set_forward(patch, layer, _layer_forward)
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            _set_forward(patch, proj, _projection_forward)  # its own forward again where its layer runs unpatched
        for head_norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):  # Qwen3
            if hasattr(head_norm, "variance_epsilon"):
                _set_forward(patch, head_norm, _head_norm_forward)
    norm = getattr(_base_model(model), "norm", None)
    head = getattr(model, "lm_head", None)
    # A forward someone else already replaced (TRL's SFTTrainer installs a fused LM head that keeps no
    # logits either, and its trainer calls it with its own arguments) keeps the head and the loss.
    own_forward = "forward" not in model.__dict__
    if policy.fused_loss and own_forward and hasattr(norm, "variance_epsilon") and isinstance(head, nn.Linear) and head.bias is None:
        _set_forward(patch, norm, _final_norm_forward)
        _set_forward(patch, model, _causal_lm_forward)
    model.__dict__[_PATCH] = patch
    if outer is not model:  # a PeftModel: found from the wrapper too, and removed with it
        outer.__dict__[_PATCH] = patch
        patch.holders.append(outer)
    return patch


def remove_agoq(model: nn.Module) -> None:
    """Undo :func:`apply_agoq` on ``model`` (nothing to do if it is not patched)."""
    patch = getattr(model, _PATCH, None)
    if patch is not None:
        patch.remove()


def agoq_patch(model: nn.Module) -> AgoqPatch | None:
    """The patch applied to ``model`` (or to the model a wrapper such as DDP holds), or None."""
    while model is not None:
        patch = model.__dict__.get(_PATCH) or _unwrap_peft(model).__dict__.get(_PATCH)
        if patch is not None:
            return patch
        model = getattr(model, "module", None)
    return None


# ---- finding and checking the layers -------------------------------------------------------------


def _refuse_nested(model: nn.Module) -> None:
    """Refuse, in one line naming the patched module, a model that is, holds or sits inside a patched one.

    Two patches over the same layers would overwrite each other's forwards, and removing either
    would leave the other's attribute behind.
    """
    if model.__dict__.get(_PATCH) is not None:
        raise ValueError("this model is already patched by agoq; call remove_agoq(model) first to change the policy")
    for name, module in model.named_modules():
        if module.__dict__.get(_PATCH) is not None:
            raise ValueError(
                f"its submodule {name!r} ({type(module).__name__}) is already patched by agoq; "
                f"call remove_agoq(model.{name}) first, then patch once at the top"
            )
    for module in model.modules():
        owner = module.__dict__.get(_OWNER)
        if owner is not None:
            outer = type(owner.model).__name__
            raise ValueError(
                f"this {type(model).__name__} is inside a {outer} already patched by agoq; patch once at the top "
                f"(the {outer}, already done), or call remove_agoq on the {outer} first"
            )


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT ``PeftModel``; any other model itself."""
    get_base = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base) and type(model).__module__.startswith("peft.") else model


def _base_model(model: nn.Module) -> nn.Module:
    """The decoder stack: ``model.model`` of a causal LM, or the model itself."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model


def _decoder_layers(model: nn.Module) -> dict[int, nn.Module]:
    layers = getattr(_base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers; apply_agoq patches LLaMA-architecture causal LMs")
    for layer in layers:
        if type(layer).__name__ not in SUPPORTED_LAYERS:
            raise ValueError(f"{type(layer).__name__} is not a supported decoder layer; apply_agoq supports {', '.join(SUPPORTED_LAYERS)}")
    return dict(enumerate(layers))


def _check_layer(index: int, layer: nn.Module) -> None:
    """Refuse, naming what is unsupported, a layer the fused ops would compute differently."""
    mlp = layer.mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(mlp, name)
        proj = getattr(proj, "base_layer", proj)
        if isinstance(proj, nn.Linear) and proj.bias is not None:
            raise ValueError(f"layer {index}: mlp.{name} has a bias; agoq's fused SwiGLU has none (config.mlp_bias must be False)")
    act = getattr(mlp, "act_fn", None)
    if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        raise ValueError(f"layer {index}: the MLP activation is {type(act).__name__}; agoq's fused SwiGLU needs SiLU (hidden_act='silu')")
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not hasattr(norm, "variance_epsilon"):
            raise ValueError(f"layer {index}: {type(norm).__name__} is not an RMSNorm with variance_epsilon")


def _set_forward(patch: AgoqPatch, module: nn.Module, fn: Callable[..., Any]) -> None:
    # A partial of a module-level function pickles by name (a bound method would pickle as
    # getattr(module, fn.__name__), which the loaded module lacks), so torch.save of a patched model loads.
    module.__dict__["forward"] = functools.partial(fn, module)
    module.__dict__[_OWNER] = patch
    patch.patched.append(module)


@dataclass(frozen=True)
class _Projection:
    """What the fused ops compute for one projection: its base weight (maybe 4-bit), bias and active adapters."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapters: tuple[LoraAdapter, ...] = ()


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _is_base_linear(module: nn.Module) -> bool:
    """A plain Linear, or a bitsandbytes 4-bit Linear whose weight is quantized."""
    if type(module) is nn.Linear:
        return True
    bnb_4bit = type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")
    return bnb_4bit and getattr(module.weight, "quant_state", None) is not None


def _projection(module: nn.Module) -> _Projection | str:
    """The projection as the fused ops compute it (PEFT's forward, for its active adapters), or what agoq cannot fuse."""
    if _is_base_linear(module):
        return _Projection(module.weight, module.bias)
    base = getattr(module, "base_layer", None)
    if not type(module).__module__.startswith("peft.tuners.lora") or base is None or not hasattr(module, "lora_A"):
        return f"a {type(module).__name__}"
    if not _is_base_linear(base):
        return f"a {type(module).__name__} over a {type(base).__name__}"
    if module.disable_adapters and module.merged:
        module.unmerge()  # as PEFT's forward does: disabled adapters mean the base weight itself
    if module.disable_adapters or module.merged:
        return _Projection(base.weight, base.bias)
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}):
            return f"a {type(module.lora_variant[name]).__name__} (LoRA variant) adapter {name!r}"
        if getattr(module, "lora_bias", {}).get(name):
            return f"an adapter {name!r} with lora_bias=True"
        drop = module.lora_dropout[name]
        if type(drop) not in (nn.Dropout, nn.Identity):
            return f"an adapter {name!r} with a {type(drop).__name__} dropout"
        p = float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0
        adapters.append(LoraAdapter(module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]), p))
    return _Projection(base.weight, base.bias, tuple(adapters))


def _layer_projections(layer: nn.Module) -> list[_Projection] | str:
    """The layer's seven projections, q/k/v/o/gate/up/down, or the first one agoq cannot fuse and why."""
    found = []
    for name in _PROJECTIONS:
        part, attr = name.split(".")
        proj = _projection(getattr(getattr(layer, part), attr))
        if isinstance(proj, str):
            return f"{name} is {proj}"
        found.append(proj)
    return found


# ---- patched forwards ----------------------------------------------------------------------------


# A decoder layer's key/value cache arguments across transformers releases.
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _checkpointed(layer: nn.Module) -> bool:
    """Whether HF's gradient checkpointing is on for ``layer`` in this call (gradient_checkpointing_enable, training)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


def _layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The decoder layer through agoq's fused ops; the model's own forward without autograd or where a projection cannot be fused.

    Under HF's gradient checkpointing the layer keeps only its input and its recompute runs the
    fused ops again, so backward holds one layer's 4-bit tensors at a time. transformers up to 5.17
    checkpoints in the layer's ``__call__``, around this forward; later releases wrap the class's
    ``forward``, which this instance forward replaces, so it checkpoints itself there.
    """
    checkpointed = _checkpointed(self)
    # A reentrant checkpoint runs its first forward without autograd: the fused ops run there too,
    # so the output and its recompute are the same values.
    fused = (torch.is_grad_enabled() or checkpointed) and not args
    projections = _layer_projections(self) if fused else None
    if not isinstance(projections, list):
        if isinstance(projections, str) and not self.__dict__.get("_agoq_warned"):
            self._agoq_warned = True
            warnings.warn(f"agoq: decoder layer {self._agoq_index} runs unpatched (no saving): {projections} agoq cannot fuse", stacklevel=2)
        return type(self).forward(self, hidden_states, *args, **kwargs)
    own_checkpoint = hasattr(type(self).forward, "__wrapped__")
    compressed = self._agoq_policy.checkpoint_input
    if compressed is not None and self.training and torch.is_grad_enabled():
        if checkpointed and not own_checkpoint and not self.__dict__.get("_agoq_warned"):
            self._agoq_warned = True
            warnings.warn(
                "agoq: checkpoint_format checkpoints the decoder layers itself, and this transformers release checkpoints "
                "around the layer call as well, so each layer runs a third time; call gradient_checkpointing_disable()",
                stacklevel=2,
            )
        # The recompute must not write the key/value cache a second time (HF's checkpoint drops it too).
        kwargs = {k: (None if k in _CACHE_ARGUMENTS else v) for k, v in kwargs.items() if k != "use_cache"}
        return checkpoint_layer(functools.partial(_fused_layer, self, projections, **kwargs), hidden_states, compressed, self.parameters())
    if checkpointed and torch.is_grad_enabled() and own_checkpoint:
        return self._gradient_checkpointing_func(functools.partial(_fused_layer, self, projections, **kwargs), hidden_states)
    return _fused_layer(self, projections, hidden_states, **kwargs)


def _fused_layer(self: nn.Module, projections: list[_Projection], hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    q, k, v, o, gate_proj, up_proj, down_proj = projections
    p = self._agoq_policy.layer(self._agoq_index)
    attn = self.self_attn
    x = hidden_states
    modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    for module in modules:  # a module put in since patching (merge_and_unload's base Linear) reads its output too
        if "forward" not in module.__dict__:
            _set_forward(self.__dict__[_OWNER], module, _projection_forward)
    norm = self.input_layernorm
    qkv = rms_norm_linear(x, norm.weight, norm.variance_epsilon, [q.weight, k.weight, v.weight], p.norm_input, [q.adapters, k.adapters, v.adapters])
    try:
        # The attention module runs its own code (rope, cache, attention kernel, q/k norms) on
        # projections it reads back from its q/k/v_proj, already computed from the fused norm.
        for module, proj, out in zip(modules, (q, k, v), qkv):
            module.__dict__[_PENDING] = out if proj.bias is None else out + proj.bias
        attn.o_proj.__dict__[_PENDING] = lambda h: _with_bias(saved_input_linear(h, o.weight, p.out_proj_input, adapters=o.adapters), o.bias)
        attn_out = attn(hidden_states=x, **kwargs)[0]
    finally:
        for module in modules:
            module.__dict__[_PENDING] = None
    x = x + attn_out
    norm = self.post_attention_layernorm
    gate, up = rms_norm_linear(
        x, norm.weight, norm.variance_epsilon, [gate_proj.weight, up_proj.weight], p.norm_input, [gate_proj.adapters, up_proj.adapters]
    )
    return x + swiglu_linear(gate, up, down_proj.weight, p.act_input, down_proj.adapters)


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def _projection_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The output its layer computed (q/k/v), or the fused call it set (o_proj); else the module's own forward."""
    pending = self.__dict__.get(_PENDING)
    self.__dict__[_PENDING] = None
    if pending is None:
        return type(self).forward(self, x, *args, **kwargs)
    return pending(x) if callable(pending) else pending


def _head_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head q/k norm through agoq's RMSNorm under autograd: keeps x and an fp32 rstd per
    head, where transformers' keeps an fp32 copy of x and its normed product as well."""
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    return rms_norm(x, self.weight, self.variance_epsilon)


def _final_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x itself while the fused loss owns the final norm; the model's own norm otherwise."""
    if self.__dict__.get(_DEFERRED):
        return x
    return type(self).forward(self, x)


def _causal_lm_forward(self: nn.Module, input_ids: torch.Tensor | None = None, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """The chunked LM head + loss when training with labels (no logits kept or returned); the model's own otherwise."""
    plain = labels is None or not torch.is_grad_enabled() or args or kwargs.get("output_hidden_states")
    norm = getattr(self.model, "norm", None)
    if plain or kwargs.get("logits_to_keep", 0) not in (0, None) or not hasattr(norm, "variance_epsilon"):
        return type(self).forward(self, input_ids, *args, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    num_items = kwargs.get("num_items_in_batch")
    norm.__dict__[_DEFERRED] = True
    try:
        # The decoder's output as a dataclass whatever the config says: config.return_dict=False
        # would make it a tuple, which the model's own forward then fails to read.
        outputs = self.model(input_ids=input_ids, return_dict=True, **kwargs)
    finally:
        norm.__dict__[_DEFERRED] = None
    hidden = outputs.last_hidden_state  # before the final norm, which the loss applies and recomputes
    if shift_labels is None:
        # transformers' causal-LM loss: token t predicts label t + 1, the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.to(hidden.device)
    reduction = "sum" if num_items is not None else "mean"
    loss = normed_lm_head_cross_entropy(
        hidden, norm.weight, norm.variance_epsilon, self.lm_head.weight, targets, ignore_index=ignore_index, reduction=reduction
    )
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    # The dataclass's own field table: torch.compile traces a dict lookup, not dataclasses.fields()
    # on a class (a graph break); hasattr would not do, since past_key_values is also a property.
    names = CausalLMOutputWithPast.__dataclass_fields__
    extra = {name: getattr(outputs, name, None) for name in ("cache", "past_key_values") if name in names}
    result = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions, **extra)
    if return_dict:
        return result
    # transformers' tuple drops None fields; the logits' place is kept (as None, since they are
    # never formed) so that out[0] is the loss and the cache stays where callers index it.
    return (loss, None, *result.to_tuple()[1:])
