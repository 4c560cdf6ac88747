"""Tensor-parallel linears with sequence parallelism on CommFuse.

Letters: G ranks in the tensor-parallel group, S sequence positions in total,
S_r of them on rank r, B anything between the sequence and the feature
dimension (batch), H_in / H_out features.

Sequence-parallel layout (Megatron-style): activations between layers are
sharded along the first (sequence) dimension, ``[S_r, *B, H]``.

* :class:`ColumnParallelLinear` takes ``[S_r, *B, H_in]``, gathers the sequence
  and multiplies by its column shard in one :func:`all_gather_matmul`:
  ``[S, *B, H_out / G]``.
* :class:`RowParallelLinear` takes that ``[S, *B, H_in / G]``, multiplies by its
  row shard and reduce-scatters the sum back to sequence shards in one
  :func:`matmul_reduce_scatter`: ``[S_r, *B, H_out]``; its bias (replicated)
  is added once, after the reduce-scatter, and its gradient is summed over the
  group so every rank holds the full-sequence bias gradient.

Both keep ``weight`` in ``nn.Linear`` layout (``[out, in]`` of the shard), as
ordinary ``nn.Parameter`` s. ``config`` is ``UniEPConfig.commfuse`` (schedule,
num_chunks, transport).
"""
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .common import check_schedule, check_transport, even_split
from .ops import all_gather_matmul, matmul_reduce_scatter


def _commfuse_args(config):
    """``(schedule, num_chunks, transport)`` of a CommFuseConfig (defaults for None)."""
    if config is None:
        return "ring", 1, "auto"
    sub = getattr(config, "commfuse", config)  # a whole UniEPConfig works too
    try:
        schedule, num_chunks = sub.schedule, sub.num_chunks
    except AttributeError:
        raise TypeError(f"config must be a CommFuseConfig (UniEPConfig.commfuse), got {type(config).__name__}") \
            from None
    transport = getattr(sub, "transport", "auto")
    check_schedule(schedule, num_chunks)
    check_transport(transport)
    return schedule, num_chunks, transport


def _group_size_rank(group):
    if not dist.is_initialized():
        raise RuntimeError("tensor-parallel linears need torch.distributed to be initialised first")
    return dist.get_world_size(group), dist.get_rank(group)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (a replicated parameter used on a shard)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def all_reduce_grad(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` as it is, with its gradient summed over ``group`` in the backward."""
    return _AllReduceGrad.apply(t, group)


class _ParallelLinear(nn.Module):

    def _setup(self, in_features: int, out_features: int, split: str, bias: bool, group, config, dtype,
               device) -> None:
        """The parameters of this rank's shard: ``split`` ("out" or "in") names the dimension the group
        divides; the bias is sharded with the output features, replicated otherwise. ``nn.Linear``'s
        initialisation for the weight (bound ``1/sqrt(H_in)``), zeros for the bias."""
        self.tp_size, self.tp_rank = _group_size_rank(group)
        features = out_features if split == "out" else in_features
        if features % self.tp_size:
            raise ValueError(f"{type(self).__name__}: {split}_features={features} is not divisible by the group "
                             f"size {self.tp_size}")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.schedule, self.num_chunks, self.transport = _commfuse_args(config)
        rows = out_features // self.tp_size if split == "out" else out_features
        cols = in_features if split == "out" else in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device)) if bias else None
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def _check_input(self, x: torch.Tensor, name: str, features: int, what: str) -> None:
        cls = type(self).__name__
        if x.dim() < 2 or x.shape[-1] != features:
            raise ValueError(f"{cls}: input {name} has shape {tuple(x.shape)}; expected [S_r, *B, {features}] "
                             f"({what})")
        if x.dtype != self.weight.dtype:
            raise TypeError(f"{cls}: input {name} is {x.dtype} but weight is {self.weight.dtype}")
        if x.device != self.weight.device:
            raise ValueError(f"{cls}: input {name} is on {x.device} but weight is on {self.weight.device}")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={self.tp_size}, schedule={self.schedule}, num_chunks={self.num_chunks}, "
                f"transport={self.transport}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W split by output rows over the group; sequence-parallel input.

    Args:
        in_features: H_in.
        out_features: H_out (all ranks together); must be divisible by G.
        bias: a ``[H_out / G]`` bias shard.
        group: tensor-parallel process group (default world).
        config: ``UniEPConfig.commfuse`` (schedule, num_chunks), or None for ring / 1.
        dtype, device: of the parameters.

    ``weight``: ``[H_out / G, H_in]``; ``forward(x [S_r, *B, H_in]) -> [S, *B, H_out / G]``.
    Initialisation follows ``nn.Linear`` for the weight (bound ``1/sqrt(H_in)``)
    and zeros the bias; use :meth:`from_linear` to shard given weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, config=None,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        self._setup(in_features, out_features, "out", bias, group, config, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, config=None) -> "ColumnParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (rows ``rank * H_out/G`` onwards of its weight)."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group, config,
                  dtype=linear.weight.dtype, device=linear.weight.device)
        n = mod.weight.shape[0]
        with torch.no_grad():
            mod.weight.copy_(linear.weight[mod.tp_rank * n:(mod.tp_rank + 1) * n])
            if mod.bias is not None:
                mod.bias.copy_(linear.bias[mod.tp_rank * n:(mod.tp_rank + 1) * n])
        return mod

    def forward(self, x: torch.Tensor, shard_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """x ``[S_r, *B, H_in]`` -> ``[S, *B, H_out / G]``. ``shard_sizes``: every rank's S_r, if known
        (saves a small all-gather)."""
        self._check_input(x, "x", self.in_features, "in_features")
        inner = x.shape[1:-1]
        width = math.prod(inner)
        rows = None if shard_sizes is None else [s * width for s in shard_sizes]
        y = all_gather_matmul(x.reshape(-1, self.in_features), self.weight.t(), self.group, self.schedule,
                              self.num_chunks, rows, self.transport)
        if self.bias is not None:
            y = y + self.bias
        return y.view(-1, *inner, y.shape[-1])


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W split by input columns over the group; sequence-parallel output.

    Args:
        in_features: H_in (all ranks together); must be divisible by G.
        out_features: H_out.
        bias: a replicated ``[H_out]`` bias, added once after the reduce-scatter;
            its gradient is summed over the group.
        group, config, dtype, device: as in :class:`ColumnParallelLinear`.

    ``weight``: ``[H_out, H_in / G]``; ``forward(x [S, *B, H_in / G]) -> [S_r, *B, H_out]``
    with S split by ``seq_sizes`` (default: ``S // G`` each, one more on the first ``S % G`` ranks).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, config=None,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        self._setup(in_features, out_features, "in", bias, group, config, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, config=None) -> "RowParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (columns ``rank * H_in/G`` onwards; the whole bias)."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group, config,
                  dtype=linear.weight.dtype, device=linear.weight.device)
        k = mod.weight.shape[1]
        with torch.no_grad():
            mod.weight.copy_(linear.weight[:, mod.tp_rank * k:(mod.tp_rank + 1) * k])
            if mod.bias is not None:
                mod.bias.copy_(linear.bias)
        return mod

    def forward(self, x: torch.Tensor, seq_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """x ``[S, *B, H_in / G]`` -> ``[S_r, *B, H_out]``."""
        self._check_input(x, "x", self.in_features // self.tp_size, "in_features / group size")
        inner = x.shape[1:-1]
        width = math.prod(inner)
        seq = even_split(x.shape[0], self.tp_size) if seq_sizes is None else list(seq_sizes)
        if len(seq) != self.tp_size or sum(seq) != x.shape[0]:
            raise ValueError(f"RowParallelLinear: seq_sizes {seq} must have {self.tp_size} entries summing to "
                             f"x.shape[0] = {x.shape[0]}")
        y = matmul_reduce_scatter(x.reshape(-1, x.shape[-1]), self.weight.t(), self.group, self.schedule,
                                  self.num_chunks, [s * width for s in seq], self.transport)
        if self.bias is not None:
            y = y + all_reduce_grad(self.bias, self.group)
        return y.view(-1, *inner, self.out_features)
