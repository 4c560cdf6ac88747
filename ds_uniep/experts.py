"""MLP experts that ds_uniep recognises, and the runner of a rank's local experts.

Any ``nn.Module`` works as an expert: it is called once per local expert on
that expert's rows. The two MLP experts here (SwiGLU as in Mixtral/DeepSeek,
GELU as in GPT/DeepSpeed-MoE examples) are also recognised, so all local
experts of a rank run as one grouped GEMM per projection (``torch._grouped_mm``, or
ds_uniep's own, :mod:`ds_uniep.gemm`) instead of a Python loop. Letters: R rows, M hidden, F expert FFN width, L
local experts.
"""

import warnings
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class SwiGLUExpert(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; ``w1``, ``w3``: ``[F, M]``, ``w2``: ``[M, F]`` (nn.Linear, no bias)."""

    def __init__(self, hidden_size: int, ffn_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeLUExpert(nn.Module):
    """``fc2(gelu(fc1 x))``; ``fc1``: ``[F, M]``, ``fc2``: ``[M, F]``, with biases."""

    def __init__(self, hidden_size: int, ffn_size: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _AddGroupBias(torch.autograd.Function):
    """``y [R, N] + bias[l]`` on the rows of group ``l``; the bias gradient sums each group's rows
    with one reduction per group (a fixed order), not a scatter-add over rows."""

    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor, counts: Tensor) -> Tensor:
        ctx.splits = counts.tolist()
        return y + torch.repeat_interleave(bias, counts, dim=0, output_size=y.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = grad.split(ctx.splits)
        return grad, torch.stack([p.sum(0) for p in parts]), None


def _grouped_linear(x: Tensor, w: Tensor, bias: Optional[Tensor], offs: Tensor, counts: Tensor,
                    gemm: str = "torch") -> Tensor:
    """Rows of group ``l`` of ``x [R, K]`` times ``w[l].T`` (``w [L, N, K]``, nn.Linear's layout), plus
    ``bias[l]`` (``[L, N]``); ``offs``: ``[L]`` int32 ends. ``gemm``: ``torch._grouped_mm`` or ds_uniep's
    grouped GEMM (see :data:`GEMMS`)."""
    if gemm == "uniep":
        from .gemm import grouped_linear
        y = grouped_linear(x, w, offs)
    else:  # viewed as [L, K, N]: the column-major B operand grouped_mm takes
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if bias is not None:
        y = _AddGroupBias.apply(y, bias, counts)
    return y


# The projections of each recognised expert, in the order the forward uses them.
_PROJECTIONS = {SwiGLUExpert: ("w1", "w3", "w2"), GeLUExpert: ("fc1", "fc2")}


class StackedExperts:
    """A rank's recognised experts as grouped-GEMM operands: per projection the weights stacked
    ``[L, N, K]`` and the biases ``[L, N]`` (or None). Built by :func:`stack_experts`; stacking is
    differentiable, so the experts' own parameters get their gradients."""

    def __init__(self, kind: type, weights: Dict[str, Tensor], biases: Dict[str, Optional[Tensor]]):
        self.kind, self.weights, self.biases = kind, weights, biases


def _expert_tensors(experts: Sequence[nn.Module], params: Optional[Sequence[Dict[str, Tensor]]], kind: type
                    ) -> Dict[str, List[Optional[Tensor]]]:
    """``{"w1.weight": [one per group], ...}``. The modules' own parameters are read from their
    parameter dicts directly: once per group and projection on every forward, where
    ``named_parameters()`` would cost tens of microseconds of host time per expert."""
    out: Dict[str, List[Optional[Tensor]]] = {}
    for proj in _PROJECTIONS[kind]:
        for what in ("weight", "bias"):
            name = f"{proj}.{what}"
            if params is not None:
                out[name] = [p.get(name) for p in params]
            else:
                out[name] = [e._modules[proj]._parameters.get(what) for e in experts]
    return out


def _grouped_operands(experts: Sequence[nn.Module], dtype: torch.dtype, device: torch.device,
                      params: Optional[Sequence[Dict[str, Tensor]]] = None):
    """``(kind, tensors)`` where the experts can run as grouped GEMMs on rows of ``dtype`` on
    ``device`` (all of one recognised kind, bf16 on ``device``, every dimension a multiple of 8:
    grouped_mm wants 16-byte aligned rows; biases on all groups or on none), else None."""
    if not hasattr(torch, "_grouped_mm") or not experts or dtype != torch.bfloat16:
        return None
    kind = type(experts[0])
    if kind not in _PROJECTIONS or any(type(e) is not kind for e in experts):
        return None
    tensors = _expert_tensors(experts, params, kind)
    for proj in _PROJECTIONS[kind]:
        ws, bs = tensors[f"{proj}.weight"], tensors[f"{proj}.bias"]
        if any(b is None for b in bs) and any(b is not None for b in bs):
            return None
        for t in ws + [b for b in bs if b is not None]:
            if t is None or t.dtype != torch.bfloat16 or t.device != device or any(d % 8 for d in t.shape):
                return None
    return kind, tensors


def stack_experts(experts: Sequence[nn.Module], dtype: torch.dtype, device: torch.device,
                  params: Optional[Sequence[Dict[str, Tensor]]] = None) -> Optional[StackedExperts]:
    """``experts`` (with their own parameters, or ``params``, one ``named_parameters``-style dict per
    group) stacked for grouped GEMMs on rows of ``dtype`` on ``device``, or None where they cannot
    run as grouped GEMMs (see :func:`_grouped_operands`)."""
    found = _grouped_operands(experts, dtype, device, params)
    if found is None:
        return None
    kind, tensors = found
    weights = {proj: torch.stack(tensors[f"{proj}.weight"]) for proj in _PROJECTIONS[kind]}
    biases = {proj: torch.stack(tensors[f"{proj}.bias"]) if tensors[f"{proj}.bias"][0] is not None else None
              for proj in _PROJECTIONS[kind]}
    return StackedExperts(kind, weights, biases)


def _grouped_ok(experts: Sequence[nn.Module], recv: Tensor, params: Optional[Sequence[Dict[str, Tensor]]] = None
                ) -> bool:
    """Whether ``experts`` (with their own parameters, or ``params``, one dict per group) run as grouped GEMMs."""
    return _grouped_operands(experts, recv.dtype, recv.device, params) is not None


GEMMS = ("torch", "uniep")
"""Grouped GEMMs the recognised experts run on: ``torch._grouped_mm`` or ds_uniep's own
(:mod:`ds_uniep.gemm`, Hopper GPUs)."""


def run_grouped(experts: Sequence[nn.Module], recv: Tensor, counts: Tensor, gemm: str = "torch",
                params: Optional[Sequence[Dict[str, Tensor]]] = None,
                stacked: Optional[StackedExperts] = None) -> Tensor:
    """All groups as grouped GEMMs. ``recv [R, M]`` bf16, ``counts [G]`` rows per group; group ``g``
    runs expert ``experts[g]`` with its own parameters, or, given ``params`` (``G`` dicts of
    ``named_parameters`` form, e.g. gathered replicas), the module of ``experts[0]``'s kind with
    ``params[g]``; ``stacked``: those already stacked by :func:`stack_experts`. ``gemm``: one of
    :data:`GEMMS` (the same GEMMs and elementwise ops on either)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    if stacked is None:
        stacked = stack_experts(experts, recv.dtype, recv.device, params)
        if stacked is None:
            raise ValueError("these experts cannot run as grouped GEMMs (see stack_experts)")
    groups = next(iter(stacked.weights.values())).shape[0]
    if groups != counts.numel():
        raise ValueError(f"{counts.numel()} row counts for {groups} expert groups")
    counts = counts.to(recv.device)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def linear(x, proj):
        return _grouped_linear(x, stacked.weights[proj], stacked.biases[proj], offs, counts, gemm)
    if stacked.kind is SwiGLUExpert:
        h = F.silu(linear(recv, "w1")) * linear(recv, "w3")
        return linear(h, "w2")
    return linear(F.gelu(linear(recv, "fc1")), "fc2")


def run_experts(experts: Sequence[nn.Module], recv: Tensor, local_expert_counts: Tensor,
                grouped: bool = True, gemm: str = "torch", stacked: Optional[StackedExperts] = None) -> Tensor:
    """Run local expert ``l`` over its rows of ``recv [R, M]``; returns ``[R, M]`` in the same order.

    Recognised bf16 MLP experts run as grouped GEMMs (when ``grouped``) on ``gemm`` (see
    :func:`run_grouped`; ``stacked``: their operands, stacked beforehand by :func:`stack_experts`).
    Otherwise every
    expert is called, also with zero rows, so its parameters always join the autograd
    graph (zero gradients rather than None, as with DeepSpeed's padded buffers). A
    ``(out, bias)`` tuple keeps ``out``, as DeepSpeed's Experts does.
    """
    if grouped:
        if stacked is None:
            stacked = stack_experts(experts, recv.dtype, recv.device)
        if stacked is not None:
            return run_grouped(experts, recv, local_expert_counts, gemm, stacked=stacked)
    outs: List[Tensor] = []
    for expert, rows in zip(experts, recv.split(local_expert_counts.tolist())):
        out = expert(rows)
        if isinstance(out, tuple):
            if len(out) > 1 and out[1] is not None:
                warnings.warn(f"{type(expert).__name__} returned (out, bias): the bias is not added, as in "
                              "DeepSpeed's MoE; add it inside the expert if it belongs to the output", UserWarning)
            out = out[0]
        outs.append(out)
    return torch.cat(outs) if outs else recv
