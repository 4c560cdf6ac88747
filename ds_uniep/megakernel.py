"""The megakernel backend's dispatcher: NVLink stores into symmetric memory.

Letters as in ``layout.py``: T tokens on this rank (at most ``T_max =
max_tokens_per_rank``), k slots, M hidden, E experts, G expert-parallel ranks,
L = E / G local experts, R rows received by this rank, ``R_max = G * T_max *
min(k, L)`` (the most any routing can send one rank).

``NVLinkDispatcher`` follows the dispatcher protocol of ``ReferenceDispatcher``
(``dispatch(x, expert_idx) -> (recv, local_expert_counts, handle)``,
``combine(y, gates, handle) -> out``), with the same rows in the same order and
the same fp32 slot-order sums, so the two are interchangeable. One forward:

1. layout kernel: count this rank's pairs per expert, store the counts into every
   rank's symmetric buffer, raise a signal, wait for every rank's counts, then give
   every kept pair its destination row (``ds_uniep.layout`` semantics);
2. dispatch kernel: one warp per token reads the row once and stores it straight
   into each destination's receive buffer at its row (16-byte stores over NVLink),
   with the source pair as a meta word; a token crosses to a rank once, its later
   slots there only name the row of its first (``dedup``); the last block raises
   the dispatch signal;
3. finish kernel: waits for every rank's dispatch signal and fills the named rows
   by local copies. Rows received in this
   rank's *direct region* (a second receive buffer, a separate symmetric
   allocation) are handed to the caller in place, as a view; rows received in
   the staging region are copied out (the next dispatch may overwrite it). A rank
   offers its direct region in the counts exchange of step 1 only when nothing
   holds a view of its previous rows any more (the region's storage has no users
   besides the dispatcher), so a caller still holding ``recv`` (pipelined
   micro-batches, two forwards before a backward) costs a copy, never corrupt
   rows. FP8 rows are dequantized on arrival and always take the staging path;
   backward dispatches use it too;
4. combine: a push kernel stores every expert output row back into its source's
   combine buffer at pair ``t * k + j`` and raises the combine signal; the source
   waits and sums each token's k rows in slot order in fp32, weighted, cast once.
   (The fused schedule's epilogue combine has the second expert GEMM store the rows into the
   sources' combine buffers itself, in expert order: ``ds_uniep.epilogue_combine``.)

Backward: the gradient of combine is a dispatch of ``grad_out`` in the same layout. The rows
travel unweighted and each source leaves its gates in its gates region; the expert rank forms
``grad_y = gate * row`` and the gate gradient ``<grad_out[t], y[r]>`` of each row it holds and
stores the scalar back into the source's gates region, so the expert outputs never travel back.
The gradient of dispatch is a combine without weights (under the fused schedule's epilogue
combine, the first expert GEMM's dgrad stores its rows into the sources' combine buffers itself:
``ds_uniep.epilogue_combine.DgradCombine``).

No step takes a row slot with an atomic; signals carry growing epochs, so no reset
is ever needed. Every wait gives up after ``overlap.timeout_s``: the kernel records
who waited for what in pinned host memory, the layer's later kernels do nothing,
and the next call (or :meth:`NVLinkDispatcher.check`) raises
:class:`UniEPTimeoutError` naming the layer, the rank and the signal.

With ``padded_recv=True`` dispatch returns ``recv [R_max, M]`` whose first R rows
are valid (R = ``local_expert_counts.sum()``), with no host synchronisation at all;
by default it reads R once on the host and returns ``recv [R, M]`` exactly as the
reference does. Not capturable in CUDA graphs (epochs are kernel arguments).
"""

import importlib.util
import itertools
import os
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from .config import UniEPConfig
from .symm import rendezvous

# Kernel limits repeated from ops/csrc/configs.cuh (tests/test_ops_compile.py checks they agree).
MAX_RANKS = 8
MAX_EXPERTS = 1024
MAX_TOP_K = 16
FP8_GROUP = 128
NUM_PHASES = 7
_PHASE_GATES = 6  # kPhaseGates: a source's gates are in its gates region (rank partials)
MAX_COMBINE_CHUNKS = 64
ERROR_RECORD_WORDS = 8
PHASE_NAMES = ("counts", "dispatch", "combine", "barrier", "pull", "arrived", "gates")
_ALIGN = 256


class UniEPTimeoutError(RuntimeError):
    """A kernel gave up waiting on a peer's signal; the message names layer, rank and signal."""


class UniEPCapacityError(ValueError):
    """An input larger than the symmetric buffers were sized for."""


def ops_package():
    """``ds_uniep.ops``; from a source checkout (``ops/`` beside ``ds_uniep/``) when not installed."""
    try:
        import ds_uniep.ops as ops
        return ops
    except ImportError:
        root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops")
        spec = importlib.util.spec_from_file_location("ds_uniep.ops", os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ds_uniep.ops"] = module
        spec.loader.exec_module(module)
        return module


def _ext():
    return ops_package().load_uniep_ops()


# ---------------------------------------------------------------------------------------------
# Symmetric buffers of one layer
# ---------------------------------------------------------------------------------------------
class _SymBuffers:
    """One symmetric byte buffer per layer, the same layout on every rank (``SymView`` in
    ops/csrc/types.h): counts, signals, status, meta, scales, recv, comb, gates, cursors, dup regions."""

    def __init__(self, E: int, G: int, rank: int, T_max: int, k: int, M: int, dtype: torch.dtype, fp8: bool,
                 group, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem
        L = E // G
        elsize = torch.empty(0, dtype=dtype).element_size()
        self.recv_rows = G * T_max * min(k, L)
        self.pairs_per_rank = T_max * k
        self.recv_row_bytes = M * elsize  # e4m3 rows use the first M bytes of a row
        self.comb_row_bytes = M * elsize
        sizes = [
            ("counts", 2 * MAX_RANKS * E * 4 + 2 * MAX_RANKS * 4),  # + direct-receive flags
            # phase signals, then the chunked combine's flags [chunk][rank] and local counters [chunk]
            ("signals", (NUM_PHASES * MAX_RANKS + MAX_COMBINE_CHUNKS * (MAX_RANKS + 1)) * 4),
            ("status", 32 * 4),
            ("meta", self.recv_rows * 4),
            ("scales", self.recv_rows * (M // FP8_GROUP) * 4 if fp8 else 0),
            ("recv", self.recv_rows * self.recv_row_bytes),
            ("comb", self.pairs_per_rank * self.comb_row_bytes),
            ("gates", self.pairs_per_rank * 4),  # backward of combine: gates out, gate gradients back
            ("cursors", E * 4),  # arrival ordering: each local expert's next free row
            ("dup", self.recv_rows * 4),  # deduplicated dispatch: where a row's token already is
        ]
        self.offsets: Dict[str, int] = {}
        total = 0
        for name, nbytes in sizes:
            self.offsets[name] = total
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.total_bytes = total
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        # Signals and the status word start at 0, before any peer can store into this buffer:
        # rendezvous is collective and comes after the local zeroing has finished.
        self.buffer.zero_()
        torch.cuda.synchronize(device)
        pg = group if group is not None else torch_dist.group.WORLD
        self.handle = rendezvous(self.buffer, pg)
        ptrs = list(self.handle.buffer_ptrs)
        if len(ptrs) != G:
            raise RuntimeError(f"symmetric memory rendezvous gave {len(ptrs)} peers, expected {G}")
        self.group = pg
        o = self.offsets
        #: this rank's gates region, ``[pairs_per_rank]`` fp32
        self.gates = self.buffer[o["gates"]:o["gates"] + self.pairs_per_rank * 4].view(torch.float32)
        self.descriptor = ptrs + [0] * (MAX_RANKS - G) + [
            rank, G, o["counts"], o["signals"], o["status"], o["meta"], o["scales"], o["recv"], o["comb"],
            o["gates"], o["cursors"], o["dup"], self.recv_rows, self.recv_row_bytes, self.comb_row_bytes, self.pairs_per_rank
        ]


def _storage_users(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _DirectRegion:
    """``[R_max, M]`` rows in a symmetric allocation of their own, so that the users of its storage
    (views handed out) can be counted: a layer's direct receive region, and its source region."""

    def __init__(self, rows: int, M: int, dtype: torch.dtype, group, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem
        elsize = torch.empty(0, dtype=dtype).element_size()
        self.buffer = symm_mem.empty(rows * M * elsize, dtype=torch.uint8, device=device)
        self.handle = rendezvous(self.buffer, group)
        ptrs = list(self.handle.buffer_ptrs)
        self.ptrs = ptrs + [0] * (MAX_RANKS - len(ptrs))
        self.dtype, self.M = dtype, M
        self.rows = self.fresh_view()
        self.idle_users = _storage_users(self.rows)

    def fresh_view(self) -> Tensor:
        """``[R_max, M]`` rows with no autograd history: an in-place write that autograd records
        (``copy_`` of a tensor that requires grad) marks only this view, not the region."""
        return self.buffer.view(self.dtype).view(-1, self.M)

    def free(self) -> bool:
        """True when no view of the region's rows is alive outside the dispatcher."""
        return _storage_users(self.rows) <= self.idle_users


# ---------------------------------------------------------------------------------------------
# The dispatcher
# ---------------------------------------------------------------------------------------------
@dataclass
class NVLinkHandle:
    """What combine and the backward ops need from dispatch (all on the device)."""
    #: ``[T, k]`` int32 expert of each pair, -1 dropped.
    expert_idx: Tensor
    #: ``[T, k]`` int32 row on the destination (layout.py's ``dest_row``), -1 dropped.
    dest_row: Tensor
    #: ``[rows]`` int32 source pair of each received row: ``src * T_max * k + t * k + j``.
    recv_pair: Tensor
    #: ``[1]`` int32 R, rows received by this rank.
    num_recv: Tensor
    #: ``[G, E]`` int64 every rank's kept pairs per expert (layout.py's ``counts_all``).
    counts_all: Tensor
    #: ``[L]`` int64 rows of each local expert.
    local_expert_counts: Tensor
    #: compression.combine "rank_partials": the kPhaseGates epoch of the gates dispatch staged for the
    #: combine (0: none; the combine then stages the gates it gets).
    gates_epoch: int = 0


_REGISTRY: "weakref.WeakValueDictionary[int, NVLinkDispatcher]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def _get(ctx_id: int) -> "NVLinkDispatcher":
    d = _REGISTRY.get(ctx_id)
    if d is None:
        raise RuntimeError(f"NVLinkDispatcher {ctx_id} no longer exists")
    return d


class NVLinkDispatcher:
    """Dispatch/combine over NVLink peers through symmetric memory (one per MoE layer).

    Args:
        layer_name: names the layer in every error.
        num_experts: E; ep_size: G (the size of ``group``); hidden_size: M; k: slots per token.
        dtype: activation dtype (bf16, fp16 or fp32) of x and y.
        config: a :class:`UniEPConfig` (or anything ``UniEPConfig.coerce`` takes): uses
            ``max_tokens_per_rank``, ``compression.dispatch_dtype``, ``overlap.timeout_s``,
            ``overlap.num_comm_sms`` (the fused dispatch's blocks), ``overlap.roles`` and, unless
            given here, ``overlap.combine_chunks`` and ``overlap.combine_queue``.
        group: the expert-parallel process group (None: the world).
        padded_recv: return ``recv [R_max, M]`` without a host sync (see the module doc).
        num_blocks: blocks of the copy kernels (default: the SM count).
        direct_receive: allocate the direct receive region (a second ``[R_max, M]``
            buffer) so forward dispatches need no copy-out (ignored with FP8 dispatch).
        combine_chunks: (default ``overlap.combine_chunks``, 16) combine (and the backward of
            dispatch) as one kernel pipelined over this many chunks of source tokens
            (``max_tokens_per_rank`` split evenly, but no chunk under ``combine_min_chunk_tokens``,
            so fewer chunks where the buffers are small): a source sums a chunk's rows while later
            chunks are still being pushed. 0: push, then reduce, as two kernels. The output bits
            are the same either way (:meth:`combine_chunking`).
        combine_min_chunk_tokens: the fewest source tokens per chunk (default 256: in
            ``bench_dispatch.py`` at ep 4 with 2048 tokens, 8 chunks of 256 were faster than 16 of
            128 on H100s and on H200s; at 8192 tokens 32 chunks of 256 were not faster than 16 of
            512, and slower in the layer).
        combine_reduce_blocks: blocks of the chunked combine that reduce, beside its pushing
            blocks; default ``num_blocks`` (two blocks fit on an SM, so with one per SM the
            reducing role has every SM), and with ``combine_push_queue`` ``num_blocks`` less the
            pushing blocks: one block per SM in all, each role on SMs of its own (a grid that fits
            one block per SM runs a kernel built for one, with twice the registers per thread; on
            2 H200s at 2048 tokens 1.04x faster than the queue's form before, beside ``num_blocks``
            reducing blocks, in one run; on 2 H100s within -1.3% to +2.0% of ``num_blocks``).
        combine_push_lead: in the chunked combine each pushing block sorts its share of the
            rows (every ``combine_push_blocks``-th group of 8) by chunk once and streams through
            them with no barrier between chunks, at most this many chunks ahead of the last chunk
            whose flag it raised (a share over 12288 rows, 48 KiB of shared memory, is pushed
            chunk by chunk instead). 0: the block gathers and pushes one chunk's rows at a time.
            The output bits are the same either way.
        combine_push_queue: (default ``overlap.combine_queue``, on) the chunked combine's pushing
            blocks first sort all rows by chunk into one order (a barrier among them; the order's
            entries carry the call's epoch, so a warp takes a position once its entry is there),
            then every pushing warp takes its next segments from one cursor over it, so blocks that
            store faster push more rows and none is left pushing alone at the end
            (``combine_push_lead`` is then unused); once pushed, the pushing blocks sum the last
            chunk beside the reducing ones. Its pushing blocks must all be resident at once
            (at most two per SM; more are refused). False: each pushing block walks a fixed share
            of the rows, sorted by chunk. The output bits are the same either way.
        combine_queue_gpu_fence: (default on) with the queue, a pushing warp that moves past a chunk
            fences at GPU scope before it counts the chunk's rows, and only the warp that completes
            the chunk fences at system scope before raising its flags on every rank (correct by the
            PTX memory model's causality order; one system fence per chunk instead of one per warp;
            on H200s 1.01-1.03x faster at ep 2, level at ep 4). False: every pushing warp fences at
            system scope. The bits are the same either way.
        combine_push_blocks: pushing blocks of the chunked combine; default half of
            ``num_blocks`` (in ``bench_dispatch.py`` on H200s, with the sorted walk, faster than a
            quarter or all of them at ep 2 and 4).
        pull_blocks: blocks of the pulling combine (default twice ``num_blocks``: two fit on an SM).
        pull_combine: allocate a source region (a third ``[R_max, M]`` symmetric buffer). Expert
            outputs written into :meth:`combine_source` are combined by pulling: each rank reads
            its tokens' rows from the ranks that computed them and sums them in slot order, with
            no combine buffer and no per-chunk signals (the same bits as pushing). Every rank
            must combine from its source region in the same call, or the call times out.
        gate_grad_on_experts: the backward of combine sends grad_out's rows (unweighted) and the
            gates to the expert ranks, which form ``grad_y`` and each pair's gate gradient there
            and send back only those scalars (one row transfer). False: the expert outputs first
            travel back to their sources, which form the gate gradients (two row transfers).
            Both give the same bits.
        ordering: ``"layout"`` (the default): every row at its layout row and every sum in slot
            order, bitwise reproducible. ``"arrival"``: what a non-deterministic design does, kept
            to measure what the fixed order costs: sources claim an expert's rows with atomics at
            the destination (rows of an expert in arrival order), and combine adds each row into
            its token's fp32 accumulator at the source with atomics (sums in arrival order). Needs
            the gates at dispatch (``dispatch(x, expert_idx, gates)``); not with FP8 dispatch or
            ``pull_combine``. Results vary in the last bits from run to run.
        dedup: unweighted dispatches (forward rows; in the backward, ``grad_out`` rows) send a
            token's row to a destination rank once, however many of its slots go there; the
            receiver copies it into the rows of the token's other slots (the same bits, fewer
            NVLink bytes: at k = 8 over 4 ranks about half). Not with FP8 dispatch.
        fused_dedup: whether the fused schedule's dispatch deduplicates too (with ``dedup``). Off,
            each slot's row is sent whole: more NVLink bytes, but no copies for the few SMs that
            move the rows while the GEMM holds the rest (same bits either way).
    """

    def __init__(self, layer_name: str, num_experts: int, ep_size: int, hidden_size: int, k: int,
                 dtype: torch.dtype, config, group=None, padded_recv: bool = False,
                 num_blocks: Optional[int] = None, direct_receive: bool = True, combine_chunks: Optional[int] = None,
                 combine_reduce_blocks: Optional[int] = None, combine_push_lead: int = 2,
                 combine_push_blocks: Optional[int] = None, combine_min_chunk_tokens: int = 256,
                 combine_push_queue: Optional[bool] = None, combine_queue_gpu_fence: bool = True,
                 pull_combine: bool = False,
                 pull_blocks: Optional[int] = None, gate_grad_on_experts: bool = True, ordering: str = "layout",
                 dedup: bool = True, fused_dedup: bool = True):
        config = UniEPConfig.coerce(config)
        if combine_chunks is None:
            combine_chunks = config.overlap.combine_chunks
        if combine_push_queue is None:
            combine_push_queue = config.overlap.combine_queue
        self.layer_name = layer_name
        self.num_experts, self.ep_size, self.hidden_size, self.k = num_experts, ep_size, hidden_size, k
        self.dtype = dtype
        self.group = group
        self.padded_recv = padded_recv
        self.fp8 = config.compression.dispatch_dtype == "fp8_e4m3"
        self.max_tokens = config.max_tokens_per_rank
        self.timeout_ns = int(config.overlap.timeout_s * 1e9)
        self.rank = torch_dist.get_rank(group) if torch_dist.is_initialized() else 0
        world = torch_dist.get_world_size(group) if torch_dist.is_initialized() else 1
        where = f"{layer_name} (rank {self.rank})"
        if world != ep_size:
            raise ValueError(f"{where}: ep_size {ep_size} but the group has {world} ranks")
        if not 1 <= ep_size <= MAX_RANKS:
            raise ValueError(f"{where}: ep_size {ep_size} outside 1..{MAX_RANKS} (one host of NVLink peers)")
        if num_experts % ep_size or not 1 <= num_experts <= MAX_EXPERTS:
            raise ValueError(f"{where}: {num_experts} experts must be in 1..{MAX_EXPERTS} and split over "
                             f"{ep_size} ranks")
        if not 1 <= k <= MAX_TOP_K:
            raise ValueError(f"{where}: k = {k} outside 1..{MAX_TOP_K}")
        if not 0 <= combine_chunks <= MAX_COMBINE_CHUNKS:
            raise ValueError(f"{where}: combine_chunks = {combine_chunks} outside 0..{MAX_COMBINE_CHUNKS}")
        if combine_min_chunk_tokens < 1:
            raise ValueError(f"{where}: combine_min_chunk_tokens = {combine_min_chunk_tokens} must be at least 1")
        if combine_push_lead < 0:
            raise ValueError(f"{where}: combine_push_lead = {combine_push_lead} must be at least 0")
        if combine_push_blocks is not None and combine_push_blocks < 1:
            raise ValueError(f"{where}: combine_push_blocks = {combine_push_blocks} must be at least 1")
        if combine_reduce_blocks is not None and combine_reduce_blocks < 1:
            raise ValueError(f"{where}: combine_reduce_blocks = {combine_reduce_blocks} must be at least 1")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{where}: activation dtype {dtype} is not bf16, fp16 or fp32")
        if ordering not in ("layout", "arrival"):
            raise ValueError(f"{where}: ordering must be 'layout' or 'arrival', got {ordering!r}")
        if ordering == "arrival" and (self.fp8 or pull_combine):
            raise ValueError(f"{where}: arrival ordering moves activation-dtype rows and combines by pushing: "
                             "it runs neither with FP8 dispatch nor with pull_combine")
        #: compression.combine "rank_partials": each rank sums its rows of a token before they travel
        #: (see _rank_partials)
        self.rank_partials = config.compression.combine == "rank_partials"
        if ordering == "arrival" and self.rank_partials:
            raise ValueError(f"{where}: compression.combine 'rank_partials' sums in a fixed order; arrival "
                             'ordering ("deterministic": false) adds rows as they arrive')
        elsize = torch.empty(0, dtype=dtype).element_size()
        if hidden_size * elsize % 16:
            raise ValueError(f"{where}: rows of {hidden_size} x {dtype} are not a multiple of 16 bytes")
        if self.fp8 and hidden_size % FP8_GROUP:
            raise ValueError(f"{where}: FP8 dispatch needs hidden_size divisible by {FP8_GROUP}, got {hidden_size}")
        ok, reason = ops_package().megakernel_available(torch.device("cuda", torch.cuda.current_device()))
        if not ok:
            raise RuntimeError(f"{where}: the NVLink dispatcher cannot run here: {reason}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.ext = _ext()
        self.bufs = _SymBuffers(num_experts, ep_size, self.rank, self.max_tokens, k, hidden_size, dtype, self.fp8,
                                group, self.device)
        self.num_blocks = num_blocks or torch.cuda.get_device_properties(self.device).multi_processor_count
        self.combine_chunks = combine_chunks
        self.combine_min_chunk_tokens = combine_min_chunk_tokens
        self.combine_queue_gpu_fence = combine_queue_gpu_fence
        # An int64 CUDA tensor of at least ext.combine_trace_size(pushing + reducing blocks) words, zeroed
        # by its owner, makes the chunked combine record its timeline there (%globaltimer stamps, ns; read
        # by benchmarks/bench_dispatch.py --trace). None: no stamps.
        self.combine_trace: Optional[Tensor] = None
        self.gate_grad_on_experts = gate_grad_on_experts
        self.ordering = ordering
        self.dedup = dedup and not self.fp8
        self.fused_dedup = fused_dedup and self.dedup
        #: the forward dispatch received in place stores the rows bound for this rank whole (none
        #: deduplicated): they are local stores beside the NVLink ones instead of copies after the
        #: wait (the same bits); False: deduplicated like the others' (kept to measure the difference)
        self.own_rows_whole = True
        # The rows the last epilogue combine left in this rank's combine buffer, while a backward
        # may still read them (a weak reference to ds_uniep.epilogue_combine's record of them).
        self._landed = None
        self._comb_bases_dev = None  # comb_bases_device(), made on first use
        self.acc = None
        if ordering == "arrival":  # each token's fp32 accumulator row, zero between combines
            self.acc = _DirectRegion(self.max_tokens, hidden_size, torch.float32, self.bufs.group, self.device)
            self.acc.buffer.zero_()
            torch.cuda.synchronize(self.device)
        self.combine_reduce_blocks = combine_reduce_blocks
        self.combine_push_lead = combine_push_lead
        self.combine_push_blocks = combine_push_blocks  # None: half of num_blocks, read at each combine
        self.combine_push_queue = bool(combine_push_queue)
        self._queue = None  # the queue's workspace, grown on demand
        self.direct = None
        if direct_receive and not self.fp8:
            self.direct = _DirectRegion(self.bufs.recv_rows, hidden_size, dtype, self.bufs.group, self.device)
        self.pull_blocks = pull_blocks or 2 * self.num_blocks
        self.source = None
        if pull_combine:
            self.source = _DirectRegion(self.bufs.recv_rows, hidden_size, dtype, self.bufs.group, self.device)
        # A pulling combine leaves peers reading this rank's source region; the next counts
        # exchange or barrier ends that, and combine_source() puts a barrier in before then.
        self._peers_may_read_source = False
        #: forward dispatches whose rows were received in place / copied out of staging
        self.direct_stats = {"in_place": 0, "copied": 0}
        #: forward dispatches whose kernels dispatch_begin queued
        self.early_dispatches = 0
        #: forward combines that pulled from the source regions / pushed rows back / ran pipelined /
        #: summed the rows the fused schedule's second GEMM stored (epilogue combine); backward
        #: dispatches whose input-gradient rows the first GEMM's dgrad stored (landed_dgrad); chunked
        #: combines, forward or backward, whose pushing blocks shared one queue (queued)
        self.combine_stats = {"pulled": 0, "pushed": 0, "pipelined": 0, "landed": 0, "landed_dgrad": 0,
                              "queued": 0, "rank_partials": 0}
        # (expert_idx, its version, its first slot per rank) of the last rank-partials combine
        self._firsts = (None, -1, None)
        # rank partials: the local pair table ([G * pairs_per_rank] int64, made on first use) and its tag,
        # the kPhaseGates epoch of the gates now in the gates region (0: none, or overwritten since) and
        # the one the next combine's handle brought
        self._pair_table = None
        self._table_epoch = 0
        self._last_gates_epoch = 0
        self._next_gates = 0
        #: the pipelined schedule's copy kernels (one per chunk and destination on the copy engines,
        #: one per chunk by SM stores), forward and backward
        self.push_stats = {"copy_engines": 0, "sm_stores": 0}
        self.error_record = torch.zeros(ERROR_RECORD_WORDS, dtype=torch.int64, pin_memory=True)
        self._num_recv_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # R of the exact-R form
        # every rank's counts per expert, read with R (the pipelined schedule plans its copies by them)
        self._counts_host = torch.zeros(ep_size, num_experts, dtype=torch.int64, pin_memory=True)
        self._comm_streams = None  # the pipelined schedule's copy-engine streams, made on first use
        # The fused schedule: blocks of its dispatch (the GEMM takes the other SMs), its stream,
        # the next dispatch's request, and what the waiting GEMM of the last fused dispatch needs.
        self.fused_comm_blocks = config.overlap.num_comm_sms
        #: interleaved roles (``overlap.roles``): the fused dispatch's arrivals are taken (source
        #: pairs, deduplicated copies) in a spare warp of each of the waiting GEMM's CTAs, which then
        #: has every SM, instead of on fused_comm_blocks SMs beside it; that job's tokens per send
        #: item, rows per take item, whether rows about to be read are prefetched to L2, and the
        #: warps per CTA that run it (1 or 2)
        self.interleaved = config.overlap.roles == "interleaved"
        self.interleaved_items = (16, 64, True, 1)
        #: whether that job sends the other ranks' rows too; False (faster forward on 2 H200s at all
        #: three shapes of docs/benchmarks.md): every SM sends them, one rank after another, before the GEMM
        self.interleaved_sends = False
        #: what one wait of the fused schedule's first GEMM covers (``overlap.signal_granularity``; see
        #: _wait_runs)
        self.signal_granularity = config.overlap.signal_granularity
        self._fused_stream = None
        self._round_sources = None
        self._fuse_next = False
        self._pending = None  # (x, expert_idx, launched state) of dispatch_begin
        self._fused_waits = None
        self._fused_weight = None
        self._fused_done = None
        # The word the fused dispatch's blocks raise once all of them run: on the device, where the
        # stream that queues the GEMM waits for it (the driver's stream memory wait); in pinned host
        # memory, polled by the host, where the driver does not offer that wait.
        self._started_dev = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._started_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._stream_waits = None  # whether the stream memory wait works (known at the first fused dispatch)
        #: forward dispatches that ran fused / asked to but ran sequential (direct region in use)
        self.fused_stats = {"fused": 0, "sequential": 0}
        self.layer_id = next(_IDS)
        self._epochs = [0] * NUM_PHASES
        _REGISTRY[self.layer_id] = self

    # ------------------------------------------------------------------ bookkeeping
    def _next_epoch(self, phase: int) -> int:
        # Every rank calls the same ops in the same order, so epochs agree across ranks.
        self._epochs[phase] = (self._epochs[phase] + 1) & 0xFFFFFFFF or 1
        return self._epochs[phase]

    def direct_descriptor(self, use: bool, counts_epoch: int):
        """The DirectView of ops/csrc/types.h: direct-region bases, whether flags apply, their epoch."""
        ptrs = self.direct.ptrs if self.direct is not None else [0] * MAX_RANKS
        return ptrs + [int(use and self.direct is not None), counts_epoch]

    def _wait_args(self):
        return self.timeout_ns, self.error_record, self.layer_id

    def check(self, synchronize: bool = False) -> None:
        """Raise :class:`UniEPTimeoutError` if a kernel of this layer gave up waiting."""
        if synchronize:
            torch.cuda.current_stream(self.device).synchronize()
        rec = self.error_record.tolist()
        if rec[0]:
            phase = PHASE_NAMES[rec[1]] if 0 <= rec[1] < len(PHASE_NAMES) else str(rec[1])
            raise UniEPTimeoutError(
                f"{self.layer_name}: rank {rec[5]} timed out after {self.timeout_ns / 1e9:g} s waiting for the "
                f"'{phase}' signal of rank {rec[2]} (epoch {rec[3]}, saw {rec[4]}); a peer did not reach the same "
                "call, or died. The layer's buffers are unusable from here on.")

    def _check_tokens(self, T: int, k: int) -> None:
        if T > self.max_tokens:
            raise UniEPCapacityError(
                f"{self.layer_name}: rank {self.rank} got {T} tokens but its symmetric buffers were sized for "
                f"max_tokens_per_rank = {self.max_tokens}; set \"uniep\": {{\"max_tokens_per_rank\": {T}}} or more")
        if k != self.k:
            raise UniEPCapacityError(f"{self.layer_name}: rank {self.rank} got k = {k} slots per token, the "
                                     f"buffers were sized for k = {self.k}")

    # ------------------------------------------------------------------ raw steps (no autograd)
    def _dispatch_fwd(self, x: Tensor, expert_idx: Tensor, gates: Optional[Tensor] = None,
                      host_counts: bool = False):
        # host_counts: also bring every rank's counts to the host (``_counts_host``) with R.
        pending, self._pending = self._pending, None
        if pending is None:
            return self._dispatch_collect(self._dispatch_launch(x, expert_idx, gates, host_counts))
        # dispatch_begin queued this dispatch's kernels already: only the row count is left to read.
        px, pidx, launched = pending
        same = (px.data_ptr(), px.shape, pidx.data_ptr(), pidx.shape) == (
            x.data_ptr(), x.shape, expert_idx.data_ptr(), expert_idx.shape)
        if not same or host_counts or gates is not None:
            raise RuntimeError(f"{self.layer_name}: dispatch() got other inputs than the dispatch_begin() before "
                               "it; call dispatch() next with the same x and expert_idx")
        return self._dispatch_collect(launched)

    def dispatch_begin(self, x: Tensor, expert_idx: Tensor) -> bool:
        """Queue the next :meth:`dispatch`'s kernels now (counts exchange, layout, the rows' stores),
        so that the host work the caller does before calling :meth:`dispatch` with the same ``x``
        and ``expert_idx`` overlaps them; that call then only reads the row count and returns. The
        same kernels, the same results (a :meth:`request_fused` before this call applies to it).
        Returns False (nothing queued) under arrival ordering, whose dispatch needs the gates."""
        if self._pending is not None:
            raise RuntimeError(f"{self.layer_name}: dispatch_begin() twice without a dispatch() between")
        if self.ordering != "layout":
            return False
        x, idx = self.checked_inputs(x, expert_idx)
        self._pending = (x, idx, self._dispatch_launch(x, idx, None, False))
        self.early_dispatches += 1
        return True

    def pending_local_counts(self) -> Tensor:
        """The ``[L]`` rows per local expert of the dispatch that :meth:`dispatch_begin` queued (a
        device tensor the layout kernel fills; the one :meth:`dispatch` returns), so that work on
        them can be queued before :meth:`dispatch` waits for the row count."""
        if self._pending is None:
            raise RuntimeError(f"{self.layer_name}: pending_local_counts() needs a dispatch_begin() before it")
        return self._pending[2]["local_counts"]

    def _dispatch_launch(self, x: Tensor, expert_idx: Tensor, gates: Optional[Tensor], host_counts: bool) -> dict:
        """The dispatch's kernels, up to where the host needs the row count (see _dispatch_collect)."""
        self.check()
        self._keep_landed()  # peers may store into this rank's combine buffer once the counts are out
        e_counts = self._next_epoch(0)
        self._peers_may_read_source = False  # every rank's earlier kernels end before the counts exchange
        in_place = self.direct is not None and self.direct.free()
        asked, self._fuse_next = self._fuse_next, False
        fused = asked and in_place  # rows received in place, so the GEMM reads them where they land
        if not fused:
            self._fused_weight = None
        if asked:
            self.fused_stats["fused" if fused else "sequential"] += 1
        st = {"x": x, "fused": fused, "in_place": in_place}
        if fused:
            from .gemm import fused_config
            (fused_w, configs), self._fused_weight = self._fused_weight, None
            fused_gemm = fused_config(configs)
            if self._stream_waits is None:
                # A wait that holds at once (the word is 0, cyclic >= 0) tells whether the driver offers it.
                self._stream_waits = bool(self.ext.stream_wait_word(self._started_dev, 0))
            st.update(fused_w=fused_w, fused_gemm=fused_gemm)
        local_counts, num_recv, counts_all, dest_row = self.ext.layout(expert_idx, self.num_experts,
                                                                       self.bufs.descriptor, e_counts,
                                                                       *self._wait_args(), in_place)
        e_disp = self._next_epoch(1)
        counted = None
        if not self.padded_recv:
            # R goes to the host as soon as the counts are known; the dispatch kernel is queued
            # before the host waits, so the device stays busy while the host reads R.
            self._num_recv_host.copy_(num_recv, non_blocking=True)
            if host_counts:
                self._counts_host.copy_(counts_all, non_blocking=True)
            counted = torch.cuda.Event()
            counted.record()
        seg_base = row_out = side = None
        if self.ordering == "arrival":
            # Gates staged for combine's atomic weighting; every row of expert e from seg_base[e] on.
            self.bufs.gates[:gates.numel()].copy_(gates.reshape(-1))
            L = self.num_experts // self.ep_size
            per_expert = counts_all.sum(0).view(self.ep_size, L)
            seg_base = (per_expert.cumsum(1) - per_expert).reshape(-1).to(torch.int32)
            row_out = torch.empty_like(dest_row)
        if fused:
            # The fused schedule: from a side stream, the rows go out one destination at a time.
            # This rank's own rows first, on every SM (nothing else could run yet: the first GEMM
            # waits for them); then, on fused_comm_blocks SMs, the other destinations' rows, and
            # this rank's arriving rows are taken source by source, while the caller's first GEMM
            # runs on the other SMs, each run of rows as soon as the latest source it holds rows
            # of is usable here (kPhaseArrived). Runs are whole tiles of the GEMM's configuration.
            from .gemm import run_alignment
            # layout.fused_runs on the device: the (source, expert) blocks the dispatch takes in,
            # and the runs of the GEMM's tiles
            source_blocks = self.ext.fused_segments(counts_all, self.rank, 1)
            segs = self._wait_runs(counts_all, run_alignment(st["fused_gemm"]))
            pairs_all = torch.empty(self.bufs.recv_rows, dtype=torch.int32, device=x.device)
            G = self.ep_size
            if self.interleaved:
                # Interleaved roles: this rank's own rows (and, unless interleaved_sends, the other
                # ranks' rows) on every SM, on this stream; the rest by the spare warps of the GEMM
                # that _dispatch_collect queues (the job's tensors stay referenced in st until
                # then), so nothing waits for SMs.
                direct = self.direct_descriptor(True, e_counts)
                sent = 1 if self.interleaved_sends else G  # rounds [0, sent) go out before the GEMM
                self.ext.dispatch_fused(x, expert_idx, dest_row, self.num_experts, self.bufs.descriptor, direct,
                                        e_disp, self.num_blocks, self.fused_dedup, source_blocks, self.direct.rows,
                                        pairs_all, None, 0, sent, False, *self._wait_args())
                waits = self._arrival_waits(segs, e_disp)
                waits.comm_job = self.ext.interleaved_job(x, expert_idx, dest_row, self.num_experts,
                                                          self.bufs.descriptor, direct, e_disp, self.fused_dedup,
                                                          source_blocks, self.direct.rows, pairs_all,
                                                          *self.interleaved_items, sent, *self._wait_args())
                st.update(pairs_all=pairs_all, waited=True, started=None, segs=segs, waits=waits,
                          job=(x, expert_idx, dest_row, source_blocks, direct, sent))
            else:
                side = self._fused_side_stream()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
            launches = [(0, G, self.fused_comm_blocks, True)] if G == 1 else [
                (0, 1, self.num_blocks, False), (1, G, self.fused_comm_blocks, True)]
            started = self._started_dev if self._stream_waits else self._started_host
            with torch.cuda.stream(side):
                for begin, end, blocks, take in launches:
                    self.ext.dispatch_fused(x, expert_idx, dest_row, self.num_experts, self.bufs.descriptor,
                                            self.direct_descriptor(True, e_counts), e_disp, blocks, self.fused_dedup,
                                            source_blocks, self.direct.rows, pairs_all, started if take else None,
                                            begin, end, take, *self._wait_args())
            for t in (x, expert_idx, dest_row, source_blocks, pairs_all):
                t.record_stream(side)
            self._fused_done = torch.cuda.Event()
            self._fused_done.record(side)
            # The GEMM queued next starts once every dispatch block holds its SM: the stream waits
            # on the device, or (no stream memory wait) the host waits below.
            waited = bool(self._stream_waits) and bool(self.ext.stream_wait_word(self._started_dev, e_disp))
            st.update(pairs_all=pairs_all, waited=waited, started=started, segs=segs,
                      waits=self._arrival_waits(segs, e_disp))
        elif not fused:
            self.ext.dispatch_rows(x, expert_idx, dest_row, None, self.fp8, self.num_experts, self.bufs.descriptor,
                                   self.direct_descriptor(True, e_counts), e_disp, self.num_blocks, seg_base, row_out,
                                   self.dedup, self.stores_own_rows_whole(in_place))
        if row_out is not None:
            dest_row = row_out
        st.update(counted=counted, e_disp=e_disp, local_counts=local_counts, num_recv=num_recv,
                  counts_all=counts_all, dest_row=dest_row)
        return st

    def _dispatch_collect(self, st: dict):
        """The rest of a dispatch whose kernels _dispatch_launch queued: the row count on the host
        (the exact-R form's one host sync), the received rows' tensor, and the copy-out (or, fused,
        the first GEMM queued)."""
        x, fused, in_place, num_recv, e_disp = st["x"], st["fused"], st["in_place"], st["num_recv"], st["e_disp"]
        if self.padded_recv:
            rows = self.bufs.recv_rows
        else:
            st["counted"].synchronize()  # the one host sync of the exact-R form: layout done, dispatch queued
            rows = int(self._num_recv_host[0])
            self.check()
        recv = self.direct.rows[:rows] if in_place else x.new_empty(rows, self.hidden_size)
        if fused:
            recv_pair = st["pairs_all"][:rows]
            if "job" in st and (rows == 0 or x.shape[0] == 0):
                # Interleaved roles, but no rows here to compute beside, or no tokens of this rank to
                # send (the GEMM's spare warps would run a job without source rows): the rest of the
                # dispatch (the take rounds, and the sends when the GEMM was to make them) runs alone,
                # on every SM, and the GEMM then finds every arrival word raised.
                jx, jidx, jrow, jblocks, direct, sent = st["job"]
                self.ext.dispatch_fused(jx, jidx, jrow, self.num_experts, self.bufs.descriptor, direct, e_disp,
                                        self.num_blocks, self.fused_dedup, jblocks, self.direct.rows,
                                        st["pairs_all"], None, sent, self.ep_size, True, *self._wait_args())
                st["waits"].comm_job = None
            if not st["waited"]:
                self._await_fused_start(e_disp, st["started"])
            # The first GEMM, queued now, before this returns to the caller: its tiles start on
            # this rank's own rows while the other sources' rows travel.
            from .gemm import grouped_mm_segments
            waits = st["waits"]
            self._fused_waits = waits
            waits.result = grouped_mm_segments(recv, st["fused_w"], st["segs"], st["fused_gemm"], waits)
        else:
            recv_pair = torch.empty(rows, dtype=torch.int32, device=x.device)
            self.ext.recv_copyout(num_recv, self.fp8, recv, recv_pair, self.bufs.descriptor, e_disp,
                                  *self._wait_args(), self.num_blocks, not in_place,
                                  self.num_experts // self.ep_size if self.ordering == "arrival" else 0, self.dedup)
        self.direct_stats["in_place" if in_place else "copied"] += 1
        return recv, st["local_counts"], st["dest_row"], recv_pair, num_recv, st["counts_all"]

    def set_comm_sms(self, blocks: int, fused: bool = False) -> None:
        """``blocks`` SMs for the copy kernels, or, with ``fused``, for the fused dispatch beside the
        first GEMM (the other copy kernels then run alone, on every SM)."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.fused_comm_blocks = int(blocks)
        self.num_blocks = sms if fused else int(blocks)

    # ------------------------------------------------------------------ the fused schedule
    def fuses(self) -> str:
        """Why this dispatcher cannot run the fused schedule's dispatch, or "". (A forward whose
        direct receive region is still in use runs the sequential dispatch instead; fused_stats
        counts both.)"""
        if self.padded_recv:
            return "padded_recv: the host does not read the row count"
        if self.ordering != "layout":
            return "arrival ordering (deterministic: false)"
        if self.fp8:
            return "FP8 dispatch (rows are dequantized on arrival)"
        if self.direct is None:
            return "direct receive is off (the GEMM reads the rows where they land)"
        if self.dtype != torch.bfloat16:
            return f"ds_uniep's grouped GEMM takes bf16 rows, not {self.dtype}"
        return ""

    def request_fused(self, weight: Tensor, configs: Optional[Dict[str, str]] = None) -> None:
        """Run the next forward dispatch fused (when its direct region is free). ``weight``
        (``[L, N, M]`` bf16, the first projection of the local experts): the dispatch queues that
        GEMM itself, right after its own launch; the caller takes :meth:`take_fused_waits` and
        hands them to its first projection, which adopts ``waits.result`` (``configs``: ds_uniep's
        GEMM configurations, as :func:`ds_uniep.gemm.grouped_linear` takes them)."""
        self._fuse_next = True
        self._fused_weight = (weight, configs)

    def take_fused_waits(self):
        """The :class:`ds_uniep.gemm.ArrivalWaits` of the last fused dispatch (once), or None when
        it ran sequential. The GEMM given them joins the dispatch's stream once queued."""
        waits, self._fused_waits = self._fused_waits, None
        return waits

    def _join_fused(self) -> None:
        """Order the current stream after the last fused dispatch (before anything but the waiting
        GEMM reads its rows or source pairs)."""
        if self._fused_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._fused_done)
            self._fused_done = None

    def _await_fused_start(self, epoch: int, word: Tensor) -> None:
        """Wait (on the host) until every block of the fused dispatch of ``epoch`` runs (they raise
        ``word``: pinned host memory, or a device word read back by the current stream, which does
        not wait for the dispatch): the GEMM queued next takes the other SMs and spins on the rows
        that those blocks take in, so all of them must hold an SM first."""
        start = time.monotonic()
        while (int(word[0]) - epoch) & 0xFFFFFFFF >= 1 << 31:  # before epoch, wrapping
            if time.monotonic() - start > self.timeout_ns / 1e9:
                self.check()
                raise UniEPTimeoutError(f"{self.layer_name}: rank {self.rank}: the fused dispatch's "
                                        f"{self.fused_comm_blocks} blocks did not all start within "
                                        f"{self.timeout_ns / 1e9:g} s (other kernels hold the SMs?)")
            time.sleep(0)

    def _fused_side_stream(self) -> torch.cuda.Stream:
        if self._fused_stream is None:
            self._fused_stream = torch.cuda.Stream(self.device)
        return self._fused_stream

    def _fused_gemm_sms(self) -> int:
        """SMs of the fused schedule's waiting GEMM: the rest of the GPU, even (2-CTA clusters);
        with interleaved roles all of it."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return max(2, (sms - (0 if self.interleaved else self.fused_comm_blocks)) // 2 * 2)

    def _wait_runs(self, counts_all: Tensor, tile_rows: int) -> Tensor:
        """The runs of rows the fused schedule's first GEMM runs over, each waiting for one source's
        arrival word (``[G * L, 4]`` int32 on the device: first row, rows, local expert, source), by
        ``signal_granularity``: ``"tile"``, runs of whole tiles (``tile_rows``), each waiting for the
        latest source among its rows (``layout.fused_runs``); ``"expert"``, each expert's rows one run
        waiting for the latest source among them; ``"rank"``, those runs all waiting for the last
        round's source (rank + 1), i.e. for every row here. The words rise in round order, so a wait
        for a round covers the earlier ones; every run is whole tiles of its expert, so the GEMM does
        the same tiles (and bits) under each."""
        # An alignment of the receive buffer's rows or more makes each expert's block one tile.
        whole = max(1, self.bufs.recv_rows)
        segs = self.ext.fused_segments(counts_all, self.rank, tile_rows if self.signal_granularity == "tile" else whole)
        if self.signal_granularity == "rank":
            segs[:, 3] = (self.rank + 1) % self.ep_size
        return segs

    def _arrival_waits(self, segs: Tensor, epoch: int):
        from .gemm import ArrivalWaits
        o = self.bufs.offsets
        signals = o["signals"] + 5 * MAX_RANKS * 4  # phase 5 (arrived): [MAX_RANKS] words, one per source
        return ArrivalWaits(segs=segs, ready=self.bufs.buffer[signals:signals + MAX_RANKS * 4].view(torch.int32),
                            epoch=epoch, timeout_ns=self.timeout_ns, error_record=self.error_record,
                            poison=self.bufs.buffer[o["status"]:o["status"] + 4].view(torch.int32),
                            layer_id=self.layer_id, rank=self.rank, phase=5, sm_count=self._fused_gemm_sms(),
                            done=self._fused_done)

    def stores_own_rows_whole(self, in_place: bool) -> bool:
        """Whether a forward dispatch received ``in_place`` stores this rank's own rows whole (the
        dispatch kernel's ``own_whole``): deduplicated dispatches with ``own_rows_whole`` set."""
        return self.dedup and in_place and self.own_rows_whole

    def combine_chunking(self) -> Tuple[int, int]:
        """(source tokens per chunk, chunks) of the chunked combine: the same on every rank, since
        they depend on ``max_tokens_per_rank`` only, not on this call's tokens. (0, 0) with
        ``combine_chunks`` 0 (push, then reduce)."""
        if not self.combine_chunks:
            return 0, 0
        chunk_tokens = max(-(-self.max_tokens // self.combine_chunks), self.combine_min_chunk_tokens)
        return chunk_tokens, -(-self.max_tokens // chunk_tokens)

    def _queue_workspace(self, rows: int) -> Tensor:
        """The chunked combine's queue workspace, large enough for this call's pushing blocks and
        ``rows`` (grown when not; stream-ordered, so consecutive combines share it). Zero when
        allocated; every launch leaves its header ready for the next, so nothing zeroes it per call."""
        pushers = self.combine_pushers()
        resident = 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        if pushers > resident:  # they meet at barriers, so all must be resident at once (two per SM)
            raise ValueError(f"{self.layer_name}: combine_push_queue needs every pushing block resident at once; "
                             f"{pushers} pushing blocks exceed the {resident} that fit on this GPU (two per SM)")
        need = self.ext.combine_queue_size(pushers, rows)
        if self._queue is None or self._queue.numel() < need:
            self._queue = torch.zeros(need, dtype=torch.int32, device=self.device)
        return self._queue

    def combine_pushers(self) -> int:
        """Pushing blocks of the chunked combine: ``combine_push_blocks``, or half of ``num_blocks``."""
        return self.combine_push_blocks or max(1, self.num_blocks // 2)

    def combine_trace_layout(self) -> Tuple[int, int]:
        """``(words per block, chunk words)`` of ``combine_trace``: block b's stamps start at word
        ``b * words per block``, a summing block's chunk c at ``3 + c`` (seen) and ``3 + chunk words
        + c`` (summed); the chunks' raise stamps follow the blocks' words."""
        chunk_words = self.ext.combine_trace_size(0)
        return self.ext.combine_trace_size(1) - chunk_words, chunk_words

    def combine_reducers(self) -> int:
        """Reducing blocks of the chunked combine: ``combine_reduce_blocks``, or by default
        ``num_blocks`` less the pushing blocks with the queue (one block per SM in all, each role
        on SMs of its own) and ``num_blocks`` without it (or where the pushers take them all)."""
        if self.combine_reduce_blocks:
            return self.combine_reduce_blocks
        pushers = self.combine_pushers()
        return self.num_blocks - pushers if self.combine_push_queue and pushers < self.num_blocks else self.num_blocks

    def _first_slots(self, expert_idx: Tensor) -> Tensor:
        """``expert_idx`` with every slot but the first of each destination rank dropped (-1): where the
        rank partials land, summed by ``combine_reduce`` in that order. Kept for the next call with the
        same tensor (a forward's combine and its dispatch's backward share the routing)."""
        cached, version, firsts = self._firsts
        if cached is expert_idx and version == expert_idx._version:
            return firsts
        from .reference import first_slots_of_ranks, slot_ranks
        rank = slot_ranks(expert_idx, self.num_experts // self.ep_size)
        firsts = torch.where(first_slots_of_ranks(rank), expert_idx, -1).contiguous()
        self._firsts = (expert_idx, expert_idx._version, firsts)
        return firsts

    def _stage_gates(self, gates: Tensor) -> int:
        """Write ``gates [T, k]`` fp32 into this rank's gates region and raise kPhaseGates on every
        rank (the expert ranks of a rank-partials combine read them there); returns its epoch. Queued
        after this rank's dispatch kernels, so every peer has finished reading what the previous
        combine or backward left there (they have reached this dispatch's counts exchange)."""
        self.bufs.gates[:gates.numel()].view(gates.shape).copy_(gates.detach())  # one copy: dtype and layout
        e = self._next_epoch(_PHASE_GATES)
        self.ext.signal_raise(self.bufs.descriptor, _PHASE_GATES, e, self.device.index)
        self._last_gates_epoch = e
        return e

    def _rank_partials(self, rows: Tensor, weights: Optional[Tensor], expert_idx: Tensor, recv_pair: Tensor,
                       num_recv: Tensor, T: int) -> Tensor:
        """compression.combine "rank_partials": each rank sums its rows of a source token (the token's
        slots on it) in slot order in fp32, times the gates when ``weights`` is given, casts the sum
        once and stores that one row at the token's first slot on it in the source's combine buffer;
        the source adds its tokens' rows (one per rank) in the order of those first slots, in fp32,
        cast once. A token crosses back to a rank once, as the deduplicated dispatch sends it."""
        gates_epoch, self._next_gates = self._next_gates, 0
        if weights is not None and not gates_epoch:
            # Not staged by this routing's dispatch (or overwritten since): staged now, and the expert
            # ranks wait for them.
            gates_epoch = self._stage_gates(weights)
        firsts = self._first_slots(expert_idx)
        if self._pair_table is None:
            self._pair_table = torch.zeros(self.ep_size * self.bufs.pairs_per_rank, dtype=torch.int64,
                                           device=self.device)
        self._table_epoch = self._table_epoch % 0xFFFFFFFF + 1  # a new tag each call: no reset needed
        e = self._next_epoch(2)
        self.ext.combine_partials_push(rows, recv_pair, num_recv, self._pair_table, self._table_epoch, self.k,
                                       weights is not None, gates_epoch, self.bufs.descriptor, e, *self._wait_args(),
                                       self.num_blocks)
        out = rows.new_empty(T, self.hidden_size)
        self.ext.combine_reduce(firsts, None, self.num_experts, out, self.bufs.descriptor, e, *self._wait_args(),
                                self.num_blocks)
        self.combine_stats["rank_partials"] += 1
        return out

    def _push_and_reduce(self, rows: Tensor, weights: Optional[Tensor], expert_idx: Tensor, recv_pair: Tensor,
                         num_recv: Tensor, T: int) -> Tensor:
        if self.rank_partials:
            return self._rank_partials(rows, weights, expert_idx, recv_pair, num_recv, T)
        # Checked before the epoch moves on, so a refused call leaves the ranks in step.
        chunked = self.combine_chunks and self.ordering != "arrival"
        queue = self._queue_workspace(rows.shape[0]) if chunked and self.combine_push_queue else None
        self.combine_stats["queued"] += int(queue is not None)
        e = self._next_epoch(2)
        out = rows.new_empty(T, self.hidden_size)
        nb = self.num_blocks
        if self.ordering == "arrival":  # weights: the gates staged at dispatch
            self.ext.combine_atomic(rows, recv_pair, num_recv, weights is not None, self.k, self.acc.ptrs,
                                    self.bufs.descriptor, e, nb)
            self.ext.acc_cast(self.acc.rows, out, self.bufs.descriptor, e, *self._wait_args(), nb)
            return out
        if self.combine_chunks:
            reduce_blocks = self.combine_reducers()
            chunk_tokens, num_chunks = self.combine_chunking()
            self.ext.combine_chunked(rows, recv_pair, num_recv, expert_idx, weights, self.num_experts, out,
                                     self.bufs.descriptor, e, *self._wait_args(), self.combine_pushers(),
                                     reduce_blocks, chunk_tokens, num_chunks, self.combine_push_lead, queue,
                                     self.combine_queue_gpu_fence, self.combine_trace)
            return out
        self.ext.combine_push(rows, recv_pair, num_recv, self.bufs.descriptor, e, nb)
        self.ext.combine_reduce(expert_idx, weights, self.num_experts, out, self.bufs.descriptor, e,
                                *self._wait_args(), nb)
        return out

    def _barrier(self) -> None:
        # Backward ops store into peers' buffers without a counts exchange first: the barrier
        # makes sure every peer has finished reading what the previous op left there.
        self._keep_landed()
        self.ext.barrier(self.bufs.descriptor, self._next_epoch(3), *self._wait_args(), self.device.index)
        self._peers_may_read_source = False

    def _keep_landed(self) -> None:
        """Before peers may store into this rank's combine buffer again (a counts exchange or a
        barrier follows): if an epilogue combine's rows there may still be read by a backward
        (two forwards before a backward, a graph kept), copy them out for it first."""
        landed, self._landed = self._landed() if self._landed is not None else None, None
        if landed is not None:
            landed.keep(self)

    def comb_bases(self):
        """Every rank's combine buffer address (a list of G ints)."""
        return [p + self.bufs.offsets["comb"] for p in self.bufs.descriptor[:self.ep_size]]

    def comb_bases_device(self) -> Tensor:
        """:meth:`comb_bases` as ``[G]`` int64 on this rank's device (made once)."""
        if self._comb_bases_dev is None:
            self._comb_bases_dev = torch.tensor(self.comb_bases(), dtype=torch.int64, device=self.device)
        return self._comb_bases_dev

    def comb_rows(self, rows: int) -> Tensor:
        """The first ``rows`` rows of this rank's combine buffer, ``[rows, M]``, a view."""
        o = self.bufs.offsets["comb"]
        return self.bufs.buffer[o:o + rows * self.bufs.comb_row_bytes].view(self.dtype).view(rows, self.hidden_size)

    def _pulls_from(self, y: Tensor) -> bool:
        # Storage pointers: an empty view (a rank that received no rows) has no data_ptr.
        return (self.source is not None and y.storage_offset() == 0 and
                y.untyped_storage().data_ptr() == self.source.buffer.untyped_storage().data_ptr())

    def _combine_fwd(self, y, gates, expert_idx, dest_row, recv_pair, num_recv):
        self._join_fused()
        self.check()
        if self.rank_partials or not self._pulls_from(y):
            self.combine_stats["pushed"] += 1
            return self._push_and_reduce(y, gates, expert_idx, recv_pair, num_recv, expert_idx.shape[0])
        out = y.new_empty(expert_idx.shape[0], self.hidden_size)
        self.ext.combine_pull(expert_idx, dest_row, gates, self.num_experts, out, self.source.ptrs,
                              self.bufs.descriptor, self._next_epoch(4), *self._wait_args(), self.pull_blocks)
        self._peers_may_read_source = True
        self.combine_stats["pulled"] += 1
        return out

    def combine_source(self, rows: int) -> Tensor:
        """Where to write the expert outputs ``[rows, M]`` (rows in recv's order) so that
        :meth:`combine` pulls them: a view of this layer's source region when it was allocated
        (``pull_combine``) and nothing else holds a view of it, else a new tensor (combine then
        pushes). Ask again before each write: this waits, on the device, until no peer still
        reads the region from the previous combine."""
        if rows > self.bufs.recv_rows:
            raise UniEPCapacityError(f"{self.layer_name}: rank {self.rank} asked for {rows} source rows, the "
                                     f"region holds {self.bufs.recv_rows}")
        if self.source is None or not self.source.free():
            return torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        if self._peers_may_read_source:
            self._barrier()
        return self.source.fresh_view()[:rows]

    def _dispatch_bwd(self, grad_recv, expert_idx, recv_pair, num_recv):
        # Gradient of dispatch: each token's k row gradients summed in slot order (fp32, cast once).
        self.check()
        self._barrier()
        return self._push_and_reduce(grad_recv, None, expert_idx, recv_pair, num_recv, expert_idx.shape[0])

    def pipelines(self) -> str:
        """Why this dispatcher cannot run the pipelined schedule (``ds_uniep.pipelined``), or ""."""
        if self.padded_recv:
            return "padded_recv: the host does not read the counts"
        if self.ordering != "layout":
            return "arrival ordering (deterministic: false)"
        if not self.gate_grad_on_experts:
            return "gate_grad_on_experts=False"
        return ""

    def comm_stream(self, dst: int) -> torch.cuda.Stream:
        """The side stream of the pipelined schedule's copy-engine copies to rank ``dst``."""
        if self._comm_streams is None:
            self._comm_streams = [torch.cuda.Stream(self.device) for _ in range(self.ep_size)]
        return self._comm_streams[dst]

    def _combine_bwd(self, grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv):
        # grad_y is a dispatch of grad_out weighted by the gates, in the same layout;
        # grad_gates[t, j] = <grad_out[t], y row of (t, j)>. y: [R, M], or the pipelined
        # schedule's chunks [(first row, rows)], which get grad_y as chunks too.
        self.check()
        self._barrier()
        if not self.gate_grad_on_experts:
            return self._combine_bwd_at_sources(grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv)
        # Unweighted grad_out rows travel to the experts, with the gates in this rank's gates
        # region; the expert rank scales each row by its gate and sends back only the dot
        # products, so y never travels back.
        T = expert_idx.shape[0]
        self.bufs.gates[:gates.numel()].copy_(gates.reshape(-1))
        self._last_gates_epoch = 0  # what a dispatch staged there is gone
        e_disp = self._next_epoch(1)
        self.ext.dispatch_rows(grad_out, expert_idx, dest_row, None, False, self.num_experts, self.bufs.descriptor,
                               self.direct_descriptor(False, 0), e_disp, self.num_blocks, None, None, self.dedup, False)
        e = self._next_epoch(2)
        chunks = y if isinstance(y, list) else [(0, y)]  # pipelines() holds gate_grad_on_experts for chunks
        rows = chunks[-1][0] + chunks[-1][1].shape[0]
        grad_y = chunks[0][1].new_empty(rows, self.hidden_size)
        grad_ys = []
        for i, (r0, y_c) in enumerate(chunks):
            grad_ys.append(grad_y[r0:r0 + y_c.shape[0]])
            self.ext.combine_bwd_rows(y_c, num_recv, grad_ys[-1], self.bufs.descriptor, e_disp, e,
                                      *self._wait_args(), self.num_blocks, self.dedup, r0, i == len(chunks) - 1)
        if isinstance(y, list):
            grad_y = grad_ys
        grad_gates = torch.empty(T, self.k, dtype=torch.float32, device=grad_out.device)
        self.ext.gate_collect(expert_idx, self.num_experts, grad_gates, self.bufs.descriptor, e, *self._wait_args(),
                              min(self.num_blocks, max(1, -(-gates.numel() // 1024))))
        return grad_y, grad_gates

    def _combine_bwd_at_sources(self, grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv):
        # y's rows go back to their sources, which form the dot products; then a weighted dispatch.
        T = expert_idx.shape[0]
        e = self._next_epoch(2)
        self.ext.combine_push(y, recv_pair, num_recv, self.bufs.descriptor, e, self.num_blocks)
        grad_gates = torch.empty(T, self.k, dtype=torch.float32, device=y.device)
        self.ext.gate_grad(expert_idx, grad_out, self.num_experts, grad_gates, self.bufs.descriptor, e,
                           *self._wait_args(), self.num_blocks)
        e_disp = self._next_epoch(1)
        self.ext.dispatch_rows(grad_out, expert_idx, dest_row, gates, False, self.num_experts, self.bufs.descriptor,
                               self.direct_descriptor(False, 0), e_disp, self.num_blocks, None, None, False, False)
        grad_y = y.new_empty(y.shape)
        scratch_pair = torch.empty(y.shape[0], dtype=torch.int32, device=y.device)
        self.ext.recv_copyout(num_recv, False, grad_y, scratch_pair, self.bufs.descriptor, e_disp,
                              *self._wait_args(), self.num_blocks, True, 0, False)
        return grad_y, grad_gates

    # ------------------------------------------------------------------ the protocol
    def checked_inputs(self, x: Tensor, expert_idx: Tensor) -> Tuple[Tensor, Tensor]:
        """(x contiguous, expert_idx as contiguous int32 on x's device), after checking both against
        the buffers' sizes, the hidden size and the activation dtype."""
        T, k = expert_idx.shape
        self._check_tokens(T, k)
        if x.shape != (T, self.hidden_size) or x.dtype != self.dtype:
            raise ValueError(f"{self.layer_name}: x must be [{T}, {self.hidden_size}] {self.dtype}, got "
                             f"{tuple(x.shape)} {x.dtype}")
        return x.contiguous(), expert_idx.to(device=x.device, dtype=torch.int32).contiguous()

    def dispatch(self, x: Tensor, expert_idx: Tensor, gates: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Tensor, NVLinkHandle]:
        """x ``[T, M]`` activation dtype, expert_idx ``[T, k]`` int (-1 dropped) ->
        (recv ``[R, M]`` (``[R_max, M]`` if padded_recv), local_expert_counts ``[L]`` int64, handle).
        ``gates [T, k]``: the weights the following :meth:`combine` gets; needed with arrival
        ordering, which stages them for the expert ranks; with ``compression.combine``
        "rank_partials" they are staged for the expert ranks here too, and that combine (given this
        handle) weights the rows by these gates, not by the ones it is given, so pass it the same
        (given none here, the combine stages its own and the expert ranks wait for them)."""
        T, k = expert_idx.shape
        x, idx = self.checked_inputs(x, expert_idx)
        staged = None
        if self.ordering == "arrival":
            if gates is None or gates.shape != (T, k):
                raise ValueError(f"{self.layer_name}: arrival ordering needs the gates [{T}, {k}] at dispatch, got "
                                 f"{None if gates is None else tuple(gates.shape)}")
            staged = gates.detach().to(device=x.device, dtype=torch.float32).contiguous()
        recv, local_counts, dest_row, recv_pair, num_recv, counts_all = _DispatchFn.apply(
            x, idx, staged, self.layer_id)
        gates_epoch = 0
        if self.rank_partials and gates is not None:
            # The combine's expert ranks weight the rows: the gates wait in this rank's gates region.
            if gates.shape != (T, k):
                raise ValueError(f"{self.layer_name}: gates must be [{T}, {k}], got {tuple(gates.shape)}")
            gates_epoch = self._stage_gates(gates)
        handle = NVLinkHandle(expert_idx=idx, dest_row=dest_row, recv_pair=recv_pair, num_recv=num_recv,
                              counts_all=counts_all, local_expert_counts=local_counts, gates_epoch=gates_epoch)
        return recv, local_counts, handle

    def combine(self, y: Tensor, gates: Tensor, handle: NVLinkHandle) -> Tensor:
        """y ``[rows, M]`` (rows of recv), gates ``[T, k]`` fp32 -> out ``[T, M]`` in y's dtype."""
        if y.shape != (handle.recv_pair.shape[0], self.hidden_size):
            raise ValueError(f"{self.layer_name}: y must be [{handle.recv_pair.shape[0]}, {self.hidden_size}], "
                             f"got {tuple(y.shape)}")
        if gates.shape != handle.expert_idx.shape:
            raise ValueError(f"{self.layer_name}: gates must be {tuple(handle.expert_idx.shape)}, got "
                             f"{tuple(gates.shape)}")
        # Rank partials: the gates this handle's dispatch staged, if the region still holds them (the
        # same on every rank: every rank stages and overwrites in the same order).
        staged = handle.gates_epoch
        self._next_gates = staged if staged and staged == self._last_gates_epoch else 0
        return _CombineFn.apply(y.contiguous(), gates.float().contiguous(), handle.expert_idx, handle.dest_row,
                                handle.recv_pair, handle.num_recv, self.layer_id)


# ---------------------------------------------------------------------------------------------
# custom ops (the boundary torch sees) and autograd
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("ds_uniep::nvl_dispatch", mutates_args=())
def nvl_dispatch(x: Tensor, expert_idx: Tensor, gates: Optional[Tensor],
                 ctx_id: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (recv [rows, M], local_expert_counts [L] i64, dest_row [T, k] i32, recv_pair [rows] i32,
    num_recv [1] i32, counts_all [G, E] i64). gates [T, k] fp32: arrival ordering only."""
    return _get(ctx_id)._dispatch_fwd(x, expert_idx, gates)


@nvl_dispatch.register_fake
def _(x, expert_idx, gates, ctx_id):
    d = _get(ctx_id)
    rows = d.bufs.recv_rows if d.padded_recv else torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty(rows, x.shape[1]), torch.empty(d.num_experts // d.ep_size, dtype=torch.int64,
                                                       device=x.device), torch.empty(expert_idx.shape, **i32),
            torch.empty(rows, **i32), torch.empty(1, **i32),
            torch.empty(d.ep_size, d.num_experts, dtype=torch.int64, device=x.device))


@torch.library.custom_op("ds_uniep::nvl_combine", mutates_args=())
def nvl_combine(y: Tensor, gates: Tensor, expert_idx: Tensor, dest_row: Tensor, recv_pair: Tensor,
                num_recv: Tensor, ctx_id: int) -> Tensor:
    """-> out [T, M] = cast(sum_j gates[t, j] * float(y[row of (t, j)])), slot order, fp32."""
    return _get(ctx_id)._combine_fwd(y, gates, expert_idx, dest_row, recv_pair, num_recv)


@nvl_combine.register_fake
def _(y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id):
    return y.new_empty(expert_idx.shape[0], y.shape[1])


@torch.library.custom_op("ds_uniep::nvl_dispatch_backward", mutates_args=())
def nvl_dispatch_backward(grad_recv: Tensor, expert_idx: Tensor, recv_pair: Tensor, num_recv: Tensor,
                          ctx_id: int) -> Tensor:
    """-> grad_x [T, M] = cast(sum_j float(grad_recv[row of (t, j)])), slot order, fp32."""
    return _get(ctx_id)._dispatch_bwd(grad_recv, expert_idx, recv_pair, num_recv)


@nvl_dispatch_backward.register_fake
def _(grad_recv, expert_idx, recv_pair, num_recv, ctx_id):
    return grad_recv.new_empty(expert_idx.shape[0], grad_recv.shape[1])


@torch.library.custom_op("ds_uniep::nvl_combine_backward", mutates_args=())
def nvl_combine_backward(grad_out: Tensor, y: Tensor, gates: Tensor, expert_idx: Tensor, dest_row: Tensor,
                         recv_pair: Tensor, num_recv: Tensor, ctx_id: int) -> Tuple[Tensor, Tensor]:
    """-> (grad_y [rows, M] = cast(gates[t, j] * float(grad_out[t])) at the row of (t, j),
    grad_gates [T, k] fp32 = <grad_out[t], y[row of (t, j)]>)."""
    return _get(ctx_id)._combine_bwd(grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv)


@nvl_combine_backward.register_fake
def _(grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id):
    return y.new_empty(y.shape), gates.new_empty(gates.shape)


class _DispatchFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, expert_idx, gates, ctx_id):
        outs = nvl_dispatch(x, expert_idx, gates, ctx_id)
        recv, local_counts, dest_row, recv_pair, num_recv, counts_all = outs
        ctx.ctx_id = ctx_id
        ctx.save_for_backward(expert_idx, recv_pair, num_recv)
        ctx.mark_non_differentiable(local_counts, dest_row, recv_pair, num_recv, counts_all)
        return outs

    @staticmethod
    def backward(ctx, grad_recv, *unused):
        expert_idx, recv_pair, num_recv = ctx.saved_tensors
        if grad_recv is None:
            return None, None, None, None
        grad_x = nvl_dispatch_backward(grad_recv.contiguous(), expert_idx, recv_pair, num_recv, ctx.ctx_id)
        return grad_x, None, None, None


class _CombineFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id):
        ctx.ctx_id = ctx_id
        ctx.save_for_backward(y, gates, expert_idx, dest_row, recv_pair, num_recv)
        return nvl_combine(y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id)

    @staticmethod
    def backward(ctx, grad_out):
        y, gates, expert_idx, dest_row, recv_pair, num_recv = ctx.saved_tensors
        grad_y, grad_gates = nvl_combine_backward(grad_out.to(y.dtype).contiguous(), y, gates, expert_idx, dest_row,
                                                  recv_pair, num_recv, ctx.ctx_id)
        return grad_y, grad_gates, None, None, None, None, None
