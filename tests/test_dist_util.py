import torch
import torch.distributed as dist

from tests._dist import run_distributed


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_gloo_group_sums_ranks():
    assert run_distributed(_sum_ranks, 3) == [3.0, 3.0, 3.0]
