"""LAAQ: layer-aware quantization of the activations kept for backward (METHOD.md part 1).

Here: the precision policy and the fused ops a model calls, the loss that keeps no logits, and the
meter of saved bytes. Their accounting (``accounting``, ``loss``) stays in its modules.
"""

from agoq.activation.loss import chunked_lm_head_cross_entropy
from agoq.activation.meter import SavedBytesMeter
from agoq.activation.ops import causal_attention, rms_norm, rms_norm_linear, rotary_embedding, saved_input_linear, swiglu_linear
from agoq.activation.policy import KINDS, POLICIES, ActivationPolicy, LayerPrecision, make_policy

__all__ = [
    "KINDS",
    "POLICIES",
    "ActivationPolicy",
    "LayerPrecision",
    "SavedBytesMeter",
    "causal_attention",
    "chunked_lm_head_cross_entropy",
    "make_policy",
    "rms_norm",
    "rms_norm_linear",
    "rotary_embedding",
    "saved_input_linear",
    "swiglu_linear",
]
