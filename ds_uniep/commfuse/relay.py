"""CommFuse's ``relay`` reduce-scatter: the running sum travels, and each GEMM adds it in its epilogue.

The other schedules send every partial straight to the rank owning its rows and add the G partials
there in rank order after the last GEMM. That closing sum reads G partials and writes the output
(at TP4, 8192 tokens, hidden 8192: 168 MB, about 12% of the collective's time) and no schedule can
start it before the last GEMM ends. Here block ``j``'s sum is built up along the ring instead:

* rank ``j+1`` computes its partial of block ``j`` (fp32 output) and passes it to ``j+2``;
* rank ``j+2`` computes its partial *with that sum as the GEMM's C operand*
  (``addmm(C, A, B)`` with an fp32 output: one fp32 add per element, in the GEMM's epilogue) and
  passes the result on, and so on round the ring;
* the owner ``j`` adds its own partial last, in the same way, and casts once.

So at step ``s`` rank ``me`` works on block ``me - s - 1`` (its own block at the last step), and
nothing is left after the last GEMM but the cast of its last chunk. Each step's GEMM is cut into
``num_chunks`` row chunks, and each chunk is passed on as soon as it is done, so the next rank's
chunk waits for one chunk's transfer, not for the whole block's (with one chunk every step waits
for a whole block). The running sums travel in fp32, twice the bytes of the other schedules'
partials, all of it behind GEMMs. Measured on 4 H100s it is slower than ``ring`` (README,
"The relay reduce-scatter"): cuBLAS's ``addmm`` with an fp32 C costs a step's GEMM about 0.05 ms
more than the plain GEMM, more than the closing sum it saves. Opt-in.

Exactness: block ``j`` is ``cast((((P_{j+1} + P_{j+2}) + ...) + P_{j+G-1}) + P_j)`` per chunk, where
``P_r`` is rank r's fp32 GEMM product and each ``+`` is the fp32 add of a GEMM epilogue: a fixed
order for every block (the ring order starting after the owner, the owner last), the same on every
run, equal to :func:`ds_uniep.commfuse.reference.ref_matmul_reduce_scatter_relay`, which makes the
same GEMM calls in the same order on one process. It is not the rank-order sum of the other
schedules (whose partials are rounded to the input dtype before they are added): the two agree
within that rounding. The all-gather has no relay form; with this schedule it runs ``ring``.

Transports: the copy engine (each chunk copied into ``me+1``'s half of the symmetric workspace,
then a signal on channel ``2 + chunk``) or NCCL/gloo send/recv (``p2p``). Every step signals once
per chunk, also for a block with no rows, so each call waits for its predecessor, which waited for
its own, round the ring: a rank's copies of a call start only after its successor finished the call
before (see ``copy_engine.py`` for why the workspace's halves need that).
"""
from typing import List, Optional, Sequence, Tuple

import torch

from .common import _Exchange, _Gemm, _chunks, side_stream, sum_dtype

_CHANNEL0 = 2  # signal channels 2 .. 2 + num_chunks - 1 (channel 1 is the other schedules')
MAX_CHUNKS = 16  # the config's bound on num_chunks; the p2p tags leave room for 64


def relay_sources(G: int, j: int) -> List[int]:
    """The ranks whose partials make block ``j``, in the order they are added: ``j+1, ..., j+G-1, j``."""
    return [(j + i) % G for i in range(1, G + 1)]


def acc_mm(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` (``+ c``) with the product accumulated and returned in :func:`sum_dtype` (fp32 for
    bf16/fp16/fp32, fp64 for fp64): on CUDA one GEMM whose epilogue adds ``c`` (``addmm`` with an
    fp32 output for 16-bit inputs); on CPU, 16-bit inputs are widened first."""
    acc = sum_dtype(a.dtype)
    if a.dtype != acc and not a.is_cuda:
        a, b = a.to(acc), b.to(acc)
    if a.dtype == acc:
        return torch.mm(a, b) if c is None else torch.addmm(c, a, b)
    return torch.mm(a, b, out_dtype=acc) if c is None else torch.addmm(c, a, b, out_dtype=acc)


def relay_chunks(rows: int, num_chunks: int) -> List[Tuple[int, int]]:
    """A block's ``(start, rows)`` chunks; a block with no rows has one empty chunk (it still signals)."""
    return _chunks(rows, num_chunks) or [(0, 0)]


class _CopyEngineLinks:
    """Chunks into ``me+1``'s half of the symmetric workspace by the copy engines, a signal after each."""

    def __init__(self, x, group, me, G, t_max, N, acc_dtype, timeline):
        from .copy_engine import _element_bytes, _workspace
        device = x.device
        ws = _workspace(group, device, max(G - 1, 1) * t_max * N * _element_bytes(acc_dtype))
        half = ws.next_half()
        self.ws, self.me, self.G, self.tl = ws, me, G, timeline
        self.mine = ws.view(me, (max(G - 1, 1), t_max, N), acc_dtype, half)
        self.next = ws.view((me + 1) % G, (max(G - 1, 1), t_max, N), acc_dtype, half)
        self.compute = torch.cuda.current_stream(device)
        self.comm = side_stream(device, self.compute)
        self.comm.wait_stream(self.compute)
        self.sent = []

    def send(self, s: int, k: int, c0: int, t: Optional[torch.Tensor]) -> None:
        if t is None:  # no chunk k in this step's block (only a receive, which this transport does not post)
            return
        ready = torch.cuda.Event()
        ready.record(self.compute)
        self.comm.wait_event(ready)
        with torch.cuda.stream(self.comm):
            t0 = self.tl.mark(self.comm) if self.tl else None
            if t.shape[0]:
                self.next[s, c0:c0 + t.shape[0]].copy_(t)
            self.ws.handle.put_signal((self.me + 1) % self.G, _CHANNEL0 + k)
            if self.tl:
                self.tl.entries.append(("transfer", s, t0, self.tl.mark(self.comm)))
        t.record_stream(self.comm)
        self.sent.append(t)

    def recv(self, s: int, k: int, c0: int, n: int) -> torch.Tensor:
        """Step ``s``'s running sum of chunk ``k`` (sent at the predecessor's step ``s - 1``), once in."""
        self.ws.handle.wait_signal((self.me - 1) % self.G, _CHANNEL0 + k)
        return self.mine[s - 1, c0:c0 + n]

    def finish(self) -> None:
        self.compute.wait_stream(self.comm)
        self.sent.clear()


class _P2PLinks:
    """NCCL/gloo send/recv: after each chunk, one exchange sends it to ``me+1`` and receives the
    matching chunk of the next step from ``me-1``."""

    def __init__(self, x, group, me, G, ranks, acc_dtype, N, sizes, num_chunks, timeline):
        self.ex = _Exchange(x.device, group, timeline)
        self.me, self.G, self.ranks = me, G, ranks
        # Receive buffers exist before the side stream first waits on the compute stream.
        self.bufs = {}
        for s in range(1, G):
            b = (me - s - 1) % G
            for k, (_, n) in enumerate(relay_chunks(sizes[b], num_chunks)):
                self.bufs[s, k] = torch.empty(n, N, dtype=acc_dtype, device=x.device)
        self.tokens = {}
        self.sent = []

    def send(self, s: int, k: int, c0: int, t: Optional[torch.Tensor]) -> None:
        """Chunk ``k`` of step ``s`` to ``me+1`` (None: nothing to send under this index), in one
        exchange with the receive of chunk ``k`` of step ``s + 1`` from ``me-1`` where that exists."""
        tag = s * 64 + k
        sends = [] if t is None else [(t, self.ranks[(self.me + 1) % self.G], tag)]
        buf = self.bufs.get((s + 1, k))
        recvs = [] if buf is None else [(buf, self.ranks[(self.me - 1) % self.G], tag)]
        self.tokens[s + 1, k] = self.ex.start(s, sends, recvs, after=self.ex.compute_ready())
        if t is not None:
            self.sent.append(t)

    def recv(self, s: int, k: int, c0: int, n: int) -> torch.Tensor:
        self.ex.wait(self.tokens.pop((s, k)))
        return self.bufs[s, k]

    def finish(self) -> None:
        # Sends whose exchange carried no receive of a later step (the next block has fewer
        # chunks) were not waited for yet; their buffers must outlive them.
        for token in self.tokens.values():
            self.ex.wait(token)
        self.tokens.clear()
        self.ex.finish()
        self.sent.clear()


def matmul_reduce_scatter_relay(x: torch.Tensor, w: torch.Tensor, group, me: int, G: int, ranks: Sequence[int],
                                out_sizes: Sequence[int], offs: Sequence[int], num_chunks: int,
                                transport: str, timeline=None) -> torch.Tensor:
    """``out [out_sizes[me], N]``, block ``me`` summed along the ring (module doc). ``transport``:
    ``"copy_engine"`` or ``"p2p"`` (resolved by the caller)."""
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"matmul_reduce_scatter: schedule 'relay' takes at most {MAX_CHUNKS} chunks per step "
                         f"(one signal channel each), got num_chunks={num_chunks}")
    dtype = torch.result_type(x, w)
    acc_dtype = sum_dtype(dtype)
    N = w.shape[1]
    t_me = out_sizes[me]
    out = torch.empty(t_me, N, dtype=dtype, device=x.device)
    if G == 1:
        links = None
    elif transport == "copy_engine":
        from .copy_engine import _round_up
        links = _CopyEngineLinks(x, group, me, G, _round_up(max(out_sizes)), N, acc_dtype, timeline)
    else:
        links = _P2PLinks(x, group, me, G, ranks, acc_dtype, N, out_sizes, num_chunks, timeline)
    compute = torch.cuda.current_stream(x.device) if x.is_cuda else None
    gemm = _Gemm(timeline, compute)
    cast = None
    if compute is not None and acc_dtype != dtype:
        cast = side_stream(x.device, compute, "sum")
        cast.wait_stream(compute)
    for s in range(G):
        b = (me - s - 1) % G
        rows = x[offs[b]:offs[b] + out_sizes[b]]
        for k, (c0, n) in enumerate(relay_chunks(out_sizes[b], num_chunks)):
            c = links.recv(s, k, c0, n) if s > 0 else None
            if n == 0:
                acc = rows.new_empty(0, N, dtype=acc_dtype)
            else:
                acc = gemm("gemm", s, lambda c=c, c0=c0, n=n: acc_mm(rows[c0:c0 + n], w, c))
            if s < G - 1:
                links.send(s, k, c0, acc)
            elif n and cast is None:
                out[c0:c0 + n].copy_(acc)
            elif n:
                # The last step's casts run beside the next chunk's GEMM; only the last one follows it.
                cast.wait_stream(compute)
                with torch.cuda.stream(cast):
                    t0 = timeline.mark(cast) if timeline else None
                    out[c0:c0 + n].copy_(acc)
                    if timeline:
                        timeline.entries.append(("reduce", k, t0, timeline.mark(cast)))
                acc.record_stream(cast)
        if s < G - 1:
            # Chunk indices the next step's block has beyond this one's: receives only.
            have = len(relay_chunks(out_sizes[b], num_chunks))
            for k in range(have, len(relay_chunks(out_sizes[(b - 1) % G], num_chunks))):
                links.send(s, k, 0, None)
    if cast is not None:
        compute.wait_stream(cast)
    if links is not None:
        links.finish()
    return out
