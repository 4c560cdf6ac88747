"""The NVLink dispatcher of one megakernel layer: its state, its knobs, and the dispatch side
(counts exchange and layout, the rows' stores, the copy-out or the fused schedule's first GEMM).
The combine side is :class:`ds_uniep.megakernel.combine._CombineSteps`; what torch sees is in
:mod:`ds_uniep.megakernel.autograd`; the buffers are in :mod:`ds_uniep.megakernel.buffers`."""

import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from .._ops import ext, ops_package
from ..errors import UniEPTimeoutError
from ..faults import stop_point
from ..knobs import FUSED_COMM_SMS, Knobs
from . import autograd
from .buffers import (FP8_GROUP, MAX_EXPERTS, MAX_RANKS, MAX_TOP_K, PHASE_ARRIVED, PHASE_COUNTS,
                      PHASE_DISPATCH, PHASE_NAMES, _Dims, _DirectView, _LayerBuffers, buffer_set, one_op)
from .combine import _CombineSteps


class UniEPCapacityError(ValueError):
    """An input larger than the symmetric buffers were sized for."""


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
    #: compression.combine "rank_partials": the PHASE_GATES epoch of the gates dispatch staged for the
    #: combine (0: none; the combine then stages the gates it gets).
    gates_epoch: int = 0


class NVLinkDispatcher(_CombineSteps):
    """Dispatch/combine over NVLink peers through symmetric memory (one per MoE layer).

    Args:
        layer_name: names the layer in every error.
        num_experts: E; ep_size: G (the size of ``group``); hidden_size: M; k: slots per token.
        dtype: activation dtype (bf16, fp16 or fp32) of x and y.
        config: the layer's ``uniep`` block (a :class:`ds_uniep.config.UniEPConfig`, or anything
            ``UniEPConfig.coerce`` takes). Read once: ``max_tokens_per_rank`` (T_max, the buffers'
            size); its knobs (:meth:`set_knobs` takes new ones later): ``schedule`` and
            ``num_comm_sms`` (the copy kernels' blocks), ``roles`` and ``signal_granularity`` (the
            fused dispatch), ``combine_chunks`` and ``combine_queue`` (the combine kernels) and
            ``dispatch_dtype`` (fixed for the dispatcher's life: FP8 rows size the buffers);
            ``overlap.timeout_s`` (how long a kernel waits on a peer before it records an error);
            ``compression.combine`` "rank_partials" (each rank sums its rows of a token before they
            travel back, :meth:`_rank_partials`); ``sync_free`` (no host read of counts and no
            host-held epochs in any op: dispatch returns ``recv [R_max, M]`` (``padded_recv``), rows
            land in the staging region and the buffer set's epochs live on the device, so the ops can
            be captured in a CUDA graph and replayed; a timeout under a replay is raised by the next
            eager call, or :meth:`check`).
        group: the expert-parallel process group (None: the world).

    :meth:`from_config` builds one from a ``uniep`` block.

    Forward dispatches send a token's row to a destination rank once, however many of its slots
    go there (``dedup``; the receiver copies it into the rows of the token's other slots: the same
    bits, fewer NVLink bytes); not with FP8 dispatch. The combine (and the backward of dispatch)
    runs as one kernel pipelined over ``combine_chunks`` chunks of source tokens
    (``max_tokens`` split evenly, but no chunk under ``combine_min_chunk_tokens``), so a source
    sums a chunk's rows while later chunks are still being pushed; with ``combine_queue`` its
    pushing warps take their rows from one shared queue. 0 chunks: push, then reduce, as two
    kernels. The output bits are the same either way (:meth:`combine_chunking`).

    Attributes read at each call, which tests set to reach every kernel path (the same bits under
    each): ``padded_recv`` (return ``recv [R_max, M]`` without a host sync, see the module doc),
    ``dedup``, ``gate_grad_on_experts`` (the backward of combine sends grad_out's rows and the
    gates to the expert ranks, which send back only the gate gradients; False: the expert outputs
    travel back to their sources first), ``combine_min_chunk_tokens``, ``combine_push_blocks``
    (default half of ``num_blocks``), ``combine_reduce_blocks`` (default: ``num_blocks`` less the
    pushing blocks with the queue, ``num_blocks`` without), ``combine_queue_gpu_fence`` (with the
    queue, a pushing warp fences at GPU scope and only the warp that completes a chunk at system
    scope; False: every warp at system scope), ``interleaved_items`` and ``interleaved_sends``
    (the interleaved fused dispatch's job, see ``__init__``). Setting ``direct`` to None makes
    every dispatch use the staging region.
    """

    def __init__(self, layer_name: str, num_experts: int, ep_size: int, hidden_size: int, k: int,
                 dtype: torch.dtype, config, group=None):
        from ..config import UniEPConfig
        config = UniEPConfig.coerce(config)
        knobs, max_tokens, timeout_s = config.knobs(), config.max_tokens_per_rank, config.overlap.timeout_s
        rank_partials, sync_free = config.compression.combine == "rank_partials", config.sync_free
        self.layer_name = layer_name
        self.num_experts, self.ep_size, self.hidden_size, self.k = num_experts, ep_size, hidden_size, k
        self.dtype = dtype
        self.group = group
        self.fp8 = knobs.dispatch_dtype == "fp8_e4m3"
        self.max_tokens = max_tokens
        self.timeout_ns = int(timeout_s * 1e9)
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
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{where}: activation dtype {dtype} is not bf16, fp16 or fp32")
        #: compression.combine "rank_partials": each rank sums its rows of a token before they travel
        #: (see _rank_partials)
        self.rank_partials = rank_partials
        if sync_free and rank_partials:
            raise ValueError(f"{where}: sync_free does not run compression.combine 'rank_partials' (its gates "
                             "staging is tagged on the host)")
        self.sync_free = sync_free
        elsize = torch.empty(0, dtype=dtype).element_size()
        if hidden_size * elsize % 16:
            raise ValueError(f"{where}: rows of {hidden_size} x {dtype} are not a multiple of 16 bytes")
        if self.fp8 and hidden_size % FP8_GROUP:
            raise ValueError(f"{where}: FP8 dispatch needs hidden_size divisible by {FP8_GROUP}, got {hidden_size}")
        ok, reason = ops_package().megakernel_available(torch.device("cuda", torch.cuda.current_device()))
        if not ok:
            raise RuntimeError(f"{where}: the NVLink dispatcher cannot run here: {reason}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.ext = ext()
        #: the buffer set this layer shares with the others of its group, device and dtypes
        #: (:mod:`ds_uniep.megakernel.buffers`), and this layer's view of its symmetric buffer
        dims = _Dims(num_experts, ep_size, self.max_tokens, k, hidden_size, elsize, self.fp8)
        self._set = buffer_set(dims, dtype, self.fp8, group, self.device, device_epochs=sync_free)
        self.bufs = _LayerBuffers(self._set, dims, self.rank, ep_size)
        #: this layer's rows of the set's direct receive region (None: FP8 dispatch, or sync-free, whose
        #: captured calls cannot ask whether the region is free; setting it to None makes every
        #: dispatch use the staging region)
        self.direct = (None if self.fp8 or sync_free else
                       _DirectView(self._set.direct, dims.recv_rows, hidden_size, dtype))
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        # Test hooks (see the class doc); the defaults are what the layer runs.
        self.padded_recv = sync_free
        self.dedup = not self.fp8
        self.gate_grad_on_experts = True
        self.combine_min_chunk_tokens = 256
        self.combine_push_blocks: Optional[int] = None  # None: half of num_blocks, read at each combine
        self.combine_reduce_blocks: Optional[int] = None
        self.combine_queue_gpu_fence = True
        #: the interleaved fused dispatch's job: tokens per send item, rows per take item, whether rows
        #: about to be read are prefetched to L2, and the warps per CTA that run it (1 or 2)
        self.interleaved_items = (16, 64, True, 1)
        #: whether that job sends the other ranks' rows too; False: every SM sends them, one rank
        #: after another, before the GEMM (only the takes run in the GEMM's spare warps)
        self.interleaved_sends = False
        self.set_knobs(knobs)
        self._comb_bases_dev = None  # comb_bases_device(), made on first use
        self._queue = None  # the chunked combine's queue workspace, grown on demand
        if sync_free and self.combine_chunks and self.combine_queue:
            self._queue_workspace(self.bufs.recv_rows)  # every call's rows: made now, outside any graph
        #: forward dispatches whose rows were received in place / copied out of staging
        self.direct_stats = {"in_place": 0, "copied": 0}
        #: forward dispatches whose kernels dispatch_begin queued
        self.early_dispatches = 0
        #: forward combines that pushed rows back / ran pipelined / summed the rows the fused
        #: schedule's second GEMM stored (epilogue combine); backward dispatches whose input-gradient
        #: rows the first GEMM's dgrad stored (landed_dgrad); chunked combines, forward or backward,
        #: whose pushing blocks shared one queue (queued); rank-partials combines
        self.combine_stats = {"pushed": 0, "pipelined": 0, "landed": 0, "landed_dgrad": 0, "queued": 0,
                              "rank_partials": 0}
        # (expert_idx, its version, its first slot per rank) of the last rank-partials combine
        self._firsts = (None, -1, None)
        # rank partials: the local pair table ([G * pairs_per_rank] int64, made on first use) and its tag,
        # and the PHASE_GATES epoch the next combine's handle brought
        self._pair_table = None
        self._table_epoch = 0
        self._next_gates = 0
        #: the pipelined schedule's copy kernels (one per chunk and destination on the copy engines,
        #: one per chunk by SM stores), forward and backward
        self.push_stats = {"copy_engines": 0, "sm_stores": 0}
        self.error_record = self._set.error_record  # the set's: a timeout stops every layer sharing it
        self._num_recv_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # R of the exact-R form
        # every rank's counts per expert, read with R (the pipelined schedule plans its copies by them)
        self._counts_host = torch.zeros(ep_size, num_experts, dtype=torch.int64, pin_memory=True)
        self._comm_streams = None  # the pipelined schedule's copy-engine streams, made on first use
        # The fused schedule: its dispatch's side stream, the next dispatch's request, and what the
        # waiting GEMM of the last fused dispatch needs.
        self._fused_stream = None
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
        self.layer_id = autograd.register(self)

    @classmethod
    def from_config(cls, layer_name: str, num_experts: int, ep_size: int, hidden_size: int, k: int,
                    dtype: torch.dtype, config, group=None) -> "NVLinkDispatcher":
        """The same as the constructor (the name the layer, the tests and the benchmarks use)."""
        return cls(layer_name, num_experts, ep_size, hidden_size, k, dtype, config, group)

    def set_config(self, config) -> None:
        """Run the next calls under the knobs of ``config`` (a ``uniep`` block, e.g. a tuning plan's):
        :meth:`set_knobs` of ``config.knobs()``."""
        self.set_knobs(config.knobs())

    def set_knobs(self, knobs: Knobs) -> None:
        """Run the next calls under ``knobs`` (in place: the buffers stay). ``num_comm_sms`` is the
        block count of the copy kernels (None: one block per SM); under the fused schedule it is what
        the fused dispatch keeps beside the first GEMM in partitioned roles (None: FUSED_COMM_SMS) and
        the other copy kernels run alone, on every SM. A new ``dispatch_dtype`` needs a new dispatcher."""
        if (knobs.dispatch_dtype == "fp8_e4m3") != self.fp8:
            raise ValueError(f"{self.layer_name}: dispatch_dtype {knobs.dispatch_dtype!r} needs a new dispatcher "
                             "(FP8 rows size the buffers)")
        fused = knobs.schedule == "fused"
        self.knobs = knobs
        self.num_blocks = self.sm_count if fused or knobs.num_comm_sms is None else knobs.num_comm_sms
        #: the fused dispatch's blocks in partitioned roles (the GEMM takes the other SMs)
        self.fused_comm_blocks = knobs.num_comm_sms or FUSED_COMM_SMS
        #: interleaved roles: the fused dispatch's arrivals are taken (source pairs, deduplicated
        #: copies) in a spare warp of each of the waiting GEMM's CTAs, which then has every SM,
        #: instead of on fused_comm_blocks SMs beside it
        self.interleaved = knobs.roles == "interleaved"
        #: what one wait of the fused schedule's first GEMM covers (see _wait_runs)
        self.signal_granularity = knobs.signal_granularity
        self.combine_chunks = knobs.combine_chunks
        self.combine_queue = knobs.combine_queue

    # ------------------------------------------------------------------ bookkeeping
    def _next_epoch(self, phase: int) -> int:
        # Every rank calls the same ops of the set's layers in the same order, so epochs agree.
        return self._set.next_epoch(phase)

    def direct_descriptor(self, use: bool, counts_epoch: int):
        """The DirectView of ops/csrc/types.h: direct-region bases, whether flags apply, their epoch."""
        ptrs = self.direct.ptrs if self.direct is not None else [0] * MAX_RANKS
        return ptrs + [int(use and self.direct is not None), counts_epoch]

    def _wait_args(self):
        return self.timeout_ns, self.error_record, self.layer_id

    def check(self, synchronize: bool = False) -> None:
        """Raise :class:`UniEPTimeoutError` if a kernel of this layer, or of another layer sharing its
        buffers, gave up waiting."""
        if synchronize:
            torch.cuda.current_stream(self.device).synchronize()
        rec = self.error_record.tolist()
        if rec[0]:
            phase = PHASE_NAMES[rec[1]] if 0 <= rec[1] < len(PHASE_NAMES) else str(rec[1])
            waited = autograd.layer_name(rec[6]) or f"layer {rec[6]}"
            where = "" if waited == self.layer_name else f" (in {waited}, which shares its buffers)"
            raise UniEPTimeoutError(
                f"{self.layer_name}: rank {rec[5]} timed out{where} after {self.timeout_ns / 1e9:g} s waiting for "
                f"the '{phase}' signal of rank {rec[2]} (epoch {rec[3]}, saw {rec[4]}); a peer did not reach the "
                "same call, or died. The buffers of this layer and of the layers sharing them are unusable from "
                "here on.")

    def _check_tokens(self, T: int, k: int) -> None:
        if T > self.max_tokens:
            raise UniEPCapacityError(
                f"{self.layer_name}: rank {self.rank} got {T} tokens but its symmetric buffers were sized for "
                f"max_tokens_per_rank = {self.max_tokens}; set \"uniep\": {{\"max_tokens_per_rank\": {T}}} or more")
        if k != self.k:
            raise UniEPCapacityError(f"{self.layer_name}: rank {self.rank} got k = {k} slots per token, the "
                                     f"buffers were sized for k = {self.k}")

    # ------------------------------------------------------------------ raw steps (no autograd)
    @one_op
    def _dispatch_fwd(self, x: Tensor, expert_idx: Tensor, host_counts: bool = False):
        # host_counts: also bring every rank's counts to the host (``_counts_host``) with R.
        pending, self._pending = self._pending, None
        if pending is None:
            return self._dispatch_collect(self._dispatch_launch(x, expert_idx, host_counts))
        # dispatch_begin queued this dispatch's kernels already: only the row count is left to read.
        px, pidx, launched = pending
        same = (px.data_ptr(), px.shape, pidx.data_ptr(), pidx.shape) == (
            x.data_ptr(), x.shape, expert_idx.data_ptr(), expert_idx.shape)
        if not same or host_counts:
            raise RuntimeError(f"{self.layer_name}: dispatch() got other inputs than the dispatch_begin() before "
                               "it; call dispatch() next with the same x and expert_idx")
        return self._dispatch_collect(launched)

    def dispatch_begin(self, x: Tensor, expert_idx: Tensor) -> bool:
        """Queue the next :meth:`dispatch`'s kernels now (counts exchange, layout, the rows' stores),
        so that the host work the caller does before calling :meth:`dispatch` with the same ``x``
        and ``expert_idx`` overlaps them; that call then only reads the row count and returns. The
        same kernels, the same results (a :meth:`request_fused` before this call applies to it).
        Returns True (the kernels are queued)."""
        if self._pending is not None:
            raise RuntimeError(f"{self.layer_name}: dispatch_begin() twice without a dispatch() between")
        x, idx = self.checked_inputs(x, expert_idx)
        self._pending = (x, idx, self._dispatch_launch(x, idx, False))
        self.early_dispatches += 1
        return True

    def pending_local_counts(self) -> Tensor:
        """The ``[L]`` rows per local expert of the dispatch that :meth:`dispatch_begin` queued (a
        device tensor the layout kernel fills; the one :meth:`dispatch` returns), so that work on
        them can be queued before :meth:`dispatch` waits for the row count."""
        if self._pending is None:
            raise RuntimeError(f"{self.layer_name}: pending_local_counts() needs a dispatch_begin() before it")
        return self._pending[2]["local_counts"]

    def _dispatch_launch(self, x: Tensor, expert_idx: Tensor, host_counts: bool) -> dict:
        """The dispatch's kernels, up to where the host needs the row count (see _dispatch_collect)."""
        self.check()
        self._set.keep_landed()  # peers may store into this rank's combine buffer once the counts are out
        e_counts = self._next_epoch(PHASE_COUNTS)
        in_place = self.direct is not None and self.direct.free()
        asked, self._fuse_next = self._fuse_next, False
        fused = asked and in_place  # rows received in place, so the GEMM reads them where they land
        if not fused:
            self._fused_weight = None
        if asked:
            self.fused_stats["fused" if fused else "sequential"] += 1
        st = {"x": x, "fused": fused, "in_place": in_place}
        if fused:
            from ..gemm import fused_config
            (fused_w, configs), self._fused_weight = self._fused_weight, None
            fused_gemm = fused_config(configs)
            if self._stream_waits is None:
                # A wait that holds at once (the word is 0, cyclic >= 0) tells whether the driver offers it.
                self._stream_waits = bool(self.ext.stream_wait_word(self._started_dev, 0))
            st.update(fused_w=fused_w, fused_gemm=fused_gemm)
        local_counts, num_recv, counts_all, dest_row = self.ext.layout(expert_idx, self.num_experts,
                                                                       self.bufs.descriptor, e_counts,
                                                                       *self._wait_args(), in_place)
        e_disp = self._next_epoch(PHASE_DISPATCH)
        counted = None
        if not self.padded_recv:
            # R goes to the host as soon as the counts are known; the dispatch kernel is queued
            # before the host waits, so the device stays busy while the host reads R.
            self._num_recv_host.copy_(num_recv, non_blocking=True)
            if host_counts:
                self._counts_host.copy_(counts_all, non_blocking=True)
            counted = torch.cuda.Event()
            counted.record()
        side = None
        if fused:
            # The fused schedule: from a side stream, the rows go out one destination at a time.
            # This rank's own rows first, on every SM (nothing else could run yet: the first GEMM
            # waits for them); then, on fused_comm_blocks SMs, the other destinations' rows, and
            # this rank's arriving rows are taken source by source, while the caller's first GEMM
            # runs on the other SMs, each run of rows as soon as the latest source it holds rows
            # of is usable here (PHASE_ARRIVED). Runs are whole tiles of the GEMM's configuration.
            from ..gemm import run_alignment
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
                                        e_disp, self.num_blocks, self.dedup, source_blocks, self.direct.rows,
                                        pairs_all, None, 0, sent, False, *self._wait_args())
                waits = self._arrival_waits(segs, e_disp)
                waits.comm_job = self.ext.interleaved_job(x, expert_idx, dest_row, self.num_experts,
                                                          self.bufs.descriptor, direct, e_disp, self.dedup,
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
                                            self.direct_descriptor(True, e_counts), e_disp, blocks, self.dedup,
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
            # Received in place, this rank's own rows are stored whole (none deduplicated): local
            # stores beside the NVLink ones instead of copies after the wait (the same bits).
            self.ext.dispatch_rows(x, expert_idx, dest_row, None, self.fp8, self.num_experts, self.bufs.descriptor,
                                   self.direct_descriptor(True, e_counts), e_disp, self.num_blocks, self.dedup,
                                   self.dedup and in_place)
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
                                        self.num_blocks, self.dedup, jblocks, self.direct.rows,
                                        st["pairs_all"], None, sent, self.ep_size, True, *self._wait_args())
                st["waits"].comm_job = None
            if not st["waited"]:
                self._await_fused_start(e_disp, st["started"])
            # The first GEMM, queued now, before this returns to the caller: its tiles start on
            # this rank's own rows while the other sources' rows travel.
            from ..gemm import grouped_mm_segments
            waits = st["waits"]
            self._fused_waits = waits
            waits.result = grouped_mm_segments(recv, st["fused_w"], st["segs"], st["fused_gemm"], waits)
        else:
            recv_pair = torch.empty(rows, dtype=torch.int32, device=x.device)
            self.ext.recv_copyout(num_recv, self.fp8, recv, recv_pair, self.bufs.descriptor, e_disp,
                                  *self._wait_args(), self.num_blocks, not in_place, self.dedup)
        self.direct_stats["in_place" if in_place else "copied"] += 1
        return recv, st["local_counts"], st["dest_row"], recv_pair, num_recv, st["counts_all"]

    # ------------------------------------------------------------------ the fused schedule
    def fuses(self) -> str:
        """Why this dispatcher cannot run the fused schedule's dispatch, or "". (A forward whose
        direct receive region is still in use runs the sequential dispatch instead; fused_stats
        counts both.)"""
        if self.padded_recv:
            return ("sync_free: " if self.sync_free else "padded_recv: ") + "the host does not read the row count"
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
        return max(2, (self.sm_count - (0 if self.interleaved else self.fused_comm_blocks)) // 2 * 2)

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
        from ..gemm import ArrivalWaits
        return ArrivalWaits(segs=segs, ready=self.bufs.phase_words(PHASE_ARRIVED), epoch=epoch,
                            timeout_ns=self.timeout_ns, error_record=self.error_record,
                            poison=self.bufs.poison_word(), layer_id=self.layer_id, rank=self.rank,
                            phase=PHASE_ARRIVED, sm_count=self._fused_gemm_sms(), done=self._fused_done)

    # ------------------------------------------------------------------ the pipelined schedule
    def pipelines(self) -> str:
        """Why this dispatcher cannot run the pipelined schedule (``ds_uniep.pipelined``), or ""."""
        if self.padded_recv:
            return ("sync_free: " if self.sync_free else "padded_recv: ") + "the host does not read the counts"
        if not self.gate_grad_on_experts:
            return "gate_grad_on_experts=False"
        return ""

    def comm_stream(self, dst: int) -> torch.cuda.Stream:
        """The side stream of the pipelined schedule's copy-engine copies to rank ``dst``."""
        if self._comm_streams is None:
            self._comm_streams = [torch.cuda.Stream(self.device) for _ in range(self.ep_size)]
        return self._comm_streams[dst]

    # ------------------------------------------------------------------ the protocol
    def checked_inputs(self, x: Tensor, expert_idx: Tensor) -> Tuple[Tensor, Tensor]:
        """(x contiguous, expert_idx as contiguous int32 on x's device), after checking both against
        the buffers' sizes, the hidden size and the activation dtype."""
        stop_point("dispatch")  # fault-injection tests only (UNIEP_TEST_STOP_AT)
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
        ``gates [T, k]``: the weights the following :meth:`combine` gets; with ``compression.combine``
        "rank_partials" they are staged for the expert ranks here, and that combine (given this
        handle) weights the rows by these gates, not by the ones it is given, so pass it the same
        (given none here, the combine stages its own and the expert ranks wait for them)."""
        T, k = expert_idx.shape
        x, idx = self.checked_inputs(x, expert_idx)
        recv, local_counts, dest_row, recv_pair, num_recv, counts_all = autograd.dispatch(x, idx, self.layer_id)
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
        self._next_gates = staged if staged and staged == self._set.last_gates_epoch else 0
        return autograd.combine(y.contiguous(), gates.float().contiguous(), handle.expert_idx, handle.dest_row,
                                handle.recv_pair, handle.num_recv, self.layer_id)
