"""The ``deepep`` baseline of the benchmarks: DeepEP's intranode dispatch and combine (its V1 line,
``deep_ep.Buffer``) around torch's grouped GEMM experts, the way Megatron-Core's flex dispatcher runs
them: route, dispatch each token once per destination rank, permute the received tokens into expert
order, run the experts, weight and sum each token's rows on the expert rank, combine (a sum over
ranks). The backward is DeepEP's: the gradient of dispatch is a combine, that of combine a dispatch
with the cached handle.

DeepEP is not on PyPI and is no part of ds_uniep: build it from its public source and put it on
``PYTHONPATH`` (benchmarks/README.md); where it cannot be imported the benchmark row says why.
"""
import copy

import torch
from torch import Tensor, nn


def import_deep_ep():
    """``deep_ep``, or ImportError with what to do."""
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(f"DeepEP is not importable ({e}); build it from its source as benchmarks/README.md says "
                          "and put it on PYTHONPATH") from None
    return deep_ep


def make_buffer(deep_ep, group, hidden_bytes: int):
    """A ``deep_ep.Buffer`` over ``group`` with the NVLink bytes DeepEP's recommended dispatch and combine
    configurations ask for rows of ``hidden_bytes``."""
    G = torch.distributed.get_world_size(group)
    nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, G)
              for cfg in (deep_ep.Buffer.get_dispatch_config(G), deep_ep.Buffer.get_combine_config(G)))
    return deep_ep.Buffer(group, nvl, 0)


class _Dispatch(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, layer):
        buf = layer.buffer
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, layer.num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        ctx.layer, ctx.handle = layer, handle
        layer.handle = handle
        ctx.mark_non_differentiable(recv_idx)
        # counts: a host list (DeepEP reads the received counts on the host)
        return recv_x, recv_idx, recv_w, torch.tensor(counts, dtype=torch.int64, device=x.device)

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w, _grad_counts):
        w = None if grad_w is None else grad_w.float().contiguous()
        gx, gw, _ = ctx.layer.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=w)
        return gx, None, gw, None


class _Combine(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, layer):
        ctx.layer, ctx.handle = layer, layer.handle
        out, _, _ = layer.buffer.combine(y.contiguous(), layer.handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        gy = ctx.layer.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return gy, None


class DeepEPLayer(nn.Module):
    """``proto`` (a stock ``deepspeed.moe.layer.MoE`` with SwiGLU experts, dropless) on DeepEP: the same
    DeepSpeed gate (so the same routes, gates and auxiliary loss) and the same experts, on torch's grouped
    GEMM. Forward ``[..., M] -> (out, l_aux, exp_counts)`` as the stock layer. ``num_sms``: DeepEP's SM
    budget (None: its default)."""

    def __init__(self, proto, device, dtype, num_sms=None):
        super().__init__()
        self.deep_ep = import_deep_ep()
        # A proto whose groups are set (set_deepspeed_parallelism) keeps them: process groups do not copy.
        groups = {id(v): v for m in proto.modules() for v in vars(m).values()
                  if isinstance(v, torch.distributed.ProcessGroup)}
        moe = copy.deepcopy(proto, groups).to(device=device, dtype=dtype)
        moe.deepspeed_moe.gate.wg.float()
        if moe.deepspeed_moe.ep_group is None:
            moe.set_deepspeed_parallelism()
        self.moe = moe
        self.num_experts = moe.num_experts
        self.group = moe.deepspeed_moe.ep_group
        self.local_experts = len(moe.deepspeed_moe.experts.deepspeed_experts)
        self.num_sms = num_sms
        if num_sms is not None:  # the buffer holds a channel per two SMs of the budget set when it is made
            self.deep_ep.Buffer.set_num_sms(num_sms)
        self.buffer = make_buffer(self.deep_ep, self.group, moe.deepspeed_moe.gate.wg.weight.shape[1] * 2)
        self.handle = None

    def forward(self, hidden_states: Tensor):
        from ds_uniep.experts import run_experts
        from ds_uniep.gating import route
        if self.num_sms is not None:
            self.deep_ep.Buffer.set_num_sms(self.num_sms)
        M = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, M)
        moe = self.moe.deepspeed_moe
        l_aux, _, route_idx, route_gates, exp_counts = route(moe.gate, x)
        topk_idx = route_idx.t().to(torch.int64).contiguous()
        recv_x, recv_idx, recv_w, counts = _Dispatch.apply(x, topk_idx, route_gates.t().float().contiguous(), self)
        # Permute: every (received token, slot) on a local expert, in expert order (stable: token order inside).
        valid = recv_idx >= 0
        tokens = torch.arange(recv_x.shape[0], device=x.device).unsqueeze(1).expand_as(recv_idx)[valid]
        order = torch.argsort(recv_idx[valid], stable=True)
        tokens = tokens[order]
        probs = recv_w[valid][order]
        y = run_experts(moe.experts.deepspeed_experts, recv_x.index_select(0, tokens), counts, grouped=True)
        # Unpermute: each token's rows weighted and summed here, then summed over ranks by the combine.
        y_tok = torch.zeros_like(recv_x).index_add_(0, tokens, (y.float() * probs.unsqueeze(1)).to(y.dtype))
        out = _Combine.apply(y_tok, self)
        return out.reshape(hidden_states.shape), l_aux, exp_counts
