"""The gradient path a run asks for (``precision.gradients``, ``parallel.zero1``), built from its
settings: the full syncs of agoq.gradient.sync or the reduce-scattered ones of
agoq.gradient.sharded. It sits above both, so that neither imports the other's caller."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from agoq.gradient.collectives import Group, world_of
from agoq.gradient.nodes import NodeGroups, node_groups
from agoq.gradient.sharded import Fp32ShardedGradientSync, QuantizedShardedGradientSync
from agoq.gradient.sync import WIRE_CHOICES, GradientSync, PlainGradientSync, QuantizedGradientSync


def _nodes_of_world(node_size: int, group: Group) -> NodeGroups | None:
    """Node groups for the 8-bit all-gather (gathers_by_node) where ``group`` is the whole world
    spread over several nodes of ``node_size`` ranks; else None.

    Only a group of every rank: torch.distributed makes groups collectively, and each rank here
    knows only its own dp group (with pp or tp > 1 the all-gather stays flat).
    """
    world = world_of(group)[0]
    if not dist.is_initialized() or world != dist.get_world_size() or not 1 < node_size < world:
        return None
    return node_groups(node_size, group)


def make_gradient_sync(
    mode: str,
    params: list[tuple[str, nn.Parameter]],
    group: Group,
    device: torch.device,
    microbatches: int,
    block: int,
    sharded: bool = False,
    node_size: int = 1,
) -> GradientSync:
    """The gradient path for ``precision.gradients`` = ``mode`` (int8, int4, int4-ef, hier-8/4 over
    nodes of ``node_size`` ranks of ``group``, fp32 or bf16); with ``sharded`` (ZeRO-1) the reduce-scattered one of agoq.gradient.sharded (int8, int4,
    int4-ef or fp32)."""
    quantized = mode in WIRE_CHOICES
    if sharded:
        if quantized:
            return QuantizedShardedGradientSync(params, group, microbatches, block, WIRE_CHOICES[mode])
        if mode == "fp32":
            return Fp32ShardedGradientSync(params, group, device, block)
        raise ValueError(f"parallel.zero1=true needs precision.gradients = int8, int4, int4-ef or fp32, got {mode!r}")
    if quantized:
        return QuantizedGradientSync(params, group, microbatches, block, WIRE_CHOICES[mode], nodes=_nodes_of_world(node_size, group))
    if mode == "hier-8/4":
        # An fp32 buffer reduced in two hops after backward (no bucketing or overlap yet).
        return PlainGradientSync(params, group, device, torch.float32, nodes=node_groups(node_size, group))
    if mode not in ("fp32", "bf16"):
        raise ValueError(f"precision.gradients={mode!r} is not a gradient path; use int8, int4, int4-ef, hier-8/4, fp32 or bf16")
    return PlainGradientSync(params, group, device, torch.float32 if mode == "fp32" else torch.bfloat16)
