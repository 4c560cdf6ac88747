"""Hugging Face MoE models on ds_uniep: :func:`convert_hf_model`, the block it puts in place of each
MoE block, and saving back in the model's own layout (:func:`save_hf_pretrained`).

Where each family keeps its router, experts and shared experts is DeepSpeed's knowledge, not ours:
:func:`convert_hf_model` runs DeepSpeed AutoEP's own detection (``deepspeed.module_inject.auto_ep``:
its presets ``mixtral``, ``qwen3_moe`` (Qwen3-MoE and Qwen2-MoE), ``deepseek_v2`` and ``deepseek_v3``)
and builds each :class:`HFMoEBlock` from the ``MoELayerSpec`` it returns: the router and its scoring,
top-k, renormalisation, scaling and groups, the experts' storage (fused 3-D ``gate_up_proj`` /
``down_proj`` as transformers 5.x keeps them, or per-expert ``nn.Linear``), the shared experts and the
shared expert's gate. What the presets do not carry is read here, and said where it is read.

The block routes with a :class:`ds_uniep.routers.Router` and runs the same dispatch, experts and
combine as ``UniEPMoE`` (it holds one, ``moe``, whose gate is the router), with this rank's share of
the experts; the shared experts run beside them on the same rows, and are added as the model adds
them.
"""
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from .config import UniEPConfig
from .env import logger
from .experts import SwiGLUExpert
from .layer import UniEPMoE
from .routers import AddAuxLoss, Router, RouterOptions

#: The AutoEP presets whose families ds_uniep converts (their routers are those of ds_uniep.routers).
PRESETS = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
#: The keys of convert_hf_model's ``router`` argument: what no AutoEP preset or model config says.
ROUTER_KEYS = ("aux_loss", "aux_loss_coef", "bias_update_rate")


def supported_model_types() -> tuple:
    """The Hugging Face ``model_type`` values :func:`convert_hf_model` converts (from AutoEP's presets)."""
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset
    return tuple(t for name in PRESETS for t in get_preset(name).hf_model_types)


def _preset_for(model_type: str) -> str:
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type
    name = preset_name_for_hf_model_type(model_type)
    if name not in PRESETS:
        raise ValueError(f"convert_hf_model: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(supported_model_types())}")
    return name


class HFMoEBlock(nn.Module):
    """One Hugging Face MoE block on ds_uniep: ``moe`` (a :class:`UniEPMoE` whose gate is a
    :class:`Router`, holding this rank's experts), and the model's shared experts and shared-expert
    gate under the model's own names. ``forward(hidden_states [..., M]) -> [..., M]`` as the model's
    block; a training forward's auxiliary loss reaches the parameters through the output's backward
    (:class:`ds_uniep.routers.AddAuxLoss`) and is kept as ``l_aux``."""

    def __init__(self, moe: UniEPMoE, shared: Optional[nn.Module], shared_gate: Optional[nn.Module],
                 layout: Dict[str, Any]):
        super().__init__()
        self.moe = moe
        #: where the model keeps each part, for saving in its layout (see hf_state_dict)
        self.layout = dict(layout)
        self.shared_name, self.shared_gate_name = layout.get("shared"), layout.get("shared_gate")
        if shared is not None:
            self.add_module(self.shared_name, shared)
        if shared_gate is not None:
            self.add_module(self.shared_gate_name, shared_gate)
        self.l_aux: Optional[Tensor] = None

    @property
    def router(self) -> Router:
        return self.moe.deepspeed_moe.gate

    def forward(self, hidden_states: Tensor) -> Tensor:
        self._check_group()
        self.router.seq_len = hidden_states.shape[-2] if hidden_states.dim() >= 3 else None
        out, l_aux, _ = self.moe(hidden_states)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden_states)
            if self.shared_gate_name is not None:  # Qwen2-MoE: sigmoid(gate(x)) * shared_expert(x)
                shared = torch.sigmoid(getattr(self, self.shared_gate_name)(hidden_states)) * shared
            out = out + shared
        self.l_aux = l_aux.detach()
        if self.training and l_aux.requires_grad:
            out = AddAuxLoss.apply(out, l_aux)
        return out

    def _check_group(self) -> None:
        """The experts were read for expert-parallel rank ``layout["ep_rank"]``: the group the layer got
        must put this rank there."""
        group = self.moe.ep_group
        if self.moe.ep_size > 1 and group is not None:
            rank = torch.distributed.get_rank(group=group)
            if rank != self.layout["ep_rank"]:
                raise RuntimeError(f"{self.moe.layer_name}: experts were read for expert-parallel rank "
                                   f"{self.layout['ep_rank']} (global rank % ep_size) but the layer's group puts this "
                                   f"rank at {rank}; use_data_before_expert_parallel_ is not supported")


def _ds_dict(ds_config) -> Dict[str, Any]:
    if ds_config is None:
        return {}
    if isinstance(ds_config, (str, os.PathLike)):
        with open(ds_config) as f:
            return json.load(f)
    if not isinstance(ds_config, Mapping):
        raise TypeError(f"convert_hf_model: ds_config must be a path or a dict, got {type(ds_config).__name__}")
    return dict(ds_config)


def _ep_size(ep_size: Optional[int], ep_block: Mapping[str, Any]) -> int:
    """``ep_size`` as given, else DeepSpeed AutoEP's ``expert_parallel.autoep_size``, else 1."""
    if ep_size is None:
        ep_size = ep_block.get("autoep_size", 1)
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"convert_hf_model: ep_size must be a positive integer, got {ep_size!r}")
    return ep_size


def _ep_rank(ep_size: int) -> int:
    """This rank's place in its expert-parallel group as DeepSpeed builds the groups (consecutive ranks)."""
    if ep_size == 1:
        return 0
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(f"convert_hf_model: ep_size={ep_size} needs torch.distributed started "
                           "(deepspeed.init_distributed()) before the conversion, to know which experts this rank "
                           "keeps")
    world = torch.distributed.get_world_size()
    if world % ep_size:
        raise ValueError(f"convert_hf_model: ep_size={ep_size} does not divide the world size {world}")
    return torch.distributed.get_rank() % ep_size


def _router_options(spec, model_config, router: Mapping[str, Any], has_bias: bool) -> RouterOptions:
    """The router options of one layer: AutoEP's resolved scoring, top-k normalisation, scaling and
    groups (``spec``), the expert bias where the model keeps one, and ``router``'s keys."""
    bad = [k for k in router if k not in ROUTER_KEYS]
    if bad:
        raise ValueError(f"convert_hf_model: unknown router option(s) {bad}; allowed: {list(ROUTER_KEYS)}")
    where = f"convert_hf_model: {spec.moe_module_name} ({spec.model_family})"
    if spec.score_apply != "post":
        raise ValueError(f"{where}: score_apply {spec.score_apply!r} (scores applied to the expert inputs) cannot "
                         "be honoured: ds_uniep weights the expert outputs ('post')")
    if spec.gate_bias:
        raise ValueError(f"{where}: a router with a bias cannot be honoured (ds_uniep's routers are bias-free)")
    if spec.expert_activation != "swiglu":
        raise ValueError(f"{where}: expert activation {spec.expert_activation!r} cannot be honoured: ds_uniep runs "
                         "SwiGLU (silu) experts")
    # Not in the presets (AutoEP only warns about them): the router's jitter and z-loss, and the
    # model-level load-balancing loss over recorded router logits, which a Router does not record.
    for name in ("router_jitter_noise", "router_z_loss_coef"):
        if getattr(model_config, name, 0) or 0:
            raise ValueError(f"{where}: {name}={getattr(model_config, name)} cannot be honoured: set it to 0")
    if getattr(model_config, "output_router_logits", False):
        raise ValueError(f"{where}: output_router_logits=True cannot be honoured (the model's aux loss reads router "
                         "logits a ds_uniep Router does not record); set it False and pass "
                         "router={'aux_loss': 'aux_loss', 'aux_loss_coef': ...} instead")
    if float(router.get("bias_update_rate", 0.0)) > 0 and not has_bias:
        raise ValueError(f"{where}: bias_update_rate needs an aux-loss-free expert bias, which this model does not "
                         "keep (nor could its checkpoint)")
    groups = spec.num_expert_groups is not None and spec.num_expert_groups >= 1
    # AutoEP fills num_expert_groups from the config's n_group for every family
    # (fill_autoep_config_from_hf), also for DeepSeek-V2 with topk_method "greedy", whose router
    # ignores its groups: its groups count only with "group_limited_greedy".
    if spec.model_family == "deepseek_v2" and getattr(model_config, "topk_method", None) != "group_limited_greedy":
        groups = False
    if groups and spec.num_limited_groups is None:
        raise ValueError(f"{where}: num_expert_groups={spec.num_expert_groups} without num_limited_groups")
    return RouterOptions(
        score_func=spec.score_func, norm_topk_prob=bool(spec.route_norm), routed_scaling_factor=float(spec.route_scale),
        n_group=spec.num_expert_groups if groups else None, topk_group=spec.num_limited_groups if groups else None,
        group_score=spec.group_score_func, expert_bias=has_bias,
        bias_update_rate=float(router.get("bias_update_rate", 0.0)), aux_loss=router.get("aux_loss", "none"),
        aux_loss_coef=float(router.get("aux_loss_coef", 0.0)))


def _expert_weights(experts: nn.Module, spec, e: int):
    """``(w1 [F, M], w3 [F, M], w2 [M, F])`` of expert ``e`` (gate, up, down) as the model keeps them."""
    if spec.expert_storage == "module_list":
        ex = experts[e]
        get = lambda name: getattr(ex, name).weight  # noqa: E731
        return get(spec.expert_w1_name), get(spec.expert_w3_name), get(spec.expert_w2_name)
    w1 = getattr(experts, spec.expert_w1_name)
    w2 = getattr(experts, spec.expert_w2_name)
    if spec.expert_w3_name is not None:
        return w1[e], getattr(experts, spec.expert_w3_name)[e], w2[e]
    if _fused_layout(w1, w2).needs_transpose:  # [E, M, 2F] / [E, F, M]
        gate, up = w1[e].t().chunk(2, dim=0)
        return gate, up, w2[e].t()
    gate, up = w1[e].chunk(2, dim=0)  # [E, 2F, M]: gate over up, as HF's .chunk(2, dim=-1) of the product
    return gate, up, w2[e]


def _fused_layout(w1: Tensor, w2: Tensor):
    from deepspeed.module_inject.auto_ep import classify_fused_gate_up_layout
    return classify_fused_gate_up_layout(tuple(w1.shape), tuple(w2.shape))


def _score_bias(source: nn.Module, spec) -> Optional[Tensor]:
    """The layer's aux-loss-free expert bias (DeepSeek-V3's ``e_score_correction_bias``), or None."""
    if spec.e_score_correction_bias_path is None:
        return None
    return source.get_submodule(spec.e_score_correction_bias_path).e_score_correction_bias


def _check_layer(source: nn.Module, spec, ep_size: int) -> None:
    if spec.num_experts % ep_size:
        raise ValueError(f"convert_hf_model: {spec.moe_module_name}: ep_size={ep_size} does not divide its "
                         f"{spec.num_experts} experts")
    if any(hasattr(p, "ds_id") for p in source.parameters()):
        raise ValueError(f"convert_hf_model: {spec.moe_module_name} is partitioned by ZeRO-3; convert before "
                         "zero.Init / deepspeed.initialize")


def _build_block(source: nn.Module, spec, options: RouterOptions, cfg: UniEPConfig, ep_size: int,
                 ep_rank: int) -> HFMoEBlock:
    E, k, H, F_ = spec.num_experts, spec.top_k, spec.hidden_size, spec.ffn_hidden_size
    hf_router = getattr(source, spec.router_name)
    experts = getattr(source, spec.experts_name)
    bias = _score_bias(source, spec)
    w = _expert_weights(experts, spec, 0)[0]
    moe = UniEPMoE(H, SwiGLUExpert(H, F_), num_experts=E, ep_size=ep_size, k=k, min_capacity=0, drop_tokens=False,
                   config=cfg)
    moe.to(device=w.device, dtype=w.dtype)
    L = E // ep_size
    with torch.no_grad():
        for l, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            w1, w3, w2 = _expert_weights(experts, spec, ep_rank * L + l)
            ex.w1.weight.copy_(w1)
            ex.w3.weight.copy_(w3)
            ex.w2.weight.copy_(w2)
    r = Router(H, E, k, options)
    r.weight = hf_router.weight  # the model's own parameter, as it is
    if bias is not None:
        r.e_score_correction_bias.copy_(bias.float())
    r.to(device=w.device)
    moe.deepspeed_moe.gate = r
    moe.layer_name = f"UniEPMoE[{spec.moe_module_name}]"
    layout = {"family": spec.model_family, "router": spec.router_name, "experts": spec.experts_name,
              "storage": spec.expert_storage, "w1": spec.expert_w1_name, "w2": spec.expert_w2_name,
              "w3": spec.expert_w3_name, "ep_rank": ep_rank, "num_experts": E,
              "transposed": spec.expert_storage == "fused_3d" and spec.expert_w3_name is None
              and _fused_layout(getattr(experts, spec.expert_w1_name),
                                getattr(experts, spec.expert_w2_name)).needs_transpose,
              "shared": spec.shared_experts_name or None, "shared_gate": spec.shared_experts_gate_name or None,
              "bias_path": (f"{spec.e_score_correction_bias_path}.e_score_correction_bias"
                            if spec.e_score_correction_bias_path is not None else None)}
    shared = getattr(source, spec.shared_experts_name) if spec.has_shared_experts else None
    shared_gate = getattr(source, spec.shared_experts_gate_name) if spec.shared_experts_gate_name else None
    block = HFMoEBlock(moe, shared, shared_gate, layout)
    block.train(source.training)
    return block


def convert_hf_model(model: nn.Module, ds_config: Union[str, os.PathLike, Mapping[str, Any], None] = None, *,
                     ep_size: Optional[int] = None, router: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Replace, in place, every MoE block of a Hugging Face model with an :class:`HFMoEBlock`; returns
    their names.

    ``ds_config``: the ds_config (path or dict) given to ``deepspeed.initialize``; its ``"uniep"`` block
    chooses backend and options as for ``UniEPMoE``. Its ``"expert_parallel"`` block is DeepSpeed
    AutoEP's and is read as AutoEP reads it (``route_norm``, ``routed_scaling_factor``,
    ``num_expert_groups``, ``score_func``, ``top_k``, ... override the model's), with ``enabled``
    false (else AutoEP would convert the model again in ``deepspeed.initialize``).
    ``ep_size``: the expert-parallel size; default ``expert_parallel.autoep_size``, else 1; this rank
    keeps experts ``(rank % ep_size) * E / ep_size`` onwards, as DeepSpeed lays out its groups (so
    torch.distributed must be started when ``ep_size`` > 1). ``router``: what the models do not say:
    ``aux_loss`` ("none", "aux_loss", "seq_aux_loss"), ``aux_loss_coef`` and ``bias_update_rate``
    (the expert bias's step, for models with one; see ``ds_uniep.update_expert_biases``).

    Call it before ``deepspeed.initialize``. Every error (an unsupported ``model_type``, an ep_size
    that does not divide the experts, a router or expert option ds_uniep cannot honour) is raised
    before any block is replaced.
    """
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    model_config = getattr(model, "config", None)
    model_type = getattr(model_config, "model_type", None)
    if model_type is None:
        raise ValueError("convert_hf_model needs a Hugging Face model (one with config.model_type); supported "
                         f"model types: {', '.join(supported_model_types())}")
    preset = _preset_for(model_type)
    ds = _ds_dict(ds_config)
    cfg = UniEPConfig.from_ds_config(ds)
    if not cfg.enabled:
        raise ValueError('convert_hf_model: "uniep": {"enabled": false} cannot run a converted model (DeepSpeed\'s '
                         "own MoE layer does not run these routers)")
    ep_block = dict(ds.get("expert_parallel") or {})
    if ep_block.get("enabled"):
        raise ValueError('convert_hf_model: "expert_parallel": {"enabled": true} makes DeepSpeed AutoEP convert the '
                         "model too; set it false (its autoep_size and routing keys are still read)")
    ep_size = _ep_size(ep_size, ep_block)
    ep_block.update(enabled=False, preset_model=preset)
    specs = AutoEP(model, parse_autoep_config(ep_block)).ep_parser()
    sources = [model.get_submodule(spec.moe_module_name) for spec in specs]
    options = []
    for source, spec in zip(sources, specs):
        _check_layer(source, spec, ep_size)
        options.append(_router_options(spec, model_config, router or {}, _score_bias(source, spec) is not None))
    ep_rank = _ep_rank(ep_size)
    blocks = [(spec, _build_block(source, spec, o, cfg, ep_size, ep_rank))
              for source, spec, o in zip(sources, specs, options)]
    for spec, block in blocks:
        parent_name, _, attr = spec.moe_module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, block)
    if ep_size > 1:  # the groups now, so the model runs without an engine too (DeepSpeed's engine reuses them)
        for _, block in blocks:
            block.moe.set_deepspeed_parallelism()
    logger.info(f"convert_hf_model: {len(blocks)} {model_type} MoE blocks on ds_uniep (ep_size={ep_size})")
    return [spec.moe_module_name for spec in specs]


# ---------------------------------------------------------------------------------------------- saving
def _gather(t: Tensor, group, size: int) -> Tensor:
    """``t [L, ...]`` of every rank of ``group`` (``size`` ranks), concatenated in group-rank order."""
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def hf_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """The model's state dict in its own Hugging Face layout (all experts gathered over each block's
    expert-parallel group): a collective, call it on every rank. The keys are those of the model
    before :func:`convert_hf_model` (its in-memory layout, which ``save_pretrained`` writes in the
    checkpoint's format)."""
    sd = model.state_dict()
    for name, block in model.named_modules():
        if not isinstance(block, HFMoEBlock):
            continue
        p = f"{name}." if name else ""
        for key in [k for k in sd if k.startswith(f"{p}moe.")]:
            del sd[key]
        lay, moe = block.layout, block.moe
        sd[f"{p}{lay['router']}.weight"] = block.router.weight.detach()
        if lay["bias_path"] is not None:
            sd[f"{p}{lay['bias_path']}"] = block.router.e_score_correction_bias.detach()
        experts = moe.deepspeed_moe.experts.deepspeed_experts
        stack = lambda proj: torch.stack([getattr(e, proj).weight.detach() for e in experts])  # noqa: E731
        w1, w3, w2 = (_gather(stack(n), moe.ep_group, moe.ep_size) for n in ("w1", "w3", "w2"))
        ex = f"{p}{lay['experts']}"
        if lay["storage"] == "module_list":
            for e in range(lay["num_experts"]):
                for which, t in ((lay["w1"], w1), (lay["w3"], w3), (lay["w2"], w2)):
                    sd[f"{ex}.{e}.{which}.weight"] = t[e]
        elif lay["w3"] is not None:
            sd[f"{ex}.{lay['w1']}"], sd[f"{ex}.{lay['w3']}"], sd[f"{ex}.{lay['w2']}"] = w1, w3, w2
        elif lay["transposed"]:
            sd[f"{ex}.{lay['w1']}"] = torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous()
            sd[f"{ex}.{lay['w2']}"] = w2.transpose(1, 2).contiguous()
        else:
            sd[f"{ex}.{lay['w1']}"] = torch.cat([w1, w3], dim=1)
            sd[f"{ex}.{lay['w2']}"] = w2
    return sd


def save_hf_pretrained(model: nn.Module, save_directory: Union[str, os.PathLike], **kwargs) -> None:
    """``model.save_pretrained(save_directory, state_dict=hf_state_dict(model))`` on global rank 0 (every
    rank takes part in gathering the experts): the folder loads with plain transformers'
    ``from_pretrained``. ``kwargs`` go to ``save_pretrained``."""
    sd = hf_state_dict(model)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not dist or torch.distributed.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=sd, **kwargs)
    if dist:
        torch.distributed.barrier()
