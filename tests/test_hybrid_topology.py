"""Domain partition pair counts, link levels and rank renumbering.

Counts, derived here rather than read from the code: with G ranks in domains
of S, every rank receives the experts of the S - 1 other ranks of its domain,
so the gather has G * (S - 1) ordered pairs; every rank sends tokens to one
rank (its offset) in each of the G/S - 1 other domains, so the token phase
has G * (G/S - 1) ordered pairs. Plain EP (S = 1) is G * (G - 1) token pairs.
"""
import itertools

import pytest

from ds_uniep.hybrid.topology import (RankCoord, Topology, gather_pairs, num_gather_pairs, num_token_pairs,
                                      token_pairs)

CASES = [(g, s) for g in (8, 16, 32) for s in (1, 2, 4, 8, 16, 32) if g % s == 0]


@pytest.mark.parametrize("g, s", CASES)
def test_pair_counts(g, s):
    gp, tp = gather_pairs(g, s), token_pairs(g, s)
    expected_gather = g * (s - 1)
    expected_token = g * (g // s - 1)
    assert len(gp) == len(set(gp)) == num_gather_pairs(g, s) == expected_gather
    assert len(tp) == len(set(tp)) == num_token_pairs(g, s) == expected_token
    for a, b in gp:
        assert a != b and a // s == b // s
    for a, b in tp:
        assert a // s != b // s and a % s == b % s
    assert not set(gp) & set(tp)


def test_hand_listed_pairs():
    # G = 4, S = 2: domains {0, 1} and {2, 3}; offsets {0, 2} and {1, 3}.
    assert gather_pairs(4, 2) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert token_pairs(4, 2) == [(0, 2), (1, 3), (2, 0), (3, 1)]


@pytest.mark.parametrize("g", [8, 16, 32])
def test_domain_size_one_is_full_all_to_all(g):
    assert gather_pairs(g, 1) == []
    assert set(token_pairs(g, 1)) == {(a, b) for a, b in itertools.product(range(g), repeat=2) if a != b}


@pytest.mark.parametrize("g", [8, 16, 32])
def test_one_domain_moves_no_tokens(g):
    assert token_pairs(g, g) == []
    assert set(gather_pairs(g, g)) == {(a, b) for a, b in itertools.product(range(g), repeat=2) if a != b}


def test_pair_validation():
    with pytest.raises(ValueError, match="domain_size: 3 does not divide world_size 8"):
        gather_pairs(8, 3)
    with pytest.raises(ValueError, match="world_size"):
        token_pairs(0, 1)


@pytest.mark.parametrize("domains, nodes, gpus", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (1, 4, 8), (32, 1, 1)])
def test_pairs_by_link_level(domains, nodes, gpus):
    # Per rank: gather peers are gpus - 1 on its node and (nodes - 1) * gpus on other nodes of the domain;
    # token peers are domains - 1, all on other domains.
    topo = Topology(domains, nodes, gpus)
    g = topo.world_size
    assert topo.count_by_level(topo.gather_pairs()) == {"node": g * (gpus - 1), "domain": g * (nodes - 1) * gpus,
                                                        "inter": 0}
    assert topo.count_by_level(topo.token_pairs()) == {"node": 0, "domain": 0, "inter": g * (domains - 1)}


def test_renumbering_from_interleaved_placement():
    # 16 global ranks dealt round-robin to 4 hosts; hosts h0, h1 in domain "A", h2, h3 in "B".
    hosts = [f"h{r % 4}" for r in range(16)]
    doms = ["A" if r % 4 < 2 else "B" for r in range(16)]
    topo = Topology.from_placement(doms, hosts)
    assert (topo.num_domains, topo.nodes_per_domain, topo.gpus_per_node) == (2, 2, 4)
    # Domain A = hosts h0 (ranks 0, 4, 8, 12) then h1 (1, 5, 9, 13): contiguous after renumbering.
    assert topo.domain_groups() == [[0, 4, 8, 12, 1, 5, 9, 13], [2, 6, 10, 14, 3, 7, 11, 15]]
    assert topo.offset_groups()[5] == [5, 7]
    assert topo.coord(9) == RankCoord(domain=0, node=1, gpu=2)
    assert topo.coord(3) == RankCoord(domain=1, node=1, gpu=0)
    for r in range(16):
        assert topo.rank_of(topo.coord(r)) == r
        assert topo.global_rank(topo.contiguous_rank(r)) == r
    # Each domain's ranks are a contiguous block of contiguous ranks.
    for d, group in enumerate(topo.domain_groups()):
        assert sorted(topo.contiguous_rank(r) for r in group) == list(range(8 * d, 8 * d + 8))
    assert topo.level(0, 4) == "node" and topo.level(0, 1) == "domain" and topo.level(0, 2) == "inter"
    # The pairs are the contiguous ones mapped through the renumbering.
    assert len(topo.token_pairs()) == 16 * 1 and all(topo.level(a, b) == "inter" for a, b in topo.token_pairs())


def test_placement_errors():
    with pytest.raises(ValueError, match="node 'h0' is in domains"):
        Topology.from_placement(["A", "B"], ["h0", "h0"])
    with pytest.raises(ValueError, match="different GPU counts"):
        Topology.from_placement(["A", "A", "A"], ["h0", "h0", "h1"])
    with pytest.raises(ValueError, match="different node counts"):
        Topology.from_placement(["A", "A", "B"], ["h0", "h1", "h2"])
    with pytest.raises(ValueError, match="permutation"):
        Topology(1, 1, 2, global_ranks=[0, 0])
    with pytest.raises(ValueError, match="Topology.gpus_per_node"):
        Topology(1, 1, 0)
    with pytest.raises(ValueError, match="outside"):
        Topology(2, 1, 2).rank_of(RankCoord(2, 0, 0))
