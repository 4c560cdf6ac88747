"""Small models shared by the tests: experts that identify themselves and a stock/UniEP pair builder."""
import copy

import torch
from torch import nn


class MLP(nn.Module):
    """A GELU MLP expert, the shape DeepSpeed-MoE examples use."""

    def __init__(self, hidden, ffn, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class BiasTupleMLP(MLP):
    """Megatron ParallelMLP style: returns ``(out, bias)`` with the bias not added."""

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))), self.fc2.bias


class Recorder(nn.Module):
    """Identity expert that keeps the rows it was given (to check where rows land)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.seen = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return x * self.scale


def distinct_experts(moe, rank, seed=0):
    """Give every global expert its own weights (so a misrouted row gives a wrong answer)."""
    L = moe.num_local_experts
    for l, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        g = torch.Generator().manual_seed(seed * 1000 + rank * L + l)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def twin_of(stock, config=None):
    """A UniEPMoE with the stock layer's weights (through the public converter)."""
    from ds_uniep import convert_moe_layers
    holder = nn.ModuleDict({"moe": copy.deepcopy(stock)})
    assert convert_moe_layers(holder, config or {"backend": "reference"}) == 1
    return holder["moe"]


class TinyMPU:
    """A Megatron-style mpu: TP groups of consecutive ranks, DP groups across them."""

    def __init__(self, tp):
        import torch.distributed as dist
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp = tp
        for i in range(world // tp):
            g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
            if rank // tp == i:
                self.tp_group = g
        for j in range(tp):
            g = dist.new_group(list(range(j, world, tp)))
            if rank % tp == j:
                self.dp_group = g

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    def get_tensor_model_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(self.tp_group)

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self):
        import torch.distributed as dist
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(self.dp_group)


class _CopyToTP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPMLP(nn.Module):
    """Megatron ParallelMLP style expert: fc1 column-parallel, fc2 row-parallel, all-reduce at the end."""

    def __init__(self, hidden, ffn, tp):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn // tp, bias=False)
        self.fc2 = nn.Linear(ffn // tp, hidden, bias=False)

    def forward(self, x):
        from deepspeed.utils import groups
        group = groups.mpu.get_tensor_model_parallel_group()
        h = torch.nn.functional.gelu(self.fc1(_CopyToTP.apply(x, group)))
        return _ReduceFromTP.apply(self.fc2(h), group)
