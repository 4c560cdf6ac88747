"""Routing through DeepSpeed's gate, without the work a dropless layer throws away.

``UniEPMoE`` routes with DeepSpeed's own ``TopKGate`` (its weights, its softmax and top-k, its
auxiliary loss), called with ``sparse_routes=True``. Without token dropping, DeepSpeed's
``topkgating`` (k >= 3) also computes every pair's location, a cumulative sum over the
``[T, E]`` mask (on a GPU, 1.5 ms at T = 8192, E = 64: torch scans an outer dimension with
one thread per column; ``top2gating`` does it twice), and the capacity, the largest expert
count all-reduced over the expert-parallel group. A dropless layer uses neither: rows are
placed by ``ds_uniep.layout``.

For k = 2 and k >= 3 without token dropping, :func:`route` runs the same operations as
``TopKGate.forward`` followed by ``top2gating`` or ``topkgating``, in the same order on the
same tensors (random draws included), minus those two, so the routes, gates, auxiliary loss
and counts are bitwise DeepSpeed's (``tests/test_gating.py`` checks this against the gate
itself). Any other gate (k = 1, token dropping, a gate class of the user's own) is called as
it is.
"""
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _dropless_kind(gate) -> Optional[str]:
    """``"topk"`` (k >= 3) or ``"top2"`` for DeepSpeed's own TopKGate without token dropping, else None."""
    try:
        from deepspeed.moe.sharded_moe import TopKGate
    except ImportError:
        return None
    if type(gate) is not TopKGate or gate.drop_tokens:
        return None
    return "topk" if gate.k >= 3 else "top2" if gate.k == 2 else None


def _topk(gate, logits: Tensor):
    """``topkgating(logits, k, ..., drop_tokens=False, sparse_routes=True)`` without locations and
    capacity, in two steps: ``(top_idx [T, k], rest)``, ``rest() -> (l_aux, route_gates [T, k], exp_counts)``."""
    k = gate.k
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)

    def rest():
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
        return l_aux, gates_masked.gather(1, top_idx), exp_counts

    return top_idx, rest


def _top2(gate, logits: Tensor):
    """``top2gating(logits, ..., drop_tokens=False, sparse_routes=True)`` without locations and
    capacity, in two steps as :func:`_topk`."""
    from deepspeed.moe import sharded_moe as sm
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if gate.top2_2nd_expert_sampling:
        logits += sm.gumbel_rsample(logits.shape, device=logits.device)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)

    def rest():
        mask2 = F.one_hot(indices2_s, num_classes=num_experts)
        me = torch.mean(gates, dim=0)
        ce = torch.mean(mask1.float(), dim=0)
        l_aux = torch.mean(me * ce) * num_experts * num_experts
        exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)
        mask1_float = mask1.float()
        mask2_float = mask2.float()
        gates1_s = sm.einsum("se,se->s", gates, mask1_float)
        gates2_s = sm.einsum("se,se->s", gates, mask2_float)
        denom_s = gates1_s + gates2_s
        denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
        gates1_s /= denom_s
        gates2_s /= denom_s
        # Without dropping both routes of every token are kept.
        return l_aux, torch.stack([gates1_s, gates2_s], dim=1), exp_counts

    return torch.stack([indices1_s, indices2_s], dim=1), rest


def splits(gate) -> bool:
    """Whether :func:`route_split` splits ``gate`` (DeepSpeed's dropless top-2 and top-k gates, their
    ``wall_clock_breakdown`` timer off) and a gate with its own ``route_split`` (``ds_uniep.routers``),
    without running it."""
    if callable(getattr(gate, "route_split", None)):
        return True
    return not getattr(gate, "wall_clock_breakdown", False) and _dropless_kind(gate) is not None


def route_split(gate, x: Tensor, used_token: Optional[Tensor] = None
                ) -> Optional[Tuple[Tensor, Callable[[], Tuple[Tensor, Tensor, Tensor]]]]:
    """The dropless top-2 and top-k paths of :func:`route` in two steps, so that a dispatch can
    start between them: ``(expert_idx [T, k] int32, rest)`` with the routes first, then
    ``rest() -> (l_aux, gates [T, k] fp32, exp_counts [E])``, the same operations on the same
    tensors as :func:`route` (so the same bits), token-major. None for every other gate (call
    :func:`route`, which then calls the gate itself) and with the gate's ``wall_clock_breakdown``
    timer on. ``used_token`` is passed on as the gate takes it: DeepSpeed's top-2 and top-k gates
    do not read it."""
    if not splits(gate):  # (its timer would time the dispatch queued between the two steps)
        return None
    return _route_split(gate, x, used_token)


def _route_split(gate, x: Tensor, used_token: Optional[Tensor] = None):
    """:func:`route_split`'s two steps, the gate's timer (``wall_clock_breakdown``) around both; a gate
    with its own ``route_split`` (a ``ds_uniep.routers.Router``) gives them itself."""
    if callable(getattr(gate, "route_split", None)):
        return gate.route_split(x, used_token)
    kind = _dropless_kind(gate)
    if kind is None:  # (only DeepSpeed's top-1 gate reads used_token, and it is never split)
        return None
    from deepspeed.moe import sharded_moe as sm
    if gate.wall_clock_breakdown:
        gate.timers(sm.TOPK_GATE_TIMER).start()
    # TopKGate.forward up to the gating function
    input_fp32 = x.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        input_fp32 = sm.multiplicative_jitter(input_fp32, device=x.device)
    logits = F.linear(input_fp32, weight=gate.wg.weight.float(), bias=None)
    idx, rest = (_topk if kind == "topk" else _top2)(gate, logits)

    def finish():
        out = rest()
        if gate.wall_clock_breakdown:
            gate.timers(sm.TOPK_GATE_TIMER).stop()
            gate.gate_time = gate.timers(sm.TOPK_GATE_TIMER).elapsed(reset=False)
        return out

    return idx.to(torch.int32), finish


def route(gate, x: Tensor, used_token: Optional[Tensor] = None
          ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    """``(l_aux, capacity, route_idx [k, T] int32, route_gates [k, T] fp32, exp_counts [E])``
    of ``gate(x, used_token, sparse_routes=True)``; ``capacity`` is None on the dropless top-2
    and top-k paths (which skip it, see the module doc)."""
    split = _route_split(gate, x, used_token)
    if split is None:
        l_aux, capacity, _, route_idx, _, route_gates, exp_counts = gate(x, used_token, True)
        return l_aux, capacity, route_idx, route_gates, exp_counts
    idx, finish = split
    l_aux, gates, exp_counts = finish()
    return l_aux, None, idx.t().contiguous(), gates.t().contiguous(), exp_counts
