"""Backend choice: never silent, never a failure deep inside a kernel.

``reference`` always works. ``megakernel`` needs CUDA, a Hopper GPU, the UniEP
ops and NVLink peers; asking for it without them is an error that says which is
missing. ``auto`` picks megakernel where it can, else reference, and logs the
choice and the reason once per layer.
"""

import os
import sys
from typing import Callable, Tuple

import torch
from .env import logger


class UniEPBackendError(RuntimeError):
    """The requested backend cannot run here; the message says why."""


def megakernel_status(device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) for the megakernel backend on ``device``. Builds nothing."""
    if device.type != "cuda":
        return False, f"inputs are on {device.type}, the megakernel backend needs CUDA tensors"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        from ._ops import ops_package
        megakernel_available = ops_package().megakernel_available
    except ImportError as err:
        return False, f"the UniEP ops cannot be imported ({err})"
    return megakernel_available(device)


def check_requested(backend: str) -> None:
    """Fail at construction when ``backend`` can never work on this machine."""
    if backend == "megakernel" and not torch.cuda.is_available():
        raise UniEPBackendError('"uniep": {"backend": "megakernel"} needs CUDA GPUs, and this machine has none '
                                '(torch.cuda.is_available() is False); use "backend": "reference" or "auto"')


def resolve(backend: str, device: torch.device, layer_name: str, topology=None) -> str:
    """The backend a layer runs on ``device``: ``"reference"`` or ``"megakernel"``. ``topology``: the
    layer's expert-parallel group over nodes (:class:`ds_uniep.topology.GroupTopology`); on a group
    spanning nodes the megakernel cannot run (its symmetric memory reaches one node's GPUs)."""
    if backend == "reference":
        return "reference"
    if topology is not None and topology.spans_nodes:
        # Next step (GPU): the megakernel inside each node with NCCL between nodes (ds_uniep.twolevel).
        why = f"the expert-parallel group spans {topology.describe()} and symmetric memory reaches one node's GPUs"
        if backend == "megakernel":
            raise UniEPBackendError(f"{layer_name}: backend 'megakernel' cannot run: {why}; use 'auto' or "
                                    "'reference' (the two-level reference path across nodes)")
        path = ("the two-level reference path: each token once per node across, then inside the node"
                if topology.uniform else "the flat reference all-to-all: its nodes hold different numbers of its ranks")
        logger.info(f"{layer_name}: backend auto -> reference ({why}; {path})")
        return "reference"
    ok, reason = megakernel_status(device)
    if backend == "megakernel":
        if not ok:
            raise UniEPBackendError(f"{layer_name}: backend 'megakernel' cannot run: {reason}")
        return "megakernel"
    chosen = "megakernel" if ok else "reference"
    logger.info(f"{layer_name}: backend auto -> {chosen} ({'megakernel available' if ok else reason})")
    return chosen


def run_script(main: Callable[[], None]) -> None:
    """Run a training script's ``main()`` (the examples' ``__main__``).

    A :class:`UniEPBackendError` (a backend that cannot run here) is printed as one line on stderr
    and exits with code 2 instead of a traceback; any other error propagates. After ``main()``
    returns (having destroyed its process group) the process leaves with code 0 without running
    C++ static destructors: a communication thread can abort a finished process ("terminate called
    without an active exception") at interpreter exit, which would turn a good run into exit code -6.
    """
    try:
        main()
    except UniEPBackendError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
