"""A linear whose weight is sharded over the data-parallel group (ZeRO-3 style), on CommFuse.

Letters: G ranks in the data-parallel group, T rows of this rank's input (its own batch), K input
and N output features, N_r of them (rows of the weight) held by rank r.

* Forward: the weight's row shards are all-gathered peer to peer, and each shard's output
  columns, ``F.linear(x, W_r, b_r)``, are computed as soon as it is in (this rank's first), while
  the next travels (``ring``, ``bidirectional_ring`` or ``local_first``; :func:`.exchange.gather_blocks`).
* Backward: the weight gradient ``dY^T X`` is a GEMM + reduce-scatter
  (:func:`.ops.matmul_reduce_scatter_impl`): the partial of rank j's rows is computed and sent to j
  while the next is computed, and every rank adds the G partials of its rows in rank order
  0..G-1 in fp32, cast once. The weight is gathered again meanwhile (p2p: all shards in one step
  behind the reduce-scatter's GEMMs; copy_engine: before it, as its workspace serves one call at a
  time), and the input gradient is one GEMM, ``dY W``. The bias gradient is summed over the group
  in rank order in fp32 too (one small all-gather).

Exactness: the output is bitwise equal to an unsharded ``F.linear(x, W, b)`` wherever the GEMM
computes each output element the same way whatever the call's number of rows or columns (torch's CPU
GEMMs at small sizes, not at every size in bf16; cuBLAS where it runs the same kernel for the shard
as for the whole), and within that GEMM's rounding elsewhere; ``dX`` is the unfused
call; the weight and bias gradients are bitwise equal to the unsharded linear's per-rank gradients
summed over the group in rank order in fp32 (cast once): deterministic, and independent of the
schedule and transport.

DeepSpeed: the reduce-scatter has already summed the weight and bias gradients over the group, so
the engine must not reduce them again. The parameters carry DeepSpeed's own marks for parameters
that are not all-reduced over the data-parallel group, those of its MoE experts:
``allreduce = False`` and ``group_name = "ep_size_<G>"`` (``deepspeed.moe.utils.is_moe_param``).
DeepSpeed reduces such a gradient over the expert-data-parallel group of that name, which for
expert-parallel size G (the whole data-parallel group) is each rank alone: no communication, only
DeepSpeed's division by the data-parallel size that every other gradient gets too (so this one is
the mean of the ranks' gradients, like theirs). :meth:`ShardedLinear.set_deepspeed_parallelism`,
which ``deepspeed.initialize`` calls, creates those groups. DeepSpeed applies that handling (ZeRO-0
and ZeRO-1/2) only to a model it sees MoE layers in, so each ``ShardedLinear`` holds a
parameter-less :class:`_DeepSpeedMoEMark` (a ``deepspeed.moe.layer.MoE`` with no experts): a model
needs no MoE layer of its own. ZeRO-1/2 want these parameters in a param group of their own
(``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``), as for experts.
Training is then that of the unsharded ``nn.Linear`` under ZeRO-1/2, and under ZeRO-0 without
gradient clipping (bitwise where the forward is). ZeRO-0's clipping (``gradient_clipping``, DeepSpeed's default 1.0) takes each
rank's norm over the gradients it holds and averages the ranks' norms, as for MoE experts: a rank
holds its shard only, so the clipping factor, and the run, differ from the unsharded model's.

Checkpoints: ``state_dict()`` holds the full weight and bias, gathered: every rank of the group
calls it (a collective), or DeepSpeed's ``save_checkpoint``, whose MoE path visits each MoE module
(the mark, which gathers) on every rank and then takes the model's state on data-parallel rank 0
alone (which finds the gathered tensors). ``load_state_dict`` takes the full tensors and keeps this
rank's rows (DeepSpeed's ``load_checkpoint`` as well).
"""
import functools
import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common import _aligned, _offsets, even_split, ordered_sum
from .exchange import finish_gather, gather_blocks, peer_schedule, start_gather
from .ops import matmul_reduce_scatter_impl


class _Plan:

    def __init__(self, group, G, me, sizes, schedule, num_chunks, transport):
        self.group, self.G, self.me, self.sizes = group, G, me, sizes
        self.offs = _offsets(sizes)
        self.schedule, self.num_chunks, self.transport = schedule, num_chunks, transport


def _gather_full(shard: torch.Tensor, plan: _Plan) -> torch.Tensor:
    full = shard.new_empty(sum(plan.sizes), *shard.shape[1:])
    for _ in gather_blocks(shard, plan.sizes, plan.group, plan.schedule, 1, plan.transport, full):
        pass
    return full


class _ShardedLinearFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w, bias, plan):
        T, N = x.shape[0], sum(plan.sizes)
        b_full = None if bias is None else _gather_full(bias.view(-1, 1), plan).view(-1)
        y = torch.empty(T, N, dtype=x.dtype, device=x.device)
        for r, w_r in gather_blocks(w, plan.sizes, plan.group, plan.schedule, plan.num_chunks, plan.transport):
            o, n = plan.offs[r], plan.sizes[r]
            y[:, o:o + n] = F.linear(x, _aligned(w_r), None if b_full is None else b_full[o:o + n])
        ctx.save_for_backward(x, w)
        ctx.args = (plan, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        plan, has_bias = ctx.args
        dy = dy.contiguous()
        state = start_gather(w, plan.sizes, plan.group, plan.num_chunks, plan.transport) \
            if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw, _ = matmul_reduce_scatter_impl(dy.t(), x, plan.group, plan.schedule, plan.num_chunks, plan.sizes,
                                               transport=plan.transport)
        db = None
        if has_bias and ctx.needs_input_grad[2]:
            local = dy.sum(0)
            parts = [torch.empty_like(local) for _ in range(plan.G)]
            dist.all_gather(parts, local, group=plan.group)
            o, n = plan.offs[plan.me], plan.sizes[plan.me]
            db = ordered_sum([p[o:o + n].contiguous() for p in parts])
        dx = dy @ finish_gather(state) if state is not None else None
        return dx, dw, db, None


class _DeepSpeedMoEMark(nn.Module):
    """A ``deepspeed.moe.layer.MoE`` (:func:`_mark_class`; with no experts, no gate, no parameters),
    so that the engine gives a model holding a :class:`ShardedLinear` its handling of
    parameters marked ``allreduce = False`` (module doc). Its state is empty; asked for it alone (as
    DeepSpeed asks each MoE module, on every rank, before it takes the model's state on rank 0), it
    gathers its linear's full weight and bias for that linear's state dict; as part of a larger
    state dict (its linear's), it does nothing."""

    def __init__(self, owner: "ShardedLinear", G: int):
        nn.Module.__init__(self)  # not MoE.__init__: no experts, no gate
        self.num_experts, self.num_local_experts, self.ep_size = 0, 0, G
        self.expert_group_name = f"ep_size_{G}"
        self._owner = weakref.ref(owner)  # not a submodule

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        pass  # the linear's own call makes the groups

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        owner = self._owner()
        if owner is not None and not prefix:
            owner.gathered_state(fresh=True)

    def forward(self, *args, **kwargs):
        raise RuntimeError("the DeepSpeed mark of a ShardedLinear is not a layer")


@functools.lru_cache(maxsize=None)
def _mark_class() -> type:
    """:class:`_DeepSpeedMoEMark` made a DeepSpeed ``MoE`` (imported here, when the first
    ShardedLinear is built, not when ds_uniep is)."""
    from deepspeed.moe.layer import MoE
    return type("_DeepSpeedMoEMark", (_DeepSpeedMoEMark, MoE), {"__doc__": _DeepSpeedMoEMark.__doc__})


class ShardedLinear(nn.Module):
    """``y = x W^T + b`` with W and b split by output rows over the data-parallel group (module doc).

    Args:
        in_features: K.
        out_features: N (all ranks together); rank r holds ``even_split(N, G)[r]`` rows.
        bias: a bias, sharded with the rows.
        group: the data-parallel process group (default world).
        config: ``UniEPConfig.commfuse`` (schedule ring / bidirectional_ring / local_first, num_chunks,
            transport), or None for ring / 1 / auto.
        dtype, device: of the parameters.

    ``weight``: ``[N_r, K]``; ``forward(x [*, K]) -> [*, N]``. Initialisation: ``nn.Linear``'s
    bound ``1/sqrt(K)`` for the weight, zeros for the bias; :meth:`from_linear` shards given weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, config=None,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        from .linear import _commfuse_args, _group_size_rank
        G, me = _group_size_rank(group)
        schedule, num_chunks, transport = _commfuse_args(config)
        peer_schedule(schedule, num_chunks, "ShardedLinear")
        sizes = even_split(out_features, G)
        self.in_features, self.out_features = in_features, out_features
        self.plan = _Plan(group, G, me, sizes, schedule, num_chunks, transport)
        self.weight = nn.Parameter(torch.empty(sizes[me], in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(sizes[me], dtype=dtype, device=device)) if bias else None
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
        for p in self.parameters():
            p.allreduce = False  # deepspeed.moe.utils.is_moe_param: not all-reduced over the DP group
            p.group_name = f"ep_size_{G}"
        self._gathered = None  # (parameter versions, full weight, full bias) of the last gather
        self.deepspeed_mark = _mark_class()(self, G)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, config=None) -> "ShardedLinear":
        """This rank's rows of a full ``nn.Linear``."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group, config,
                  dtype=linear.weight.dtype, device=linear.weight.device)
        mod._load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return mod

    def _load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        o, n = self.plan.offs[self.plan.me], self.plan.sizes[self.plan.me]
        with torch.no_grad():
            self.weight.copy_(weight[o:o + n])
            if self.bias is not None:
                self.bias.copy_(bias[o:o + n])

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by ``deepspeed.initialize``: the expert groups named ``ep_size_<G>`` (module doc)."""
        from deepspeed.utils import groups
        groups._create_expert_and_data_parallel(self.plan.G,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        edp = groups._get_expert_data_parallel_group(f"ep_size_{self.plan.G}")
        if dist.get_world_size(edp) != 1:
            raise ValueError(f"ShardedLinear: its group ({self.plan.G} ranks) must be DeepSpeed's whole data-parallel "
                             f"group, so that the expert-data-parallel group ep_size_{self.plan.G} is each rank alone "
                             f"(it has {dist.get_world_size(edp)} ranks)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ShardedLinear: input has shape {tuple(x.shape)}; expected [*, {self.in_features}]")
        if x.dtype != self.weight.dtype:
            raise TypeError(f"ShardedLinear: input is {x.dtype} but the weight is {self.weight.dtype}")
        self._gathered = None
        y = _ShardedLinearFn.apply(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias, self.plan)
        return y.view(*x.shape[:-1], self.out_features)

    def _versions(self):
        return tuple(p._version for p in (self.weight, self.bias) if p is not None)

    def gathered_state(self, fresh: bool = False):
        """``(weight [N, K], bias [N] or None)``, the full tensors: gathered over the group (a
        collective), or, unless ``fresh``, those of the last gather if the parameters have not been
        written in place since (kept until the next forward)."""
        if fresh or self._gathered is None or self._gathered[0] != self._versions():
            with torch.no_grad():
                w = _gather_full(self.weight.detach().contiguous(), self.plan)
                b = None if self.bias is None else _gather_full(self.bias.detach().view(-1, 1), self.plan).view(-1)
            self._gathered = (self._versions(), w, b)
        return self._gathered[1:]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        w, b = self.gathered_state()
        destination[prefix + "weight"] = w
        if b is not None:
            destination[prefix + "bias"] = b

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        mine = {}
        o, n = self.plan.offs[self.plan.me], self.plan.sizes[self.plan.me]
        for name in ("weight", "bias"):
            key = prefix + name
            if key in state_dict and getattr(self, name) is not None:
                t = state_dict[key]
                full = (self.out_features, self.in_features) if name == "weight" else (self.out_features,)
                if tuple(t.shape) != full:
                    error_msgs.append(f"{key}: expected the full {name} {full}, got {tuple(t.shape)}")
                    continue
                mine[key] = t[o:o + n]
        rest = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in mine}
        rest.update(mine)
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        p = self.plan
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dp={p.G}, schedule={p.schedule}, num_chunks={p.num_chunks}, transport={p.transport}")
