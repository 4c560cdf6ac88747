"""Layers tune themselves: autotune inside UniEPMoE on CPU (gloo), and the plan's knobs reaching the dispatcher."""
import json
import logging

import pytest
import torch

from dist_utils import run_distributed
from ds_uniep import SwiGLUExpert, UniEPMoE
from ds_uniep.tuning import Plan

M, F, E, K = 32, 64, 4, 2


def test_num_comm_sms_is_the_block_count_of_the_copy_kernels(monkeypatch):
    """The megakernel dispatcher is built with the block's knobs (``overlap.num_comm_sms``: the block
    count of its copy kernels) and takes a plan's knobs in place; a new dispatch dtype builds another."""
    import ds_uniep.megakernel as mk
    from ds_uniep import backend as backend_mod
    built = []

    class FakeNVLinkDispatcher:
        """NVLinkDispatcher's own knob handling (set_knobs) on 132 SMs, without buffers."""
        sm_count, layer_name = 132, "fake"
        set_knobs, set_config = mk.NVLinkDispatcher.set_knobs, mk.NVLinkDispatcher.set_config

        @classmethod
        def from_config(cls, layer_name, num_experts, ep_size, hidden_size, k, dtype, config, group=None):
            d = cls()
            d.fp8, d.dispatch_dtype = config.compression.dispatch_dtype == "fp8_e4m3", config.compression.dispatch_dtype
            d.set_knobs(config.knobs())
            built.append(d)
            return d

    monkeypatch.setattr(mk, "NVLinkDispatcher", FakeNVLinkDispatcher)
    monkeypatch.setattr(backend_mod, "resolve", lambda backend, device, name, topology=None, **_: "megakernel")
    layer = UniEPMoE(M, torch.nn.Linear(M, M), num_experts=2, config={"overlap": {"num_comm_sms": 24}})
    x = torch.randn(4, M)
    d = layer._dispatcher(x)
    assert d.num_blocks == 24
    plan = Plan.from_config(layer.uniep_config)
    layer.set_plan(plan.replace(num_comm_sms=96))
    assert layer._dispatcher(x) is d and d.num_blocks == 96 and len(built) == 1  # no new symmetric buffer
    # the fused dispatch's SMs in partitioned roles; the other copy kernels then take every SM
    layer.set_plan(plan.replace(schedule="fused", roles="partitioned", num_comm_sms=16))
    assert (d.fused_comm_blocks, d.num_blocks) == (16, 132) and layer.uniep_config.overlap.schedule == "fused"
    layer.set_plan(plan.replace(num_comm_sms=96, dispatch_dtype="fp8_e4m3"))
    d2 = layer._dispatcher(x)
    assert d2 is not d and (d2.num_blocks, d2.dispatch_dtype) == (96, "fp8_e4m3") and len(built) == 2


def _build(ep_size, cache_dir, autotune, seed=0):
    torch.manual_seed(seed)
    cfg = {"backend": "reference",
           "autotune": {"enabled": autotune, "cache_dir": cache_dir, "budget_s": 10.0, "warmup": 1, "repeats": 2}}
    # RSample: the gate draws Gumbel noise, so tuning must hand the RNG streams back untouched.
    layer = UniEPMoE(M, SwiGLUExpert(M, F), num_experts=E, ep_size=ep_size, k=K, min_capacity=0, drop_tokens=False,
                     noisy_gate_policy="RSample", config=cfg)
    if ep_size > 1:
        layer.set_deepspeed_parallelism()
    return layer


def _step(layer, x, gy):
    """One forward and backward from a fixed RNG state; what the user sees afterwards."""
    torch.manual_seed(123)
    xi = x.clone().requires_grad_(True)
    out, l_aux, _ = layer(xi)
    no_grad_yet = all(p.grad is None for p in layer.parameters())
    rng_after_forward = torch.rand(4)
    torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
    return [out, xi.grad] + [p.grad for p in layer.parameters()], rng_after_forward, no_grad_yet


def _self_tuning_body(rank, world_size, cache_dir, report_path):
    from ds_uniep.tuning import runner, tuner
    timed, runs = [], []
    real_run, real_live = tuner._Timer.run, runner.live_runner

    def counting_run(self, fn, n):
        timed.append(n)
        return real_run(self, fn, n)

    def counting_live(*args, **kw):
        run_plan = real_live(*args, **kw)
        return lambda plan: (runs.append(plan), run_plan(plan))[1]

    tuner._Timer.run = counting_run
    runner.live_runner = counting_live
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("ds_uniep").addHandler(Keep())

    T = 19
    g = torch.Generator().manual_seed(rank)
    x, gy = torch.randn(T, M, generator=g), torch.randn(T, M, generator=g)
    seen = {}
    for name, autotune in (("plain", False), ("tuned", True), ("cached", True)):
        timed.clear()
        runs.clear()
        layer = _build(world_size, cache_dir, autotune)
        seen[name] = _step(layer, x, gy) + (list(timed), list(runs), layer)

    plain, tuned, cached = seen["plain"], seen["tuned"], seen["cached"]
    for other in (tuned, cached):
        assert len(other[0]) == len(plain[0])
        for i, (a, b) in enumerate(zip(plain[0], other[0])):
            assert torch.equal(a, b), f"rank {rank}: tensor {i} changed by autotune"
        assert torch.equal(other[1], plain[1]), "tuning moved the caller's RNG stream"
        assert other[2], "tuning left a .grad behind"
    key = (T, torch.float32, torch.device("cpu"))
    first, hit = tuned[5].autotune_results[key], cached[5].autotune_results[key]
    assert tuned[3] and tuned[4] and not first.from_cache, "the first construction did not tune"
    assert {p.dispatch_dtype for p in tuned[4]} == {"activation"}  # FP8 only when numerics may change
    assert cached[3] == [] and cached[4] == [] and hit.from_cache, "a cache hit ran timing"
    assert hit.winner == first.winner and tuned[5].uniep_config.overlap == cached[5].uniep_config.overlap
    if rank == 0:
        assert any("autotune" in m and first.winner.label() in m for m in records), records

    # The next forward of the same shape does not tune again; a new T does.
    layer = tuned[5]
    timed.clear()
    layer(x)
    assert timed == []
    layer(torch.randn(7, M))
    assert timed and (7, torch.float32, torch.device("cpu")) in layer.autotune_results

    # ep_size 1 tunes on its rank alone: no collective, so rank 0 may do it while rank 1 waits.
    if rank == 0:
        solo = _build(1, cache_dir, True)
        solo(x)
        assert not solo.autotune_results[key].from_cache
    torch.distributed.barrier()

    # Ranks feeding different T to the first forward of a shape get a clear error, not a hang.
    with pytest.raises(ValueError, match="same layer shape on every expert-parallel rank"):
        _build(world_size, cache_dir, True)(torch.randn(10 + rank, M))

    if rank == 0:
        with open(report_path, "w") as f:
            json.dump({"winner": first.winner.to_dict(), "measured": len(first.by_status("measured"))}, f)


def test_layer_tunes_itself_once_then_reads_the_cache(tmp_path):
    report = tmp_path / "report.json"
    run_distributed(_self_tuning_body, 2, str(tmp_path / "cache"), str(report))
    data = json.loads(report.read_text())
    # The reference backend acts on dispatch_dtype only: its space is one plan without numerics change.
    assert data["measured"] == 1 and Plan.from_dict(data["winner"]).schedule == "sequential"
    assert len(list((tmp_path / "cache").glob("plan-*.json"))) == 3  # ep 2 at T=19 and T=7, ep 1 at T=19


def test_a_new_shape_tunes_from_the_configured_plan_not_the_last_winner(tmp_path, monkeypatch):
    from ds_uniep.tuning import tuner
    seen = []
    real = tuner.tune_from_config
    monkeypatch.setattr(tuner, "tune_from_config", lambda cfg, *a, **kw: (seen.append(cfg), real(cfg, *a, **kw))[1])
    layer = _build(1, str(tmp_path), True)
    layer(torch.randn(19, M))
    assert len(seen) == 1 and seen[0].compression.dispatch_dtype == "activation"
    # as if that shape's winner had changed the dispatch dtype (allowed numerics change)
    first = layer.autotune_results[(19, torch.float32, torch.device("cpu"))].winner
    layer.set_plan(first.replace(dispatch_dtype="fp8_e4m3"))
    assert layer.uniep_config.compression.dispatch_dtype == "fp8_e4m3"
    layer(torch.randn(7, M))
    assert len(seen) == 2
    assert seen[1].compression == layer.configured_config.compression and seen[1].overlap == \
        layer.configured_config.overlap, "the second shape was tuned from the first shape's winner"
    assert seen[1].autotune == layer.uniep_config.autotune
