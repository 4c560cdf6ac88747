"""Bounded waits for the reference backend's collectives, and the hook that fault-injection tests use
to stop a rank.

On CPU tensors (gloo) the reference backend's collectives carry ``overlap.timeout_s`` as the
operation's own timeout (the c10d options' ``timeout``): gloo gives up after that long and frees its
worker thread, so the process can still exit, and the failure becomes a
:class:`~ds_uniep.errors.UniEPTimeoutError` naming the layer, the rank and the step. (Waiting on the
returned ``Work`` with a timeout would not do: the collective itself would keep waiting, and the
process could not exit before the group's own timeout.) On GPU tensors (NCCL) the process group's
own timeout governs, as for every other collective of the job: see docs/reliability.md.
"""
import datetime
import os
import time
from typing import List

import torch
import torch.distributed as torch_dist
from torch import Tensor

from . import env
from .env import logger
from .errors import UniEPCommError, UniEPTimeoutError

STOP_S = 600.0
"""How long a rank stopped by ``UNIEP_TEST_STOP_AT`` sleeps before it exits (code 1) by itself."""


def stop_point(step: str) -> None:
    """With ``UNIEP_TEST_STOP_AT=<step>:<rank>`` (tests only), this global rank stops here: it logs the
    wall-clock time, sleeps :data:`STOP_S` without reaching its peers and exits. Does nothing otherwise."""
    stop = env.TEST_STOP_AT
    if stop is None or stop[0] != step:
        return
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    if rank != stop[1]:
        return
    logger.warning(f"rank {rank} stops at the {step} (UNIEP_TEST_STOP_AT) at time {time.time():.3f}")
    time.sleep(STOP_S)
    os._exit(1)


class Deadline:
    """The collectives of one layer's reference dispatcher, each waiting at most ``timeout_s`` on CPU
    tensors; a failure raises a ds_uniep error naming ``layer_name``, this rank and the step."""

    def __init__(self, layer_name: str, timeout_s: float):
        self.layer_name = layer_name
        self.timeout_s = timeout_s
        self.rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0

    def all_to_all_single(self, out: Tensor, x: Tensor, out_splits: List[int], in_splits: List[int], group,
                          step: str) -> None:
        if x.device.type != "cpu":
            torch_dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
            return
        opts = torch_dist.AllToAllOptions()
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        pg = group if group is not None else torch_dist.group.WORLD
        self._wait(lambda: pg.alltoall_base(out, x, list(out_splits), list(in_splits), opts), step)

    def all_gather(self, parts: List[Tensor], x: Tensor, group, step: str) -> None:
        if x.device.type != "cpu":
            torch_dist.all_gather(parts, x, group=group)
            return
        opts = torch._C._distributed_c10d.AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        pg = group if group is not None else torch_dist.group.WORLD
        self._wait(lambda: pg.allgather([parts], [x], opts), step)

    def _wait(self, start, step: str) -> None:
        began = time.monotonic()
        try:
            start().wait()
        except RuntimeError as err:
            took = time.monotonic() - began
            torch_says = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            timed_out = "timed out" in str(err).lower()
            cls, how = (UniEPTimeoutError, "timed out") if timed_out else (UniEPCommError, "failed")
            raise cls(f"{self.layer_name}: rank {self.rank} {how} after {took:.1f} s (overlap.timeout_s = "
                      f"{self.timeout_s:g}) in the reference backend's {step} on the expert-parallel group: a "
                      "peer did not reach the same call, or died. The group's collectives are unusable "
                      f"from here on. torch: {torch_says}") from err
