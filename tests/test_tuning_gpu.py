"""Tuning never changes numbers, on 2 GPUs over NCCL with the megakernel backend.

Every plan the tuner timed (and block counts outside the walked values) gives
the sequential baseline plan's output and input/parameter gradients bit for
bit, on torch's grouped GEMM, on ds_uniep's (whose space holds the fused
schedule) and in a space that walks both (the baseline on torch's); a layer that
tunes itself gives an untuned layer's numbers, and a second layer of the same
shape reads the plan from the cache, and a layer whose block sets the combine's
chunks and queue gives the same bits. FP8 dispatch changes
the numbers by design, so it is not in the space (allow_numerics_change is off).
"""
import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from ds_uniep.knobs import FUSED_COMM_SMS

M, F, K, T = 512, 1024, 2, 2048
EXPERTS_PER_RANK = 4


def _layer(rank, world_size, config, device):
    from ds_uniep import SwiGLUExpert, UniEPMoE
    torch.manual_seed(7)
    layer = UniEPMoE(M, SwiGLUExpert(M, F), num_experts=EXPERTS_PER_RANK * world_size, ep_size=world_size, k=K,
                     min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False, config=config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + rank)
        for p in layer.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.deepspeed_moe.gate.wg.float()
    layer.set_deepspeed_parallelism()
    return layer


def _inputs(rank, device):
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(T, M, device=device, generator=g).to(torch.bfloat16)
    gy = torch.randn(T, M, device=device, generator=g).to(torch.bfloat16)
    return x, gy


def _run(layer, x, gy):
    """Output, input gradient and every parameter gradient of one forward+backward."""
    for p in layer.parameters():
        p.grad = None
    xi = x.clone().requires_grad_(True)
    out, l_aux, _ = layer(xi)
    torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
    return [out.detach().clone(), xi.grad] + [None if p.grad is None else p.grad.clone() for p in layer.parameters()]


def _assert_same(base, got, what):
    assert len(base) == len(got)
    for i, (a, b) in enumerate(zip(base, got)):
        assert (a is None) == (b is None), f"{what}: tensor {i} has a gradient in one run only"
        assert a is None or torch.equal(a, b), f"{what}: tensor {i} differs from the sequential baseline's"


def _every_timed_plan_body(rank, world_size, gemm):
    from ds_uniep import gemm as uniep_gemm
    from ds_uniep.tuning import GPUInfo, Shape, Space, tune
    from ds_uniep.tuning.runner import layer_runner, runnable_gemms
    device = rank_gpu(rank)
    # "both": configured on torch's GEMM, the space walks the GEMMs the layer can run (torch's and
    # ds_uniep's), as a self-tuning layer's does; the baseline runs torch's
    configured = "torch" if gemm == "both" else gemm
    layer = _layer(rank, world_size, {"backend": "megakernel", "max_tokens_per_rank": T, "expert_gemm": configured,
                                      "overlap": {"timeout_s": 30.0}}, device)
    x, gy = _inputs(rank, device)
    shape = Shape(T=T, M=M, F=F, E=EXPERTS_PER_RANK * world_size, k=K, dtype="bf16", ep=world_size)
    gemms = runnable_gemms(configured, device, "bf16", layer.ep_group) if gemm == "both" else None
    assert gemms in (None, ("torch", "uniep")), gemms
    space = Space(shape, GPUInfo.detect(device), world_size, T, False, backend="megakernel", expert_gemm=configured,
                  gemms=gemms)
    # The plan the tuner takes for the untuned layer is the one it runs: the block leaves num_comm_sms
    # unset, so the sequential schedule's copy kernels take one block per SM.
    untuned = space.layer_default(layer.uniep_config)
    _run(layer, x, gy)
    assert layer._dispatchers[device].num_blocks == untuned.num_comm_sms == torch.cuda.get_device_properties(
        device).multi_processor_count, "Space.layer_default is not the plan the untuned layer runs"
    result = tune(space, layer_runner(layer, x.clone().requires_grad_(True)), budget_s=300.0, warmup=1, repeats=3,
                  group=layer.ep_group, progress=False, default_plan=untuned)
    timed = [r.plan for r in result.records if r.status in ("measured", "pruned")]
    assert not result.by_status("skipped"), "the budget cut the space short: not every plan was timed"
    assert len({p.num_comm_sms for p in timed}) >= 3, [p.label() for p in timed]
    assert all(p.dispatch_dtype == "activation" for p in timed)
    assert any(p.schedule == "fused" for p in timed) == (gemm != "torch"), [p.label() for p in timed]
    assert {p.expert_gemm for p in timed} == ({"torch", "uniep"} if gemm == "both" else {gemm})
    assert any(p.schedule == "pipelined" for p in timed), [p.label() for p in timed]
    # the combine's chunk counts and queue, where the combine kernels move the rows
    assert {(p.combine_chunks, p.combine_queue) for p in timed if p.schedule == "sequential"} == {
        (c, q) for c in (4, 8, 16) for q in (False, True)}, [p.label() for p in timed]
    if gemm != "torch":  # the fused schedule's two overlaps, each alone and both
        assert {(p.fused_dispatch, p.epilogue_combine) for p in timed if p.schedule == "fused"} == {
            (True, True), (True, False), (False, True)}, [p.label() for p in timed]
        assert {p.roles for p in timed if p.schedule == "fused"} == {"partitioned", "interleaved"}

    baseline = space.baseline()
    layer.set_plan(baseline)
    base = _run(layer, x, gy)
    d = layer._dispatchers[device]
    assert d.num_blocks == baseline.num_comm_sms
    odd = [baseline.replace(num_comm_sms=n) for n in (1, 7)]  # block counts outside the walked values
    if gemm != "torch":
        odd.append(baseline.replace(schedule="fused", num_comm_sms=6))
    for plan in timed + odd + [result.winner]:
        layer.set_plan(plan)
        fused_before, landed_before = d.fused_stats["fused"], d.combine_stats["landed"]
        piped_before, queued_before = d.combine_stats["pipelined"], d.combine_stats["queued"]
        uniep_before = sum(uniep_gemm.TILE_RUNS.values())
        got = _run(layer, x, gy)
        ran_uniep = sum(uniep_gemm.TILE_RUNS.values()) > uniep_before
        assert ran_uniep == (plan.expert_gemm == "uniep"), f"{plan.label()}: ds_uniep's GEMM ran: {ran_uniep}"
        piped = d.combine_stats["pipelined"] - piped_before
        assert piped == int(plan.schedule == "pipelined"), f"{plan.label()}: {piped} pipelined combines"
        assert (d.combine_chunks, d.combine_queue) == (plan.combine_chunks, plan.combine_queue), plan.label()
        # the forward's combine and the backward of its dispatch, when the queue is on and the combine
        # kernels move the rows (elsewhere the plan leaves the queue at its default, unread)
        queued = d.combine_stats["queued"] - queued_before
        assert queued == 2 * int(plan.combine_queue and plan.runs_combine_kernels()), \
            f"{plan.label()}: {queued} queued combines"
        if plan.schedule == "fused":
            if plan.fused_dispatch:
                assert d.fused_comm_blocks == (plan.num_comm_sms or FUSED_COMM_SMS), \
                    "the plan did not reach the fused dispatch"
                assert d.interleaved == (plan.roles == "interleaved"), "the plan's roles did not reach it"
            ran = (d.fused_stats["fused"] - fused_before, d.combine_stats["landed"] - landed_before)
            assert ran == (int(plan.fused_dispatch), int(plan.epilogue_combine)), f"{plan.label()} ran {ran}"
        else:
            assert d.num_blocks == plan.num_comm_sms, "the plan did not reach the kernels"
            assert d.fused_stats["fused"] == fused_before, f"{plan.label()} ran the fused dispatch"
        _assert_same(base, got, f"rank {rank}, plan {plan.label()}")


@needs_gpus(2)
@pytest.mark.parametrize("gemm", ["torch", "uniep", "both"])
def test_every_timed_plan_gives_the_sequential_baselines_numbers(gemm):
    """Every timed plan, the fused schedule's among them on ds_uniep's GEMM, gives the baseline's bits;
    "both": a space walking both GEMMs (the experts' GEMM is a knob), against the baseline on torch's."""
    run_distributed(_every_timed_plan_body, 2, gemm, backend="nccl")


def _self_tuning_body(rank, world_size, cache_dir):
    device = rank_gpu(rank)
    x, gy = _inputs(rank, device)
    common = {"backend": "megakernel", "max_tokens_per_rank": T}
    plain = _layer(rank, world_size, {**common, "overlap": {"schedule": "sequential", "num_comm_sms": 16,
                                                            "timeout_s": 30.0}}, device)
    base = _run(plain, x, gy)
    # the combine's chunks and queue from the block reach the dispatcher the layer builds (the queue is
    # the default: the plain layer's combines were queued)
    assert plain._dispatchers[device].combine_stats["queued"] == 2, plain._dispatchers[device].combine_stats
    shares = _layer(rank, world_size, {**common, "overlap": {"schedule": "sequential", "combine_chunks": 4,
                                                             "combine_queue": False, "timeout_s": 30.0}}, device)
    _assert_same(base, _run(shares, x, gy), f"rank {rank}: combine_chunks 4 in fixed shares from the block")
    d = shares._dispatchers[device]
    assert (d.combine_chunks, d.combine_queue, d.combine_stats["queued"]) == (4, False, 0), d.combine_stats
    tuned_cfg = {**common, "overlap": {"timeout_s": 30.0},
                 "autotune": {"enabled": True, "cache_dir": cache_dir, "budget_s": 60.0, "warmup": 1, "repeats": 3}}
    key = (T, torch.bfloat16, device)
    for attempt in ("tunes", "reads the cache"):
        layer = _layer(rank, world_size, tuned_cfg, device)
        got = _run(layer, x, gy)
        result = layer.autotune_results[key]
        assert result.from_cache == (attempt == "reads the cache"), attempt
        if not result.from_cache:
            assert len(result.by_status("measured")) >= 2, result.table()
            # its space walks the experts' GEMM: torch's (configured) and ds_uniep's, which runs here
            assert {r.plan.expert_gemm for r in result.records} == {"torch", "uniep"}, result.table()
        w, d = result.winner, layer._dispatchers[device]
        assert layer.uniep_config.expert_gemm == w.expert_gemm, (w.label(), layer.uniep_config.expert_gemm)
        if w.schedule != "fused":
            assert d.num_blocks == w.num_comm_sms, w.label()
        elif w.fused_dispatch:
            assert d.fused_comm_blocks == (w.num_comm_sms or FUSED_COMM_SMS), w.label()
        _assert_same(base, got, f"rank {rank}: a layer that {attempt}")


@needs_gpus(2)
def test_a_layer_tuning_itself_keeps_the_numbers_and_caches_the_plan(tmp_path):
    run_distributed(_self_tuning_body, 2, str(tmp_path / "cache"), backend="nccl")
