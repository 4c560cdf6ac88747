"""The deterministic token layout: where every kept (token, slot) row goes.

Letters: T tokens on this rank, k slots per token, E experts, G expert-parallel
ranks, L = E // G local experts per rank, R rows received by this rank.
Expert ``e`` lives on rank ``e // L`` as local expert ``e % L``.

The layout is a pure function of every rank's routing decisions:

1. ``counts_all[s, e]`` (``[G, E]`` int64) counts the kept (token, slot) pairs
   of source rank ``s`` routed to expert ``e``; every rank holds the same copy.
2. On destination rank ``d`` the receive buffer holds local experts in order;
   the rows of one expert are ordered by (source rank, token index, slot).
   A token reaches one expert at most once, so inside a (source, expert) block
   rows follow token order.
3. Hence the row of pair (t, j) of source ``s`` routed to ``e`` is
   ``expert_base[e] + src_prefix[s, e] + block_pos`` where ``block_pos`` is the
   number of kept pairs of ``s`` routed to ``e`` with a smaller token index.

Nothing here depends on arrival time or on how rows are moved, which is what
lets every backend and schedule produce bitwise identical results.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


def expert_counts(expert_idx: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64 kept pairs per expert. ``expert_idx``: ``[T, k]`` int, -1 for a dropped pair."""
    flat = expert_idx.reshape(-1).long()
    # Dropped pairs land in an extra bin 0, cut off: no boolean indexing, so no host synchronisation.
    bins = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    return bins.scatter_add_(0, flat + 1, torch.ones_like(flat))[1:]


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return torch.cumsum(x, dim) - x


@dataclass(frozen=True)
class Layout:
    """The layout as seen from one rank. Every tensor is int64 on the routing's device.

    Pair ids are flat: ``pair = t * k + j``.
    """
    #: ``[T, k]`` destination rank of each pair, -1 if dropped.
    dest_rank: Tensor
    #: ``[T, k]`` row in the destination's expert-major receive buffer, -1 if dropped.
    dest_row: Tensor
    #: ``[T, k]`` position inside its (source, expert) block, -1 if dropped.
    block_pos: Tensor
    #: ``[N]`` kept pair ids in send order: by destination rank, then destination row.
    send_pairs: Tensor
    #: ``[G]`` rows this rank sends to each rank.
    send_counts: Tensor
    #: ``[G]`` rows this rank receives from each rank.
    recv_counts: Tensor
    #: ``[L]`` rows of each local expert on this rank (``R`` in total).
    local_expert_counts: Tensor
    #: ``[R]`` for the i-th received row in arrival-buffer order (source-major, as
    #: ``all_to_all_single`` delivers it), its row in the expert-major buffer.
    recv_rows: Tensor
    #: ``[R]`` source rank / local expert / block position of each received row (same order).
    recv_src: Tensor
    recv_local_expert: Tensor
    recv_block_pos: Tensor

    @property
    def num_recv_rows(self) -> int:
        return int(self.recv_rows.numel())


def build_layout(expert_idx: Tensor, counts_all: Tensor, rank: int) -> Layout:
    """Compute the layout of this rank's pairs and of the rows it receives.

    Args:
        expert_idx: ``[T, k]`` int, the expert of each (token, slot), -1 if dropped.
        counts_all: ``[G, E]`` int64, ``expert_counts`` of every rank (row ``s`` from rank ``s``).
        rank: this rank's index in the expert-parallel group.
    """
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be [T, k], got shape {tuple(expert_idx.shape)}")
    G, E = counts_all.shape
    if E % G != 0:
        raise ValueError(f"{E} experts do not split over {G} ranks")
    if not 0 <= rank < G:
        raise ValueError(f"rank {rank} outside an expert-parallel group of {G}")
    L = E // G
    T, k = expert_idx.shape
    device = expert_idx.device
    counts_all = counts_all.to(device=device, dtype=torch.long)
    counts_me = counts_all[rank]

    flat = expert_idx.reshape(-1).long()
    kept = flat >= 0
    if bool((flat >= E).any()):
        raise ValueError(f"expert index out of range for {E} experts: {int(flat.max())}")
    if not torch.equal(torch.bincount(flat[kept], minlength=E), counts_me):
        raise ValueError("counts_all[rank] does not match this rank's routing")

    # 1. Sort pairs by expert; a stable sort keeps (token, slot) order inside each expert,
    #    so the position inside the expert's run is block_pos. Dropped pairs sort last.
    key = torch.where(kept, flat, torch.full_like(flat, E))
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    starts = torch.cat([_exclusive_cumsum(counts_me, 0), counts_me.new_zeros(1)])
    pos_sorted = torch.arange(flat.numel(), device=device) - starts[sorted_key]
    block_pos = torch.empty_like(flat)
    block_pos[order] = pos_sorted
    block_pos = torch.where(kept, block_pos, torch.full_like(block_pos, -1))

    # 2. Base row of each (source, expert) block on the expert's rank: experts in order,
    #    sources in order inside an expert.
    totals = counts_all.sum(0).view(G, L)
    expert_base = _exclusive_cumsum(totals, 1).reshape(E)
    src_prefix = _exclusive_cumsum(counts_all, 0)  # [G, E]
    block_base = expert_base + src_prefix[rank]
    safe = torch.where(kept, flat, torch.zeros_like(flat))
    dest_row = torch.where(kept, block_base[safe] + block_pos, torch.full_like(flat, -1))
    dest_rank = torch.where(kept, flat // L, torch.full_like(flat, -1))

    # 3. Sorting by expert also sorts by (destination rank, destination row): experts of one
    #    rank are contiguous and block_base grows with the expert for a fixed source.
    num_kept = int(counts_me.sum())
    send_pairs = order[:num_kept]
    send_counts = counts_me.view(G, L).sum(1)

    # 4. Received rows in arrival order (source-major, then local expert, then block_pos).
    mine = counts_all[:, rank * L:(rank + 1) * L]  # [G, L]
    recv_counts = mine.sum(1)
    local_expert_counts = mine.sum(0)
    lengths = mine.reshape(-1)
    R = int(lengths.sum())
    block_ids = torch.repeat_interleave(torch.arange(G * L, device=device), lengths)
    within = torch.arange(R, device=device) - torch.repeat_interleave(_exclusive_cumsum(lengths, 0), lengths)
    base = (expert_base.view(G, L)[rank].unsqueeze(0) + src_prefix[:, rank * L:(rank + 1) * L]).reshape(-1)
    recv_rows = base[block_ids] + within

    return Layout(dest_rank=dest_rank.view(T, k), dest_row=dest_row.view(T, k), block_pos=block_pos.view(T, k),
                  send_pairs=send_pairs, send_counts=send_counts, recv_counts=recv_counts,
                  local_expert_counts=local_expert_counts, recv_rows=recv_rows, recv_src=block_ids // L,
                  recv_local_expert=block_ids % L, recv_block_pos=within)


def fused_runs(counts_all: Tensor, rank: int, align: int = 1) -> Tensor:
    """The runs of rows the fused schedule's first GEMM takes on ``rank``: ``[G * L, 4]`` int64
    (first row, rows, local expert, source), one per (arrival round, local expert), rounds in the
    order rows arrive: round r brings source ``rank - r`` (source s sends to rank d in its round
    ``(d - s) mod G``), local experts in order inside a round.

    Expert l's rows form one block of the expert-major receive buffer (sources in rank order
    inside it). ``align`` cuts that block into tiles of ``align`` rows from its first row (the
    GEMM's rows per tile; 1: every row its own tile). A tile waits for the latest round among
    the sources it holds rows of, and the run of (round r, expert l) is every tile of the block
    whose latest round is r: one contiguous range, since a block's sources arrive in rounds
    falling from ``rank`` to 0 and then from ``G - 1`` to ``rank + 1``. So runs start on a tile
    boundary of their expert and only the last one of an expert ends off it: the GEMM over the
    runs does the tiles of the GEMM over whole experts. The source's word covers every row of a
    run, because the rounds are taken in order. ``align`` 1 gives the (source, expert) blocks.
    A run without rows starts where its source's rows in the block start. The megakernel builds
    the same table on the device (``fused_segments`` in ops/csrc/layout)."""
    G, E = counts_all.shape
    if E % G != 0 or not 0 <= rank < G:
        raise ValueError(f"counts_all {tuple(counts_all.shape)} and rank {rank} do not make a layout")
    if align < 1:
        raise ValueError(f"fused runs: align must be a positive number of rows, got {align}")
    L = E // G
    mine = counts_all[:, rank * L:(rank + 1) * L].long().cpu()  # [G sources, L]
    totals = mine.sum(0)
    bases = _exclusive_cumsum(totals, 0).tolist()
    rounds = [(rank - s) % G for s in range(G)]
    runs = torch.zeros(G * L, 4, dtype=torch.long)
    for l in range(L):
        counts = mine[:, l].tolist()
        pre = _exclusive_cumsum(mine[:, l], 0).tolist()
        total = int(totals[l])

        def latest(tile: int) -> int:  # the latest round among the sources with rows in the tile
            lo, hi = tile * align, min(tile * align + align, total)
            return max(rounds[s] for s in range(G) if counts[s] and pre[s] < hi and pre[s] + counts[s] > lo)

        for r in range(G):
            s = (rank - r) % G
            first, rows = bases[l] + pre[s], 0
            if counts[s]:
                t0, t1 = pre[s] // align, (pre[s] + counts[s] - 1) // align  # the tiles holding s's rows
                ts = t0 if latest(t0) == r else t0 + 1  # tiles inside s's rows hold only s's
                te = t1 if latest(t1) == r else t1 - 1
                if ts <= te:
                    first, rows = bases[l] + ts * align, min((te + 1) * align, total) - ts * align
            runs[r * L + l] = torch.tensor([first, rows, l, s])
    return runs.to(counts_all.device)
