"""Dispatch and combine as torch sees them: custom ops (the boundary torch.compile and the
fake-tensor tracer stop at) and the autograd functions over them.

A custom op takes plain tensors and an int, so each finds its dispatcher by id in a weak
registry (:func:`register`); the dispatcher's raw steps (``_dispatch_fwd``, ``_combine_fwd``,
``_dispatch_bwd``, ``_combine_bwd``) do the work.
"""

import itertools
import weakref
from typing import Tuple

import torch
from torch import Tensor

_REGISTRY: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(dispatcher) -> int:
    """A new id for ``dispatcher``, by which the custom ops find it while it lives."""
    layer_id = next(_IDS)
    _REGISTRY[layer_id] = dispatcher
    return layer_id


def layer_name(ctx_id: int):
    """The layer name of dispatcher ``ctx_id`` while it lives, else None."""
    d = _REGISTRY.get(ctx_id)
    return None if d is None else d.layer_name


def _get(ctx_id: int):
    d = _REGISTRY.get(ctx_id)
    if d is None:
        raise RuntimeError(f"NVLinkDispatcher {ctx_id} no longer exists")
    return d


@torch.library.custom_op("ds_uniep::nvl_dispatch", mutates_args=())
def nvl_dispatch(x: Tensor, expert_idx: Tensor, ctx_id: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (recv [rows, M], local_expert_counts [L] i64, dest_row [T, k] i32, recv_pair [rows] i32,
    num_recv [1] i32, counts_all [G, E] i64)."""
    return _get(ctx_id)._dispatch_fwd(x, expert_idx)


@nvl_dispatch.register_fake
def _(x, expert_idx, ctx_id):
    d = _get(ctx_id)
    rows = d.bufs.recv_rows if d.padded_recv else torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty(rows, x.shape[1]), torch.empty(d.num_experts // d.ep_size, dtype=torch.int64,
                                                       device=x.device), torch.empty(expert_idx.shape, **i32),
            torch.empty(rows, **i32), torch.empty(1, **i32),
            torch.empty(d.ep_size, d.num_experts, dtype=torch.int64, device=x.device))


@torch.library.custom_op("ds_uniep::nvl_combine", mutates_args=())
def nvl_combine(y: Tensor, gates: Tensor, expert_idx: Tensor, recv_pair: Tensor, num_recv: Tensor,
                ctx_id: int) -> Tensor:
    """-> out [T, M] = cast(sum_j gates[t, j] * float(y[row of (t, j)])), slot order, fp32."""
    return _get(ctx_id)._combine_fwd(y, gates, expert_idx, recv_pair, num_recv)


@nvl_combine.register_fake
def _(y, gates, expert_idx, recv_pair, num_recv, ctx_id):
    return y.new_empty(expert_idx.shape[0], y.shape[1])


@torch.library.custom_op("ds_uniep::nvl_dispatch_backward", mutates_args=())
def nvl_dispatch_backward(grad_recv: Tensor, expert_idx: Tensor, recv_pair: Tensor, num_recv: Tensor,
                          ctx_id: int) -> Tensor:
    """-> grad_x [T, M] = cast(sum_j float(grad_recv[row of (t, j)])), slot order, fp32."""
    return _get(ctx_id)._dispatch_bwd(grad_recv, expert_idx, recv_pair, num_recv)


@nvl_dispatch_backward.register_fake
def _(grad_recv, expert_idx, recv_pair, num_recv, ctx_id):
    return grad_recv.new_empty(expert_idx.shape[0], grad_recv.shape[1])


@torch.library.custom_op("ds_uniep::nvl_combine_backward", mutates_args=())
def nvl_combine_backward(grad_out: Tensor, y: Tensor, gates: Tensor, expert_idx: Tensor, dest_row: Tensor,
                         recv_pair: Tensor, num_recv: Tensor, ctx_id: int) -> Tuple[Tensor, Tensor]:
    """-> (grad_y [rows, M] = cast(gates[t, j] * float(grad_out[t])) at the row of (t, j),
    grad_gates [T, k] fp32 = <grad_out[t], y[row of (t, j)]>)."""
    return _get(ctx_id)._combine_bwd(grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv)


@nvl_combine_backward.register_fake
def _(grad_out, y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id):
    return y.new_empty(y.shape), gates.new_empty(gates.shape)


class _DispatchFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, expert_idx, ctx_id):
        outs = nvl_dispatch(x, expert_idx, ctx_id)
        recv, local_counts, dest_row, recv_pair, num_recv, counts_all = outs
        ctx.ctx_id = ctx_id
        ctx.save_for_backward(expert_idx, recv_pair, num_recv)
        ctx.mark_non_differentiable(local_counts, dest_row, recv_pair, num_recv, counts_all)
        return outs

    @staticmethod
    def backward(ctx, grad_recv, *unused):
        expert_idx, recv_pair, num_recv = ctx.saved_tensors
        if grad_recv is None:
            return None, None, None
        grad_x = nvl_dispatch_backward(grad_recv.contiguous(), expert_idx, recv_pair, num_recv, ctx.ctx_id)
        return grad_x, None, None


class _CombineFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id):
        ctx.ctx_id = ctx_id
        ctx.save_for_backward(y, gates, expert_idx, dest_row, recv_pair, num_recv)
        return nvl_combine(y, gates, expert_idx, recv_pair, num_recv, ctx_id)

    @staticmethod
    def backward(ctx, grad_out):
        y, gates, expert_idx, dest_row, recv_pair, num_recv = ctx.saved_tensors
        grad_y, grad_gates = nvl_combine_backward(grad_out.to(y.dtype).contiguous(), y, gates, expert_idx, dest_row,
                                                  recv_pair, num_recv, ctx.ctx_id)
        return grad_y, grad_gates, None, None, None, None, None


def dispatch(x: Tensor, expert_idx: Tensor, ctx_id: int):
    """Autograd-aware dispatch: the outputs of :func:`nvl_dispatch`; grad of recv flows to x."""
    return _DispatchFn.apply(x, expert_idx, ctx_id)


def combine(y: Tensor, gates: Tensor, expert_idx: Tensor, dest_row: Tensor, recv_pair: Tensor, num_recv: Tensor,
            ctx_id: int) -> Tensor:
    """Autograd-aware combine: :func:`nvl_combine`; grads flow to y and gates."""
    return _CombineFn.apply(y, gates, expert_idx, dest_row, recv_pair, num_recv, ctx_id)
