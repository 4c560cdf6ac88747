"""The combine side of :class:`ds_uniep.megakernel.NVLinkDispatcher`: the forward combine, the
backward of dispatch (a combine without weights) and the backward of combine, over the kernels
of ops/csrc/combine.

Rows go back to their sources at pair ``t * k + j`` of the source's combine buffer and are
summed there in slot order in fp32, cast once: by the chunked combine (``combine_chunks`` > 0:
one kernel, pipelined over chunks of source tokens), or by a push kernel and then a reduce
kernel; with ``compression.combine`` "rank_partials", each rank first sums its own rows of a
token (:meth:`_CombineSteps._rank_partials`).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..faults import stop_point
from .buffers import PHASE_BARRIER, PHASE_COMBINE, PHASE_DISPATCH, PHASE_GATES, one_op


class _CombineSteps:
    """Mixed into NVLinkDispatcher; reads its buffers, epochs and knobs."""

    # ------------------------------------------------------------------ the chunked combine's shape
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
            raise ValueError(f"{self.layer_name}: combine_queue needs every pushing block resident at once; "
                             f"{pushers} pushing blocks exceed the {resident} that fit on this GPU (two per SM)")
        need = self.ext.combine_queue_size(pushers, rows)
        if self._queue is None or self._queue.numel() < need:
            self._queue = torch.zeros(need, dtype=torch.int32, device=self.device)
        return self._queue

    def combine_pushers(self) -> int:
        """Pushing blocks of the chunked combine: ``combine_push_blocks``, or half of ``num_blocks``."""
        return self.combine_push_blocks or max(1, self.num_blocks // 2)

    def combine_reducers(self) -> int:
        """Reducing blocks of the chunked combine: ``combine_reduce_blocks``, or by default
        ``num_blocks`` less the pushing blocks with the queue (one block per SM in all, each role
        on SMs of its own) and ``num_blocks`` without it (or where the pushers take them all)."""
        if self.combine_reduce_blocks:
            return self.combine_reduce_blocks
        pushers = self.combine_pushers()
        return self.num_blocks - pushers if self.combine_queue and pushers < self.num_blocks else self.num_blocks

    # ------------------------------------------------------------------ rank partials
    def _first_slots(self, expert_idx: Tensor) -> Tensor:
        """``expert_idx`` with every slot but the first of each destination rank dropped (-1): where the
        rank partials land, summed by ``combine_reduce`` in that order. Kept for the next call with the
        same tensor (a forward's combine and its dispatch's backward share the routing)."""
        cached, version, firsts = self._firsts
        if cached is expert_idx and version == expert_idx._version:
            return firsts
        from ..reference import first_slots_of_ranks, slot_ranks
        rank = slot_ranks(expert_idx, self.num_experts // self.ep_size)
        firsts = torch.where(first_slots_of_ranks(rank), expert_idx, -1).contiguous()
        self._firsts = (expert_idx, expert_idx._version, firsts)
        return firsts

    def _stage_gates(self, gates: Tensor) -> int:
        """Write ``gates [T, k]`` fp32 into this rank's gates region and raise PHASE_GATES on every
        rank (the expert ranks of a rank-partials combine read them there); returns its epoch. Queued
        after this rank's dispatch kernels, so every peer has finished reading what the previous
        combine or backward left there (they have reached this dispatch's counts exchange)."""
        self.bufs.gates[:gates.numel()].view(gates.shape).copy_(gates.detach())  # one copy: dtype and layout
        e = self._next_epoch(PHASE_GATES)
        self.ext.signal_raise(self.bufs.descriptor, PHASE_GATES, e, self.device.index)
        self._set.last_gates_epoch = e
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
        e = self._next_epoch(PHASE_COMBINE)
        self.ext.combine_partials_push(rows, recv_pair, num_recv, self._pair_table, self._table_epoch, self.k,
                                       weights is not None, gates_epoch, self.bufs.descriptor, e, *self._wait_args(),
                                       self.num_blocks)
        out = rows.new_empty(T, self.hidden_size)
        self.ext.combine_reduce(firsts, None, self.num_experts, out, self.bufs.descriptor, e, *self._wait_args(),
                                self.num_blocks)
        self.combine_stats["rank_partials"] += 1
        return out

    # ------------------------------------------------------------------ push and reduce
    def _push_and_reduce(self, rows: Tensor, weights: Optional[Tensor], expert_idx: Tensor, recv_pair: Tensor,
                         num_recv: Tensor, T: int) -> Tensor:
        if self.rank_partials:
            return self._rank_partials(rows, weights, expert_idx, recv_pair, num_recv, T)
        # Checked before the epoch moves on, so a refused call leaves the ranks in step.
        queue = self._queue_workspace(rows.shape[0]) if self.combine_chunks and self.combine_queue else None
        self.combine_stats["queued"] += int(queue is not None)
        e = self._next_epoch(PHASE_COMBINE)
        out = rows.new_empty(T, self.hidden_size)
        nb = self.num_blocks
        if self.combine_chunks:
            reduce_blocks = self.combine_reducers()
            chunk_tokens, num_chunks = self.combine_chunking()
            self.ext.combine_chunked(rows, recv_pair, num_recv, expert_idx, weights, self.num_experts, out,
                                     self.bufs.descriptor, e, *self._wait_args(), self.combine_pushers(),
                                     reduce_blocks, chunk_tokens, num_chunks, queue, self.combine_queue_gpu_fence)
            return out
        self.ext.combine_push(rows, recv_pair, num_recv, self.bufs.descriptor, e, nb)
        self.ext.combine_reduce(expert_idx, weights, self.num_experts, out, self.bufs.descriptor, e,
                                *self._wait_args(), nb)
        return out

    def _barrier(self) -> None:
        # Backward ops store into peers' buffers without a counts exchange first: the barrier
        # makes sure every peer has finished reading what the previous op left there.
        self._set.keep_landed()
        self.ext.barrier(self.bufs.descriptor, self._next_epoch(PHASE_BARRIER), *self._wait_args(),
                         self.device.index)

    # ------------------------------------------------------------------ the combine buffers
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

    # ------------------------------------------------------------------ raw steps (no autograd)
    @one_op
    def _combine_fwd(self, y, gates, expert_idx, recv_pair, num_recv):
        stop_point("combine")  # fault-injection tests only (UNIEP_TEST_STOP_AT)
        self._join_fused()
        self.check()
        self.combine_stats["pushed"] += 1
        return self._push_and_reduce(y, gates, expert_idx, recv_pair, num_recv, expert_idx.shape[0])

    @one_op
    def _dispatch_bwd(self, grad_recv, expert_idx, recv_pair, num_recv):
        # Gradient of dispatch: each token's k row gradients summed in slot order (fp32, cast once).
        self.check()
        self._barrier()
        return self._push_and_reduce(grad_recv, None, expert_idx, recv_pair, num_recv, expert_idx.shape[0])

    @one_op
    def _combine_bwd(self, grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv):
        # grad_y is a dispatch of grad_out weighted by the gates, in the same layout;
        # grad_gates[t, j] = <grad_out[t], y row of (t, j)>. y: [R, M], or the pipelined
        # schedule's chunks [(first row, rows)], which get grad_y as chunks too.
        stop_point("backward")  # fault-injection tests only (UNIEP_TEST_STOP_AT)
        self.check()
        self._barrier()
        if not self.gate_grad_on_experts:
            return self._combine_bwd_at_sources(grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv)
        # Unweighted grad_out rows travel to the experts, with the gates in this rank's gates
        # region; the expert rank scales each row by its gate and sends back only the dot
        # products, so y never travels back.
        T = expert_idx.shape[0]
        self.bufs.gates[:gates.numel()].copy_(gates.reshape(-1))
        self._set.last_gates_epoch = 0  # what a dispatch staged there is gone
        e_disp = self._next_epoch(PHASE_DISPATCH)
        self.ext.dispatch_rows(grad_out, expert_idx, dest_row, None, False, self.num_experts, self.bufs.descriptor,
                               self.direct_descriptor(False, 0), e_disp, self.num_blocks, self.dedup, False)
        e = self._next_epoch(PHASE_COMBINE)
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
        e = self._next_epoch(PHASE_COMBINE)
        self.ext.combine_push(y, recv_pair, num_recv, self.bufs.descriptor, e, self.num_blocks)
        grad_gates = torch.empty(T, self.k, dtype=torch.float32, device=y.device)
        self.ext.gate_grad(expert_idx, grad_out, self.num_experts, grad_gates, self.bufs.descriptor, e,
                           *self._wait_args(), self.num_blocks)
        e_disp = self._next_epoch(PHASE_DISPATCH)
        self.ext.dispatch_rows(grad_out, expert_idx, dest_row, gates, False, self.num_experts, self.bufs.descriptor,
                               self.direct_descriptor(False, 0), e_disp, self.num_blocks, False, False)
        grad_y = y.new_empty(y.shape)
        scratch_pair = torch.empty(y.shape[0], dtype=torch.int32, device=y.device)
        self.ext.recv_copyout(num_recv, False, grad_y, scratch_pair, self.bufs.descriptor, e_disp,
                              *self._wait_args(), self.num_blocks, True, False)
        return grad_y, grad_gates
