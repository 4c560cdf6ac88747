"""A layer tuning itself (``"uniep": {"autotune": {"enabled": true}}``): on its first forward with a
new (T tokens this rank moves, dtype, device) a :class:`~ds_uniep.UniEPMoE` looks the plan up in the
cache, else times the plans its backend acts on (``ds_uniep.tuning``) on a copy of the input, and
then runs under the winner (``UniEPMoE.set_plan``)."""

import sys
from typing import Optional

import torch
from torch import Tensor, nn

from .env import logger
from .experts import stack_experts
from .tensor_parallel import even_sizes, tp_context

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def autotune(layer, hidden_states: Tensor) -> None:
    """Run ``layer`` under the tuned plan for this input's (T, dtype, device), tuning first if none
    is known."""
    T = hidden_states.numel() // layer.hidden_size
    _, tp, tp_rank = tp_context()
    if tp > 1:
        T = even_sizes(T, tp)[tp_rank]
    key = (T, hidden_states.dtype, hidden_states.device)
    plan = layer._tuned_plans.get(key)
    if plan is None:
        plan = tune(layer, hidden_states, T)
        layer._tuned_plans[key] = plan
    if plan is not False and plan != layer._applied_plan:
        layer.set_plan(plan)


def tune(layer, hidden_states: Tensor, T: int):
    """The plan for this shape: from the cache, else measured on every rank of the EP group.
    False when there is nothing to tune (the plan stays the configured one)."""
    from .tuning import GPUInfo, Shape
    from .tuning.runner import live_runner, runnable_gemms
    from .tuning.tuner import tune_from_config
    name = layer.layer_name
    device = hidden_states.device
    dtype = _DTYPE_NAMES.get(hidden_states.dtype)
    if dtype is None or T < 1:
        logger.info(f"{name}: autotune skipped for {T} tokens of {hidden_states.dtype} (tunes "
                    "bf16, fp16 and fp32 inputs with at least one token)")
        return False
    # resolves (and logs) the backend and the schedule once, as an untuned forward would
    layer._schedule(hidden_states.reshape(-1, layer.hidden_size))
    backend = layer._backend_by_device[device]
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    shape = Shape(T=T, M=layer.hidden_size, F=expert_ffn(experts[0], layer.hidden_size), E=layer.num_experts,
                  k=layer.k, dtype=dtype, ep=layer.ep_size)
    group = layer.ep_group
    local = layer.ep_size == 1 or group is None
    if not local:
        check_same_shape(shape, group, name)
    gpu = GPUInfo.detect(device) if device.type == "cuda" else GPUInfo.cpu()
    # The experts' GEMM is a knob where they run as grouped GEMMs on a device with ds_uniep's.
    gemms = None
    if backend == "megakernel":
        grouped = stack_experts(experts, hidden_states.dtype, device, cache=layer._stack_cache) is not None
        gemms = runnable_gemms(layer.configured_config.expert_gemm, device, dtype if grouped else "",
                               None if local else group)
    rank0 = local or torch.distributed.get_rank(group) == 0
    backward = not torch.is_inference_mode_enabled()
    cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    if rank0:  # the progress bar shows only on a terminal: say that tuning runs, and for how long at most
        logger.info(f"{name}: autotune {shape} on the {backend} backend: measuring plans "
                    f"(budget {layer.uniep_config.autotune.budget_s:g} s after the configured and baseline plans, "
                    "unless the plan cache has this shape)")
    layer._autotuning = True
    try:
        # The gate (noisy policies, random token selection) and experts (dropout) may draw
        # random numbers: the caller's RNG streams continue as if tuning never ran.
        with torch.random.fork_rng(devices=cuda_devices):
            # From the configured plan (not the last shape's winner), with the autotune settings in force.
            start = layer.configured_config.model_copy(update={"autotune": layer.uniep_config.autotune})
            run_plan = live_runner(layer.set_plan, layer.forward, layer.parameters(), hidden_states, backward=backward)
            result = tune_from_config(start, shape, run_plan, gpu=gpu, group=group, backend=backend, local=local,
                                      progress=rank0 and sys.stderr.isatty(), gemms=gemms)
    finally:
        layer._autotuning = False
    layer.autotune_results[(T, hidden_states.dtype, device)] = result
    if rank0:
        how = (f"from the cache {result.cache_file}" if result.from_cache else
               f"{_ms(result.best_ms)} ms fwd{'+bwd' if backward else ''} against {_ms(result.default_ms)} ms "
               f"for the configured plan, {len(result.by_status('measured'))} plans measured in "
               f"{result.elapsed_s:.1f} s")
        logger.info(f"{name}: autotune {shape} on the {backend} backend: plan {result.winner.label()} ({how})")
    return result.winner


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def expert_ffn(expert: nn.Module, hidden_size: int) -> int:
    """F of the cache key: the FFN width of a SwiGLU/GeLU expert (or any expert with an ``ffn_size``,
    ``intermediate_size`` or ``w1``/``fc1`` linear), else its parameter count over the hidden size."""
    for name in ("ffn_size", "intermediate_size"):
        v = getattr(expert, name, None)
        if isinstance(v, int) and v > 0:
            return v
    for name in ("w1", "fc1"):
        lin = getattr(expert, name, None)
        if isinstance(lin, nn.Linear):
            return lin.out_features
    return max(1, sum(p.numel() for p in expert.parameters()) // hidden_size)


def check_same_shape(shape, group, layer_name: str) -> None:
    """Every rank of the group must tune the same shape (they run the same plans together)."""
    mine = (shape.T, shape.M, shape.F, shape.E, shape.k, shape.dtype)
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    if any(s != mine for s in everyone):
        raise ValueError(f"{layer_name}: autotune needs the same layer shape on every expert-parallel rank, got "
                         f"(T, M, F, E, k, dtype) = {everyone} per rank; feed every rank the same number of tokens "
                         'on the first forward of a shape, or set "uniep": {"autotune": {"enabled": false}}')
