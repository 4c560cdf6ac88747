"""The pipelined schedule's copy plan (``ds_uniep.pipelined.MirrorPlan``) on the CPU: every
(expert, source) segment copied by the plan lands where the source's slot-order sum reads it.

The copies are simulated in numpy on byte buffers: each rank's expert outputs are rows whose
value names the (source, token, slot) pair, laid out as ``ds_uniep.layout`` places them; after
every rank's chunks are "copied", each source reads the row of its pair (t, j) at
``dest_row[t, j] + mirror_off[e]`` and must find its own pair id."""

import numpy as np
import pytest
import torch

from ds_uniep.layout import build_layout, expert_counts
from ds_uniep.pipelined import MirrorPlan, _chunks

ROW = 8  # bytes per simulated row: one int64 pair id


def _routing(G, T, k, E, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(G):
        if skew:  # every token of this rank to the first k experts: other experts get no rows
            idx = torch.arange(k).repeat(T, 1)
        else:
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
                torch.empty(0, k, dtype=torch.long)
        drop = torch.rand(idx.shape, generator=g) < 0.1
        out.append(torch.where(drop, torch.full_like(idx, -1), idx))
    return out


def _simulate(G, T, k, E, num_chunks, seed, skew=False):
    routing = _routing(G, T, k, E, seed, skew)
    counts = torch.stack([expert_counts(r, E) for r in routing])
    layouts = [build_layout(routing[r], counts, r) for r in range(G)]
    L = E // G
    cap = T * k
    mirrors = np.full((G, cap), -1, dtype=np.int64)  # each rank's combine buffer, rows of ROW bytes
    base = 1 << 20  # fake addresses: rank r's buffer at (r + 1) * base
    bases = [(r + 1) * base for r in range(G)]
    plans = [MirrorPlan(counts.numpy(), d, num_chunks, ROW, bases) for d in range(G)]
    for d in range(G):
        # the expert outputs of rank d, in its layout order: the pair id of each received row
        R = int(layouts[d].local_expert_counts.sum())
        rows = np.full(R, -1, dtype=np.int64)
        for s in range(G):
            lay = layouts[s]
            for t in range(routing[s].shape[0]):
                for j in range(k):
                    e = int(routing[s][t, j])
                    if e >= 0 and e // L == d:
                        rows[int(lay.dest_row[t, j])] = s * cap + t * k + j
        assert (rows >= 0).all()
        plan = plans[d]
        assert plan.rows == R
        covered = 0
        assert plan.chunks[0][2] == 0 and plan.chunks[-1][3] == R
        for c, (a, b, r0, r1) in enumerate(plan.chunks):
            if c:
                assert plan.chunks[c - 1][1] == a and plan.chunks[c - 1][3] == r0
            tables = plan.tables(c, torch.empty(0))
            assert sum(len(t) for t in tables.values()) == len(plan.segments[c])
            for dst_rank, t in tables.items():  # one table per destination rank, addresses read from `rows`
                assert all(int(a) // base - 1 == dst_rank for a in t[:, 1])
            a_off = plan.offs[sum(b_ - a_ for a_, b_, _, _ in plan.chunks[:c]):][:b - a]
            assert list(a_off) == list(np.cumsum(layouts[d].local_expert_counts.numpy()[a:b]))
            for src_row, dst, nbytes, dst_rank in plan.segments[c]:
                owner, off = divmod(int(dst), base)
                owner -= 1
                assert owner == dst_rank
                n = int(nbytes) // ROW
                assert 0 <= src_row and r0 + src_row + n <= r1
                dst_row = off // ROW
                assert (mirrors[owner, dst_row:dst_row + n] == -1).all(), "two segments overlap"
                mirrors[owner, dst_row:dst_row + n] = rows[r0 + src_row:r0 + src_row + n]
                covered += n
        assert covered == R
    for s in range(G):
        off = plans[s].mirror_off
        for t in range(routing[s].shape[0]):
            for j in range(k):
                e = int(routing[s][t, j])
                if e >= 0:
                    pos = int(layouts[s].dest_row[t, j]) + int(off[e])
                    assert mirrors[s, pos] == s * cap + t * k + j
    return plans


@pytest.mark.parametrize("G,T,k,E", [(2, 19, 2, 4), (4, 33, 6, 16), (4, 1, 8, 32), (2, 0, 1, 2), (4, 40, 1, 8)])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 8])
def test_every_segment_lands_where_the_source_reads_it(G, T, k, E, num_chunks):
    _simulate(G, T, k, E, num_chunks, seed=G * 100 + T + num_chunks)


def test_experts_without_rows_and_all_tokens_to_few_experts():
    for num_chunks in (2, 4):
        plans = _simulate(4, 25, 2, 16, num_chunks, seed=7, skew=True)
        assert all(len(p.chunks) == 1 for p in plans[1:])  # ranks 1-3 receive no rows: one empty chunk


def test_chunks_cut_by_rows_and_never_empty():
    assert _chunks(np.array([5, 5, 5, 5]), 2) == [(0, 2, 0, 10), (2, 4, 10, 20)]
    assert _chunks(np.array([5, 5, 5, 5]), 4) == [(0, 1, 0, 5), (1, 2, 5, 10), (2, 3, 10, 15), (3, 4, 15, 20)]
    assert _chunks(np.array([0, 0, 0]), 3) == [(0, 3, 0, 0)]
    assert _chunks(np.array([9, 0, 0, 1]), 2) == [(0, 1, 0, 9), (1, 4, 9, 10)]
    for counts in (np.array([0, 3, 0, 0, 4, 0]), np.array([1] * 16), np.array([0, 0, 7]), np.array([7, 0, 0])):
        for n in (1, 2, 3, 5, 16):
            ch = _chunks(counts, n)
            assert ch[0][0] == 0 and ch[-1][1] == len(counts) and ch[-1][3] == counts.sum()
            assert len(ch) <= max(1, n)
            assert all(a < b for a, b, _, _ in ch)
            assert all(r1 > r0 for _, _, r0, r1 in ch) or len(ch) == 1
            assert all(ch[i][1] == ch[i + 1][0] and ch[i][3] == ch[i + 1][2] for i in range(len(ch) - 1))


def test_partition_gives_the_gemm_the_sms_the_copies_leave():
    from ds_uniep.pipelined import partition
    assert partition("uniep", 20, 132) == (20, 112)
    assert partition("uniep", 21, 132) == (21, 110)  # an even count for 2-CTA clusters
    assert partition("uniep", 131, 132) == (0, 0)  # under 2 SMs left: copy engines, every SM
    assert partition("torch", 20, 132) == (0, 0)  # torch's GEMM takes every SM: copy engines


class _FakeDispatcher:
    """What ``ds_uniep.epilogue_combine.landing_tables`` reads of an NVLinkDispatcher, on the CPU:
    the device's run table is ``ds_uniep.layout.fused_runs`` (the same table, built in Python)."""

    def __init__(self, rank, G, base):
        from types import SimpleNamespace

        from ds_uniep.layout import fused_runs
        from ds_uniep.megakernel import NVLinkDispatcher
        self.rank, self.ep_size, self.device = rank, G, torch.device("cpu")
        comb = 4096
        self.bufs = SimpleNamespace(offsets={"comb": comb}, comb_row_bytes=ROW,
                                    descriptor=[(r + 1) * base - comb for r in range(G)])
        self.ext = SimpleNamespace(fused_segments=lambda counts, r, align: fused_runs(counts, r, align).int())
        self._comb_bases_dev = None
        self.comb_bases = NVLinkDispatcher.comb_bases.__get__(self)
        self.comb_bases_device = NVLinkDispatcher.comb_bases_device.__get__(self)


@pytest.mark.parametrize("G,T,k,E", [(2, 19, 2, 4), (4, 33, 6, 16), (4, 1, 8, 32), (2, 0, 1, 2), (4, 40, 1, 8)])
@pytest.mark.parametrize("skew", [False, True])
def test_epilogue_combine_runs_land_where_the_source_reads_them(G, T, k, E, skew):
    """The fused schedule's second GEMM stores each (expert, source) run at ``out_ptrs`` in the
    source's combine buffer; the source reads pair (t, j) at ``dest_row + mirror_off[e]``."""
    from ds_uniep.epilogue_combine import landing_tables
    routing = _routing(G, T, k, E, seed=G * 10 + T + k, skew=skew)
    counts = torch.stack([expert_counts(r, E) for r in routing])
    layouts = [build_layout(routing[r], counts, r) for r in range(G)]
    L, cap, base = E // G, T * k, 1 << 20
    mirrors = np.full((G, max(cap, 1)), -1, dtype=np.int64)
    offs = []
    for d in range(G):
        R = int(layouts[d].local_expert_counts.sum())
        rows = np.full(R, -1, dtype=np.int64)  # rank d's expert outputs: the pair id of each row
        for s in range(G):
            for t in range(routing[s].shape[0]):
                for j in range(k):
                    e = int(routing[s][t, j])
                    if e >= 0 and e // L == d:
                        rows[int(layouts[s].dest_row[t, j])] = s * cap + t * k + j
        segs, out_ptrs, mirror_off = landing_tables(_FakeDispatcher(d, G, base), counts)
        assert segs.shape == (G * L, 4) and out_ptrs.dtype == torch.int64 and mirror_off.dtype == torch.int32
        covered = 0
        for (first, n, l, src), ptr in zip(segs.tolist(), out_ptrs.tolist()):
            if n == 0:
                continue
            owner, off = divmod(ptr, base)
            assert owner - 1 == src and off % ROW == 0
            # a run is one expert's rows from one source, in layout order
            assert all(r // cap == src for r in rows[first:first + n])
            pos = off // ROW
            assert (mirrors[src, pos:pos + n] == -1).all(), "two runs overlap"
            mirrors[src, pos:pos + n] = rows[first:first + n]
            covered += n
        assert covered == R
        offs.append(mirror_off)
    for s in range(G):
        for t in range(routing[s].shape[0]):
            for j in range(k):
                e = int(routing[s][t, j])
                if e >= 0:
                    assert mirrors[s, int(layouts[s].dest_row[t, j]) + int(offs[s][e])] == s * cap + t * k + j


def test_epilogue_rows_are_kept_for_a_pending_backward_only():
    """Before peers may store into a combine region again (``BufferSet.keep_landed``, run by any
    layer of the set), the rows of an epilogue combine whose backward may still come are copied out,
    in the shape of the layer that left them; rows a backward already read, or whose forward record
    is gone (no graph kept), are not."""
    import gc
    import weakref
    from types import SimpleNamespace

    from ds_uniep.epilogue_combine import _Landed
    from ds_uniep.megakernel.buffers import BufferSet
    comb = torch.arange(24, dtype=torch.float32)
    layer_a = SimpleNamespace(comb_rows=lambda n: comb[:n * 4].view(n, 4))  # M = 4
    bset = SimpleNamespace(landed=None)
    keep = BufferSet.keep_landed

    pending = _Landed(4, layer_a)
    bset.landed = weakref.ref(pending)
    keep(bset)  # e.g. from another layer's dispatch, whose rows are [*, 6]
    assert bset.landed is None and torch.equal(pending.rows, comb[:16].view(4, 4))
    comb.add_(100)  # peers overwrite the buffer: the copy stays as it was
    assert torch.equal(pending.rows, torch.arange(16, dtype=torch.float32).view(4, 4))

    read = _Landed(4, layer_a)
    read.read = True
    bset.landed = weakref.ref(read)
    keep(bset)
    assert read.rows is None and bset.landed is None

    gone = _Landed(4, layer_a)
    bset.landed = weakref.ref(gone)
    del gone
    gc.collect()
    keep(bset)  # nothing to keep, nothing raised
    assert bset.landed is None


def test_segment_config_times_only_when_no_tile_is_set():
    """The GEMMs over runs take the tile of an explicit configuration (order dropped); the plain
    op's automatic choice (``auto``, which times kernels the first time) is asked for only when
    the op is left on "auto"."""
    from ds_uniep.epilogue_combine import segment_config

    def never():
        raise AssertionError("timed although a tile was given")
    assert segment_config({"dgrad": "pingpong128x128:n4"}, "dgrad", never) == "pingpong128x128"
    assert segment_config({"dgrad": "auto"}, "dgrad", lambda: "coop256x128:m2") == "coop256x128"
    assert segment_config(None, "fwd", never) == "coop128x256"  # the forward's default is explicit


@pytest.mark.parametrize("G,T,k,E", [(2, 19, 2, 4), (4, 33, 6, 16), (4, 1, 8, 32), (4, 300, 2, 8), (2, 0, 1, 2)])
@pytest.mark.parametrize("skew", [False, True])
def test_wait_runs_cover_each_expert_and_wait_for_every_source_they_hold(G, T, k, E, skew):
    """The runs the fused dispatch's first GEMM waits on (``NVLinkDispatcher._wait_runs``) under
    each ``signal_granularity``: every expert's block is covered once, by runs starting on its tile
    boundaries (so the GEMM does the tiles of the whole experts), and each run waits for a source
    whose round is at least that of every source with rows in it (arrival words rise in round
    order). ``expert``: one run per expert; ``rank``: every run waits for the last round."""
    from ds_uniep.layout import fused_runs
    from ds_uniep.megakernel import NVLinkDispatcher
    routing = _routing(G, T, k, E, seed=G * 7 + T + k, skew=skew)
    counts = torch.stack([expert_counts(r, E) for r in routing])
    L, tile = E // G, 4
    for rank in range(G):
        mine = counts[:, rank * L:(rank + 1) * L]  # [sources, local experts]
        for gran in ("tile", "expert", "rank"):
            fake = _FakeDispatcher(rank, G, 1 << 20)
            fake.signal_granularity = gran
            fake.bufs.recv_rows = G * max(T, 1) * min(k, L)
            segs = NVLinkDispatcher._wait_runs(fake, counts, tile)
            assert segs.shape == (G * L, 4)
            if gran == "tile":
                assert torch.equal(segs.long(), fused_runs(counts, rank, tile))
            base = 0
            for l in range(L):
                per_src = mine[:, l].tolist()
                total = sum(per_src)
                runs = sorted((f, n, s) for f, n, ll, s in segs.tolist() if ll == l and n > 0)
                assert sum(n for _, n, _ in runs) == total, (gran, rank, l)
                at = base
                for first, n, src in runs:
                    assert first == at and (first - base) % tile == 0, (gran, rank, l, runs)
                    at += n
                    pre = 0
                    for s, c in enumerate(per_src):  # every source with rows in [first, first + n)
                        if c and base + pre < first + n and base + pre + c > first:
                            assert (rank - src) % G >= (rank - s) % G, (gran, rank, l, s, src)
                        pre += c
                    if gran == "rank":
                        assert src == (rank + 1) % G
                if gran != "tile":
                    assert len(runs) == (1 if total else 0), (gran, runs)
                base += total
