"""Property-based checks of the deterministic layout (hypothesis): any group size, experts per rank,
slots, per-rank token counts (0 included) and routing (drops included) give the layout that
``test_layout._check`` writes out naively; the pipelined schedule's mirror offsets put a source's
pairs in (expert, token, slot) order in its combine buffer, densely."""
import torch
from hypothesis import given, settings  # a test requirement (setup.cfg [test]): never skipped
from hypothesis import strategies as st

from ds_uniep.layout import build_layout, expert_counts
from ds_uniep.pipelined import source_layout
from test_layout import _check


@st.composite
def routings(draw):
    """``(per-rank [T, k] int32 routings, E)``: a token's kept slots name distinct experts; -1 is a drop."""
    G = draw(st.integers(1, 4))
    L = draw(st.integers(1, 4))
    E = G * L
    k = draw(st.integers(1, min(E, 8)))
    out = []
    for _ in range(G):
        T = draw(st.integers(0, 9))
        rows = []
        for _ in range(T):
            experts = draw(st.permutations(range(E)))[:k]
            drops = draw(st.lists(st.booleans(), min_size=k, max_size=k))
            rows.append([-1 if d else e for e, d in zip(experts, drops)])
        out.append(torch.tensor(rows, dtype=torch.int32).view(T, k))
    return out, E


@settings(max_examples=150, deadline=None)
@given(routings())
def test_any_routing_gets_the_naive_layout(case):
    _check(*case)


@settings(max_examples=150, deadline=None)
@given(routings())
def test_mirror_offsets_order_a_sources_pairs_by_expert_token_slot(case):
    rs, E = case
    counts_all = torch.stack([expert_counts(r, E) for r in rs])
    for s, r in enumerate(rs):
        lay = build_layout(r, counts_all, s)
        _, mirror_off = source_layout(counts_all, s)
        kept = r >= 0
        rows = (lay.dest_row + mirror_off.long()[r.long().clamp_min(0)])[kept]
        # the kept pairs in (token, slot) order, as the mask reads them; each one's rank by (expert, token, slot)
        keys = [(int(r[t, j]), t, j) for t in range(r.shape[0]) for j in range(r.shape[1]) if r[t, j] >= 0]
        assert rows.tolist() == [sorted(keys).index(key) for key in keys]
