"""Slow links between sites, emulated on one host (:class:`InterSitePacing`, opt-in, off by default).

It holds a rank for the bytes it exchanged with other sites over a given bandwidth, so HybridEP and
plain EP can be measured against the cost model of :mod:`.model`.
"""

import math
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as torch_dist

from ..commfuse.common import side_stream


class PacedTransfer:
    """A background transfer on the emulated slow link (:meth:`InterSitePacing.start`)."""

    __slots__ = ("seconds", "deadline", "event")

    def __init__(self, seconds: float):
        self.seconds = seconds
        #: Host clock (``time.perf_counter``) at which its bytes have crossed ("host" hold).
        self.deadline: Optional[float] = None
        #: End of its spin on the side stream ("stream" hold on CUDA).
        self.event = None


class InterSitePacing:
    """Slow links between sites, emulated on one host by pacing (opt-in; nothing uses it by default).

    Sites are runs of ``site_size`` consecutive global ranks. The fast backend (NCCL, gloo) still
    moves every byte, so results are unchanged; each rank has one slow link per direction, and a
    collective occupies it for ``max(bytes sent to other sites, bytes received from them) /
    bytes_per_s`` seconds. Two kinds of traffic go through it:

    - blocking collectives (the reference dispatcher's token all-to-alls forward and backward, the
      probe of :func:`.planning.measure_bandwidths`): after the collective, :meth:`pace` holds the rank for
      its link time; such a collective's time is the fast backend's plus the hold, and
      :func:`.planning.measure_bandwidths` through the same pacing measures the sum;
    - background transfers (HybridEP's replica gather and gradient return): :meth:`start` puts
      the bytes on the link when the collective is issued, behind background bytes already on it,
      and :meth:`finish` holds the rank, when the result is needed, until they have crossed. The
      rank computes meanwhile. A blocking collective's bytes go first: they delay the background
      bytes still on the link by their own link time (the order of the cost model of
      :mod:`.model`: the dispatch waits for no replica, the replica bytes take the link's idle
      time).

    The exchange of per-expert row counts (``[E]`` integers) is not paced.

    How a CUDA rank is held (``hold``): ``"host"`` waits for the current stream to finish the
    collective, then ``time.sleep``s (wall-clock exact; nothing is queued meanwhile; a background
    transfer starts when the stream has reached it and :meth:`finish` sleeps only what is left of
    it); ``"stream"`` queues a spin (``torch.cuda._sleep``, its clock rate timed once against CUDA
    events), which the host does not wait for, but whose length follows the SM clock: on the
    current stream for a blocking collective, on a side stream for a background transfer (the
    current stream waits for it in :meth:`finish`), so in this mode background bytes do not yield
    to token bytes: the two overlap where both cross sites at once. A CPU rank always sleeps.

    ``paced_bytes``, ``paced_s`` (link seconds) and ``paced_transfers`` (collectives that crossed
    sites) count what this rank was held for (tests and benchmarks read them).
    """

    HOLDS = ("host", "stream")

    def __init__(self, site_size: int, bytes_per_s: float, hold: str = "host"):
        if isinstance(site_size, bool) or not isinstance(site_size, int) or site_size < 1:
            raise ValueError(f"InterSitePacing.site_size: must be a positive integer, got {site_size!r}")
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, (int, float)) or not bytes_per_s > 0 \
                or math.isinf(bytes_per_s):
            raise ValueError(f"InterSitePacing.bytes_per_s: must be a positive finite number, got {bytes_per_s!r}")
        if hold not in self.HOLDS:
            raise ValueError(f"InterSitePacing.hold: must be one of {', '.join(self.HOLDS)}, got {hold!r}")
        self.site_size, self.bytes_per_s, self.hold_mode = site_size, float(bytes_per_s), hold
        self.paced_bytes = 0
        self.paced_s = 0.0
        self.paced_transfers = 0
        self._cycles_per_s: Dict[int, float] = {}
        self._background: List[PacedTransfer] = []  # host-clock transfers started and not finished

    def site_of(self, global_rank: int) -> int:
        return global_rank // self.site_size

    def remote(self, group) -> List[bool]:
        """For each rank of ``group`` (group order): does it lie in another site than this rank?"""
        ranks = torch_dist.get_process_group_ranks(group) if group is not None else \
            list(range(torch_dist.get_world_size()))
        mine = self.site_of(torch_dist.get_rank())
        return [self.site_of(r) != mine for r in ranks]

    def _link_seconds(self, group, send_bytes: Sequence[int], recv_bytes: Sequence[int]) -> float:
        """Seconds the inter-site share of one collective occupies this rank's link (counted)."""
        remote = self.remote(group)
        nbytes = max(sum(b for b, far in zip(send_bytes, remote) if far),
                     sum(b for b, far in zip(recv_bytes, remote) if far))
        if nbytes == 0:
            return 0.0
        seconds = nbytes / self.bytes_per_s
        self.paced_bytes += nbytes
        self.paced_s += seconds
        self.paced_transfers += 1
        return seconds

    def pace(self, group, send_bytes: Sequence[int], recv_bytes: Sequence[int], device: torch.device) -> float:
        """Hold this rank for the inter-site share of one blocking collective over ``group``.

        ``send_bytes[i]`` / ``recv_bytes[i]``: bytes this rank sent to / received from group rank
        ``i``. Returns the seconds held."""
        seconds = self._link_seconds(group, send_bytes, recv_bytes)
        if seconds:
            self.hold(seconds, device)
        return seconds

    def start(self, group, send_bytes: Sequence[int], recv_bytes: Sequence[int],
              device: torch.device) -> Optional[PacedTransfer]:
        """Put the inter-site share of a background collective on the link now (arguments as
        :meth:`pace`); None if nothing crosses sites. Call :meth:`finish` before using its result."""
        seconds = self._link_seconds(group, send_bytes, recv_bytes)
        if not seconds:
            return None
        transfer = PacedTransfer(seconds)
        if device.type == "cuda" and self.hold_mode == "stream":
            side = side_stream(device, torch.cuda.current_stream(device))
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s(device))))
                transfer.event = torch.cuda.Event()
                transfer.event.record(side)
            return transfer
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the transfer starts where the stream is
        now = time.perf_counter()
        transfer.deadline = max([now] + [t.deadline for t in self._background]) + seconds
        self._background.append(transfer)
        return transfer

    def finish(self, transfer: Optional[PacedTransfer], device: torch.device) -> None:
        """Hold this rank until the bytes of ``transfer`` (from :meth:`start`) have crossed."""
        if transfer is None:
            return
        if transfer.event is not None:
            torch.cuda.current_stream(device).wait_event(transfer.event)
            return
        if transfer in self._background:
            self._background.remove(transfer)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        left = transfer.deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def hold(self, seconds: float, device: torch.device) -> None:
        """Delay the work queued after this point on ``device`` by ``seconds`` (a blocking collective's
        link time: background bytes still on the link wait behind it)."""
        if device.type == "cuda" and self.hold_mode == "stream":
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s(device))))
            return
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        now = time.perf_counter()
        for t in self._background:
            if t.deadline > now:
                t.deadline += seconds
        time.sleep(seconds)

    def cycles_per_s(self, device: torch.device) -> float:
        """Clock cycles of ``torch.cuda._sleep`` per second on ``device``, timed once with CUDA events."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._cycles_per_s:
            cycles = 20_000_000  # ~10 ms at 2 GHz
            with torch.cuda.device(idx):
                torch.cuda._sleep(cycles // 10)  # first launch
                ms = []
                for _ in range(3):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    torch.cuda._sleep(cycles)
                    end.record()
                    end.synchronize()
                    ms.append(start.elapsed_time(end))
            self._cycles_per_s[idx] = cycles / (statistics.median(ms) * 1e-3)
        return self._cycles_per_s[idx]

    def __repr__(self) -> str:
        return (f"InterSitePacing(site_size={self.site_size}, bytes_per_s={self.bytes_per_s:g}, "
                f"hold={self.hold_mode!r})")
