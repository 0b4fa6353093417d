"""Pipeline-stage-aware activation bit widths (DBCA-PP, METHOD.md part 2).

A pipeline rank that keeps N_i micro-batches in flight at its peak holds N_i times one
micro-batch's saved activations. The rank with the most in flight sets the memory peak at uniform
4 bits; every other rank may spend its slack on more bits. The paper's rule B_i = 4 * N_1 / N_i
rounds 9 micro-batches (of 11) to 5 bits, which needs 9 * 5 = 45 > 11 * 4 = 44 units: above the
peak it claims to keep. Here each rank takes the highest candidate whose bytes fit, so no rank's
peak ever exceeds the uniform-4-bit peak.

``allocate_stage_bits`` works from in-flight counts and one per-micro-batch size (equal stages);
``allocate_rank_bits`` from torch's action order and a per-stage size, for stages that differ (the
last one also keeps the loss's tensors); ``stage_layer_bits`` sizes a LLaMA's stages with the
activation accounting and returns the policy's per-layer bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from agoq.activation.accounting import layer_saved_bytes
from agoq.activation.loss import loss_saved_bytes
from agoq.activation.policy import ActivationPolicy
from agoq.parallel.inflight import peak_inflight_bytes
from agoq.parallel.layout import PipelineLayout
from agoq.parallel.pipeline import split_layers

if TYPE_CHECKING:
    from agoq.models import LlamaConfig

# 16 keeps a layer's saved tensors as the unquantized baseline keeps them.
BIT_CANDIDATES = (4, 5, 6, 8, 16)


def _candidate_bits(candidates: Sequence[int], base_bits: int) -> list[int]:
    bits = sorted({int(b) for b in candidates})
    if base_bits not in bits:
        raise ValueError(f"base_bits={base_bits} must be one of the candidates {bits}; add it to candidates")
    return [b for b in bits if b >= base_bits]


def _highest_fitting(peak_at: Callable[[int], int], budget: int, bits: Sequence[int]) -> int:
    """The highest bit width whose peak fits the budget; bits[0] (the base) always fits by construction."""
    return max(b for b in bits if b == bits[0] or peak_at(b) <= budget)


def allocate_stage_bits(
    inflight: Sequence[int],
    bytes_per_microbatch: Callable[[int], int],
    candidates: Sequence[int] = BIT_CANDIDATES,
    base_bits: int = 4,
) -> list[int]:
    """The highest candidate bit width per stage whose peak N_i * bytes(b_i) stays within max_j N_j * bytes(base_bits).

    ``inflight[i]`` is stage (or rank) i's peak in-flight micro-batch count and
    ``bytes_per_microbatch(b)`` the saved-activation bytes one micro-batch leaves on that stage at
    ``b`` bits, including the parts that keep their precision whatever ``b`` is.
    """
    counts = [int(n) for n in inflight]
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"in-flight counts must be a non-empty list of positive integers, got {list(inflight)}")
    bits = _candidate_bits(candidates, base_bits)
    cost = {b: int(bytes_per_microbatch(b)) for b in bits}
    if any(c < 0 for c in cost.values()):
        raise ValueError(f"bytes_per_microbatch returned a negative size: {cost}")
    budget = max(counts) * cost[base_bits]
    return [_highest_fitting(lambda b: n * cost[b], budget, bits) for n in counts]


def allocate_rank_bits(
    pipeline_order: dict[int, list],
    stage_bytes: Callable[[int, int], int],
    num_stages: int,
    candidates: Sequence[int] = BIT_CANDIDATES,
    base_bits: int = 4,
) -> list[int]:
    """Per pp rank, the highest candidate bit width whose timeline peak stays within the uniform-base peak.

    ``stage_bytes(stage, bits)`` is what one in-flight micro-batch keeps on a global stage, so stages
    may differ (the last one also keeps the loss's tensors). A rank's peak is taken over its actual
    action order, all its stages at the rank's bits; with equal stages this is allocate_stage_bits.
    """
    bits = _candidate_bits(candidates, base_bits)
    owner = {s: r for r, actions in pipeline_order.items() for a in actions if a is not None for s in _stages_of(a)}

    def peaks(rank_bits: Callable[[int], int]) -> list[int]:
        return peak_inflight_bytes(pipeline_order, [stage_bytes(s, rank_bits(owner.get(s, 0))) for s in range(num_stages)])

    budget = max(peaks(lambda r: base_bits))
    return [_highest_fitting(lambda b: peaks(lambda r: b)[rank], budget, bits) for rank in range(len(pipeline_order))]


def _stages_of(action) -> list[int]:
    return [a.stage_index for a in action.sub_actions] if action.sub_actions else [action.stage_index]


def stage_saved_bytes(
    model_cfg: LlamaConfig,
    policy: ActivationPolicy,
    layers: range,
    last: bool,
    bits: int,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    tp: int = 1,
) -> int:
    """Bytes one micro-batch keeps for backward on a stage holding ``layers`` (and the loss when ``last``) at ``bits``.

    ``seq_len`` is the sequence length one rank holds (divided by tp under sequence parallelism);
    under ``tp`` > 1 the loss is the vocab-parallel one of agoq.parallel.tensor_ops.
    """
    c = model_cfg
    precision = replace(policy, layer_bits=(bits,)).layer(0)
    per_layer = sum(layer_saved_bytes(micro_batch, seq_len, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate, dtype, precision).values())
    if not last:
        loss = 0
    elif tp > 1:
        # agoq's tensor-parallel model always takes the sequence- and vocab-parallel loss.
        from agoq.parallel.tensor_ops import vocab_parallel_loss_saved_bytes

        loss = vocab_parallel_loss_saved_bytes(micro_batch * seq_len * tp, c.hidden, dtype, tp)
    else:
        loss = loss_saved_bytes(
            micro_batch * seq_len,
            c.hidden,
            c.vocab_size,
            dtype,
            policy.fused_loss,
            recompute=policy._loss_recompute,
            weight_grad_in_forward=policy._loss_weight_grad_in_forward,
        )
    return len(layers) * per_layer + loss


def stage_layer_bits(
    model_cfg: LlamaConfig,
    layout: PipelineLayout,
    micro_batch: int,
    seq_len: int,
    policy: ActivationPolicy,
    base_bits: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    candidates: Sequence[int] = BIT_CANDIDATES,
    tp: int = 1,
) -> list[int]:
    """Per-layer bit widths (ActivationPolicy.layer_bits) that raise later ranks' precision without raising the peak.

    ``seq_len`` is the sequence length one rank holds (divided by ``tp`` under sequence parallelism)."""
    ranges = layout.stage_ranges(model_cfg.n_layers)
    num_stages = len(ranges)

    def stage_bytes(stage: int, bits: int) -> int:
        return stage_saved_bytes(model_cfg, policy, ranges[stage], stage == num_stages - 1, bits, micro_batch, seq_len, dtype, tp=tp)

    rank_bits = allocate_rank_bits(layout.order(), stage_bytes, num_stages, candidates, base_bits)
    return layer_bits(rank_bits, model_cfg.n_layers, layout.stage_ranks())


def peak_bytes(inflight: Sequence[int], bits: Sequence[int], bytes_per_microbatch: Callable[[int], int]) -> list[int]:
    """Each stage's peak saved-activation bytes N_i * bytes(b_i)."""
    if len(inflight) != len(bits):
        raise ValueError(f"{len(inflight)} in-flight counts but {len(bits)} bit widths; give one per stage")
    return [int(n) * int(bytes_per_microbatch(b)) for n, b in zip(inflight, bits)]


def layer_bits(bits: Sequence[int], n_layers: int, stage_to_rank: Sequence[int] | None = None) -> list[int]:
    """Per-layer bit widths (ActivationPolicy.layer_bits) for n_layers cut into equal consecutive stages.

    ``bits`` is indexed by global stage, or by pp rank when ``stage_to_rank`` (stage -> rank, as in
    InFlight.stage_to_rank) is given, so that every stage a rank holds gets that rank's bits.
    """
    if stage_to_rank is None:
        stage_bits = list(bits)
    else:
        if any(not 0 <= r < len(bits) for r in stage_to_rank):
            raise ValueError(f"stage_to_rank {list(stage_to_rank)} names ranks outside the {len(bits)} given bit widths")
        stage_bits = [bits[r] for r in stage_to_rank]
    if not stage_bits:
        raise ValueError("no bit widths given; pass one per stage (or per rank with stage_to_rank)")
    ranges = split_layers(n_layers, len(stage_bits))
    return [b for b, layers in zip(stage_bits, ranges) for _ in layers]
