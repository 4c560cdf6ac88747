"""Point-to-point exchanges with a deadline: every rank sends its pieces to each peer of a process
group and receives theirs (``batch_isend_irecv``; through host copies where gloo moves CUDA tensors),
each transfer waited for at most a given time, a late or broken one raised as the caller's error
naming the peer. The two-level dispatch across nodes (:mod:`ds_uniep.twolevel`) moves its rows with
them, some started while other work runs (:func:`start_exchange`, then
:meth:`PendingExchange.wait`)."""

import datetime
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as torch_dist
from torch import Tensor


class PendingExchange:
    """Transfers of :func:`start_exchange` in flight; :meth:`wait` waits for them (each until the
    deadline set at the start) and returns what arrived."""

    def __init__(self, recvs: List[List[Tensor]], works=(), peers=(), deadline: float = 0.0,
                 fail: Optional[Callable[[int, BaseException], Exception]] = None):
        self.recvs, self.works, self.peers, self.deadline, self.fail = recvs, works, peers, deadline, fail

    def wait(self) -> List[List[Tensor]]:
        # One work per operation (gloo); a backend that coalesces the batch into one work cannot say
        # which peer is late: the error then names the first peer of the batch.
        works, self.works = self.works, ()
        for work, peer in zip(works, self.peers if len(works) == len(self.peers) else self.peers[:1]):
            try:
                work.wait(datetime.timedelta(seconds=max(self.deadline - time.monotonic(), 1e-3)))
            except Exception as err:  # noqa: BLE001 - re-raised with the names
                raise self.fail(peer, err) from err
        return self.recvs


def start_exchange(sends: List[List[Tensor]], recvs: List[List[Tensor]], group, me: int, timeout_s: float,
                   fail: Callable[[int, BaseException], Exception]) -> PendingExchange:
    """Start sending ``sends[p]`` to group rank ``p`` of ``group`` and filling ``recvs[p]`` from it
    (``me``'s own are copied now; empty tensors do not travel, both sides know the sizes). Each
    transfer may take until ``timeout_s`` after the start; one that fails or times out makes
    :meth:`PendingExchange.wait` raise ``fail(p, error)``."""
    for src, dst in zip(sends[me], recvs[me]):
        dst.copy_(src)
    if any(t.is_cuda for ts in sends + recvs for t in ts) and torch_dist.get_backend(group) == "gloo":
        # gloo's point-to-point reads and writes host memory: CUDA rows travel through host copies.
        host = [[t.cpu() for t in ts] for ts in sends]
        got = [[torch.empty(t.shape, dtype=t.dtype) for t in ts] for ts in recvs]
        host[me], got[me] = [], []
        exchange(host, got, group, me, timeout_s, fail)
        for ts, hs in zip(recvs, got):
            for t, h in zip(ts, hs):
                t.copy_(h)
        return PendingExchange(recvs)
    ops, peers = [], []
    for p in range(len(sends)):
        if p == me:
            continue
        for t in sends[p]:
            if t.numel():
                ops.append(torch_dist.P2POp(torch_dist.isend, t.contiguous(), group=group, group_peer=p))
                peers.append(p)
        for t in recvs[p]:
            if t.numel():
                ops.append(torch_dist.P2POp(torch_dist.irecv, t, group=group, group_peer=p))
                peers.append(p)
    if not ops:
        return PendingExchange(recvs)
    deadline = time.monotonic() + timeout_s
    return PendingExchange(recvs, torch_dist.batch_isend_irecv(ops), peers, deadline, fail)


def exchange(sends: List[List[Tensor]], recvs: List[List[Tensor]], group, me: int, timeout_s: float,
             fail: Callable[[int, BaseException], Exception]) -> None:
    """:func:`start_exchange`, waited for."""
    start_exchange(sends, recvs, group, me, timeout_s, fail).wait()
