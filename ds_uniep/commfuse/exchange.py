"""Peer-to-peer exchanges that hand each block to a GEMM as it is ready: the building blocks of
CommFuse's Ulysses attention (:mod:`.ulysses`) and sharded data-parallel linear (:mod:`.data_parallel`).

Letters: G ranks in the group, ``me`` this rank's index in it. Blocks are 2-D ``[rows, cols]``.

* :func:`compute_and_scatter` (an all-to-all whose blocks are computed here): the block for each
  peer is computed in the schedule's peer order and sent while the next one is computed; this
  rank's own block is computed last, so the last transfer hides behind it.
* :func:`exchange_blocks` (an all-to-all of blocks that exist already): yields this rank's own
  block, then each peer's as it lands, so the caller's GEMM on one block hides the next transfer.
* :func:`exchange_row_chunks` (the same all-to-all, consumed by rows): every block travels in
  ``num_chunks`` row chunks, and row chunk c is yielded once it has come from every peer.
* :func:`gather_blocks` (an all-gather): yields this rank's block, then each peer's as it lands
  (``ring``: relayed by neighbours; ``bidirectional_ring``: both ways round; ``local_first``: all
  in one step), and keeps the gathered rows.

Peer order (:func:`.common._peer_order`): ``ring`` and ``local_first`` serve peers me+1, me+2, ...;
``bidirectional_ring`` me+1, me-1, me+2, ... . ``arrival`` and ``relay`` name forms of the TP
operations that have no all-to-all counterpart; :func:`peer_schedule` rejects them.

Transports: ``p2p`` (NCCL/gloo send/recv, each transfer split into ``num_chunks`` messages,
through :class:`.common._Exchange`: side stream on CUDA) or ``copy_engine`` (CUDA: copies into the
peers' halves of the group's symmetric workspace and a signal per copy, the helpers of
:mod:`.copy_engine`). A copy-engine call copies what it keeps out of the workspace before it
returns and signals every peer at least once, so the workspace's two halves can take turns call
by call as in :mod:`.copy_engine` (a signal on the data channel is set only once the peer took
the previous one, so several per call are safe). Blocks yielded on the copy engine are views into
the workspace: use them before the next CommFuse call on the group.
"""
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .common import _chunks, _Exchange, _offsets, _peer_order, _resolve_group, check_schedule, side_stream
from .ops import _ag_plan, resolve_transport

_DATA_CHANNEL = 1


def peer_schedule(schedule: str, num_chunks: int, what: str) -> str:
    """``schedule`` checked for an exchange of ``what``: ring, bidirectional_ring or local_first."""
    check_schedule(schedule, num_chunks)
    if schedule in ("arrival", "relay"):
        raise ValueError(f"{what}: commfuse schedule {schedule!r} is a form of the tensor-parallel all-gather / "
                         "reduce-scatter with no all-to-all counterpart; use 'ring', 'bidirectional_ring' or "
                         "'local_first'")
    return schedule


class _CopyEngine:
    """One call's copies into the peers' halves of the group's symmetric workspace (slots of
    ``slot_elems`` elements, one per source rank) and the data-channel signals."""

    def __init__(self, group, me: int, G: int, slot_elems: int, dtype: torch.dtype, device: torch.device):
        from .copy_engine import _element_bytes, _round_up, _workspace
        self.slot = _round_up(max(slot_elems, 1))
        self.ws = _workspace(group, device, G * self.slot * _element_bytes(dtype))
        self.half = self.ws.next_half()
        self.me, self.G, self.dtype = me, G, dtype
        self.compute = torch.cuda.current_stream(device)
        self.comm = side_stream(device, self.compute)
        self.comm.wait_stream(self.compute)  # earlier reads of the half this call writes are done
        self.kept = []

    def _slot(self, peer: int, src: int, shape, start: int = 0) -> torch.Tensor:
        flat = self.ws.view(peer, (self.G * self.slot,), self.dtype, self.half)
        n = 1
        for s in shape:
            n *= s
        return flat[src * self.slot + start:src * self.slot + start + n].view(*shape)

    def send(self, peer: int, t: torch.Tensor, start: int = 0, after_compute: bool = True) -> None:
        """``t`` into ``peer``'s slot of this rank (from element ``start``), then a signal to ``peer``."""
        if after_compute:
            self.comm.wait_stream(self.compute)
        with torch.cuda.stream(self.comm):
            if t.numel():
                self._slot(peer, self.me, t.shape, start).copy_(t)
            self.ws.handle.put_signal(peer, _DATA_CHANNEL)
        t.record_stream(self.comm)
        self.kept.append(t)

    def recv(self, src: int, shape, start: int = 0) -> torch.Tensor:
        """``src``'s block in this rank's slot, behind the wait (on the compute stream) for its signal."""
        self.ws.handle.wait_signal(src, _DATA_CHANNEL)
        return self._slot(self.me, src, shape, start)

    def finish(self) -> None:
        self.compute.wait_stream(self.comm)
        self.kept.clear()


def _p2p_messages(t: torch.Tensor, peer: int, num_chunks: int, tag0: int = 0):
    return [(t[c0:c0 + cn], peer, tag0 + c) for c, (c0, cn) in enumerate(_chunks(t.shape[0], num_chunks))]


def compute_and_scatter(compute: Callable[[int], torch.Tensor], recv_rows: Sequence[int], cols: int,
                        dtype: torch.dtype, device: torch.device, group=None, schedule: str = "ring",
                        num_chunks: int = 1, transport: str = "p2p",
                        beside: Optional[Callable[[], None]] = None) -> List[torch.Tensor]:
    """All-to-all of computed blocks: ``compute(j)`` -> the contiguous ``[rows, cols]`` block for rank
    j, computed in peer order and sent while the next is computed; this rank's own last, then
    ``beside()`` (work with no part in the exchange, queued before the waits for the last blocks).
    Returns the block from every rank, in rank order: ``[recv_rows[r], cols]`` (own: ``compute(me)``)."""
    g, G, me, ranks = _resolve_group(group)
    order = _peer_order(G, schedule)
    beside = beside or (lambda: None)
    if G == 1:
        own = compute(me)
        beside()
        return [own]
    if resolve_transport(transport, g, G, device) == "copy_engine":
        ce = _CopyEngine(g, me, G, max(recv_rows) * cols, dtype, device)
        for d in order:
            j = (me + d) % G
            ce.send(j, compute(j))
        own = compute(me)
        beside()
        got = [own if src == me else ce.recv(src, (recv_rows[src], cols)).clone() for src in range(G)]
        ce.finish()
        return got
    bufs = {src: torch.empty(recv_rows[src], cols, dtype=dtype, device=device) for src in range(G) if src != me}
    ex = _Exchange(device, g, None)
    tokens, sent = [], []
    for d in order:
        j, src = (me + d) % G, (me - d) % G
        blk = compute(j)
        sent.append(blk)
        tokens.append(ex.start(0, _p2p_messages(blk, ranks[j], num_chunks),
                               _p2p_messages(bufs[src], ranks[src], num_chunks), after=ex.compute_ready()))
    own = compute(me)
    beside()
    for t in tokens:
        ex.wait(t)
    ex.finish()
    del sent
    return [own if src == me else bufs[src] for src in range(G)]


def exchange_blocks(blocks: Sequence[torch.Tensor], recv_rows: Sequence[int], cols: int, group=None,
                    schedule: str = "ring", num_chunks: int = 1,
                    transport: str = "p2p") -> Iterator[Tuple[int, torch.Tensor]]:
    """All-to-all of existing blocks: ``blocks[j]`` (contiguous ``[rows_j, *]``) goes to rank j. Yields
    ``(me, blocks[me])`` first, then ``(src, [recv_rows[src], cols])`` as each peer's block lands."""
    g, G, me, ranks = _resolve_group(group)
    ref = blocks[me]
    yield me, ref
    if G == 1:
        return
    order = _peer_order(G, schedule)
    if resolve_transport(transport, g, G, ref.device) == "copy_engine":
        ce = _CopyEngine(g, me, G, max(recv_rows) * cols, ref.dtype, ref.device)
        for d in order:
            ce.send((me + d) % G, blocks[(me + d) % G], after_compute=(d == order[0]))
        for d in order:
            src = (me - d) % G
            yield src, ce.recv(src, (recv_rows[src], cols))
        ce.finish()
        return
    bufs = {src: torch.empty(recv_rows[src], cols, dtype=ref.dtype, device=ref.device)
            for src in range(G) if src != me}
    ex = _Exchange(ref.device, g, None)
    tokens = []
    for d in order:
        j, src = (me + d) % G, (me - d) % G
        tokens.append((src, ex.start(0, _p2p_messages(blocks[j], ranks[j], num_chunks),
                                     _p2p_messages(bufs[src], ranks[src], num_chunks))))
    for src, t in tokens:
        ex.wait(t)
        yield src, bufs[src]
    ex.finish()


def exchange_row_chunks(blocks: Sequence[torch.Tensor], rows: int, cols: int, group=None, num_chunks: int = 1,
                        transport: str = "p2p") -> Iterator[Tuple[int, int, List[torch.Tensor]]]:
    """All-to-all of existing blocks consumed by rows: ``blocks[j]`` (contiguous ``[rows, *]``, the same
    ``rows`` for every j and on every rank) goes to rank j in ``num_chunks`` row chunks. Yields
    ``(r0, n, parts)`` per chunk once it is in from every rank: ``parts[src]`` is rows ``r0:r0+n`` of
    the block from src (``[n, cols]``; own: a slice of ``blocks[me]``)."""
    g, G, me, ranks = _resolve_group(group)
    ref = blocks[me]
    chunks = _chunks(rows, num_chunks)
    if G == 1:
        for r0, n in chunks:
            yield r0, n, [ref[r0:r0 + n]]
        return
    peers = [(me + d) % G for d in range(1, G)]
    if resolve_transport(transport, g, G, ref.device) == "copy_engine":
        ce = _CopyEngine(g, me, G, rows * cols, ref.dtype, ref.device)
        for c, (r0, n) in enumerate(chunks):
            for i, j in enumerate(peers):
                ce.send(j, blocks[j][r0:r0 + n], start=r0 * cols, after_compute=(c == 0 and i == 0))
        for r0, n in chunks:
            yield r0, n, [ref[r0:r0 + n] if src == me else ce.recv(src, (n, cols), r0 * cols)
                          for src in range(G)]
        ce.finish()
        return
    bufs = {src: torch.empty(rows, cols, dtype=ref.dtype, device=ref.device) for src in range(G) if src != me}
    ex = _Exchange(ref.device, g, None)
    tokens = []
    for c, (r0, n) in enumerate(chunks):
        sends = [(blocks[j][r0:r0 + n], ranks[j], c) for j in peers]
        recvs = [(bufs[j][r0:r0 + n], ranks[j], c) for j in peers]
        tokens.append(ex.start(c, sends, recvs))
    for (r0, n), t in zip(chunks, tokens):
        ex.wait(t)
        yield r0, n, [ref[r0:r0 + n] if src == me else bufs[src][r0:r0 + n] for src in range(G)]
    ex.finish()


def gather_blocks(shard: torch.Tensor, sizes: Sequence[int], group=None, schedule: str = "ring",
                  num_chunks: int = 1, transport: str = "p2p",
                  full: Optional[torch.Tensor] = None) -> Iterator[Tuple[int, torch.Tensor]]:
    """All-gather of row blocks (``shard``: this rank's contiguous ``[sizes[me], K]``) into ``full``
    (``[sum(sizes), K]``, allocated if None). Yields ``(me, shard)``, then ``(b, block b)`` as each
    block is in ``full``; when the generator is exhausted ``full`` holds every block."""
    g, G, me, ranks = _resolve_group(group)
    offs = _offsets(sizes)
    K = shard.shape[1]
    if full is None:
        full = shard.new_empty(sum(sizes), K)

    def rows(b):
        return full[offs[b]:offs[b] + sizes[b]]

    yield me, shard
    if G == 1:
        rows(me).copy_(shard)
        return
    if resolve_transport(transport, g, G, shard.device) == "copy_engine":
        ce = _CopyEngine(g, me, G, max(sizes) * K, shard.dtype, shard.device)
        for d in _peer_order(G, schedule):
            ce.send((me + d) % G, shard, after_compute=False)
        for d in _peer_order(G, schedule):
            src = (me - d) % G
            rows(src).copy_(ce.recv(src, (sizes[src], K)))
            yield src, rows(src)
        rows(me).copy_(shard)
        ce.finish()
        return
    ex = _Exchange(shard.device, g, None)

    def block(b):
        return shard if b == me else rows(b)

    if schedule == "local_first":
        sends, recvs = [], []
        for p in range(G):
            if p != me:
                sends += _p2p_messages(shard, ranks[p], num_chunks)
                recvs += _p2p_messages(rows(p), ranks[p], num_chunks)
        ex.wait(ex.start(0, sends, recvs))
        for d in range(1, G):
            yield (me + d) % G, rows((me + d) % G)
    else:
        prev = None
        for s, (gemm_blocks, transfers) in enumerate(_ag_plan(G, me, schedule)):
            ex.wait(prev)
            sends, recvs = [], []
            for send_b, to, recv_b, frm, tag_base in transfers:
                sends += _p2p_messages(block(send_b), ranks[to], num_chunks, tag_base * num_chunks)
                recvs += _p2p_messages(rows(recv_b), ranks[frm], num_chunks, tag_base * num_chunks)
            prev = ex.start(s, sends, recvs)
            for b in gemm_blocks:
                if b != me:
                    yield b, rows(b)
        ex.wait(prev)
    rows(me).copy_(shard)
    ex.finish()


def start_gather(shard: torch.Tensor, sizes: Sequence[int], group=None, num_chunks: int = 1,
                 transport: str = "p2p") -> Dict:
    """An all-gather started now and finished by :func:`finish_gather` (``p2p``: every block in one
    step, which the work queued in between hides; ``copy_engine``: the whole gather runs here,
    since the workspace serves one call at a time)."""
    g, G, me, ranks = _resolve_group(group)
    full = shard.new_empty(sum(sizes), shard.shape[1])
    if G > 1 and resolve_transport(transport, g, G, shard.device) == "copy_engine":
        for _ in gather_blocks(shard, sizes, g, "ring", num_chunks, "copy_engine", full):
            pass
        return {"full": full}
    offs = _offsets(sizes)
    full[offs[me]:offs[me] + sizes[me]].copy_(shard)
    if G == 1:
        return {"full": full}
    ex = _Exchange(shard.device, g, None)
    sends, recvs = [], []
    for p in range(G):
        if p != me:
            sends += _p2p_messages(shard, ranks[p], num_chunks)
            recvs += _p2p_messages(full[offs[p]:offs[p] + sizes[p]], ranks[p], num_chunks)
    return {"full": full, "ex": ex, "token": ex.start(0, sends, recvs), "shard": shard}


def finish_gather(state: Dict) -> torch.Tensor:
    """The gathered ``[sum(sizes), K]`` of :func:`start_gather`."""
    ex = state.get("ex")
    if ex is not None:
        ex.wait(state["token"])
        ex.finish()
    return state["full"]
