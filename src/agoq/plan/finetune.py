"""Fine-tuning plans (``agoq plan --hf-config``): the peak bytes of one GPU fine-tuning a Hugging Face
Llama, Mistral, Qwen2 or Qwen3 (LoRA, QLoRA or every weight) under five ways of keeping activations,
and the longest context and largest micro-batch that fit.

Variants: ``plain`` (transformers and PEFT as they are), ``ac`` (transformers' activation
checkpointing of every layer, non-reentrant), ``agoq`` (:func:`agoq.integrations.hf.apply_agoq`),
``agoq_ac`` (both) and ``agoq_ckpt8`` (``apply_agoq(checkpoint_format="int8/128")``).

What a decoder layer keeps is :func:`agoq.activation.accounting.layer_saved_bytes` (the count the
saved-tensor meter checks to the byte) plus what a transformers layer and PEFT's adapters keep
beyond it, each a named term of :func:`layer_terms`, measured with the meter (tests/test_plan_finetune.py).
The LM head's bytes are :func:`agoq.activation.loss.loss_saved_bytes` and ``loss_work_bytes``, a
layer's backward working set :func:`agoq.plan.accounting.layer_backward_bytes`. The peak is the
worst moment of one step (:func:`peak_bytes`): the loss's backward, each layer's backward (as the
layers' saved tensors are freed, their gradients are made), and the end of backward. Assumptions
are in docs/plan.md ("Fine-tuning plans").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable
from pathlib import Path

import torch

from agoq.activation.accounting import layer_saved_bytes
from agoq.activation.lora import mask_bytes
from agoq.activation.loss import default_chunk_size, loss_saved_bytes, loss_work_bytes
from agoq.activation.policy import DEFAULT_ACTIVATION_FORMAT, LayerPrecision, make_policy
from agoq.plan.accounting import layer_backward_bytes
from agoq.plan.config import DTYPES, PlanError
from agoq.quant import parse_format

SCHEMA = "agoq.plan.finetune/1"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
VARIANTS = ("plain", "ac", "agoq", "agoq_ac", "agoq_ckpt8")
CHECKPOINTED = ("ac", "agoq_ac", "agoq_ckpt8")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT_FORMAT = "int8/128"  # agoq_ckpt8's layer inputs
AGOQ_FORMAT = parse_format(DEFAULT_ACTIVATION_FORMAT)  # apply_agoq's default policy
COMPONENTS = ("weights", "adapters", "gradients", "optimizer", "saved_activations", "logits_or_loss", "transient")
ADAPTER_BYTES = 4  # PEFT keeps LoRA weights in fp32 (get_peft_model's autocast_adapter_dtype=True)
ADAM_STATE_BYTES = 2 * 4  # AdamW's fp32 m and v per trainable value
STEP_BYTES = 4  # AdamW's per-tensor step counter
INDEX_BYTES = 8  # int64 token ids
# HF's attention backward beside what the layer keeps, measured on a CPU (fp32, SDPA, hidden 256 to
# 2048, 2K to 8K tokens, full and LoRA): RoPE's and SDPA's backward and the fused norm + q/k/v
# backward hold about this many [tokens, hidden] tensors at once (a full fine-tune; LoRA adapters on
# the projections add about 2). Under agoq the MLP's inputs are kept at 4 bits, so at long contexts
# this, not the MLP's backward, is a layer's largest working set; without agoq the attention's
# tensors are mostly the layer's own saved ones.
ATTENTION_BACKWARD_TENSORS = 19
LORA_ATTENTION_BACKWARD_TENSORS = 2
RSTD_BYTES = 4  # the fp32 1/rms per row an RMSNorm keeps
NF4_BLOCK = 64  # bitsandbytes' nf4: two 4-bit codes per byte and one fp32 absmax per 64 values
SEARCH_STEP = 256  # the longest context is searched to a multiple of this
MAX_SEARCH = 1 << 24  # tokens or sequences: beyond any context or batch a GPU holds


@dataclass(frozen=True)
class HFModel:
    """The architecture of a transformers config.json, as the plan reads it."""

    model_type: str
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama's attention_bias
    qk_norm: bool  # Qwen3: an RMSNorm over each head of q and k
    name: str = "config.json"

    @classmethod
    def from_config(cls, path: str | Path) -> HFModel:
        """The architecture in a transformers config.json; PlanError (one line) for one the plan cannot read."""
        p = Path(path)
        try:
            cfg = json.loads(p.read_text())
        except OSError as e:
            raise PlanError(f"cannot read --hf-config {str(p)!r} ({e.strerror}); give the path of a model's config.json") from None
        except ValueError as e:
            raise PlanError(f"--hf-config {str(p)!r} is not JSON ({e}); give a model's config.json") from None
        if not isinstance(cfg, dict):
            raise PlanError(f"--hf-config {str(p)!r} holds no JSON object; give a model's config.json")
        kind = cfg.get("model_type")
        if kind not in MODEL_TYPES:
            raise PlanError(
                f"{p.name}: model_type {kind!r} is not supported; use a Llama, Mistral, Qwen2 or Qwen3 config.json "
                f"(model_type one of {', '.join(MODEL_TYPES)})"
            )

        def number(key: str, default: int | None = None) -> int:
            value = cfg.get(key, default)
            if value is None:
                raise PlanError(f"{p.name}: {key} is missing; add it (a {kind} config.json has it) or use the model's own config.json")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{p.name}: {key}={value!r} must be a positive integer; fix it in the config.json")
            return value

        hidden, heads = number("hidden_size"), number("num_attention_heads")
        kv_heads = number("num_key_value_heads", heads)
        if heads % kv_heads:
            raise PlanError(f"{p.name}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; fix the config.json")
        if cfg.get("head_dim") is None and hidden % heads:
            raise PlanError(f"{p.name}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; add head_dim")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise PlanError(f"{p.name}: hidden_act={act!r}; the plan (and apply_agoq) covers SwiGLU MLPs, hidden_act 'silu'")
        if cfg.get("mlp_bias"):
            raise PlanError(f"{p.name}: mlp_bias=true; the plan (and apply_agoq) covers MLPs without biases")
        return cls(
            model_type=kind,
            hidden=hidden,
            intermediate=number("intermediate_size"),
            n_layers=number("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=number("head_dim", hidden // heads),
            vocab=number("vocab_size"),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            name=p.name if p.parent.name in ("", ".") else f"{p.parent.name}/{p.name}",
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each projection of a decoder layer."""
        h, q, kv, i = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def layer_other_numel(self) -> int:
        """Values of a decoder layer outside its projections' weights: norm gains and q/k/v biases."""
        n = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return n + ((self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0)

    def parameters(self) -> int:
        """Every parameter value of the causal LM."""
        layer = sum(o * i for o, i in self.projection_shapes().values()) + self.layer_other_numel()
        return self.n_layers * layer + self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden


@dataclass(frozen=True)
class FineTune:
    """One fine-tuning configuration on one GPU: the model, the adapters, the batch, the memory."""

    model: HFModel
    seq_len: int
    micro_batch: int = 1
    dtype: str = "bf16"  # the weights' and activations' dtype
    lora_r: int = 16  # 0: full fine-tune (every weight trained)
    lora_targets: tuple[str, ...] = PROJECTIONS
    lora_dropout: float = 0.05
    qlora: bool = False  # base projections in bitsandbytes nf4
    grad_accum: int = 1  # micro-batches per optimizer step; above 1 the gradients are held throughout
    gpu_memory: int | None = None
    reserved: int = 2 * 2**30  # as agoq plan: CUDA context, allocator fragmentation
    device: str = "cuda"  # where the step runs: the dropout mask's dtype and agoq's chunk sizes depend on it

    def validate(self) -> None:
        """PlanError (one line) for a configuration that cannot be planned."""
        for name in ("seq_len", "micro_batch", "grad_accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"{name.replace('_', '-')}={v!r} must be a positive integer")
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype={self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        if not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise PlanError(f"lora-r={self.lora_r!r} must be a positive integer, or 0 for a full fine-tune")
        bad = [t for t in self.lora_targets if t not in PROJECTIONS]
        if bad or (self.lora_r and not self.lora_targets):
            raise PlanError(f"lora-targets {','.join(bad) or '(none)'} unknown; use a comma-separated subset of {','.join(PROJECTIONS)}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise PlanError(f"lora-dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.qlora and not self.lora_r:
            raise PlanError("--qlora trains LoRA adapters over 4-bit weights; give --lora-r above 0")
        if self.gpu_memory is not None and self.gpu_memory <= self.reserved:
            raise PlanError(f"gpu-memory={self.gpu_memory} is not above the reserve of {self.reserved} bytes; lower --reserved")

    @property
    def es(self) -> int:
        """Bytes per value of the weights and activations."""
        return DTYPES[self.dtype].itemsize

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch * self.seq_len

    @property
    def full(self) -> bool:
        """Whether every weight is trained (no adapters)."""
        return self.lora_r == 0

    @property
    def capacity(self) -> int | None:
        """Bytes a step may take: the GPU's memory less the reserve."""
        return None if self.gpu_memory is None else self.gpu_memory - self.reserved


# ---- what one decoder layer keeps -------------------------------------------------------------------


def layer_terms(ft: FineTune, variant: str, first: bool = False) -> dict[str, int]:
    """Bytes one decoder layer keeps for backward in ``variant``, by named term: agoq's
    ``layer_saved_bytes`` count, then what transformers and PEFT keep beyond it (negative where
    they keep less). ``first``: layer 0, whose input needs no gradient when the embedding is frozen."""
    m, es, t = ft.model, ft.es, ft.tokens
    agoq = variant.startswith("agoq")
    precision = make_policy("agoq").layer(0) if agoq else LayerPrecision()
    # transformers' o_proj reads the SDPA output through a view and keeps nothing of its own;
    # apply_agoq's keeps its input at 4 bits beside it.
    kinds = layer_saved_bytes(
        ft.micro_batch,
        ft.seq_len,
        m.hidden,
        m.n_heads,
        m.n_kv_heads,
        m.head_dim,
        m.intermediate,
        DTYPES[ft.dtype],
        precision,
        out_proj_input_shared=not agoq,
    )
    terms = {"layer_saved_bytes": sum(kinds.values())}
    shapes = m.projection_shapes()
    adapters = () if ft.full else ft.lora_targets
    heads = m.n_heads + m.n_kv_heads
    if agoq:
        # agoq's fused ops recompute every GEMM input (the adapters' too) and keep the dropout mask at 1 bit.
        if ft.lora_dropout > 0:
            terms["lora_dropout_masks"] = sum(mask_bytes(t, shapes[a][1]) for a in adapters)
        if m.qk_norm:  # agoq's RMSNorm over each head keeps its input and an fp32 rstd per row
            terms["qk_norm"] = t * heads * (m.head_dim * es + RSTD_BYTES)
        return terms
    # transformers' RMSNorm keeps an fp32 copy of its input (the input itself in fp32) and, with a
    # trainable gain, the normed rows the gain multiplies.
    terms["hf_norm_fp32_input"] = 2 * t * m.hidden * (4 - es)
    if ft.full:
        terms["hf_norm_gain_input"] = 2 * t * m.hidden * es
    if m.qk_norm:
        terms["qk_norm"] = t * heads * (m.head_dim * (4 + (es if ft.full else 0)) + RSTD_BYTES)
    if not ft.full:
        # A frozen GEMM keeps no input; a LoRA A keeps its (dropout's) input in fp32: the GEMM's
        # input itself only where that already is fp32 with no dropout.
        shares = ft.lora_dropout == 0 and es == ADAPTER_BYTES
        groups = {
            ("q_proj", "k_proj", "v_proj"): t * m.hidden * es,
            ("gate_proj", "up_proj"): t * m.hidden * es,
            ("down_proj",): t * m.intermediate * es,
        }
        terms["frozen_gemm_inputs"] = -sum(b for group, b in groups.items() if not (shares and set(group) & set(adapters)))
        # Dropout on a CPU keeps its scaled fp32 noise; CUDA's fused dropout a bool mask.
        mask = (1 if ft.device == "cuda" else ADAPTER_BYTES) if ft.lora_dropout > 0 else 0
        terms["lora_a_inputs"] = 0 if shares else sum(t * shapes[a][1] * (ADAPTER_BYTES + mask) for a in adapters)
        terms["lora_b_inputs"] = len(adapters) * t * ft.lora_r * ADAPTER_BYTES
        if first:
            # The embedding is frozen: layer 0's input needs no gradient, so its first norm keeps
            # nothing, nor does dropout on that norm's output (q/k/v's masks).
            qkv_masks = sum(t * m.hidden * mask for a in adapters if a in ("q_proj", "k_proj", "v_proj"))
            terms["first_layer_frozen_input"] = -(t * m.hidden * 4 + t * RSTD_BYTES + qkv_masks)
    return terms


def layer_bytes(ft: FineTune, variant: str, first: bool = False) -> int:
    """Bytes one decoder layer keeps for backward in ``variant`` without checkpointing."""
    return sum(layer_terms(ft, variant, first).values())


def checkpoint_input_bytes(ft: FineTune, variant: str) -> int:
    """What a checkpointed layer keeps: its input, in its dtype or (agoq_ckpt8) at 8 bits."""
    if variant == "agoq_ckpt8":
        return parse_format(CHECKPOINT_FORMAT).stored_nbytes((ft.tokens, ft.model.hidden))
    return ft.tokens * ft.model.hidden * ft.es


def rotary_bytes(ft: FineTune) -> int:
    """transformers' cos and sin tables, [1, seq, head_dim] each, kept once for every layer."""
    return 2 * ft.seq_len * ft.model.head_dim * ft.es


# ---- weights, adapters, gradients, optimizer ---------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes held for the whole step, and each layer's gradient."""

    weights: int
    adapters: int
    optimizer: int
    layer_grads: int  # one decoder layer's
    head_grads: int  # the LM head's and final norm's (made first in backward)
    embedding_grads: int  # made last

    @property
    def grads(self) -> int:
        """Every gradient of one step."""
        return self.head_grads + self.embedding_grads


def _nf4_bytes(numel: int) -> int:
    """bitsandbytes' nf4 storage of ``numel`` values: packed codes and an fp32 absmax per block."""
    return -(-numel // 2) + 4 * -(-numel // NF4_BLOCK)


def state_bytes(ft: FineTune) -> StateBytes:
    """Weights (base in the dtype or nf4), LoRA adapters, AdamW state and the gradients' sizes."""
    m, es = ft.model, ft.es
    shapes = m.projection_shapes()
    proj = sum(o * i for o, i in shapes.values())
    # bitsandbytes quantizes each projection's weight on its own (its blocks never span two).
    proj_bytes = sum(_nf4_bytes(o * i) for o, i in shapes.values()) if ft.qlora else proj * es
    embed = m.vocab * m.hidden
    head = 0 if m.tie_embeddings else embed
    weights = m.n_layers * (proj_bytes + m.layer_other_numel() * es) + (embed + head + m.hidden) * es
    tensors_per_layer = len(shapes) + 2 + (2 if m.qk_norm else 0) + (3 if m.qkv_bias else 0)
    if ft.full:
        layer_numel = proj + m.layer_other_numel()
        trainable = m.parameters()
        tensors = m.n_layers * tensors_per_layer + 2 + (0 if m.tie_embeddings else 1)
        return StateBytes(
            weights=weights,
            adapters=0,
            optimizer=trainable * ADAM_STATE_BYTES + tensors * STEP_BYTES,
            layer_grads=layer_numel * es,
            head_grads=(head + m.hidden) * es + (embed * es if m.tie_embeddings else 0),  # a tied head's gradient is the embedding's
            embedding_grads=0 if m.tie_embeddings else embed * es,
        )
    layer_numel = sum(ft.lora_r * (shapes[a][0] + shapes[a][1]) for a in ft.lora_targets)
    trainable = m.n_layers * layer_numel
    return StateBytes(
        weights=weights,
        adapters=trainable * ADAPTER_BYTES,
        optimizer=trainable * ADAM_STATE_BYTES + m.n_layers * 2 * len(ft.lora_targets) * STEP_BYTES,
        layer_grads=layer_numel * ADAPTER_BYTES,
        head_grads=0,
        embedding_grads=0,
    )


# ---- the peak of one step ----------------------------------------------------------------------------


@dataclass
class VariantPlan:
    """One variant's peak, split into components, and what fits."""

    variant: str
    components: dict[str, int]
    phase: str  # the moment of the step that is the peak
    layer_terms: dict[str, int]
    fits: bool | None = None
    max_seq_len: int | None = None
    max_micro_batch: int | None = None

    @property
    def peak(self) -> int:
        """Everything held at the step's peak."""
        return sum(self.components.values())

    def to_dict(self) -> dict[str, object]:
        """JSON form (schema agoq.plan.finetune/1)."""
        return {
            "components": dict(self.components),
            "peak_bytes": self.peak,
            "peak_phase": self.phase,
            "layer_saved_bytes_by_term": dict(self.layer_terms),
            "fits": self.fits,
            "max_seq_len": self.max_seq_len,
            "max_micro_batch": self.max_micro_batch,
        }


def outside_saved_bytes(ft: FineTune, variant: str) -> tuple[int, int]:
    """(kept outside the layers besides the loss: final norm, head input, token ids; the loss's own)."""
    m, es, t = ft.model, ft.es, ft.tokens
    dtype = DTYPES[ft.dtype]
    ids = t * INDEX_BYTES if ft.full else 0  # the embedding's backward reads the ids
    if variant.startswith("agoq"):
        # The fused loss keeps the final norm's input and the targets, recomputing the norm.
        return ids, loss_saved_bytes(t, m.hidden, m.vocab, dtype, fused=True, recompute=True)
    head_input = t * m.hidden * es
    norm = t * m.hidden * 4 + t * RSTD_BYTES + (head_input if ft.full else 0)  # transformers' RMSNorm, as in the layers
    loss = loss_saved_bytes(t, m.hidden, m.vocab, dtype, fused=False) - head_input
    return ids + norm + (head_input if ft.full else 0), loss


def plan_variant(ft: FineTune, variant: str) -> VariantPlan:
    """The peak of one step of ``variant`` and its components."""
    if variant not in VARIANTS:
        raise PlanError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
    m, es, t = ft.model, ft.es, ft.tokens
    st = state_bytes(ft)
    held = {"weights": st.weights, "adapters": st.adapters, "optimizer": st.optimizer}
    accumulating = ft.grad_accum > 1
    ckpt = variant in CHECKPOINTED
    agoq = variant.startswith("agoq")
    first, other = layer_bytes(ft, variant, first=True), layer_bytes(ft, variant)
    kept = [checkpoint_input_bytes(ft, variant)] * m.n_layers if ckpt else [first] + [other] * (m.n_layers - 1)
    rotary = rotary_bytes(ft)
    ids_and_norm, loss_kept = outside_saved_bytes(ft, variant)
    loss_work = loss_backward_bytes(ft, agoq)
    all_grads = st.head_grads + m.n_layers * st.layer_grads + st.embedding_grads
    layer_work = layer_work_bytes(ft, agoq)
    incoming = t * m.hidden * es  # the gradient flowing down the residual stream

    phases: list[tuple[str, dict[str, int]]] = []
    grads = all_grads if accumulating else 0
    phases.append(
        (
            "loss backward",
            {
                **held,
                "gradients": grads,
                "saved_activations": sum(kept) + rotary + ids_and_norm,
                "logits_or_loss": loss_kept + loss_work,
                "transient": 0,
            },
        )
    )
    made = st.head_grads
    ids = t * INDEX_BYTES if ft.full else 0
    for i in reversed(range(m.n_layers)):
        recompute = (first if i == 0 and not agoq else other) if ckpt else 0
        if variant == "agoq_ckpt8":
            recompute += t * m.hidden * es  # the dequantized layer input it recomputes from
        made += st.layer_grads  # a layer's weight gradients are made as its backward starts
        phases.append(
            (
                f"backward of layer {i}",
                {
                    **held,
                    "gradients": all_grads if accumulating else made,
                    "saved_activations": sum(kept[: i + 1]) + rotary + ids,
                    "logits_or_loss": 0,
                    "transient": recompute + layer_work + incoming,
                },
            )
        )
    # A tied embedding's backward makes a second vocabulary x hidden gradient before it is added to the head's.
    end = incoming + (m.vocab * m.hidden * es if ft.full and m.tie_embeddings else 0)
    phases.append(("end of backward", {**held, "gradients": all_grads, "saved_activations": ids, "logits_or_loss": 0, "transient": end}))
    phase, parts = max(phases, key=lambda p: sum(p[1].values()))
    return VariantPlan(variant, {k: parts[k] for k in COMPONENTS}, phase, layer_terms(ft, variant, first=False))


def layer_work_bytes(ft: FineTune, agoq: bool) -> int:
    """The most one decoder layer's backward holds at once beside what the layer keeps: its MLP's or,
    under agoq, its attention's backward, whichever is larger."""
    m, es, t = ft.model, ft.es, ft.tokens
    work = layer_backward_bytes(t, m.hidden, m.intermediate, es, AGOQ_FORMAT.block_size if agoq else None, torch.device(ft.device))
    if agoq:
        tensors = ATTENTION_BACKWARD_TENSORS + (0 if ft.full else LORA_ATTENTION_BACKWARD_TENSORS)
        work = max(work, tensors * t * m.hidden * es)
    if ft.qlora:
        work += max(o * i for o, i in m.projection_shapes().values()) * es  # a 4-bit weight dequantized for its GEMM
    return work


def loss_backward_bytes(ft: FineTune, agoq: bool) -> int:
    """The most the LM head + loss's backward holds at once beside what it keeps."""
    m, t = ft.model, ft.tokens
    work = loss_work_bytes(t, m.hidden, m.vocab, DTYPES[ft.dtype], fused=agoq)
    if agoq:
        # apply_agoq's loss recomputes the final norm in backward: its output and rstd.
        work += t * m.hidden * ft.es + t * RSTD_BYTES
        if ft.full and t > default_chunk_size(m.vocab, m.hidden):
            work += m.vocab * m.hidden * 4  # the head gradient, summed over chunks in fp32
    return work


def _largest(fits: Callable[[int], bool], start: int, step: int) -> int | None:
    """The largest multiple of ``step`` from ``start`` up for which ``fits`` holds (powers of two, then bisection)."""
    if not fits(start):
        return None
    lo, hi = start, start * 2
    while hi <= MAX_SEARCH and fits(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_SEARCH:
        return lo
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_finetune(ft: FineTune, variants: tuple[str, ...] = VARIANTS) -> list[VariantPlan]:
    """Each variant's peak at ``ft``, whether it fits, and the longest context and largest micro-batch that do."""
    ft.validate()
    cap = ft.capacity
    plans = []
    for v in variants:
        p = plan_variant(ft, v)
        if cap is not None:
            p.fits = p.peak <= cap
            p.max_seq_len = _largest(lambda s: plan_variant(replace(ft, seq_len=s), v).peak <= cap, SEARCH_STEP, SEARCH_STEP)
            p.max_micro_batch = _largest(lambda b: plan_variant(replace(ft, micro_batch=b), v).peak <= cap, 1, 1)
        plans.append(p)
    return plans


def to_dict(ft: FineTune, plans: list[VariantPlan]) -> dict[str, object]:
    """The plan's JSON form (schema agoq.plan.finetune/1, docs/plan.md)."""
    m = ft.model
    return {
        "schema": SCHEMA,
        "model": {
            "config": m.name,
            "model_type": m.model_type,
            "hidden_size": m.hidden,
            "intermediate_size": m.intermediate,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim,
            "vocab_size": m.vocab,
            "tie_word_embeddings": m.tie_embeddings,
            "parameters": m.parameters(),
        },
        "fine_tune": {
            "method": "full" if ft.full else ("qlora" if ft.qlora else "lora"),
            "lora_r": ft.lora_r,
            "lora_targets": [] if ft.full else list(ft.lora_targets),
            "lora_dropout": ft.lora_dropout,
            "dtype": ft.dtype,
            "seq_len": ft.seq_len,
            "micro_batch": ft.micro_batch,
            "grad_accum": ft.grad_accum,
        },
        "memory": {"gpu_memory": ft.gpu_memory, "reserved": ft.reserved, "capacity": ft.capacity},
        "variants": {p.variant: p.to_dict() for p in plans},
    }


def markdown(ft: FineTune, plans: list[VariantPlan]) -> str:
    """The plan as a markdown table, one row per variant."""
    from agoq.plan.config import format_size

    m = ft.model
    method = "full fine-tune" if ft.full else f"{'QLoRA' if ft.qlora else 'LoRA'} r={ft.lora_r} on {','.join(ft.lora_targets)}"
    head = (
        f"{m.name} ({m.model_type}, {m.parameters() / 1e9:.2f} B parameters), {method}, {ft.dtype}, "
        f"micro-batch {ft.micro_batch} x {ft.seq_len} tokens"
        + ("" if ft.capacity is None else f"; fits means peak <= {format_size(ft.gpu_memory)} - {format_size(ft.reserved)} reserved")
    )
    cols = ["variant", *COMPONENTS, "peak", "fits", "longest context", "largest micro-batch"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|---" + "|---:" * (len(cols) - 1) + "|"]
    for p in plans:

        def fit_text(n: int | None) -> str:
            return "-" if p.fits is None else ("does not fit" if n is None else f"{n:,}")

        cells = [p.variant, *(format_size(p.components[c]) for c in COMPONENTS), format_size(p.peak)]
        cells += ["-" if p.fits is None else ("yes" if p.fits else "no"), fit_text(p.max_seq_len), fit_text(p.max_micro_batch)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Longest context at this micro-batch, largest micro-batch at this context; assumptions: docs/plan.md (Fine-tuning plans).")
    return "\n".join(lines)
