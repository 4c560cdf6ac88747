"""HybridEP inside ``UniEPMoE``: experts gathered inside a domain, tokens sent only across domains.

Letters: G expert-parallel ranks, S ranks per domain, D = G / S domains, L local
experts per rank, E = G * L experts. EP rank ``r`` is offset ``r % S`` of domain
``r // S``; domains are contiguous runs of EP ranks, so domain ``d`` owns the
experts ``[d * S * L, (d + 1) * S * L)``.

One layer on rank r:

1. Gather: every rank of the domain receives the weights of all S * L experts of
   its domain (its own included, through the same path).
2. Dispatch over the *offset group* (the D ranks with r's offset, one per
   domain): a token routed to expert e goes to the rank of e's domain with r's
   offset, which holds a replica of e. A token whose expert lives in r's own
   domain stays on r. This is the reference dispatcher with D "ranks" of S * L
   experts each, so the deterministic layout carries over unchanged.
3. Each replica runs over its rows (``torch.func.functional_call`` on the
   expert module with the gathered weights).
4. Combine over the offset group, in slot order in fp32.

Backward: the gradient of a replica comes back to its owner through the
gather's backward, an all-to-all that hands each owner the S gradients of its
own tensors (the gather's bytes, mirrored), added in domain-rank order (fp32),
so each owner parameter receives exactly one gradient per backward, before
DeepSpeed's expert-data-parallel reduction.
With S = 1 the layer takes the plain EP path, so it is bitwise plain EP.

:class:`InterSitePacing` (opt-in, off by default) holds a rank after each of
these collectives for the bytes it exchanged with other sites over a given
bandwidth: slow links between sites, emulated on one host, so HybridEP and
plain EP can be measured against the cost model of :mod:`.model`.
"""

import math
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn
from torch.func import functional_call

from ..reference import ReferenceDispatcher


class InterSitePacing:
    """Slow links between sites, emulated on one host by pacing (opt-in; nothing uses it by default).

    Sites are runs of ``site_size`` consecutive global ranks. The fast backend (NCCL, gloo) still
    moves every byte, so results are unchanged; after each collective a layer sends through
    :meth:`pace` (the reference dispatcher's token all-to-alls forward and backward, HybridEP's
    domain gather and the return of replica gradients, the probe of :func:`measure_bandwidths`),
    the rank is held for ``max(bytes sent to other sites, bytes received from them) /
    bytes_per_s``: each rank has one slow link per direction, and the bytes of one collective
    cross it back to back. A collective's time is the fast backend's plus the hold;
    :func:`measure_bandwidths` through the same pacing measures the sum. The exchange of
    per-expert row counts (``[E]`` integers) is not paced.

    How a CUDA rank is held (``hold``): ``"host"`` waits for the current stream to finish the
    collective, then ``time.sleep``s (wall-clock exact; nothing is queued meanwhile); ``"stream"``
    queues a spin on the current stream (``torch.cuda._sleep``, its clock rate timed once against
    CUDA events), which the host does not wait for, but whose length follows the SM clock. A
    CPU rank always sleeps.

    ``paced_bytes`` and ``paced_s`` count what this rank was held for (tests and benchmarks read them).
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
        self._cycles_per_s: Dict[int, float] = {}

    def site_of(self, global_rank: int) -> int:
        return global_rank // self.site_size

    def remote(self, group) -> List[bool]:
        """For each rank of ``group`` (group order): does it lie in another site than this rank?"""
        ranks = torch_dist.get_process_group_ranks(group) if group is not None else \
            list(range(torch_dist.get_world_size()))
        mine = self.site_of(torch_dist.get_rank())
        return [self.site_of(r) != mine for r in ranks]

    def pace(self, group, send_bytes: Sequence[int], recv_bytes: Sequence[int], device: torch.device) -> float:
        """Hold this rank for the inter-site share of one collective over ``group``.

        ``send_bytes[i]`` / ``recv_bytes[i]``: bytes this rank sent to / received from group rank
        ``i``. Returns the seconds held."""
        remote = self.remote(group)
        nbytes = max(sum(b for b, far in zip(send_bytes, remote) if far),
                     sum(b for b, far in zip(recv_bytes, remote) if far))
        if nbytes == 0:
            return 0.0
        seconds = nbytes / self.bytes_per_s
        self.paced_bytes += nbytes
        self.paced_s += seconds
        self.hold(seconds, device)
        return seconds

    def hold(self, seconds: float, device: torch.device) -> None:
        """Delay the work queued after this point on ``device`` by ``seconds``."""
        if device.type == "cuda" and self.hold_mode == "stream":
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s(device))))
            return
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
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

    def __init__(self, ep_group, domain_size: int):
        G = torch_dist.get_world_size(ep_group)
        if domain_size < 1 or G % domain_size != 0:
            raise ValueError(f'"uniep": {{"hybrid": {{"domain_size": {domain_size}}}}} must divide the '
                             f"expert-parallel size {G}")
        S = domain_size
        self.domain_size, self.ep_size = S, G
        self.ep_rank = torch_dist.get_rank(ep_group)
        self.domain, self.offset = divmod(self.ep_rank, S)
        # Every EP group of the world, in a fixed order, so all ranks create the same groups.
        mine = torch_dist.get_process_group_ranks(ep_group)
        everyone: List[Optional[List[int]]] = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(everyone, mine)
        ep_groups = sorted({tuple(g) for g in everyone})
        self.domain_group = self.offset_group = None
        for ranks in ep_groups:
            for d in range(G // S):
                g = torch_dist.new_group(list(ranks[d * S:(d + 1) * S]))
                if list(ranks) == mine and d == self.domain:
                    self.domain_group = g
            for o in range(S):
                g = torch_dist.new_group(list(ranks[o::S]))
                if list(ranks) == mine and o == self.offset:
                    self.offset_group = g


class _GatherDomain(torch.autograd.Function):
    """Forward: ``[S, ...]`` replicas of each local tensor across the domain. Backward: the
    owner's gradient is the sum of the S replica gradients, added in domain-rank order in fp32."""

    @staticmethod
    def forward(ctx, group, S: int, offset: int, counter: Optional[Dict[str, int]],
                pacing: Optional[InterSitePacing], *local: Tensor):
        ctx.group, ctx.S, ctx.offset, ctx.counter, ctx.pacing = group, S, offset, counter, pacing
        out = []
        for t in local:
            parts = [torch.empty_like(t) for _ in range(S)]
            torch_dist.all_gather(parts, t.detach().contiguous(), group=group)
            if pacing is not None:  # one copy to and from every peer
                nbytes = t.numel() * t.element_size()
                pacing.pace(group, [nbytes] * S, [nbytes] * S, t.device)
            out.append(torch.stack(parts))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        S = ctx.S
        result = []
        for g in grads:
            # g[i]: this rank's gradient of domain rank i's tensor. After the all-to-all,
            # parts[j] = rank j's gradient of this rank's tensor; they are added in rank order.
            g = g.contiguous()
            parts = torch.empty_like(g)
            torch_dist.all_to_all_single(parts, g, group=ctx.group)
            if ctx.pacing is not None:
                nbytes = g[0].numel() * g.element_size()
                ctx.pacing.pace(ctx.group, [nbytes] * S, [nbytes] * S, g.device)
            acc = torch.zeros_like(g[0], dtype=torch.float32)
            for j in range(S):
                acc = acc + parts[j].float()
            result.append(acc.to(g.dtype))
        if ctx.counter is not None:
            ctx.counter["owner_reductions"] = ctx.counter.get("owner_reductions", 0) + 1
        return (None, None, None, None, None) + tuple(result)


def _compressed_replicas(stacked: Sequence[Tensor], num_params: int, offset: int, ratio: float) -> List[Tensor]:
    """What compressed migration delivers: for each parameter, the domain's shared base (the mean of
    all S * L experts' copies) with each *other* owner's top-``ratio`` positions restored; this
    rank's own experts stay exact. ``stacked[l * P + i]``: ``[S, ...]`` replicas of local expert l,
    parameter i. The gradient passes straight through to the owners."""
    from .compress import decode, encode, shared_base
    out = list(stacked)
    L = len(stacked) // num_params
    for i in range(num_params):
        replicas = [stacked[l * num_params + i] for l in range(L)]  # L x [S, ...]
        base = shared_base(torch.cat([r.detach() for r in replicas]))
        for l, r in enumerate(replicas):
            approx = torch.stack([r[s].detach() if s == offset else decode(encode(r[s].detach(), base, ratio), base)
                                  for s in range(r.shape[0])])
            out[l * num_params + i] = r + (approx - r).detach()
    return out


class HybridExperts:
    """Runs the domain's S * L experts on this rank from gathered weights."""

    def __init__(self, experts: Sequence[nn.Module], groups: HybridGroups, num_experts: int,
                 compression_ratio: Optional[float] = None, pacing: Optional[InterSitePacing] = None):
        self.experts = list(experts)
        self.groups = groups
        self.compression_ratio = compression_ratio
        self.names = [n for n, _ in self.experts[0].named_parameters()]
        self.dispatcher = ReferenceDispatcher(num_experts, groups.ep_size // groups.domain_size,
                                              groups.offset_group, rank=groups.domain)
        self.pacing = None
        self.set_pacing(pacing)
        #: Backward passes that reduced replica gradients to their owners (tests count them).
        self.counter: Dict[str, int] = {}

    def set_pacing(self, pacing: Optional[InterSitePacing]) -> None:
        """Send the gather, the gradient return and the token all-to-alls through ``pacing`` (None: off)."""
        self.pacing = pacing
        self.dispatcher.pacing = pacing

    def gather(self) -> List[Dict[str, Tensor]]:
        """``[S * L]`` parameter dicts, domain expert order (owner offset, then local index)."""
        g = self.groups
        local = [p for e in self.experts for p in e.parameters()]
        stacked = _GatherDomain.apply(g.domain_group, g.domain_size, g.offset, self.counter, self.pacing, *local)
        P = len(self.names)
        if self.compression_ratio is not None:
            stacked = _compressed_replicas(stacked, P, g.offset, self.compression_ratio)
        L = len(self.experts)
        return [{name: stacked[l * P + i][s] for i, name in enumerate(self.names)}
                for s in range(g.domain_size) for l in range(L)]

    def run(self, recv: Tensor, counts: Tensor) -> Tensor:
        params = self.gather()
        L = len(self.experts)
        outs = []
        for j, rows in enumerate(recv.split(counts.tolist())):
            out = functional_call(self.experts[j % L], params[j], (rows, ))
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
                       pacing: Optional[InterSitePacing] = None):
    """``(S, plan)`` for ``"domain_size": "auto"``: the planner of :mod:`.model` on this layer.

    Inputs: the configured site size (auto: the ranks of one node, ``local_world_size``, as
    far as it divides the EP size) and bandwidths (bytes/s, or measured over ``ep_group`` by
    :func:`measure_bandwidths`, through ``pacing`` when given); token bytes D = T_max * k * M *
    element size; expert bytes from the expert's parameters; expert compute from its FLOPs and
    pre-expert compute from the attention projections' (2 * T * 4 * M^2), both at
    :data:`ds_uniep.hybrid.presets.DEFAULT_TFLOPS`, as the ``plan`` CLI estimates them. The runtime migrates whole domains, so the
    planner chooses between plain EP and full migration (fractions 0 and 1).
    """
    from .model import Cluster, Workload, plan
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
                  expert_compute_s=flops / (DEFAULT_TFLOPS * 1e12))
    cl = Cluster(num_ranks=ep_size, site_size=site, intra_site_bandwidth_bytes_per_s=intra,
                 inter_site_bandwidth_bytes_per_s=inter)
    ratio = hybrid_cfg.compression.ratio if hybrid_cfg.compression.enabled else None
    p = plan(wl, cl, "auto", compression_ratio=ratio, fractions=(0.0, 1.0))
    return (p.domain_size if p.migrated_fraction > 0 else 1), p
