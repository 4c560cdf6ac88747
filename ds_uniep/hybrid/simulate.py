"""The cost model over many sites, vectorised: EP vs HybridEP at up to 1,000 sites.

A site (a data centre, say) holds ``site_size`` ranks on fast links; sites
are joined by slow links. The sweep varies the number of sites N (G = N L
ranks), the inter-site bandwidth, and the HybridEP domain size, counted in
whole sites (S = m L: gathering inside one site saves no slow-link bytes,
see :mod:`ds_uniep.hybrid.model`). With ``num_experts`` given, the model is
fixed and each rank owns ``E / G`` experts (a fraction past G = E: the model
is fluid, standing for experts split across ranks); without it each rank
keeps ``workload.experts_per_rank`` and the model grows with the cluster.

With E fixed, both what HybridEP saves (token bytes to the migrated experts)
and what it pays (their gather and gradient return) scale as (S - L)/G: at
low bandwidth it wins when the domain's expert bytes, gathered and returned
once a step, are fewer than the token bytes they replace over the step's
micro-batches; with S fixed and G growing both shrink next to the remaining
all-to-all and the speedup tends to 1.

Shapes of the arrays: B bandwidths, N site counts, K domain sizes, F
migrated fractions; everything is evaluated at once as ``[N, K, F]`` per
bandwidth.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .model import DEFAULT_FRACTIONS, GBPS, Workload, migration_bytes, layer_times

DEFAULT_SITES_PER_DOMAIN = (2, 4, 8)


def default_site_counts(max_sites: int, step: int = 8) -> np.ndarray:
    """2, 4, then every multiple of ``step`` up to ``max_sites`` (and ``max_sites`` itself)."""
    counts = {n for n in (2, 4) if n <= max_sites} | set(range(step, max_sites + 1, step)) | {max_sites}
    return np.asarray(sorted(counts), dtype=np.int64)


def default_bandwidths() -> np.ndarray:
    """0.1 to 1000 Gbps, ten points a decade (bytes/s); 1, 10 and 100 Gbps are on the grid."""
    return np.round(10.0**np.linspace(-1, 3, 41), 6) * GBPS


@dataclass
class SweepResult:
    """Per-micro-batch forward+backward times (seconds) over the grid; nan where S does not divide G."""

    inter_bandwidths_bytes_per_s: np.ndarray  # [B]
    num_sites: np.ndarray  # [N]
    sites_per_domain: np.ndarray  # [K]
    site_size: int
    ep_s: np.ndarray  # [B, N]
    hybrid_s: np.ndarray  # [B, N, K] best fraction for each domain size
    hybrid_fraction: np.ndarray  # [B, N, K]
    best_s: np.ndarray  # [B, N] best over domain sizes (plain EP included)
    best_sites_per_domain: np.ndarray  # [B, N] 1 means plain EP
    best_fraction: np.ndarray  # [B, N]

    @property
    def speedup(self) -> np.ndarray:
        """[B, N, K] EP time over HybridEP time at each fixed domain size."""
        return self.ep_s[:, :, None] / self.hybrid_s

    @property
    def best_speedup(self) -> np.ndarray:
        """[B, N] EP time over the planner's choice."""
        return self.ep_s / self.best_s


def sweep(workload: Workload, site_size: int, intra_site_bandwidth_bytes_per_s: float,
          num_sites: Optional[Sequence[int]] = None, inter_bandwidths_bytes_per_s: Optional[Sequence[float]] = None,
          sites_per_domain: Sequence[int] = DEFAULT_SITES_PER_DOMAIN, fractions: Sequence[float] = DEFAULT_FRACTIONS,
          compression_ratio: Optional[float] = None, bytes_per_value: int = 2, num_experts: Optional[int] = None,
          progress: bool = True) -> SweepResult:
    """Evaluate EP and HybridEP over the grid (see the module docstring)."""
    if isinstance(site_size, bool) or not isinstance(site_size, int) or site_size < 1:
        raise ValueError(f"site_size: must be a positive integer, got {site_size!r}")
    if not intra_site_bandwidth_bytes_per_s > 0:
        raise ValueError(f"intra_site_bandwidth_bytes_per_s: must be positive, got {intra_site_bandwidth_bytes_per_s}")
    n = np.asarray(default_site_counts(1000) if num_sites is None else num_sites, dtype=np.int64)
    bws = np.asarray(default_bandwidths() if inter_bandwidths_bytes_per_s is None else inter_bandwidths_bytes_per_s,
                     dtype=np.float64)
    m = np.asarray(sites_per_domain, dtype=np.int64)
    if n.min() < 1 or m.min() < 1 or not (bws > 0).all():
        raise ValueError("num_sites, sites_per_domain and bandwidths must be positive")
    phis = np.asarray(sorted(set(float(f) for f in fractions) | {0.0}), dtype=np.float64)
    if phis.min() < 0 or phis.max() > 1:
        raise ValueError(f"fractions: every fraction must be in [0, 1], got {list(fractions)}")
    pe_wire, base = migration_bytes(workload, compression_ratio, bytes_per_value)
    l = site_size
    g = (n * l).astype(np.float64)[:, None, None]  # [N, 1, 1]
    s = (m * l).astype(np.float64)[None, :, None]  # [1, K, 1]
    valid = (n[:, None] % m[None, :]) == 0  # [N, K]
    e_r = workload.experts_per_rank if num_experts is None else num_experts / g

    def evaluate(domain, phi, bw):
        fwd, bwd, *_ = layer_times(workload.token_bytes, pe_wire, workload.grad_bytes, base,
                                   e_r, g, domain, l, intra_site_bandwidth_bytes_per_s, bw,
                                   workload.pre_expert_compute_s, workload.expert_compute_s,
                                   workload.backward_compute_factor, workload.num_microbatches, phi,
                                   workload.returns_every_microbatch)
        return fwd + bwd

    ep = np.empty((len(bws), len(n)))
    hyb = np.empty((len(bws), len(n), len(m)))
    hyb_phi = np.empty_like(hyb)
    iterator = range(len(bws))
    if progress:
        from tqdm import tqdm
        iterator = tqdm(iterator, desc="bandwidths", unit="bw", leave=False)
    for b in iterator:
        ep[b] = evaluate(1.0, 0.0, bws[b])[:, 0, 0]
        t = np.broadcast_to(evaluate(s, phis[None, None, :], bws[b]), (len(n), len(m), len(phis)))
        k = np.argmin(t, axis=2)  # first minimum: the smallest fraction among ties
        hyb[b] = np.where(valid, np.take_along_axis(t, k[..., None], 2)[..., 0], np.nan)
        hyb_phi[b] = np.where(valid, phis[k], np.nan)
    # The planner may keep plain EP: column 0 is EP, then each domain size; nan never wins.
    cand = np.concatenate([ep[:, :, None], np.where(np.isnan(hyb), np.inf, hyb)], axis=2)
    pick = np.argmin(cand, axis=2)
    best = np.take_along_axis(cand, pick[..., None], 2)[..., 0]
    best_m = np.concatenate([[1], m])[pick]
    best_phi = np.where(pick == 0, 0.0, np.take_along_axis(np.nan_to_num(hyb_phi), np.maximum(pick - 1, 0)[..., None],
                                                            2)[..., 0])
    return SweepResult(bws, n, m, l, ep, hyb, hyb_phi, best, best_m, best_phi)


def plot(result: SweepResult, path: str, title: str = "", sites_for_bandwidth_panel: Optional[int] = None,
         bandwidth_for_sites_panel: Optional[float] = None) -> str:
    """Two panels to a PNG: speedup vs inter-site bandwidth (one line per domain size, at one site
    count), and speedup vs number of sites (one line per domain size, at one bandwidth)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result
    n_idx = _nearest(r.num_sites, sites_for_bandwidth_panel or _first_common(r))
    b_idx = _nearest(r.inter_bandwidths_bytes_per_s, bandwidth_for_sites_panel or 10 * GBPS)
    gbps = r.inter_bandwidths_bytes_per_s / GBPS
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, m in enumerate(r.sites_per_domain):
        ax1.plot(gbps, r.speedup[:, n_idx, k], label=f"S = {m} sites ({m * r.site_size} ranks)")
    ax1.plot(gbps, r.best_speedup[:, n_idx], "k--", label="planner (best S, fraction)")
    ax1.set_xscale("log")
    ax1.axhline(1.0, color="grey", lw=0.5)
    ax1.set_xlabel("inter-site bandwidth per rank (Gbps)")
    ax1.set_ylabel("speedup over EP (fwd+bwd)")
    ax1.set_title(f"{r.num_sites[n_idx]} sites of {r.site_size} ranks")
    ax1.legend(fontsize=8)
    for k, m in enumerate(r.sites_per_domain):
        ok = ~np.isnan(r.speedup[b_idx, :, k])
        ax2.plot(r.num_sites[ok], r.speedup[b_idx, ok, k], label=f"S = {m} sites")
    ax2.plot(r.num_sites, r.best_speedup[b_idx], "k--", label="planner")
    ax2.set_xscale("log")
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_xlabel("number of sites")
    ax2.set_ylabel("speedup over EP (fwd+bwd)")
    ax2.set_title(f"inter-site {gbps[b_idx]:g} Gbps")
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nearest(values: np.ndarray, target: float) -> int:
    return int(np.argmin(np.abs(np.log(values.astype(np.float64)) - math.log(target))))


def _first_common(r: SweepResult) -> int:
    """Smallest site count every domain size divides (so every line of the bandwidth panel exists)."""
    lcm = int(np.lcm.reduce(r.sites_per_domain))
    ok = r.num_sites[r.num_sites % lcm == 0]
    return int(ok[0]) if len(ok) else int(r.num_sites[-1])
