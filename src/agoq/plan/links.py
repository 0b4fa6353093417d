"""Gradient bytes per rank and step by link class (within a node, between nodes), per gradient mode.

dp ranks form nodes of ``node_size`` consecutive ranks (L = min(node_size, dp), N = dp / L nodes).
Per rank, averaged over the ranks:

- fp32: torch's ring all-reduce, 2 (dp - 1) / dp x 4 bytes per value; a ring over consecutive
  ranks leaves each node once, so 1 / L of it crosses between nodes (none with one node).
- int8, int4: the all-to-all sends dp - 1 rows (a rank chunk each, in the wire format), dp - L of
  them to other nodes; the all-gather sends dp - 1 rows too. At pp = tp = 1 (``by_node``) it goes
  between nodes first, N - 1 rows to the peers with the same local index, then within the node
  (agoq.gradient.collectives.gathers_by_node); otherwise as a ring across nodes (1 / L of it
  crosses), and as one all-to-all within a host.
- hier-8/4: the two-hop reduction's own counts (agoq.gradient.hierarchical.hierarchical_bytes):
  hops 1 and 3 within the node, hop 2 between nodes.
"""

from __future__ import annotations

from agoq.gradient.collectives import chunk_layout
from agoq.gradient.hierarchical import HOP_NAMES, hierarchical_bytes, hierarchical_layout
from agoq.gradient.sync import HIER_INTRA_FORMAT, INT4_WIRE_FORMAT

LINK_MODES = ("fp32", "int8", "int4", "hier-8/4")


def _split(total: int, inter: int) -> dict[str, int]:
    return {"intra_node": total - inter, "inter_node": inter}


def _flat(numel: int, dp: int, local: int, fmt: str, by_node: bool) -> dict[str, int]:
    row = chunk_layout(numel, dp, fmt).row_bytes
    all_to_all, all_gather = (dp - 1) * row, (dp - 1) * row
    if dp == local:
        gather_inter = 0
    elif by_node:
        gather_inter = (dp // local - 1) * row
    else:
        gather_inter = all_gather // local
    return _split(all_to_all + all_gather, (dp - local) * row + gather_inter)


def gradient_link_bytes(numel: int, dp: int, node_size: int, gradient_block: int = 256, by_node: bool = True) -> dict[str, dict[str, int]]:
    """{mode: {"intra_node": bytes, "inter_node": bytes}} one rank sends per step to reduce ``numel``
    gradients over dp; ``by_node``: the quantized all-gathers go between nodes, then within (pp = tp = 1)."""
    if dp == 1:
        return {mode: _split(0, 0) for mode in LINK_MODES}
    local = min(node_size, dp)
    if dp % local:
        raise ValueError(f"node-size={node_size} does not divide dp={dp}; give the dp ranks per node")
    ring = 2 * (dp - 1) * numel * 4 // dp
    out = {"fp32": _split(ring, ring // local if dp > local else 0)}
    out["int8"] = _flat(numel, dp, local, f"int8/{gradient_block}", by_node)
    out["int4"] = _flat(numel, dp, local, INT4_WIRE_FORMAT, by_node)
    hops = hierarchical_bytes(hierarchical_layout(numel, local, dp // local, HIER_INTRA_FORMAT, INT4_WIRE_FORMAT))
    sent = {name: sum(hops[name]) for name in HOP_NAMES}
    out["hier-8/4"] = {"intra_node": sent[HOP_NAMES[0]] + sent[HOP_NAMES[2]], "inter_node": sent[HOP_NAMES[1]]}
    return out
