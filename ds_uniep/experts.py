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


def _grouped_linear(x: Tensor, weights: Sequence[Tensor], biases: Optional[Sequence[Tensor]], offs: Tensor,
                    counts: Tensor, gemm: str = "torch") -> Tensor:
    """Rows of group ``l`` of ``x [R, K]`` times ``weights[l].T`` (``[N, K]``, nn.Linear's layout), plus
    ``biases[l]``; ``offs``: ``[L]`` int32 ends. ``gemm``: ``torch._grouped_mm`` or ds_uniep's grouped
    GEMM (see :data:`GEMMS`)."""
    w = torch.stack(list(weights))  # [L, N, K]
    if gemm == "uniep":
        from .gemm import grouped_linear
        y = grouped_linear(x, w, offs)
    else:  # viewed as [L, K, N]: the column-major B operand grouped_mm takes
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if biases is not None:
        y = _AddGroupBias.apply(y, torch.stack(list(biases)), counts)  # bias [L, N]
    return y


def _grouped_ok(experts: Sequence[nn.Module], recv: Tensor, params: Optional[Sequence[Dict[str, Tensor]]] = None
                ) -> bool:
    """Whether ``experts`` (with their own parameters, or ``params``, one dict per group) run as grouped GEMMs."""
    if not hasattr(torch, "_grouped_mm") or not experts or recv.dtype != torch.bfloat16:
        return False
    kind = type(experts[0])
    if kind not in (SwiGLUExpert, GeLUExpert) or any(type(e) is not kind for e in experts):
        return False
    tensors = [t for p in params for t in p.values()] if params is not None else \
        [t for e in experts for t in e.parameters()]
    # grouped_mm wants 16-byte aligned rows: dims multiple of 8 in bf16.
    return all(t.dtype == torch.bfloat16 and t.device == recv.device for t in tensors) and \
        all(d % 8 == 0 for t in tensors for d in t.shape)


GEMMS = ("torch", "uniep")
"""Grouped GEMMs the recognised experts run on: ``torch._grouped_mm`` or ds_uniep's own
(:mod:`ds_uniep.gemm`, Hopper GPUs)."""


def run_grouped(experts: Sequence[nn.Module], recv: Tensor, counts: Tensor, gemm: str = "torch",
                params: Optional[Sequence[Dict[str, Tensor]]] = None) -> Tensor:
    """All groups as grouped GEMMs. ``recv [R, M]`` bf16, ``counts [G]`` rows per group; group ``g``
    runs expert ``experts[g]`` with its own parameters, or, given ``params`` (``G`` dicts of
    ``named_parameters`` form, e.g. gathered replicas), the module of ``experts[0]``'s kind with
    ``params[g]``. ``gemm``: one of :data:`GEMMS` (the same GEMMs and elementwise ops on either)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    params = [dict(e.named_parameters()) for e in experts] if params is None else params
    if len(params) != counts.numel():
        raise ValueError(f"{counts.numel()} row counts for {len(params)} expert groups")
    counts = counts.to(recv.device)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def linear(x, name):
        bias = [p[f"{name}.bias"] for p in params] if f"{name}.bias" in params[0] else None
        return _grouped_linear(x, [p[f"{name}.weight"] for p in params], bias, offs, counts, gemm)
    if isinstance(experts[0], SwiGLUExpert):
        h = F.silu(linear(recv, "w1")) * linear(recv, "w3")
        return linear(h, "w2")
    return linear(F.gelu(linear(recv, "fc1")), "fc2")


def run_experts(experts: Sequence[nn.Module], recv: Tensor, local_expert_counts: Tensor,
                grouped: bool = True, gemm: str = "torch") -> Tensor:
    """Run local expert ``l`` over its rows of ``recv [R, M]``; returns ``[R, M]`` in the same order.

    Recognised bf16 MLP experts run as grouped GEMMs (when ``grouped``) on ``gemm`` (see
    :func:`run_grouped`). Otherwise every
    expert is called, also with zero rows, so its parameters always join the autograd
    graph (zero gradients rather than None, as with DeepSpeed's padded buffers). A
    ``(out, bias)`` tuple keeps ``out``, as DeepSpeed's Experts does.
    """
    if grouped and _grouped_ok(experts, recv):
        return run_grouped(experts, recv, local_expert_counts, gemm)
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
