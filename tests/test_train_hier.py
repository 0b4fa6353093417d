"""`agoq train --precision.gradients=hier-8/4` on 4 gloo ranks as 2 simulated nodes of 2.

The two-hop reduction (int8 within a node, int4 between nodes, agoq.gradient.hierarchical) trains
like the flat int8 all-reduce on the same seed and data, every rank reports the same loss, and the
run summary splits the dp bytes by link class: between nodes each rank sends one int4 row of its
1/2 chunk, within its node the int8 rows of hop 1 and the forwarded int4 bytes of hop 3.

The int8 all-reduce over the same nodes gathers between nodes, then within them: the same bytes
arrive, so it trains bit-identically to the flat one, and fewer of them cross nodes.
"""

from __future__ import annotations

import pytest
import torch

from agoq.launch.config import ConfigError, load_config
from tests._dist import run_distributed
from tests.test_train import BASE as TRAIN_BASE
from tests._data import data_args, data_cache, train_corpus

COMMON = [*TRAIN_BASE, "--parallel.pp=1", "--parallel.dp=4", "--precision.compute_dtype=fp32", "--train.steps=4"]


def _runs(rank: int, world: int, cfgs: dict) -> dict:
    from agoq.launch.run import train_worker

    torch.manual_seed(0)
    out = {}
    for name, cfg in cfgs.items():
        res = train_worker(cfg)
        out[name] = {"losses": [r["loss"] for r in res["records"]], "ranks": res.get("ranks"), "params": res.get("ranks", [{}])[0].get("param_count")}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from agoq.data.tokens import prepare_data

    tmp = tmp_path_factory.mktemp("train_hier")
    prepare_data(train_corpus(), None, 512, data_cache(), 0.01)

    def cfg(folder, *extra):
        return load_config(None, [*COMMON, *data_args(), f"--train.out_dir={tmp / folder}", *extra])

    cfgs = {
        "int8": cfg("a"),
        "hier": cfg("b", "--precision.gradients=hier-8/4", "--parallel.node_size=2"),
        "int8_nodes": cfg("c", "--parallel.node_size=2"),
    }
    return run_distributed(_runs, 4, cfgs)


def test_two_hop_reduction_trains_like_the_flat_int8_one(runs):
    flat, hier = runs[0]["int8"]["losses"], runs[0]["hier"]["losses"]
    assert hier[-1] < hier[0] - 0.05, hier
    assert hier == pytest.approx(flat, rel=5e-3)
    assert all(r["hier"]["losses"] == hier for r in runs)


def test_the_summary_splits_dp_bytes_by_link_class(runs):
    for stats in runs[0]["hier"]["ranks"]:
        link = stats["link_bytes_per_step"]
        assert link["intra_node"] + link["inter_node"] == stats["wire_bytes_per_step"]
        # Between nodes: one int4/64 row of this rank's half of the gradients (plus block padding),
        # at most 0.15x of what an fp32 ring all-reduce over all 4 ranks sends.
        assert 0 < link["inter_node"] <= 0.15 * stats["fp32_wire_bytes_per_step"]
    assert all(not s.get("link_bytes_per_step") for s in runs[0]["int8"]["ranks"])
    # agoq plan's count for the same gradients, dp and nodes is the trainer's, to the byte.
    from agoq.plan.links import gradient_link_bytes

    stats = runs[0]["hier"]["ranks"][0]
    assert gradient_link_bytes(stats["param_count"], 4, 2)["hier-8/4"] == stats["link_bytes_per_step"]


def test_int8_gathered_by_node_trains_bit_identically_to_the_flat_one(runs):
    for r in runs:
        assert r["int8_nodes"]["losses"] == r["int8"]["losses"] == runs[0]["int8"]["losses"]


def test_int8_gathered_by_node_splits_its_bytes_and_sends_fewer_across_nodes(runs):
    from agoq.plan.links import gradient_link_bytes

    world, local, nodes = 4, 2, 2
    for flat, stats in zip(runs[0]["int8"]["ranks"], runs[0]["int8_nodes"]["ranks"]):
        link = stats["link_bytes_per_step"]
        assert link["intra_node"] + link["inter_node"] == stats["wire_bytes_per_step"] == flat["wire_bytes_per_step"]
        # Per bucket: of the all-to-all's W - 1 rows, W - L cross; of the all-gather's W - 1, N - 1
        # (the rest is the few bytes of the finite-check's all-gather, within and between nodes).
        share = (world - local + nodes - 1) / (2 * (world - 1))
        assert link["inter_node"] == pytest.approx(share * stats["wire_bytes_per_step"], rel=1e-3)
        planned = gradient_link_bytes(stats["param_count"], world, local)["int8"]
        assert link["inter_node"] == pytest.approx(planned["inter_node"], rel=0.01)
        ring = gradient_link_bytes(stats["param_count"], world, local, by_node=False)["int8"]
        assert link["inter_node"] < 0.9 * ring["inter_node"]


def test_hier_is_refused_where_its_nodes_would_not_span_the_dp_group():
    with pytest.raises(ConfigError, match="needs parallel.pp=1"):
        load_config(None, [*TRAIN_BASE, "--precision.gradients=hier-8/4"])  # pp=2 by default
    with pytest.raises(ConfigError, match="parallel.node_size=3 must divide parallel.dp=4"):
        load_config(None, [*COMMON, "--precision.gradients=hier-8/4", "--parallel.node_size=3"])
