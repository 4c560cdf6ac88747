"""The symmetric buffers of the megakernel layers, and the kernel limits they are sized by.

Layers run one after another, so the layers of one expert-parallel group, device, activation
dtype and dispatch dtype share one :class:`BufferSet` (as DeepEP's ``Buffer`` serves every layer):
one symmetric byte buffer (``SymView`` in ops/csrc/types.h: the same layout on every rank, so one
set of offsets serves all peers), one direct receive region, and the signal epochs both carry.
A layer that does not fit the group's newest set makes a new one, sized for it and that set,
which later layers share; earlier layers keep theirs (a call under way finishes on the buffers it
began with). Layers of one size, as in a model, share one set. What autograd keeps for a backward
lives outside the set (rows received in place while the direct region is held elsewhere are
copied instead, see :class:`_DirectView`). Each layer sees its set through its own
:class:`_LayerBuffers` (its sizes, the set's offsets). Each set logs its size once.

Symmetric bytes of a set, for ``b`` bytes per activation element (the largest layer's values):
``(2 * R_max + T_max * k) * M * b + 8 * R_max + 4 * T_max * k + 4 * E * 2 * MAX_RANKS`` and a
few KiB of signals, with ``R_max = G * T_max * min(k, E / G)`` (the staging and the direct region
hold ``R_max`` rows each; with FP8 dispatch there is no direct region and ``4 * R_max * M / 128``
bytes of scales are added).
"""

import functools
from typing import Dict

import torch
import torch.distributed as torch_dist
from torch import Tensor

from ..env import logger
from ..symm import symmetric_empty

# Kernel limits repeated from ops/csrc/configs.cuh (tests/test_ops_compile.py checks they agree).
MAX_RANKS = 8
MAX_EXPERTS = 1024
MAX_TOP_K = 16
FP8_GROUP = 128
NUM_PHASES = 6
MAX_COMBINE_CHUNKS = 64
ERROR_RECORD_WORDS = 8
EPOCH_BASE_WORD = 24  # status word of the first phase's epoch base (kEpochBaseWord)
_ADVANCE_ROWS = 16  # distinct per-op epoch advances kept on the device (ops use four)

# Signal phases (SignalPhase in ops/csrc/configs.cuh): one row of MAX_RANKS words each in the
# signals region, and one epoch counter each in the buffer set.
PHASE_COUNTS = 0  # routing counts exchanged (layout)
PHASE_DISPATCH = 1  # all rows of a dispatch stored
PHASE_COMBINE = 2  # all rows of a combine push stored
PHASE_BARRIER = 3  # entry barrier of the backward ops
PHASE_ARRIVED = 4  # fused schedule, local only: a source's rows are usable here
PHASE_GATES = 5  # a source's gates are in its gates region (rank partials)
PHASE_NAMES = ("counts", "dispatch", "combine", "barrier", "arrived", "gates")
_ALIGN = 256
_GIB = float(1 << 30)

#: Whether layers share buffer sets (False: each dispatcher made afterwards gets a set of its own;
#: tests compare the two).
SHARED = True


class _Dims:
    """The sizes one layer needs of a set."""

    def __init__(self, E: int, G: int, T_max: int, k: int, M: int, elsize: int, fp8: bool):
        L = E // G
        self.recv_rows = G * T_max * min(k, L)
        self.pairs_per_rank = T_max * k
        self.recv_row_bytes = M * elsize  # e4m3 rows use the first M bytes of a row
        self.comb_row_bytes = M * elsize
        self.regions = {
            "counts": 2 * MAX_RANKS * E * 4 + 2 * MAX_RANKS * 4,  # + direct-receive flags
            # phase signals, then the chunked combine's flags [chunk][rank] and local counters [chunk]
            "signals": (NUM_PHASES * MAX_RANKS + MAX_COMBINE_CHUNKS * (MAX_RANKS + 1)) * 4,
            "status": 32 * 4,
            "meta": self.recv_rows * 4,
            "scales": self.recv_rows * (M // FP8_GROUP) * 4 if fp8 else 0,
            "recv": self.recv_rows * M * elsize,
            "comb": self.pairs_per_rank * self.comb_row_bytes,
            "gates": self.pairs_per_rank * 4,  # backward of combine: gates out, gate gradients back
            "dup": self.recv_rows * 4,  # deduplicated dispatch: where a row's token already is
        }
        self.direct_bytes = 0 if fp8 else self.recv_rows * M * elsize


class _SymBuffers:
    """One symmetric byte buffer with the regions of ``SymView`` (ops/csrc/types.h), each
    ``regions[name]`` bytes; the same layout on every rank. Collective over ``group``."""

    def __init__(self, regions: Dict[str, int], group, device: torch.device):
        self.offsets: Dict[str, int] = {}
        total = 0
        for name, nbytes in regions.items():
            self.offsets[name] = total
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.total_bytes = total
        # Signals and the status word start at 0 (symmetric_empty zeroes before peers can store).
        self.buffer, self.handle = symmetric_empty(total, group, device)
        self.group = group
        self.ptrs = list(self.handle.buffer_ptrs)
        G = torch_dist.get_world_size(group) if torch_dist.is_initialized() else 1
        if len(self.ptrs) != G:
            raise RuntimeError(f"symmetric memory rendezvous gave {len(self.ptrs)} peers, expected {G}")


class _DirectRegion:
    """A receive region in a symmetric allocation of its own, so that the users of its storage
    (views handed out) can be counted. Collective over ``group``."""

    def __init__(self, nbytes: int, group, device: torch.device):
        self.buffer, self.handle = symmetric_empty(max(nbytes, 16), group, device)
        ptrs = list(self.handle.buffer_ptrs)
        self.ptrs = ptrs + [0] * (MAX_RANKS - len(ptrs))
        self.idle_users = _storage_users(self.buffer)

    def free(self) -> bool:
        """True when no view of the region is alive outside the buffer set."""
        return _storage_users(self.buffer) <= self.idle_users


def _storage_users(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferSet:
    """The symmetric buffers a group of layers shares (see the module doc), and the state that goes
    with them: the signal epochs, the gates epoch of the gates region, and the rows an epilogue
    combine left in the combine region for a backward still to come. Collective over ``group``."""

    def __init__(self, regions: Dict[str, int], direct_bytes: int, group, device: torch.device,
                 dtype: torch.dtype, fp8: bool, device_epochs: bool = False):
        self.group, self.device, self.dtype, self.fp8 = group, device, dtype, fp8
        self.regions, self.direct_bytes = dict(regions), direct_bytes
        self.sym = _SymBuffers(self.regions, group, device)
        self.direct = _DirectRegion(direct_bytes, group, device) if direct_bytes else None
        #: one counter per signal phase; every rank runs the same ops in the same order, so they agree
        self.epochs = [0] * NUM_PHASES
        #: device epochs (sync-free layers): the host counts each op's epochs from 1 and the kernels add
        #: the per-phase bases in the status words (``epoch_bases``), which :meth:`end_op` advances on
        #: the stream, so a captured CUDA graph replays with growing epochs
        self.device_epochs = device_epochs
        at = self.sym.offsets["status"] + EPOCH_BASE_WORD * 4
        self.epoch_bases = self.sym.buffer[at:at + NUM_PHASES * 4].view(torch.int32)
        # An op's advance is one add of a row of this table, each row filled at its first use (made
        # here, so that no later call allocates: CUDA graph pools keep nothing of the set's)
        self._advance_rows = torch.zeros(_ADVANCE_ROWS, NUM_PHASES, dtype=torch.int32, device=device)
        self._advances: Dict[tuple, int] = {}
        #: PHASE_GATES epoch of the gates now in the gates region (0: none, or overwritten since)
        self.last_gates_epoch = 0
        #: weak reference to the epilogue combine's record of rows left in the combine region
        self.landed = None
        #: who waited for what, from the first wait of any of the set's layers that gave up (the
        #: kernels fill it; the poison word that stops every later kernel is the set's too)
        self.error_record = torch.zeros(ERROR_RECORD_WORDS, dtype=torch.int64, pin_memory=True)
        rank = torch_dist.get_rank(group) if torch_dist.is_initialized() else 0
        if rank == 0:
            logger.info(f"ds_uniep: megakernel buffers of ep group {getattr(group, 'group_name', '?')} "
                        f"({dtype}{', fp8 dispatch' if fp8 else ''}) on {device}: "
                        f"{(self.sym.total_bytes + direct_bytes) / _GIB:.3f} GiB symmetric memory "
                        f"(staging {self.sym.total_bytes / _GIB:.3f}, direct receive {direct_bytes / _GIB:.3f}), "
                        "shared by the group's layers of this size or smaller")

    def fits(self, dims: _Dims) -> bool:
        return all(dims.regions[n] <= b for n, b in self.regions.items()) and dims.direct_bytes <= self.direct_bytes

    def next_epoch(self, phase: int) -> int:
        self.epochs[phase] = (self.epochs[phase] + 1) & 0xFFFFFFFF or 1
        return self.epochs[phase]

    def end_op(self) -> None:
        """After an op's kernels are queued: with device epochs, add the op's epochs to the bases on
        the current stream (its next op counts from 1 again); else nothing."""
        if not self.device_epochs or not any(self.epochs):
            return
        used, self.epochs = tuple(self.epochs), [0] * NUM_PHASES
        row = self._advances.get(used)
        if row is None and len(self._advances) < _ADVANCE_ROWS and not torch.cuda.is_current_stream_capturing():
            row = self._advances[used] = len(self._advances)
            self._advance_rows[row].copy_(torch.tensor(used, dtype=torch.int32))
        if row is not None:
            self.epoch_bases.add_(self._advance_rows[row])
        else:  # first met under capture (no host-to-device copy there): one add per phase
            for phase, n in enumerate(used):
                if n:
                    self.epoch_bases[phase:phase + 1].add_(n)

    def keep_landed(self) -> None:
        """Before peers may store into this rank's combine region again: if an epilogue combine's
        rows there may still be read by a backward, copy them out for it first."""
        landed, self.landed = self.landed() if self.landed is not None else None, None
        if landed is not None:
            landed.keep()


def one_op(step):
    """A dispatcher's raw step (``_dispatch_fwd``, ``_combine_fwd``, ``_dispatch_bwd``, ``_combine_bwd``) is one
    op of its buffer set: :meth:`BufferSet.end_op` follows it."""
    @functools.wraps(step)
    def run(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        self._set.end_op()
        return out
    return run


#: The newest set per (group, device, dtype, FP8, device epochs), with its process group, held here
#: until :func:`release_buffers`: whether a layer gets a new set must not depend on when each rank's
#: garbage collector frees the last layer of the old one (making a set is collective). A group made
#: again under the same name gets sets of its own.
_SETS: Dict[tuple, tuple] = {}


def release_buffers() -> None:
    """Forget every group's newest buffer set: layers made afterwards get new sets, and a set's
    memory goes back when its last layer does. Call it on every rank of the groups, at the same
    point of the program (e.g. between two models)."""
    _SETS.clear()


def buffer_set(dims: _Dims, dtype: torch.dtype, fp8: bool, group, device: torch.device,
               device_epochs: bool = False) -> BufferSet:
    """The newest set of ``group`` (None: the world) on ``device`` for ``dtype`` rows (FP8 dispatch or
    not, device epochs or not) if a layer of sizes ``dims`` fits it; else a new one, sized for both,
    that becomes the newest (every rank builds its layers in the same order: collective over the
    group). With :data:`SHARED` False, a new set of this layer's own."""
    pg = group if group is not None else torch_dist.group.WORLD
    key = (getattr(pg, "group_name", id(pg)), device.index, dtype, fp8, device_epochs)
    held = _SETS.get(key) if SHARED else None
    newest = held[1] if held is not None and held[0] is pg else None
    if newest is not None and newest.fits(dims):
        return newest
    regions, direct = dims.regions, dims.direct_bytes
    if newest is not None:
        regions = {n: max(b, newest.regions[n]) for n, b in regions.items()}
        direct = max(direct, newest.direct_bytes)
    made = BufferSet(regions, direct, pg, device, dtype, fp8, device_epochs)
    if SHARED:
        _SETS[key] = (pg, made)
    return made


class _LayerBuffers:
    """One layer's view of its set's symmetric buffer: its sizes, the set's offsets, and the
    ``SymView`` descriptor (SymField order of ops/csrc/host_utils.h)."""

    def __init__(self, bset: BufferSet, dims: _Dims, rank: int, G: int):
        sym = bset.sym
        self.recv_rows, self.pairs_per_rank = dims.recv_rows, dims.pairs_per_rank
        self.recv_row_bytes, self.comb_row_bytes = dims.recv_row_bytes, dims.comb_row_bytes
        self.offsets, self.buffer = sym.offsets, sym.buffer
        o = self.offsets
        #: this rank's gates region, ``[pairs_per_rank]`` fp32
        self.gates = self.buffer[o["gates"]:o["gates"] + self.pairs_per_rank * 4].view(torch.float32)
        self.descriptor = sym.ptrs + [0] * (MAX_RANKS - G) + [
            rank, G, o["counts"], o["signals"], o["status"], o["meta"], o["scales"], o["recv"], o["comb"],
            o["gates"], o["dup"], self.recv_rows, self.recv_row_bytes, self.comb_row_bytes, self.pairs_per_rank
        ]

    def phase_words(self, phase: int) -> Tensor:
        """This rank's ``[MAX_RANKS]`` int32 signal words of ``phase``, one per source rank."""
        at = self.offsets["signals"] + phase * MAX_RANKS * 4
        return self.buffer[at:at + MAX_RANKS * 4].view(torch.int32)

    def poison_word(self) -> Tensor:
        """This rank's status word 0 (``[1]`` int32): set once a wait of the set's layers gave up."""
        at = self.offsets["status"]
        return self.buffer[at:at + 4].view(torch.int32)


class _DirectView:
    """One layer's ``[R_max, M]`` rows of its set's direct region."""

    def __init__(self, region: _DirectRegion, rows: int, M: int, dtype: torch.dtype):
        self.region, self.ptrs, self.shape, self.dtype = region, region.ptrs, (rows, M), dtype
        self.nbytes = rows * M * torch.empty(0, dtype=dtype).element_size()

    @property
    def rows(self) -> Tensor:
        """``[R_max, M]`` rows with no autograd history (a fresh view each time: an in-place write
        that autograd records, ``copy_`` of a tensor that requires grad, marks only that view)."""
        return self.region.buffer[:self.nbytes].view(self.dtype).view(*self.shape)

    def free(self) -> bool:
        """True when no view of the region's rows is alive (of this layer or another of the set)."""
        return self.region.free()
