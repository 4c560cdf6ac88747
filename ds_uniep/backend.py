"""Backend choice: never silent, never a failure deep inside a kernel.

``reference`` always works. ``megakernel`` needs CUDA, a Hopper GPU, the UniEP
ops and NVLink peers; asking for it without them is an error that says which is
missing. ``auto`` picks megakernel where it can, else reference, and logs the
choice and the reason once per layer.
"""

from typing import Tuple

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
        from .megakernel import ops_package
        megakernel_available = ops_package().megakernel_available
    except ImportError as err:
        return False, f"the UniEP ops cannot be imported ({err})"
    return megakernel_available(device)


def check_requested(backend: str) -> None:
    """Fail at construction when ``backend`` can never work on this machine."""
    if backend == "megakernel" and not torch.cuda.is_available():
        raise UniEPBackendError('"uniep": {"backend": "megakernel"} needs CUDA GPUs, and this machine has none '
                                '(torch.cuda.is_available() is False); use "backend": "reference" or "auto"')


def resolve(backend: str, device: torch.device, layer_name: str) -> str:
    """The backend a layer runs on ``device``: ``"reference"`` or ``"megakernel"``."""
    if backend == "reference":
        return "reference"
    ok, reason = megakernel_status(device)
    if backend == "megakernel":
        if not ok:
            raise UniEPBackendError(f"{layer_name}: backend 'megakernel' cannot run: {reason}")
        return "megakernel"
    chosen = "megakernel" if ok else "reference"
    logger.info(f"{layer_name}: backend auto -> {chosen} ({'megakernel available' if ok else reason})")
    return chosen
