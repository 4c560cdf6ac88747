"""The symmetric buffers of one megakernel layer, and the kernel limits they are sized by.

``_SymBuffers`` is the one symmetric byte buffer of a layer (``SymView`` in
ops/csrc/types.h: the same layout on every rank, so one set of offsets serves all
peers); ``_DirectRegion`` is a receive region of its own allocation, whose views
can be counted, so rows can be handed to the caller in place.
"""

from typing import Dict

import torch
import torch.distributed as torch_dist
from torch import Tensor

from ..symm import rendezvous

# Kernel limits repeated from ops/csrc/configs.cuh (tests/test_ops_compile.py checks they agree).
MAX_RANKS = 8
MAX_EXPERTS = 1024
MAX_TOP_K = 16
FP8_GROUP = 128
NUM_PHASES = 6
MAX_COMBINE_CHUNKS = 64
ERROR_RECORD_WORDS = 8

# Signal phases (SignalPhase in ops/csrc/configs.cuh): one row of MAX_RANKS words each in the
# signals region, and one epoch counter each in the dispatcher.
PHASE_COUNTS = 0  # routing counts exchanged (layout)
PHASE_DISPATCH = 1  # all rows of a dispatch stored
PHASE_COMBINE = 2  # all rows of a combine push stored
PHASE_BARRIER = 3  # entry barrier of the backward ops
PHASE_ARRIVED = 4  # fused schedule, local only: a source's rows are usable here
PHASE_GATES = 5  # a source's gates are in its gates region (rank partials)
PHASE_NAMES = ("counts", "dispatch", "combine", "barrier", "arrived", "gates")
_ALIGN = 256


class _SymBuffers:
    """One symmetric byte buffer per layer, the same layout on every rank (``SymView`` in
    ops/csrc/types.h): counts, signals, status, meta, scales, recv, comb, gates, dup regions."""

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
        # SymField order of ops/csrc/host_utils.h
        self.descriptor = ptrs + [0] * (MAX_RANKS - G) + [
            rank, G, o["counts"], o["signals"], o["status"], o["meta"], o["scales"], o["recv"], o["comb"],
            o["gates"], o["dup"], self.recv_rows, self.recv_row_bytes, self.comb_row_bytes, self.pairs_per_rank
        ]

    def phase_words(self, phase: int) -> Tensor:
        """This rank's ``[MAX_RANKS]`` int32 signal words of ``phase``, one per source rank."""
        at = self.offsets["signals"] + phase * MAX_RANKS * 4
        return self.buffer[at:at + MAX_RANKS * 4].view(torch.int32)

    def poison_word(self) -> Tensor:
        """This rank's status word 0 (``[1]`` int32): set once a wait of the layer gave up."""
        at = self.offsets["status"]
        return self.buffer[at:at + 4].view(torch.int32)


def _storage_users(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _DirectRegion:
    """``[R_max, M]`` rows in a symmetric allocation of their own, so that the users of its storage
    (views handed out) can be counted: a layer's direct receive region."""

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
