"""HybridEP's planner on a layer: the inputs of :func:`ds_uniep.hybrid.model.plan` for a layer's
experts and ranks (bandwidths configured or measured, compute estimated or measured), and the
domain size and migrated experts per rank it chooses (``"domain_size": "auto"``,
``"replan_after_steps"``).
"""

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import nn

from .pacing import InterSitePacing


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

    Inputs: the configured site size (auto: the ranks of one node, ``local_world_size`` from
    :func:`ds_uniep.topology.node_size`, as far as it divides the EP size) and bandwidths
    (bytes/s, or measured over ``ep_group`` by :func:`measure_bandwidths`, through ``pacing`` when
    given); token bytes D = T_max * k * M * element size; expert bytes from the expert's
    parameters; expert compute from its FLOPs and
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


def migrated_experts(fraction: float, local_experts: int) -> int:
    """m: experts per rank a migrated ``fraction`` moves, the nearest whole number to
    ``fraction * L`` (exact rational arithmetic, halves up; 0 means plain EP)."""
    from .model import migrated_count
    return migrated_count(fraction, local_experts)
