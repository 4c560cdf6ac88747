"""Ulysses sequence parallelism on CommFuse: the all-to-alls fused with the projections next to them.

:class:`UlyssesAttention` stands in for DeepSpeed-Ulysses'
``deepspeed.sequence.layer.DistributedAttention`` *together with* the QKV and output projections
around it. ``DistributedAttention`` takes projected q, k, v ``[b, S/G, heads, d]`` (or seq-first
``[S/G, b, heads, d]``), exchanges sequence for heads by one all-to-all, runs the local attention
on ``[b, S, heads/G, d]`` and exchanges back. Here:

* QKV projection + sequence-to-head all-to-all: the columns of rank j's heads (its q heads, then
  its k and v heads) are computed as one GEMM, ``F.linear(x, W_j, b_j)``, and sent to j while the
  next rank's are computed; this rank's own heads last, so the last transfer hides behind them.
* head-to-sequence all-to-all + output projection: the attention output travels in
  ``num_chunks`` row chunks of every rank's sequence block, and each row chunk is multiplied by
  the whole output projection, ``F.linear(ctx[rows], W_o, b_o)``, as soon as it is in from every
  rank, while the next chunk travels.
* Backward: the output projection's input gradient is computed per rank's heads and sent while
  the next is computed (its weight gradient beside the last transfers); the QKV gradient blocks
  travel back, each block's weight gradient is computed as it lands, and the input gradient is
  one GEMM over all heads once every block is in.

Exactness. Every GEMM covers whole rows or whole columns of the GEMM an unfused layer runs, never
a part of its contracted dimension, so no sum is reordered:

* QKV (forward) and the output projection's input gradient (backward) are *column blocks* of the
  unfused GEMM (the same rows and K, fewer output columns); the QKV weight gradient is a *row
  block* of the unfused ``dY^T X``.
* The output projection runs per *row chunk* of the unfused GEMM (all K, fewer rows);
  ``num_chunks=1`` is the unfused call itself.
* The QKV input gradient, the output projection's weight gradient and both bias gradients are
  the unfused calls on the whole operands.

So the result is bitwise equal to ``DistributedAttention`` with the same projections
(``F.linear`` with the same weights) and attention function wherever the GEMM computes each
output element the same way whatever the number of rows or columns of the call: torch's CPU
GEMMs do at small sizes (fp32 and bf16) but not at every size (a bf16 GEMM of 512 rows and K 512
gives other last bits for a block of its rows), and cuBLAS does where it runs the same kernel (and
split) for the block as for the whole. Elsewhere the result is within that GEMM's rounding. The alternative the method also allows, multiplying each rank's head block by
its columns of ``W_o`` as it lands and adding the partials, splits the contracted dimension: it
agrees with the unfused projection only within fp32 reassociation (on CPU fp32 most elements
differ in the last bits), so it is not used.

Layout: ``batch_dim_idx`` 0 (``[b, S/G, H]``, DistributedAttention's ``scatter_idx=2,
gather_idx=1``) or 1 (``[S/G, b, H]``, ``scatter_idx=2, gather_idx=0``); every rank holds the same
S/G. Heads: ``num_heads`` q heads and ``num_kv_heads`` k/v heads (GQA), both divisible by G; rank
j gets heads ``j * heads/G`` onwards, as DistributedAttention splits them.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .common import _aligned
from .exchange import compute_and_scatter, exchange_blocks, exchange_row_chunks, peer_schedule


class _Plan:
    """Sizes and settings of one layer on one group (fixed at construction)."""

    def __init__(self, group, G, me, heads, kv_heads, head_dim, schedule, num_chunks, transport):
        self.group, self.G, self.me = group, G, me
        self.hq, self.hk, self.d = heads // G, kv_heads // G, head_dim
        self.heads, self.kv_heads = heads, kv_heads
        self.schedule, self.num_chunks, self.transport = schedule, num_chunks, transport
        self.n = (self.hq + 2 * self.hk) * head_dim  # QKV columns per rank
        qd, kd = heads * head_dim, kv_heads * head_dim
        # Rows of the [q; k; v] weight rank j's block takes: (start, length) of q, k and v.
        self.rows = [[(j * self.hq * head_dim, self.hq * head_dim), (qd + j * self.hk * head_dim, self.hk * head_dim),
                      (qd + kd + j * self.hk * head_dim, self.hk * head_dim)] for j in range(G)]

    def weight_block(self, w: torch.Tensor, j: int) -> torch.Tensor:
        return torch.cat([w[r0:r0 + n] for r0, n in self.rows[j]])

    def bias_block(self, b: Optional[torch.Tensor], j: int) -> Optional[torch.Tensor]:
        return None if b is None else torch.cat([b[r0:r0 + n] for r0, n in self.rows[j]])

    def to_heads(self, blocks, bdim: int, b: int, s: int):
        """Rank-ordered sequence blocks ``[G, b*s or s*b, C]`` -> ``[b, G*s, C]`` / ``[G*s, b, C]``."""
        st = blocks if torch.is_tensor(blocks) else torch.stack(blocks)
        C = st.shape[-1]
        if bdim == 0:
            return st.view(self.G, b, s, C).transpose(0, 1).reshape(b, self.G * s, C)
        return st.view(self.G * s, b, C)

    def to_blocks(self, t: torch.Tensor, bdim: int, b: int, s: int) -> torch.Tensor:
        """``[b, G*s, C]`` / ``[G*s, b, C]`` -> contiguous ``[G, rows, C]``: rank j's sequence block j."""
        C = t.shape[-1]
        if bdim == 0:
            return t.reshape(b, self.G, s, C).transpose(0, 1).contiguous().view(self.G, b * s, C)
        return t.contiguous().view(self.G, s * b, C)


class _QKV(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w, bias, plan, bdim, b, s):
        T = x.shape[0]
        blocks = compute_and_scatter(lambda j: F.linear(x, plan.weight_block(w, j), plan.bias_block(bias, j)),
                                     [T] * plan.G, plan.n, x.dtype, x.device, plan.group, plan.schedule,
                                     plan.num_chunks, plan.transport)
        qkv = plan.to_heads(blocks, bdim, b, s)
        hd, kd = plan.hq * plan.d, plan.hk * plan.d
        shape = qkv.shape[:2]
        q = qkv[..., :hd].reshape(*shape, plan.hq, plan.d)
        k = qkv[..., hd:hd + kd].reshape(*shape, plan.hk, plan.d)
        v = qkv[..., hd + kd:].reshape(*shape, plan.hk, plan.d)
        ctx.save_for_backward(x, w)
        ctx.args = (plan, bdim, b, s, bias is not None)
        return q.contiguous(), k.contiguous(), v.contiguous()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, w = ctx.saved_tensors
        plan, bdim, b, s, has_bias = ctx.args
        shape = dq.shape[:2]
        dqkv = torch.cat([dq.reshape(*shape, -1), dk.reshape(*shape, -1), dv.reshape(*shape, -1)], dim=-1)
        blocks = plan.to_blocks(dqkv, bdim, b, s)  # block r: the gradient of rank r's rows, this rank's heads
        T = x.shape[0]
        dy = torch.empty(T, w.shape[0], dtype=dq.dtype, device=dq.device)  # d(x W^T) in the weight's row order
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for j, g in exchange_blocks(blocks, [T] * plan.G, plan.n, plan.group, plan.schedule, plan.num_chunks,
                                    plan.transport):
            g = g.contiguous()
            if dw is not None:
                gw = g.t() @ x  # a row block of the unfused dY^T X
            c = 0
            for r0, n in plan.rows[j]:
                dy[:, r0:r0 + n] = g[:, c:c + n]
                if dw is not None:
                    dw[r0:r0 + n] = gw[c:c + n]
                c += n
        dx = dy @ w if ctx.needs_input_grad[0] else None
        db = dy.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


class _Out(torch.autograd.Function):

    @staticmethod
    def forward(ctx, attn, w, bias, plan, bdim, b, s):
        c = plan.hq * plan.d
        blocks = plan.to_blocks(attn.reshape(*attn.shape[:2], c), bdim, b, s)
        T = blocks.shape[1]
        rows = torch.empty(T, plan.G * c, dtype=attn.dtype, device=attn.device)  # this rank's rows, all heads
        out = torch.empty(T, w.shape[0], dtype=attn.dtype, device=attn.device)
        for r0, n, parts in exchange_row_chunks(list(blocks), T, c, plan.group, plan.num_chunks, plan.transport):
            for src, p in enumerate(parts):
                rows[r0:r0 + n, src * c:(src + 1) * c] = p
            out[r0:r0 + n] = F.linear(_aligned(rows[r0:r0 + n]), w, bias)
        ctx.save_for_backward(rows, w)
        ctx.args = (plan, bdim, b, s, bias is not None)
        return out

    @staticmethod
    def backward(ctx, dout):
        rows, w = ctx.saved_tensors
        plan, bdim, b, s, has_bias = ctx.args
        dout = dout.contiguous()
        c = plan.hq * plan.d
        T = dout.shape[0]
        dw = []

        def beside():
            if ctx.needs_input_grad[1]:
                dw.append(dout.t() @ rows)

        blocks = compute_and_scatter(lambda j: dout @ w[:, j * c:(j + 1) * c].contiguous(), [T] * plan.G, c,
                                     dout.dtype, dout.device, plan.group, plan.schedule, plan.num_chunks,
                                     plan.transport, beside=beside)
        dattn = plan.to_heads(blocks, bdim, b, s)
        dattn = dattn.reshape(*dattn.shape[:2], plan.hq, plan.d)
        db = dout.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        return dattn, (dw[0] if dw else None), db, None, None, None, None


class UlyssesAttention(nn.Module):
    """DeepSpeed-Ulysses attention with its projections, the all-to-alls fused with them (module doc).

    Args:
        local_attention: ``f(q, k, v, *args, **kwargs) -> context``, as ``DistributedAttention`` calls
            it: q ``[b, S, heads/G, d]`` (seq-first: ``[S, b, heads/G, d]``), k and v with
            ``kv_heads/G`` heads; the context has q's shape.
        sequence_process_group: the Ulysses group (G ranks; default world).
        hidden_size: H, the width of the input and of the output.
        num_heads: q heads (all ranks together), divisible by G; head dim ``H / num_heads``.
        num_kv_heads: k/v heads (default ``num_heads``), divisible by G.
        bias: biases on both projections.
        config: ``UniEPConfig.commfuse`` (schedule ring / bidirectional_ring / local_first,
            num_chunks, transport), or None for ring / 1 / auto.
        dtype, device: of the parameters.

    Parameters (replicated over the group): ``qkv_weight`` ``[(heads + 2 kv_heads) d, H]`` (q rows,
    then k, then v, as one ``nn.Linear``), ``qkv_bias``, ``out_weight`` ``[H, heads d]``,
    ``out_bias``. ``forward(hidden_states, batch_dim_idx, *args, **kwargs)``: ``[b, S/G, H]``
    (``batch_dim_idx=0``) or ``[S/G, b, H]`` (1) -> the same shape; ``args``/``kwargs`` go to
    ``local_attention``.
    """

    def __init__(self, local_attention, sequence_process_group=None, hidden_size: int = 0, num_heads: int = 1,
                 num_kv_heads: Optional[int] = None, bias: bool = True, config=None,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        from .linear import _commfuse_args, _group_size_rank
        G, me = _group_size_rank(sequence_process_group)
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size <= 0 or hidden_size % num_heads:
            raise ValueError(f"UlyssesAttention: hidden_size {hidden_size} must be a positive multiple of "
                             f"num_heads {num_heads}")
        if num_heads % G or kv % G:
            raise ValueError(f"UlyssesAttention: num_heads ({num_heads}) and num_kv_heads ({kv}) must be divisible "
                             f"by the sequence-parallel size {G}")
        schedule, num_chunks, transport = _commfuse_args(config)
        peer_schedule(schedule, num_chunks, "UlyssesAttention")
        d = hidden_size // num_heads
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.hidden_size = hidden_size
        self.plan = _Plan(sequence_process_group, G, me, num_heads, kv, d, schedule, num_chunks, transport)
        self.qkv_weight = nn.Parameter(torch.empty((num_heads + 2 * kv) * d, hidden_size, dtype=dtype, device=device))
        self.out_weight = nn.Parameter(torch.empty(hidden_size, num_heads * d, dtype=dtype, device=device))
        self.qkv_bias = nn.Parameter(torch.zeros((num_heads + 2 * kv) * d, dtype=dtype, device=device)) if bias \
            else None
        self.out_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():
            for w in (self.qkv_weight, self.out_weight):
                bound = 1.0 / math.sqrt(w.shape[1])
                w.uniform_(-bound, bound)

    @classmethod
    def from_linears(cls, local_attention, sequence_process_group, qkv: nn.Linear, out: nn.Linear, num_heads: int,
                     num_kv_heads: Optional[int] = None, config=None) -> "UlyssesAttention":
        """The layer with the weights of an unfused model's ``qkv`` (rows q, k, v) and ``out`` linears."""
        mod = cls(local_attention, sequence_process_group, out.out_features, num_heads, num_kv_heads,
                  qkv.bias is not None, config, qkv.weight.dtype, qkv.weight.device)
        if mod.qkv_weight.shape != qkv.weight.shape or mod.out_weight.shape != out.weight.shape:
            raise ValueError(f"UlyssesAttention.from_linears: qkv {tuple(qkv.weight.shape)} / out "
                             f"{tuple(out.weight.shape)} do not match {tuple(mod.qkv_weight.shape)} / "
                             f"{tuple(mod.out_weight.shape)}")
        if (out.bias is not None) != (qkv.bias is not None):
            raise ValueError("UlyssesAttention.from_linears: both linears have a bias or neither has")
        with torch.no_grad():
            mod.qkv_weight.copy_(qkv.weight)
            mod.out_weight.copy_(out.weight)
            if mod.qkv_bias is not None:
                mod.qkv_bias.copy_(qkv.bias)
                mod.out_bias.copy_(out.bias)
        return mod

    def forward(self, hidden_states: torch.Tensor, batch_dim_idx: int, *args, **kwargs) -> torch.Tensor:
        x = hidden_states
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"UlyssesAttention: batch_dim_idx must be 0 or 1, got {batch_dim_idx}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"UlyssesAttention: hidden_states must be [b, S/G, {self.hidden_size}] or "
                             f"[S/G, b, {self.hidden_size}], got {tuple(x.shape)}")
        if x.dtype != self.qkv_weight.dtype:
            raise TypeError(f"UlyssesAttention: hidden_states is {x.dtype} but the weights are "
                            f"{self.qkv_weight.dtype}")
        b, s = x.shape[batch_dim_idx], x.shape[1 - batch_dim_idx]
        p = self.plan
        q, k, v = _QKV.apply(x.reshape(-1, self.hidden_size).contiguous(), self.qkv_weight, self.qkv_bias, p,
                             batch_dim_idx, b, s)
        context = self.local_attn(q, k, v, *args, **kwargs)
        out = _Out.apply(context.contiguous(), self.out_weight, self.out_bias, p, batch_dim_idx, b, s)
        return out.view(*x.shape[:2], self.hidden_size)

    def extra_repr(self) -> str:
        p = self.plan
        return (f"hidden_size={self.hidden_size}, num_heads={p.heads}, num_kv_heads={p.kv_heads}, sp={p.G}, "
                f"schedule={p.schedule}, num_chunks={p.num_chunks}, transport={p.transport}")
