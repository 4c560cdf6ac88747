"""A sync-free ``UniEPMoE`` replayed from CUDA graphs inside an eager training step.

``graph_moe(layer, sample)`` captures the layer's forward and its backward as two CUDA graphs
(``torch.cuda.make_graphed_callables``) for inputs shaped like ``sample``; the returned module is called
as the layer is and replays them, so the layer's host work (the gate's small ops, the launches, the
autograd nodes) costs one replay each way while the rest of the model runs eagerly, DeepSpeed's
engine and its gradient hooks included (the parameters' gradients are accumulated outside the graphs).
Inputs of another shape, dtype or ``requires_grad`` run the layer eagerly. The replays give the eager
layer's bits (``tests/test_cuda_graph.py``).
"""
from typing import Optional

import torch
from torch import Tensor, nn


class _Eager(nn.Module):
    """The layer's own forward, for capture (its parameters are the layer's)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor):
        return self.layer(x)


class GraphedMoE(nn.Module):
    """See :func:`graph_moe`. ``layer`` stays reachable (its parameters, ``state_dict`` and checkpoints are
    the layer's)."""

    def __init__(self, layer: nn.Module, sample: Tensor, warmup: int):
        super().__init__()
        cfg = getattr(layer, "uniep_config", None)
        if cfg is None or not cfg.sync_free:
            raise ValueError('graph_moe needs a UniEPMoE with "uniep": {"sync_free": true} (no host read of counts, '
                             "epochs on the device)")
        if not sample.is_cuda:
            raise ValueError(f"graph_moe: the sample must be a CUDA tensor, got one on {sample.device}")
        self.layer = layer
        self.key = (tuple(sample.shape), sample.dtype, sample.device, sample.requires_grad)
        # The last auxiliary loss (kept as DeepSpeed's MoE keeps it) holds the gate's gradient accumulator on
        # the stream of the layer's last eager call; let it go before the warm-up on the capture's stream.
        moe = layer.deepspeed_moe
        moe.l_aux = moe.exp_counts = None
        # Kept outside the module tree, so that the layer's parameters appear once in state_dict.
        self.__dict__["_graphed"] = torch.cuda.make_graphed_callables(_Eager(layer), (sample, ),
                                                                      num_warmup_iters=warmup)

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None):
        key = (tuple(hidden_states.shape), hidden_states.dtype, hidden_states.device, hidden_states.requires_grad)
        if used_token is not None or key != self.key or torch.is_autocast_enabled(hidden_states.device.type):
            return self.layer(hidden_states, used_token)
        return self._graphed(hidden_states)


def graph_moe(layer: nn.Module, sample: Tensor, warmup: int = 3) -> GraphedMoE:
    """``layer`` (a ``UniEPMoE`` with ``"sync_free": true``, on its GPU) with its forward and backward
    captured as CUDA graphs for inputs like ``sample`` (shape, dtype, device and ``requires_grad``: set it as
    the real inputs will have it). Collective: every rank of the expert-parallel group calls it at the same
    point, with its own sample (``warmup`` eager steps run first). Capture it before ``deepspeed.initialize``
    adds module hooks, and call the result where the layer was called."""
    return GraphedMoE(layer, sample, warmup)
