"""Nodes of a process group: ranks that share a host, and the peers with the same local index on the others.

A job spread over hosts reaches its fast links (shared memory, NVLink) within a node and its slow
one (the network) between nodes. :func:`node_groups` makes both groups once; the 8-bit all-reduce's
all-gather (:mod:`agoq.gradient.collectives`) and the two-hop reduction
(:mod:`agoq.gradient.hierarchical`) send over them so that fewer bytes cross the slow link.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from agoq.compat import all_gather_single

Group = dist.ProcessGroup | None


@dataclass(frozen=True)
class NodeGroups:
    """This rank's node (``intra``: its node_size ranks) and its peers on other nodes (``inter``)."""

    intra: Group
    inter: Group
    node_size: int
    nodes: int
    local_rank: int
    node: int

    @property
    def world_size(self) -> int:
        """Ranks in the whole group: node_size x nodes."""
        return self.node_size * self.nodes


def check_node_size(node_size: int, world_size: int) -> None:
    if not isinstance(node_size, int) or node_size < 1 or world_size % node_size:
        raise ValueError(f"node_size must be a positive divisor of the group size {world_size}, got node_size={node_size!r}")


def node_groups(node_size: int, group: Group = None) -> NodeGroups | None:
    """Nodes of ``node_size`` consecutive ranks of ``group`` (default: the whole world), as process groups.

    Every rank of the default group must call it, in the same order as its other group creations
    (torch.distributed creates groups collectively); ranks outside ``group`` get None. Without an
    initialized torch.distributed there is one rank: node_size must be 1.
    """
    if not (dist.is_available() and dist.is_initialized()):
        check_node_size(node_size, 1)
        return NodeGroups(None, None, 1, 1, 0, 0)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    check_node_size(node_size, len(ranks))
    nodes = len(ranks) // node_size
    me = dist.get_rank()
    intra = inter = None
    for k in range(nodes):
        members = ranks[k * node_size : (k + 1) * node_size]
        made = dist.new_group(members)
        if me in members:
            intra = made
    for local in range(node_size):
        members = ranks[local::node_size]
        made = dist.new_group(members)
        if me in members:
            inter = made
    if me not in ranks:
        return None
    index = ranks.index(me)
    return NodeGroups(intra, inter, node_size, nodes, index % node_size, index // node_size)


def gather_within_node(send: torch.Tensor, groups: NodeGroups) -> torch.Tensor:
    """uint8 [node_size, len(send)]: every node rank's ``send``, in local-rank order."""
    size = groups.node_size
    if size == 1:
        return send.view(1, -1)
    out = torch.empty(size * send.numel(), dtype=torch.uint8, device=send.device)
    if dist.get_backend(groups.intra) == "gloo":
        # gloo's all-gather is a ring of size - 1 rounds; within a node one all-to-all round sends the same bytes.
        dist.all_to_all_single(out, send.expand(size, send.numel()).contiguous(), group=groups.intra)
    else:
        all_gather_single(out, send, group=groups.intra)
    return out.view(size, -1)
