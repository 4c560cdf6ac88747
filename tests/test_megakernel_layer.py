"""UniEPMoE with the megakernel backend against the reference backend, on GPUs over NCCL.

Both backends run the same grouped GEMMs over the same rows in the same layout
order and combine in slot order in fp32, so outputs agree bit for bit; the gate
gradient is reduced in a different (fixed) order by each, so gradients agree to
bf16 tolerance. Megakernel runs must be bitwise identical to each other. The
The pipelined and fused schedules must equal the sequential one bit for bit, for every chunk
count and number of communication SMs, and so must the sequential schedule with its dispatch
queued before the rest of the gate (the default) and after it. Under ``compression.combine``
"rank_partials" both backends sum a token's rows per rank first, so forward outputs again agree
bit for bit (gradients to bf16 tolerance).
"""
import time

import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed, shared_gpus


def _make(rank, world_size, k, backend, overlap=None, expert_gemm="torch", M=256, F=512, gelu=False,
          max_tokens=4096, compression=None, extra=None):
    """A layer with the same weights on every call (bf16 experts, fp32 gate); SwiGLU experts, or
    GeLU ones with biases (``gelu``); buffers for ``max_tokens`` tokens per rank. At least 2k
    experts, so that with every token's first choice on one expert that expert is crowded."""
    from ds_uniep import GeLUExpert, SwiGLUExpert, UniEPMoE
    E = max(4 * world_size, 2 * k)
    torch.manual_seed(11)
    expert = GeLUExpert(M, F) if gelu else SwiGLUExpert(M, F)
    layer = UniEPMoE(M, expert, num_experts=E, ep_size=world_size, k=k, min_capacity=0,
                     drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                     config={"backend": backend, "max_tokens_per_rank": max_tokens,
                             "expert_gemm": expert_gemm, "compression": compression or {},
                             "overlap": dict(timeout_s=30.0 if shared_gpus() else 5.0, **(overlap or {})),
                             **(extra or {})})
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + rank)
        for p in layer.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
    layer = layer.to(device=rank_gpu(rank), dtype=torch.bfloat16)
    layer.deepspeed_moe.gate.wg.float()
    layer.set_deepspeed_parallelism()
    return layer


def _step(layer, rank, T, one_expert):
    """One forward and backward from cleared gradients: [output, x.grad, every parameter's grad]."""
    device = rank_gpu(rank)
    wg = layer.deepspeed_moe.gate.wg.weight
    saved = wg.detach().clone()
    if one_expert:  # every token's first choice is the last expert
        with torch.no_grad():
            wg[-1] += 50.0
    for p in layer.parameters():
        p.grad = None
    gx = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(T, layer.hidden_size, device=device, generator=gx).abs().to(torch.bfloat16).requires_grad_(True)
    gy = torch.randn(T, layer.hidden_size, device=device, generator=gx).to(torch.bfloat16)
    out, l_aux, _ = layer(x)
    torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
    res = [out, x.grad] + [p.grad for p in layer.parameters()]
    with torch.no_grad():
        wg.copy_(saved)
    return res


def _two_steps(layer, rank):
    """Two forwards (19 and 300 tokens), then the second one's backward, then the first one's:
    [outputs, input gradients, every parameter's gradient (summed over both)]."""
    device = rank_gpu(rank)
    for p in layer.parameters():
        p.grad = None
    g = torch.Generator(device=device).manual_seed(50 + rank)
    xs = [torch.randn(T, layer.hidden_size, device=device, generator=g).abs().to(torch.bfloat16).requires_grad_(True)
          for T in (19, 300)]
    gys = [torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16) for x in xs]
    outs = [layer(x)[0] for x in xs]
    outs[1].backward(gys[1])
    outs[0].backward(gys[0])
    return outs + [x.grad for x in xs] + [p.grad for p in layer.parameters()]


def _rel(got, want):
    """Relative distance of ``got`` from ``want`` (Frobenius norms, fp32)."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _tiles_ran(config):
    """Assert that every grouped GEMM since the last clear ran ``config`` (the bits cannot show it)."""
    from ds_uniep.gemm import TILE_RUNS
    ran = dict(TILE_RUNS)
    assert ran and {tile for _, tile in ran} == {config}, f"the layer's grouped GEMMs ran {ran}, not only {config}"
    assert {op for op, _ in ran} >= {"fwd", "dgrad", "wgrad"}, ran
    TILE_RUNS.clear()


def _check_same(layer, rank, cases, want, where):
    """One step of ``layer`` per (T, one_expert) case, each bitwise the expected tensors."""
    for (T, one_expert), expected in zip(cases, want):
        res = _step(layer, rank, T, one_expert)
        for i, (a, b) in enumerate(zip(expected, res)):
            assert torch.equal(a, b), f"rank {rank} T={T} one_expert={one_expert} {where}: tensor {i} differs from " \
                                      "the sequential schedule"


# ep 2 and ep 4, each skipped (conftest's needs_gpus) where fewer GPUs are here.
WORLD_SIZES = pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (2, 4)])


def _run(rank, world_size, k, T, one_expert, backend, overlap=None):
    layer = _make(rank, world_size, k, backend, overlap, max_tokens=max(T, 4096))
    res = _step(layer, rank, T, one_expert)
    assert layer.backend_name(rank_gpu(rank)) == backend
    return res, layer


CASES = [(k, T, one) for k in (1, 2, 6, 8) for T, one in ((1, False), (19, False), (4096, False), (4096, True))]
BIG = 8192  # the largest token count: every k against the reference, k = 8 in the schedule comparisons


def _cases(k):
    """The (T, one_expert) cases of ``k`` for the schedule comparisons (k = 8 also at BIG tokens) and the
    buffers' tokens per rank they need."""
    cases = [(T, one) for kk, T, one in CASES if kk == k] + ([(BIG, False)] if k == 8 else [])
    return cases, max(T for T, _ in cases)


def _compare(rank, world_size):
    for k, T, one_expert in CASES + [(k, BIG, False) for k in (1, 2, 6, 8)]:
        ref, _ = _run(rank, world_size, k, T, one_expert, "reference")
        mk1, _ = _run(rank, world_size, k, T, one_expert, "megakernel")
        mk2, _ = _run(rank, world_size, k, T, one_expert, "megakernel")
        where = f"rank {rank} k={k} T={T} one_expert={one_expert}"
        assert torch.equal(mk1[0], ref[0]), f"{where}: forward output differs from the reference"
        for i, (a, b, c) in enumerate(zip(ref, mk1, mk2)):
            assert torch.equal(b, c), f"{where}: tensor {i} of the megakernel not bitwise repeatable"
            rel = _rel(b, a)
            assert rel <= 1e-2, f"{where}: tensor {i} of the megakernel: relative error {rel:.3e} against the reference"


@WORLD_SIZES
def test_megakernel_layer_matches_reference(world_size):
    run_distributed(_compare, world_size, backend="nccl")


def _compare_rank_partials(rank, world_size):
    """compression.combine "rank_partials": the megakernel's forward bitwise the reference backend's
    under it (the same torch GEMMs, the same sums), every tensor repeatable, within bf16 tolerance of
    the reference (and of the slot-order combine, whose distance is printed); the fused schedule
    without its epilogues (its combine kernels move the rows) bitwise the sequential one. Every k at
    ep 2; k 2 and 8 at ep 4."""
    rp = {"combine": "rank_partials"}
    device = rank_gpu(rank)
    for k, T, one_expert in [c for c in CASES if world_size == 2 or c[0] in (2, 8)]:  # ep 4: k 2 and 8
        where = f"rank {rank} k={k} T={T} one_expert={one_expert}"
        tokens = max(T, 4096)
        ref = _step(_make(rank, world_size, k, "reference", compression=rp, max_tokens=tokens), rank, T, one_expert)
        slots = _step(_make(rank, world_size, k, "reference", max_tokens=tokens), rank, T, one_expert)
        mks = []
        for _ in range(2):
            layer = _make(rank, world_size, k, "megakernel", compression=rp, max_tokens=tokens)
            mks.append(_step(layer, rank, T, one_expert))
            stats = layer._dispatchers[device].combine_stats
            assert stats["rank_partials"] == 2, f"{where}: {stats} (a forward combine and a dispatch backward)"
        assert torch.equal(mks[0][0], ref[0]), f"{where}: forward output differs from the reference's rank partials"
        worst = 0.0
        for i, (a, b, c, d) in enumerate(zip(ref, mks[0], mks[1], slots)):
            assert torch.equal(b, c), f"{where}: tensor {i} of the megakernel not bitwise repeatable"
            rel = _rel(b, a)
            assert rel <= 1e-2, f"{where}: tensor {i}: relative error {rel:.3e} against the reference"
            worst = max(worst, _rel(b, d))
        assert worst <= 2e-2, f"{where}: {worst:.3e} from the slot-order combine"
        if rank == 0:
            print(f"rank_partials {where}: largest relative distance to the slot-order combine {worst:.3e}")
    cases, tokens = [(4096, False), (4096, True)], 4096
    seq = [_step(_make(rank, world_size, 8, "megakernel", expert_gemm="uniep", compression=rp, max_tokens=tokens),
                 rank, T, one) for T, one in cases]
    fused = _make(rank, world_size, 8, "megakernel", expert_gemm="uniep", compression=rp, max_tokens=tokens,
                  overlap={"schedule": "fused", "epilogue_combine": False, "num_comm_sms": 16})
    _check_same(fused, rank, cases, seq, "fused without epilogues, rank partials")
    assert fused._dispatchers[device].fused_stats["fused"] >= 2


@WORLD_SIZES
def test_rank_partials_combine(world_size):
    run_distributed(_compare_rank_partials, world_size, backend="nccl")


def _compare_route_order(rank, world_size):
    # The sequential schedule queues its dispatch and experts between the gate's routes and the rest
    # of the gate (route_early, the default): the same bits as with the dispatch after the whole gate.
    for k in (1, 2, 6, 8):
        cases = [(T, one) for kk, T, one in CASES if kk == k]
        late = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"})
        late.route_early = False
        want = [_step(late, rank, T, one) for T, one in cases]
        assert next(iter(late._dispatchers.values())).early_dispatches == 0
        del late
        for gemm in ("torch", "uniep"):
            layer = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"}, expert_gemm=gemm)
            _check_same(layer, rank, cases, want, f"k={k} dispatch queued early, {gemm} GEMM")
            begun = next(iter(layer._dispatchers.values())).early_dispatches
            # k = 1 is DeepSpeed's top-1 gate, called whole: no early dispatch there
            assert begun == (0 if k == 1 else len(cases)), f"rank {rank} k={k}: {begun} dispatches queued early"


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2, 4)])
def test_early_dispatch_is_bitwise_the_late_one(world_size):
    """Outputs, input and every parameter gradient with the dispatch and the experts queued before
    the rest of the gate, against the dispatch queued after the whole gate; k 2-8, 1 to 4096 tokens
    (at k 1 DeepSpeed's top-1 gate is called whole: both paths are one, the test checks that no
    dispatch was queued early); also on one GPU, where the dispatch is this rank's alone."""
    run_distributed(_compare_route_order, world_size, backend="nccl")


def _progress(rank, world_size, what, t0):
    """Rank 0 says how far a long comparison got (seen with ``pytest -s``, also when a time limit stops it)."""
    if rank == 0:
        print(f"[ep {world_size}] {what} done, {time.perf_counter() - t0:.0f} s", flush=True)


def _compare_schedules(rank, world_size):
    # One layer per (k, schedule), run on every token count: layers are built len(CASES) times less.
    t0 = time.perf_counter()
    for k in (1, 2, 6, 8):
        cases, big = _cases(k)
        seq = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"}, max_tokens=big)
        want = [_step(seq, rank, T, one) for T, one in cases]
        del seq
        for chunks in (1, 2, 3, 4, 4):  # 4 twice: run to run
            layer = _make(rank, world_size, k, "megakernel", overlap={"schedule": "pipelined", "num_chunks": chunks},
                          max_tokens=big)
            _check_same(layer, rank, cases, want, f"k={k} chunks={chunks}")
            stats = next(iter(layer._dispatchers.values())).combine_stats
            assert stats["pipelined"] == len(cases) and stats["pushed"] == 0, f"k={k} chunks={chunks}: {stats}"
        _progress(rank, world_size, f"pipelined, torch's GEMM, k={k}", t0)


def _compare_schedules_uniep_gemm(rank, world_size):
    # ds_uniep's GEMM: the pipelined schedule's chunks run it on the SMs num_comm_sms leaves, and
    # their rows travel by SM stores; the bits are still the sequential schedule's (on all SMs).
    t0 = time.perf_counter()
    for k in (2, 8):
        cases, big = _cases(k)
        seq = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"}, expert_gemm="uniep",
                    max_tokens=big)
        want = [_step(seq, rank, T, one) for T, one in cases]
        del seq
        for chunks, sms in ((1, 20), (2, 20), (4, 32), (4, 32), (2, None)):  # None: copy engines, every SM
            overlap = {"schedule": "pipelined", "num_chunks": chunks}
            if sms is not None:
                overlap["num_comm_sms"] = sms
            layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", overlap=overlap, max_tokens=big)
            where = f"k={k} chunks={chunks} uniep GEMM, copy SMs {sms}"
            _check_same(layer, rank, cases, want, where)
            d = next(iter(layer._dispatchers.values()))
            assert d.combine_stats["pipelined"] == len(cases), f"{where}: {d.combine_stats}"
            used, unused = ("sm_stores", "copy_engines") if sms else ("copy_engines", "sm_stores")
            assert d.push_stats[used] > 0 and d.push_stats[unused] == 0, f"{where}: copies {d.push_stats}"
        # The block's tile sizes: every chunk's GEMMs run that tile, the same bits.
        from ds_uniep.gemm import TILE_RUNS
        TILE_RUNS.clear()
        overlap = {"schedule": "pipelined", "num_chunks": 2, "num_comm_sms": 20, "tile_m": 256, "tile_n": 128}
        layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", overlap=overlap, max_tokens=big)
        _check_same(layer, rank, cases, want, f"k={k} {overlap}")
        assert next(iter(layer._dispatchers.values())).combine_stats["pipelined"] == len(cases)
        _tiles_ran("coop256x128")
        _progress(rank, world_size, f"pipelined, ds_uniep's GEMM, k={k}", t0)


@WORLD_SIZES
def test_pipelined_schedule_is_bitwise_the_sequential_one(world_size):
    """Outputs, input and every parameter gradient, for k 1-8, 1 to 4096 tokens (8192 at k 8), all tokens
    to one expert, 1 to 4 chunks (one per local expert); torch's grouped GEMM."""
    run_distributed(_compare_schedules, world_size, backend="nccl")


@WORLD_SIZES
def test_pipelined_schedule_on_uniep_gemm_is_bitwise_the_sequential_one(world_size):
    """The same with ds_uniep's grouped GEMM (k 2 and 8): chunks on the SMs that ``num_comm_sms``
    leaves with their rows sent by SM stores, or on every SM with the copy engines, and a tile size
    from the block."""
    run_distributed(_compare_schedules_uniep_gemm, world_size, backend="nccl")


def _compare_fused(rank, world_size):
    # ds_uniep's GEMM in both; the fused schedule's first GEMM starts each (source, expert) run of
    # rows when that source's rows are there. Wider rows than the other tests (M 1024), so the
    # dispatch takes long enough for the GEMM to start on early sources while later ones travel.
    t0 = time.perf_counter()
    for k in (1, 2, 6, 8):
        cases, big = _cases(k)
        seq = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"}, expert_gemm="uniep",
                    M=1024, F=512, max_tokens=big)
        want = [_step(seq, rank, T, one) for T, one in cases]
        del seq
        # 20 twice: run to run, the second time with the dispatch queued after the whole gate
        # (the third one with the second GEMM's outputs pushed back by the combine kernel instead of
        # stored into the sources' combine buffers by the GEMM's epilogue; the last one with the
        # sequential dispatch and only the epilogue combine; the last two with the dispatch in the
        # first GEMM's CTAs (interleaved roles), with and without the epilogue combine, the second
        # with the sends in those CTAs too and two warps of each CTA on the job. At k = 1 with every
        # token on one expert, a rank receives no rows: its interleaved dispatch runs alone. The
        # last two: each expert's rows waited for as a whole, and all of a rank's rows)
        for sms, early, epilogue, fused_dispatch, roles, granularity in (
                (20, True, True, True, "partitioned", "tile"), (8, True, True, True, "partitioned", "tile"),
                (20, False, False, True, "partitioned", "tile"), (8, True, True, False, "partitioned", "tile"),
                (20, True, True, True, "interleaved", "tile"), (20, False, False, True, "interleaved", "tile"),
                (20, True, True, True, "interleaved", "expert"), (8, True, True, True, "partitioned", "rank")):
            layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", M=1024, F=512, max_tokens=big,
                          overlap={"schedule": "fused", "num_comm_sms": sms, "epilogue_combine": epilogue,
                                   "fused_dispatch": fused_dispatch, "roles": roles,
                                   "signal_granularity": granularity})
            layer.route_early = early
            if roles == "interleaved" and not early:  # the GEMM's spare warps (two per CTA) send the rows too
                x0 = torch.empty(1, 1024, dtype=torch.bfloat16, device=rank_gpu(rank))
                d = layer._dispatcher(x0)
                d.interleaved_sends = True
                d.interleaved_items = d.interleaved_items[:3] + (2, )
            where = (f"k={k} fused, comm SMs {sms}, early dispatch {early}, epilogue combine {epilogue}, fused "
                     f"dispatch {fused_dispatch}, roles {roles}, signal granularity {granularity}")
            _check_same(layer, rank, cases, want, where)
            disp = next(iter(layer._dispatchers.values()))
            stats = disp.fused_stats
            assert stats == {"fused": len(cases) if fused_dispatch else 0, "sequential": 0}, f"{where}: {stats}"
            assert disp.interleaved == (roles == "interleaved") and disp.signal_granularity == granularity, where
            begun = disp.early_dispatches
            assert begun == (len(cases) if early and k > 1 else 0), f"{where}: {begun} queued early"
            landed = disp.combine_stats["landed"], disp.combine_stats["landed_dgrad"]
            runs = len(cases) if epilogue else 0  # the backward's dgrad epilogue too
            assert landed == (runs, runs), f"{where}: {landed} epilogue combines (forward, backward)"
        if k == 2:  # two forwards before their backwards: the first one's rows are kept for its backward
            seq = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"}, expert_gemm="uniep",
                        M=1024, F=512)
            want2 = _two_steps(seq, rank)
            del seq
            layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", M=1024, F=512,
                          overlap={"schedule": "fused", "num_comm_sms": 8})
            got = _two_steps(layer, rank)
            for i, (a, b) in enumerate(zip(want2, got)):
                assert torch.equal(a, b), f"rank {rank} two forwards, then backwards: tensor {i} differs"
            stats = next(iter(layer._dispatchers.values())).combine_stats
            assert (stats["landed"], stats["landed_dgrad"]) == (2, 2), stats
            # a second backward through the same graph finds the rows gone and says so
            x = torch.randn(64, 1024, device=rank_gpu(rank)).to(torch.bfloat16).requires_grad_(True)
            out = layer(x)[0]
            out.float().sum().backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="second backward"):
                out.float().sum().backward()
            # the graph keeps its rows in the direct receive region the next layers share: gone, they fuse
            del out, x, layer
        # The block's tile sizes pick ds_uniep's GEMM tile for every expert GEMM: the same bits.
        from ds_uniep.gemm import TILE_RUNS
        for overlap, tile in (({"schedule": "sequential", "tile_m": 256, "tile_n": 128}, "coop256x128"),
                              ({"schedule": "fused", "num_comm_sms": 8, "tile_m": 128, "tile_n": 128},
                               "pingpong128x128")):
            TILE_RUNS.clear()
            layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", M=1024, F=512, overlap=overlap,
                          max_tokens=big)
            _check_same(layer, rank, cases, want, f"k={k} {overlap}")
            d = next(iter(layer._dispatchers.values()))
            fused = len(cases) if overlap["schedule"] == "fused" else 0
            assert d.fused_stats == {"fused": fused, "sequential": 0}, f"k={k} {overlap}: {d.fused_stats}"
            assert (d.combine_stats["landed"], d.combine_stats["landed_dgrad"]) == (fused, fused), d.combine_stats
            _tiles_ran(tile)
        if k == 2:  # GeLU experts with biases: the second GEMM's rows go back by the combine kernel, the
            # first GEMM's dgrad still stores into the sources' combine buffers
            seq = _make(rank, world_size, k, "megakernel", overlap={"schedule": "sequential"}, expert_gemm="uniep",
                        M=1024, F=512, gelu=True)
            want_gelu = [_step(seq, rank, T, one) for T, one in cases]
            del seq
            layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", M=1024, F=512, gelu=True,
                          overlap={"schedule": "fused", "num_comm_sms": 8})
            _check_same(layer, rank, cases, want_gelu, "k=2 fused, GeLU experts with biases")
            stats = next(iter(layer._dispatchers.values())).combine_stats
            assert (stats["landed"], stats["landed_dgrad"]) == (0, len(cases)), stats
        if k == 2:  # experts flattened into one buffer, as DeepSpeed's optimizers leave them: strided stacks
            layer = _make(rank, world_size, k, "megakernel", expert_gemm="uniep", M=1024, F=512,
                          overlap={"schedule": "fused", "num_comm_sms": 8})
            params = list(layer.deepspeed_moe.experts.parameters())
            flat = torch.cat([q.detach().reshape(-1) for q in params])
            off = 0
            for q in params:
                q.data = flat[off:off + q.numel()].view(q.shape)
                off += q.numel()
            _check_same(layer, rank, cases, want, "k=2 fused, flattened experts")
            d = next(iter(layer._dispatchers.values()))
            assert d.fused_stats == {"fused": len(cases), "sequential": 0}, d.fused_stats
            assert (d.combine_stats["landed"], d.combine_stats["landed_dgrad"]) == (len(cases), len(cases))
        _progress(rank, world_size, f"fused, k={k}", t0)


@WORLD_SIZES
def test_fused_schedule_is_bitwise_the_sequential_one(world_size):
    """Outputs, input and every parameter gradient, for k 1-8, 1 to 4096 tokens (8192 at k 8), all
    tokens to one expert, 8 and 20 communication SMs in partitioned roles and interleaved roles (the default, which
    the cases that name no roles run: two forwards before their backwards, tile sizes, GeLU experts,
    flattened experts), each signal granularity; every forward ran fused."""
    run_distributed(_compare_fused, world_size, backend="nccl")
