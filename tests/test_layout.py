"""The layout on simulated ranks: no process group needed, every rank's view is computed here."""
import pytest
import torch

from ds_uniep.layout import build_layout, expert_counts


def _routing(T, k, E, gen, drop=0.0, all_to=None):
    if all_to is not None:
        idx = torch.full((T, k), -1, dtype=torch.int32)
        idx[:, 0] = all_to
        return idx
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32) if T else \
        torch.empty(0, k, dtype=torch.int32)
    if drop:
        idx[torch.rand(idx.shape, generator=gen) < drop] = -1
    return idx


def _check(routings, E):
    G = len(routings)
    L = E // G
    counts_all = torch.stack([expert_counts(r, E) for r in routings])
    layouts = [build_layout(r, counts_all, s) for s, r in enumerate(routings)]
    # Expected order on each destination: (local expert, source, token, slot), written out naively.
    for d in range(G):
        expected = []
        for l in range(L):
            e = d * L + l
            for s, r in enumerate(routings):
                for t in range(r.shape[0]):
                    for j in range(r.shape[1]):
                        if int(r[t, j]) == e:
                            expected.append((s, t, j))
        got = {}
        for s, (r, lay) in enumerate(zip(routings, layouts)):
            for t in range(r.shape[0]):
                for j in range(r.shape[1]):
                    if int(lay.dest_rank[t, j]) == d:
                        got[int(lay.dest_row[t, j])] = (s, t, j)
        assert sorted(got) == list(range(len(expected))), "rows are not a dense range"
        assert [got[i] for i in range(len(expected))] == expected
        assert int(layouts[d].local_expert_counts.sum()) == len(expected)
    # Simulated all_to_all_single: what d receives from s is s's send order restricted to d.
    for d in range(G):
        arrived = []
        for s, (r, lay) in enumerate(zip(routings, layouts)):
            sent = lay.send_pairs.tolist()
            off = int(lay.send_counts[:d].sum())
            chunk = sent[off:off + int(lay.send_counts[d])]
            assert int(layouts[d].recv_counts[s]) == len(chunk)
            arrived += [int(lay.dest_row.view(-1)[p]) for p in chunk]
        assert layouts[d].recv_rows.tolist() == arrived
    # Dropped pairs are marked, kept ones are not.
    for r, lay in zip(routings, layouts):
        assert torch.equal(lay.dest_row < 0, r < 0)
        assert torch.equal(lay.dest_rank, torch.where(r >= 0, r.long() // L, -1))


@pytest.mark.parametrize("G,E,k", [(1, 4, 2), (2, 4, 1), (2, 8, 2), (4, 8, 4), (4, 16, 6), (2, 8, 8)])
@pytest.mark.parametrize("T", [1, 19, 111])
def test_layout_orders_rows_by_source_token_slot(G, E, k, T):
    gen = torch.Generator().manual_seed(1000 * G + 10 * k + T)
    _check([_routing(T + s, k, E, gen, drop=0.2) for s in range(G)], E)


def test_all_tokens_to_one_expert_and_empty_experts():
    E, G = 8, 4
    _check([_routing(19, 2, E, None, all_to=5) for _ in range(G)], E)


def test_no_tokens_anywhere():
    _check([torch.empty(0, 2, dtype=torch.int32) for _ in range(2)], 4)


def test_bad_input_is_named():
    idx = torch.tensor([[0, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match="out of range"):
        build_layout(idx, torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="does not match"):
        build_layout(torch.tensor([[0, 1]]), torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="do not split"):
        build_layout(torch.tensor([[0, 1]]), torch.zeros(3, 4, dtype=torch.long), 0)


def test_fused_runs_are_the_source_expert_blocks_in_arrival_order():
    """Each run of ``fused_runs`` covers exactly the rows the layout gives that (source, local
    expert) on the rank, sources come this rank first then rank - 1, ..., and the runs tile
    the receive buffer."""
    from ds_uniep.layout import build_layout, expert_counts, fused_runs
    G, L, T, k = 4, 3, 37, 2
    E = G * L
    g = torch.Generator().manual_seed(4)
    routes = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) for _ in range(G)]
    routes[1][::3, 1] = -1  # dropped pairs
    counts_all = torch.stack([expert_counts(r, E) for r in routes])
    for rank in range(G):
        runs = fused_runs(counts_all, rank)
        assert runs.shape == (G * L, 4)
        assert runs[::L, 3].tolist() == [(rank - r) % G for r in range(G)]
        lay = build_layout(routes[rank], counts_all, rank)
        covered = torch.zeros(lay.num_recv_rows, dtype=torch.long)
        for first, n, expert, src in runs.tolist():
            want = lay.recv_rows[(lay.recv_src == src) & (lay.recv_local_expert == expert)]
            assert sorted(want.tolist()) == list(range(first, first + n)), (rank, src, expert)
            covered[first:first + n] += 1
        assert bool((covered == 1).all())


@pytest.mark.parametrize("align", [2, 5, 16, 256])
def test_aligned_fused_runs_are_whole_tiles_waiting_for_their_latest_source(align):
    """With ``align`` rows per tile, every run of ``fused_runs`` starts on a tile boundary of its
    expert's block, ends on one or at the block's end, and each of its tiles holds rows of the
    run's source and otherwise only of sources of earlier rounds (from the layout's own rows);
    the runs cover every received row once, in as many tiles as the whole experts have."""
    from ds_uniep.layout import build_layout, expert_counts, fused_runs
    g = torch.Generator().manual_seed(align)
    for G, L, T, k in ((1, 3, 40, 2), (2, 4, 300, 3), (4, 3, 97, 2), (4, 2, 5, 2)):
        E = G * L
        routes = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) for _ in range(G)]
        routes[0][: T // 2, 0] = 0  # a crowded expert
        if G > 1:
            routes[1][::3, 1] = -1  # dropped pairs
        counts_all = torch.stack([expert_counts(r, E) for r in routes])
        totals = counts_all[:, :].view(G, G, L).sum(0)  # [rank, L]
        for rank in range(G):
            runs = fused_runs(counts_all, rank, align)
            assert runs.shape == (G * L, 4)
            assert runs[::L, 3].tolist() == [(rank - r) % G for r in range(G)]
            lay = build_layout(routes[rank], counts_all, rank)
            src_of = torch.full((lay.num_recv_rows,), -1, dtype=torch.long)
            src_of[lay.recv_rows] = lay.recv_src
            base = torch.cumsum(totals[rank], 0) - totals[rank]
            covered = torch.zeros(lay.num_recv_rows, dtype=torch.long)
            tiles = 0
            for i, (first, n, expert, src) in enumerate(runs.tolist()):
                r = i // L
                assert expert == i % L and src == (rank - r) % G
                if n == 0:
                    continue
                lo, end = first - int(base[expert]), first - int(base[expert]) + n
                assert lo % align == 0 and (end % align == 0 or end == int(totals[rank, expert])), (rank, i)
                for t in range(lo, end, align):
                    rows_src = src_of[int(base[expert]) + t:int(base[expert]) + min(t + align, end)]
                    assert max((rank - s) % G for s in rows_src.tolist()) == r, (rank, i, t)
                    tiles += 1
                covered[first:first + n] += 1
            assert bool((covered == 1).all())
            assert tiles == sum(-(-int(n) // align) for n in totals[rank].tolist())
    assert torch.equal(fused_runs(counts_all, 1, 1), fused_runs(counts_all, 1))
    with pytest.raises(ValueError, match="align"):
        fused_runs(counts_all, 0, 0)
