"""CommFuse's copy-engine transport: blocks pushed into peers' symmetric buffers.

The ``p2p`` transport (``ops.py``) moves blocks with NCCL send/recv, whose
kernels take SMs from the GEMMs they should hide behind. Here a block travels
as a device-to-device copy into the peer's symmetric buffer (torch symmetric
memory over NVLink), which the copy engines execute without SMs, and a
stream-ordered signal tells the peer that the block is there:

* all-gather + GEMM: this rank copies its block to ``me+1, me+2, ...``
  in turn, signalling each peer after its copy. The compute stream multiplies
  the local block first, then blocks ``me-1, me-2, ...`` in arrival order,
  each behind the wait for its signal. One GEMM per block, the same call as
  the reference, so the result stays bitwise equal to it.
* GEMM + reduce-scatter: the partial of rank ``me+1``'s rows first, copied to
  it while the partial of ``me+2``'s rows is computed, and so on; this rank's
  own partial last, so the last copy hides behind it. Partials are then added
  in rank order into fp32 and cast once, the same operations as the ``p2p``
  transport, so both transports give the same bits. With ``num_chunks`` > 1 the
  own partial is one GEMM per row chunk and each chunk is summed on a third
  stream while the next chunk's GEMM runs (the bits of the reference with
  ``own_chunks``; see ``ops.py``).
* ``local_first``: all-gather pushes this rank's block to every peer while
  the local block is multiplied, then multiplies each run of received rows
  (the blocks after this rank's, then those before) as one GEMM once its
  blocks' signals are in; reduce-scatter computes one GEMM per run of the
  peers' rows, copies each run's partials to their owners as soon as it is
  done, and computes its own partial last.

Buffers: one symmetric workspace per (group, device) in two halves, grown
collectively when a call needs more (every rank asks for the same size:
all-gather needs ``T * K``, reduce-scatter ``G * max(out_sizes) * N`` elements
per half). Calls on a workspace use its halves in turn, so no call waits for
its peers before copying into their buffers: a peer last read the half this
call writes two calls ago, and it had finished that call before it signalled
this rank in the previous one (its copies of a call start behind everything
its compute stream holds, every call waits for every peer's signal, and this
rank's copies start behind its own compute stream, so behind that wait).
Signals use channel 1 of the workspace's signal pad; a signal is set only
once the peer has taken the previous one (torch's ``put_signal`` waits for
the slot to be free), so consecutive calls never lose one.
"""
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..symm import rendezvous
from .common import ordered_sum, side_stream

_DATA_CHANNEL = 1
_ALIGN_ELEMS = 128
_HALF_ALIGN_BYTES = 256

_workspaces: Dict[Tuple[str, int], "_Workspace"] = {}
_unavailable: Dict[Tuple[str, int], str] = {}


class _Workspace:
    """A symmetric byte buffer of one group on one device in two halves of ``half_bytes``, with
    views of every peer's copy."""

    def __init__(self, group, device: torch.device, half_bytes: int):
        from torch.distributed import _symmetric_memory as symm_mem
        self.half_bytes = half_bytes
        self.buf = symm_mem.empty(2 * half_bytes, dtype=torch.uint8, device=device)
        self.handle = rendezvous(self.buf, group)
        self.calls = 0
        self._views: Dict[tuple, torch.Tensor] = {}

    def next_half(self) -> int:
        """The byte offset of the half this call uses (the halves take turns, call by call)."""
        offset = (self.calls % 2) * self.half_bytes
        self.calls += 1
        return offset

    def view(self, peer: int, shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """``peer``'s buffer from byte ``offset`` on (a half's start) as ``shape`` of ``dtype``."""
        key = (peer, tuple(shape), dtype, offset)
        v = self._views.get(key)
        if v is None:
            v = self.handle.get_buffer(peer, list(shape), dtype, offset // _element_bytes(dtype))
            self._views[key] = v
        return v


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _group_key(group, device: torch.device) -> Tuple[str, int]:
    return (group.group_name, device.index)


def available(group, device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) for the copy-engine transport on ``group`` and ``device``."""
    if device.type != "cuda":
        return False, f"needs CUDA tensors (got {device.type})"
    if dist.get_backend(group) != "nccl":
        return False, f"needs an NCCL group (got {dist.get_backend(group)})"
    reason = _unavailable.get(_group_key(group, device))
    if reason:
        return False, reason
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return False, f"torch symmetric memory cannot be imported ({e})"
    return True, "symmetric memory on CUDA"


def _workspace(group, device: torch.device, nbytes: int) -> _Workspace:
    """The group's workspace with halves of at least ``nbytes``, grown (collectively: every rank
    asks for the same size) when too small."""
    key = _group_key(group, device)
    ws = _workspaces.get(key)
    nbytes = -(-nbytes // _HALF_ALIGN_BYTES) * _HALF_ALIGN_BYTES
    if ws is None or ws.half_bytes < nbytes:
        if ws is not None:
            torch.cuda.current_stream(device).synchronize()
        size = max(nbytes, 2 * ws.half_bytes if ws is not None else 0)
        try:
            ws = _Workspace(group, device, size)
        except RuntimeError as e:
            _unavailable[key] = f"symmetric memory rendezvous failed: {e}"
            raise
        _workspaces[key] = ws
    return ws


def _round_up(n: int) -> int:
    return (n + _ALIGN_ELEMS - 1) // _ALIGN_ELEMS * _ALIGN_ELEMS


def all_gather_matmul_ce(x_shard: torch.Tensor, w: torch.Tensor, group, me: int, shard_sizes: List[int],
                         offs: List[int], order: Sequence[int], keep_full: bool, mm_into, timeline=None,
                         runs=None):
    """``(y [T, N], x_full [T, K] or None)``. ``order``: the offsets d of the peers, in the order this
    rank sends to ``me+d`` (and multiplies the block of ``me-d``); ``mm_into(a, b, out)`` is the
    reference's block GEMM. ``runs`` (``local_first``): ``(start, rows, blocks)`` groups of the
    peers' rows, each multiplied as one GEMM once all its blocks are there."""
    G = len(shard_sizes)
    T, K, N = sum(shard_sizes), x_shard.shape[1], w.shape[1]
    device, dtype = x_shard.device, x_shard.dtype
    out = torch.empty(T, N, dtype=torch.result_type(x_shard, w), device=device)
    ws = _workspace(group, device, T * K * _element_bytes(dtype))
    half = ws.next_half()
    mine = ws.view(me, (T, K), dtype, half)
    compute = torch.cuda.current_stream(device)
    comm = side_stream(device, compute)
    comm.wait_stream(compute)  # before the local GEMM is queued: the copies do not wait for it

    def rows(t, b):
        return t[offs[b]:offs[b] + shard_sizes[b]]

    def gemm(step, a, b):
        t0 = timeline.mark(compute) if timeline else None
        mm_into(a, w, rows(out, b))
        if timeline:
            timeline.entries.append(("gemm", step, t0, timeline.mark(compute)))

    gemm(0, x_shard, me)  # queued first, so the GPU starts on it while the copies are being issued
    with torch.cuda.stream(comm):
        for i, d in enumerate(order):
            p = (me + d) % G
            t0 = timeline.mark(comm) if timeline else None
            if shard_sizes[me]:
                rows(ws.view(p, (T, K), dtype, half), me).copy_(x_shard)
            ws.handle.put_signal(p, _DATA_CHANNEL)
            if timeline:
                timeline.entries.append(("transfer", i, t0, timeline.mark(comm)))
    x_shard.record_stream(comm)
    if runs is not None:
        for i, (r0, n, blocks) in enumerate(runs):
            for src in blocks:
                ws.handle.wait_signal(src, _DATA_CHANNEL)
            t0 = timeline.mark(compute) if timeline else None
            mm_into(mine[r0:r0 + n], w, out[r0:r0 + n])
            if timeline:
                timeline.entries.append(("gemm", i + 1, t0, timeline.mark(compute)))
        # Every peer signals, empty blocks included, and each signal is waited for once.
        in_runs = {b for _, _, blocks in runs for b in blocks}
        for src in range(G):
            if src != me and src not in in_runs:
                ws.handle.wait_signal(src, _DATA_CHANNEL)
    else:
        for i, d in enumerate(order):
            src = (me - d) % G
            ws.handle.wait_signal(src, _DATA_CHANNEL)
            gemm(i + 1, rows(mine, src), src)
    x_full = gathered_rows(mine, x_shard, offs[me]) if keep_full else None
    compute.wait_stream(comm)
    return out, x_full


def gathered_rows(mine: torch.Tensor, x_shard: torch.Tensor, row0: int) -> torch.Tensor:
    """A copy of all gathered rows (``mine``: this rank's workspace view ``[T, K]``, where the peers'
    blocks landed; this rank's own block, rows ``row0`` on, from ``x_shard``), kept for the weight
    gradient: the next call may overwrite the workspace. Queued on the current stream, after the
    waits for the peers' blocks."""
    x_full = torch.empty_like(mine)
    a, b = row0, row0 + x_shard.shape[0]
    x_full[:a].copy_(mine[:a])
    x_full[a:b].copy_(x_shard)
    x_full[b:].copy_(mine[b:])
    return x_full


def matmul_reduce_scatter_ce(x: torch.Tensor, w: torch.Tensor, group, me: int, out_sizes: List[int],
                             offs: List[int], order: Sequence[int], timeline=None, runs=None,
                             tail_chunks: int = 1) -> torch.Tensor:
    """``out [out_sizes[me], N]``: partials added in rank order 0..G-1 in fp32, cast once. ``order``:
    the offsets d of the peers in the order their partials (rows of ``me+d``) are computed and sent.
    ``runs`` (``local_first``): the peers' partials come from one GEMM per ``(start, rows, blocks)``
    run instead, each run's partials sent as soon as it is computed. ``tail_chunks`` > 1: this
    rank's own partial is computed in that many row chunks (``_chunks``), and each chunk's rows are
    summed on a third stream while the next chunk's GEMM runs, so only the last chunk's sum
    follows the last GEMM (see :func:`_own_partial_and_sum`)."""
    G = len(out_sizes)
    N = w.shape[1]
    device = x.device
    dtype = torch.result_type(x, w)
    t_max = _round_up(max(out_sizes))
    ws = _workspace(group, device, G * t_max * N * _element_bytes(dtype))
    half = ws.next_half()
    mine = ws.view(me, (G, t_max, N), dtype, half)
    compute = torch.cuda.current_stream(device)
    comm = side_stream(device, compute)
    comm.wait_stream(compute)

    def partial(step, j):
        t0 = timeline.mark(compute) if timeline else None
        p = x[offs[j]:offs[j] + out_sizes[j]] @ w
        if timeline:
            timeline.entries.append(("gemm", step, t0, timeline.mark(compute)))
        return p

    sent = []
    if runs is not None:
        _send_runs(x, w, runs, out_sizes, offs, me, G, t_max, N, dtype, ws, half, compute, comm, timeline, sent)
        order = []
    for i, d in enumerate(order):
        dst = (me + d) % G
        p = partial(i, dst)
        ready = torch.cuda.Event()
        ready.record(compute)
        comm.wait_event(ready)
        with torch.cuda.stream(comm):
            t0 = timeline.mark(comm) if timeline else None
            if out_sizes[dst]:
                ws.view(dst, (G, t_max, N), dtype, half)[me, :out_sizes[dst]].copy_(p)
            ws.handle.put_signal(dst, _DATA_CHANNEL)
            if timeline:
                timeline.entries.append(("transfer", i, t0, timeline.mark(comm)))
        p.record_stream(comm)
        sent.append(p)
    step = len(runs) if runs is not None else len(order)
    t_me = out_sizes[me]
    if tail_chunks > 1 and t_me > 1:
        out = _own_partial_and_sum(x[offs[me]:offs[me] + t_me], w, ws, me, G, mine, tail_chunks, step,
                                   compute, timeline)
    else:
        own = partial(step, me)
        _wait_for_peers(ws, me, G)
        parts = [own if src == me else mine[src, :t_me] for src in range(G)]
        t0 = timeline.mark(compute) if timeline else None
        out = ordered_sum(parts)
        if timeline:
            timeline.entries.append(("reduce", 0, t0, timeline.mark(compute)))
    compute.wait_stream(comm)
    del sent
    return out


def _wait_for_peers(ws, me: int, G: int) -> None:
    """On the current stream, wait for every peer's data signal (each peer's partial is in)."""
    for src in range(G):
        if src != me:
            ws.handle.wait_signal(src, _DATA_CHANNEL)


def _own_partial_and_sum(x_me, w, ws, me, G, mine, tail_chunks, step, compute, timeline):
    """This rank's partial in ``tail_chunks`` row chunks on the compute stream; each chunk's rows
    summed (rank order, fp32, cast once: :func:`ordered_sum`) on a third stream as soon as its GEMM
    is done, behind the waits for every peer's signal, while the next chunk's GEMM runs. One GEMM
    per chunk: its bits are those of ``ref_matmul_reduce_scatter(..., own_chunks=tail_chunks)``."""
    from .common import _chunks
    t_me, N = x_me.shape[0], w.shape[1]
    red = side_stream(x_me.device, compute, "sum")
    out = torch.empty(t_me, N, dtype=mine.dtype, device=x_me.device)  # before red first waits on compute
    red.wait_stream(compute)
    for c, (c0, cn) in enumerate(_chunks(t_me, tail_chunks)):
        t0 = timeline.mark(compute) if timeline else None
        p = x_me[c0:c0 + cn] @ w
        if timeline:
            timeline.entries.append(("gemm", step + c, t0, timeline.mark(compute)))
        ready = torch.cuda.Event()
        ready.record(compute)
        red.wait_event(ready)
        with torch.cuda.stream(red):
            if c == 0:  # the peers' partials are in (queued behind the first chunk, off the GEMM's SMs)
                _wait_for_peers(ws, me, G)
            t0 = timeline.mark(red) if timeline else None
            out[c0:c0 + cn] = ordered_sum([p if src == me else mine[src, c0:c0 + cn] for src in range(G)])
            if timeline:
                timeline.entries.append(("reduce", c, t0, timeline.mark(red)))
        p.record_stream(red)
    compute.wait_stream(red)
    return out


def _send_runs(x, w, runs, out_sizes, offs, me, G, t_max, N, dtype, ws, half, compute, comm, timeline, sent):
    """``local_first`` reduce-scatter: one GEMM per run of the peers' rows, each followed (on the
    side stream) by the copies of its partials into their owners' slots and the owners' signals.
    Peers with no rows get their signal after the last run."""
    signalled = set()
    for i, (r0, n, blocks) in enumerate(runs):
        t0 = timeline.mark(compute) if timeline else None
        p = x[r0:r0 + n] @ w
        if timeline:
            timeline.entries.append(("gemm", i, t0, timeline.mark(compute)))
        ready = torch.cuda.Event()
        ready.record(compute)
        comm.wait_event(ready)
        with torch.cuda.stream(comm):
            t0 = timeline.mark(comm) if timeline else None
            for j in blocks:
                ws.view(j, (G, t_max, N), dtype, half)[me, :out_sizes[j]].copy_(
                    p[offs[j] - r0:offs[j] - r0 + out_sizes[j]])
                ws.handle.put_signal(j, _DATA_CHANNEL)
                signalled.add(j)
            if timeline:
                timeline.entries.append(("transfer", i, t0, timeline.mark(comm)))
        p.record_stream(comm)
        sent.append(p)
    with torch.cuda.stream(comm):
        for j in range(G):
            if j != me and j not in signalled:
                ws.handle.put_signal(j, _DATA_CHANNEL)
