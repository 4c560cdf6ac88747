"""The sequential schedule: dispatch, all local experts, then combine, one after the other.

Two ways through it. :class:`Sequential` runs DeepSpeed's whole gate first and covers every
backend and layout: the reference dispatcher (capacity-padded buffers with ``drop_tokens``),
HybridEP (its domain's replicas travel while the gate runs), tensor parallelism (each TP rank
moves its slice of the tokens; TP-sharded experts through ``run_tp_sharded_experts``), and the
megakernel where the dispatch cannot start early. :class:`EarlySequential` is the megakernel's
with the dispatch queued as soon as the gate's routes exist (``NVLinkDispatcher.dispatch_begin``):
the counts exchange, the layout and the rows' stores run on the device while the host stacks the
experts' weights and reads the row count, and the experts are queued before the rest of the gate
(gates, auxiliary loss, counts: ``gating.route_split``), which only the combine needs. With rank
partials (the dispatch stages the gates) the rest of the gate comes before the dispatch. The same
operations on the same tensors either way, so the same bits.
"""

from torch import Tensor

from .. import gating
from ..experts import row_ends
from ..reference import ReferenceDispatcher
from ..tensor_parallel import run_tp_sharded_experts, tp_context
from . import common
from .common import Step


class Sequential:
    """The gate, then dispatch, experts and combine in turn, on any dispatcher."""

    name = "sequential"

    def __init__(self, tp_sharded: bool = False) -> None:
        self.tp_sharded = tp_sharded  #: the experts are TP-sharded (enable_expert_tensor_parallelism)

    def run(self, layer, step: Step) -> Tensor:
        hybrid = layer._hybrid
        if hybrid is not None:  # HybridEP: the domain's replicas travel while the gate and dispatch run
            hybrid.prefetch()
        expert_idx, gates, capacity = common.route(layer, step)
        d, x = step.dispatcher, step.x
        # Stacked now, so that this host work is done by the time the dispatch's row count arrives.
        stacked = None if hybrid is not None or self.tp_sharded else common.stack(layer, x)
        if isinstance(d, ReferenceDispatcher):
            # With drop_tokens the reference exchanges capacity-padded buffers, as DeepSpeed does.
            cap = int(capacity) if layer.deepspeed_moe.gate.drop_tokens else None
            recv, local_counts, handle = d.dispatch(x, expert_idx, cap)
        else:
            recv, local_counts, handle = d.dispatch(x, expert_idx, gates)
        if hybrid is not None:
            y = hybrid.run(recv, local_counts, gemm=layer._expert_gemm(recv.device))
        elif self.tp_sharded:
            cf, (tp_group, tp, tp_rank) = layer.uniep_config.commfuse, tp_context()
            y = run_tp_sharded_experts(layer.deepspeed_moe.experts.deepspeed_experts, recv, local_counts, tp_group,
                                       tp_rank, tp, cf.schedule, cf.transport, cf.num_chunks)
        else:
            y = common.local_experts(layer, d, recv, local_counts, stacked, False)
        return d.combine(y, gates, handle)


class EarlySequential:
    """The megakernel's sequential schedule with the dispatch and the experts queued between the
    gate's routes and the rest of the gate (one rank of tokens, DeepSpeed's dropless top-2/top-k)."""

    name = "sequential"

    def run(self, layer, step: Step) -> Tensor:
        d = step.dispatcher
        x = step.x = step.x.contiguous()  # the very tensor the dispatch's kernels read, checked again by dispatch()
        expert_idx, finish = gating.route_split(layer.deepspeed_moe.gate, x, step.used_token)
        d.dispatch_begin(x, expert_idx)
        # The experts need no gates (only the combine does), so the dispatch and the experts come
        # before the rest of the gate; the dispatch needs no gates then either, unless it stages
        # them for rank partials.
        experts_first = not d.rank_partials
        if experts_first:
            stacked = common.stack(layer, x)
            # The grouped GEMMs' row ends, queued before dispatch() waits for the row count (where
            # the host waits for the peers anyway), not after it.
            offs = row_ends(d.pending_local_counts()) if stacked is not None else None
            recv, local_counts, handle = d.dispatch(x, expert_idx, None)
            y = common.local_experts(layer, d, recv, local_counts, stacked, False, offs=offs)
        l_aux, gates, exp_counts = finish()
        common.set_gate_outputs(layer, step, l_aux, exp_counts)
        if not experts_first:
            stacked = common.stack(layer, x)
            recv, local_counts, handle = d.dispatch(x, expert_idx, gates)
            y = common.local_experts(layer, d, recv, local_counts, stacked, False)
        return d.combine(y, gates, handle)
