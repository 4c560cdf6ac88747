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


def _launch_counting(tmp_path, fail_with):
    """A stand-in launcher: each launch appends its port to a file and fails with ``fail_with``
    on its first launch, succeeds after."""
    import sys
    from dist_utils import run_launcher
    log = tmp_path / "ports.txt"
    script = ("import sys, pathlib; p = pathlib.Path(sys.argv[1]); first = not p.exists(); "
              "p.write_text(p.read_text() + sys.argv[2] + chr(10) if p.exists() else sys.argv[2] + chr(10)); "
              "first and (print(sys.argv[3], file=sys.stderr), sys.exit(1))")
    proc = run_launcher(lambda port: [sys.executable, "-c", script, str(log), str(port), fail_with])
    return proc, log.read_text().split()


def test_a_launch_whose_port_was_taken_runs_again_on_another(tmp_path):
    proc, ports = _launch_counting(tmp_path, "RuntimeError: EADDRINUSE (Address already in use)")
    assert proc.returncode == 0 and len(ports) == 2, (proc, ports)


def test_other_launch_failures_are_returned_as_they_are(tmp_path):
    proc, ports = _launch_counting(tmp_path, "ValueError: the config is wrong")
    assert proc.returncode == 1 and len(ports) == 1 and "the config is wrong" in proc.stderr, (proc, ports)
