"""LAAQ: layer-aware quantization of the activations kept for backward (METHOD.md part 1)."""

from agoq.activation.ops import causal_attention, rms_norm, rms_norm_linear, saved_input_linear, swiglu_linear
from agoq.activation.policy import KINDS, POLICIES, ActivationPolicy, LayerPrecision, make_policy

__all__ = [
    "KINDS",
    "POLICIES",
    "ActivationPolicy",
    "LayerPrecision",
    "causal_attention",
    "make_policy",
    "rms_norm",
    "rms_norm_linear",
    "saved_input_linear",
    "swiglu_linear",
]
