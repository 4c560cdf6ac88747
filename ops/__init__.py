"""ds_uniep.ops: the UniEP CUDA kernels and their builder.

``megakernel_available(device)`` says whether the megakernel backend can run on
``device`` without building anything; ``load_uniep_ops()`` builds the extension
once (local rank 0 builds, every rank then loads it) and caches the module.
"""

import functools
import os
from typing import Tuple

from .builder import UniEPBuilder, build_requirements, cutlass_include, find_nvcc

__all__ = ["UniEPBuilder", "megakernel_available", "load_uniep_ops", "cutlass_include", "find_nvcc"]


def megakernel_available(device) -> Tuple[bool, str]:
    """(usable, reason) for the NVLink kernels on ``device``; checks, never builds.

    Needs CUDA, a compute capability 9.x GPU, nvcc, and peer access from ``device``
    to every other visible GPU of the host (the EP group's peers are local GPUs).
    """
    import torch
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        return False, f"not a device: {device!r} ({err})"
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA device"
    ok, reason = build_requirements(device)
    if not ok:
        return False, reason
    index = device.index if device.index is not None else torch.cuda.current_device()
    for peer in range(torch.cuda.device_count()):
        if peer != index and not torch.cuda.can_device_access_peer(index, peer):
            return False, f"GPU {index} cannot access GPU {peer} as a peer (no NVLink/P2P path)"
    return True, "Hopper GPU, nvcc and peer access present"


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _barrier():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@functools.lru_cache(maxsize=None)
def load_uniep_ops(verbose: bool = False):
    """The compiled extension module. Local rank 0 builds first, behind a barrier, so
    ranks never race on one build directory; the others then load the finished build."""
    ok, reason = build_requirements()
    if not ok:
        raise RuntimeError(f"cannot build the UniEP ops: {reason}")
    builder = UniEPBuilder()
    if _local_rank() == 0:
        try:
            module = builder.jit_load(verbose=verbose)
        finally:
            _barrier()  # also on failure: the other ranks must not wait forever
        return module
    _barrier()
    return builder.jit_load(verbose=verbose)
