"""Node groups on real gloo groups of 2 nodes x 2 ranks and 3 nodes x 2 ranks: the two-hop quantized
all-reduce, and the 8-bit all-reduce whose all-gather goes between nodes, then within them.

Each group is spawned once (module fixture) and runs every check; the workers return measured
values and the tests assert on them. Every rank regenerates every rank's input from seeds, so the
references (the float64 sum, the local recomputation of the hops and its bound) need no collective.
"""

from __future__ import annotations

import hashlib
import math
import zlib

import pytest
import torch
import torch.distributed as dist

from agoq.gradient import CommCounter, all_reduce_8bit, all_reduce_hierarchical, node_groups
from agoq.gradient.collectives import chunk_layout
from agoq.gradient.hierarchical import hierarchical_error_bound, simulate_hierarchical
from agoq.gradient import collectives
from agoq.gradient.collectives import NODE_PIECES_MAX, inter_node_name, node_pieces
from agoq.gradient.hierarchical import HOP_NAMES, hierarchical_bytes, hierarchical_layout
from tests._dist import run_distributed

NODE_SIZE = 2
# (numel, op, intra format, inter format): sizes that no rank count divides into whole blocks.
CASES = [
    (1, "sum", "int8/256", "int4/128"),
    (1000, "sum", "int8/256", "int4/128"),
    (4099, "sum", "int8/256", "int4/128"),
    (30001, "sum", "int8/256", "int4/128"),
    (30001, "avg", "int8/256", "int4/128"),
    (12345, "sum", "int8/256", "int4/64"),
    (12345, "sum", "int4/128", "int8/256"),
]
BYTES_N = (1 << 20) + 77
HOPS = ("hier_intra_reduce_scatter", "hier_inter_all_reduce", "hier_intra_all_gather")
assert HOPS == HOP_NAMES


def _input(rank: int, n: int) -> torch.Tensor:
    """N(0, 1) values with a few 256-value blocks scaled by 1e3 and by 1e-4, at rank-dependent places."""
    g = torch.Generator().manual_seed(zlib.crc32(f"hier/{rank}/{n}".encode()))
    x = torch.randn(n, generator=g)
    blocks = max(1, n // 256)
    for scale in (1e3, 1e-4):
        for b in torch.randint(0, blocks, (max(1, blocks // 8),), generator=g).tolist():
            x[b * 256 : (b + 1) * 256] *= scale
    return x


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _case(rank: int, world: int, groups, n: int, op: str, intra: str, inter: str, node_size: int = NODE_SIZE) -> dict:
    inputs = [_input(r, n) for r in range(world)]
    y = inputs[rank].clone()
    counter = CommCounter()
    all_reduce_hierarchical(y, op, groups, intra_fmt=intra, inter_fmt=inter, counter=counter)
    expected, bound = simulate_hierarchical(inputs, node_size, op=op, intra_fmt=intra, inter_fmt=inter)
    exact = sum(x.double() for x in inputs) / (world if op == "avg" else 1)
    err = (y.double() - exact).abs()
    return {
        "case": (n, op, intra, inter),
        "digest": _digest(y),
        "equals_simulation": bool(torch.equal(y, expected)),
        "max_err_over_bound": float((err / (bound.double() + 1e-30)).max()),
        "bytes": counter.as_dict(),
    }


def _nan_case(rank: int, world: int, groups) -> dict:
    n = 3000
    inputs = [_input(r, n) for r in range(world)]
    inputs[world - 1][1000] = float("nan")
    y = inputs[rank].clone()
    all_reduce_hierarchical(y, "sum", groups, counter=CommCounter())
    expected, _ = simulate_hierarchical(inputs, NODE_SIZE)
    nan = torch.isnan(y)
    idx = nan.nonzero().flatten()
    return {
        "digest": _digest(y),
        "has_1000": bool(nan[1000]),
        "count": int(nan.sum()),
        "span": int(idx.max() - idx.min() + 1) if idx.numel() else 0,
        "same_as_simulation": bool(torch.equal(nan, torch.isnan(expected))),
        "rest_finite": bool(torch.isfinite(y[~nan]).all()),
    }


BY_NODE_CASES = [(1, "sum"), (4099, "sum"), (30001, "avg"), (200003, "sum")]
# Pieces of 16 KiB in the workers (2 MiB in use), so that small tensors go as 1, 2 and up to
# NODE_PIECES_MAX pieces.
TEST_PIECE_BYTES = 16 << 10


def _by_node_case(rank: int, world: int, groups, n: int, op: str, group=None) -> dict:
    """all_reduce_8bit of the same input gathered by node, and flat piece by piece (node_pieces): digests and counts."""
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    x = _input(members.index(rank) + 100, n)
    pieces = node_pieces(n, groups)
    y, counter = x.clone(), CommCounter()
    all_reduce_8bit(y, op, group, counter=counter, nodes=groups)
    z, flat_counter = x.clone(), CommCounter()
    for a, b in pieces:
        all_reduce_8bit(z[a:b], op, group, counter=flat_counter)
    return {
        "pieces": pieces,
        "flat": {"digest": _digest(z), "bytes": flat_counter.as_dict()},
        "by_node": {"digest": _digest(y), "bytes": counter.as_dict()},
    }


def _subgroup_case(rank: int) -> dict | None:
    """Nodes of 2 within global ranks 2..5 of 6: ranks 0 and 1 take part in creating the groups only."""
    members = [2, 3, 4, 5]
    sub = dist.new_group(members)
    groups = node_groups(NODE_SIZE, sub)
    if groups is None:
        return None
    inputs = [_input(r, 4099) for r in members]
    y = inputs[members.index(rank)].clone()
    all_reduce_hierarchical(y, "sum", groups, counter=CommCounter())
    return {
        "groups": (groups.node_size, groups.nodes, groups.local_rank, groups.node),
        "digest": _digest(y),
        "equals_simulation": bool(torch.equal(y, simulate_hierarchical(inputs, NODE_SIZE)[0])),
        "by_node": _by_node_case(rank, 4, groups, 4099, "sum", group=sub),
    }


def _checks(rank: int, world: int) -> dict:
    out: dict = {"errors": []}
    for bad in (0, 4, -2):
        if world % 4 == 0 and bad == 4:
            continue
        try:
            node_groups(bad)
        except ValueError as e:
            out["errors"].append(str(e))
    groups = node_groups(NODE_SIZE)
    out["groups"] = (groups.node_size, groups.nodes, groups.local_rank, groups.node)
    out["cases"] = [_case(rank, world, groups, *case) for case in CASES]
    counter = CommCounter()
    all_reduce_hierarchical(_input(rank, BYTES_N), "sum", groups, counter=counter)
    out["big_bytes"] = counter.as_dict()
    out["nan"] = _nan_case(rank, world, groups)
    collectives.NODE_PIECE_BYTES = TEST_PIECE_BYTES
    out["by_node"] = [_by_node_case(rank, world, groups, n, op) for n, op in BY_NODE_CASES]
    if world == 4:
        # One node of 4 (no inter-node hop) and 4 nodes of 1 (no intra-node hops).
        out["degenerate"] = [_case(rank, world, node_groups(size), 4099, "sum", "int8/256", "int4/128", size) for size in (4, 1)]
    else:
        out["subgroup"] = _subgroup_case(rank)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """Every check's measurements, per world size (4 = 2 nodes x 2, 6 = 3 nodes x 2), per rank."""
    return {w: run_distributed(_checks, w) for w in (4, 6)}


def test_node_groups_are_consecutive_blocks_of_ranks(runs):
    for world, results in runs.items():
        assert [r["groups"] for r in results] == [(2, world // 2, rank % 2, rank // 2) for rank in range(world)]


def test_every_rank_holds_bit_identical_results(runs):
    for world, results in runs.items():
        for i in range(len(CASES)):
            assert len({r["cases"][i]["digest"] for r in results}) == 1, (world, CASES[i])
        assert len({r["nan"]["digest"] for r in results}) == 1


def test_result_equals_the_local_recomputation_of_the_three_hops(runs):
    for world, results in runs.items():
        for r in results:
            for entry in r["cases"]:
                assert entry["equals_simulation"], (world, entry["case"])


def test_error_against_the_float64_sum_is_within_the_composed_bound(runs):
    for world, results in runs.items():
        for entry in results[0]["cases"]:
            assert entry["max_err_over_bound"] <= 1.0, (world, entry["case"], entry["max_err_over_bound"])


def _expected_bytes(n: int, world: int, intra: str, inter: str) -> dict[str, tuple[int, int]]:
    """(payload, scales) per hop, from first principles: (group size - 1) rows sent per exchange."""
    bits1, block1 = int(intra[3]), int(intra.split("/")[1])
    bits2, block2 = int(inter[3]), int(inter.split("/")[1])
    nodes, size = world // NODE_SIZE, NODE_SIZE
    c1 = math.ceil(n / size)
    p1 = math.ceil(c1 / block1) * block1
    c2 = math.ceil(c1 / nodes)
    p2 = max(1, math.ceil(c2 / block2)) * block2
    row1 = (p1 * bits1 // 8, p1 // block1 * 4)
    row2 = (p2 * bits2 // 8, p2 // block2 * 4)
    return {
        HOPS[0]: ((size - 1) * row1[0], (size - 1) * row1[1]),
        HOPS[1]: (2 * (nodes - 1) * row2[0], 2 * (nodes - 1) * row2[1]),
        HOPS[2]: ((size - 1) * nodes * row2[0], (size - 1) * nodes * row2[1]),
    }


def test_nodes_of_a_subgroup_count_its_ranks_only(runs):
    results = runs[6]
    assert results[0]["subgroup"] is None and results[1]["subgroup"] is None
    sub = [r["subgroup"] for r in results[2:]]
    assert [s["groups"] for s in sub] == [(2, 2, 0, 0), (2, 2, 1, 0), (2, 2, 0, 1), (2, 2, 1, 1)]
    assert all(s["equals_simulation"] for s in sub) and len({s["digest"] for s in sub}) == 1


def test_one_node_and_one_rank_per_node_reduce_like_the_recomputation(runs):
    results = runs[4]
    for i in range(2):
        assert len({r["degenerate"][i]["digest"] for r in results}) == 1
        for r in results:
            entry = r["degenerate"][i]
            assert entry["equals_simulation"] and entry["max_err_over_bound"] <= 1.0, entry
    one_node, one_rank = results[0]["degenerate"][0]["bytes"], results[0]["degenerate"][1]["bytes"]
    assert one_node[HOPS[1]]["total"] == 0 and one_rank[HOPS[0]]["total"] == one_rank[HOPS[2]]["total"] == 0


def test_bytes_per_rank_per_hop_equal_the_formula(runs):
    for world, results in runs.items():
        for r in results:
            measured = [(e["case"], e["bytes"]) for e in r["cases"]] + [((BYTES_N, "sum", "int8/256", "int4/128"), r["big_bytes"])]
            for (n, _, intra, inter), got in measured:
                expected = _expected_bytes(n, world, intra, inter)
                assert hierarchical_bytes(hierarchical_layout(n, NODE_SIZE, world // NODE_SIZE, intra, inter)) == expected
                for hop, (payload, scales) in expected.items():
                    assert (got[hop]["payload"], got[hop]["scales"], got[hop]["calls"]) == (payload, scales, 1), (world, n, hop, got[hop])


def test_inter_node_bytes_are_under_0_15x_of_an_fp32_ring_all_reduce(runs):
    # Per rank, hop 2 sends 2 (N - 1) rows of c / N values, c = n / L, at 4.25 bits (int4 + an fp32
    # scale per 128): 2 (N - 1) / (L N) * n * 0.53125 bytes; an fp32 ring over all W = L N ranks
    # sends 2 (W - 1) / W * 4 n. Ratio (N - 1) * 0.53125 / (4 (W - 1)): 0.044 at 2 x 2, 0.053 at
    # 3 x 2. Against an fp32 ring over the same N nodes of the same chunk, 2 (N - 1) / N * 4 c:
    # 0.53125 / 4 = 0.133 (plus the padding to whole blocks).
    for world, results in runs.items():
        nodes = world // NODE_SIZE
        inter = results[0]["big_bytes"][HOPS[1]]["total"]
        fp32_ring = 2 * (world - 1) * 4 * BYTES_N // world
        fp32_ring_between_nodes = 2 * (nodes - 1) * 4 * math.ceil(BYTES_N / NODE_SIZE) // nodes
        ratio = inter / fp32_ring
        assert ratio <= 0.15, ratio
        assert abs(ratio - (nodes - 1) * 0.53125 / (4 * (world - 1))) < 1e-3, ratio
        assert inter / fp32_ring_between_nodes <= 0.135, inter / fp32_ring_between_nodes


def test_node_size_that_does_not_divide_the_group_is_a_one_line_error(runs):
    for world, results in runs.items():
        for r in results:
            assert r["errors"] and all("\n" not in e and f"group size {world}" in e and "node_size=" in e for e in r["errors"]), r["errors"]
        assert any("node_size=4" in e for e in runs[6][0]["errors"])


def test_nan_in_one_rank_makes_its_blocks_nan_on_every_rank(runs):
    for world, results in runs.items():
        for r in results:
            nan = r["nan"]
            assert nan["has_1000"] and nan["same_as_simulation"] and nan["rest_finite"], nan
            # The hop-1 block (256 values) and at most the int4/128 blocks of hop 2 that it touches.
            assert 256 <= nan["count"] <= 256 + 2 * 128 and nan["span"] <= 256 + 2 * 128, nan


def test_the_8bit_all_reduce_gathered_by_node_equals_the_flat_one_bit_for_bit(runs):
    # Piece by piece: a large tensor over nodes goes as pieces, each an all-reduce of its own.
    for world, results in runs.items():
        for i, case in enumerate(BY_NODE_CASES):
            digests = {r["by_node"][i][path]["digest"] for r in results for path in ("flat", "by_node")}
            assert len(digests) == 1, (world, case)  # every rank, both paths
    sub = [r["subgroup"]["by_node"] for r in runs[6][2:]]
    assert len({s[path]["digest"] for s in sub for path in ("flat", "by_node")}) == 1


def test_a_large_tensor_over_nodes_goes_as_pieces_of_about_node_piece_bytes_at_most_node_pieces_max(runs):
    for world, results in runs.items():
        for (n, _), entry in zip(BY_NODE_CASES, results[0]["by_node"]):
            pieces = [tuple(p) for p in entry["pieces"]]
            assert pieces[0][0] == 0 and pieces[-1][1] == n and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
            assert len(pieces) == min(NODE_PIECES_MAX, max(1, -(-n * 4 // TEST_PIECE_BYTES))), (n, pieces)
    assert [len(entry["pieces"]) for entry in results[0]["by_node"]] == [1, 2, NODE_PIECES_MAX, NODE_PIECES_MAX]


def test_by_node_the_same_bytes_are_sent_and_fewer_cross_nodes(runs):
    # Per rank and piece: the all-to-all sends W - 1 rows, W - L to other nodes; the all-gather
    # W - 1 rows, N - 1 of them across nodes (a ring would carry (W - 1) / L across on average).
    name = "all_reduce_8bit"
    for world, results in runs.items():
        nodes = world // NODE_SIZE
        for r in results:
            for entry in r["by_node"]:
                flat, by_node = entry["flat"]["bytes"], entry["by_node"]["bytes"]
                rows = sum(chunk_layout(b - a, world, "int8/256").row_bytes for a, b in entry["pieces"])
                assert set(flat) == {name} and flat[name]["total"] == 2 * (world - 1) * rows
                inter = by_node[inter_node_name(name)]["total"]
                assert inter == (world - NODE_SIZE + nodes - 1) * rows
                assert by_node[name]["total"] + inter == flat[name]["total"]
                assert inter < (world - NODE_SIZE) * rows + (world - 1) * rows / NODE_SIZE


def test_single_process_is_two_requantizations_within_the_bound():
    groups = node_groups(1)
    x = _input(0, 5000)
    y = x.clone()
    counter = CommCounter()
    timings: dict[str, float] = {}
    all_reduce_hierarchical(y, groups=groups, counter=counter, timings=timings)
    expected, bound = simulate_hierarchical([x], 1)
    assert torch.equal(y, expected)
    assert ((y - x).abs() <= bound).all()
    assert torch.equal(bound, hierarchical_error_bound([x], 1))
    assert counter.bytes() == 0 and set(timings) == {*HOPS, "dequantize"}
    # A bf16 tensor gets the fp32 result rounded once to bf16; a strided one is written in place.
    b = x.bfloat16()
    all_reduce_hierarchical(b, groups=groups, counter=counter)
    assert torch.equal(b, simulate_hierarchical([x.bfloat16()], 1)[0].bfloat16())
    grid = x[:4096].clone().view(64, 64).t()
    all_reduce_hierarchical(grid, groups=groups, counter=counter)
    assert torch.equal(grid, simulate_hierarchical([x[:4096].view(64, 64).t()], 1)[0].view(64, 64))
    empty = torch.empty(0)
    all_reduce_hierarchical(empty, groups=groups, counter=counter)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="group size 1, got node_size=2"):
        node_groups(2)
    with pytest.raises(ValueError, match="node_size=3"):
        simulate_hierarchical([torch.ones(4)] * 4, 3)
    with pytest.raises(TypeError, match="floating-point"):
        all_reduce_hierarchical(torch.ones(4, dtype=torch.long), groups=node_groups(1))
