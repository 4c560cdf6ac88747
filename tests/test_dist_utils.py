import pytest
import torch

from dist_utils import run_distributed


def _sum_ranks(rank, world_size):
    import deepspeed.comm as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


def _fail_on_one(rank, world_size):
    assert rank != 1, "rank 1 fails on purpose"


def test_all_ranks_run():
    run_distributed(_sum_ranks, 2)


def test_a_failing_rank_fails_the_test():
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        run_distributed(_fail_on_one, 2)
