"""run_distributed fails fast and says which rank: a hang ends at the time limit with every live rank's
stack, a rank killed by a signal ends the run at once; the /dev/shm clean-up spares live runs' buffers."""
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import SHM_PATTERN, remove_unused_shm_buffers, run_distributed


def _rank_one_sleeps_forever(rank, world_size):
    if rank == 1:
        while True:
            time.sleep(1)


def _rank_one_is_killed(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    import deepspeed.comm as dist
    dist.barrier()  # rank 0 waits here on a peer that is gone


def test_a_hang_names_the_ranks_and_where_they_wait():
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_distributed(_rank_one_sleeps_forever, 2, timeout=20)
    took = time.monotonic() - start
    message = str(err.value)
    assert took < 60, took
    if "still running after" not in message:
        # Under load rank 0's own collective timeout (0.8 of the limit) can come first: it then
        # fails the run, and the rank that hangs is still named.
        assert "ranks [1] were still running" in message, message
        return
    assert "--- rank 1 ---" in message, message
    rank1 = message.split("--- rank 1 ---", 1)[1]
    assert "_rank_one_sleeps_forever" in rank1, message


def test_a_rank_killed_by_a_signal_ends_the_run_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 of 2 exit code -9 \(signal 9\) without a Python error") as err:
        run_distributed(_rank_one_is_killed, 2, timeout=300)
    assert time.monotonic() - start < 90, str(err.value)


def test_shm_clean_up_keeps_buffers_a_live_process_maps(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    prefix = SHM_PATTERN.replace("*", f"test_{os.getpid()}_")
    live, orphan = prefix + "live", prefix + "orphan"
    for path in (live, orphan):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    # A peer that maps its buffer, then closes the descriptor, as DeepSpeed's shm_comm does.
    peer = subprocess.Popen([sys.executable, "-c", "import mmap, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
                             "m = mmap.mmap(fd, 4096); os.close(fd); print('mapped', flush=True); time.sleep(120)",
                             live], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "mapped"
        remove_unused_shm_buffers({live, orphan})
        assert os.path.exists(live) and not os.path.exists(orphan)
    finally:
        peer.kill()
        peer.wait()
    remove_unused_shm_buffers({live})
    assert not os.path.exists(live)
