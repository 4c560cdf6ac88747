"""Pieces both CommFuse operations (:mod:`.ops`) and their transports share: schedule and
transport names and checks, row blocks and chunks, the exchange of one step's transfers, the block
GEMM, the rank-order sum and the timeline marks.
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
