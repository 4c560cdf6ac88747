"""ds_uniep's grouped GEMM (fwd, dgrad, wgrad) on one Hopper GPU.

Every op, tile configuration and tile order (and the automatic choice) against an fp32 reference computed group by group, at most
2x the error ``torch._grouped_mm`` itself has; bitwise equal across configurations, SM counts
and repeats; row counts 1, 19, 4096, empty groups, all rows in one group. Then its autograd
and the SwiGLU / GeLU experts on it against the ``torch._grouped_mm`` path. Inputs are
self-identifying: each group's weight is scaled by its own factor, so rows reaching the wrong
group's weight land far outside the tolerance.
"""
import pytest
import torch

from conftest import needs_gpus

pytestmark = needs_gpus(1)

COUNTS = {
    "one-row": [1],
    "nineteen": [19, 0, 7],
    "empty-groups": [0, 64, 0, 33, 0],
    "all-in-one": [0, 0, 4096, 0],
    "random-4096": None,  # 4096 rows over 6 groups at random
}


def _gemm():
    from ds_uniep import gemm
    ok, why = gemm.available("cuda")
    if not ok:
        pytest.skip(why)
    return gemm


def _counts(name):
    if COUNTS[name] is not None:
        return torch.tensor(COUNTS[name])
    g = torch.Generator().manual_seed(5)
    return torch.bincount(torch.randint(0, 6, (4096, ), generator=g), minlength=6)


def _operands(op, counts, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, groups = int(counts.sum()), len(counts)
    scale = torch.arange(1, groups + 1, dtype=torch.float32).view(-1, 1, 1)  # group g's weight is (g + 1) x

    def randn(*shape):
        return torch.randn(*shape, generator=g)
    w = (randn(groups, n, k) * k ** -0.5 * scale).cuda().bfloat16()
    if op == "fwd":
        return randn(rows, k).cuda().bfloat16(), w
    if op == "dgrad":
        return randn(rows, n).cuda().bfloat16(), w
    return randn(rows, n).cuda().bfloat16(), randn(rows, k).cuda().bfloat16()


def _err(x, ref):
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("counts_name", list(COUNTS))
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_every_config_matches_reference_and_each_other(op, counts_name):
    gemm = _gemm()
    counts = _counts(counts_name)
    n, k = 384, 256
    a, b = _operands(op, counts, n, k)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    ref = gemm.reference(op, a, b, offs)
    torch_err = _err(gemm.torch_grouped_mm(op, a, b, offs), ref)
    first = None
    for config in gemm.candidates() + ["auto"]:
        out = gemm.grouped_mm(a, b, offs, op, config)
        assert out.shape == ref.shape
        assert torch.isfinite(out).all()
        err = _err(out, ref)
        assert err <= 2 * torch_err + 1e-6, f"{op} {config}: rel err {err:.2e}, torch's {torch_err:.2e}"
        assert torch.equal(out, gemm.grouped_mm(a, b, offs, op, config)), f"{op} {config}: repeat differs"
        first = out if first is None else first
        assert torch.equal(out, first), f"{op} {config} differs from {gemm.candidates()[0]}"
    assert torch.equal(gemm.grouped_mm(a, b, offs, op, gemm.CONFIGS[0], sm_count=8), first), \
        "the result depends on the SM count"
    if op == "wgrad":  # groups without rows get zero gradients
        for i, c in enumerate(counts.tolist()):
            if c == 0:
                assert not first[i].any()


def test_output_is_fully_written():
    """The output's memory is poisoned first: a NaN tensor of the output's size is freed just
    before each call, so the caching allocator hands that block to the output."""
    gemm = _gemm()
    counts = torch.tensor([3, 0, 130])
    a, b = _operands("fwd", counts, 128, 64)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    for config in gemm.CONFIGS:
        poison = torch.full((int(counts.sum()), 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        ptr = poison.data_ptr()
        del poison
        out = gemm.grouped_mm(a, b, offs, "fwd", config)
        if out.data_ptr() != ptr:
            pytest.skip("the allocator did not reuse the poisoned block")
        assert torch.isfinite(out).all(), f"{config} left rows unwritten"


def test_bad_input_is_refused():
    gemm = _gemm()
    x = torch.zeros(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 64, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([4, 8], device="cuda", dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16"):
        gemm.grouped_mm(x.float(), w, offs, "fwd")
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm.grouped_mm(x[:, :60].contiguous(), w[:, :, :60].contiguous(), offs, "fwd")
    with pytest.raises(ValueError, match="sm_count"):
        gemm.grouped_mm(x, w, offs, "fwd", sm_count=7)
    with pytest.raises(ValueError, match="G = 2"):
        gemm.grouped_mm(x, w[:1].contiguous(), offs, "fwd")
    with pytest.raises(ValueError, match="op"):
        gemm.grouped_mm(x, w, offs, "sideways")
    with pytest.raises(ValueError, match="config"):
        gemm.grouped_mm(x, w, offs, "fwd", "huge")


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_experts_on_uniep_gemm_match_torch_path(kind):
    _gemm()
    from ds_uniep.experts import GeLUExpert, SwiGLUExpert, run_grouped
    torch.manual_seed(3)
    M, F = 256, 384
    counts = torch.tensor([37, 0, 300, 19])
    make = (lambda: SwiGLUExpert(M, F)) if kind == "swiglu" else (lambda: GeLUExpert(M, F))
    experts = [make().cuda().bfloat16() for _ in counts]
    x = torch.randn(int(counts.sum()), M, device="cuda").bfloat16()
    dy = torch.randn_like(x)

    def run(gemm):
        for e in experts:
            e.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = run_grouped(experts, xi, counts.cuda(), gemm=gemm)
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad.clone() for e in experts for p in e.parameters()]

    # fp32 ground truth: the same experts in fp32, row by row.
    ref_experts = [make().cuda() for _ in counts]
    for r, e in zip(ref_experts, experts):
        r.load_state_dict({k: v.float() for k, v in e.state_dict().items()})
    xr = x.float().requires_grad_(True)
    yr = torch.cat([e(part) for e, part in zip(ref_experts, xr.split(counts.tolist()))])
    yr.backward(dy.float())
    ref = [yr.detach(), xr.grad] + [p.grad if p.grad is not None else torch.zeros_like(p)
                                    for e in ref_experts for p in e.parameters()]
    got_t, got_u = run("torch"), run("uniep")
    assert torch.equal(run("uniep")[0], got_u[0]) and all(torch.equal(a, b) for a, b in zip(run("uniep"), got_u))
    for i, (t, u, r) in enumerate(zip(got_t, got_u, ref)):
        if not r.any():
            assert not u.any(), f"tensor {i}: expected zeros (an expert without rows)"
            continue
        et, eu = _err(t, r), _err(u, r)
        assert eu <= 2 * et + 1e-3, f"tensor {i}: uniep rel err {eu:.2e} vs torch path's {et:.2e}"


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize("gemm_name", ["torch", "uniep"])
def test_experts_give_the_same_bits_in_every_parameter_layout(kind, gemm_name):
    """Stacked weights that are views of packed or DeepSpeed-flattened parameters (a group stride
    larger than the group, for the flattened ones) against weights copied into a fresh stack."""
    if gemm_name == "uniep":
        _gemm()
    from moe_models import expert_layouts
    from ds_uniep.experts import GeLUExpert, SwiGLUExpert, run_experts
    M, F, L = 256, 384, 4
    counts = torch.tensor([37, 0, 300, 19])
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(int(counts.sum()), M, device="cuda", generator=g).bfloat16()
    dy = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    results = {}
    layouts = expert_layouts(SwiGLUExpert if kind == "swiglu" else GeLUExpert, M, F, L, "cuda")
    for layout, experts in layouts.items():
        xi = x.clone().requires_grad_(True)
        y = run_experts(experts, xi, counts.cuda(), gemm=gemm_name)
        y.backward(dy)
        results[layout] = [y, xi.grad] + [p.grad for e in experts for p in e.parameters()]
    for layout in ("flat", "separate"):
        for i, (a, b) in enumerate(zip(results["packed"], results[layout])):
            assert torch.equal(a, b), f"{layout}: tensor {i} differs from the packed layout"
    ref = torch.cat([e.float()(part.float()) for e, part in zip(layouts["separate"], x.split(counts.tolist()))])
    assert _err(results["packed"][0], ref) < 2e-2


def _segments(counts, words, seed=3):
    """Each group's rows cut into up to three runs, shuffled; run i waits for word i % words
    (-1: no wait, every fourth run). -> [S, 4] int32 (first row, rows, group, word)."""
    g = torch.Generator().manual_seed(seed)
    segs, start = [], 0
    for grp, n in enumerate(counts.tolist()):
        cuts = sorted(torch.randint(0, n + 1, (2, ), generator=g).tolist()) if n else [0, 0]
        for a, b in zip([0] + cuts, cuts + [n]):
            segs.append([start + a, b - a, grp, 0])
        start += n
    order = torch.randperm(len(segs), generator=g).tolist()
    segs = [segs[i] for i in order]
    for i, s in enumerate(segs):
        s[3] = -1 if i % 4 == 3 else i % words
    return torch.tensor(segs, dtype=torch.int32).cuda()


def _waits(gemm, segs, words, poison, record, timeout_s, sm_count):
    return gemm.ArrivalWaits(segs=segs, ready=words, epoch=1, timeout_ns=int(timeout_s * 1e9), error_record=record,
                             poison=poison, layer_id=7, rank=0, phase=1, sm_count=sm_count)


def test_segments_and_arrival_waits_give_the_plain_bits():
    """The forward over shuffled runs of rows gives the per-group forward's bits in every tile
    configuration; with arrival waits, rows written only after a delay (then their words raised)
    still give them, so no tile read its rows before its word said they were there."""
    gemm = _gemm()
    counts = _counts("random-4096")
    counts[2] = 0  # an expert without rows
    a, w = _operands("fwd", counts, 384, 256)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    plain = gemm.grouped_mm(a, w, offs, "fwd", "coop128x256")
    segs = _segments(counts, words=3)
    for config in gemm.candidates():
        out = gemm.grouped_mm_segments(a, w, segs, config)
        assert torch.equal(out, plain), f"segments differ from the per-group forward ({config})"
    # dgrad over the same runs: the per-group dgrad's bits, whatever tile the plain one ran
    dy, _ = _operands("dgrad", counts, 384, 256, seed=1)
    plain_dgrad = gemm.grouped_mm(dy, w, offs, "dgrad", "pingpong128x128")
    assert not torch.equal(plain_dgrad, torch.zeros_like(plain_dgrad))
    for config in gemm.candidates():
        out = gemm.grouped_mm_segments(dy, w, segs, config, op="dgrad")
        assert out.shape == (dy.shape[0], 256)
        assert torch.equal(out, plain_dgrad), f"dgrad segments differ from the per-group dgrad ({config})"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waited = segs[:, 3] >= 0
    late = torch.zeros(a.shape[0], dtype=torch.bool, device="cuda")
    for first, n, _, word in segs.tolist():
        late[first:first + n] = word >= 0
    assert late.any() and (~late).any() and bool(waited.any())
    for config in ("coop128x256", "pingpong128x128"):
        rows = torch.where(late[:, None], torch.full_like(a, 1e4), a)  # late rows wrong until the delay ends
        words = torch.zeros(3, dtype=torch.int32, device="cuda")
        poison = torch.zeros(1, dtype=torch.int32, device="cuda")
        record = torch.zeros(8, dtype=torch.int64, pin_memory=True)
        writer = torch.cuda.Stream()
        with torch.cuda.stream(writer):  # load the writer's kernels now: loading one later could wait for the GEMM
            torch.cuda._sleep(1000)
            words.fill_(0)
        writer.synchronize()
        writer.wait_stream(torch.cuda.current_stream())
        out = gemm.grouped_mm_segments(rows, w, segs, config, _waits(gemm, segs, words, poison, record, 20.0,
                                                                     sms - 4))
        with torch.cuda.stream(writer):  # the GEMM leaves 4 SMs free for the delay and the stores
            torch.cuda._sleep(50_000_000)
            rows.copy_(a)
            words.fill_(1)
        torch.cuda.synchronize()
        assert record[0].item() == 0 and poison.item() == 0, record.tolist()
        assert torch.equal(out, plain), f"rows were read before their word was raised ({config})"


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_segments_store_at_their_own_addresses(op):
    """With ``out_ptrs`` each run's rows go to its own address (here: runs placed in reverse order
    in another buffer, with a gap row between them): the plain forward's (dgrad's) rows, bit for
    bit, in every tile configuration, and no byte outside the runs is written."""
    gemm = _gemm()
    counts = _counts("random-4096")
    counts[2] = 0
    a, w = _operands(op, counts, 384, 256)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    plain = gemm.grouped_mm(a, w, offs, op, "coop128x256")
    segs = _segments(counts, words=1)
    runs = segs.tolist()
    place, pos = {}, 1
    for i in reversed(range(len(runs))):
        place[i] = pos
        pos += runs[i][1] + 1
    for config in ("coop128x256", "coop256x128", "pingpong128x128"):
        dest = torch.full((pos, plain.shape[1]), 7.0, dtype=torch.bfloat16, device="cuda")
        ptrs = torch.tensor([dest[place[i]].data_ptr() for i in range(len(runs))], dtype=torch.int64, device="cuda")
        assert gemm.grouped_mm_segments(a, w, segs, config, out_ptrs=ptrs, op=op) is None
        written = torch.zeros(pos, dtype=torch.bool, device="cuda")
        for i, (first, n, _, _) in enumerate(runs):
            got = dest[place[i]:place[i] + n]
            assert torch.equal(got, plain[first:first + n]), f"{config}: run {i} differs from the plain {op}"
            written[place[i]:place[i] + n] = True
        assert bool((dest[~written] == 7.0).all()), f"{config}: rows outside the runs were written"
    with pytest.raises(ValueError, match="out_ptrs"):
        gemm.grouped_mm_segments(a, w, segs, "coop128x256", out_ptrs=ptrs[:-1], op=op)


def test_arrival_wait_times_out_with_a_record():
    """A word never raised: the wait gives up after its timeout, records which word it waited
    for and sets the poison word, and the GEMM returns instead of hanging; once poisoned, later
    waits return at once."""
    gemm = _gemm()
    counts = torch.tensor([64, 200, 0, 31])
    a, w = _operands("fwd", counts, 128, 128)
    segs = torch.tensor([[0, 64, 0, -1], [64, 200, 1, 2], [264, 31, 3, 2]], dtype=torch.int32).cuda()
    words = torch.zeros(3, dtype=torch.int32, device="cuda")
    poison = torch.zeros(1, dtype=torch.int32, device="cuda")
    record = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    gemm.grouped_mm_segments(a, w, segs, "coop128x256", _waits(gemm, segs, words, poison, record, 0.2, sms))
    end.record()
    torch.cuda.synchronize()
    assert record[0].item() == 1 and poison.item() == 1, record.tolist()
    # phase, word (the source rank in the fused schedule), epoch, seen, rank, layer
    assert record[1:7].tolist() == [1, 2, 1, 0, 0, 7], record.tolist()
    assert 150 <= start.elapsed_time(end) < 10_000
    start.record()
    gemm.grouped_mm_segments(a, w, segs, "coop128x256", _waits(gemm, segs, words, poison, record, 30.0, sms))
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) < 1_000, "a poisoned wait did not return at once"


def test_fused_segments_kernel_is_the_layout_runs():
    """The device table the fused schedule runs over equals ``layout.fused_runs``, for every
    rank and tile size (1: the (source, expert) blocks), with empty (source, expert) blocks and
    a crowded expert among them."""
    _gemm()
    from ds_uniep.layout import fused_runs
    from ds_uniep._ops import ext as _ext
    g = torch.Generator().manual_seed(9)
    for G, E in ((1, 4), (2, 64), (4, 32), (8, 128)):
        counts_all = torch.randint(0, 300, (G, E), generator=g)
        counts_all[0, ::5] = 0
        counts_all[:, 1] = 5000
        for rank in range(G):
            for align in (1, 7, 256, 1024):
                got = _ext().fused_segments(counts_all.cuda(), rank, align).cpu()
                assert torch.equal(got.long(), fused_runs(counts_all, rank, align)), (G, E, rank, align)


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_first_call_on_a_stream_inside_a_graph_capture(op):
    """The GEMM's first call for a stream (its per-stream set-up) may come inside a CUDA graph's
    capture; the graph replays with the eager bits. (A shape and SM count no other test uses, so that
    the set-up happens in the capture whichever streams ran before.)"""
    gemm = _gemm()
    G, N, K = 7, 136, 72
    g = torch.Generator(device="cuda").manual_seed(3)
    offs = torch.tensor([40, 40, 97, 150, 150, 203, 260], dtype=torch.int32, device="cuda")
    R = int(offs[-1])
    a = torch.randn(R, N if op != "fwd" else K, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(R, K, device="cuda", generator=g) if op == "wgrad" else
         torch.randn(G, N, K, device="cuda", generator=g)).to(torch.bfloat16)
    want = gemm.grouped_mm(a, b, offs, op, "pingpong128x128:n8", sm_count=6)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        got = gemm.grouped_mm(a, b, offs, op, "pingpong128x128:n8", sm_count=6)
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
