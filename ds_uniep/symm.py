"""Symmetric memory for the megakernel buffers and CommFuse: torch's symmetric memory, or CUDA IPC
where ranks of the group share a GPU (torch refuses that; e.g. more ranks than GPUs on a workstation).
"""
import warnings
from typing import List, Tuple

import torch


def rendezvous(buf: torch.Tensor, group):
    """``symm_mem.rendezvous(buf, group)``; older torch needs the group registered first
    (deprecated and unneeded in newer ones). Collective over ``group``."""
    from torch.distributed import _symmetric_memory as symm_mem
    try:
        return symm_mem.rendezvous(buf, group)
    except RuntimeError as err:
        if _SHARED_GPU in str(err):
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return symm_mem.rendezvous(buf, group)


# What torch's rendezvous says when two ranks of the group allocated on one GPU.
_SHARED_GPU = "overlapping devices"


class _IpcPeers:
    """Every rank's copy of a buffer opened through CUDA IPC (``buffer_ptrs`` as torch's handle has);
    keeps the peers' storages open while it lives."""

    def __init__(self, buf: torch.Tensor, group):
        import torch.distributed as dist
        storage = buf.untyped_storage()
        mine = storage._share_cuda_()
        offset = buf.data_ptr() - storage.data_ptr()
        handles = [None] * dist.get_world_size(group)
        dist.all_gather_object(handles, (mine, offset), group=group)
        me = dist.get_rank(group)
        self._opened = []
        self.buffer_ptrs: List[int] = []
        for r, (h, off) in enumerate(handles):
            if r == me:
                self.buffer_ptrs.append(buf.data_ptr())
                continue
            peer = torch.UntypedStorage._new_shared_cuda(*h)
            self._opened.append(peer)
            self.buffer_ptrs.append(peer.data_ptr() + off)
        dist.barrier(group=group)


def symmetric_empty(nbytes: int, group, device: torch.device) -> Tuple[torch.Tensor, object]:
    """``(buffer, handle)``: a zeroed uint8 buffer of ``nbytes`` on every rank of ``group`` and the
    handle whose ``buffer_ptrs`` address every rank's copy. Torch's symmetric memory; where ranks of
    the group share a GPU, a plain allocation opened by the peers through CUDA IPC. Collective."""
    from torch.distributed import _symmetric_memory as symm_mem
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    # Zeroed before any peer can store into it: the rendezvous is collective and comes after.
    buf.zero_()
    torch.cuda.synchronize(device)
    try:
        return buf, rendezvous(buf, group)
    except RuntimeError as err:
        if _SHARED_GPU not in str(err):
            raise
    del buf
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    return buf, _IpcPeers(buf, group)
