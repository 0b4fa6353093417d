"""LAAQ: layer-aware quantization of the activations kept for backward (METHOD.md part 1)."""

from agoq.activation.accounting import U_bytes, layer_saved_bytes
from agoq.activation.loss import (
    chunked_lm_head_cross_entropy,
    default_chunk_size,
    loss_saved_bytes,
    plain_lm_head_cross_entropy,
)
from agoq.activation.meter import METER_KINDS, SavedBytesMeter, meter_scope
from agoq.activation.ops import (
    causal_attention,
    kept_by_attention,
    rms_norm,
    rms_norm_linear,
    rotary_embedding,
    saved_input_linear,
    swiglu_linear,
)
from agoq.activation.policy import KINDS, POLICIES, ActivationPolicy, LayerPrecision, make_policy

__all__ = [
    "KINDS",
    "METER_KINDS",
    "POLICIES",
    "ActivationPolicy",
    "LayerPrecision",
    "SavedBytesMeter",
    "U_bytes",
    "causal_attention",
    "chunked_lm_head_cross_entropy",
    "default_chunk_size",
    "kept_by_attention",
    "layer_saved_bytes",
    "loss_saved_bytes",
    "make_policy",
    "meter_scope",
    "plain_lm_head_cross_entropy",
    "rms_norm",
    "rms_norm_linear",
    "rotary_embedding",
    "saved_input_linear",
    "swiglu_linear",
]
