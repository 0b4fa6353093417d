"""Pipeline-stage-aware activation bit widths (DBCA-PP, METHOD.md part 2).

A pipeline rank that keeps N_i micro-batches in flight at its peak holds N_i times one
micro-batch's saved activations. The rank with the most in flight sets the memory peak at uniform
4 bits; every other rank may spend its slack on more bits. The paper's rule B_i = 4 * N_1 / N_i
rounds 9 micro-batches (of 11) to 5 bits, which needs 9 * 5 = 45 > 11 * 4 = 44 units: above the
peak it claims to keep. Here each rank takes the highest candidate whose bytes fit, so no rank's
peak ever exceeds the uniform-4-bit peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agoq.parallel.pipeline import split_layers

BIT_CANDIDATES = (4, 5, 6, 8, 16)


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
    bits = sorted({int(b) for b in candidates})
    if base_bits not in bits:
        raise ValueError(f"base_bits={base_bits} must be one of the candidates {bits}; add it to candidates")
    cost = {b: int(bytes_per_microbatch(b)) for b in bits}
    if any(c < 0 for c in cost.values()):
        raise ValueError(f"bytes_per_microbatch returned a negative size: {cost}")
    budget = max(counts) * cost[base_bits]
    chosen = []
    for n in counts:
        fitting = [b for b in bits if b >= base_bits and n * cost[b] <= budget]
        # base_bits always fits: n * cost[base] <= max(counts) * cost[base].
        chosen.append(max(fitting))
    return chosen


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
