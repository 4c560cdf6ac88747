"""``run_plan`` callables for :func:`~ds_uniep.tuning.tuner.tune`: the seam between tuner and kernels.

:func:`layer_runner` turns any :class:`~ds_uniep.UniEPMoE` and an input into a
``run_plan``: it puts the plan into the layer and runs forward and backward.
``UniEPMoE.set_plan(plan)`` switches plans: a new ``num_comm_sms`` is taken by
the live dispatcher, a new dispatch dtype rebuilds it. :func:`live_runner` is
what a layer uses to tune itself on its live input without leaving a trace.

Each backend acts on a few knobs only (``space.ACTING_KNOBS``): the reference
backend reads only ``dispatch_dtype``, so :func:`reference_paths` keeps one
plan per distinct reference path rather than timing identical work many times.
"""

import os
from typing import List, Optional, Tuple

import torch

from ..experts import SwiGLUExpert
from .space import Plan, Shape, Space
from .tuner import RunPlan

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def apply_plan(layer, plan: Plan) -> None:
    """Make ``layer``'s next forward run ``plan`` (``UniEPMoE.set_plan``)."""
    layer.set_plan(plan)


def layer_runner(layer, x: torch.Tensor, *, backward: bool = True, seed: int = 0) -> RunPlan:
    """``run_plan`` running ``layer(x)`` (and its backward with a fixed random output gradient) under a plan."""
    grad: List[Optional[torch.Tensor]] = [None]

    def run_plan(plan: Plan) -> None:
        apply_plan(layer, plan)
        out, l_aux, _ = layer(x)
        if not backward:
            return
        if grad[0] is None:
            g = torch.Generator(device="cpu").manual_seed(seed)
            grad[0] = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        torch.autograd.backward([out, l_aux], [grad[0], torch.ones_like(l_aux)])

    return run_plan


def live_runner(layer, hidden_states: torch.Tensor, *, backward: bool = True, seed: int = 0) -> RunPlan:
    """``run_plan`` for a layer tuning itself on its live input, leaving nothing behind.

    The input is a detached copy of ``hidden_states`` (the user's graph never
    sees the tuning runs); ``layer.forward`` is called directly (no module
    hooks fire); the backward is ``torch.autograd.grad`` over the input and the
    parameters that require grad, so no ``.grad`` is written and no
    accumulate-grad hook (DeepSpeed's gradient reduction) fires, yet the
    backward does the work a training step's does. The caller restores RNG
    states (the gate may draw random numbers)."""
    x = hidden_states.detach().clone().requires_grad_(backward)
    params = [p for p in layer.parameters() if p.requires_grad]
    grad: List[Optional[torch.Tensor]] = [None]

    def run_plan(plan: Plan) -> None:
        layer.set_plan(plan)
        with torch.enable_grad() if backward else torch.no_grad():
            out, l_aux, _ = layer.forward(x)
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


def build_layer(shape: Shape, config, backend: str, device: torch.device, seed: int = 0):
    """A UniEPMoE with SwiGLU experts at ``shape`` and an input ``[T, M]`` for it, on ``device``.

    With ``shape.ep > 1`` the process must be one of ``ep`` launched ranks
    (``deepspeed`` or ``torchrun``); distributed is initialised here if needed."""
    from ..config import UniEPConfig
    from ..layer import UniEPMoE
    cfg = UniEPConfig.coerce(config).model_copy(update={"backend": backend})
    if shape.ep > 1:
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(f"--ep {shape.ep} needs {shape.ep} ranks: launch with "
                             f"`deepspeed --num_gpus {shape.ep} -m ds_uniep.tune ...` or torchrun")
        import deepspeed
        deepspeed.init_distributed(verbose=False)
        if torch.distributed.get_world_size() != shape.ep:
            raise ValueError(f"--ep {shape.ep} but the job has {torch.distributed.get_world_size()} ranks")
    torch.manual_seed(seed + (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0))
    layer = UniEPMoE(shape.M, SwiGLUExpert(shape.M, shape.F), num_experts=shape.E, ep_size=shape.ep, k=shape.k,
                     min_capacity=0, drop_tokens=False, config=cfg)
    if shape.ep > 1:
        layer.set_deepspeed_parallelism()
    dtype = TORCH_DTYPES[shape.dtype]
    layer = layer.to(device=device, dtype=dtype)
    layer.deepspeed_moe.gate.wg.float()  # fp32 gate, as docs/benchmarks.md runs it
    x = torch.randn(shape.T, shape.M, device=device, dtype=dtype, requires_grad=True)
    return layer, x
