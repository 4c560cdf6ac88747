"""What the schedules share: one forward's :class:`Step`, the gate over the whole input, the stacked
experts, and the local experts over the received rows."""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from torch import Tensor

from .. import gating
from ..experts import run_experts, run_grouped, stack_experts
from ..tensor_parallel import even_sizes, tp_context, tp_slice


@dataclass
class Step:
    """One forward as the schedules see it: the input, the dispatcher that moves its rows, and what
    the gate leaves for the layer's outputs."""

    hidden_states: Tensor  #: the input as given, ``[..., M]``
    x: Tensor  #: the tokens this rank moves, ``[T, M]`` (a TP rank's slice once :func:`route` cut it)
    used_token: Optional[Tensor]
    dispatcher: Any  #: the layer's dispatcher for ``x``'s device, or HybridEP's
    l_aux: Optional[Tensor] = None
    exp_counts: Optional[Tensor] = None
    tp: Optional[Tuple[list, int, Any]] = None  #: ``(sizes, rank, group)`` where a TP rank moved its slice


def set_gate_outputs(layer, step: Step, l_aux: Tensor, exp_counts: Tensor) -> None:
    """The gate's auxiliary loss and counts, on DeepSpeed's ``deepspeed_moe`` (as its MoE keeps them)
    and for the layer's outputs."""
    moe = layer.deepspeed_moe
    moe.l_aux, moe.exp_counts = l_aux, exp_counts
    step.l_aux, step.exp_counts = l_aux, exp_counts


def route(layer, step: Step) -> Tuple[Tensor, Tensor, Tensor]:
    """DeepSpeed's whole gate: ``(expert_idx [T, k] (-1 dropped), gates [T, k] fp32, capacity)``
    (the dropless top-2/top-k paths skip the locations and capacity they do not use:
    ``ds_uniep.gating``). Under tensor parallelism the routes and ``step.x`` are cut to this TP
    rank's slice of the (replicated) tokens, which :meth:`UniEPMoE._finish` gathers back."""
    l_aux, capacity, route_idx, route_gates, exp_counts = gating.route(layer.deepspeed_moe.gate, step.x,
                                                                       step.used_token)
    set_gate_outputs(layer, step, l_aux, exp_counts)
    expert_idx, gates = route_idx.t(), route_gates.t()
    if layer.hybrid.replan is not None:  # "replan_after_steps" plans with the routes seen
        layer.hybrid.count_routes(expert_idx)
    tp_group, tp, tp_rank = tp_context()
    if tp > 1:
        sizes = even_sizes(step.x.shape[0], tp)
        step.x = tp_slice(step.x, sizes, tp_rank, tp_group)
        gates = tp_slice(gates, sizes, tp_rank, tp_group)
        off = sum(sizes[:tp_rank])
        expert_idx = expert_idx[off:off + sizes[tp_rank]]
        step.tp = (sizes, tp_rank, tp_group)
    return expert_idx, gates, capacity


def stack(layer, x: Tensor):
    """The layer's experts stacked for grouped GEMMs on rows like ``x``, or None where they do not run
    as grouped GEMMs (``ds_uniep.experts.stack_experts``, cached per parameter storage)."""
    return stack_experts(layer.deepspeed_moe.experts.deepspeed_experts, x.dtype, x.device, cache=layer._stack_cache)


def comm_blocks(cfg) -> Optional[int]:
    """Blocks of the megakernel's copy kernels: ``overlap.num_comm_sms`` (None, unset: one block per SM,
    since the sequential schedule runs them alone)."""
    return cfg.overlap.num_comm_sms


def gemm_configs(cfg, layer_name: str) -> Optional[Dict[str, str]]:
    """ds_uniep's GEMM configuration for every operation when the ``uniep.overlap`` block sets
    ``tile_m`` or ``tile_n`` (the other :data:`ds_uniep.knobs.DEFAULT_TILE`;
    :func:`ds_uniep.gemm.configs_for_tiles`), else None (its defaults)."""
    overlap = cfg.overlap
    if overlap.tile_m is None and overlap.tile_n is None:
        return None
    from ..gemm import configs_for_tiles
    from ..knobs import DEFAULT_TILE
    tile_m, tile_n = overlap.tile_m or DEFAULT_TILE, overlap.tile_n or DEFAULT_TILE
    try:
        return configs_for_tiles(tile_m, tile_n)
    except ValueError as e:
        raise ValueError(f"{layer_name}: uniep.overlap tile_m={tile_m}, tile_n={tile_n}: {e}") from None


def local_experts(layer, dispatcher, recv: Tensor, local_counts: Tensor, stacked, fused: bool, last=None, into=None,
                  offs: Optional[Tensor] = None) -> Tensor:
    """This rank's experts over the received rows: the fused schedule's grouped GEMMs (the first
    one's tiles waiting for their rows, ``take_fused_waits``; ``last``: runs the last projection,
    ``into``: the first one's dgrad, see ``run_grouped``), else ``run_experts`` (``offs``: the
    grouped GEMMs' int32 row ends, the cumulative ``local_counts``, where the caller has them)."""
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    if fused:
        return run_grouped(experts, recv, local_counts, "uniep", stacked=stacked, waits=dispatcher.take_fused_waits(),
                           configs=layer._gemm_configs(), last=last, into=into)
    gemm = layer._expert_gemm(recv.device)
    return run_experts(experts, recv, local_counts, grouped=stacked is not None, gemm=gemm, stacked=stacked,
                       configs=layer._gemm_configs() if gemm == "uniep" else None, offs=offs)
