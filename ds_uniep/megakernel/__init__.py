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
   waits and sums each token's k rows in slot order in fp32, weighted, cast once
   (by default both in one kernel, pipelined over chunks of source tokens).
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
who waited for what in pinned host memory, the later kernels of every layer sharing
the buffers do nothing, and the next call of any of them (or :meth:`NVLinkDispatcher.check`) raises
:class:`UniEPTimeoutError` naming the layer, the rank and the signal.

With ``padded_recv`` set, dispatch returns ``recv [R_max, M]`` whose first R rows
are valid (R = ``local_expert_counts.sum()``), with no host synchronisation at all;
by default it reads R once on the host and returns ``recv [R, M]`` exactly as the
reference does. A ``sync_free`` dispatcher also keeps its epochs on the device (each op's
kernels count from 1 above per-phase bases that the op advances on the stream, see
``kEpochBaseWord`` in ops/csrc/types.h), so its ops can be captured in a CUDA graph and
replayed; the host-counted epochs of the other dispatchers are kernel arguments.

Modules: :mod:`.buffers` (the symmetric buffers and the kernel limits),
:mod:`.dispatcher` (the dispatcher and its dispatch side), :mod:`.combine` (its combine
side and the backward ops), :mod:`.autograd` (the custom ops and autograd functions).
"""

from .buffers import (ERROR_RECORD_WORDS, FP8_GROUP, MAX_COMBINE_CHUNKS, MAX_EXPERTS, MAX_RANKS, MAX_TOP_K,
                      NUM_PHASES, PHASE_NAMES, release_buffers)
from .dispatcher import NVLinkDispatcher, NVLinkHandle, UniEPCapacityError, UniEPTimeoutError

__all__ = ["NVLinkDispatcher", "NVLinkHandle", "UniEPCapacityError", "UniEPTimeoutError", "MAX_RANKS", "MAX_EXPERTS",
           "MAX_TOP_K", "FP8_GROUP", "NUM_PHASES", "MAX_COMBINE_CHUNKS", "ERROR_RECORD_WORDS", "PHASE_NAMES",
           "release_buffers"]
