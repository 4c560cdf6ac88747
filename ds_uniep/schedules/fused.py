"""The megakernel's fused schedule: the rows travel one destination at a time from a few SMs while
the first expert GEMM runs on the others, each run of its tiles as soon as the latest source among
the run's rows has arrived (``overlap.fused_dispatch``); with ``overlap.epilogue_combine`` the
expert GEMMs' epilogues store into the sources' combine buffers (``ds_uniep.epilogue_combine``).
The same bits as the sequential schedule.

With the dispatch queued early (``early``: one rank of tokens, DeepSpeed's dropless top-2/top-k
gate) the experts are stacked before the routes (the fused dispatch needs the stacked first
projection when it is queued, and this host work then overlaps the work queued before the layer),
and with the fused dispatch the first expert GEMM is queued inside ``dispatch()``, before the rest
of the gate (gates, auxiliary loss, counts: ``gating.route_split``), whose kernels then run behind
it. With rank partials (the dispatch stages the gates) and without the fused dispatch, the rest of
the gate comes before ``dispatch()``.
"""

from typing import Dict, Optional

from torch import Tensor

from .. import gating
from . import common
from .common import Step


class Fused:
    """The fused schedule on the megakernel with experts that run as ds_uniep's grouped GEMMs."""

    name = "fused"

    def __init__(self, early: bool, fused_dispatch: bool, epilogue_combine: bool,
                 configs: Optional[Dict[str, str]]) -> None:
        self.early, self.fused_dispatch, self.epilogue_combine = early, fused_dispatch, epilogue_combine
        self.configs = configs

    def run(self, layer, step: Step) -> Tensor:
        return self._run_early(layer, step) if self.early else self._run_routed(layer, step)

    def _run_routed(self, layer, step: Step) -> Tensor:
        expert_idx, gates, _ = common.route(layer, step)
        d, x = step.dispatcher, step.x
        stacked = common.stack(layer, x)
        if self.fused_dispatch:
            request_fused(d, stacked, self.configs)
        recv, local_counts, handle = d.dispatch(x, expert_idx, gates)
        return self.experts_and_combine(layer, d, x, recv, local_counts, stacked, gates, handle)

    def _run_early(self, layer, step: Step) -> Tensor:
        d = step.dispatcher
        x = step.x = step.x.contiguous()  # the very tensor the dispatch's kernels read, checked again by dispatch()
        stacked = common.stack(layer, x)
        expert_idx, finish = gating.route_split(layer.deepspeed_moe.gate, x, step.used_token)
        if self.fused_dispatch:
            request_fused(d, stacked, self.configs)
        d.dispatch_begin(x, expert_idx)
        # The fused dispatch moves most rows inside the first expert GEMM, so little device work is
        # queued ahead of it: that GEMM is queued (once the row count is read) before the rest of
        # the gate. Issued first, the gate's host work left the device idle before the GEMM.
        gemm_first = self.fused_dispatch and not d.rank_partials
        if gemm_first:
            recv, local_counts, handle = d.dispatch(x, expert_idx, None)
        l_aux, gates, exp_counts = finish()
        common.set_gate_outputs(layer, step, l_aux, exp_counts)
        if not gemm_first:
            recv, local_counts, handle = d.dispatch(x, expert_idx, gates)
        return self.experts_and_combine(layer, d, x, recv, local_counts, stacked, gates, handle)

    def experts_and_combine(self, layer, dispatcher, x: Tensor, recv: Tensor, local_counts: Tensor, stacked,
                            gates: Tensor, handle) -> Tensor:
        """This rank's experts, then the combine (``x``: the tokens the dispatch read). With
        ``epilogue_combine`` the expert GEMMs' epilogues store into the sources' combine buffers:
        the second GEMM's output rows in the forward (a last projection without bias), the first
        GEMM's input-gradient rows in the backward."""
        into = None
        if self.epilogue_combine:
            from ..epilogue_combine import DgradCombine, gemm_combine
            into = DgradCombine(dispatcher, handle, x)
            if stacked.biases["w2" if "w2" in stacked.weights else "fc2"] is None:
                return common.local_experts(
                    layer, dispatcher, recv, local_counts, stacked, True, into=into,
                    last=lambda h, w, offs: gemm_combine(dispatcher, h, w, offs, gates, handle, self.configs))
        y = common.local_experts(layer, dispatcher, recv, local_counts, stacked, True, into=into)
        return dispatcher.combine(y, gates, handle)


def request_fused(dispatcher, stacked, configs: Optional[Dict[str, str]]) -> None:
    """Ask the next dispatch to queue the first expert GEMM (``w13`` of SwiGLU experts, ``fc1`` of
    GeLU ones) over the rows as they arrive; the weight contiguous, as grouped_linear makes it (a
    copy only for the strided stacks of flattened experts)."""
    first = "w13" if "w13" in stacked.weights else "fc1"
    # Read without an autograd node where it is a view: the GEMM that computes with it makes that
    # node when it runs.
    dispatcher.request_fused(stacked.weights.detached(first).contiguous(), configs)
