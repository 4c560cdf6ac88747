"""ds_uniep.ops: the UniEP CUDA kernels and their builder.

``megakernel_available(device)`` says whether the megakernel backend can run on
``device`` without building anything; ``load_uniep_ops()`` builds the extension
once (local rank 0 builds, every rank then loads it) and caches the module.
"""

import functools
import os
from typing import Optional, Tuple

from .builder import (UniEPBuilder, build_directory, build_lock, build_requirements, cutlass_include, find_nvcc,
                      stale_build_locks)

__all__ = ["UniEPBuilder", "megakernel_available", "load_uniep_ops", "cutlass_include", "find_nvcc",
           "stale_build_locks"]


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


def _agree(error: Optional[str]) -> Optional[str]:
    """The builds' outcome on every rank, gathered where a barrier would stand: the first rank's
    error (``"rank r: ..."``), else None. Without torch.distributed, this process's own."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None if error is None else f"this process: {error}"
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (dist.get_rank(), error))
    return next((f"rank {r}: {e}" for r, e in outcomes if e), None)


@functools.lru_cache(maxsize=None)
def load_uniep_ops(verbose: bool = False):
    """The compiled extension module. Local rank 0 builds first, and every rank then learns
    whether the builds succeeded (one collective, in place of a barrier), so ranks never race on
    one build directory; the others then load the finished build, or, where a build failed, raise
    an error naming the rank whose build failed instead of building again themselves.

    Every build and load holds the build directory's flock (:func:`build_lock`): two jobs building at once
    take turns, and a torch build ``lock`` that a killed build left there is removed with a message
    instead of being waited on forever."""
    ok, reason = build_requirements()
    if not ok:
        raise RuntimeError(f"cannot build the UniEP ops: {reason}")
    builder = UniEPBuilder()
    build_dir = build_directory(builder.NAME)
    if _local_rank() == 0:
        try:
            with build_lock(build_dir):
                module = builder.jit_load(verbose=verbose)
        except Exception as err:
            _agree(f"{type(err).__name__}: {str(err)[-2000:]}")  # the other ranks must not wait forever
            raise
        failed = _agree(None)
        if failed is not None:  # another node's build
            raise RuntimeError(f"building the UniEP ops failed on {failed}")
        return module
    failed = _agree(None)
    if failed is not None:
        raise RuntimeError(f"building the UniEP ops failed on {failed} (local rank 0 builds; this rank does not "
                           "build again)")
    with build_lock(build_dir):
        return builder.jit_load(verbose=verbose)
