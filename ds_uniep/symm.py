"""Torch symmetric memory helpers shared by the megakernel buffers and CommFuse."""
import warnings

import torch


def rendezvous(buf: torch.Tensor, group):
    """``symm_mem.rendezvous(buf, group)``; older torch needs the group registered first
    (deprecated and unneeded in newer ones). Collective over ``group``."""
    from torch.distributed import _symmetric_memory as symm_mem
    try:
        return symm_mem.rendezvous(buf, group)
    except RuntimeError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return symm_mem.rendezvous(buf, group)
