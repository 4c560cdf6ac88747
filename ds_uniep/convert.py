"""Swap every stock ``deepspeed.moe.layer.MoE`` of a model for a ``UniEPMoE`` with the same weights."""

import os
from typing import Any, Mapping, Union

from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import TopKGate
from torch import nn

from .config import UniEPConfig
from .experts import pack_experts
from .layer import UniEPMoE

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _why_not(moe: MoE) -> str:
    """Why ``moe`` cannot be rebuilt as a UniEPMoE that computes the same, or ""."""
    cls = type(moe)
    if cls.forward is not MoE.forward:
        return f"{cls.__name__} overrides MoE.forward, which UniEPMoE would not run"
    gate = moe.deepspeed_moe.gate
    if type(gate) is not TopKGate:
        return f"its gate is a {type(gate).__name__}, not DeepSpeed's TopKGate"
    experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
    first = experts[0]
    shapes = [(n, tuple(p.shape)) for n, p in first.named_parameters()]
    for i, e in enumerate(experts[1:], 1):
        if type(e) is not type(first) or [(n, tuple(p.shape)) for n, p in e.named_parameters()] != shapes:
            return (f"local expert {i} ({type(e).__name__}) differs from expert 0 ({type(first).__name__}) in type "
                    "or parameters; UniEPMoE builds its experts as copies of one module")
    return ""


def _twin(moe: MoE, config: UniEPConfig) -> UniEPMoE:
    gate = moe.deepspeed_moe.gate
    expert = moe.mlp if moe.use_residual else moe.deepspeed_moe.experts.deepspeed_experts[0]
    new = UniEPMoE(gate.wg.in_features, expert, moe.num_experts, moe.ep_size, gate.k, gate.capacity_factor,
                   gate.eval_capacity_factor, gate.min_capacity, moe.use_residual, gate.noisy_gate_policy,
                   gate.drop_tokens, gate.use_rts, moe.deepspeed_moe.use_tutel, moe.enable_expert_tensor_parallelism,
                   gate.top2_2nd_expert_sampling, config=config)
    # Share the very tensors (dtype, device and values) instead of copying through
    # load_state_dict, which would cast into the new module's fp32 CPU parameters.
    old_params = dict(moe.named_parameters())
    for name, p in new.named_parameters():
        p.data = old_params[name].data
        p.requires_grad_(old_params[name].requires_grad)
    old_buffers = dict(moe.named_buffers())
    for name, b in new.named_buffers():
        b.data = old_buffers[name].data
    # Laid out again as the grouped GEMMs read them (the constructor packed the placeholder weights).
    pack_experts(new.deepspeed_moe.experts.deepspeed_experts)
    if moe.deepspeed_moe.ep_group is not None:
        new.deepspeed_moe._set_ep_group(moe.deepspeed_moe.ep_group)
    for attr in _HOOK_DICTS:  # the same dicts: hooks registered on the old layer fire, and their handles work
        if hasattr(moe, attr):
            setattr(new, attr, getattr(moe, attr))
    new.train(moe.training)
    return new


def convert_moe_layers(model: nn.Module,
                       config: Union[UniEPConfig, str, os.PathLike, Mapping[str, Any], None] = None) -> int:
    """Replace, in place, every ``MoE`` that is not already a ``UniEPMoE``; returns how many.

    ``config``: a UniEPConfig, a ds_config path or dict with a ``"uniep"`` block, or the block.
    Call it before ``deepspeed.initialize`` (the engine builds its MoE groups there). The new
    layers share the old ones' parameter values, dtype and device, and their hooks. A layer that
    cannot be rebuilt exactly (a subclass with its own ``forward``, another gate, local experts that
    differ in type or shapes) raises a ValueError naming it, before anything is replaced.
    """
    cfg = UniEPConfig.coerce(config)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE) and not isinstance(m, UniEPMoE)]
    if isinstance(model, MoE) and targets and targets[0][0] == "":
        raise ValueError("convert_moe_layers needs a model that holds MoE layers, not an MoE layer itself; "
                         "build UniEPMoE directly instead")
    bad = [f"{name}: {why}" for name, m in targets for why in [_why_not(m)] if why]
    if bad:
        raise ValueError("convert_moe_layers cannot convert " + "; ".join(bad))
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        twin = _twin(m, cfg)
        twin.layer_name = f"UniEPMoE[{name}]"
        setattr(parent, attr, twin)
    return len(targets)
