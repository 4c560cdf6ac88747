"""Routing through DeepSpeed's gate, without the work a dropless layer throws away.

``UniEPMoE`` routes with DeepSpeed's own ``TopKGate`` (its weights, its softmax and top-k, its
auxiliary loss), called with ``sparse_routes=True``. For k >= 3 without token dropping,
DeepSpeed's ``topkgating`` also computes every pair's location, a cumulative sum over the
``[T, E]`` mask (on a GPU, 1.5 ms at T = 8192, E = 64: torch scans an outer dimension with
one thread per column), and the capacity, the largest expert count all-reduced over the
expert-parallel group. A dropless layer uses neither: rows are placed by ``ds_uniep.layout``.

:func:`route` runs the same operations as ``TopKGate.forward`` followed by ``topkgating``, in
the same order on the same tensors, minus those two, so the routes, gates, auxiliary loss and
counts are bitwise DeepSpeed's (``tests/test_gating.py`` checks this against the gate
itself). Any other gate (k of 1 or 2, token dropping, a gate class of the user's own) is
called as it is.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _is_plain_topk_gate(gate) -> bool:
    try:
        from deepspeed.moe.sharded_moe import TopKGate
    except ImportError:
        return False
    return type(gate) is TopKGate and gate.k >= 3 and not gate.drop_tokens


def route(gate, x: Tensor, used_token: Optional[Tensor] = None
          ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    """``(l_aux, capacity, route_idx [k, T] int32, route_gates [k, T] fp32, exp_counts [E])``
    of ``gate(x, used_token, sparse_routes=True)``; ``capacity`` is None on the dropless
    top-k path (which skips it, see the module doc)."""
    if not _is_plain_topk_gate(gate):
        l_aux, capacity, _, route_idx, _, route_gates, exp_counts = gate(x, used_token, True)
        return l_aux, capacity, route_idx, route_gates, exp_counts
    from deepspeed.moe import sharded_moe as sm
    if gate.wall_clock_breakdown:
        gate.timers(sm.TOPK_GATE_TIMER).start()
    # TopKGate.forward
    input_fp32 = x.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        input_fp32 = sm.multiplicative_jitter(input_fp32, device=x.device)
    logits = F.linear(input_fp32, weight=gate.wg.weight.float(), bias=None)
    # topkgating(logits, k, ..., drop_tokens=False, sparse_routes=True), without locations and capacity
    k = gate.k
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    gates_masked = gates * mask
    gates_s = torch.sum(gates_masked, dim=-1, keepdim=True)
    denom_s = torch.clamp(gates_s, min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom_s
    # Without dropping every route is kept: the route indices are top_idx itself.
    route_gates = gates_masked.gather(1, top_idx)
    route_idx = top_idx.t().contiguous().to(torch.int32)
    route_gates = route_gates.t().contiguous()
    if gate.wall_clock_breakdown:
        gate.timers(sm.TOPK_GATE_TIMER).stop()
        gate.gate_time = gate.timers(sm.TOPK_GATE_TIMER).elapsed(reset=False)
    return l_aux, None, route_idx, route_gates, exp_counts
