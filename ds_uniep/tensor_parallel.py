"""UniEPMoE beside a tensor-parallel model (``deepspeed.utils.groups.mpu`` with TP size t > 1).

DeepSpeed's semantics, in ds_uniep's layout:

1. Activations are replicated over the TP group. The gate runs on all T tokens on
   every TP rank (same l_aux, exp_counts and routing), then TP rank r dispatches
   only its slice of the tokens (``even_sizes``), so each (token, slot) row travels
   and is computed once.
2. Experts that are not tensor-parallel run on the rows as usual. With
   ``enable_expert_tensor_parallelism=True`` the expert is TP-sharded:
   - a :class:`TPGeLUExpert` runs through CommFuse: its first GEMM is an
     ``all_gather_matmul`` of the TP ranks' rows (expert by expert, TP-rank order),
     its second a ``matmul_reduce_scatter`` that hands each TP rank the sum over
     TP ranks of its own rows, added in rank order;
   - any other sharded expert does its own TP communication (as Megatron's
     ParallelMLP does): each TP rank gathers the rows of all TP ranks, runs the
     expert on them and keeps its own rows.
3. After the combine, the TP ranks all-gather their token slices back into the
   replicated output.

Gradients mirror it: the slice's backward all-gathers the gradient, the gather's
backward keeps the own slice (the replicated activation's gradient is the same
on every TP rank), exactly as DeepSpeed's ``drop_tokens`` / ``gather_tokens``.
"""

from typing import List, Sequence, Tuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from torch import nn
from torch.nn import functional as F

from .experts import run_experts


def even_sizes(total: int, parts: int) -> List[int]:
    """``total`` split into ``parts`` contiguous pieces, the first ``total % parts`` one larger."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _all_gather_rows(x: Tensor, sizes: Sequence[int], group) -> List[Tensor]:
    """Every rank's ``[sizes[i], ...]`` piece (padded to the largest for the collective)."""
    pad = max(sizes)
    buf = x.new_zeros((pad, ) + tuple(x.shape[1:]))
    buf[:x.shape[0]] = x
    parts = [torch.empty_like(buf) for _ in sizes]
    torch_dist.all_gather(parts, buf.contiguous(), group=group)
    return [p[:n] for p, n in zip(parts, sizes)]


class _Slice(torch.autograd.Function):
    """Forward: this TP rank's rows. Backward: the gradients of every rank's rows, gathered."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], rank: int, group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        off = sum(sizes[:rank])
        return x[off:off + sizes[rank]]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return torch.cat(_all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group)), None, None, None


class _Gather(torch.autograd.Function):
    """Forward: every TP rank's rows, in rank order. Backward: this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], rank: int, group) -> Tensor:
        ctx.off, ctx.n = sum(sizes[:rank]), sizes[rank]
        return torch.cat(_all_gather_rows(x.contiguous(), sizes, group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.off:ctx.off + ctx.n], None, None, None


def tp_slice(x: Tensor, sizes: List[int], rank: int, group) -> Tensor:
    return _Slice.apply(x, sizes, rank, group)


def tp_gather(x: Tensor, sizes: List[int], rank: int, group) -> Tensor:
    return _Gather.apply(x, sizes, rank, group)


def run_tp_sharded_experts(experts, recv: Tensor, counts: Tensor, group, rank: int, size: int,
                           schedule: str = "ring", transport: str = "auto", num_chunks: int = 1) -> Tensor:
    """Run TP-sharded experts on the rows of all TP ranks; returns this rank's rows' outputs.

    ``recv [R_r, M]``, ``counts [L]``: this TP rank's rows, expert-major. ``schedule``, ``transport``
    and ``num_chunks``: CommFuse's, for :class:`TPGeLUExpert` s.
    """
    if experts and all(isinstance(e, TPGeLUExpert) for e in experts):
        return run_tp_commfuse_experts(experts, recv, counts, group, rank, size, schedule, transport, num_chunks)
    L = counts.numel()
    all_counts = torch.stack(_all_gather_rows(counts.view(1, L), [1] * size, group)).view(size, L)
    per_rank = all_counts.sum(1).tolist()
    full = tp_gather(recv, per_rank, rank, group)  # [sum R_r, M]: rank-major, expert-major inside
    # Reorder to expert-major, TP-rank order inside an expert: a fixed permutation.
    starts = torch.cumsum(all_counts.view(-1), 0) - all_counts.view(-1)
    order = torch.cat([torch.arange(int(starts[r * L + l]), int(starts[r * L + l] + all_counts[r, l]))
                       for l in range(L) for r in range(size)]).to(recv.device) if full.shape[0] else \
        torch.empty(0, dtype=torch.long, device=recv.device)
    y = run_experts(experts, full.index_select(0, order), all_counts.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return tp_slice(y.index_select(0, back), per_rank, rank, group)


class TPGeLUExpert(nn.Module):
    """This TP rank's shard of ``fc2(gelu(fc1 x))``: ``fc1`` column-parallel (``[F/t, M]`` and
    its bias shard), ``fc2`` row-parallel (``[M, F/t]``, full bias added once).

    Called alone (on replicated rows, TP group of ``deepspeed.utils.groups.mpu``) each TP rank takes
    its slice of the rows, runs :meth:`sharded` (CommFuse's ``ring`` schedule) and the slices'
    outputs are all-gathered: the full MLP's output on every rank. Inside
    ``UniEPMoE(enable_expert_tensor_parallelism=True)`` :meth:`sharded` runs on each TP rank's
    dispatched rows, with the ``uniep.commfuse`` block's schedule, transport and chunks."""

    def __init__(self, hidden_size: int, ffn_size: int, tp_size: int, bias: bool = True):
        super().__init__()
        if ffn_size % tp_size:
            raise ValueError(f"TPGeLUExpert: ffn_size {ffn_size} is not divisible by the TP size {tp_size}")
        self.fc1 = nn.Linear(hidden_size, ffn_size // tp_size, bias=bias)
        self.fc2 = nn.Linear(ffn_size // tp_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        group, size, rank = tp_context()
        # Replicated rows: each TP rank owns a slice; gathering the slices back makes the
        # same two CommFuse steps the MoE path runs, so both give the same numbers.
        sizes = even_sizes(x.shape[0], size)
        mine = tp_slice(x, sizes, rank, group)
        y = self.sharded(mine, sizes, group)
        return tp_gather(y, sizes, rank, group)

    def sharded(self, x_shard: Tensor, sizes: List[int], group, schedule: str = "ring",
                transport: str = "auto", num_chunks: int = 1) -> Tensor:
        """Rows ``x_shard [sizes[rank], M]`` of this TP rank -> their outputs ``[sizes[rank], M]``."""
        from ds_uniep.commfuse import all_gather_matmul, matmul_reduce_scatter
        from ds_uniep.commfuse.linear import all_reduce_grad
        h = all_gather_matmul(x_shard, self.fc1.weight.t(), group, schedule=schedule, shard_sizes=sizes,
                              transport=transport, num_chunks=num_chunks)
        if self.fc1.bias is not None:
            h = h + self.fc1.bias
        y = matmul_reduce_scatter(F.gelu(h), self.fc2.weight.t(), group, schedule=schedule, out_sizes=sizes,
                                  transport=transport, num_chunks=num_chunks)
        if self.fc2.bias is None:
            return y
        # The whole bias on this rank's rows only: its gradient is summed over the TP ranks, so every
        # rank's copy gets the gradient of all rows (as RowParallelLinear's bias does).
        return y + all_reduce_grad(self.fc2.bias, group)


def run_tp_commfuse_experts(experts, recv: Tensor, counts: Tensor, group, rank: int, size: int,
                            schedule: str = "ring", transport: str = "auto", num_chunks: int = 1) -> Tensor:
    """:class:`TPGeLUExpert` s over this TP rank's rows ``recv [R_r, M]`` (``counts [L]``), expert by expert."""
    L = counts.numel()
    all_counts = torch.stack(_all_gather_rows(counts.view(1, L), [1] * size, group)).view(size, L)
    outs = []
    for l, rows in enumerate(recv.split(counts.tolist())):
        outs.append(experts[l].sharded(rows, all_counts[:, l].tolist(), group, schedule, transport, num_chunks))
    return torch.cat(outs) if outs else recv


def tp_context() -> Tuple[object, int, int]:
    """(group, size, rank) of the tensor-parallel group of ``deepspeed.utils.groups.mpu``."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import (bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_rank,
                                     bwc_tensor_model_parallel_world_size)
    mpu = groups.mpu
    return (bwc_tensor_model_parallel_group(mpu), bwc_tensor_model_parallel_world_size(mpu),
            bwc_tensor_model_parallel_rank(mpu))
