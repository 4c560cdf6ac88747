"""HybridEP inside ``UniEPMoE``: experts gathered inside a domain, tokens sent only across domains.

Letters: G expert-parallel ranks, S ranks per domain, D = G / S domains, L local
experts per rank, E = G * L experts. EP rank ``r`` is offset ``r % S`` of domain
``r // S``; domains are contiguous runs of EP ranks, so domain ``d`` owns the
experts ``[d * S * L, (d + 1) * S * L)``.

One layer on rank r:

1. Gather, issued first, before the router: every rank of the domain receives the
   weights of all S * L experts of its domain (its own included, through the same
   path), in one all-gather of its experts' parameters laid end to end (one per
   dtype), asynchronous, so it runs beside the router and the dispatch layout and
   is waited for only when the experts need it.
2. Dispatch over the *offset group* (the D ranks with r's offset, one per
   domain): a token routed to expert e goes to the rank of e's domain with r's
   offset, which holds a replica of e. A token whose expert lives in r's own
   domain stays on r. This is the reference dispatcher with D "ranks" of S * L
   experts each, so the deterministic layout carries over unchanged.
3. The replicas run over their rows: recognised bf16 MLP experts as one grouped
   GEMM per projection over all ``S * L`` replicas (as plain EP's local experts),
   other experts one by one (``torch.func.functional_call`` with the gathered
   weights).
4. Combine over the offset group, in slot order in fp32.

Backward: the gradient of a replica comes back to its owner through the
gather's backward, one all-to-all (again of all parameters end to end) that
hands each owner the S gradients of its own tensors (the gather's bytes,
mirrored), added in domain-rank order (fp32), so each owner parameter receives
exactly one gradient per backward, before DeepSpeed's expert-data-parallel
reduction. The all-to-all is issued as soon as the expert backward has produced
the replica gradients; the sum waits for it only at the end of the layer's
backward (after the dispatch-gradient all-to-all and the router's backward), so
the return runs beside them, as the cost model's streams assume. Each replica is
its own tensor in the graph, so its gradient goes into the all-to-all's send
buffer without an ``[S, ...]`` zero-filled intermediate.
With S = 1 the layer takes the plain EP path, so it is bitwise plain EP.

Partial migration (``migrated_fraction``, ``m < L`` experts per rank): step 1 gathers only m of
each rank's experts (its first m, or the hottest: :meth:`HybridExperts._choose`); the dispatch
runs over the whole EP group (:class:`PartialMigrationDispatcher`): a token for a migrated expert
goes where step 2 sends it, a token for any other expert to its owner, which runs those experts
with its own weights.

Once per optimizer step (``reuse_replicas``): a gather is kept while the weights it copied are
unchanged (:meth:`HybridExperts.prefetch`), so the micro-batches of a step share one; under a
DeepSpeed engine each backward before the step's last adds its replica gradients to fp32 sums
(:class:`HeldGradients`) and hands the owners zeros, and the last one returns the sums in one
all-to-all, as the cost model's M micro-batches assume.

Compressed migration (``compression.enabled``, :class:`CompressedGather`) replaces step 1's
all-gather: an asynchronous all-reduce of the domain's fp32 expert sums (the shared base), issued
where the dense gather is, then the encoding of each owner's experts against it (:mod:`.compress`),
the all-gather of the encoded experts and the decoding. On a GPU all of it is queued there on a
side stream, with no host synchronisation, and runs beside the router and the dispatch; on the CPU
the encoding and what follows run when the experts need the replicas. The backward is the dense
one (straight through the compression).

:class:`InterSitePacing` (opt-in, off by default) holds a rank for the bytes it
exchanged with other sites over a given bandwidth: slow links between sites,
emulated on one host, so HybridEP and plain EP can be measured against the cost
model of :mod:`.model`.
"""

import contextlib
import dataclasses
import math
import statistics
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn
from torch.func import functional_call

from ..commfuse.ops import side_stream
from ..env import logger
from ..experts import run_grouped, stack_experts
from ..layout import expert_counts
from ..reference import ReferenceDispatcher, gather_counts


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
      probe of :func:`measure_bandwidths`): after the collective, :meth:`pace` holds the rank for
      its link time; such a collective's time is the fast backend's plus the hold, and
      :func:`measure_bandwidths` through the same pacing measures the sum;
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


class HybridGroups:
    """The domain and offset process groups of one expert-parallel group.

    Creating it is collective over the whole world: every rank builds every
    group, in the same order, as ``torch.distributed.new_group`` requires.
    """

    def __init__(self, ep_group, domain_size: int, votes: bool = False):
        G = torch_dist.get_world_size(ep_group)
        if domain_size < 1 or G % domain_size != 0:
            raise ValueError(f'"uniep": {{"hybrid": {{"domain_size": {domain_size}}}}} must divide the '
                             f"expert-parallel size {G}")
        S = domain_size
        self.domain_size, self.ep_size, self.ep_group = S, G, ep_group
        self.ep_rank = torch_dist.get_rank(ep_group)
        self.domain, self.offset = divmod(self.ep_rank, S)
        # Every EP group of the world, in a fixed order, so all ranks create the same groups.
        mine = torch_dist.get_process_group_ranks(ep_group)
        everyone: List[Optional[List[int]]] = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(everyone, mine)
        ep_groups = sorted({tuple(g) for g in everyone})
        self.domain_group = self.offset_group = None
        #: With ``votes``: a gloo group of the domain for :meth:`any_in_domain` (host values, so no
        #: GPU synchronisation), the domain group itself where that is gloo already.
        self.vote_group = None
        gloo_domains = votes and S > 1 and torch_dist.get_backend(ep_group) != "gloo"
        for ranks in ep_groups:
            for d in range(G // S):
                g = torch_dist.new_group(list(ranks[d * S:(d + 1) * S]))
                v = torch_dist.new_group(list(ranks[d * S:(d + 1) * S]), backend="gloo") if gloo_domains else g
                if list(ranks) == mine and d == self.domain:
                    self.domain_group = g
                    self.vote_group = v if votes else None
            for o in range(S):
                g = torch_dist.new_group(list(ranks[o::S]))
                if list(ranks) == mine and o == self.offset:
                    self.offset_group = g

    def any_in_domain(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of this rank's domain (collective over the domain,
        built with ``votes``): decisions that choose whether the domain's ranks run a collective
        together are made with it, so no rank waits alone in a collective the others skipped."""
        if self.domain_size == 1:
            return flag
        if self.vote_group is None:
            raise RuntimeError("HybridGroups: any_in_domain needs the groups built with votes=True")
        t = torch.tensor([int(flag)], dtype=torch.int32)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=self.vote_group)
        return bool(t.item())


def _all_gather_flat(out: Tensor, flat: Tensor, group):
    """Asynchronous all-gather of ``flat`` into ``out`` (``[S * n]``, rank-major)."""
    fn = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
    return fn(out, flat, group=group, async_op=True)


class DomainGather:
    """The domain's copies of this rank's expert parameters, in flight (issued on construction).

    The parameters are laid end to end, one buffer per dtype, and all-gathered asynchronously over
    the domain group: one collective per dtype instead of one per tensor, and the layer computes
    while it runs. With ``pacing`` its inter-site bytes are a background transfer (one copy of every
    tensor to and from every peer). After :meth:`wait`, ``outs`` hold the ``[S, n]`` copies per
    dtype; :class:`_ReplicaViews` hands out views of them, no copy."""

    def __init__(self, local: Sequence[Tensor], group, S: int, pacing: Optional[InterSitePacing]):
        self.local, self.group, self.S, self.pacing = list(local), group, S, pacing
        self.buckets = _buckets(self.local)
        self.outs, self.works = [], []
        nbytes = 0
        for idx in self.buckets:
            flat = torch.cat([self.local[i].detach().reshape(-1) for i in idx])
            out = flat.new_empty(S, flat.numel())
            self.works.append(_all_gather_flat(out.view(-1), flat, group))
            self.outs.append(out)
            nbytes += flat.numel() * flat.element_size()
        self.device = self.local[0].device
        self.wire_bytes = (S - 1) * nbytes  # this rank's tensors, to each of S - 1 peers
        self.transfer = pacing.start(group, [nbytes] * S, [nbytes] * S, self.device) if pacing is not None \
            else None
        self._done = False

    def wait(self) -> None:
        """Until the gathered buffers (``outs``, ``[S, n]`` per dtype) hold the domain's copies."""
        if self._done:
            return
        for w in self.works:
            w.wait()
        if self.pacing is not None:
            self.pacing.finish(self.transfer, self.device)
        self._done = True


class CompressedGather:
    """Compressed migration in flight: what :class:`DomainGather` delivers, with each other owner's
    tensors as the domain's shared base plus that owner's top-``ratio`` residual positions
    (:mod:`.compress`), and only those bytes on the links.

    Issued on construction: the fp32 sum of this rank's experts, per parameter (local experts in
    order), all-reduced over the domain group asynchronously; the base is that sum over the S * L
    experts divided by S * L, cast to the parameter's dtype, the same bits on every rank. Then
    (:meth:`_exchange`) each of this rank's tensors is encoded against its parameter's base (the
    values at the kept positions, in the tensor's dtype, and their int32 indices), those are
    all-gathered (one collective per dtype and one for the indices), and every other owner's
    tensors are decoded into ``outs`` (``[S, n]`` per dtype, as :class:`DomainGather`'s); this
    rank's own copies are its exact tensors. On a GPU all of that is queued at construction on a
    side stream that waits for the base all-reduce (the encoding synchronises nothing with the
    host), so it runs beside the router and the token dispatch; :meth:`wait` makes the current
    stream wait for it. On the CPU it runs in :meth:`wait`. ``ratio`` 1 keeps every position: the
    replicas are then the dense ones, bit for bit. Gradients go back to the owners as with the
    dense gather (straight through the compression, dense bytes). ``wire_bytes``: what one rank
    puts on the links for it (the base all-reduce counted as a ring's ``2 (S - 1) / S`` of the fp32
    sums, then the encoded tensors to each of S - 1 peers); with ``pacing`` the whole ring counts on
    the slow link where the domain spans sites."""

    def __init__(self, local: Sequence[Tensor], group, S: int, pacing: Optional[InterSitePacing],
                 num_params: int, offset: int, ratio: float):
        from .compress import num_kept
        self.local, self.group, self.S, self.pacing = list(local), group, S, pacing
        self.num_params, self.offset, self.ratio = num_params, offset, ratio
        self.buckets = _buckets(self.local)
        self.device = self.local[0].device
        self.local_experts = len(self.local) // num_params  # L
        sums = []
        for i in range(num_params):
            acc = self.local[i].detach().to(torch.float32).clone()
            for l in range(1, self.local_experts):
                acc += self.local[l * num_params + i].detach().to(torch.float32)
            sums.append(acc.reshape(-1))
        self.base_sum = torch.cat(sums)
        self.base_work = torch_dist.all_reduce(self.base_sum, group=group, async_op=True)
        self.outs = [torch.empty(S, sum(self.local[i].numel() for i in idx), dtype=self.local[idx[0]].dtype,
                                 device=self.device) for idx in self.buckets]
        self.kept = [num_kept(t.numel(), ratio) for t in self.local]
        encoded = sum(k * (t.element_size() + 4) for k, t in zip(self.kept, self.local))
        ring = 2 * (S - 1) * self.base_sum.numel() * 4 // S  # what a ring all-reduce moves per rank
        self.wire_bytes = (S - 1) * encoded + ring
        self.transfer = None
        if pacing is not None:
            # Every step of a ring waits for its slowest hop: where the domain spans sites, the whole
            # ring crosses the slow link (as the cost model charges it), spread over the remote peers.
            per_peer = [encoded] * S
            far = [i for i, f in enumerate(pacing.remote(group)) if f]
            for j, i in enumerate(far):
                per_peer[i] += ring // len(far) + (j < ring % len(far))
            self.transfer = pacing.start(group, per_peer, per_peer, self.device)
        self._done = False
        self._stream = self._event = None
        if self.device.type == "cuda":
            compute = torch.cuda.current_stream(self.device)
            self._stream = side_stream(self.device, compute, "migration")
            self._stream.wait_stream(compute)  # the experts' weights and the sums as they are now
            with torch.cuda.stream(self._stream):
                self._exchange()
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
            for out in self.outs:  # made on the compute stream, written on the side one
                out.record_stream(self._stream)

    def _exchange(self) -> None:
        """Encode this rank's tensors against the base, all-gather them, decode the others' into ``outs``."""
        from .compress import decode_rows, encode
        self.base_work.wait()
        P, S, n_exp = self.num_params, self.S, self.local_experts * self.S
        bases, off = [], 0
        for i in range(P):
            t = self.local[i]
            bases.append((self.base_sum[off:off + t.numel()] / n_exp).to(t.dtype).view(t.shape))
            off += t.numel()
        self.bases = bases  # per parameter of an expert, the domain's shared base
        encs = [encode(t.detach(), bases[j % P], self.ratio) for j, t in enumerate(self.local)]
        indices = torch.cat([e.indices for e in encs])
        all_indices = indices.new_empty(S, indices.numel())
        works = [_all_gather_flat(all_indices.view(-1), indices, self.group)]
        all_values = []
        for idx in self.buckets:
            values = torch.cat([encs[i].values for i in idx])
            all_values.append(values.new_empty(S, values.numel()))
            works.append(_all_gather_flat(all_values[-1].view(-1), values, self.group))
        for w in works:
            w.wait()
        starts, at = [], 0  # where tensor i's indices start in a rank's row of all_indices
        for k in self.kept:
            starts.append(at)
            at += k
        for idx, out, vals in zip(self.buckets, self.outs, all_values):
            # Every owner's row at once: the bucket's tensors side by side are one flat row per owner,
            # each tensor's kept positions offset by its column (the columns do not overlap), so one
            # decode_rows places them all; this rank's row is then its exact tensors.
            cols, col = [], 0
            for i in idx:
                cols.append(col)
                col += self.local[i].numel()
            pos = torch.cat([all_indices[:, starts[i]:starts[i] + self.kept[i]].long() + c
                             for i, c in zip(idx, cols)], dim=1)
            decode_rows(out, torch.cat([bases[i % P].reshape(-1) for i in idx]), pos, vals)
            out[self.offset] = torch.cat([self.local[i].detach().reshape(-1) for i in idx])

    def wait(self) -> None:
        """Until ``outs`` hold the domain's copies (this rank's exact, the others' decoded)."""
        if self._done:
            return
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        else:
            self._exchange()
        if self.pacing is not None:
            self.pacing.finish(self.transfer, self.device)
        self._done = True


def _buckets(tensors: Sequence[Tensor]) -> List[List[int]]:
    """Indices of ``tensors`` grouped by dtype, in first-seen order (one flat buffer each)."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return list(by_dtype.values())


class HeldGradients:
    """Replica gradients held for the step's last micro-batch (``reuse_replicas`` under a DeepSpeed
    engine): ``boundary()`` says whether the backward running now is the last of the step (the
    engine's ``is_gradient_accumulation_boundary``); before it, each backward adds its replica
    gradients to ``sums`` (fp32, ``[S, n]`` per dtype, in micro-batch order) and sends nothing."""

    __slots__ = ("boundary", "sums", "count")

    def __init__(self, boundary: Callable[[], bool]):
        self.boundary, self.sums, self.count = boundary, None, 0


class _GatherUse:
    """One forward's use of a gather (:class:`DomainGather` or :class:`CompressedGather`): a reused
    gather serves several forwards, and each forward's backward exchanges its own replica gradients
    (``grad_works``, set by :class:`_ReplicaViews`, read by :class:`_OwnerSum`; None when they were
    held for a later backward, see :class:`HeldGradients`)."""

    __slots__ = ("gathered", "grad_works", "held")

    def __init__(self, gathered, held: Optional[HeldGradients] = None):
        self.gathered, self.grad_works, self.held = gathered, None, held


_OPTIMIZER_STEPS = [0]
_STEP_HOOK = None


def optimizer_steps() -> int:
    """Optimizer steps taken in this process since the first call (``torch.optim`` step post-hooks,
    which every ``torch.optim.Optimizer`` runs, DeepSpeed's included: its ZeRO and bf16 optimizers
    step a torch optimizer inside)."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def count(*_):
            _OPTIMIZER_STEPS[0] += 1
        _STEP_HOOK = register_optimizer_step_post_hook(count)
    return _OPTIMIZER_STEPS[0]


class _OwnerSum(torch.autograd.Function):
    """First half of the gather's autograd, applied when the gather is issued (before the router).

    Forward: the in-flight ``[S, n]`` buffers, one per dtype (not waited for; only
    :class:`_ReplicaViews` reads them, after :meth:`DomainGather.wait`). Backward: each owner
    tensor's gradient, the S gradients of it that :class:`_ReplicaViews` exchanged, added in
    domain-rank order in fp32. Autograd runs a node after every node created later, so this sum
    runs at the end of the layer's backward (after the dispatch-gradient all-to-all and the router's
    backward), while the exchange, issued right after the expert backward, has been on the links
    meanwhile."""

    @staticmethod
    def forward(ctx, use: _GatherUse, counter: Optional[Dict[str, int]], *local: Tensor):
        ctx.use, ctx.counter = use, counter
        return tuple(out.detach() for out in use.gathered.outs)  # not views: the collective writes them

    @staticmethod
    def backward(ctx, *parts: Tensor):
        use = ctx.use
        gathered = use.gathered
        local = gathered.local
        result: List[Optional[Tensor]] = [None] * len(local)
        if use.grad_works is None:
            # Held for the step's last micro-batch: nothing arrived. Zeros, not None: autograd calls
            # the parameters' gradient hooks either way, and DeepSpeed's ZeRO-2 hook reduces the
            # gradient it finds (as it does every expert gradient at every micro-batch in plain EP).
            return (None, None) + tuple(torch.zeros_like(t) for t in local)
        for idx, part, w in zip(gathered.buckets, parts, use.grad_works):
            w.wait()
            # fp32, in domain-rank order: the same sums as 0 + part[0] + part[1] + ... (an fp32 part
            # is summed in place: the buffer is this rank's and read by nobody else).
            acc = part[0].float()
            for j in range(1, part.shape[0]):
                acc.add_(part[j])
            off = 0
            for i in idx:
                n = local[i].numel()
                piece = acc[off:off + n].view(local[i].shape)
                result[i] = piece.to(local[i].dtype) if local[i].dtype != torch.float32 else piece.clone()
                off += n
        use.grad_works = None
        if ctx.counter is not None:
            ctx.counter["owner_reductions"] = ctx.counter.get("owner_reductions", 0) + 1
        return (None, None) + tuple(result)


class _ReplicaViews(torch.autograd.Function):
    """Second half, applied when the experts need the replicas: waits for the gather and returns one
    tensor per replica and local tensor (``[s * n + i]``: domain rank s's copy of tensor i), views of
    the gathered buffers. Backward: the replica gradients, laid end to end per dtype, go back to
    their owners in one asynchronous all-to-all per dtype, issued at once (with pacing, its
    inter-site bytes are a background transfer that the rank waits for at the end of the backward
    pass); the gradients handed to :class:`_OwnerSum` are the all-to-all's output buffers, which it
    reads only after waiting for the all-to-all."""

    @staticmethod
    def forward(ctx, use: _GatherUse, *buffers: Tensor):
        ctx.use = use
        gathered = use.gathered
        gathered.wait()
        local, out = gathered.local, [None] * len(gathered.local)
        for idx, buf in zip(gathered.buckets, buffers):
            off = 0
            for i in idx:
                n = local[i].numel()
                out[i] = buf[:, off:off + n].view(gathered.S, *local[i].shape)
                off += n
        return tuple(out[i][s] for s in range(gathered.S) for i in range(len(local)))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        use = ctx.use
        gathered, held = use.gathered, use.held
        S, local = gathered.S, gathered.local
        n = len(local)
        # send[s]: this rank's gradients of domain rank s's tensors, one [S, n] per dtype.
        sends = [torch.cat([(grads[s * n + i] if grads[s * n + i] is not None
                             else local[i].new_zeros(local[i].shape)).reshape(-1)
                            for s in range(S) for i in idx]).view(S, -1) for idx in gathered.buckets]
        if held is not None:
            if not held.boundary():  # not the step's last micro-batch: keep them, send nothing
                if held.sums is None:
                    held.sums = [x.to(torch.float32, copy=True) for x in sends]
                else:
                    for acc, x in zip(held.sums, sends):
                        acc.add_(x)
                held.count += 1
                use.grad_works = None
                return (None, ) * (1 + len(sends))
            if held.sums is not None:  # the last one: the step's sums go, in the gradients' dtype
                sends = [acc.add_(x).to(x.dtype) for acc, x in zip(held.sums, sends)]
                held.sums, held.count = None, 0
        parts, works = [], []
        nbytes = 0
        for send in sends:
            # After the all-to-all, part[j] = rank j's gradients of this rank's tensors.
            part = torch.empty_like(send)
            works.append(torch_dist.all_to_all_single(part, send, group=gathered.group, async_op=True))
            parts.append(part)
            nbytes += send[0].numel() * send.element_size()
        use.grad_works = works
        pacing = gathered.pacing
        if pacing is not None:
            device = local[0].device
            transfer = pacing.start(gathered.group, [nbytes] * S, [nbytes] * S, device)
            if transfer is not None:  # the gradients are the owner's once the bytes have crossed
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: pacing.finish(transfer, device))
        return (None, ) + tuple(parts)


class PartialMigrationDispatcher(ReferenceDispatcher):
    """The reference dispatcher over the whole EP group when each rank migrates only ``m`` of its
    ``L`` experts inside its domain (``0 < m < L``): its first m, or those :meth:`set_migrated` names.

    A token routed to a migrated expert goes to the rank of that expert's domain with the sender's
    offset, which holds a replica; a token routed to any other expert goes to its owner. So rank r
    hosts ``V = S * m + (L - m)`` virtual experts: the replicas of its domain's migrated experts
    (domain offset, then the owner's migrated experts in index order; its own among them) and its
    own experts that stay, in index order. Each expert index is mapped to its virtual expert on the
    sender (``route [E]``, which depends on the sender's offset) and the reference dispatch runs
    unchanged on ``G * V`` virtual experts: rows land expert-major, sources in rank order, and the
    combine sums each token's slots in slot order, as before.

    With ``track_load`` each dispatch also adds the tokens every EP rank routed to every expert
    (``[G, E]``, one all-gather of ``[E]`` counts, no host synchronisation) to :attr:`load`."""

    def __init__(self, num_experts: int, groups: "HybridGroups", local_experts: int, migrated: int):
        G, S, L, m = groups.ep_size, groups.domain_size, local_experts, migrated
        self.virtual_per_rank = V = S * m + (L - m)
        super().__init__(G * V, G, groups.ep_group, rank=groups.ep_rank)
        self.groups, self.real_experts, self.local_experts, self.migrated = groups, num_experts, L, m
        self.track_load = False
        #: ``[G, E]`` int64 tokens each EP rank routed to each expert since :meth:`take_load` (with track_load)
        self.load: Optional[Tensor] = None
        self._load_host = self._load_event = None
        self.set_migrated([list(range(m))] * G)

    def set_migrated(self, chosen: Sequence[Sequence[int]]) -> None:
        """Route to the replicas of ``chosen[o]`` (EP rank o's migrated local experts, m of them,
        ascending) from now on; every rank of the EP group must set the same ``chosen``."""
        G, S, L, m, V = (self.groups.ep_size, self.groups.domain_size, self.local_experts, self.migrated,
                         self.virtual_per_rank)
        if len(chosen) != G or any(list(c) != sorted(set(c)) or len(c) != m or not all(0 <= j < L for j in c)
                                   for c in chosen):
            raise ValueError(f"HybridEP: expected, for each of {G} ranks, {m} distinct ascending local experts "
                             f"in 0..{L - 1}, got {chosen!r}")
        self.chosen = [list(c) for c in chosen]
        moved = torch.zeros(G, L, dtype=torch.bool)
        for o, c in enumerate(self.chosen):
            moved[o, c] = True
        rank_moved = (moved.long().cumsum(1) - 1).reshape(-1)  # place among its owner's migrated experts
        rank_kept = ((~moved).long().cumsum(1) - 1).reshape(-1)  # ... among those that stay
        moved = moved.reshape(-1)
        owner = torch.arange(self.real_experts) // L
        dest = torch.where(moved, (owner // S) * S + self.groups.offset, owner)
        local = torch.where(moved, (owner % S) * m + rank_moved, S * m + rank_kept)
        self.route = dest * V + local  # [E]: this rank's virtual expert for each expert

    def _note_load(self, expert_idx: Tensor) -> None:
        E, G = self.real_experts, self.groups.ep_size
        rows = gather_counts(expert_counts(expert_idx, E), self.groups.ep_group, G)  # [G, E]
        self.load = rows if self.load is None else self.load + rows
        if self.load.is_cuda:  # a host copy that :meth:`take_load` reads without stalling the stream
            if self._load_host is None:
                self._load_host = torch.empty(G, E, dtype=torch.long, pin_memory=True)
            self._load_host.copy_(self.load, non_blocking=True)
            self._load_event = torch.cuda.Event()
            self._load_event.record()

    def take_load(self) -> Optional[List[List[int]]]:
        """The ``[G, E]`` tokens routed since the last call (None if none), and start counting anew."""
        if self.load is None:
            return None
        if self.load.is_cuda:
            self._load_event.synchronize()
            load = self._load_host.tolist()
        else:
            load = self.load.tolist()
        self.load = None
        return load

    def dispatch(self, x: Tensor, expert_idx: Tensor, capacity: Optional[int] = None):
        if self.track_load:
            self._note_load(expert_idx)
        route = self.route.to(expert_idx.device)
        virtual = torch.where(expert_idx >= 0, route[expert_idx.clamp_min(0).long()], expert_idx.long())
        return super().dispatch(x, virtual, capacity)


def hottest_experts(load: Sequence[Sequence[int]], groups: "HybridGroups", local_experts: int,
                    migrated: int) -> List[List[int]]:
    """For each EP rank (owner), the ``migrated`` of its ``local_experts`` experts whose migration
    keeps the most tokens from crossing to it: those the other ranks of its domain routed to them
    (``load [G, E]``, :attr:`PartialMigrationDispatcher.load`; a token from a domain peer to a
    migrated expert stays on that peer), ties to the smaller index; ascending. The same on every
    rank given the same ``load`` (:func:`ds_uniep.hybrid.model.hottest_choice`, which the cost model
    plans with)."""
    from .model import hottest_choice
    return hottest_choice(load, groups.ep_size, groups.domain_size, local_experts, migrated)


class HybridExperts:
    """Runs the domain's S * L experts on this rank from gathered weights (or, migrating ``m < L``
    experts per rank, the domain's S * m replicas and this rank's L - m other experts)."""

    def __init__(self, experts: Sequence[nn.Module], groups: HybridGroups, num_experts: int,
                 compression_ratio: Optional[float] = None, pacing: Optional[InterSitePacing] = None,
                 reuse_replicas: bool = False, boundary: Optional[Callable[[], bool]] = None,
                 name: str = "HybridEP", migrated: Optional[int] = None, choice: str = "hottest"):
        self.experts = list(experts)
        self.groups = groups
        L = len(self.experts)
        #: m: experts per rank migrated inside the domain (which: ``choice``); the others take tokens
        self.migrated = L if migrated is None else migrated
        if isinstance(self.migrated, bool) or not isinstance(self.migrated, int) or not 1 <= self.migrated <= L:
            raise ValueError(f"{name}: migrated experts per rank must be an integer in 1..{L}, got {migrated!r}")
        if choice not in MIGRATION_CHOICES:
            raise ValueError(f"{name}: migrated_experts must be one of {', '.join(MIGRATION_CHOICES)}, got {choice!r}")
        #: which m experts each rank migrates: "first" (its first m) or "hottest" (see :meth:`prefetch`)
        self.choice = choice if self.migrated < L else "first"
        self._chosen_at_step = None  # optimizer_steps() when the choice was last made ("hottest")
        self.compression_ratio = compression_ratio
        self.name = name
        #: Keep a gather for later forwards while the weights it copied are unchanged (see :meth:`prefetch`).
        self.reuse_replicas = reuse_replicas
        self._kept: Optional[tuple] = None  # (key, gather) with reuse_replicas
        #: With reuse_replicas and ``boundary`` (the engine's accumulation boundary), replica gradients
        #: are held until the step's last micro-batch and returned once (see :class:`HeldGradients`).
        self.held: Optional[HeldGradients] = None
        if reuse_replicas:
            if groups.domain_size > 1 and groups.vote_group is None:
                raise ValueError(f"{name}: reuse_replicas needs HybridGroups built with votes=True (the domain's "
                                 "ranks agree at each forward whether to gather)")
            self.set_boundary(boundary)
            optimizer_steps()  # counts steps from here on
        self.names = [n for n, _ in self.experts[0].named_parameters()]
        if self.migrated == L:  # every expert migrated: tokens cross domains only (the offset group)
            self.dispatcher = ReferenceDispatcher(num_experts, groups.ep_size // groups.domain_size,
                                                  groups.offset_group, rank=groups.domain)
        else:
            self.dispatcher = PartialMigrationDispatcher(num_experts, groups, L, self.migrated)
            self.dispatcher.track_load = self.choice == "hottest"
        self.pacing = None
        self.set_pacing(pacing)
        self._inflight: Optional[tuple] = None  # (DomainGather or CompressedGather, its _OwnerSum outputs)
        #: bytes this rank put on the links for the last gather it issued (``wire_bytes``)
        self.last_wire_bytes = 0
        #: that gather, weakly (alive while a forward's graph holds it; its buffers are not kept here)
        self.last_gather = lambda: None
        #: Backward passes that reduced replica gradients to their owners (``owner_reductions``), gathers
        #: issued (``gathers``) and forwards that reused a kept one (``reuses``); tests count them.
        self.counter: Dict[str, int] = {}

    def set_pacing(self, pacing: Optional[InterSitePacing]) -> None:
        """Send the gather, the gradient return and the token all-to-alls through ``pacing`` (None: off)."""
        self.pacing = pacing
        self.dispatcher.pacing = pacing

    def prefetch(self) -> None:
        """Issue the gather of the domain's expert weights now (asynchronous); :meth:`gather` waits
        for it. The layer calls this first in its forward, before the router. The autograd node that
        sums the returned replica gradients is made here too, so that it runs at the end of the
        layer's backward (see :class:`_OwnerSum`).

        With ``reuse_replicas`` the gather is kept, and a later forward whose weights are unchanged
        (:meth:`_weights_key`: no optimizer step, no in-place change of an expert parameter since)
        reuses it instead of gathering: gradient-accumulation micro-batches gather once per step.
        Each forward's backward returns its replica gradients to their owners, or, with a boundary
        (:class:`HeldGradients`), adds them to the step's sums until the step's last backward."""
        g = self.groups
        if self._inflight is not None:  # issued and never used (a forward that stopped early)
            self._inflight[0].gathered.wait()
        key = self._weights_key([p for e in self.experts for p in e.parameters()]) if self.reuse_replicas else None
        # The domain's ranks reuse or gather together: one rank whose weights changed (or that called
        # refresh_replicas) makes every rank of its domain gather, instead of gathering alone.
        if self.reuse_replicas and g.any_in_domain(self._kept is None or self._kept[0] != key):
            self._kept = None
        if self._kept is not None:
            gathered, self.last_wire_bytes = self._kept[1], 0
            self.counter["reuses"] = self.counter.get("reuses", 0) + 1
        else:
            if self.held is not None and self.held.sums is not None:
                raise RuntimeError(
                    f"{self.name}: the expert weights changed (an optimizer step, an in-place change or "
                    f"refresh_replicas()) while the replica gradients of {self.held.count} micro-batch(es) were "
                    "held for the step's last one, whose backward never came: under a DeepSpeed engine call "
                    "engine.step() after every engine.backward(); with UniEPMoE.set_accumulation_boundary, "
                    "its function must return True in the step's last backward")
            self._kept = None  # its buffers go before the new gather's are allocated
            self._choose()
            local = self._migrated_params()
            if self.compression_ratio is None:
                gathered = DomainGather(local, g.domain_group, g.domain_size, self.pacing)
            else:
                gathered = CompressedGather(local, g.domain_group, g.domain_size, self.pacing, len(self.names),
                                            g.offset, self.compression_ratio)
            self.last_wire_bytes = gathered.wire_bytes
            self.counter["gathers"] = self.counter.get("gathers", 0) + 1
            if self.reuse_replicas:
                self._kept = (key, gathered)
        self.last_gather = weakref.ref(gathered)
        use = _GatherUse(gathered, self.held)
        self._inflight = (use, _OwnerSum.apply(use, self.counter, *self._migrated_params()))

    @property
    def migrated_by_rank(self) -> Optional[List[List[int]]]:
        """Per EP rank, the local experts its domain peers hold replicas of now (the dispatcher's
        routes); None where every expert migrates."""
        return self.dispatcher.chosen if self.migrated < len(self.experts) else None

    @property
    def chosen(self) -> List[int]:
        """This rank's migrated experts (local indices, ascending), as the dispatcher routes now
        (``dispatcher.set_migrated`` changes them)."""
        by_rank = self.migrated_by_rank
        return list(range(self.migrated)) if by_rank is None else by_rank[self.groups.ep_rank]

    def _migrated_params(self) -> List[Tensor]:
        return [p for l in self.chosen for p in self.experts[l].parameters()]

    def _choose(self) -> None:
        """With ``choice`` "hottest", at a gather: migrate, on every rank, the experts that keep the
        most tokens local (:func:`hottest_experts`) by the tokens routed since the last choice, and
        route to them from now on. Without ``reuse_replicas`` every forward chooses (from the tokens
        of the forwards since the last); with it, the first gather after each optimizer step does
        (a domain that gathers again for another reason keeps the step's choice, so every rank of
        the EP group routes alike). No tokens seen yet: the first m stay."""
        if self.choice != "hottest":
            return
        step = optimizer_steps()
        if self.reuse_replicas and step == self._chosen_at_step:
            return
        load = self.dispatcher.take_load()
        self._chosen_at_step = step
        if load is None:
            return
        g = self.groups
        chosen = hottest_experts(load, g, len(self.experts), self.migrated)
        if chosen != self.dispatcher.chosen:
            self.dispatcher.set_migrated(chosen)
            self.counter["choices_changed"] = self.counter.get("choices_changed", 0) + 1
            if self.counter["choices_changed"] == 1 and g.ep_rank == 0:  # once: the choice follows the tokens
                logger.info(f"{self.name}: HybridEP migrates the hottest experts now (local indices per EP rank "
                            f"{chosen}); later changes are counted in counter['choices_changed']")

    def _weights_key(self, local: Sequence[Tensor]) -> tuple:
        """What a kept gather must match to be reused: the optimizer steps taken in this process, and
        each expert parameter's identity, storage, version counter (in-place changes), shape, dtype and
        device. The domain's ranks agree before using it (:meth:`HybridGroups.any_in_domain`): if
        any rank's key changed, every rank of the domain gathers."""
        return (optimizer_steps(), self.compression_ratio,
                tuple((id(p), p.data_ptr(), p._version, tuple(p.shape), p.dtype, p.device) for p in local))

    def set_boundary(self, boundary: Optional[Callable[[], bool]]) -> None:
        """Hold replica gradients until ``boundary()`` is true (None: return them at every backward)."""
        if self.held is not None and self.held.sums is not None:
            raise RuntimeError(f"{self.name}: the accumulation boundary changed while the replica gradients of "
                               f"{self.held.count} micro-batch(es) were held")
        self.held = HeldGradients(boundary) if boundary is not None else None

    def refresh_replicas(self) -> None:
        """Drop the kept gather: the next forward gathers again, on every rank of the domain (one
        rank's call is enough). Call it after changing expert weights in a way the reuse check does
        not see (through ``.data``, or a buffer the parameters view, without an optimizer step)."""
        self._kept = None

    def gather(self) -> List[Dict[str, Tensor]]:
        """``[S * m]`` parameter dicts of the migrated experts' replicas, domain expert order (owner
        offset, then local index)."""
        g = self.groups
        if self._inflight is None:
            self.prefetch()
        (use, buffers), self._inflight = self._inflight, None
        replicas = _ReplicaViews.apply(use, *buffers)  # [s * n + t]: rank s's copy of local tensor t
        P, m, S = len(self.names), self.migrated, g.domain_size
        n = P * m
        return [{name: replicas[s * n + l * P + i] for i, name in enumerate(self.names)}
                for s in range(S) for l in range(m)]

    def run(self, recv: Tensor, counts: Tensor, gemm: str = "torch") -> Tensor:
        """This rank's experts over their rows of ``recv``: the ``S * m`` replicas, then (migrating
        ``m < L``) its own ``L - m`` experts that stay, ``counts`` rows each. Recognised bf16 MLP
        experts run as one grouped GEMM per projection over all of them (on ``gemm``, as the plain
        EP path); other experts are called one by one with their weights."""
        params = self.gather()
        stay = [self.experts[j] for j in range(len(self.experts)) if j not in self.chosen]
        modules = [self.experts[l] for _ in range(self.groups.domain_size) for l in self.chosen] + stay
        params = params + [dict(e.named_parameters()) for e in stay]
        stacked = stack_experts(modules, recv.dtype, recv.device, params)
        if stacked is not None:
            return run_grouped(modules, recv, counts, gemm, stacked=stacked)
        outs = []
        for j, rows in enumerate(recv.split(counts.tolist())):
            out = functional_call(modules[j], params[j], (rows, ))
            if isinstance(out, tuple):
                out = out[0]
            outs.append(out)
        return torch.cat(outs) if outs else recv


def _ring_exchange_s(ep_group, peer_next: int, peer_prev: int, nbytes: int, repeats: int, device,
                     pacing: Optional[InterSitePacing] = None) -> float:
    """Slowest rank's median seconds to send ``nbytes`` to ``peer_next`` while receiving from
    ``peer_prev`` (EP-group ranks), through ``pacing`` when given."""
    G = torch_dist.get_world_size(ep_group)
    sent, received = [0] * G, [0] * G
    sent[peer_next] += nbytes
    received[peer_prev] += nbytes
    to_global = torch_dist.get_process_group_ranks(ep_group)
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    times = []
    for _ in range(repeats + 1):  # the first exchange sets up the connections; not counted
        torch_dist.barrier(group=ep_group)
        t0 = time.perf_counter()
        reqs = torch_dist.batch_isend_irecv([
            torch_dist.P2POp(torch_dist.isend, send, to_global[peer_next], group=ep_group),
            torch_dist.P2POp(torch_dist.irecv, recv, to_global[peer_prev], group=ep_group)])
        for r in reqs:
            r.wait()
        if pacing is not None:
            pacing.pace(ep_group, sent, received, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    worst = torch.tensor([statistics.median(times[1:])], dtype=torch.float64, device=device)
    torch_dist.all_reduce(worst, op=torch_dist.ReduceOp.MAX, group=ep_group)
    return float(worst.item())


def measure_bandwidths(ep_group, site_size: int, nbytes: int = 8 << 20, repeats: int = 3,
                       pacing: Optional[InterSitePacing] = None):
    """(intra-site, inter-site) bytes/s per rank, from ring exchanges inside a site and between
    same-offset ranks of neighbouring sites. Every rank gets the same numbers (the slowest rank's
    time), so every rank plans the same domain size. A level that does not exist (one site, or
    sites of one rank) takes the other level's number. With ``pacing`` the exchanges go through
    it, as the layer's traffic does."""
    G = torch_dist.get_world_size(ep_group)
    r = torch_dist.get_rank(ep_group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch_dist.get_backend(ep_group) == "nccl" \
        else torch.device("cpu")
    site, off = divmod(r, site_size)
    intra = inter = None
    if site_size > 1:
        t = _ring_exchange_s(ep_group, site * site_size + (off + 1) % site_size,
                             site * site_size + (off - 1) % site_size, nbytes, repeats, device, pacing)
        intra = nbytes / t
    if G > site_size:
        t = _ring_exchange_s(ep_group, (r + site_size) % G, (r - site_size) % G, nbytes, repeats, device, pacing)
        inter = nbytes / t
    if intra is None and inter is None:
        raise ValueError("measuring bandwidths needs at least 2 ranks")
    return (intra if intra is not None else inter), (inter if inter is not None else intra)


def choose_domain_size(hybrid_cfg, ep_size: int, expert: nn.Module, hidden_size: int, k: int,
                       max_tokens_per_rank: int, experts_per_rank: int, local_world_size: int, ep_group=None,
                       pacing: Optional[InterSitePacing] = None, num_microbatches: int = 1):
    """``(S, plan)`` for ``"domain_size": "auto"``: the planner of :mod:`.model` on this layer.

    Inputs: the configured site size (auto: the ranks of one node, ``local_world_size``, as
    far as it divides the EP size) and bandwidths (bytes/s, or measured over ``ep_group`` by
    :func:`measure_bandwidths`, through ``pacing`` when given); token bytes D = T_max * k * M *
    element size; expert bytes from the expert's parameters; expert compute from its FLOPs and
    pre-expert compute from the attention projections' (2 * T * 4 * M^2), both at
    :data:`ds_uniep.hybrid.presets.DEFAULT_TFLOPS`, as the ``plan`` CLI estimates them. The domain
    size is the configured one or (``"auto"``) chosen; the migrated fraction is the configured one
    (rounded to whole experts, :func:`migrated_experts`) against plain EP, or (``"auto"``) chosen
    among ``j / experts_per_rank`` (the runtime migrates whole experts: ``m = phi * L``). The layer
    calls it with ``domain_size`` auto only.
    ``num_microbatches``: forwards served by one gather and one gradient return (the engine's
    gradient accumulation steps when replicas are kept, else 1).
    """
    inputs = planner_inputs(hybrid_cfg, ep_size, expert, hidden_size, k, max_tokens_per_rank, experts_per_rank,
                            local_world_size, ep_group, pacing, num_microbatches)
    S, _, p = plan_domains(inputs, experts_per_rank, hybrid_cfg.domain_size)
    return S, p


def plan_domains(inputs, experts_per_rank: int, domain_size="auto", load=None, migrated_experts: str = "hottest"):
    """``(S, m, plan)`` for :func:`planner_inputs`' tuple (``load``, ``migrated_experts``: as
    :func:`ds_uniep.hybrid.model.plan`): the domain size and migrated experts per rank to run, 1 and
    0 where plain EP wins."""
    from .model import plan
    wl, cl, fractions, ratio, elsize = inputs
    p = plan(wl, cl, domain_size, compression_ratio=ratio, fractions=fractions, bytes_per_value=elsize, load=load,
             migrated_experts=migrated_experts)
    S = p.domain_size if p.migrated_fraction > 0 else 1
    return S, (round(p.migrated_fraction * experts_per_rank) if S > 1 else 0), p


def planner_inputs(hybrid_cfg, ep_size: int, expert: nn.Module, hidden_size: int, k: int,
                   max_tokens_per_rank: int, experts_per_rank: int, local_world_size: int, ep_group=None,
                   pacing: Optional[InterSitePacing] = None, num_microbatches: int = 1):
    """``(workload, cluster, fractions, compression_ratio, bytes_per_value)``: what
    :func:`choose_domain_size` plans with (see there); a layer keeps them to plan again for the
    routing it has seen (``"replan_after_steps"``)."""
    from .model import Cluster, Workload
    from .presets import DEFAULT_TFLOPS
    site = hybrid_cfg.site_size if hybrid_cfg.site_size != "auto" else math.gcd(local_world_size, ep_size)
    if ep_size % site != 0:
        raise ValueError(f'"uniep": {{"hybrid": {{"site_size": {site}}}}} must divide the expert-parallel size {ep_size}')
    intra, inter = hybrid_cfg.intra_site_bandwidth, hybrid_cfg.inter_site_bandwidth
    if "measure" in (intra, inter):
        m_intra, m_inter = measure_bandwidths(ep_group, site, pacing=pacing)
        intra = m_intra if intra == "measure" else intra
        inter = m_inter if inter == "measure" else inter
    params = list(expert.parameters())
    expert_bytes = float(sum(p.numel() * p.element_size() for p in params))
    elsize = params[0].element_size() if params else 2
    token_bytes = float(max_tokens_per_rank * k * hidden_size * elsize)
    flops = 2.0 * sum(p.numel() for p in params) * max_tokens_per_rank * k
    wl = Workload(token_bytes=token_bytes, expert_bytes=expert_bytes, experts_per_rank=experts_per_rank,
                  pre_expert_compute_s=2.0 * max_tokens_per_rank * 4 * hidden_size**2 / (DEFAULT_TFLOPS * 1e12),
                  expert_compute_s=flops / (DEFAULT_TFLOPS * 1e12), num_microbatches=num_microbatches)
    cl = Cluster(num_ranks=ep_size, site_size=site, intra_site_bandwidth_bytes_per_s=intra,
                 inter_site_bandwidth_bytes_per_s=inter)
    # Compressed migration moves the encoded experts and all-reduces the shared base
    # (CompressedGather), the bytes the model charges for a compression ratio.
    ratio = hybrid_cfg.compression.ratio if hybrid_cfg.compression.enabled else None
    L, frac = experts_per_rank, hybrid_cfg.migrated_fraction
    fractions = (tuple(j / L for j in range(L + 1)) if frac == "auto"
                 else (0.0, migrated_experts(frac, L) / L))
    return wl, cl, fractions, ratio, elsize


def measure_expert_compute(experts: Sequence[nn.Module], rows: int, hidden_size: int, dtype: torch.dtype,
                           device, gemm: str = "torch", repeats: int = 3, min_seconds: float = 0.05,
                           max_repeats: int = 200) -> float:
    """Seconds of ``experts``' forward (the layer's local experts, as the plain EP path runs them:
    grouped GEMMs on ``gemm`` where they are recognised, else one by one) over ``rows`` random rows of
    ``hidden_size`` in ``dtype`` on ``device``, split evenly among them (the first ones take the
    remainder): the median of the timed runs after one untimed run, without autograd, by the
    autotuner's clock (CUDA events on a GPU, else ``time.perf_counter``). ``repeats`` runs are timed,
    then, while they add up to less than ``min_seconds``, as many more as fill it at their median
    (``max_repeats`` in all at most): a sub-millisecond forward is timed about 50 ms long, a slow
    one ``repeats`` times. What ``"replan_compute": "measure"`` plans with."""
    from ..experts import run_experts
    from ..tuning.tuner import _Timer
    if rows < 1 or repeats < 1 or max_repeats < repeats or min_seconds < 0 or not experts:
        raise ValueError(f"measure_expert_compute: needs rows >= 1, 1 <= repeats <= max_repeats, min_seconds >= 0 "
                         f"and experts, got rows {rows}, repeats {repeats}, max_repeats {max_repeats}, min_seconds "
                         f"{min_seconds}, {len(experts)} experts")
    device = torch.device(device)
    L = len(experts)
    counts = torch.tensor([rows // L + (1 if j < rows % L else 0) for j in range(L)], dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden_size, generator=g).to(device=device, dtype=dtype)
    clock = _Timer("cuda" if device.type == "cuda" else "cpu")

    def forward():
        run_experts(list(experts), x, counts, gemm=gemm)
    # (the clock's events and sync are the current device's)
    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        clock.run(forward, 1)  # the first run (caches, kernel choices) is not counted
        ms = clock.run(forward, repeats)
        short = min_seconds * 1e3 - sum(ms)
        if short > 0:
            more = math.ceil(short / max(statistics.median(ms), 1e-6))
            ms += clock.run(forward, min(more, max_repeats - repeats))
    return statistics.median(ms) * 1e-3


def with_compute(inputs, expert_compute_s: float):
    """:func:`planner_inputs`' tuple with the experts' forward compute ``expert_compute_s`` (measured)
    in place of its estimate, and the compute before the router scaled from its estimate by the same
    ratio (the layer cannot time the attention that runs before it)."""
    wl, *rest = inputs
    if not expert_compute_s > 0:
        raise ValueError(f"expert compute must be a positive number of seconds, got {expert_compute_s}")
    scale = expert_compute_s / wl.expert_compute_s
    wl = dataclasses.replace(wl, expert_compute_s=expert_compute_s,
                             pre_expert_compute_s=wl.pre_expert_compute_s * scale)
    return (wl, *rest)


MIGRATION_CHOICES = ("first", "hottest")


def migrated_experts(fraction: float, local_experts: int) -> int:
    """m: experts per rank a migrated ``fraction`` moves, the nearest whole number to
    ``fraction * L`` (exact rational arithmetic, halves up; 0 means plain EP)."""
    from .model import migrated_count
    return migrated_count(fraction, local_experts)
