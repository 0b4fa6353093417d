"""Activation precision policies: which tensor saved for backward is stored in which format.

Kinds of saved tensors in a decoder layer (METHOD.md, part 1):
- ``norm_input``: the input of each RMSNorm (the norm and the following GEMM input are recomputed);
- ``act_input``: the SwiGLU gate/up tensors (SiLU(gate) * up and the FFN2 input are recomputed);
- ``out_proj_input``: the input of the attention out-projection. When attention keeps its output at
  full precision and the out-projection input is a view of it (the LLaMA layer's layout), that view
  is saved instead: a quantized copy would add 0.25U + scales and save nothing (measured with
  ``python -m benchmarks.activation``). The format applies when the input is a copy or attention is quantized;
- ``attention``: what the attention core keeps (q, k, v, output, softmax statistics).
A kind mapped to ``None`` is kept as the bf16 baseline keeps it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

from agoq.quant import QuantFormat, parse_format

KINDS = ("norm_input", "act_input", "out_proj_input", "attention")
DEFAULT_ACTIVATION_FORMAT = "int4/128"
POLICIES = ("bf16", "agoq", "uniform4")


@dataclass(frozen=True)
class LayerPrecision:
    """Formats of one decoder layer's saved tensors; None keeps the baseline tensor."""

    norm_input: QuantFormat | None = None
    act_input: QuantFormat | None = None
    out_proj_input: QuantFormat | None = None
    attention: QuantFormat | None = None


@dataclass(frozen=True)
class ActivationPolicy:
    """A named precision policy: per-kind formats, optional per-layer bit widths, loss path."""

    name: str = "bf16"
    formats: LayerPrecision = field(default_factory=LayerPrecision)
    # Per-layer integer bit widths (for pipeline stages); overrides the bits of every quantized
    # kind of that layer except attention. None: every layer uses ``formats``.
    layer_bits: tuple[int, ...] | None = None
    # Chunked LM head + cross-entropy that never keeps [tokens, vocab] logits.
    fused_loss: bool = False
    # The format a checkpointed decoder layer keeps its input in (agoq.activation.checkpoint); None
    # keeps it as plain activation checkpointing does, in its dtype.
    checkpoint_input: QuantFormat | None = None
    # The fused loss's backward path, private: agoq's own trainer (and its planner) choose it for
    # their pipeline through with_loss_path; any other caller keeps the defaults.
    # Recompute each chunk's logits in backward instead of keeping a precomputed [vocab, hidden]
    # weight gradient per in-flight micro-batch: the loss then keeps only the hidden states
    # (tokens x hidden), for one more LM-head GEMM in backward.
    _loss_recompute: bool = True
    # Instead of recomputing, compute both gradients in forward and accumulate the LM-head weight's
    # into ``weight.grad`` there (its post-accumulate hooks fold it into the gradient buffer at
    # once): nothing vocab-sized is kept either, and no second LM-head GEMM is run. For a caller
    # that backpropagates the loss with grad_output 1 (the trainer's pipelined last stage); see
    # agoq.activation.loss.chunked_lm_head_cross_entropy.
    _loss_weight_grad_in_forward: bool = False

    def layer(self, index: int) -> LayerPrecision:
        """The formats of decoder layer ``index``."""
        if self.layer_bits is None:
            return self.formats
        if not 0 <= index < len(self.layer_bits):
            raise IndexError(f"policy {self.name!r} has bits for {len(self.layer_bits)} layers, asked for layer {index}")
        bits = self.layer_bits[index]

        def with_bits(fmt: QuantFormat | None) -> QuantFormat | None:
            if fmt is None or bits >= 16:
                return None
            return QuantFormat("int", bits, fmt.block_size)

        f = self.formats
        return replace(f, norm_input=with_bits(f.norm_input), act_input=with_bits(f.act_input), out_proj_input=with_bits(f.out_proj_input))


def make_policy(
    name: str = "agoq",
    formats: dict[str, str | QuantFormat | None] | None = None,
    layer_bits: list[int] | tuple[int, ...] | None = None,
    fused_loss: bool | None = None,
    fmt: str | QuantFormat = DEFAULT_ACTIVATION_FORMAT,
    *,
    checkpoint_format: str | QuantFormat | None = None,
    overrides: dict[str, str | QuantFormat | None] | None = None,
) -> ActivationPolicy:
    """Build a named policy ('bf16', 'agoq', 'uniform4'), with per-kind format overrides and layer bits.

    This is the one place that says which saved tensors a policy quantizes: 'agoq' the norm inputs,
    SwiGLU's gate and up and the out-projection input, 'uniform4' attention's as well, each at
    ``fmt``; ``formats`` then sets single kinds (e.g. ``{"act_input": "fp4/128"}``; None or 'bf16'
    keeps a kind unquantized). ``checkpoint_format`` (e.g. 'int8/128'): the format checkpointed
    layers keep their input in (None: their dtype). ``overrides`` is the deprecated spelling of ``formats``.
    """
    if overrides is not None:
        if formats is not None:
            raise ValueError("make_policy got both formats and overrides (its deprecated spelling); pass formats only")
        warnings.warn("make_policy(overrides=...) is deprecated; pass formats=... (the same per-kind formats)", DeprecationWarning, stacklevel=2)
        formats = overrides
    if name not in POLICIES:
        raise ValueError(f"unknown activation policy {name!r}; use one of {', '.join(POLICIES)}")
    base = parse_format(fmt)
    if name == "bf16":
        precision = LayerPrecision()
    elif name == "agoq":
        precision = LayerPrecision(norm_input=base, act_input=base, out_proj_input=base)
    else:
        precision = LayerPrecision(norm_input=base, act_input=base, out_proj_input=base, attention=base)
    for kind, spec in (formats or {}).items():
        if kind not in KINDS:
            raise ValueError(f"unknown saved-tensor kind {kind!r}; use one of {', '.join(KINDS)}")
        precision = replace(precision, **{kind: None if spec in (None, "bf16", "none") else parse_format(spec)})
    if layer_bits is not None:
        for b in layer_bits:
            if b not in (2, 3, 4, 5, 6, 8, 16):
                raise ValueError(f"layer bit width {b} is not supported; use 2, 3, 4, 5, 6, 8 or 16 (16 = keep bf16)")
        layer_bits = tuple(int(b) for b in layer_bits)
    return ActivationPolicy(
        name=name,
        formats=precision,
        layer_bits=layer_bits,
        fused_loss=(name != "bf16") if fused_loss is None else fused_loss,
        checkpoint_input=None if checkpoint_format in (None, "bf16", "none") else parse_format(checkpoint_format),
    )


def with_loss_path(policy: ActivationPolicy, *, recompute: bool, weight_grad_in_forward: bool = False) -> ActivationPolicy:
    """``policy`` with the fused loss's backward path that agoq's pipelined trainer takes (and its planner counts)."""
    return replace(policy, _loss_recompute=recompute, _loss_weight_grad_in_forward=weight_grad_in_forward)
