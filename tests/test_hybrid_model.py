"""Cost model: numbers worked by hand, the cases the docstring promises, validation."""
import itertools
import math

import pytest

from ds_uniep.hybrid.model import (GBPS, Cluster, Workload, compressed_expert_bytes, hottest_choice, kept_count, plan,
                                   predict, predict_routed, token_flows)
from ds_uniep.hybrid.presets import PRESETS, parse_bandwidth

INF = math.inf


def test_gbps_pinned():
    assert GBPS == 1.25e8
    assert parse_bandwidth("1Gbps") == 1.25e8
    assert parse_bandwidth("10Gbps") == 1.25e9
    assert parse_bandwidth("400GB/s") == 4e11
    assert parse_bandwidth("1e9 bytes/s") == 1e9
    assert parse_bandwidth("2GiB/s") == 2 * 2**30
    assert parse_bandwidth("800Mbps") == 1e8
    assert parse_bandwidth("inf") == INF


@pytest.mark.parametrize("bad", ["10Gbs", "10 gbps", "10", "fast", "-1GB/s", "10GB/h"])
def test_bandwidth_rejects_unknown_units(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(bad)


def _wl(**kw):
    base = dict(token_bytes=400.0, expert_bytes=100.0, experts_per_rank=1.0, pre_expert_compute_s=1.0,
                expert_compute_s=2.0, backward_compute_factor=2.0, num_microbatches=1)
    base.update(kw)
    return Workload(**base)


# G = 4 ranks, sites of L = 2, B_f = 100 B/s, B_s = 10 B/s; D/G = 100 B per destination.
HAND = Cluster(num_ranks=4, site_size=2, intra_site_bandwidth_bytes_per_s=100.0, inter_site_bandwidth_bytes_per_s=10.0)


def test_plain_ep_by_hand():
    # EP: 1 site peer (100 B fast), 2 other-site ranks (200 B slow): a = max(1, 20) = 20 s.
    # fwd = t_pre + a + t_exp + a = 1 + 20 + 2 + 20 = 43; bwd = a + 2*2 + a + 2*1 = 46.
    t = predict(_wl(), HAND, domain_size=1)
    assert (t.token_bytes_intra, t.token_bytes_inter) == (100.0, 200.0)
    assert (t.forward_s, t.backward_s) == (43.0, 46.0)
    assert t.gather_bytes_inter == t.grad_return_bytes_inter == 0


def test_full_hybrid_by_hand():
    # S = 4 = G, phi = 1: no tokens move. Gather 1 fast peer * 100 B (1 s), 2 slow peers * 100 B (20 s).
    # fwd = max(max(1, 1) + 0, max(1, 20) + 0) + 2 + 0 = 22.
    # bwd = 0 + 4 + max(0 + 2, 100/100, 200/10) = 24: the gradient return is the 20 s.
    t = predict(_wl(), HAND, domain_size=4, migrated_fraction=1.0)
    assert (t.token_bytes_intra, t.token_bytes_inter) == (0.0, 0.0)
    assert (t.gather_bytes_intra, t.gather_bytes_inter) == (100.0, 200.0)
    assert (t.grad_return_bytes_intra, t.grad_return_bytes_inter) == (100.0, 200.0)
    assert (t.forward_s, t.backward_s) == (22.0, 24.0)


def test_half_migrated_two_microbatches_by_hand():
    # phi = 0.5: tokens 50 B fast (0.5 s), 100 B slow (10 s), a = 10; gather 50 B fast, 100 B slow (10 s).
    # fwd_1 = max(max(1, .5) + .5, max(1, 10) + 10) + 2 + 10 = 32; fwd_n = 1 + 10 + 2 + 10 = 23 -> 27.5.
    # bwd_n = 10 + 4 + 10 + 2 = 26; bwd_M = 10 + 4 + max(12, (50+50)/100, (100+100)/10) = 34 -> 30.
    t = predict(_wl(num_microbatches=2), HAND, domain_size=4, migrated_fraction=0.5)
    assert t.forward_s == pytest.approx(27.5, rel=1e-12)
    assert t.backward_s == pytest.approx(30.0, rel=1e-12)


def test_returns_every_microbatch_by_hand():
    # The case above with the replica gradients returned after both micro-batches: bwd = bwd_M = 34.
    t = predict(_wl(num_microbatches=2, returns_every_microbatch=True), HAND, domain_size=4, migrated_fraction=0.5)
    assert t.forward_s == pytest.approx(27.5, rel=1e-12)
    assert t.backward_s == pytest.approx(34.0, rel=1e-12)
    # One micro-batch: returning every micro-batch is returning once per step.
    for phi in (0.0, 0.5, 1.0):
        a = predict(_wl(returns_every_microbatch=True), HAND, domain_size=4, migrated_fraction=phi)
        b = predict(_wl(), HAND, domain_size=4, migrated_fraction=phi)
        assert (a.forward_s, a.backward_s) == (b.forward_s, b.backward_s)


def test_compressed_gather_by_hand():
    # 100 B of 2-byte values: n = 50, ratio 0.1 keeps 5 values of 2 + 4 bytes = 30 B per expert.
    assert compressed_expert_bytes(100.0, 2, 0.1) == 30.0
    # Base all-reduce over S = 4 of the 50 values in fp32 (200 B): 2 * 3/4 * 200 = 300 B, on the
    # slow level since S > L.
    t = predict(_wl(), HAND, domain_size=4, migrated_fraction=1.0, compression_ratio=0.1)
    assert t.gather_bytes_intra == 30.0
    assert t.gather_bytes_inter == 2 * 30.0 + 300.0
    assert t.grad_return_bytes_inter == 200.0  # gradients stay dense


def test_kept_count_rounds_exactly():
    assert kept_count(10, 0.1) == 1
    assert kept_count(10, 0.3) == 3
    assert kept_count(10, 1.0) == 10
    assert kept_count(1000, 1e-9) == 1
    assert kept_count(3, 0.5) == 2  # 1.5 rounds up


CLUSTERS = [Cluster(g, l, bf, bs) for g, l in ((8, 1), (16, 4), (32, 8)) for bf, bs in ((4e11, 1.25e9), (1e11, 1e8))]
WORKLOADS = [_wl(token_bytes=d, expert_bytes=p, experts_per_rank=e, num_microbatches=m, pre_expert_compute_s=1e-3,
                 expert_compute_s=3e-3) for d, p, e, m in itertools.product((1e7, 3e8), (1e6, 5e7), (0.5, 4), (1, 8))]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=str)
def test_s1_and_phi0_are_plain_ep(cluster):
    for wl in WORKLOADS:
        ep = predict(wl, cluster, 1, 0.0)
        assert predict(wl, cluster, 1, 1.0) == ep
        for s in cluster.valid_domain_sizes():
            t = predict(wl, cluster, s, 0.0)
            assert (t.forward_s, t.backward_s) == pytest.approx((ep.forward_s, ep.backward_s), rel=1e-12)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=str)
def test_backward_at_least_forward(cluster):
    # Dense migration: the return is the gather's bytes on each level, behind the same all-to-all.
    for wl in WORKLOADS:
        for s in cluster.valid_domain_sizes():
            for phi in (0.0, 0.3, 1.0):
                t = predict(wl, cluster, s, phi)
                assert t.backward_s >= t.forward_s


def test_compressed_gather_can_outweigh_the_return():
    # The documented exception: slow gather = base all-reduce 300 B (fp32) + 2 * 30 B = 360 B (36 s)
    # with no tokens moving, so fwd = max(1, 36) + 2 = 38 s; gradients of 10 B return 20 B slow
    # (2 s), so bwd = 4 + max(2, 2) = 6 s.
    t = predict(_wl(grad_bytes_per_expert=10.0), HAND, 4, 1.0, compression_ratio=0.1)
    assert t.forward_s == 2 + 360 / 10
    assert t.backward_s == 4 + max(2, 20 / 10)
    assert t.forward_s > t.backward_s


def test_backward_counts_the_gradient_return():
    # Same gather, heavier gradients: only the backward grows, by the extra slow bytes over B_s.
    light = predict(_wl(grad_bytes_per_expert=100.0), HAND, 4, 1.0)
    heavy = predict(_wl(grad_bytes_per_expert=1000.0), HAND, 4, 1.0)
    assert heavy.forward_s == light.forward_s
    assert heavy.backward_s == 4 + 2 * 1000 / 10  # 0 + c_b*t_exp + slow return of 2 peers * 1000 B
    assert heavy.backward_s > light.backward_s


def test_infinite_inter_bandwidth_never_beats_ep():
    # L = 1: every link is inter-site, so with B_s = inf plain EP is pure compute.
    for g in (8, 16, 32):
        cl = Cluster(g, 1, 4e11, INF)
        for wl in WORKLOADS:
            ep = predict(wl, cl, 1)
            assert ep.total_s == pytest.approx(3 * (wl.pre_expert_compute_s + wl.expert_compute_s))
            for s in cl.valid_domain_sizes():
                for phi in (0.1, 0.5, 1.0):
                    assert predict(wl, cl, s, phi).total_s >= ep.total_s
            p = plan(wl, cl)
            assert (p.domain_size, p.migrated_fraction, p.speedup) == (1, 0.0, 1.0)


def test_everything_infinite_keeps_ep():
    cl = Cluster(16, 4, INF, INF)
    p = plan(WORKLOADS[-1], cl)
    assert (p.domain_size, p.migrated_fraction) == (1, 0.0)


def test_tiny_inter_bandwidth_big_domains_win():
    # Token bytes dwarf expert bytes: at 1 Mbps the planner migrates everything across the whole group.
    wl = _wl(token_bytes=1e9, expert_bytes=1e7, experts_per_rank=1, pre_expert_compute_s=1e-3,
             expert_compute_s=1e-3)
    cl = Cluster(32, 4, 4e11, parse_bandwidth("1Mbps"))
    p = plan(wl, cl)
    assert p.domain_size == 32 and p.migrated_fraction == 1.0
    # EP moves 4 * D * 28/32 slow bytes per step; HybridEP 2 * 28 * 1e7. Ratio ~ 4*0.875e9 / 5.6e8 = 6.25.
    assert p.speedup == pytest.approx(4 * 1e9 * 28 / 32 / (2 * 28 * 1e7), rel=1e-3)


def test_gains_grow_as_bandwidth_falls():
    shape = PRESETS["dsv2lite-like"]
    wl = shape.workload(32, num_microbatches=8)
    speedups = [plan(wl, Cluster(32, 8, 4e11, gbps * GBPS)).speedup for gbps in (1000, 100, 10, 1, 0.1)]
    assert all(b >= a - 1e-12 for a, b in zip(speedups, speedups[1:])), speedups
    assert speedups[-1] > 1.5 and speedups[0] < speedups[-1]


def test_plan_fixed_domain_and_token_fraction():
    wl = PRESETS["dsv2lite-like"].workload(16, num_microbatches=8)
    cl = Cluster(16, 8, 4e11, 10 * GBPS)
    p = plan(wl, cl, domain_size=16)
    assert p.domain_size == 16 and p.token_fraction == 1 - p.migrated_fraction
    assert p.speedup >= 1
    assert p.hybrid == predict(wl, cl, 16, p.migrated_fraction)


@pytest.mark.parametrize("kw, field", [
    (dict(token_bytes=-1.0), "Workload.token_bytes"),
    (dict(expert_bytes=0.0), "Workload.expert_bytes"),
    (dict(pre_expert_compute_s=float("nan")), "Workload.pre_expert_compute_s"),
    (dict(expert_compute_s=INF), "Workload.expert_compute_s"),
    (dict(num_microbatches=0), "Workload.num_microbatches"),
    (dict(backward_compute_factor=0.5), "Workload.backward_compute_factor"),
])
def test_workload_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _wl(**kw)


def test_cluster_and_domain_validation():
    with pytest.raises(ValueError, match="Cluster.site_size"):
        Cluster(12, 8, 1.0, 1.0)
    with pytest.raises(ValueError, match="Cluster.num_ranks"):
        Cluster(0, 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="Cluster.inter_site_bandwidth_bytes_per_s"):
        Cluster(8, 1, 1.0, 0.0)
    with pytest.raises(ValueError, match="domain_size: 3 does not divide"):
        predict(_wl(), Cluster(8, 2, 1.0, 1.0), 3)
    with pytest.raises(ValueError, match="do not nest"):
        predict(_wl(), Cluster(24, 4, 1.0, 1.0), 6)
    with pytest.raises(ValueError, match="migrated_fraction"):
        predict(_wl(), HAND, 2, 1.5)
    with pytest.raises(ValueError, match="compression.ratio"):
        compressed_expert_bytes(100.0, 2, 1.5)
    assert Cluster(24, 4, 1.0, 1.0).valid_domain_sizes() == [1, 2, 4, 8, 12, 24]


# ---------------------------------------------------------------- measured routing (predict_routed)
def _times(t):
    return (t.forward_s, t.backward_s, t.token_bytes_intra, t.token_bytes_inter, t.gather_bytes_intra,
            t.gather_bytes_inter, t.grad_return_bytes_intra, t.grad_return_bytes_inter)


@pytest.mark.parametrize("site", [1, 2, 4])
def test_routed_uniform_load_is_the_uniform_model(site):
    """Every rank sending each expert the same copies gives predict's numbers, for every S and every
    partial migration of the first m experts."""
    wl = _wl(experts_per_rank=4.0, num_microbatches=3)
    cl = Cluster(4, site, 100.0, 10.0)
    load = [[7.0] * 16] * 4
    for S in cl.valid_domain_sizes():
        for m in ([0] if S == 1 else [1, 2, 3, 4]):
            chosen = None if m in (0, 4) else [list(range(m))] * 4
            for ratio in (None, 0.25):
                want = predict(wl, cl, S, m / 4, compression_ratio=ratio)
                got = predict_routed(wl, cl, load, S, chosen, compression_ratio=ratio)
                assert _times(got) == pytest.approx(_times(want), rel=1e-12, abs=1e-12), (S, m, ratio)


def test_routed_plain_ep_all_to_one_expert_by_hand():
    # HAND (sites of 2, B_f 100, B_s 10), D = 400 B = 4 copies of 100 B; every copy to expert 0 (rank 0).
    # Rank 1 sends 400 B fast, ranks 2 and 3 400 B slow each; rank 0 receives 400 B fast and 800 B slow:
    # a = max(400/100, 800/10) = 80. Rank 0 serves 16 copies, 4 times the mean: t_exp = 8.
    # fwd = 1 + 80 + 8 + 80 = 169; bwd = 80 + 2*8 + 80 + 2*1 = 178.
    load = [[4, 0, 0, 0]] * 4
    flows = token_flows(load, 1, 1)
    assert flows.tolist() == [[4, 0, 0, 0]] * 4
    t = predict_routed(_wl(), HAND, load, 1)
    assert (t.token_bytes_intra, t.token_bytes_inter) == (400.0, 800.0)
    assert (t.forward_s, t.backward_s) == (169.0, 178.0)
    # One domain of 4, every expert migrated: no token moves and each rank serves its own 4 copies,
    # whatever the routing: the uniform numbers (test_full_hybrid_by_hand).
    t = predict_routed(_wl(), HAND, load, 4)
    assert (t.forward_s, t.backward_s) == (22.0, 24.0)


def test_routed_hottest_partial_migration_by_hand():
    # 2 ranks on slow links (B_s 10), 2 experts each, D = 400 B = 4 copies of 100 B. Both ranks route
    # 3 copies to expert 1 (rank 0's local 1) and 1 to expert 2 (rank 1's local 0).
    cl = Cluster(2, 1, 100.0, 10.0)
    wl = _wl(experts_per_rank=2.0)
    load = [[0, 3, 1, 0], [0, 3, 1, 0]]
    hot = hottest_choice(load, 2, 2, 2, 1)
    assert hot == [[1], [0]]
    # Hottest: every copy stays on its rank; gather 1 expert of 100 B (10 s).
    # fwd = max(1, 10) + 2 = 12; bwd = 4 + max(2, 100/10) = 14.
    assert token_flows(load, 2, 2, hot).tolist() == [[4, 0], [0, 4]]
    t = predict_routed(wl, cl, load, 2, hot)
    assert (t.token_bytes_inter, t.forward_s, t.backward_s) == (0.0, 12.0, 14.0)
    # First experts: rank 1's 3 copies for expert 1 cross (300 B: a = 30); rank 0 serves 7 copies
    # (t_exp = 2 * 7/4 = 3.5). fwd = max(1, 10) + 30 + 3.5 + 30 = 73.5; bwd = 30 + 7 + max(32, 400/10) = 77.
    first = [[0], [0]]
    assert token_flows(load, 2, 2, first).tolist() == [[4, 0], [3, 1]]
    t = predict_routed(wl, cl, load, 2, first)
    assert (t.token_bytes_inter, t.forward_s, t.backward_s) == (300.0, 73.5, 77.0)
    # Plain EP: rank 1 sends 300 B, rank 0 sends 100 B (a = 30); rank 0 serves 6 copies (t_exp 3).
    # fwd = 1 + 30 + 3 + 30 = 64; bwd = 30 + 6 + 30 + 2 = 68.
    ep = predict_routed(wl, cl, load, 1)
    assert (ep.forward_s, ep.backward_s) == (64.0, 68.0)
    # The planner fed with this routing migrates the hottest half (26 s) over whole domains (46 s)
    # and plain EP (132 s); the uniform model sees no skew and chooses otherwise.
    p = plan(wl, cl, fractions=(0.5, 1.0), load=load)
    assert (p.domain_size, p.migrated_fraction, p.migrated) == (2, 0.5, [[1], [0]])
    assert p.hybrid.total_s == 26.0 and p.ep.total_s == 132.0 and p.speedup == pytest.approx(132 / 26)
    assert plan(wl, cl, fractions=(0.5, 1.0)).migrated_fraction == 1.0


def test_routed_plan_with_uniform_load_matches_the_uniform_plan():
    wl = PRESETS["dsv2lite-like"].workload(16, num_microbatches=4)
    for cl in (Cluster(16, 8, 4e11, 10 * GBPS), Cluster(16, 4, 4e11, 100 * GBPS), Cluster(16, 1, 4e11, 4e11)):
        L = int(wl.experts_per_rank)
        a = plan(wl, cl, fractions=(0.0, 1.0))
        b = plan(wl, cl, fractions=(0.0, 1.0), load=[[1.0] * (16 * L)] * 16)
        assert (a.domain_size, a.migrated_fraction) == (b.domain_size, b.migrated_fraction), cl
        assert a.hybrid.total_s == pytest.approx(b.hybrid.total_s, rel=1e-12) and b.migrated is None


def test_routed_validation():
    wl = _wl(experts_per_rank=2.0)
    with pytest.raises(ValueError, match=r"load: expected \[G=4, E=8\]"):
        predict_routed(wl, HAND, [[1.0] * 4] * 4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        predict_routed(wl, HAND, [[-1.0] + [1.0] * 7] * 4)
    with pytest.raises(ValueError, match="no token"):
        predict_routed(wl, HAND, [[0.0] * 8] * 4)
    with pytest.raises(ValueError, match=r"migrated\[1\]"):
        predict_routed(wl, HAND, [[1.0] * 8] * 4, 2, [[0], [0, 1], [0], [0]])
    with pytest.raises(ValueError, match="one list of local experts per rank"):
        predict_routed(wl, HAND, [[1.0] * 8] * 4, 2, [[0]])
    with pytest.raises(ValueError, match="experts_per_rank must be whole"):
        predict_routed(_wl(experts_per_rank=1.5), HAND, [[1.0] * 6] * 4)
