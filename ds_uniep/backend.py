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


def resolve(backend: str, device: torch.device, layer_name: str, topology=None, unsupported_across: str = "") -> str:
    """The backend a layer runs on ``device``: ``"reference"`` or ``"megakernel"``. ``topology``: the
    layer's expert-parallel group over nodes (:class:`ds_uniep.topology.GroupTopology`); on a group
    spanning nodes the megakernel's symmetric memory reaches one node's GPUs, so there it runs inside
    each node with NCCL between nodes (:func:`_resolve_across_nodes`), unless ``unsupported_across``
    names what of the layer's configuration that path does not run."""
    if backend == "reference":
        return "reference"
    if topology is not None and topology.spans_nodes:
        return _resolve_across_nodes(backend, device, layer_name, topology, unsupported_across)
    ok, reason = megakernel_status(device)
    if backend == "megakernel":
        if not ok:
            raise UniEPBackendError(f"{layer_name}: backend 'megakernel' cannot run: {reason}")
        return "megakernel"
    chosen = "megakernel" if ok else "reference"
    logger.info(f"{layer_name}: backend auto -> {chosen} ({'megakernel available' if ok else reason})")
    return chosen


def _resolve_across_nodes(backend: str, device: torch.device, layer_name: str, topology, unsupported: str) -> str:
    """``resolve`` on a group spanning nodes: the megakernel runs inside each node with NCCL across
    (:class:`ds_uniep.twolevel.TwoLevelNVLinkDispatcher`) where every node holds the same number of
    the group's ranks and the megakernel can run on this node's GPUs; else the reference backend."""
    spans = f"the expert-parallel group spans {topology.describe()}"
    uneven = "its nodes hold different numbers of its ranks"
    ok, reason = megakernel_status(device)
    why = (reason if not ok else uneven if not topology.uniform else
           f"{unsupported} runs on the reference backend across nodes" if unsupported else "")
    if backend == "megakernel":
        if why:
            raise UniEPBackendError(f"{layer_name}: backend 'megakernel' cannot run: {spans} and {why}; use 'auto' "
                                    "or 'reference'")
        logger.info(f"{layer_name}: backend megakernel across nodes: {spans}; the megakernel inside each node, "
                    "NCCL between nodes (two-level: each token once per node across)")
        return "megakernel"
    if not why:
        logger.info(f"{layer_name}: backend auto -> megakernel across nodes ({spans}; the megakernel inside each "
                    "node, NCCL between nodes, each token once per node across)")
        return "megakernel"
    path = ("the two-level reference path: each token once per node across, then inside the node"
            if topology.uniform else "the flat reference all-to-all" + ("" if why == uneven else f": {uneven}"))
    logger.info(f"{layer_name}: backend auto -> reference ({spans}; {why}; {path})")
    return "reference"


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
