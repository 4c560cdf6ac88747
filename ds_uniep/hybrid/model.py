"""Stream-based cost model of one MoE layer under plain EP and HybridEP.

Units: bytes, bytes/s, seconds, everywhere; names carry them (``*_bytes``,
``*_bytes_per_s``, ``*_s``). ``GBPS`` converts Gbit/s to bytes/s.

Letters (per rank unless said otherwise)
----------------------------------------
G    ranks in the EP group.
L    site size: ranks joined by the fast links (a node, or a data centre).
     Two ranks of one site talk at ``B_f`` (intra-site bytes/s, per rank and
     direction), ranks of different sites at ``B_s`` (inter-site).
S    HybridEP domain size: ranks that gather each other's experts. S divides
     G, and S and L nest (S divides L or L divides S). S = 1 is plain EP.
phi  migrated fraction: the share of each domain peer's experts gathered as
     replicas; ``1 - phi`` of the work on domain peers' experts is still
     served by sending tokens. phi is a fluid quantity; the runtime rounds it
     to whole experts.
D    dispatch payload of one rank (all k copies of its tokens, bytes).
E_r  experts owned by one rank.
P    wire bytes of one migrated expert (dense, or compressed: see
     :func:`compressed_expert_bytes`); P_g the bytes of one expert's gradient
     (always dense).
M    micro-batches per optimizer step: replicas are gathered once per step
     and their gradients returned once per step, or after every micro-batch
     (``returns_every_microbatch``). ds_uniep's runtime gathers at every
     forward and returns at every backward (M = 1), or with ``"reuse_replicas":
     true`` gathers once per step and, under a DeepSpeed engine, returns once per
     step (M = gradient accumulation steps; without an engine it returns at
     every backward: ``returns_every_microbatch``).
t_pre, t_exp  forward pre-expert and expert compute; backward takes
     ``c_b`` times as long (``backward_compute_factor``, default 2).

Routing is uniform: each rank sends D/G to every rank (itself included); see "Measured
routing" below for any other.

Bytes each rank sends per all-to-all (dispatch; combine is its mirror)
---------------------------------------------------------------------
A rank sends tokens for a domain peer's non-migrated experts to the owner,
and tokens for any expert of another domain to the same-offset rank of that
domain (which holds the domain's replicas; the byte count does not depend on
which rank of the other domain receives them)::

    p_f = min(S, L) - 1                       domain peers on fast links
    p_s = S - min(S, L)                       domain peers on slow links
    tok_f = D/G * ((1 - phi) * p_f + max(L - S, 0))
    tok_s = D/G * ((1 - phi) * p_s + G - max(S, L))
    a     = max(tok_f / B_f, tok_s / B_s)     the two link levels are separate
                                              streams and run concurrently

Case S <= L (domains inside a site): tok_s = D (G - L)/G whatever S and phi,
so HybridEP only saves fast-link bytes. Case S >= L: every migrated expert
of a slow-link peer takes D/G of slow-link token bytes off each all-to-all.

Replica traffic, once per step
------------------------------
::

    g_f = phi * E_r * P * p_f   (+ base bytes, see below)
    g_s = phi * E_r * P * p_s
    r_f = phi * E_r * P_g * p_f    gradients of replicas back to their owner
    r_s = phi * E_r * P_g * p_s

With compression, the domain's shared base expert is all-reduced once per
step (ring: ``2 (S - 1)/S * P_base`` bytes per rank, ``P_base`` one expert's
values in fp32, as the runtime sums them), charged to the slow level when
S > L, else to the fast level.

Streams and the layer time
--------------------------
Compute stream: pre-expert compute, expert compute, in that order, with the
all-to-alls between them. Gather stream: starts with the layer and shares
each link level with the dispatch that follows it (bytes on one level are
served in order). Forward, first micro-batch of a step, and the steady ones::

    fwd_1 = max over level x of (max(t_pre, g_x / B_x) + tok_x / B_x) + t_exp + a
    fwd_n = t_pre + a + t_exp + a

Backward runs the mirror: combine-gradient all-to-all, expert backward,
dispatch-gradient all-to-all, pre-expert backward. The replica gradients of
the last micro-batch are complete after its expert backward; they return to
the owner on the links behind the dispatch-gradient all-to-all, overlapped
with the pre-expert backward::

    bwd_n = a + c_b t_exp + a + c_b t_pre
    bwd_M = a + c_b t_exp + max(a + c_b t_pre, max over x of (tok_x + r_x) / B_x)

The runtime (:mod:`ds_uniep.hybrid.runtime`) follows these streams: it issues the gather, one
asynchronous all-gather of all local expert parameters, first in the layer's forward and waits
for it only before the experts, so the gather overlaps the layer's compute up to the experts
(router, dispatch layout; compute before the layer only as far as the layer's forward starts
while it is still queued); it issues the replica-gradient return, one asynchronous all-to-all,
as soon as the expert backward has produced the gradients, and the backward pass ends when it
has arrived. Over emulated slow links (``InterSitePacing``) the token all-to-alls go first and
the replica bytes take the link's idle time, which gives the same completion times as the
formulas.

Reported times are per micro-batch, averaged over the step::

    forward  = (fwd_1 + (M - 1) fwd_n) / M
    backward = (bwd_M + (M - 1) bwd_n) / M     (bwd_M alone when every micro-batch returns)

Cases that follow from the formulas (and are tested): phi = 0 or S = 1 gives
plain EP exactly; backward >= forward whenever c_b >= 1 and the return
bytes are at least the gather bytes on each level (dense migration with
P_g >= P; with compression the base all-reduce can make the gather the
larger, and then the first forward may be the longer pass); with infinite inter-site bandwidth
and L = 1 plain EP is pure compute and HybridEP can only tie; with both
bandwidths infinite every plan ties and the planner keeps plain EP.

Measured routing: :func:`predict_routed` takes the token copies every rank routes to every
expert (``load [G, E]``) instead of the uniform routing above. It routes them as the runtime
does (:func:`token_flows`: a copy for a migrated expert to the sender's offset in the expert's
domain, any other to the owner) and puts into the same formulas the busiest rank's bytes per
level, ``max(sent, received)``, for ``tok_x``, and ``t_exp`` scaled by the busiest rank's rows
over the mean. Partial migration then depends on *which* experts migrate (for instance the
hottest, :func:`hottest_choice`), not only on how many. With a uniform load it gives
:func:`predict`'s numbers. :func:`plan` takes the same ``load``.

What the model leaves out: per-message latency (HybridEP's fewer peers help
there; see :mod:`ds_uniep.hybrid.topology` for the pair counts), routing
imbalance (unless fed with a load), pipelining of expert compute with the all-to-alls,
and link contention between levels that share a NIC.
"""

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional, Sequence, Union

import numpy as np

GBPS = 1.25e8
"""Bytes/s in one Gbit/s (1e9 bits / 8)."""

DEFAULT_FRACTIONS = tuple(i / 10 for i in range(11))
"""Migrated fractions phi the planner tries: 0, 0.1, ..., 1."""

INDEX_BYTES = 4
"""Bytes per index of a compressed residual (int32)."""
BASE_BYTES_PER_VALUE = 4
"""Bytes per value of the shared base on the wire (its fp32 sum is what is all-reduced)."""


def _positive(owner: str, name: str, value, allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{name}: expected a number, got {value!r}")
    if not value > 0 or math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{owner}.{name}: must be a positive{'' if allow_inf else ' finite'} number, got {value!r}")


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """What one rank moves and computes for one MoE layer and one micro-batch."""

    token_bytes: float
    """D: dispatch payload of one rank, all k copies of its tokens (bytes)."""
    expert_bytes: float
    """Dense bytes of one expert's weights (bytes)."""
    experts_per_rank: float
    """E_r: experts owned by one rank (may be fractional: the model is fluid)."""
    pre_expert_compute_s: float
    """t_pre: forward compute of the layer before the router (seconds)."""
    expert_compute_s: float
    """t_exp: forward expert compute of one rank (seconds)."""
    backward_compute_factor: float = 2.0
    """c_b: backward compute time over forward compute time."""
    num_microbatches: int = 1
    """M: micro-batches per optimizer step (replicas gathered once per step)."""
    returns_every_microbatch: bool = False
    """Replica gradients return to their owners after every micro-batch's backward (ds_uniep's
    runtime) instead of once per step."""
    grad_bytes_per_expert: Optional[float] = None
    """P_g: bytes of one expert's gradient; None means ``expert_bytes``."""

    def __post_init__(self):
        for name in ("token_bytes", "expert_bytes", "experts_per_rank", "pre_expert_compute_s",
                     "expert_compute_s", "backward_compute_factor"):
            _positive("Workload", name, getattr(self, name))
        if self.backward_compute_factor < 1:
            raise ValueError(f"Workload.backward_compute_factor: must be >= 1, got {self.backward_compute_factor}")
        _positive_int("Workload", "num_microbatches", self.num_microbatches)
        if self.grad_bytes_per_expert is not None:
            _positive("Workload", "grad_bytes_per_expert", self.grad_bytes_per_expert)

    @property
    def grad_bytes(self) -> float:
        return self.expert_bytes if self.grad_bytes_per_expert is None else self.grad_bytes_per_expert


@dataclass(frozen=True)
class Cluster:
    """G ranks in sites of L ranks; fast links inside a site, slow links between sites."""

    num_ranks: int
    """G."""
    site_size: int
    """L: ranks joined by the intra-site links; 1 means every link is slow."""
    intra_site_bandwidth_bytes_per_s: float
    """B_f: bytes/s one rank sends to the rest of its site (inf allowed)."""
    inter_site_bandwidth_bytes_per_s: float
    """B_s: bytes/s one rank sends to other sites (inf allowed)."""

    def __post_init__(self):
        _positive_int("Cluster", "num_ranks", self.num_ranks)
        _positive_int("Cluster", "site_size", self.site_size)
        if self.num_ranks % self.site_size:
            raise ValueError(f"Cluster.site_size: {self.site_size} does not divide num_ranks {self.num_ranks}")
        _positive("Cluster", "intra_site_bandwidth_bytes_per_s", self.intra_site_bandwidth_bytes_per_s, True)
        _positive("Cluster", "inter_site_bandwidth_bytes_per_s", self.inter_site_bandwidth_bytes_per_s, True)

    def valid_domain_sizes(self) -> list:
        """Every S that divides G and nests with L, ascending."""
        g, l = self.num_ranks, self.site_size
        return [s for s in range(1, g + 1) if g % s == 0 and (l % s == 0 or s % l == 0)]

    def check_domain_size(self, domain_size: int) -> None:
        _positive_int("domain_size", "value", domain_size)
        if self.num_ranks % domain_size:
            raise ValueError(f"domain_size: {domain_size} does not divide num_ranks {self.num_ranks}")
        if self.site_size % domain_size and domain_size % self.site_size:
            raise ValueError(f"domain_size: {domain_size} and site_size {self.site_size} do not nest "
                             "(one must divide the other)")


def compressed_expert_bytes(expert_bytes: float, bytes_per_value: int, ratio: float,
                            index_bytes: int = INDEX_BYTES) -> float:
    """Wire bytes of one expert sent as a top-k residual: ``k * (value + index)`` bytes.

    ``k = round(ratio * n)`` (at least 1) of ``n = expert_bytes / bytes_per_value``
    values, the same count :func:`ds_uniep.hybrid.compress.num_kept` keeps."""
    _positive("compression", "ratio", ratio)
    if ratio > 1:
        raise ValueError(f"compression.ratio: must be <= 1, got {ratio}")
    n = int(expert_bytes // bytes_per_value)
    return float(kept_count(n, ratio) * (bytes_per_value + index_bytes))


def kept_count(numel: int, ratio: float) -> int:
    """Values kept of ``numel``: nearest whole number to ``ratio * numel``, at least 1.

    Exact rational arithmetic, so 0.1 * 10 keeps 1 and 0.3 * 10 keeps 3 on every machine."""
    return max(1, min(numel, math.floor(Fraction(ratio) * numel + Fraction(1, 2))))


@dataclass(frozen=True)
class LayerTime:
    """Predicted time of one layer, per micro-batch averaged over a step, with the bytes behind it."""

    forward_s: float
    backward_s: float
    token_bytes_intra: float
    """Bytes one rank sends on fast links per token all-to-all."""
    token_bytes_inter: float
    """Bytes one rank sends on slow links per token all-to-all."""
    gather_bytes_intra: float
    """Replica (and base) bytes one rank receives on fast links per step."""
    gather_bytes_inter: float
    grad_return_bytes_intra: float
    """Replica gradient bytes one rank sends back to owners on fast links per return (once per step,
    or per micro-batch with ``Workload.returns_every_microbatch``)."""
    grad_return_bytes_inter: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def layer_times(d, pe_wire, pe_grad, base_bytes, e_r, g, s, l, b_f, b_s, t_pre, t_exp, c_b, m, phi,
                returns_every_microbatch=False, tok=None):
    """The formulas of the module docstring on numpy-broadcastable arguments.

    ``tok``: ``(tok_f, tok_s)`` token bytes per all-to-all and level in place of the uniform
    routing's (:func:`predict_routed` passes the busiest rank's). Returns ``(forward_s, backward_s,
    tok_f, tok_s, g_f, g_s, r_f, r_s)``; no validation (callers validate once)."""
    d, g, s, l, phi, m = (np.asarray(x, dtype=np.float64) for x in (d, g, s, l, phi, m))
    per_dest = d / g
    p_f = np.minimum(s, l) - 1
    p_s = s - np.minimum(s, l)
    if tok is None:
        tok_f = per_dest * ((1 - phi) * p_f + np.maximum(l - s, 0))
        tok_s = per_dest * ((1 - phi) * p_s + g - np.maximum(s, l))
    else:
        tok_f, tok_s = (np.asarray(x, dtype=np.float64) for x in tok)
    migrated = phi * e_r
    base = np.where((phi > 0) & (s > 1), 2 * (s - 1) / s * base_bytes, 0.0)
    g_f = migrated * pe_wire * p_f + np.where(s > l, 0.0, base)
    g_s = migrated * pe_wire * p_s + np.where(s > l, base, 0.0)
    r_f = migrated * pe_grad * p_f
    r_s = migrated * pe_grad * p_s

    def secs(nbytes, bw):
        # 0 bytes over an infinite link is 0 s, not nan.
        return np.where(nbytes == 0, 0.0, nbytes / bw)

    a_f, a_s = secs(tok_f, b_f), secs(tok_s, b_s)
    a = np.maximum(a_f, a_s)
    fwd_first = np.maximum(np.maximum(t_pre, secs(g_f, b_f)) + a_f,
                           np.maximum(t_pre, secs(g_s, b_s)) + a_s) + t_exp + a
    fwd_steady = t_pre + a + t_exp + a
    bwd_steady = a + c_b * t_exp + a + c_b * t_pre
    bwd_last = a + c_b * t_exp + np.maximum(a + c_b * t_pre,
                                            np.maximum(secs(tok_f + r_f, b_f), secs(tok_s + r_s, b_s)))
    fwd = (fwd_first + (m - 1) * fwd_steady) / m
    bwd = bwd_last if returns_every_microbatch else (bwd_last + (m - 1) * bwd_steady) / m
    return fwd, bwd, tok_f, tok_s, g_f, g_s, r_f, r_s


def migration_bytes(workload: Workload, compression_ratio: Optional[float], bytes_per_value: int):
    """(wire bytes per migrated expert, shared base bytes all-reduced per step) for a compression choice.
    The base is one expert's values summed in fp32 (``BASE_BYTES_PER_VALUE`` each), as
    :class:`ds_uniep.hybrid.gather.CompressedGather` all-reduces it."""
    if compression_ratio is None:
        return workload.expert_bytes, 0.0
    base = workload.expert_bytes / bytes_per_value * BASE_BYTES_PER_VALUE
    return compressed_expert_bytes(workload.expert_bytes, bytes_per_value, compression_ratio), base


def predict(workload: Workload, cluster: Cluster, domain_size: int = 1, migrated_fraction: float = 1.0,
            compression_ratio: Optional[float] = None, bytes_per_value: int = 2) -> LayerTime:
    """Layer time for one (S, phi) choice. ``domain_size=1`` is plain EP whatever ``migrated_fraction``.

    ``compression_ratio`` None sends experts dense; a ratio sends a shared base
    once plus a top-k residual per expert (``bytes_per_value`` per weight)."""
    cluster.check_domain_size(domain_size)
    if not 0 <= migrated_fraction <= 1:
        raise ValueError(f"migrated_fraction: must be in [0, 1], got {migrated_fraction}")
    pe_wire, base = migration_bytes(workload, compression_ratio, bytes_per_value)
    out = layer_times(workload.token_bytes, pe_wire, workload.grad_bytes, base, workload.experts_per_rank,
                      cluster.num_ranks, domain_size, cluster.site_size, cluster.intra_site_bandwidth_bytes_per_s,
                      cluster.inter_site_bandwidth_bytes_per_s, workload.pre_expert_compute_s,
                      workload.expert_compute_s, workload.backward_compute_factor, workload.num_microbatches,
                      migrated_fraction, workload.returns_every_microbatch)
    return LayerTime(*(float(x) for x in out))


# --------------------------------------------------------------------------- measured routing
def migrated_count(fraction: float, local_experts: int) -> int:
    """m: experts per rank a migrated ``fraction`` moves, the nearest whole number to
    ``fraction * L`` (exact rational arithmetic, halves up; 0 means plain EP)."""
    if fraction <= 0:
        return 0
    return kept_count(local_experts, fraction)


def _load_array(load, num_ranks: int, num_experts: int) -> np.ndarray:
    arr = np.asarray(load, dtype=np.float64)
    if arr.shape != (num_ranks, num_experts):
        raise ValueError(f"load: expected [G={num_ranks}, E={num_experts}] token copies (each rank's tokens "
                         f"routed to each expert, all k slots), got shape {list(arr.shape)}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError("load: every count must be finite and >= 0")
    if not arr.sum() > 0:
        raise ValueError("load: no token is routed anywhere")
    return arr


def hottest_choice(load, num_ranks: int, domain_size: int, local_experts: int,
                   migrated: int) -> List[List[int]]:
    """For each rank (owner), the ``migrated`` of its ``local_experts`` experts whose migration
    keeps the most tokens from crossing to it: those the other ranks of its domain routed to
    them (``load [G, E]``), ties to the smaller index; ascending. What the runtime's
    ``"migrated_experts": "hottest"`` migrates given the same load."""
    G, S, L = num_ranks, domain_size, local_experts
    load = np.asarray(load)
    chosen = []
    for o in range(G):
        peers = [r for r in range((o // S) * S, (o // S + 1) * S) if r != o]
        saved = [sum(load[r][o * L + j] for r in peers) for j in range(L)]
        best = sorted(range(L), key=lambda j: (-saved[j], j))[:migrated]
        chosen.append(sorted(int(j) for j in best))
    return chosen


def token_flows(load, domain_size: int, local_experts: int, migrated=None) -> np.ndarray:
    """``[G, G]``: token copies rank i sends rank j (j = i included) in one dispatch, given the
    copies each rank routes to each expert (``load [G, E]``), as the runtime routes them: a copy
    for a migrated expert goes to the rank of that expert's domain with the sender's offset
    (which holds the replica; the sender itself inside its own domain), any other copy to the
    expert's owner. ``migrated``: per owner, its migrated local experts; None migrates every
    expert (at S > 1). At S = 1 nothing migrates."""
    load = np.asarray(load, dtype=np.float64)
    G, E = load.shape
    S, L = domain_size, local_experts
    owner = np.arange(E) // L
    moved = np.zeros((G, L), dtype=bool)
    if S > 1:
        if migrated is None:
            moved[:] = True
        else:
            for o, c in enumerate(migrated):
                moved[o, list(c)] = True
    sender = np.arange(G)[:, None]
    dest = np.where(moved.reshape(1, -1), (owner // S * S)[None, :] + sender % S, owner[None, :])  # [G, E]
    flows = np.zeros(G * G)
    np.add.at(flows, (sender * G + dest).ravel(), load.ravel())
    return flows.reshape(G, G)


def _check_migrated(migrated, G: int, L: int) -> int:
    if len(migrated) != G:
        raise ValueError(f"migrated: expected one list of local experts per rank ({G}), got {len(migrated)}")
    m = len(migrated[0])
    for o, c in enumerate(migrated):
        if len(c) != m or len(set(c)) != m or not all(isinstance(j, (int, np.integer)) and 0 <= j < L for j in c):
            raise ValueError(f"migrated[{o}]: expected {m} distinct local experts in 0..{L - 1} "
                             f"(the same count on every rank), got {list(c)}")
    return m


def predict_routed(workload: Workload, cluster: Cluster, load, domain_size: int = 1, migrated=None,
                   compression_ratio: Optional[float] = None, bytes_per_value: int = 2) -> LayerTime:
    """:func:`predict` for a measured routing instead of the uniform one.

    ``load [G, E]``: token copies each rank routes to each expert (all k slots; E = G * E_r, so
    E_r must be whole). The routing decides where every copy goes (:func:`token_flows`), so:

    - token bytes per all-to-all and level are the busiest rank's ``max(sent, received)`` on
      that level (a collective lasts until its slowest rank is done; the combine is the
      dispatch's mirror), at ``D / (copies per rank, mean)`` bytes per copy;
    - expert compute is ``t_exp`` times the busiest rank's rows over the mean rows (every rank
      waits for it in the combine);
    - ``migrated``: per owner, its migrated local experts (for instance :func:`hottest_choice`'s);
      None with S > 1 migrates every expert. Replica bytes follow m = the count per owner.

    With a uniform load it gives :func:`predict`'s numbers (``phi = m / E_r``)."""
    cluster.check_domain_size(domain_size)
    G, S = cluster.num_ranks, domain_size
    L = workload.experts_per_rank
    if L != int(L):
        raise ValueError(f"predict_routed: experts_per_rank must be whole, got {L}")
    L = int(L)
    arr = _load_array(load, G, G * L)
    if S == 1:
        phi, migrated = 0.0, None
    elif migrated is None:
        phi = 1.0
    else:
        phi = _check_migrated(migrated, G, L) / L
    flows = token_flows(arr, S, L, migrated)
    mean = arr.sum() / G
    site = np.arange(G) // cluster.site_size
    far = site[:, None] != site[None, :]
    near = ~far & ~np.eye(G, dtype=bool)
    per_copy = workload.token_bytes / mean
    tok = [max((flows * lvl).sum(1).max(), (flows * lvl).sum(0).max()) * per_copy for lvl in (near, far)]
    t_exp = workload.expert_compute_s * flows.sum(0).max() / mean
    pe_wire, base = migration_bytes(workload, compression_ratio, bytes_per_value)
    out = layer_times(workload.token_bytes, pe_wire, workload.grad_bytes, base, L, G, S, cluster.site_size,
                      cluster.intra_site_bandwidth_bytes_per_s, cluster.inter_site_bandwidth_bytes_per_s,
                      workload.pre_expert_compute_s, t_exp, workload.backward_compute_factor,
                      workload.num_microbatches, phi, workload.returns_every_microbatch, tok=tok)
    return LayerTime(*(float(x) for x in out))


@dataclass(frozen=True)
class Plan:
    """The planner's choice and the plain-EP baseline it beats (or keeps)."""

    domain_size: int
    migrated_fraction: float
    """phi: share of domain peers' experts migrated."""
    ep: LayerTime
    hybrid: LayerTime
    compression_ratio: Optional[float] = None
    migrated: Optional[List[List[int]]] = None
    """With a measured routing (``plan(load=...)``) and 0 < phi < 1: the migrated local experts per
    owner the prediction assumed (the hottest, :func:`hottest_choice`, or with
    ``migrated_experts="first"`` each owner's first m); else None."""

    @property
    def token_fraction(self) -> float:
        """1 - phi: share of domain peers' expert work still served by token all-to-all."""
        return 1.0 - self.migrated_fraction

    @property
    def speedup(self) -> float:
        """EP forward+backward time over HybridEP's (>= 1: the planner can always keep plain EP)."""
        return self.ep.total_s / self.hybrid.total_s


def plan(workload: Workload, cluster: Cluster, domain_size: Union[int, str] = "auto",
         compression_ratio: Optional[float] = None, fractions: Sequence[float] = DEFAULT_FRACTIONS,
         bytes_per_value: int = 2, load=None, migrated_experts: str = "hottest") -> Plan:
    """Choose (S, phi) minimising forward + backward time.

    ``domain_size="auto"`` tries every S of :meth:`Cluster.valid_domain_sizes`;
    an int fixes S and only phi is chosen. Ties keep the smaller S, then the
    smaller phi (less migration for the same predicted time).

    ``load [G, E]`` (token copies each rank routes to each expert): plan for that routing with
    :func:`predict_routed` instead of the uniform routing. Each fraction is rounded to whole
    experts (:func:`migrated_count`), and a partial migration moves the hottest experts
    (:func:`hottest_choice`, as ``"migrated_experts": "hottest"`` does; ``migrated_experts="first"``:
    each rank's first m, as ``"first"`` does)."""
    if migrated_experts not in ("first", "hottest"):
        raise ValueError(f'migrated_experts: must be "first" or "hottest", got {migrated_experts!r}')
    if domain_size == "auto":
        sizes = cluster.valid_domain_sizes()
    else:
        cluster.check_domain_size(domain_size)
        sizes = [domain_size]
    phis = np.asarray(sorted(set(float(f) for f in fractions) | {0.0}), dtype=np.float64)
    if phis.min() < 0 or phis.max() > 1:
        raise ValueError(f"fractions: every fraction must be in [0, 1], got {list(fractions)}")
    if load is not None:
        return _plan_routed(workload, cluster, sizes, phis, load, compression_ratio, bytes_per_value,
                            migrated_experts)
    pe_wire, base = migration_bytes(workload, compression_ratio, bytes_per_value)
    s_grid = np.asarray(sizes, dtype=np.float64)[:, None]
    fwd, bwd, *_ = layer_times(workload.token_bytes, pe_wire, workload.grad_bytes, base, workload.experts_per_rank,
                               cluster.num_ranks, s_grid, cluster.site_size,
                               cluster.intra_site_bandwidth_bytes_per_s, cluster.inter_site_bandwidth_bytes_per_s,
                               workload.pre_expert_compute_s, workload.expert_compute_s,
                               workload.backward_compute_factor, workload.num_microbatches, phis[None, :],
                               workload.returns_every_microbatch)
    total = fwd + bwd
    best = int(np.argmin(total))  # first minimum in (S ascending, phi ascending) order
    s_best, phi_best = sizes[best // len(phis)], float(phis[best % len(phis)])
    if s_best == 1:
        phi_best = 0.0
    return Plan(domain_size=s_best, migrated_fraction=phi_best,
                ep=predict(workload, cluster, 1, 0.0),
                hybrid=predict(workload, cluster, s_best, phi_best, compression_ratio, bytes_per_value),
                compression_ratio=compression_ratio)


def _plan_routed(workload: Workload, cluster: Cluster, sizes, phis, load, compression_ratio,
                 bytes_per_value, choice: str) -> Plan:
    """:func:`plan` for a measured routing: every (S, m) with the hottest (or first) m migrated."""
    G, L = cluster.num_ranks, workload.experts_per_rank
    if L != int(L):
        raise ValueError(f"plan: experts_per_rank must be whole to plan for a load, got {L}")
    L = int(L)
    arr = _load_array(load, G, G * L)
    ep = predict_routed(workload, cluster, arr, 1)
    counts = sorted({migrated_count(float(f), L) for f in phis})
    best = (ep.total_s, 1, 0, None, ep)
    for S in sizes:
        for m in counts:
            if S == 1 or m == 0:
                continue
            chosen = None if m == L else hottest_choice(arr, G, S, L, m) if choice == "hottest" \
                else [list(range(m))] * G
            lt = predict_routed(workload, cluster, arr, S, chosen, compression_ratio, bytes_per_value)
            if lt.total_s < best[0]:
                best = (lt.total_s, S, m, chosen, lt)
    _, S, m, chosen, lt = best
    return Plan(domain_size=S, migrated_fraction=m / L, ep=ep, hybrid=lt,
                compression_ratio=compression_ratio if S > 1 else None, migrated=chosen)
