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


def expert_layouts(kind, M, F, L, device="cpu"):
    """The same experts with their parameters laid out three ways: packed by pack_experts, flattened
    expert by expert in module order into one buffer (as DeepSpeed's optimizers flatten a parameter
    group), and each in its own storage."""
    from ds_uniep.experts import pack_experts
    torch.manual_seed(1)
    base = [kind(M, F).to(device, torch.bfloat16) for _ in range(L)]
    with torch.no_grad():
        for e in base:  # self-identifying values: expert l's weights sit around l
            for p in e.parameters():
                p.mul_(0.5).add_(0.01 * (list(base).index(e) + 1))
    out = {}
    for layout in ("packed", "flat", "separate"):
        experts = [kind(M, F).to(device, torch.bfloat16) for _ in range(L)]
        for e, b in zip(experts, base):
            e.load_state_dict(b.state_dict())
        if layout == "packed":
            assert pack_experts(experts)
        elif layout == "flat":
            params = [p for e in experts for p in e.parameters()]
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            off = 0
            for p in params:
                p.data = flat[off:off + p.numel()].view(p.shape)
                off += p.numel()
        out[layout] = experts
    return out


def tiny_swiglu_moe(world_size, config, device="cpu", dtype=torch.float32, hidden=16, **moe_kw):
    """A dropless top-2 ``UniEPMoE`` (SwiGLU experts ``hidden`` -> 2 * ``hidden``, 4 experts per rank) with
    the same weights on every call, fp32 gate; in the expert-parallel group of ``world_size`` ranks.
    ``moe_kw``: more of the constructor's arguments (DeepSpeed's gate options)."""
    from ds_uniep import SwiGLUExpert, UniEPMoE
    torch.manual_seed(7)
    layer = UniEPMoE(hidden, SwiGLUExpert(hidden, 2 * hidden), num_experts=4 * world_size, ep_size=world_size, k=2,
                     min_capacity=0, drop_tokens=False, config=config, **moe_kw)
    layer = layer.to(device=device, dtype=dtype)
    layer.deepspeed_moe.gate.wg.float()
    if world_size > 1:
        layer.set_deepspeed_parallelism()
    return layer


def assert_bitwise(got, want, where):
    """Two lists of tensors: as many, each with the same dtype, shape and bits."""
    assert len(got) == len(want), f"{where}: {len(got)} tensors, {len(want)} wanted"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
            f"{where}: tensor {i} differs (max {(a.double() - b.double()).abs().max().item():.3g})"
