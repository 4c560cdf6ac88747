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
:func:`_remote_runs`): this rank's block, then the blocks after it as one GEMM,
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
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

SCHEDULES = ("ring", "bidirectional_ring", "local_first", "arrival", "relay")
TRANSPORTS = ("auto", "p2p", "copy_engine")

# cuBLAS, and on the CPU torch's BLAS, may pick a different kernel (with other
# bits) for operands and outputs less aligned than a fresh allocation; such
# operands are copied (and such outputs computed fresh, then copied in) so every
# block GEMM matches the reference GEMM on a freshly allocated block.
_CUDA_ALIGN = 256
_CPU_ALIGN = 64  # what torch's CPU allocator gives a fresh tensor

_comm_streams = {}


def side_stream(device: torch.device, compute, role: str = "transfer") -> "torch.cuda.Stream":
    """The ``role`` stream paired with the compute stream ``compute`` (one per pair and role,
    reused): ``"transfer"`` for transfers, ``"sum"`` for the copy engine's chunked closing sum."""
    key = (device.index, compute.cuda_stream, role)
    if key not in _comm_streams:
        _comm_streams[key] = torch.cuda.Stream(device=device)
    return _comm_streams[key]


def even_split(total: int, parts: int) -> List[int]:
    """``parts`` sizes summing to ``total``; the remainder goes one each to the first ranks."""
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def _offsets(sizes: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _chunks(rows: int, num_chunks: int) -> List[Tuple[int, int]]:
    """Non-empty ``(start, length)`` row chunks; both ends of a transfer compute the same list."""
    return [(s, n) for s, n in zip(_offsets(even_split(rows, num_chunks)), even_split(rows, num_chunks)) if n > 0]


def _resolve_group(group):
    g = dist.group.WORLD if group is None else group
    ranks = dist.get_process_group_ranks(g)
    return g, len(ranks), dist.get_rank(g), ranks


def check_schedule(schedule: str, num_chunks: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"commfuse schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"commfuse num_chunks must be a positive integer, got {num_chunks!r}")


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"commfuse transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")


def resolve_transport(transport: str, group, G: int, device: torch.device) -> str:
    """``p2p`` or ``copy_engine`` for this call. ``auto``: the copy engine on CUDA with torch symmetric
    memory (measured faster, see README), NCCL/gloo send/recv otherwise; one rank needs no transport."""
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


def _peer_order(G: int, schedule: str) -> List[int]:
    """Offsets d of the peers in the order the copy-engine transport serves them: ``ring`` and
    ``local_first`` 1..G-1, ``bidirectional_ring`` +1, -1, +2, -2, ... (each peer once)."""
    if schedule in ("ring", "local_first"):
        return list(range(1, G))
    order = []
    for k in range(1, G):
        for d in (k, -k):
            if d % G and d % G not in [o % G for o in order]:
                order.append(d)
    return order


def _check_pair(op: str, a_name: str, a: torch.Tensor, w: torch.Tensor, a_shape: str, w_shape: str) -> None:
    if a.dim() != 2:
        raise ValueError(f"{op}: {a_name} must be 2-D {a_shape}, got shape {tuple(a.shape)}")
    if w.dim() != 2:
        raise ValueError(f"{op}: w must be 2-D {w_shape}, got shape {tuple(w.shape)}")
    if a.shape[1] != w.shape[0]:
        raise ValueError(f"{op}: {a_name} {tuple(a.shape)} and w {tuple(w.shape)} do not chain: "
                         f"{a_name}.shape[1] must equal w.shape[0]")
    if a.dtype != w.dtype:
        raise TypeError(f"{op}: {a_name} is {a.dtype} but w is {w.dtype}; they must match")
    if not a.is_floating_point():
        raise TypeError(f"{op}: {a_name} must be a floating-point tensor, got {a.dtype}")
    if a.device != w.device:
        raise ValueError(f"{op}: {a_name} is on {a.device} but w is on {w.device}")


def _remote_runs(sizes: Sequence[int], me: int) -> List[Tuple[int, int, List[int]]]:
    """The other ranks' rows as contiguous runs ``(start, rows, blocks)``, in the order the
    ``local_first`` schedule multiplies them: the blocks after ``me``'s, then those before it
    (empty runs left out)."""
    offs, T = _offsets(sizes), sum(sizes)
    end = offs[me] + sizes[me]
    runs = [(end, T - end, [b for b in range(me + 1, len(sizes)) if sizes[b]]),
            (0, offs[me], [b for b in range(me) if sizes[b]])]
    return [r for r in runs if r[1] > 0]


def gather_shard_sizes(x_shard: torch.Tensor, group=None) -> List[int]:
    """Rows of every rank's block (one small all-gather; a host sync on GPU).

    Also checks that every rank has the same K (``x_shard.shape[1]``)."""
    g, G, me, _ = _resolve_group(group)
    mine = torch.tensor([x_shard.shape[0], x_shard.shape[1]], dtype=torch.int64, device=x_shard.device)
    parts = [torch.empty_like(mine) for _ in range(G)]
    dist.all_gather(parts, mine, group=g)
    rows_k = [p.tolist() for p in parts]
    ks = [k for _, k in rows_k]
    if any(k != ks[0] for k in ks):
        raise ValueError(f"all_gather_matmul: x_shard.shape[1] differs across ranks: {ks}")
    return [t for t, _ in rows_k]


class Timeline:
    """Start/end marks of each transfer, GEMM and reduction, for a timeline plot.

    On CUDA the marks are events (transfers on the side stream, GEMMs and adds
    on the compute stream); on CPU host times. Call :meth:`spans_ms` after the
    device is synchronised."""

    def __init__(self):
        self.entries = []  # (kind, step, start, end)

    def mark(self, stream):
        if stream is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def spans_ms(self) -> List[Tuple[str, int, float, float]]:
        """``(kind, step, start_ms, end_ms)`` relative to the earliest start."""
        if not self.entries:
            return []
        ref = self.entries[0][2]
        if isinstance(ref, float):
            raw = [(k, st, (s - ref) * 1e3, (e - ref) * 1e3) for k, st, s, e in self.entries]
        else:
            raw = [(k, st, ref.elapsed_time(s), ref.elapsed_time(e)) for k, st, s, e in self.entries]
        t0 = min(s for _, _, s, _ in raw)
        return [(k, st, s - t0, e - t0) for k, st, s, e in raw]


class _Exchange:
    """Issues one step's sends and receives and hands back what to wait on."""

    def __init__(self, device: torch.device, group, timeline: Optional[Timeline]):
        self.group = group
        self.timeline = timeline
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm = side_stream(device, self.compute)
            # Inputs and every buffer allocated so far are ready for the side stream.
            self.comm.wait_stream(self.compute)
        else:
            self.compute = self.comm = None

    def compute_ready(self):
        """An event after the work queued on the compute stream so far (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.compute)
        return ev

    def start(self, step: int, sends, recvs, after=None):
        """``sends``/``recvs``: lists of ``(tensor, global_peer, tag)``; ``after``: a :meth:`compute_ready`
        event the sends were produced before. Returns a token for :meth:`wait`."""
        ops = [dist.P2POp(dist.isend, t, p, self.group, tag) for t, p, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, p, self.group, tag) for t, p, tag in recvs]
        if not ops:
            return None
        if not self.cuda:
            t0 = time.perf_counter()
            return (dist.batch_isend_irecv(ops), step, t0)
        if after is not None:
            # The tensors sent were produced on the compute stream; later adds need not be waited for.
            self.comm.wait_event(after)
        with torch.cuda.stream(self.comm):
            t0 = self.timeline.mark(self.comm) if self.timeline else None
            works = dist.batch_isend_irecv(ops)
            for w in works:
                w.wait()  # the side stream, not the host, waits
            done = torch.cuda.Event()
            done.record(self.comm)
            if self.timeline:
                self.timeline.entries.append(("transfer", step, t0, self.timeline.mark(self.comm)))
        for t, _, _ in sends + recvs:
            t.record_stream(self.comm)
        return done

    def wait(self, token) -> None:
        if token is None:
            return
        if self.cuda:
            self.compute.wait_event(token)
            return
        works, step, t0 = token
        for w in works:
            w.wait()
        if self.timeline:
            self.timeline.entries.append(("transfer", step, t0, time.perf_counter()))

    def finish(self) -> None:
        if self.cuda:
            self.compute.wait_stream(self.comm)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    if t.numel() and t.data_ptr() % (_CUDA_ALIGN if t.is_cuda else _CPU_ALIGN):
        return t.clone()
    return t


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if out.numel() == 0:
        return
    a = _aligned(a)
    if out.data_ptr() % (_CUDA_ALIGN if out.is_cuda else _CPU_ALIGN):
        out.copy_(a @ b)
    else:
        torch.mm(a, b, out=out)


class _Gemm:
    """Marks GEMM / add spans on the compute stream for the timeline."""

    def __init__(self, timeline: Optional[Timeline], stream):
        self.tl = timeline
        self.stream = stream  # the compute stream (None on CPU)

    def __call__(self, kind: str, step: int, fn):
        if self.tl is None:
            return fn()
        t0 = self.tl.mark(self.stream)
        r = fn()
        self.tl.entries.append((kind, step, t0, self.tl.mark(self.stream)))
        return r


_SUM_KERNELS: Dict[int, object] = {}
_SUM_FALLBACK = [False]


def _sum_kernel(n: int):
    """An elementwise kernel (NVRTC, through torch's jiterator) adding n inputs in order in fp32, cast once."""
    fn = _SUM_KERNELS.get(n)
    if fn is None:
        from torch.cuda.jiterator import _create_jit_fn
        args = ", ".join(f"T p{i}" for i in range(n))
        body = "".join(f" acc += static_cast<float>(p{i});" for i in range(1, n))
        code = (f"template <typename T> T ordered_sum{n}({args}) {{ float acc = static_cast<float>(p0);{body} "
                "return static_cast<T>(acc); }")
        fn = _SUM_KERNELS[n] = _create_jit_fn(code)
    return fn


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are added in: fp32, or the partials' own where wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def ordered_sum(parts: List[torch.Tensor]) -> torch.Tensor:
    """``cast(((float(p0) + p1) + p2) + ...)``: fp32 adds in list order (fp64 for fp64 parts,
    :func:`sum_dtype`), one cast; the same bits as
    ``acc = p0.float(); acc += p1; ...; acc.to(p0.dtype)``, in one pass over the inputs where the
    elementwise compiler is available (else exactly those steps)."""
    dtype = parts[0].dtype
    if any(p.shape != parts[0].shape or p.dtype != dtype or p.device != parts[0].device for p in parts):
        raise ValueError("ordered_sum: every part must have the shape, dtype and device of the first; got "
                         f"{[(tuple(p.shape), p.dtype, str(p.device)) for p in parts]}")
    if len(parts) > 1 and parts[0].is_cuda and dtype in (torch.bfloat16, torch.float16, torch.float32) \
            and len(parts) <= 8 and not _SUM_FALLBACK[0]:
        try:
            return _sum_kernel(len(parts))(*parts)
        except Exception as e:  # noqa: BLE001 - the step-by-step form gives the same bits
            _SUM_FALLBACK[0] = True
            warnings.warn(f"ds_uniep.commfuse: fused ordered sum unavailable ({type(e).__name__}: {e}); "
                          "adding partials one by one")
    acc = parts[0].to(sum_dtype(dtype), copy=True)
    for p in parts[1:]:
        acc.add_(p)
    return acc if acc.dtype == dtype else acc.to(dtype)


# --------------------------------------------------------------------------- all-gather + GEMM
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
