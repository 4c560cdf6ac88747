"""All-gather+GEMM and GEMM+reduce-scatter as overlapped peer-to-peer steps.

Letters: G ranks in the group, ``me`` this rank's index in it, T rows in total
(tokens), T_r rows of rank r's block, K the contracted dimension, N output
columns. Row blocks are in rank order: block r holds rows
``offsets[r] : offsets[r] + T_r``.

Exactness (the promise every schedule keeps):

* :func:`all_gather_matmul` computes output block r with one GEMM of block r
  (``x_r @ w``), the same call that ``all_gather`` followed by a block-wise
  GEMM makes, so the result is bitwise equal to
  ``torch.cat([x_r @ w for r in range(G)])``
  (:func:`ds_uniep.commfuse.reference.ref_all_gather_matmul`).
* :func:`matmul_reduce_scatter` computes each partial ``x_r[rows_j] @ w_r`` in
  the input dtype and adds the partials of a block in rank order
  0, 1, ..., G-1 into an fp32 accumulator (fp64 for fp64 inputs), cast once at the end, whatever the
  schedule, so it is bitwise reproducible and equal to
  :func:`ds_uniep.commfuse.reference.ref_matmul_reduce_scatter`; except the
  ``relay`` schedule, which adds the fp32 products in ring order in the GEMMs'
  epilogues (below).

``num_chunks`` splits each step's transfer into that many row chunks (separate
messages). GEMMs stay whole blocks: splitting a GEMM by rows may change the
kernel (and so the rounding) and would break the promise above. The one
exception, on the copy-engine transport (whose copies are never split): there
``num_chunks`` > 1 cuts the reduce-scatter's own partial, its last GEMM, into
that many row chunks, and each chunk's rank-order sum runs on a side stream
while the next chunk's GEMM runs, so only the last chunk's sum is left after
the last GEMM. The sum keeps its order; the own partial's bits are those of
one GEMM per chunk, as :func:`ds_uniep.commfuse.reference.ref_matmul_reduce_scatter`
computes them with ``own_chunks=num_chunks`` (equal to ``num_chunks=1``'s
within the GEMM's rounding, bitwise where the GEMM library runs the same
kernel for the chunk's row count).

The ``local_first`` schedule multiplies fewer, larger row groups instead (see
:func:`.common._remote_runs`): this rank's block, then the blocks after it as one GEMM,
then the blocks before it as one GEMM. Its results are bitwise equal to the
references run with the same grouping (``local_first_rank=`` / ``local_first=``
in :mod:`ds_uniep.commfuse.reference`) and equal to the ring schedules' within
the GEMM's rounding (bitwise where the GEMM library runs the same kernel for the
larger row count). The reduce-scatter's rank-order fp32 sum is unchanged.

Schedules. all_gather_matmul: ``ring`` relays blocks between neighbours
(send to me+1, receive from me-1), ``bidirectional_ring`` relays the blocks of
the ranks behind one way and of the ranks ahead the other way, so half the
steps. matmul_reduce_scatter sends each partial straight to the rank that owns
its rows, peer me+d at step d (``ring``: d = 1..G-1; ``bidirectional_ring``: +d
and -d together): a relayed running sum would fix the addition order by ring
position instead of rank order. On a switched fabric (NVSwitch) such shifted
peers cost what neighbours cost. ``local_first`` (both ops) moves every block
in one step, straight between owner and user: all-gather sends this rank's
block to every peer while multiplying it, then multiplies the blocks received;
reduce-scatter multiplies the peers' partials first and sends them all while
multiplying its own. Fewer, larger GEMMs lose less to partly filled waves of
tiles than one GEMM per block; the transfers hide behind one block's GEMM.

``arrival`` (CUDA, Hopper, bf16; ``arrival.py``): all-gather moves every block in one step by
the copy engines, as ``local_first``, and runs the whole GEMM as one launch of ds_uniep's grouped
GEMM whose tiles of a peer's block wait (on the GPU) for that block's arrival, this rank's block
first; bitwise equal to that GEMM over the gathered rows
(:func:`ds_uniep.commfuse.reference.ref_all_gather_matmul` with ``gemm="uniep"``), equal to the
other schedules within the GEMM's rounding. Its reduce-scatter (also the all-gather's backward)
is ``bidirectional_ring``'s. Where it cannot run, both ops raise, naming why.

``relay`` (reduce-scatter; ``relay.py``): block j's running sum travels round the ring from
rank j+1 to the owner j, each rank adding its fp32 product in its GEMM's epilogue (``addmm`` with
the sum so far as C), in ``num_chunks`` row chunks passed on one by one, so no closing sum follows
the last GEMM. Its fixed order (j+1, ..., j+G-1, j; fp32 products, not partials rounded to the
input dtype) makes it bitwise reproducible and equal to
:func:`ds_uniep.commfuse.reference.ref_matmul_reduce_scatter_relay`, and equal to the rank-order
schedules within the input dtype's rounding. Its all-gather (also the reduce-scatter's backward)
is ``ring``'s.

Streams (CUDA): transfers are issued from a side stream, so a transfer waits
only for the GEMM that produced what it sends, and each GEMM waits (by event)
only for the transfer that brought its block. Buffers a transfer writes are
allocated before the side stream first waits on the compute stream; every
tensor a transfer touches is recorded on the side stream; and the compute
stream joins the side stream before returning. So the caching allocator cannot
hand out a buffer while a transfer still uses it, and the caller sees finished
results on its current stream.

Inputs should be contiguous (a non-contiguous ``x_shard`` is copied first, so
its GEMM is no longer the one a reference on the original view would run).
"""
from typing import List, Optional, Sequence

import torch

from .common import (Timeline, _check_pair, _chunks, _Exchange, _Gemm, _mm_into, _offsets, _peer_order, _remote_runs,
                     _resolve_group, check_schedule, check_transport, even_split, gather_shard_sizes,
                     ordered_sum, sum_dtype)


# --------------------------------------------------------------------------- all-gather + GEMM

def resolve_transport(transport: str, group, G: int, device: torch.device) -> str:
    """``p2p`` or ``copy_engine`` for this call. ``auto``: the copy engine on CUDA with torch symmetric
    memory, NCCL/gloo send/recv otherwise; one rank needs no transport."""
    check_transport(transport)
    if transport == "p2p" or G == 1:
        return "p2p"
    from . import copy_engine
    ok, reason = copy_engine.available(group, device)
    if ok:
        return "copy_engine"
    if transport == "copy_engine":
        raise RuntimeError(f"commfuse transport 'copy_engine' is not usable here: {reason}")
    return "p2p"


def check_arrival(op: str, a: torch.Tensor, w: torch.Tensor, group) -> None:
    """Raise unless the ``arrival`` schedule can run ``op`` here: its all-gather (of ``op`` itself,
    or of its backward) runs ds_uniep's GEMM with copy-engine transfers."""
    from .arrival import available
    ok, why = available(a, w, group)
    if not ok:
        raise RuntimeError(f"{op}: commfuse schedule 'arrival' cannot run here: {why} (schedules 'ring', "
                           "'bidirectional_ring' and 'local_first' run everywhere)")

def _ag_plan(G: int, me: int, schedule: str):
    """Steps of ``(gemm_blocks, transfers)``; a transfer is ``(send_block, to, recv_block, frm, tag_base)``.

    ring: at step s this rank holds block me-s; it sends it to me+1, receives
    block me-s-1 from me-1 and multiplies block me-s meanwhile.
    bidirectional_ring: blocks of the G//2 ranks behind arrive clockwise and of
    the (G-1)//2 ranks ahead counter-clockwise, both directions at once, so
    there are G//2 transfer steps instead of G-1.
    """
    steps = []
    if schedule == "ring":
        for s in range(G):
            tr = [((me - s) % G, (me + 1) % G, (me - s - 1) % G, (me - 1) % G, 0)] if s < G - 1 else []
            steps.append(([(me - s) % G], tr))
        return steps
    hf, hb = G // 2, (G - 1) // 2
    for s in range(hf + 1):
        gemm = [me] if s == 0 else [(me - s) % G] + ([(me + s) % G] if s <= hb else [])
        tr = []
        if s < hf:
            tr.append(((me - s) % G, (me + 1) % G, (me - s - 1) % G, (me - 1) % G, 0))
        if s < hb:
            tr.append(((me + s) % G, (me - 1) % G, (me + s + 1) % G, (me + 1) % G, 1))
        steps.append((gemm, tr))
    return steps


def all_gather_matmul_impl(x_shard: torch.Tensor, w: torch.Tensor, group=None, schedule: str = "ring",
                           num_chunks: int = 1, shard_sizes: Optional[Sequence[int]] = None,
                           timeline: Optional[Timeline] = None, transport: str = "p2p", keep_full: bool = True):
    """No-autograd core of :func:`all_gather_matmul`; returns ``(y [T, N], x_full [T, K], shard_sizes)``
    (``x_full`` is None when ``keep_full`` is False and the copy-engine transport ran)."""
    g, G, me, ranks = _resolve_group(group)
    x_shard = x_shard.contiguous()
    if shard_sizes is None:
        shard_sizes = gather_shard_sizes(x_shard, g)
    shard_sizes = [int(s) for s in shard_sizes]
    if len(shard_sizes) != G or shard_sizes[me] != x_shard.shape[0] or min(shard_sizes) < 0:
        raise ValueError(f"all_gather_matmul: shard_sizes {shard_sizes} must have one entry per rank ({G}) and "
                         f"entry {me} must equal x_shard.shape[0] = {x_shard.shape[0]}")
    offs = _offsets(shard_sizes)
    if schedule == "relay":  # a reduce-scatter schedule; the all-gather has no relay form
        schedule = "ring"
    if schedule == "arrival":
        if transport == "p2p":
            raise ValueError("all_gather_matmul: commfuse schedule 'arrival' moves blocks by the copy engines; "
                             "transport 'p2p' does not apply (use 'auto' or 'copy_engine')")
        check_arrival("all_gather_matmul", x_shard, w, g)
        from .arrival import all_gather_matmul_arrival
        out, x_full = all_gather_matmul_arrival(x_shard, w, g, me, shard_sizes, offs, keep_full, timeline)
        return out, x_full, shard_sizes
    runs = _remote_runs(shard_sizes, me) if schedule == "local_first" else None
    if resolve_transport(transport, g, G, x_shard.device) == "copy_engine":
        from .copy_engine import all_gather_matmul_ce
        out, x_full = all_gather_matmul_ce(x_shard, w, g, me, shard_sizes, offs, _peer_order(G, schedule),
                                           keep_full, _mm_into, timeline, runs)
        return out, x_full, shard_sizes
    T, K, N = sum(shard_sizes), x_shard.shape[1], w.shape[1]
    x_full = x_shard.new_empty(T, K)
    out = torch.empty(T, N, dtype=torch.result_type(x_shard, w), device=x_shard.device)

    def rows(t, b):
        return t[offs[b]:offs[b] + shard_sizes[b]]

    def block(b):
        return x_shard if b == me else rows(x_full, b)

    ex = _Exchange(x_shard.device, g, timeline)
    gemm = _Gemm(ex.timeline, ex.compute)
    if runs is not None:
        # One step: this rank's block to every peer, every peer's block from it, all at once.
        sends, recvs = [], []
        for p in range(G):
            if p != me:
                for c, (c0, cn) in enumerate(_chunks(shard_sizes[me], num_chunks)):
                    sends.append((x_shard[c0:c0 + cn], ranks[p], c))
                for c, (c0, cn) in enumerate(_chunks(shard_sizes[p], num_chunks)):
                    recvs.append((rows(x_full, p)[c0:c0 + cn], ranks[p], c))
        token = ex.start(0, sends, recvs)
        gemm("gemm", 0, lambda: _mm_into(x_shard, w, rows(out, me)))
        ex.wait(token)
        for i, (r0, n, _) in enumerate(runs):
            gemm("gemm", i + 1, lambda r0=r0, n=n: _mm_into(x_full[r0:r0 + n], w, out[r0:r0 + n]))
        rows(x_full, me).copy_(x_shard)
        ex.finish()
        return out, x_full, shard_sizes
    plan = _ag_plan(G, me, schedule)
    prev = None
    for s, (gemm_blocks, transfers) in enumerate(plan):
        # After this wait every block in gemm_blocks (received at step s-1) is
        # present, and so is every block this step forwards.
        ex.wait(prev)
        sends, recvs = [], []
        for send_b, to, recv_b, frm, tag_base in transfers:
            for c, (c0, cn) in enumerate(_chunks(shard_sizes[send_b], num_chunks)):
                sends.append((block(send_b)[c0:c0 + cn], ranks[to], tag_base * num_chunks + c))
            for c, (c0, cn) in enumerate(_chunks(shard_sizes[recv_b], num_chunks)):
                recvs.append((rows(x_full, recv_b)[c0:c0 + cn], ranks[frm], tag_base * num_chunks + c))
        prev = ex.start(s, sends, recvs)
        for b in gemm_blocks:
            gemm("gemm", s, lambda b=b: _mm_into(block(b), w, rows(out, b)))
    ex.wait(prev)
    # x_full's own block is filled off the critical path, after the GEMMs were queued.
    rows(x_full, me).copy_(x_shard)
    ex.finish()
    return out, x_full, shard_sizes


# --------------------------------------------------------------------------- GEMM + reduce-scatter
def _rs_plan(G: int, schedule: str) -> List[List[int]]:
    """Per step, the offsets d: send the partial of block me+d to rank me+d, receive ours from me-d.

    Each partial goes straight to its owner (a shifted exchange, not a relay):
    relaying a running sum would fix the addition order by ring position,
    while the promise is rank order. On a switched fabric (NVSwitch) the
    shifted peers cost what ring neighbours cost. ring: offsets 1..G-1, one per
    step; bidirectional_ring: +k and -k in the same step, so ceil((G-1)/2) steps.
    """
    if schedule == "ring":
        return [[d] for d in range(1, G)]
    steps = [[k, -k] for k in range(1, (G - 1) // 2 + 1)]
    if G % 2 == 0 and G > 1:
        steps.append([G // 2])
    return steps


def matmul_reduce_scatter_impl(x: torch.Tensor, w: torch.Tensor, group=None, schedule: str = "ring",
                               num_chunks: int = 1, out_sizes: Optional[Sequence[int]] = None,
                               timeline: Optional[Timeline] = None, transport: str = "p2p"):
    """No-autograd core of :func:`matmul_reduce_scatter`; returns ``(out [T_me, N], out_sizes)``."""
    g, G, me, ranks = _resolve_group(group)
    T, N = x.shape[0], w.shape[1]
    out_sizes = even_split(T, G) if out_sizes is None else [int(s) for s in out_sizes]
    if len(out_sizes) != G or sum(out_sizes) != T or min(out_sizes) < 0:
        raise ValueError(f"matmul_reduce_scatter: out_sizes {out_sizes} must have one non-negative entry per "
                         f"rank ({G}) summing to x.shape[0] = {T}")
    offs = _offsets(out_sizes)
    if schedule == "arrival":  # no arrival form of its own (see the module doc)
        schedule = "bidirectional_ring"
    if schedule == "relay":
        from .relay import matmul_reduce_scatter_relay
        return matmul_reduce_scatter_relay(x, w, g, me, G, ranks, out_sizes, offs, num_chunks,
                                           resolve_transport(transport, g, G, x.device), timeline), out_sizes
    runs = _remote_runs(out_sizes, me) if schedule == "local_first" else None
    if resolve_transport(transport, g, G, x.device) == "copy_engine":
        from .copy_engine import matmul_reduce_scatter_ce
        return matmul_reduce_scatter_ce(x, w, g, me, out_sizes, offs, _peer_order(G, schedule), timeline,
                                        runs, tail_chunks=num_chunks), out_sizes
    dtype = torch.result_type(x, w)
    t_me = out_sizes[me]

    def partial(j):
        return x[offs[j]:offs[j] + out_sizes[j]] @ w

    # Receive buffers exist before the side stream first waits on the compute stream.
    partials: List[Optional[torch.Tensor]] = [None] * G
    recv_bufs = {src: torch.empty(t_me, N, dtype=dtype, device=x.device) for src in range(G) if src != me}

    ex = _Exchange(x.device, g, timeline)
    gemm = _Gemm(ex.timeline, ex.compute)
    if runs is not None:
        # The peers' partials first, one GEMM per run of their rows; all sent in one step while
        # this rank's own partial is computed.
        to_send = {}
        for i, (r0, n, blocks) in enumerate(runs):
            p = gemm("gemm", i, lambda r0=r0, n=n: x[r0:r0 + n] @ w)
            for j in blocks:
                to_send[j] = p[offs[j] - r0:offs[j] - r0 + out_sizes[j]]
        sends, recvs = [], []
        for p in range(G):
            if p != me:
                for c, (c0, cn) in enumerate(_chunks(out_sizes[p], num_chunks)):
                    sends.append((to_send[p][c0:c0 + cn], ranks[p], c))
                for c, (c0, cn) in enumerate(_chunks(t_me, num_chunks)):
                    recvs.append((recv_bufs[p][c0:c0 + cn], ranks[p], c))
        token = ex.start(0, sends, recvs, after=ex.compute_ready())
        own = gemm("gemm", len(runs), lambda: partial(me))
        ex.wait(token)
        out = gemm("reduce", 0, lambda: ordered_sum([own if p == me else recv_bufs[p] for p in range(G)]))
        ex.finish()
        del to_send
        return out, out_sizes
    plan = _rs_plan(G, schedule)
    acc = None
    next_src = 0

    def add_ready(step):
        # Partials of sources 0..next_src-1 are in acc, added in that order.
        nonlocal acc, next_src
        while next_src < G and partials[next_src] is not None:
            p = partials[next_src]
            if acc is None:
                acc = gemm("reduce", step, lambda: p.to(sum_dtype(dtype), copy=True))
            else:
                gemm("reduce", step, lambda: acc.add_(p))
            next_src += 1

    # The first partials to send: nothing to hide them behind.
    to_send = {(me + d) % G: gemm("gemm", 0, lambda j=(me + d) % G: partial(j)) for d in plan[0]} if plan else {}
    ready = ex.compute_ready()
    for s, ds in enumerate(plan):
        sends, recvs = [], []
        for tag_base, d in enumerate(ds):
            dst, src = (me + d) % G, (me - d) % G
            for c, (c0, cn) in enumerate(_chunks(out_sizes[dst], num_chunks)):
                sends.append((to_send[dst][c0:c0 + cn], ranks[dst], tag_base * num_chunks + c))
            for c, (c0, cn) in enumerate(_chunks(t_me, num_chunks)):
                recvs.append((recv_bufs[src][c0:c0 + cn], ranks[src], tag_base * num_chunks + c))
        token = ex.start(s, sends, recvs, after=ready)
        # While step s's partials travel: the partials of step s+1, or ours last,
        # so that the last transfer is hidden too.
        if s + 1 < len(plan):
            for d in plan[s + 1]:
                j = (me + d) % G
                to_send[j] = gemm("gemm", s + 1, lambda j=j: partial(j))
            ready = ex.compute_ready()
        else:
            partials[me] = gemm("gemm", s + 1, lambda: partial(me))
        ex.wait(token)
        for d in ds:
            partials[(me - d) % G] = recv_bufs[(me - d) % G]
        add_ready(s)
    if G == 1:
        partials[me] = partial(me)
    add_ready(len(plan))
    assert next_src == G
    out = acc if acc.dtype == dtype else acc.to(dtype)
    ex.finish()
    # to_send must outlive the transfers (recorded on the side stream above).
    del to_send
    return out, out_sizes


# --------------------------------------------------------------------------- autograd
class _AllGatherMatmul(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_shard, w, group, schedule, num_chunks, shard_sizes, transport):
        y, x_full, sizes = all_gather_matmul_impl(x_shard, w, group, schedule, num_chunks, shard_sizes,
                                                  transport=transport, keep_full=ctx.needs_input_grad[1])
        # x_full is kept (not re-gathered) for the weight gradient.
        ctx.save_for_backward(x_full if ctx.needs_input_grad[1] else None, w)
        ctx.args = (group, schedule, num_chunks, sizes, transport)
        return y

    @staticmethod
    def backward(ctx, gy):
        x_full, w = ctx.saved_tensors
        group, schedule, num_chunks, sizes, transport = ctx.args
        gy = gy.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # d x_full = sum over ranks of gy_r @ w_r^T; each rank keeps its own rows.
            gx, _ = matmul_reduce_scatter_impl(gy, w.t(), group, schedule, num_chunks, out_sizes=sizes,
                                               transport=transport)
        if ctx.needs_input_grad[1]:
            gw = x_full.t() @ gy
        return gx, gw, None, None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w, group, schedule, num_chunks, out_sizes, transport):
        out, sizes = matmul_reduce_scatter_impl(x, w, group, schedule, num_chunks, out_sizes, transport=transport)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        ctx.args = (group, schedule, num_chunks, sizes, transport)
        return out

    @staticmethod
    def backward(ctx, gout):
        x, w = ctx.saved_tensors
        group, schedule, num_chunks, sizes, transport = ctx.args
        # d x_r = gout_full @ w_r^T, and the gathered gout_full also gives d w_r.
        gx, gout_full, _ = all_gather_matmul_impl(gout.contiguous(), w.t(), group, schedule, num_chunks,
                                                  shard_sizes=sizes, transport=transport,
                                                  keep_full=ctx.needs_input_grad[1])
        gw = x.t() @ gout_full if ctx.needs_input_grad[1] else None
        return (gx if ctx.needs_input_grad[0] else None), gw, None, None, None, None, None


def all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor, group=None, schedule: str = "ring",
                      num_chunks: int = 1, shard_sizes: Optional[Sequence[int]] = None,
                      transport: str = "auto") -> torch.Tensor:
    """``all_gather(x_shard) @ w`` as overlapped peer-to-peer steps.

    Args:
        x_shard: ``[T_r, K]`` bf16/fp16/fp32, this rank's row block; blocks may
            differ in size across ranks (zero rows included).
        w: ``[K, N]`` same dtype and device (this rank's weight; may be a view
            such as ``weight.t()``).
        group: process group (default: the world group).
        schedule: ``"ring"``, ``"bidirectional_ring"``, ``"local_first"``, ``"arrival"`` or
            ``"relay"`` (see the module doc; ``arrival`` runs ds_uniep's GEMM, so its bits are that
            GEMM's; ``relay`` is a reduce-scatter schedule, its all-gather is ``ring``).
        num_chunks: messages each block transfer is split into.
        shard_sizes: rows of every rank's block, if known; otherwise gathered
            once (a small all-gather and, on GPU, a host sync).
        transport: ``"p2p"`` (NCCL or gloo send/recv), ``"copy_engine"``
            (copies into peers' symmetric buffers, CUDA only; ``num_chunks``
            does not split its copies: in its reduce-scatter, also the backward
            of this op, it cuts the own partial's GEMM and the closing sum into
            row chunks, see the module doc) or ``"auto"`` (the copy engine where usable).

    Returns:
        ``[T, N]``, rows in rank order, bitwise equal to
        ``torch.cat([x_r @ w for r in ranks])`` (``local_first`` and ``arrival``: to the
        references of :mod:`ds_uniep.commfuse.reference` with their grouping or GEMM).
    Backward: ``d x_shard`` is a :func:`matmul_reduce_scatter` of ``d y`` with
    ``w^T``; ``d w = x_full^T @ d y`` with the gathered ``x_full`` kept from forward.
    """
    _check_pair("all_gather_matmul", "x_shard", x_shard, w, "[T_r, K]", "[K, N]")
    check_schedule(schedule, num_chunks)
    check_transport(transport)
    return _AllGatherMatmul.apply(x_shard, w, group, schedule, num_chunks,
                                  None if shard_sizes is None else tuple(int(s) for s in shard_sizes), transport)


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group=None, schedule: str = "ring",
                          num_chunks: int = 1, out_sizes: Optional[Sequence[int]] = None,
                          transport: str = "auto") -> torch.Tensor:
    """This rank's row block of ``sum over ranks r of x_r @ w_r``, as overlapped peer-to-peer steps.

    Args:
        x: ``[T, K_r]`` bf16/fp16/fp32, the same T on every rank.
        w: ``[K_r, N]`` same dtype and device, the same N on every rank.
        group, schedule, num_chunks, transport: as in :func:`all_gather_matmul`.
        out_sizes: rows of each rank's output block (the same list on every
            rank, summing to T); default :func:`even_split`: ``T // G`` each and
            one more on the first ``T % G`` ranks.

    Returns:
        ``[out_sizes[me], N]``: partials ``x_r[rows] @ w_r`` (input dtype) added
        in rank order 0..G-1 in fp32 and cast once, so bitwise reproducible and
        independent of the schedule. Each partial travels straight to the rank
        owning its rows (step d: to me+d), not as a relayed running sum; except
        with ``schedule="relay"``, where the running sum of fp32 products is
        relayed round the ring and added in the GEMMs' epilogues (``relay.py``:
        its own fixed order, equal to ``ref_matmul_reduce_scatter_relay``).
    Backward: ``d x`` is an :func:`all_gather_matmul` of ``d out`` with ``w^T``;
    ``d w = x^T @ d out_full`` with the ``d out`` gathered on the way.
    """
    _check_pair("matmul_reduce_scatter", "x", x, w, "[T, K_r]", "[K_r, N]")
    check_schedule(schedule, num_chunks)
    check_transport(transport)
    if schedule == "arrival":  # its backward is an arrival all-gather of d out with w^T
        if transport == "p2p":
            raise ValueError("matmul_reduce_scatter: commfuse schedule 'arrival' (its backward's all-gather) moves "
                             "blocks by the copy engines; transport 'p2p' does not apply (use 'auto' or "
                             "'copy_engine')")
        check_arrival("matmul_reduce_scatter", x, w.t(), _resolve_group(group)[0])
    return _MatmulReduceScatter.apply(x, w, group, schedule, num_chunks,
                                      None if out_sizes is None else tuple(int(s) for s in out_sizes), transport)
