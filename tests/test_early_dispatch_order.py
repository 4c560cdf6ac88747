"""The order in which the megakernel's early-dispatch schedules issue their steps (CPU, one gloo rank):
``ds_uniep.schedules.EarlySequential`` and ``Fused`` with ``early``.

Under the fused schedule the experts are stacked before the routes (the fused dispatch needs the
stacked first projection when it is queued; stacked between the routes and the dispatch, that host
work left the GPU idle there), and with the fused dispatch the first expert GEMM is queued inside
``dispatch()``, so ``dispatch()`` comes before the rest of the gate (gates, auxiliary loss): issued
after it, that host work left the GPU idle ahead of the GEMM. The sequential schedule's experts need
no gates, so there ``dispatch()`` and the experts come before the rest of the gate and only the
combine after it; experts that run as grouped GEMMs get their row ends computed from the pending
dispatch's counts before ``dispatch()`` waits for the row count. With rank partials (whose dispatch
stages the gates) and in the fused schedule without the fused dispatch, the rest of the gate comes
first and ``dispatch()`` gets the gates. The dispatcher here is a stand-in that records its calls
(the real one needs NVLink peers); the gate is DeepSpeed's own, split by
``ds_uniep.gating.route_split``. The schedule is resolved before the calls are recorded (the
resolver asks whether the experts stack). The GPU tests check that either order gives the same bits.
"""
import torch

from dist_utils import run_distributed

COUNTS = torch.tensor([3, 0, 5, 2])  # rows per local expert, as the layout would leave them


class _Recorder:
    """Stands in for ``NVLinkDispatcher``: records the layer's calls in ``calls``."""

    def __init__(self, calls, seen, rank_partials):
        self.calls, self.seen, self.rank_partials = calls, seen, rank_partials

    def dispatch_begin(self, x, expert_idx):
        self.calls.append("dispatch_begin")
        return True

    def pending_local_counts(self):
        self.calls.append("pending counts")
        return COUNTS

    def dispatch(self, x, expert_idx, gates=None):
        self.calls.append("dispatch(gates)" if gates is not None else "dispatch()")
        return x, torch.zeros(1, dtype=torch.int64), "handle"

    def combine(self, y, gates, handle):
        self.calls.append("combine")
        self.seen["gates"] = gates
        return y


def _orders(rank, world_size):
    from ds_uniep import SwiGLUExpert, UniEPMoE, gating, schedules
    from ds_uniep.schedules import common, fused
    from moe_models import MLP

    real_split = gating.route_split
    cases = {  # (schedule, fused_dispatch, rank partials, grouped bf16 experts) -> the calls expected
        ("fused", True, False, False): ["stack", "routes", "request_fused", "dispatch_begin", "dispatch()", "finish",
                                        "experts"],
        ("fused", True, True, False): ["stack", "routes", "request_fused", "dispatch_begin", "finish",
                                       "dispatch(gates)", "experts"],
        ("fused", False, False, False): ["stack", "routes", "dispatch_begin", "finish", "dispatch(gates)", "experts"],
        ("sequential", True, False, False): ["routes", "dispatch_begin", "stack", "dispatch()", "local experts",
                                             "finish", "combine"],
        # experts that run as grouped GEMMs: their row ends are queued before dispatch() waits for the row count
        ("sequential", True, False, True): ["routes", "dispatch_begin", "stack", "pending counts", "dispatch()",
                                            "local experts", "finish", "combine"],
        ("sequential", True, True, False): ["routes", "dispatch_begin", "finish", "stack", "dispatch(gates)",
                                            "local experts", "combine"],
    }
    real_stack, real_local, real_request = common.stack, common.local_experts, fused.request_fused
    real_experts = fused.Fused.experts_and_combine
    for (schedule, fused_dispatch, partials, grouped), want in cases.items():
        torch.manual_seed(0)
        layer = UniEPMoE(16, SwiGLUExpert(16, 32) if grouped else MLP(16, 32), num_experts=4, ep_size=1, k=2,
                         drop_tokens=False,
                         config={"overlap": {"schedule": schedule, "fused_dispatch": fused_dispatch}})
        dtype = torch.bfloat16 if grouped else torch.float32
        layer = layer.to(dtype)
        layer.deepspeed_moe.gate.wg.float()
        calls = []
        seen = {}

        def split(gate, x, used_token=None):
            calls.append("routes")
            idx, finish = real_split(gate, x, used_token)

            def recorded():
                calls.append("finish")
                seen["finish"] = finish()
                return seen["finish"]
            return idx, recorded

        def experts(self, layer, dispatcher, x, recv, local_counts, stacked, gates, handle):
            calls.append("experts")
            seen["gates"] = gates
            return x * 2

        def local_experts(layer, dispatcher, recv, local_counts, stacked, fused, last=None, into=None, offs=None):
            calls.append("local experts")
            assert not fused and (stacked is not None) == grouped
            seen["offs"] = offs
            return recv * 2

        recorder = _Recorder(calls, seen, partials)
        layer._dispatcher = lambda x: recorder
        gating.route_split = split
        common.stack = lambda layer, x: calls.append("stack") or real_stack(layer, x)
        common.local_experts, fused.Fused.experts_and_combine = local_experts, experts
        fused.request_fused = lambda dispatcher, stacked, configs: calls.append("request_fused")
        try:
            x = torch.randn(2, 5, 16, dtype=dtype)
            chosen, _ = layer._schedule(x.reshape(-1, 16))
            if schedule == "fused":  # the fused schedule needs experts that stack: stand-ins for its checks
                chosen = schedules.Fused(True, fused_dispatch, True, None)
                layer._schedules[x.device, x.dtype] = (layer._schedules[x.device, x.dtype][0], chosen)
            assert type(chosen) is {"fused": schedules.Fused, "sequential": schedules.EarlySequential}[schedule]
            calls.clear()
            out, l_aux, counts = layer(x)
        finally:
            gating.route_split, common.stack, common.local_experts = real_split, real_stack, real_local
            fused.request_fused, fused.Fused.experts_and_combine = real_request, real_experts
        where = f"{schedule}, fused_dispatch={fused_dispatch}, rank partials={partials}, grouped={grouped}"
        assert calls == want, f"{where}: {calls}"
        # whatever the order, the combine gets the gate's own gates and the layer its auxiliary loss and counts
        l_aux_want, gates_want, counts_want = seen["finish"]
        assert seen["gates"] is gates_want, where
        assert l_aux is l_aux_want and counts is counts_want, where
        assert layer.deepspeed_moe.l_aux is l_aux_want, where
        assert torch.equal(out, (x * 2)), where
        if grouped:  # the row ends of the pending dispatch's counts, as run_grouped computes them
            assert seen["offs"].dtype == torch.int32 and seen["offs"].tolist() == [3, 3, 8, 10], where
        elif schedule == "sequential" and not partials:
            assert seen["offs"] is None, where


def test_the_dispatch_comes_before_the_rest_of_the_gate_unless_it_needs_the_gates():
    """The calls in order, per schedule; the gates, auxiliary loss and counts reach their users either way."""
    run_distributed(_orders, 1)
