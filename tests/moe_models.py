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
