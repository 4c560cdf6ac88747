"""The tuning space, the tuner (cache, pruning, rank agreement) and the tune CLI, on CPU."""
import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings

import pytest

from dist_utils import run_distributed
from ds_uniep.config import UniEPConfig, UniEPConfigError
from ds_uniep.tuning import GPUInfo, Plan, PlanCacheWarning, Shape, Space, cache_key, cache_path, tune
from ds_uniep.tuning import tune_from_config
from ds_uniep.tuning.presets import preset_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = GPUInfo("test-gpu", 132, 227 * 1024)
SHAPE = Shape(T=4096, M=1024, F=2048, E=8, k=2, ep=2)  # 2048 rows per expert


def small_space(**kw):
    """Four valid plans: sequential (the baseline), pipelined x2, fused (tiles unset, as the baseline's)."""
    values = dict(schedule=("sequential", "pipelined", "fused"), num_chunks=(2, 4), num_comm_sms=(16,),
                  roles=("partitioned",), tile_m=(None,), tile_n=(None,), signal_granularity=("tile",),
                  dispatch_dtype=("activation",), fused_dispatch=(True,), epilogue_combine=(True,))
    values.update(kw.pop("values", {}))
    return Space(SHAPE, GPU, 2, 8192, False, values=values, **kw)


# ---------------------------------------------------------------------- space
def test_pipelined_on_the_uniep_gemm_leaves_the_gemm_the_other_sms():
    """With ds_uniep's GEMM (the plan's expert_gemm) the pipelined schedule's copies hold num_comm_sms SMs
    beside the GEMMs: the SM budget applies, and the cost model gives the GEMM the rest and prices the
    copies as SM stores; with torch's GEMM it does neither (the copy engines move the rows)."""
    from ds_uniep.tuning import estimate_ms
    space = Space(SHAPE, GPU, 2, 8192, False)
    on_uniep, on_torch = (Plan(schedule="pipelined", num_chunks=2, num_comm_sms=96, expert_gemm=g)
                          for g in ("uniep", "torch"))
    assert "SM budget exceeded: the GEMM is left 36 of 132" in (space.check(on_uniep) or "")
    assert space.check(on_torch) is None
    # 32 and 64 SMs both saturate the peer stores: only the GEMM's share of the SMs differs.
    for gemm in ("uniep", "torch"):
        fewer, more = (Plan(schedule="pipelined", num_chunks=2, num_comm_sms=n, expert_gemm=gemm) for n in (32, 64))
        if gemm == "uniep":
            assert estimate_ms(more, space) > estimate_ms(fewer, space)
        else:
            assert estimate_ms(more, space) == estimate_ms(fewer, space)
    # Many small (expert, source) segments and little GEMM work: the copy engines pay per segment,
    # the SM stores only by the bytes.
    many = Space(Shape(T=64, M=1024, F=64, E=64, k=2, ep=4), GPU, 4, 8192, False)
    sm_copies, ce_copies = (estimate_ms(Plan(schedule="pipelined", num_chunks=2, num_comm_sms=32, expert_gemm=g),
                                        many) for g in ("uniep", "torch"))
    assert sm_copies < 0.5 * ce_copies, (sm_copies, ce_copies)
    uniep = Space.from_config({"expert_gemm": "uniep"}, SHAPE, GPU)
    assert uniep.expert_gemm == "uniep" and uniep.gemms == ("uniep", )
    assert uniep.for_backend("megakernel").expert_gemm == "uniep"


def test_the_megakernel_space_walks_the_gemms_the_layer_runs(tmp_path):
    """expert_gemm is a knob of the megakernel's space: walked over Space.gemms (the GEMMs the layer can
    run; default the configured one), the fused schedule only on ds_uniep's, the baseline on the
    configured one, and Plan.apply sets the config's expert_gemm."""
    from ds_uniep.config import UniEPConfig
    one = Space(SHAPE, GPU, 2, 8192, False, backend="megakernel")
    both = Space(SHAPE, GPU, 2, 8192, False, backend="megakernel", gemms=("torch", "uniep"))
    assert {p.expert_gemm for p in one.enumerate()} == {"torch"}
    assert "fused" not in {p.schedule for p in one.enumerate()}
    plans = both.enumerate()
    assert {p.expert_gemm for p in plans} == {"torch", "uniep"}
    assert all(p.expert_gemm == "uniep" for p in plans if p.schedule == "fused")
    # Every plan of the one-GEMM space is in the other, and on ds_uniep's GEMM too, but for the pipelined
    # plans whose copies would leave it under half the SMs.
    on_uniep = {p.replace(expert_gemm="uniep") for p in one.enumerate()}
    assert set(one.enumerate()) <= set(plans)
    assert {p for p in on_uniep if both.check(p) is None} <= set(plans)
    assert {p.schedule for p in on_uniep if both.check(p)} == {"pipelined"}
    assert both.baseline().expert_gemm == "torch" and both.baseline() in plans
    assert "is not a GEMM this layer runs here (torch)" in one.check(Plan(schedule="sequential", expert_gemm="uniep"))
    # The fused schedule carries ds_uniep's GEMM, whatever it is given.
    assert Plan(schedule="fused", expert_gemm="torch").expert_gemm == "uniep"
    with pytest.raises(ValueError, match="expert_gemm: must be one of torch, uniep"):
        Plan(expert_gemm="cublas")
    with pytest.raises(ValueError, match="not among gemms"):
        Space(SHAPE, GPU, 2, 8192, False, backend="megakernel", expert_gemm="uniep", gemms=("torch", ))
    # Rows in fp32 do not run as grouped GEMMs: only the configured GEMM is walked.
    fp32 = Space(Shape(T=512, M=1024, F=512, E=8, k=2, dtype="fp32", ep=2), GPU, backend="megakernel",
                 gemms=("torch", "uniep"))
    assert fp32.gemms == ("torch", ) and {p.expert_gemm for p in fp32.enumerate()} == {"torch"}
    # ... and a layer configured on ds_uniep's GEMM keeps every plan there (its experts run one by one in
    # fp32, whatever the GEMM knob says): the baseline stays valid
    fp32_u = Space(fp32.shape, GPU, backend="megakernel", expert_gemm="uniep", gemms=("torch", "uniep"))
    assert fp32_u.gemms == ("uniep", ) and fp32_u.baseline() in fp32_u.enumerate()
    assert {p.schedule for p in fp32_u.enumerate()} == {"sequential", "pipelined"}
    cfg = UniEPConfig.coerce({"overlap": {"schedule": "sequential"}})
    on_uniep = Plan(schedule="sequential", expert_gemm="uniep").apply(cfg)
    assert on_uniep.expert_gemm == "uniep" and Plan.from_config(on_uniep).expert_gemm == "uniep"
    assert Plan(schedule="sequential").apply(on_uniep).expert_gemm == "torch"
    assert Plan(schedule="sequential", expert_gemm="uniep").label().endswith(" uniep")
    from ds_uniep.tuning import estimate_ms
    from ds_uniep.tuning.plot import plot_space
    png = plot_space(str(tmp_path / "both.png"), both, {p: estimate_ms(p, both) for p in plans}, measured=False,
                     title="both GEMMs")
    assert (tmp_path / "both.png").stat().st_size > 0 and png.endswith("both.png")


def test_each_rejection_reason_is_hit_by_a_plan():
    space = Space(SHAPE, GPU, 2, max_tokens_per_rank=8192, allow_numerics_change=False)
    cases = {
        "SM budget exceeded: num_comm_sms=132 >= 132": Plan(schedule="fused", roles="partitioned", num_comm_sms=132),
        "SM budget exceeded: the GEMM is left 62 of 132": Plan(schedule="fused", roles="partitioned", num_comm_sms=70),
        "pipelined with 1 chunk": Plan(schedule="pipelined", num_chunks=1),
        "numerics change not allowed": Plan(dispatch_dtype="fp8_e4m3"),
    }
    for reason, plan in cases.items():
        got = space.check(plan)
        assert got is not None and reason in got, (plan, got)
    # 19 tokens, k=1, 64 experts: 1 row per expert, rounded up to 64 rows.
    tiny = Space(Shape(T=19, M=64, F=64, E=64, k=1), GPU)
    assert "tile larger than the rows: tile_m=128 > 64 rows" in tiny.check(Plan(tile_m=128))
    assert tiny.check(Plan(tile_m=64)) is None
    assert tiny.check(Plan()) is None  # tiles unset: the GEMM picks them
    big = Space(Shape(T=9000, M=64, F=64, E=8, k=2), GPU, max_tokens_per_rank=8192)
    assert "symmetric buffer too small: T=9000" in big.check(big.baseline())
    # Interleaved roles keep every SM for the GEMM; the sequential schedule never overlaps, and roles
    # outside the fused dispatch (the config's default, interleaved, under the sequential schedule)
    # are the partitioned ones: nothing reads them there.
    assert space.check(Plan(schedule="fused", roles="interleaved", num_comm_sms=70)) is None
    assert Plan(schedule="pipelined", num_chunks=2, roles="interleaved") == Plan(schedule="pipelined", num_chunks=2)
    assert Plan.from_config(UniEPConfig()).roles == "partitioned" and UniEPConfig().overlap.roles == "interleaved"
    assert UniEPConfig.coerce({"overlap": {"schedule": "fused"}}).knobs().roles == "interleaved"
    assert space.check(Plan(schedule="sequential", num_comm_sms=70)) is None
    # The default plan of the config is valid at docs/performance.md shapes.
    assert space.check(Plan.from_config(UniEPConfig())) is None


def test_sequential_baseline_always_valid_and_enumeration_only_valid():
    shapes = [SHAPE, Shape(1, 64, 64, 64, 1), Shape(19, 64, 128, 8, 8, dtype="fp32"), Shape(111, 32, 32, 2, 2, ep=2),
              preset_shape("mixtral-like", 4), preset_shape("dsv2lite-like", 8), preset_shape("dsv3-like", 8)]
    gpus = [GPU, GPUInfo("small", 16, 96 * 1024), GPUInfo("tiny", 2, 64 * 1024)]
    for shape in shapes:
        for gpu in gpus:
            for allow in (False, True):
                space = Space(shape, gpu, shape.ep, 8192, allow, values=dict(num_comm_sms=(1, 8, 16)))
                base = space.baseline()
                assert base.schedule == "sequential" and space.check(base) is None, (shape, gpu)
                plans = space.enumerate()
                assert len(plans) == len(set(plans))
                assert all(space.check(p) is None for p in plans)
                assert any(p.dispatch_dtype == "fp8_e4m3" for p in plans) == allow


def test_backend_space_walks_only_the_knobs_the_backend_acts_on():
    from ds_uniep.tuning.space import ACTING_KNOBS, comm_sms_values
    h200 = GPUInfo.preset("h200")
    shape = preset_shape("mixtral-like", 4)
    design = Space(shape, h200, 4)
    mk = design.for_backend("megakernel")
    assert mk.acting_knobs() == ACTING_KNOBS["megakernel"] == ("schedule", "num_chunks", "num_comm_sms", "roles",
                                                               "dispatch_dtype", "fused_dispatch", "epilogue_combine",
                                                               "combine_chunks", "combine_queue", "expert_gemm")
    assert mk.fixed_knobs() == dict(tile_m=None, tile_n=None, signal_granularity="tile")
    plans = mk.enumerate()
    seq = [p for p in plans if p.schedule == "sequential"]
    pipe = [p for p in plans if p.schedule == "pipelined"]
    assert len(seq) + len(pipe) == len(plans)  # never the fused schedule on torch's grouped GEMM
    # Every SM count up to the whole GPU (the sequential copy kernels run alone), exact dispatch only,
    # each with the combine in 4, 8 and 16 chunks, pushed in fixed shares or from one queue.
    assert sorted((p.num_comm_sms, p.combine_chunks, p.combine_queue) for p in seq) == [
        (n, c, q) for n in (8, 16, 24, 32, 48, 64, 80, 96, 132) for c in (4, 8, 16) for q in (False, True)]
    # The pipelined schedule copies its chunks back by itself: the combine knobs are unread there, and
    # left at the config's defaults.
    assert all((p.combine_chunks, p.combine_queue) == (16, True) for p in pipe)
    # Pipelined: 2 chunks (4 would be more than the 2 local experts: rejected), every SM count but the
    # whole GPU (its copy kernels share the GPU).
    assert sorted((p.num_chunks, p.num_comm_sms) for p in pipe) == [(2, n) for n in (8, 16, 24, 32, 48, 64, 80, 96)]
    four = [r for p, r in mk.table() if p.schedule == "pipelined" and p.num_chunks == 4]
    assert four and all("more chunks than local experts: num_chunks=4 > E/ep=2" in r for r in four), four
    assert all(p.dispatch_dtype == "activation" and p.replace(num_comm_sms=16, schedule="sequential", num_chunks=1,
                                                              combine_chunks=16, combine_queue=True)
               == mk.baseline() for p in plans)
    # the FP8 plans are rejected (roles outside the fused schedule are the partitioned ones) ...
    assert mk.baseline() in plans and len(mk.table()) == 2 * (9 * 6 + 2 * 9)
    assert all(p.roles == "partitioned" for p in plans)
    assert all("numerics change not allowed" in r or "SM budget" in r or "more chunks than local experts" in r
               for _, r in mk.table() if r)
    allowed = Space(shape, h200, 4, allow_numerics_change=True, backend="megakernel")
    assert len(allowed.enumerate()) == 2 * len(plans)  # ... unless numerics may change
    # Capped by the GPU's SM count; FP8 rows need M divisible by 128 on the megakernel only.
    assert comm_sms_values(114) == (8, 16, 24, 32, 48, 64, 80, 96, 114) and comm_sms_values(20) == (8, 16, 20)
    odd = Shape(T=64, M=96, F=64, E=4, k=2)
    small = Space(odd, GPUInfo("small", 20, 96 * 1024), allow_numerics_change=True, backend="megakernel")
    assert sorted({(p.num_comm_sms, p.dispatch_dtype) for p in small.enumerate() if p.schedule == "sequential"}) == [
        (8, "activation"), (16, "activation"), (20, "activation")]
    assert "FP8 rows need the hidden size divisible by 128: M=96" in small.check(small.baseline().replace(
        dispatch_dtype="fp8_e4m3"))
    ref = Space(odd, GPUInfo("small", 20, 96 * 1024), allow_numerics_change=True, backend="reference")
    assert [p.dispatch_dtype for p in ref.enumerate()] == ["activation", "fp8_e4m3"]
    # Projection: the configured plan runs as the space's point with the same acting knobs (the fused
    # schedule, not built, as the sequential one).
    assert mk.project(Plan(schedule="fused", roles="partitioned", num_comm_sms=20, tile_m=256)) == \
        mk.baseline().replace(num_comm_sms=20)
    assert mk.project(Plan(schedule="pipelined", num_chunks=4, num_comm_sms=20, tile_m=256)) == mk.baseline().replace(
        schedule="pipelined", num_chunks=4, num_comm_sms=20)
    assert design.project(Plan(tile_m=256)) == Plan(tile_m=256)
    # On ds_uniep's grouped GEMM in bf16 the fused schedule is a point too: its dispatch keeps
    # num_comm_sms SMs beside the first GEMM, which keeps at least half of them; activation rows only.
    own = Space(shape, h200, 4, backend="megakernel", expert_gemm="uniep", allow_numerics_change=True)
    # Its two overlaps are knobs too: with the fused dispatch, every SM count with and without the
    # epilogue combine in partitioned roles, and interleaved roles (num_comm_sms unread, normalised to
    # None); without it (num_comm_sms unread again) the epilogue combine alone; never neither (that is
    # the sequential schedule).
    # Without the epilogues the combine kernels move the rows: each plan with every combine chunk count
    # and queue choice.
    fused = [p for p in own.enumerate() if p.schedule == "fused"]
    combines = [(c, q) for c in (4, 8, 16) for q in (False, True)]
    assert sorted((p.fused_dispatch, p.epilogue_combine, p.roles, p.num_comm_sms, p.combine_chunks, p.combine_queue)
                  for p in fused) == [(False, True, "partitioned", None, 16, True)] + [
        (True, e, r, n, *cq) for e in (False, True) for r, ns in (("interleaved", (None, )),
                                                                  ("partitioned", (8, 16, 24, 32, 48, 64)))
        for n in ns for cq in (combines if not e else [(16, True)])]
    assert Plan(schedule="fused", roles="interleaved", num_comm_sms=8) == Plan(schedule="fused", roles="interleaved")
    assert not own.comm_shares_sms(Plan(schedule="fused", roles="interleaved"))
    assert all(p.dispatch_dtype == "activation" for p in fused)
    assert "neither its dispatch nor its combine" in own.check(Plan(schedule="fused", fused_dispatch=False,
                                                                    epilogue_combine=False))
    assert Plan(schedule="fused", fused_dispatch=False, num_comm_sms=8, roles="interleaved") == Plan(
        schedule="fused", fused_dispatch=False)
    assert Plan(schedule="pipelined", num_chunks=2, fused_dispatch=False) == Plan(schedule="pipelined", num_chunks=2)
    with pytest.raises(ValueError, match="epilogue_combine"):
        Plan(epilogue_combine=1)
    assert not own.comm_shares_sms(Plan(schedule="fused", fused_dispatch=False))
    assert "the fused schedule moves activation rows" in own.check(fused[0].replace(dispatch_dtype="fp8_e4m3"))
    assert own.project(Plan(schedule="fused", roles="partitioned", num_comm_sms=20, tile_m=256)) == \
        own.baseline().replace(schedule="fused", num_comm_sms=20)
    # A fused plan in interleaved roles where the fused schedule is not built runs the sequential one
    # (its copy kernels on every SM).
    assert mk.project(Plan(schedule="fused", roles="interleaved")) == mk.baseline().replace(num_comm_sms=None)
    # A fused dispatch in partitioned roles left unset takes FUSED_COMM_SMS SMs.
    assert Plan(schedule="fused", roles="partitioned").num_comm_sms == 20
    assert "needs ds_uniep's grouped GEMM" in mk.check(mk.baseline().replace(schedule="fused"))
    fp16 = Space(dataclasses.replace(shape, dtype="fp16"), h200, 4, backend="megakernel", expert_gemm="uniep")
    assert "fused" not in {p.schedule for p in fp16.enumerate()}
    # The reference backend has no symmetric buffer: max_tokens_per_rank does not bind it.
    big = Shape(T=9000, M=64, F=64, E=8, k=2)
    assert Space(big, GPU, backend="reference").enumerate() and not Space(big, GPU, backend="megakernel").enumerate()
    # The sequential schedule may give the copy kernels every SM; an overlapping one may not.
    assert design.check(Plan(schedule="sequential", num_comm_sms=132)) is None
    assert "SM budget exceeded" in Space(shape, GPUInfo("g", 100, 227 * 1024), 4).check(
        Plan(schedule="sequential", num_comm_sms=101))
    with pytest.raises(ValueError, match="backend must be None or one of"):
        Space(shape, h200, backend="nccl")


def test_configured_fp8_is_kept_without_allow_numerics_change(tmp_path):
    cfg = UniEPConfig.from_dict({"compression": {"dispatch_dtype": "fp8_e4m3"},
                                 "autotune": {"cache_dir": str(tmp_path), "warmup": 0, "repeats": 2}})
    space = Space.from_config(cfg, SHAPE, GPU, backend="megakernel")
    assert {p.dispatch_dtype for p in space.enumerate()} == {"fp8_e4m3"}
    assert space.baseline().dispatch_dtype == "fp8_e4m3"
    assert "changes the numbers of the configured fp8_e4m3" in space.check(space.baseline().replace(
        dispatch_dtype="activation"))
    calls = []
    r = tune_from_config(cfg, SHAPE, _fake_runner({}, calls), gpu=GPU, progress=False, values=dict(num_comm_sms=(16,)))
    assert r.winner.dispatch_dtype == "fp8_e4m3" and {p.dispatch_dtype for p in calls} == {"fp8_e4m3"}


def test_plan_forms_normalisation_and_config_round_trip():
    p = Plan(schedule="fused", num_chunks=1, signal_granularity="expert", dispatch_dtype="fp8_e4m3")
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert Plan(schedule="fused", num_chunks=1).key() == Plan(schedule="fused").key()
    # Knobs a schedule ignores are normalised, so equal work has one key.
    assert Plan(schedule="sequential", signal_granularity="rank") == Plan(schedule="sequential")
    assert Plan.from_config(UniEPConfig()).num_chunks == 1
    cfg = UniEPConfig.from_dict({"overlap": {"schedule": "pipelined", "num_chunks": 4, "tile_m": 64,
                                             "timeout_s": 7.0}, "compression": {"dispatch_dtype": "fp8_e4m3"}})
    plan = Plan.from_config(cfg)
    assert (plan.schedule, plan.num_chunks, plan.tile_m, plan.dispatch_dtype) == ("pipelined", 4, 64, "fp8_e4m3")
    applied = Plan(schedule="fused").apply(cfg)
    assert applied.overlap.timeout_s == 7.0 and applied.overlap.schedule == "fused"
    # the config's tile sizes stay: tile_m set (64), tile_n unset
    assert applied.compression.dispatch_dtype == "activation" and Plan.from_config(applied) == Plan(
        schedule="fused", tile_m=64)
    assert applied.knobs() == Plan.from_config(applied) and applied.knobs().gemm_tiles() == (64, 128)
    assert "tile_n" not in applied.overlap.model_fields_set
    # and so does its signal granularity (read by the fused dispatch, not walked): set, or left unset
    assert "signal_granularity" not in applied.overlap.model_fields_set
    expert = UniEPConfig.from_dict({"overlap": {"schedule": "fused", "signal_granularity": "expert"}})
    for p2 in (Plan(schedule="fused"), Plan(schedule="fused", signal_granularity="rank")):
        assert p2.apply(expert).overlap.signal_granularity == "expert"
    assert Plan(schedule="sequential").apply(expert).overlap.signal_granularity == "tile"  # nothing reads it there
    assert plan.apply(UniEPConfig()).overlap.num_chunks == 4
    assert UniEPConfig().knobs(schedule="pipelined").num_chunks == 2  # the block's default chunks
    with pytest.raises(ValueError, match="tile_m"):
        Plan(tile_m=96)
    with pytest.raises(ValueError, match="exactly the keys"):
        Plan.from_dict({"schedule": "fused"})


def test_combine_knobs_reach_plans_only_where_the_combine_kernels_move_the_rows():
    """combine_chunks and combine_queue: read from the block, kept where the combine kernels run
    (sequential; fused without its epilogues), normalised away elsewhere, and the queue without
    chunks is no queue."""
    cfg = UniEPConfig.from_dict({"overlap": {"combine_chunks": 4, "combine_queue": True}})
    assert (cfg.overlap.combine_chunks, cfg.overlap.combine_queue) == (4, True)
    assert (UniEPConfig().overlap.combine_chunks, UniEPConfig().overlap.combine_queue) == (16, True)
    assert Plan.from_config(UniEPConfig()).label().endswith(" c16q")  # the default: sequential, queued
    plan = Plan.from_config(cfg.model_copy(update={"overlap": cfg.overlap.model_copy(
        update={"schedule": "sequential"})}))
    assert (plan.combine_chunks, plan.combine_queue) == (4, True) and plan.label().endswith(" c4q")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    applied = plan.apply(UniEPConfig())
    assert (applied.overlap.combine_chunks, applied.overlap.combine_queue) == (4, True)
    kept = dict(combine_chunks=4, combine_queue=True)
    assert Plan(schedule="fused", epilogue_combine=False, **kept).combine_queue  # the combine kernels run
    for gone in (Plan(schedule="fused", **kept), Plan(schedule="pipelined", num_chunks=2, **kept)):
        assert (gone.combine_chunks, gone.combine_queue) == (16, True) and " c" not in gone.label(), gone
        # applied to a block, they leave the combine knobs where a block that never set them has them
        applied_gone = gone.apply(UniEPConfig()).overlap
        assert (applied_gone.combine_chunks, applied_gone.combine_queue) == (16, True), gone
    assert Plan(schedule="sequential", combine_chunks=0, combine_queue=True) == Plan(schedule="sequential",
                                                                                      combine_chunks=0)
    for bad, match in (({"combine_chunks": 65}, "uniep.overlap.combine_chunks"),
                       ({"combine_chunks": -1}, "uniep.overlap.combine_chunks"),
                       ({"combine_queue": "yes"}, "uniep.overlap.combine_queue")):
        with pytest.raises(UniEPConfigError, match=match):
            UniEPConfig.from_dict({"overlap": bad})
    for bad in (dict(combine_chunks=65), dict(combine_queue=1), dict(combine_chunks=True)):
        with pytest.raises(ValueError, match="combine_"):
            Plan(**bad)


# ---------------------------------------------------------------------- cache keys
def test_cache_key_changes_with_every_field():
    base = cache_key(SHAPE, GPU)
    variants = [cache_key(Shape(T=4097, M=1024, F=2048, E=8, k=2, ep=2), GPU),
                cache_key(Shape(T=4096, M=2048, F=2048, E=8, k=2, ep=2), GPU),
                cache_key(Shape(T=4096, M=1024, F=1024, E=8, k=2, ep=2), GPU),
                cache_key(Shape(T=4096, M=1024, F=2048, E=16, k=2, ep=2), GPU),
                cache_key(Shape(T=4096, M=1024, F=2048, E=8, k=1, ep=2), GPU),
                cache_key(Shape(T=4096, M=1024, F=2048, E=8, k=2, ep=2, dtype="fp16"), GPU),
                cache_key(Shape(T=4096, M=1024, F=2048, E=8, k=2, ep=4), GPU),
                cache_key(SHAPE, GPUInfo("other-gpu", 132, 227 * 1024)),
                cache_key(SHAPE, GPU, backend="reference")]
    assert all(v != base for v in variants)
    paths = {cache_path("/c", k) for k in [base] + variants}
    assert len(paths) == 1 + len(variants)
    # The version is in the key but not the file name: an upgrade finds the old file and calls it stale.
    old = cache_key(SHAPE, GPU, version="0.0.1")
    assert old != base and cache_path("/c", old) == cache_path("/c", base)


def _fake_runner(ms_by_plan, calls, default_ms=2.0):
    def run_plan(plan):
        calls.append(plan)
        time.sleep(ms_by_plan.get(plan, default_ms) / 1e3)
    return run_plan


def _tune(space, run_plan, tmp_path=None, **kw):
    kw.setdefault("budget_s", 30.0)
    return tune(space, run_plan, warmup=kw.pop("warmup", 0), repeats=kw.pop("repeats", 3), progress=False,
                cache_dir=None if tmp_path is None else str(tmp_path), **kw)


def test_cache_hit_does_not_run_plans(tmp_path):
    space = small_space()
    calls = []
    first = _tune(space, _fake_runner({}, calls), tmp_path)
    assert calls and not first.from_cache and os.path.exists(first.cache_file)
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hit = _tune(space, _fake_runner({}, calls), tmp_path)
    assert calls == [] and hit.from_cache and hit.winner == first.winner
    assert hit.best_ms == first.best_ms and hit.cache_file == first.cache_file
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # the atomic write left no temp file


@pytest.mark.parametrize("content, why", [
    ("{not json", "corrupt: not readable JSON"),
    (json.dumps({"schema": 99, "plan": {}}), "corrupt: wrong schema"),
    (json.dumps([1, 2, 3]), "corrupt: wrong schema"),
    ("INVALID_PLAN", "stale: the cached plan"),
    ("OLD_VERSION", "stale: written for another key (version: '0.0.1' (cache)"),
    ("BAD_TILE", "corrupt: wrong schema (bad plan"),
    ("OLD_KNOBS", "stale: its plan has another version's knobs (missing: combine_chunks, combine_queue)"),
    ("OLD_STAGES", "stale: its plan has another version's knobs (unknown: stages)"),
])
def test_stale_or_corrupt_cache_is_ignored_and_rewritten(tmp_path, content, why):
    space = small_space()
    calls = []
    good = _tune(space, _fake_runner({}, calls), tmp_path)
    path = good.cache_file
    entry = json.load(open(path))
    if content == "INVALID_PLAN":
        entry["plan"] = Plan(schedule="fused", roles="partitioned", num_comm_sms=132).to_dict()  # every SM
        content = json.dumps(entry)
    elif content == "OLD_VERSION":
        entry["key"]["version"] = "0.0.1"
        content = json.dumps(entry)
    elif content == "BAD_TILE":
        entry["plan"]["tile_m"] = 96
        content = json.dumps(entry)
    elif content == "OLD_KNOBS":  # a plan written before the combine's knobs joined the space
        del entry["plan"]["combine_chunks"], entry["plan"]["combine_queue"]
        content = json.dumps(entry)
    elif content == "OLD_STAGES":  # a plan written while the space had a stage knob
        entry["plan"]["stages"] = 4
        content = json.dumps(entry)
    with open(path, "w") as f:
        f.write(content)
    calls.clear()
    with pytest.warns(PlanCacheWarning) as rec:
        again = _tune(space, _fake_runner({}, calls), tmp_path)
    msg = str(rec[0].message)
    assert path in msg and why in msg, msg
    assert calls and not again.from_cache  # re-tuned ...
    reread = json.load(open(path))  # ... and rewritten with a trustworthy entry
    assert reread["key"] == cache_key(space.shape, space.gpu) and Plan.from_dict(reread["plan"]) == again.winner


def test_cached_plan_from_another_space_is_stale(tmp_path):
    calls = []
    _tune(small_space(), _fake_runner({}, calls), tmp_path)
    wider = small_space(values=dict(num_comm_sms=(16, 32)))
    with pytest.warns(PlanCacheWarning, match="the tuning space changed"):
        _tune(wider, _fake_runner({}, calls), tmp_path)


# ---------------------------------------------------------------------- measuring
def test_early_stopping_prunes_a_slow_plan_and_picks_the_fastest():
    space = small_space()
    seq, pipe2, pipe4, fused = (Plan("sequential", 1, 16), Plan("pipelined", 2, 16), Plan("pipelined", 4, 16),
                                Plan("fused", 1, 16, "partitioned"))
    assert set(space.enumerate()) == {seq, pipe2, pipe4, fused}
    ms = {seq: 4.0, pipe2: 40.0, pipe4: 3.0, fused: 1.5}
    calls = []
    r = _tune(space, _fake_runner(ms, calls), warmup=1, repeats=8, default_plan=seq, cost_model=lambda p, s: 0.0)
    slow = next(x for x in r.records if x.plan == pipe2)
    assert slow.status == "pruned" and "> 1.5 x best" in slow.reason
    assert calls.count(pipe2) == 1 + 3  # warm-up + probe runs only
    assert calls.count(fused) == 1 + 8
    assert r.winner == fused and r.default_ms == pytest.approx(4.0, abs=2.0)
    assert r.speedup is not None and r.speedup > 1.5
    assert "fused" in r.table() and "speedup" in r.summary()
    # A fast configured plan does not get the sequential baseline pruned: both are always timed whole.
    calls.clear()
    r = _tune(space, _fake_runner(ms, calls), warmup=1, repeats=8, default_plan=fused, cost_model=lambda p, s: 0.0)
    base = next(x for x in r.records if x.plan == seq)
    assert space.baseline() == seq and base.status == "measured" and calls.count(seq) == 1 + 8
    assert r.baseline_ms == pytest.approx(4.0, abs=2.0)


def test_confirmation_keeps_a_plan_that_timed_fast_once_by_chance_from_winning():
    """The search's fastest plan was fast only while it was first timed (a chance fast batch); the
    finalists (the fastest two and the default) take turns again and the truly fastest one wins."""
    space = small_space()
    seq, pipe2, pipe4, fused = (Plan("sequential", 1, 16), Plan("pipelined", 2, 16), Plan("pipelined", 4, 16),
                                Plan("fused", 1, 16, "partitioned"))
    ms = {seq: 6.0, pipe2: 30.0, pipe4: 3.0, fused: 4.0}
    calls = []
    lucky = {"runs": 0}

    def run_plan(plan):
        calls.append(plan)
        if plan == fused:  # its first 4 runs (warm-up and the search's timed runs) are quick, later ones not
            lucky["runs"] += 1
            time.sleep((1.0 if lucky["runs"] <= 4 else 4.0) / 1e3)
            return
        time.sleep(ms[plan] / 1e3)

    kw = dict(warmup=1, repeats=3, default_plan=seq, cost_model=lambda p, s: 0.0)
    r = _tune(space, run_plan, confirm_top=2, confirm_rounds=3, **kw)
    rec = {x.plan: x for x in r.records}
    assert rec[fused].median_ms < rec[pipe4].median_ms  # the search alone would pick it
    assert [x.plan for x in r.records if x.confirmed_ms is not None] == [seq, pipe4, fused]  # + the default
    assert rec[pipe2].confirmed_ms is None
    assert r.winner == pipe4 and r.best_ms == rec[pipe4].confirmed_ms
    assert rec[fused].confirmed_ms > rec[pipe4].confirmed_ms
    assert r.default_ms == rec[seq].confirmed_ms and r.speedup > 1.4
    # every finalist ran warm-up + repeats in each of the 3 rounds, beyond its search runs
    assert calls.count(pipe4) == (1 + 3) + 3 * (1 + 3) and calls.count(pipe2) == 1 + 3
    assert "confirmed" in r.table() and r.best()[0].plan == pipe4
    # without confirmation the chance fast batch wins
    assert _tune(space, _fake_runner({**ms, fused: 1.0}, []), confirm_top=0, **kw).winner == fused
    with pytest.raises(ValueError, match="confirm_rounds"):
        _tune(space, run_plan, confirm_top=2, confirm_rounds=0, **kw)


def test_a_space_with_no_valid_plan_says_why():
    # FP8 configured (no numerics change allowed) at a hidden size FP8 rows cannot take: nothing runs.
    space = Space(Shape(T=64, M=96, F=128, E=4, k=2, dtype="bf16", ep=2), GPUInfo.preset("h200"), 2, 64, False,
                  backend="megakernel", dispatch_dtype="fp8_e4m3")
    assert not space.enumerate()
    with pytest.raises(ValueError, match=r"tune: no valid plan for .* FP8 rows need the hidden size divisible by 128"):
        _tune(space, lambda p: None)


def test_tie_goes_to_the_earlier_plan_and_budget_skips(monkeypatch):
    from ds_uniep.tuning import tuner
    space = small_space()
    order = space.enumerate()
    with monkeypatch.context() as m:
        m.setattr(tuner._Timer, "run", lambda self, fn, n: [fn() or 1.0 for _ in range(n)])
        # Measured last-first by the cost model; every median is exactly 1.0 ms.
        r = _tune(space, lambda p: None, default_plan=order[-1], cost_model=lambda p, s: -order.index(p))
    assert [x.status for x in r.records] == ["measured"] * 4
    assert r.winner == order[0] and r.best_ms == 1.0
    # The budget counts from the end of the two mandatory plans: the first plan after them starts
    # within it (and, started, is finished); the last one is skipped.
    r2 = _tune(space, lambda p: time.sleep(0.002), budget_s=1e-9, default_plan=order[-1])
    statuses = {x.plan: x.status for x in r2.records}
    assert statuses[order[-1]] == "measured" and statuses[space.baseline()] == "measured"
    assert list(statuses.values()).count("skipped") == 1 and list(statuses.values()).count("measured") == 3
    # ... and mandatory plans that take longer than the budget do not use it up
    r3 = _tune(space, lambda p: time.sleep(0.05 if p in (order[-1], space.baseline()) else 0.001), budget_s=0.2,
               default_plan=order[-1], warmup=0, repeats=3)
    assert [x.status for x in r3.records].count("measured") == 4, r3.table()


def test_the_default_plan_is_the_one_the_layer_runs_untuned(tmp_path):
    """A block that leaves num_comm_sms unset runs the sequential schedule's copy kernels with one block
    per SM, so the tuner's configured plan (timed, confirmed, the speedup's reference) is that plan."""
    mk = Space(SHAPE, GPU, 2, 8192, False, backend="megakernel")
    assert UniEPConfig().overlap.num_comm_sms is None and Plan.from_config(UniEPConfig()).num_comm_sms is None
    untuned = mk.layer_default(UniEPConfig())
    assert untuned.schedule == "sequential" and untuned.num_comm_sms == min(GPU.num_sms, 132)
    assert mk.check(untuned) is None and untuned in mk.enumerate()
    assert mk.layer_default({"overlap": {"num_comm_sms": 24}}).num_comm_sms == 24  # set: as configured
    fused = Space(SHAPE, GPU, 2, 8192, False, backend="megakernel", expert_gemm="uniep")
    assert fused.layer_default({"expert_gemm": "uniep", "overlap": {"schedule": "fused"}}).num_comm_sms is None
    assert fused.layer_default({"expert_gemm": "uniep", "overlap": {"schedule": "fused", "roles": "partitioned"}}
                               ).num_comm_sms == 20
    # the pipelined schedule with num_comm_sms unset copies on the copy engines: a plan of its own
    piped = fused.layer_default({"expert_gemm": "uniep", "overlap": {"schedule": "pipelined"}})
    assert piped.num_comm_sms is None and not fused.comm_shares_sms(piped) and fused.check(piped) is None
    # the fused schedule asked for on torch's GEMM runs as the sequential one, with the block's combine knobs
    # (the fused plan had normalised them away) and with the defaults where the block leaves them unset
    for overlap, combine in (({"schedule": "fused"}, (16, True)),
                             ({"schedule": "fused", "combine_chunks": 8, "combine_queue": False}, (8, False))):
        ran = mk.layer_default({"overlap": overlap})
        assert (ran.schedule, ran.combine_chunks, ran.combine_queue) == ("sequential", *combine), ran
        assert ran in mk.enumerate()
    # the design space models the knobs as configured; the reference backend does not act on them
    assert Space(SHAPE, GPU, 2, 8192, False).layer_default(UniEPConfig()) == Plan.from_config(UniEPConfig())
    ref = Space(SHAPE, GPU, 2, 8192, False, backend="reference")
    assert ref.layer_default(UniEPConfig()) == ref.project(Plan.from_config(UniEPConfig()))
    calls = []
    cfg = UniEPConfig.from_dict({"autotune": {"cache_dir": str(tmp_path), "warmup": 0, "repeats": 2}})
    r = tune_from_config(cfg, SHAPE, _fake_runner({}, calls), gpu=GPU, progress=False,
                         values=dict(num_comm_sms=(16, 32)))
    assert r.default_plan == untuned and calls[0] == untuned


def test_budget_keeps_the_confirmation_its_time():
    """The search stops early enough to leave the confirmation (its runs at the finalists' medians)
    inside the budget; without a confirmation the same budget measures every plan."""
    space = small_space()
    order = space.enumerate()
    run = lambda p: time.sleep(0.014 if p == order[-1] else 0.01)  # noqa: E731  (the default slowest)
    # 2 plans after the mandatory two, 30 ms each; confirming 2 + the default, 3 rounds of 3 runs: about 0.3 s
    full = _tune(space, run, budget_s=0.15, default_plan=order[-1], warmup=0, repeats=3)
    assert [x.status for x in full.records].count("measured") == 4, full.table()
    kept = _tune(space, run, budget_s=0.15, default_plan=order[-1], warmup=0, repeats=3, confirm_top=2,
                 confirm_rounds=3)
    skipped = [x for x in kept.records if x.status == "skipped"]
    assert len(skipped) == 1, kept.table()
    assert "budget of 0.15 s spent (" in skipped[0].reason and "s of it kept for the confirmation)" in skipped[0].reason
    assert sum(x.confirmed_ms is not None for x in kept.records) == 3  # the two fastest and the default


def _rank_agreement_body(rank, world_size, result_path):
    import deepspeed.comm as dist
    import torch
    space = small_space()
    seq, pipe2, pipe4, fused = space.enumerate()
    # Rank 0 alone would pick fused (1 ms); rank 1 is slow on it (12 ms). MAX: fused 12, pipe4 5, seq 6, pipe2 8.
    local = [{seq: 6.0, pipe2: 8.0, pipe4: 5.0, fused: 1.0}, {seq: 3.0, pipe2: 4.0, pipe4: 5.0, fused: 12.0}][rank]
    r = tune(space, _fake_runner(local, []), budget_s=30, warmup=0, repeats=3, progress=False, default_plan=seq,
             prune_ratio=100.0)
    winners = [None] * world_size
    dist.all_gather_object(winners, (r.winner.key(), [x.median_ms for x in r.records]))
    assert winners[0] == winners[1], winners
    assert r.winner == pipe4, r.table()
    if rank == 0:
        torch.save(winners[0][0], result_path)


def test_ranks_agree_on_the_slowest_ranks_time(tmp_path):
    out = str(tmp_path / "winner.pt")
    run_distributed(_rank_agreement_body, 2, out)
    import torch
    assert Plan.from_dict(json.loads(torch.load(out))) == Plan("pipelined", 4, 16)


# ---------------------------------------------------------------------- config
def test_autotune_block_parses_and_drives_tuning(tmp_path):
    cfg = UniEPConfig.from_ds_config({"train_batch_size": 8, "uniep": {
        "max_tokens_per_rank": 4096,
        "overlap": {"schedule": "pipelined", "num_chunks": 4, "num_comm_sms": 16},
        "autotune": {"enabled": True, "cache_dir": str(tmp_path / "c"), "budget_s": 5, "allow_numerics_change": True,
                     "warmup": 0, "repeats": 2}}})
    at = cfg.autotune
    assert at.enabled and at.budget_s == 5.0 and at.allow_numerics_change and at.repeats == 2
    assert UniEPConfig().autotune.enabled is False and UniEPConfig().autotune.allow_numerics_change is False
    for bad, key in (({"budget_s": 0}, "uniep.autotune.budget_s"), ({"enabled": "yes"}, "uniep.autotune.enabled"),
                     ({"repeats": 0}, "uniep.autotune.repeats"), ({"budget": 3}, "uniep.autotune.budget"),
                     ({"confirm_top": -1}, "uniep.autotune.confirm_top"),
                     ({"confirm_rounds": 0}, "uniep.autotune.confirm_rounds")):
        with pytest.raises(UniEPConfigError, match=key):
            UniEPConfig.from_dict({"autotune": bad})
    calls = []
    r = tune_from_config(cfg, SHAPE, _fake_runner({}, calls), gpu=GPU, progress=False,
                         values=dict(num_comm_sms=(16, 32)))
    # The megakernel acts on the schedule, num_chunks, num_comm_sms and dispatch_dtype: the configured
    # pipelined plan (4 chunks, 16 communication SMs, the baseline's tiles) is the default plan timed.
    assert r.default_plan == Plan("pipelined", 4, 16) and r.default_ms is not None
    assert {(p.schedule, p.num_chunks, p.num_comm_sms, p.dispatch_dtype) for p in calls} == {
        (sched, c, n, dt) for sched, c in (("sequential", 1), ("pipelined", 2), ("pipelined", 4))
        for n in (16, 32) for dt in ("activation", "fp8_e4m3")}
    assert {(p.tile_m, p.tile_n) for p in calls} == {(None, None)}
    # warmup 0, repeats 2; then the 4 fastest and the configured plan (confirm_top's default) 3 rounds each
    finalists = [x for x in r.records if x.confirmed_ms is not None]
    assert cfg.autotune.confirm_top == 4 and cfg.autotune.confirm_rounds == 3
    assert r.default_plan in [x.plan for x in finalists] and len(finalists) in (4, 5)
    assert len(calls) == 2 * len(set(calls)) + 3 * 2 * len(finalists)
    assert r.best_ms == min(x.confirmed_ms for x in finalists)
    assert os.path.dirname(r.cache_file) == str(tmp_path / "c")
    # max_tokens_per_rank sizes the buffer: a larger T cannot be tuned at all.
    with pytest.raises(ValueError, match="symmetric buffer too small"):
        tune_from_config(cfg, Shape(T=8192, M=64, F=64, E=8, k=2), lambda p: None, gpu=GPU, progress=False)


# ---------------------------------------------------------------------- CLI
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ds_uniep.tune", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_cli_help():
    p = _cli("--help")
    assert p.returncode == 0
    for opt in ("--ds-config", "--shape", "--preset", "--ep", "--out", "--backend", "mixtral-like"):
        assert opt in p.stdout


def test_cli_refuses_a_budget_that_is_not_positive(tmp_path):
    p = _cli("--shape", "64,32,64,4,2", "--backend", "reference", "--budget-s", "0", "--out", str(tmp_path))
    assert p.returncode == 2 and "--budget-s: must be a positive number, got '0'" in p.stderr, p.stderr


def test_cli_space_only_writes_the_plot(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "uniep": {"overlap": {"schedule": "fused"}}}))
    p = _cli("--ds-config", str(ds), "--preset", "dsv2lite-like", "--ep", "4", "--out", str(tmp_path / "o"),
             "--top", "3")
    assert p.returncode == 0, p.stderr
    assert "only enumerating and validating the space; no plan is timed" in p.stdout
    assert "864 candidates, 423 valid" in p.stdout and "neither its dispatch nor its combine" in p.stdout
    assert "NOT measured" in p.stdout
    png = tmp_path / "o" / "tune-dsv2lite-like-ep4-space.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "o" / "tune-dsv2lite-like-ep4-space.json").read_text())
    # (interleaved roles outside the fused schedule are the partitioned plans, not candidates of their own)
    assert data["measured"] is False and len(data["plans"]) == 864


def test_cli_reference_backend_says_the_knobs_do_not_matter(tmp_path):
    p = _cli("--shape", "64,32,64,4,2", "--backend", "reference", "--allow-numerics-change", "--out",
             str(tmp_path), "--warmup", "0", "--repeats", "2", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "only dispatch_dtype changes its path" in p.stdout and "time.perf_counter" in p.stdout
    data = json.loads((tmp_path / "tune-shape-64x32x64x4x2-ep1-reference.json").read_text())
    # One plan per dispatch dtype; fp8's quantisation may make it slow enough to be pruned on CPU.
    assert sorted((r["plan"]["dispatch_dtype"], r["status"] in ("measured", "pruned")) for r in data["records"]) \
        == [("activation", True), ("fp8_e4m3", True)]
    # the configured plan and the baseline project onto the same reference path: one record, one timing
    assert data["default_plan"] == data["baseline_plan"]
    assert data["default_ms"] is not None and data["default_ms"] == data["baseline_ms"]
    assert (tmp_path / "tune-shape-64x32x64x4x2-ep1-reference.png").exists()


def test_cli_errors(tmp_path):
    p = _cli("--shape", "1,2,3", "--out", str(tmp_path))
    assert p.returncode == 2 and "expected five integers" in p.stderr
    p = _cli("--preset", "mixtral-like", "--backend", "megakernel", "--out", str(tmp_path))
    assert p.returncode == 2 and "megakernel backend cannot run here" in p.stderr


def test_set_plan_changes_what_the_next_forward_runs():
    import torch

    from ds_uniep import UniEPMoE
    torch.manual_seed(0)
    layer = UniEPMoE(128, torch.nn.Linear(128, 128), num_experts=2, min_capacity=0, use_rts=False,
                     config={"backend": "reference"})
    x = torch.randn(16, 128)
    exact = layer(x)[0]
    base = Plan.from_config(layer.uniep_config)
    layer.set_plan(base.replace(dispatch_dtype="fp8_e4m3"))
    assert layer.uniep_config.compression.dispatch_dtype == "fp8_e4m3"
    fp8 = layer(x)[0]
    assert not torch.equal(fp8, exact)  # rows travelled as FP8: the numbers changed
    layer.set_plan(base)
    assert torch.equal(layer(x)[0], exact)
