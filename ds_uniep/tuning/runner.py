"""``run_plan`` callables for :func:`~ds_uniep.tuning.tuner.tune`: the seam between tuner and layer.

The tuner never imports the layer: the layer hands in what a run needs, ``apply(knobs)``
(make the next forward run these knobs) and ``forward(x) -> (output, l_aux, ...)``, and
:func:`live_runner` / :func:`input_runner` turn them into a ``run_plan(knobs)`` that runs
forward and backward. :func:`layer_runner` does the same for any module with a public
``set_plan`` (scripts and tests).

Each backend acts on a few knobs only (``space.ACTING_KNOBS``): the reference
backend reads only ``dispatch_dtype``, so :func:`reference_paths` keeps one
plan per distinct reference path rather than timing identical work many times.
"""

from typing import Callable, Iterable, List, Optional, Tuple

import torch

from .space import Plan, Space
from .tuner import RunPlan

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Apply = Callable[[Plan], None]
"""Makes the layer's next forward run the given knobs (``UniEPMoE.set_plan``)."""
Forward = Callable[[torch.Tensor], Tuple]
"""One forward of the layer: ``x -> (output, l_aux, ...)``."""


def input_runner(apply: Apply, forward: Forward, x: torch.Tensor, *, backward: bool = True,
                 seed: int = 0) -> RunPlan:
    """``run_plan`` running ``forward(x)`` (and its backward with a fixed random output gradient) under
    the knobs it is given, applied through ``apply``."""
    grad: List[Optional[torch.Tensor]] = [None]

    def run_plan(plan: Plan) -> None:
        apply(plan)
        out, l_aux = forward(x)[:2]
        if not backward:
            return
        if grad[0] is None:
            g = torch.Generator(device="cpu").manual_seed(seed)
            grad[0] = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        torch.autograd.backward([out, l_aux], [grad[0], torch.ones_like(l_aux)])

    return run_plan


def layer_runner(layer, x: torch.Tensor, *, backward: bool = True, seed: int = 0) -> RunPlan:
    """:func:`input_runner` of a module with a public ``set_plan(knobs)`` (a UniEPMoE), called on ``x``."""
    return input_runner(layer.set_plan, layer, x, backward=backward, seed=seed)


def live_runner(apply: Apply, forward: Forward, params: Iterable[torch.Tensor], hidden_states: torch.Tensor, *,
                backward: bool = True, seed: int = 0) -> RunPlan:
    """``run_plan`` for a layer tuning itself on its live input, leaving nothing behind.

    ``apply`` puts the knobs into the layer, ``forward`` runs it without module hooks
    (``UniEPMoE.forward``), ``params`` are the layer's parameters. The input is a
    detached copy of ``hidden_states`` (the user's graph never sees the tuning runs);
    the backward is ``torch.autograd.grad`` over the input and the parameters that
    require grad, so no ``.grad`` is written and no accumulate-grad hook (DeepSpeed's
    gradient reduction) fires, yet the backward does the work a training step's does.
    The caller restores RNG states (the gate may draw random numbers)."""
    x = hidden_states.detach().clone().requires_grad_(backward)
    params = [p for p in params if p.requires_grad]
    grad: List[Optional[torch.Tensor]] = [None]

    def run_plan(plan: Plan) -> None:
        apply(plan)
        with torch.enable_grad() if backward else torch.no_grad():
            out, l_aux = forward(x)[:2]
            if not backward:
                return
            if grad[0] is None:
                gen = torch.Generator(device="cpu").manual_seed(seed)
                grad[0] = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
            outs = [(o, g) for o, g in ((out, grad[0]), (l_aux, torch.ones_like(l_aux))) if o.requires_grad]
            if outs:
                torch.autograd.grad([o for o, _ in outs], [x] + params, [g for _, g in outs],
                                    allow_unused=True)

    return run_plan


def reference_paths(space: Space) -> Space:
    """The sub-space of plans that take different paths through the reference backend: one per dispatch dtype."""
    return space.for_backend("reference")


def runnable_gemms(configured: str, device, dtype: str, group=None) -> Tuple[str, ...]:
    """The grouped GEMMs a megakernel layer can run its experts on here, for ``Space(gemms=...)``:
    torch's and ds_uniep's for bf16 rows on a device where ds_uniep's GEMM can run
    (:func:`ds_uniep.gemm.available`), else the ``configured`` one only. With ``group``, ds_uniep's
    counts only where it can run on every rank of it (all spaces must be the same)."""
    device = torch.device(device)
    ok = dtype == "bf16" and device.type == "cuda"
    if ok:
        from ..gemm import available
        ok = available(device)[0]
    if group is not None:
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    return ("torch", "uniep") if ok else (configured, )


def megakernel_status() -> Tuple[bool, str]:
    """(usable, reason) for timing plans on the megakernel backend here."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    from ..backend import megakernel_status as status
    ok, reason = status(torch.device("cuda", torch.cuda.current_device()))
    if not ok:
        return False, reason
    try:
        from .. import megakernel  # noqa: F401
    except ImportError as e:
        return False, f"ds_uniep.megakernel cannot be imported ({e})"
    return True, "megakernel available"
