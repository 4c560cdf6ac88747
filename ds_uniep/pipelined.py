"""The megakernel backend's ``pipelined`` schedule (``"uniep": {"overlap": {"schedule": "pipelined"}}``).

The sequential schedule runs dispatch, all expert GEMMs, then combine. Here a rank's local
experts run in ``num_chunks`` chunks (consecutive experts, cut where the rows split most evenly),
and each chunk's rows start back towards their sources as soon as the chunk's GEMMs are done,
copied by the copy engines (no SMs taken from the GEMMs) on a side stream while the next chunk
computes. In the backward the same happens with the gradient of dispatch: each chunk's input
gradient is copied to its sources as soon as that chunk's backward GEMMs have produced it, while
the other chunks' backward runs.

Two ways to copy: by the copy engines (``cudaMemcpyAsync`` per segment, one stream per
destination rank; the default, as torch's grouped GEMM takes every SM), or, with ``copy_blocks``
set, by SM stores from one kernel of ``copy_blocks`` blocks per chunk, for a caller whose GEMMs
leave that many SMs free (ds_uniep's grouped GEMM with ``sm_count``). Same bytes, same places.

Where the rows land. The rows of expert e from source s are consecutive in the expert rank's
layout (``layout.py``: an expert's rows by source rank, then token), so each (expert, source)
segment is one copy. Source s keeps them in its combine buffer in expert order: its pairs of
expert e from row ``prefix_s(e)`` on (its pairs of all lower experts before), in the layout's token
order. A pair (t, j) routed to expert e is therefore found at ``dest_row[t, j] + mirror_off[e]``
with ``mirror_off[e] = prefix_s(e) - (first layout row of s's pairs of e on e's rank)``, and the
source sums its k rows in slot order in fp32 exactly as the sequential combine does, so the bits
are the same under every schedule and chunk count. A chunk's GEMMs are the same GEMMs on fewer
groups: a row's result, and an expert's weight gradient (a sum over that expert's rows only), do
not depend on which other experts share the call.

Needs the exact-R dispatch (the host reads every rank's counts per expert with R) and experts
that run as grouped GEMMs; the layer falls back to the sequential schedule, saying why, where
they do not.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

_PHASE_COMBINE = 2


def source_layout(counts: Tensor, rank: int) -> Tuple[Tensor, Tensor]:
    """``(prefix [G, E] int64, mirror_off [E] int32)`` from every rank's kept pairs per expert
    (``[G, E]``, on any device, no host sync): source s keeps its pairs of expert e in its combine
    buffer from row ``prefix[s, e]`` on (its pairs of every lower expert before), in the layout's
    token order, so ``rank``, as a source, finds pair (t, j) of expert e at row
    ``dest_row[t, j] + mirror_off[e]``: its pairs of e start on e's rank at the expert's first row
    plus the pairs of lower ranks."""
    counts = counts.long()
    G, E = counts.shape
    prefix = counts.cumsum(1) - counts
    totals = counts.sum(0).view(G, E // G)
    first_of_expert = (totals.cumsum(1) - totals).reshape(E)
    first_of_mine = first_of_expert + counts[:rank].sum(0)
    return prefix, (prefix[rank] - first_of_mine).to(torch.int32)


class MirrorPlan:
    """Where every (local expert, source) segment of one dispatch goes, from every rank's counts.

    Args:
        counts: ``[G, E]`` every rank's kept pairs per expert (layout.py's ``counts_all``).
        rank: this rank; num_chunks: chunks asked for (at most L, and no chunk without rows
            unless there are no rows at all).
        row_bytes: bytes of one row; bases: every rank's combine buffer address (``G``).
    """

    def __init__(self, counts: np.ndarray, rank: int, num_chunks: int, row_bytes: int, bases: Sequence[int]):
        counts = np.asarray(counts, dtype=np.int64)
        G, E = counts.shape
        L = E // G
        me = slice(rank * L, (rank + 1) * L)
        mine = counts[:, me]  # [G, L] rows of local expert l from source s
        per_expert = mine.sum(0)
        expert_start = np.cumsum(per_expert) - per_expert
        seg_start = expert_start[None, :] + np.cumsum(mine, 0) - mine  # [G, L] first row of (s, l)
        prefix, mirror_off = source_layout(torch.from_numpy(counts), rank)
        prefix = prefix.numpy()  # [G, E] where source s keeps expert e's rows
        self.mirror_off = mirror_off.numpy()
        self.rows = int(per_expert.sum())
        self.row_bytes = row_bytes
        self.chunks = _chunks(per_expert, num_chunks)
        #: each chunk's row ends per expert (grouped GEMM offsets), all chunks concatenated, int32
        self.offs = np.concatenate([np.cumsum(per_expert[a:b]) for a, b, _, _ in self.chunks]).astype(np.int32)
        # per chunk: (row in the chunk, destination address, bytes, destination rank) of each
        # non-empty segment
        self.segments: List[np.ndarray] = []
        bases = np.asarray(list(bases), dtype=np.int64)
        for a, b, r0, _ in self.chunks:
            l_idx, s_idx = np.nonzero(mine[:, a:b].T)  # expert, then source: the layout's order
            l_idx = l_idx + a
            n = mine[s_idx, l_idx]
            seg = np.stack([seg_start[s_idx, l_idx] - r0, bases[s_idx] + prefix[s_idx, rank * L + l_idx] * row_bytes,
                            n * row_bytes, s_idx], axis=1) if len(n) else np.zeros((0, 4), dtype=np.int64)
            self.segments.append(seg.astype(np.int64))

    def tables(self, chunk: int, rows: Tensor) -> Dict[int, Tensor]:
        """Per destination rank, ``[n, 3]`` CPU int64 (source address, destination address, bytes) of
        ``chunk``'s segments read from ``rows`` (the chunk's rows, consecutive)."""
        seg = self.segments[chunk]
        src = rows.data_ptr() + seg[:, 0] * self.row_bytes
        out = {}
        for dst in np.unique(seg[:, 3]):
            mask = seg[:, 3] == dst
            out[int(dst)] = torch.from_numpy(np.stack([src[mask], seg[mask, 1], seg[mask, 2]], axis=1))
        return out


def _chunks(per_expert: np.ndarray, num_chunks: int) -> List[Tuple[int, int, int, int]]:
    """``(first expert, end expert, first row, end row)`` of each chunk: consecutive local experts,
    cut where the cumulative rows pass ``i * R / num_chunks``; chunks without rows are merged into
    their neighbour (one chunk of all experts when there are no rows)."""
    L = len(per_expert)
    R = int(per_expert.sum())
    ends = np.cumsum(per_expert)
    if R == 0 or num_chunks <= 1 or L == 1:
        return [(0, L, 0, R)]
    cuts = sorted({int(np.searchsorted(ends, i * R / num_chunks, side="left")) + 1
                   for i in range(1, num_chunks)} - {0, L})
    bounds = [0] + [c for c in cuts if 0 < c < L] + [L]
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        r0 = int(ends[a - 1]) if a else 0
        r1 = int(ends[b - 1])
        if chunks and (r1 == r0 or chunks[-1][2] == chunks[-1][3]):  # this or the previous one has no rows
            pa, _, pr0, _ = chunks.pop()
            chunks.append((pa, b, pr0, r1))
        else:
            chunks.append((a, b, r0, r1))
    return chunks


class PipelinedCall:
    """One forward (and its backward) of a layer under the pipelined schedule."""

    def __init__(self, dispatcher, num_chunks: int, copy_blocks: int = 0):
        self.d = dispatcher
        self.num_chunks = num_chunks
        self.copy_blocks = copy_blocks  # 0: copy engines; else SM stores from this many blocks
        self.plan: Optional[MirrorPlan] = None
        self.mirror_off: Optional[Tensor] = None
        self.pushed = {False: set(), True: set()}
        self.barrier_done = False  # before the backward's first push into the peers' buffers

    def setup(self, counts: np.ndarray) -> None:
        d = self.d
        self.plan = MirrorPlan(counts, d.rank, self.num_chunks, d.bufs.comb_row_bytes, d.comb_bases())
        host = torch.from_numpy(np.concatenate([self.plan.mirror_off, self.plan.offs])).pin_memory()
        both = host.to(d.device, non_blocking=True)
        self.mirror_off = both[:len(self.plan.mirror_off)]
        self.offs, start = [], len(self.plan.mirror_off)
        for a, b, _, _ in self.plan.chunks:
            self.offs.append(both[start:start + b - a])
            start += b - a

    def push(self, chunk: int, rows: Tensor, backward: bool) -> None:
        """Copy ``chunk``'s rows (forward: expert outputs; backward: input gradients) into their
        sources' combine buffers on the copy stream, after the work queued so far on this stream."""
        d = self.d
        if backward and not self.barrier_done:
            d._barrier()
            self.barrier_done = True
        rows = rows.contiguous()
        ready = torch.cuda.Event()
        ready.record()
        tables = self.plan.tables(chunk, rows)
        dev = d.device.index
        if self.copy_blocks:  # one kernel stores every segment, on this rank's copy stream
            jobs = [(d.rank, lambda: d.ext.copy_segments_sm(torch.cat(list(tables.values())), self.copy_blocks,
                                                            dev))] if tables else []
        else:  # one stream per destination rank: copies to different ranks run on different copy engines
            jobs = [(dst, lambda t=table: d.ext.copy_segments(t, dev)) for dst, table in tables.items()]
        d.push_stats["sm_stores" if self.copy_blocks else "copy_engines"] += len(jobs)
        for dst, copy in jobs:
            comm = d.comm_stream(dst)
            comm.wait_event(ready)
            with torch.cuda.stream(comm):
                copy()
            rows.record_stream(comm)
        self.pushed[backward].add(chunk)

    def reduce(self, expert_idx: Tensor, dest_row: Tensor, weights: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        """Raise the combine signal after this rank's copies, wait for every rank's, and sum each
        token's k rows in slot order from this rank's combine buffer."""
        d = self.d
        e = d._next_epoch(_PHASE_COMBINE)
        comm = d.comm_stream(d.rank)
        compute = torch.cuda.current_stream(d.device)
        comm.wait_stream(compute)
        for dst in range(d.ep_size):  # every rank's copies, then the signal
            if dst != d.rank:
                comm.wait_stream(d.comm_stream(dst))
        with torch.cuda.stream(comm):
            d.ext.signal_raise(d.bufs.descriptor, _PHASE_COMBINE, e, d.device.index)
        # The summing kernel waits on the device for every rank's signal, this rank's included: it
        # starts only once this rank's own signal is up, or its waiting blocks could hold every SM
        # while the signal's kernel waits for one.
        compute.wait_stream(comm)
        out = torch.empty(expert_idx.shape[0], d.hidden_size, dtype=dtype, device=d.device)
        d.ext.combine_mirror(expert_idx, dest_row, self.mirror_off, weights, d.num_experts, out, d.bufs.descriptor, e,
                             *d._wait_args(), d.num_blocks)
        return out


class _DispatchChunksFn(torch.autograd.Function):
    """Dispatch, then the received rows as one view per chunk. Backward: the chunks' gradients
    were copied to their sources by :class:`_PushBackFn` as they came; sum them there."""

    @staticmethod
    def forward(ctx, x, expert_idx, call):
        d = call.d
        recv, local_counts, dest_row, recv_pair, num_recv, _ = d._dispatch_fwd(x, expert_idx, host_counts=True)
        call.setup(d._counts_host.numpy().copy())
        call.expert_idx, call.dest_row, call.recv_pair, call.num_recv = expert_idx, dest_row, recv_pair, num_recv
        ctx.call = call
        chunks = tuple(recv[r0:r1] for _, _, r0, r1 in call.plan.chunks)
        ctx.mark_non_differentiable(local_counts)
        return chunks + (local_counts, )

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        for c, (_, _, r0, r1) in enumerate(call.plan.chunks):
            if c not in call.pushed[True]:  # a chunk whose gradient did not pass its push node
                g = grads[c]
                if g is None:
                    g = torch.zeros(r1 - r0, call.d.hidden_size, dtype=call.d.dtype, device=call.d.device)
                call.push(c, g, backward=True)
        grad_x = call.reduce(call.expert_idx, call.dest_row, None, call.d.dtype)
        call.pushed[True].clear()  # a second backward (retain_graph) starts over, barrier included
        call.barrier_done = False
        return grad_x, None, None


class _PushBackFn(torch.autograd.Function):
    """Identity on a chunk's received rows; its backward copies the chunk's input gradient to the
    sources as soon as the chunk's backward GEMMs have produced it."""

    @staticmethod
    def forward(ctx, rows, call, chunk):
        ctx.call, ctx.chunk = call, chunk
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        ctx.call.push(ctx.chunk, grad, backward=True)
        return grad, None, None


class _CombineChunksFn(torch.autograd.Function):
    """Combine of chunks already pushed (forward); backward: grad_out dispatched to the experts'
    ranks, each chunk's grad_y and gate gradients formed there (``_combine_bwd``)."""

    @staticmethod
    def forward(ctx, gates, call, *ys):
        ctx.call = call
        ctx.save_for_backward(gates, *ys)
        call.d.combine_stats["pipelined"] += 1
        return call.reduce(call.expert_idx, call.dest_row, gates, ys[0].dtype)

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        gates, *ys = ctx.saved_tensors
        chunks = [(r0, y) for (_, _, r0, _), y in zip(call.plan.chunks, ys)]
        grad_ys, grad_gates = call.d._combine_bwd(grad_out.to(ys[0].dtype).contiguous(), chunks, gates,
                                                  call.expert_idx, call.dest_row, call.recv_pair, call.num_recv)
        call.barrier_done = True  # _combine_bwd began with one
        return (grad_gates, None) + tuple(grad_ys)


def partition(gemm: str, num_comm_sms: int, sms: int) -> Tuple[int, int]:
    """``(copy_blocks, gemm_sm_count)`` of the pipelined schedule on a GPU of ``sms`` SMs: with
    ds_uniep's grouped GEMM (``gemm == "uniep"``), SM-store copies from ``num_comm_sms`` blocks and
    the GEMMs on the SMs left (an even count: its kernels run 2-CTA clusters); with torch's GEMM,
    which takes every SM, or where fewer than 2 SMs would be left, ``(0, 0)``: copy engines, all SMs."""
    gemm_sms = (sms - num_comm_sms) // 2 * 2
    if gemm != "uniep" or num_comm_sms < 1 or gemm_sms < 2:
        return 0, 0
    return num_comm_sms, gemm_sms


def pipeline_partition(gemm: str, num_comm_sms: int, device: torch.device) -> Tuple[int, int]:
    """:func:`partition` for ``device``'s SM count."""
    if gemm != "uniep":
        return 0, 0
    return partition(gemm, num_comm_sms, torch.cuda.get_device_properties(device).multi_processor_count)


def run_pipelined(dispatcher, x: Tensor, expert_idx: Tensor, gates: Tensor, num_chunks: int,
                  run_chunk: Callable[[Tensor, Tensor, Tensor, int, int], Tensor], copy_blocks: int = 0) -> Tensor:
    """Dispatch ``x [T, M]`` by ``expert_idx [T, k]`` (-1 dropped), run the local experts chunk by
    chunk (``run_chunk(rows, counts, offs, first_expert, end_expert) -> outputs``; ``offs``: the
    chunk's row ends per expert, int32 on the device), each chunk's outputs
    copied back to their sources while the next computes, and combine with ``gates [T, k]``.
    ``copy_blocks``: copy by SM stores from this many blocks instead of the copy engines."""
    x, idx = dispatcher.checked_inputs(x, expert_idx)
    call = PipelinedCall(dispatcher, num_chunks, copy_blocks)
    *chunks, local_counts = _DispatchChunksFn.apply(x, idx, call)
    ys = []
    for c, ((a, b, _, _), rows) in enumerate(zip(call.plan.chunks, chunks)):
        y = run_chunk(_PushBackFn.apply(rows, call, c), local_counts[a:b], call.offs[c], a, b).contiguous()
        call.push(c, y.detach(), backward=False)
        ys.append(y)
    return _CombineChunksFn.apply(gates.float().contiguous(), call, *ys)
