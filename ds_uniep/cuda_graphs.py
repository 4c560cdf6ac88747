"""A sync-free ``UniEPMoE`` replayed from CUDA graphs inside an eager training step.

``graph_moe(layer, sample)`` captures the layer's forward and its backward as two CUDA graphs
(``torch.cuda.make_graphed_callables``) for inputs like ``sample`` and keeps them on the layer: its
later calls with such inputs replay them, so the layer's host work (the gate's small ops, the
launches, the autograd nodes) costs one replay each way while the rest of the model runs eagerly,
DeepSpeed's engine and its gradient hooks included (the parameters' gradients are accumulated
outside the graphs). Other inputs (shape, dtype, ``requires_grad``, ``used_token``, autocast, eval
mode) run the layer eagerly. The layer stays the same module: its parameters, ``state_dict`` and
checkpoints do not change.

The graphs are of the layer as a function of its input and of aliases of its parameters (tensors
on the parameters' storage, leaves of their own, swapped in by ``torch.func.functional_call``):
the captured backward computes the aliases' gradients, and an autograd node outside the graphs
hands them to the parameters. The parameters' own gradient accumulators, which DeepSpeed's ZeRO-2
keeps from ``deepspeed.initialize`` on (on the stream it ran on, for its reduction hooks), then
never enter the capture, which cannot wait on another stream's nodes.
"""
from typing import Optional

import torch
from torch import Tensor, nn


class _Eager(nn.Module):
    """The layer's forward without its graphs."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor):
        return self.layer.forward_eager(x)


class _Functional:
    """``f(x, *tensors)``: the layer's eager forward with ``tensors`` in place of its parameters (in
    ``named_parameters`` order)."""

    def __init__(self, layer: nn.Module):
        self.eager = _Eager(layer)
        self.names = ["layer." + n for n, _ in layer.named_parameters()]

    def __call__(self, x: Tensor, *tensors: Tensor):
        return torch.func.functional_call(self.eager, dict(zip(self.names, tensors)), (x, ))


class _Alias(torch.autograd.Function):
    """Tensors on the parameters' storage whose gradients go to the parameters."""

    @staticmethod
    def forward(ctx, *params):
        return tuple(p.detach() for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return grads


class LayerGraphs:
    """The captured forward and backward of one layer, for inputs keyed like the sample."""

    def __init__(self, layer: nn.Module, sample: Tensor, warmup: int):
        self.key = self.key_of(sample, layer.training)
        self.params = [p for _, p in layer.named_parameters()]
        aliases = tuple(p.detach().requires_grad_(p.requires_grad) for p in self.params)
        self.graphed = torch.cuda.make_graphed_callables(_Functional(layer), (sample, ) + aliases,
                                                         num_warmup_iters=warmup)

    @staticmethod
    def key_of(x: Tensor, training: bool):
        return tuple(x.shape), x.dtype, x.device, x.requires_grad, training

    def run(self, x: Tensor, training: bool):
        """The replayed forward's outputs, or None where ``x`` is not like the sample (the caller runs
        the layer eagerly)."""
        if self.key_of(x, training) != self.key or torch.is_autocast_enabled(x.device.type):
            return None
        return self.graphed(x, *_Alias.apply(*self.params))


def graph_moe(layer: nn.Module, sample: Tensor, warmup: int = 3) -> nn.Module:
    """Capture ``layer`` (a ``UniEPMoE`` with ``"sync_free": true``, on its GPU, in the mode it will run in)
    for inputs like ``sample`` (shape, dtype, device and ``requires_grad`` as the real inputs will have them)
    and return it; see the module doc. Collective: every rank of the expert-parallel group calls it at the
    same point with its own sample (``warmup`` eager forward and backward steps run first, their gradients
    not accumulated). Call it after the parameters have their final dtype and device (after
    ``deepspeed.initialize``, which may cast them); calling it again replaces the graphs."""
    cfg = getattr(layer, "uniep_config", None)
    if cfg is None or not cfg.sync_free:
        raise ValueError('graph_moe needs a UniEPMoE with "uniep": {"sync_free": true} (no host read of counts, '
                         "epochs on the device)")
    if not sample.is_cuda:
        raise ValueError(f"graph_moe: the sample must be a CUDA tensor, got one on {sample.device}")
    # The last auxiliary loss (kept as DeepSpeed's MoE keeps it) holds the gate's gradient accumulator on
    # the stream of the layer's last eager call; let it go before the warm-up on the capture's stream.
    moe = layer.deepspeed_moe
    moe.l_aux = moe.exp_counts = None
    layer.__dict__["_cuda_graphs"] = None  # (the warm-up and capture run the eager forward)
    layer.__dict__["_cuda_graphs"] = LayerGraphs(layer, sample, warmup)
    return layer


def replay(layer: nn.Module, hidden_states: Tensor, used_token: Optional[Tensor]):
    """The layer's graphed forward for these inputs, or None (no graphs, or inputs unlike the sample)."""
    graphs = layer.__dict__.get("_cuda_graphs")
    if graphs is None or used_token is not None:
        return None
    return graphs.run(hidden_states, layer.training)
