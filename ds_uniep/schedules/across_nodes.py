"""The pipelined schedule across nodes: the megakernel on an expert-parallel group spanning nodes
(``ds_uniep.twolevel.TwoLevelNVLinkDispatcher``) with ``"overlap": {"schedule": "pipelined"}``.

The dispatch moves the rows in two phases (``TwoLevelDispatcher.dispatch`` with ``on_phase``):
first those whose sources are on this rank's own node, inside the node only, while the other
nodes' token rows cross the network; then those, once they have crossed, inside the node. The first
expert GEMM is queued over each phase's rows as soon as they are in place (ds_uniep's grouped GEMM
over the phase's segments), so the GEMM of the local rows runs while the network transfers are in
flight. The combine sends the other nodes' rows back first, so that they cross the network while
this node's rows move inside it.

The same bits as the sequential schedule: a row of the first GEMM is the same single k-ordered
sum whichever segment computes it, that GEMM's backward (and every other GEMM) runs over all the
rows at once (``ds_uniep.gemm.ComputedRows``), and the rows land where the one-phase dispatch puts
them. Needs experts that run as grouped GEMMs on ds_uniep's GEMM (``expert_gemm: "uniep"``, bf16).
"""

from typing import Dict, Optional

from torch import Tensor

from ..experts import run_grouped
from ..gemm import ComputedRows, fused_config, grouped_mm_segments
from . import common
from .common import Step


class NodePipelined:
    """The pipelined schedule on the megakernel across nodes (``configs``: ds_uniep's GEMM
    configurations; the phases' first GEMM runs its forward configuration, or the fused
    schedule's default where that is automatic)."""

    name = "pipelined"

    def __init__(self, configs: Optional[Dict[str, str]]) -> None:
        self.configs = configs

    def run(self, layer, step: Step) -> Tensor:
        expert_idx, gates, capacity = common.route(layer, step)
        d, x = step.dispatcher, step.x
        stacked = common.stack(layer, x)
        first = "w13" if "w13" in stacked.weights else "fc1"
        # Read without an autograd node where it is a view (the adopting GEMM makes that node).
        w = stacked.weights.detached(first).contiguous()
        config = fused_config(self.configs)
        computed = ComputedRows()

        def on_phase(recv: Tensor, phase) -> None:
            if computed.result is None:
                computed.result = recv.new_empty(recv.shape[0], w.shape[1])
            segs = phase.segments()
            if segs.shape[0]:
                grouped_mm_segments(recv, w, segs, config, out=computed.result)

        cap = int(capacity) if layer.deepspeed_moe.gate.drop_tokens else None
        recv, local_counts, handle = d.dispatch(x, expert_idx, cap, on_phase=on_phase)
        y = run_grouped(layer.deepspeed_moe.experts.deepspeed_experts, recv, local_counts, "uniep", stacked=stacked,
                        waits=computed, configs=self.configs)
        return d.combine(y, gates, handle)
