import torch
import torch.distributed as dist

from tests._dist import run_distributed


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_gloo_group_sums_ranks():
    assert run_distributed(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def _rank0_fails_while_the_others_wait_in_a_collective(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("rank 0's own failure")
    dist.all_reduce(torch.ones(1))


def test_one_rank_failing_fails_the_check_with_its_error_not_the_timeout():
    import time

    import pytest

    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0's own failure"):
        run_distributed(_rank0_fails_while_the_others_wait_in_a_collective, 3, timeout=300)
    # The others are blocked in a collective that cannot complete: they are killed after the grace.
    assert time.monotonic() - start < 120


def _rank2_dies_without_a_word(rank: int, world: int) -> None:
    import os

    if rank == 2:
        os._exit(3)  # stands for a crash below Python, or a kill
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_dies_without_reporting_fails_the_check_naming_its_exit_code():
    import time

    import pytest

    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 2:\nexited with code 3 before reporting"):
        run_distributed(_rank2_dies_without_a_word, 3, timeout=300)
    # Its peers wait in the collective until the grace after a failure, not the whole timeout.
    assert time.monotonic() - start < 120
