"""CommFuse's ``arrival`` all-gather + GEMM: one GEMM launch whose tiles wait for their rows.

The other schedules cut the GEMM into one launch per block (or per run of blocks), each queued
behind the wait for its block: every launch ends in a partly filled wave of tiles, which at TP4
with a contiguous ``[K, N]`` weight alone left 18-24% of the collective exposed (with
``nn.Linear``'s layout cuBLAS's block GEMMs cost 1-2%, and those schedules measured faster than
this one, whose GEMM is slower than cuBLAS's at those shapes; see README). Here the whole ``[T, K] @ [K, N]`` is one
launch of ds_uniep's grouped GEMM (``ds_uniep.gemm.grouped_mm_segments``) over G segments of
rows, this rank's block first (read where the caller holds it), then the blocks of
``me-1, me-2, ...``, read where they land in this rank's half of the symmetric workspace. No tile
of a peer's block loads its rows before that peer's arrival word reaches this call's epoch, so
the tiles of this rank's block run while the blocks travel, and the others follow without a
second launch.

Transfers: as the copy-engine transport's (``copy_engine.py``), this rank's block is copied into
``me+1, me+2, ...``'s workspace by the copy engines, and after each copy the driver's stream
memory write (no SM: the peer's GEMM holds every SM while it waits) raises this rank's word in
that peer's arrival words to the epoch. After the GEMM the compute stream waits (with a timeout)
for every peer's word, those of empty blocks included, so every call waits for every peer as the
workspace's halves require (see ``copy_engine.py``).

Exactness: a row's result of ds_uniep's grouped GEMM never depends on its tile, the tile order or
the segment it falls in, so the output is bitwise equal to that GEMM over the gathered rows
(:func:`ds_uniep.commfuse.reference.ref_all_gather_matmul` with ``gemm="uniep"``); against the
cuBLAS GEMM of the other schedules it is equal within the GEMM's rounding. Needs CUDA with NCCL
and torch symmetric memory, a Hopper GPU with ds_uniep's ops, bf16 operands and K and N multiples
of 8 (:func:`available` says why not). A wait that outlasts :data:`TIMEOUT_S` records the peer;
the next call raises :class:`ArrivalTimeoutError`.
"""
from typing import Dict, List, Optional, Tuple

import torch

from ..symm import rendezvous
from .copy_engine import _element_bytes, _group_key, _workspace, gathered_rows
from .copy_engine import available as copy_engine_available

TIMEOUT_S = 100.0
"""Seconds a tile (or the closing wait) waits for a peer's block before it records a timeout."""
_PHASE = 7  # recorded in the error record as the phase waited for
_MAX_RANKS = 32  # one word per rank, the closing wait's mask is 32 bits

_words: Dict[Tuple[str, int], "_ArrivalWords"] = {}
_usable: Dict[Tuple[str, int], Tuple[bool, str]] = {}
_ids = iter(range(1 << 20, 1 << 30))


class ArrivalTimeoutError(RuntimeError):
    """A peer's block did not arrive within :data:`TIMEOUT_S` (it died or never made the same call)."""


class _ArrivalWords:
    """Per (group, device): one symmetric int32 word per rank (word r: rank r's block of the current
    call is here), this rank's epoch counter (calls are collective, so counters agree), the error
    record and the poison word of the waits."""

    def __init__(self, group, device: torch.device, G: int, me: int):
        from torch.distributed import _symmetric_memory as symm_mem
        self.words = symm_mem.empty(_MAX_RANKS, dtype=torch.int32, device=device)
        self.words.zero_()
        self.handle = rendezvous(self.words, group)
        self.peer_words = [self.handle.get_buffer(p, [_MAX_RANKS], torch.int32, 0) for p in range(G)]
        self.epoch = 0
        self.me = me
        self.error_record = torch.zeros(8, dtype=torch.int64, pin_memory=True)
        self.poison = torch.zeros(1, dtype=torch.int32, device=device)
        self.layer_id = next(_ids)
        self.segs: Dict[tuple, torch.Tensor] = {}
        torch.cuda.current_stream(device).synchronize()  # zeroed words before any peer writes them
        torch.distributed.barrier(group=group)

    def next_epoch(self) -> int:
        self.epoch = (self.epoch + 1) & 0x7FFFFFFF or 1
        return self.epoch

    def check(self) -> None:
        rec = self.error_record.tolist()
        if rec[0]:
            raise ArrivalTimeoutError(
                f"ds_uniep.commfuse all_gather_matmul (schedule 'arrival'): rank {rec[5]} waited more than "
                f"{TIMEOUT_S:g} s for the block of group rank {rec[2]} (epoch {rec[3]}, saw {rec[4]}); that peer "
                "did not reach the same call, or died. This group's CommFuse buffers are unusable from here on.")


def available(x_shard: torch.Tensor, w: torch.Tensor, group) -> Tuple[bool, str]:
    """(usable, reason) for the ``arrival`` schedule with these operands on this group (None: the
    default group)."""
    group = torch.distributed.group.WORLD if group is None else group
    if x_shard.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False, f"it runs ds_uniep's grouped GEMM, which takes bf16 operands, not {x_shard.dtype}"
    K, N = w.shape
    if K % 8 or N % 8:
        return False, f"ds_uniep's grouped GEMM needs K and N multiples of 8, got K={K}, N={N}"
    ok, reason = copy_engine_available(group, x_shard.device)
    if not ok:
        return False, f"it needs the copy-engine transport, which {reason}"
    key = _group_key(group, x_shard.device)
    if key not in _usable:  # the device and build checks once per group and device (host time per call)
        from ..gemm import available as gemm_available
        ok, reason = gemm_available(x_shard.device)
        if torch.distributed.get_world_size(group) > _MAX_RANKS:
            ok, reason = False, f"at most {_MAX_RANKS} ranks per group"
        elif not ok:
            reason = f"ds_uniep's grouped GEMM is not usable here: {reason}"
        _usable[key] = (ok, reason if not ok else "copy engine + ds_uniep's grouped GEMM")
    return _usable[key]


def _arrival_words(group, device: torch.device, G: int, me: int) -> _ArrivalWords:
    key = _group_key(group, device)
    aw = _words.get(key)
    if aw is None:
        aw = _words[key] = _ArrivalWords(group, device, G, me)
    return aw


def segments(shard_sizes: List[int], offs: List[int], me: int) -> List[Tuple[int, int, int, int]]:
    """``(first row, rows, weight index, word)`` of the one GEMM: this rank's block first (rows
    from the caller's tensor, no wait), then the blocks of ``me-1, me-2, ...`` (each waits for its
    owner's word); empty blocks have no segment."""
    from ..gemm import SEG_ALT_ROWS
    G = len(shard_sizes)
    out = [(offs[me], shard_sizes[me], SEG_ALT_ROWS, -1)] if shard_sizes[me] else []
    for d in range(1, G):
        src = (me - d) % G
        if shard_sizes[src]:
            out.append((offs[src], shard_sizes[src], 0, src))
    return out


def default_config() -> str:
    """The GEMM's tile configuration unless the caller names one: the plain forward's default
    (:data:`ds_uniep.gemm.DEFAULT_CONFIGS`, ``coop128x256``), not a per-shape timed choice. On one
    H200 at the TP4 all-gather's shape (8192 x 8192 x 7168) the ping-pong configurations were the
    fastest timed one call at a time (1.07x cuBLAS) and the slowest in sustained back-to-back runs
    near the 700 W power limit (0.93-0.95x), where ``coop128x256`` stayed 1.03x."""
    from ..gemm import DEFAULT_CONFIGS
    return DEFAULT_CONFIGS["fwd"]


def all_gather_matmul_arrival(x_shard: torch.Tensor, w: torch.Tensor, group, me: int, shard_sizes: List[int],
                              offs: List[int], keep_full: bool, timeline=None,
                              config: Optional[str] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(y [T, N], x_full [T, K] or None)`` (see the module doc). ``w``: ``[K, N]``; its transpose
    is what the GEMM reads, so ``w = weight.t()`` of a contiguous ``[N, K]`` weight (as the parallel
    linears pass it) costs no copy; any other ``w`` is transposed into a copy first. ``config``:
    the GEMM's tile configuration (default: :func:`default_config`)."""
    from ..gemm import ArrivalWaits, grouped_mm_segments
    from .common import side_stream
    G = len(shard_sizes)
    T, K, N = sum(shard_sizes), x_shard.shape[1], w.shape[1]
    device, dtype = x_shard.device, x_shard.dtype
    out = torch.empty(T, N, dtype=dtype, device=device)
    aw = _arrival_words(group, device, G, me)
    aw.check()
    ws = _workspace(group, device, T * K * _element_bytes(dtype))
    half = ws.next_half()
    mine = ws.view(me, (T, K), dtype, half)
    epoch = aw.next_epoch()
    wt = w.t()
    wt = (wt if wt.is_contiguous() else wt.contiguous()).unsqueeze(0)  # [1, N, K]
    key = (tuple(shard_sizes), me)
    segs = aw.segs.get(key)
    if segs is None:
        segs = aw.segs[key] = torch.tensor(segments(shard_sizes, offs, me), dtype=torch.int32,
                                           device=device).reshape(-1, 4)
    cfg = (config or default_config()) if segs.shape[0] else None
    compute = torch.cuda.current_stream(device)
    comm = side_stream(device, compute)
    comm.wait_stream(compute)  # earlier reads of the half this call writes are done (see copy_engine.py)
    if cfg is not None:
        # Queued before the copies, so it starts on this rank's block at once; the copies and the
        # words take no SM, so they run beside it.
        waits = ArrivalWaits(segs=segs, ready=aw.words, epoch=epoch, timeout_ns=int(TIMEOUT_S * 1e9),
                             error_record=aw.error_record, poison=aw.poison, layer_id=aw.layer_id, rank=me,
                             phase=_PHASE, sm_count=0)
        t0 = timeline.mark(compute) if timeline else None
        grouped_mm_segments(mine, wt, segs, cfg, waits, out=out, a_alt=x_shard, alt_row0=offs[me])
        if timeline:
            timeline.entries.append(("gemm", 0, t0, timeline.mark(compute)))
    with torch.cuda.stream(comm):
        for i, d in enumerate(range(1, G)):
            p = (me + d) % G
            t0 = timeline.mark(comm) if timeline else None
            if shard_sizes[me]:
                ws.view(p, (T, K), dtype, half)[offs[me]:offs[me] + shard_sizes[me]].copy_(x_shard)
            if not _write(aw, p, epoch):
                raise RuntimeError("ds_uniep.commfuse all_gather_matmul (schedule 'arrival'): the driver's stream "
                                   "memory write (cuStreamWriteValue32) is not available or failed")
            if timeline:
                timeline.entries.append(("transfer", i, t0, timeline.mark(comm)))
    x_shard.record_stream(comm)
    # Every peer's word, empty blocks' included: this call has heard from every peer.
    from ..gemm import _ops
    mask = sum(1 << p for p in range(G) if p != me)
    _ops().wait_words(aw.words, mask, epoch, int(TIMEOUT_S * 1e9), aw.error_record, aw.poison, aw.layer_id, me,
                      _PHASE)
    x_full = gathered_rows(mine, x_shard, offs[me]) if keep_full else None
    compute.wait_stream(comm)
    return out, x_full


def _write(aw: _ArrivalWords, p: int, epoch: int) -> bool:
    """Raise this rank's word in peer ``p``'s arrival words to ``epoch`` (on the current stream)."""
    from ..gemm import _ops
    return bool(_ops().stream_write_word(aw.peer_words[p][aw.me:aw.me + 1], epoch))
