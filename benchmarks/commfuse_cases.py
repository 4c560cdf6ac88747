"""Pieces of ``bench_commfuse.py``: the unfused collectives, the per-variant results (slowest
rank, speed-up, exposed communication), and the Ulysses attention and data-parallel cases
(``--cases ulysses dp``)."""
import traceback

import torch
import torch.distributed as dist

from timing import bench_interleaved


def all_gather_to(out, x, group, gloo):
    if gloo:  # gloo has no all_gather_into_tensor on every version
        parts = list(out.chunk(dist.get_world_size(group)))
        dist.all_gather(parts, x, group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)


def reduce_scatter_to(out, y, group, gloo):
    if gloo:  # gloo has no reduce_scatter: all-reduce and keep ours (dry run only)
        full = y.clone()
        dist.all_reduce(full, group=group)
        out.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    else:
        dist.reduce_scatter_tensor(out, y, group=group)


def collect(timed, device, queued):
    """Per variant: the slowest rank's median, rank 0's runs, and against the unfused and GEMM-alone
    times of the same mode: speed-up and exposed communication. ``queued``: the runs were queued
    behind a GPU spin, so each variant also counts its late runs (most over ranks). Every rank makes
    the same collectives, whichever variants failed where."""
    res = {}
    for name, r in timed.items():
        err = r.get("error")
        r = None if err else r
        slow = slowest(None if r is None else r["median_ms"], device)
        res[name] = {"median_ms": slow, "rank0": r, "error": err}
        if queued:
            late = slowest(None if r is None else r.get("late_runs", 0), device)
            if late is not None:
                res[name]["late_runs"] = int(late)
    t_gemm, t_comm, t_unf = (res[k]["median_ms"] for k in ("gemm_alone", "comm_alone", "unfused"))
    for name, r in res.items():
        t = r["median_ms"]
        if t is None:
            continue
        r["speedup_vs_unfused"] = t_unf / t if t_unf else None
        if name not in ("gemm_alone", "comm_alone") and t_gemm is not None and t_comm:
            # sum_alone runs after the last GEMM, so all of it is exposed.
            r["exposed_comm_ms"] = t if name == "sum_alone" else t - t_gemm
            r["exposed_frac_of_unfused_comm"] = r["exposed_comm_ms"] / t_comm
    t_own = res.get("gemm_alone_uniep", {}).get("median_ms")
    for name, r in res.items():
        if ".arrival." in name and r["median_ms"] is not None and t_own and t_comm:
            # arrival runs ds_uniep's GEMM: its exposure over that GEMM alone too.
            r["exposed_vs_own_gemm_ms"] = r["median_ms"] - t_own
            r["exposed_vs_own_gemm_frac"] = r["exposed_vs_own_gemm_ms"] / t_comm
    return res


def slowest(value, device):
    """Max over ranks (NaN stays NaN only if every rank failed)."""
    t = torch.tensor([-1.0 if value is None else value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() < 0 else t.item()


class _Zero3Linear(torch.autograd.Function):
    """Unfused ZeRO-3-style linear: the weight's shards all-gathered (NCCL) before the forward GEMM
    and again before the input-gradient GEMM; the full weight gradient reduce-scattered (NCCL, in
    its dtype: the bytes ShardedLinear sends, whose sum is fp32 in rank order) after its GEMM."""

    @staticmethod
    def forward(ctx, x, shard, group, gloo):
        ctx.save_for_backward(x, shard)
        ctx.group, ctx.gloo = group, gloo
        return torch.nn.functional.linear(x, _gathered(shard, group, gloo))

    @staticmethod
    def backward(ctx, dy):
        x, shard = ctx.saved_tensors
        dx = dy @ _gathered(shard, ctx.group, ctx.gloo)
        dw = torch.empty_like(shard)
        reduce_scatter_to(dw, dy.t() @ x, ctx.group, ctx.gloo)
        return dx, dw, None, None


def _gathered(shard, group, gloo):
    full = shard.new_empty(dist.get_world_size(group) * shard.shape[0], *shard.shape[1:])
    all_gather_to(full, shard.detach().contiguous(), group, gloo)
    return full


def _fused_configs(a):
    """``(name, CommFuseConfig)`` of every fused variant to time: each transport, each schedule that
    has an all-to-all / data-parallel form, each chunk count."""
    from ds_uniep.config import CommFuseConfig
    for t in a.transports:
        for sch in [s for s in a.schedules if s in ("ring", "bidirectional_ring", "local_first")]:
            for c in a.num_chunks:
                yield f"cf.{t}.{sch}.c{c}", CommFuseConfig(schedule=sch, num_chunks=c, transport=t)


def _a2a(x, group):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def time_case(case, a, G, group, device, dtype, sync, modes):
    """Forward + backward of the Ulysses attention block or the sharded linear: CommFuse's fused
    forms against the unfused NCCL collectives + GEMMs, with two floors of the same mode:
    ``gemm_alone`` (the same GEMMs and attention, no communication) and ``comm_alone`` (the unfused
    form's collectives alone). Exposed communication = time - gemm_alone, as a share of comm_alone.

    ulysses: unfused = DeepSpeed's ``DistributedAttention`` between the ``nn.Linear`` projections
    (4 all-to-alls forward, 4 backward); gemm_alone = the projections and the attention on tensors
    of the all-to-alls' output shapes, made by reshaping the local ones.
    dp: unfused = all-gather + GEMM forward, all-gather + input-gradient GEMM and weight-gradient
    GEMM + reduce-scatter backward (ZeRO-3's collectives); gemm_alone = ``F.linear`` with the
    full weight, forward + backward."""
    import torch.nn.functional as F

    from ds_uniep.commfuse import ShardedLinear, UlyssesAttention
    H = a.hidden
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    variants = {}

    def step(mod, x, params):
        params = list(params)

        def run(*_):
            for t in [x] + params:
                t.grad = None  # no gradient accumulation in the timed runs
            mod(x).sum().backward()
        return run, None

    gloo = dist.get_backend(group) == "gloo"
    forwards = {}  # the unfused and fused forms' forwards, for the checks
    if case == "ulysses":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend(group))
        S = 8 * G * a.heads if a.dry_run else a.seq
        if S % G or a.heads % G or H % a.heads:
            raise SystemExit(f"ulysses: --seq ({S}) and --heads ({a.heads}) must be divisible by the {G} ranks, "
                             f"--hidden ({H}) by --heads")

        def attn(q, k, v):
            o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3))
            return o.permute(2, 0, 1, 3)

        qkv, out = torch.nn.Linear(H, 3 * H).to(device, dtype), torch.nn.Linear(H, H).to(device, dtype)
        dattn = DistributedAttention(attn, group, scatter_idx=2, gather_idx=0)
        d = H // a.heads

        def unfused(x):
            q, k, v = qkv(x).reshape(*x.shape[:2], 3, a.heads, d).unbind(2)
            return out(dattn(q, k, v, 1).reshape(*x.shape[:2], H))

        def compute_alone(x):
            q, k, v = (t.reshape(S, 1, a.heads // G, d) for t in qkv(x).reshape(*x.shape[:2], 3, a.heads, d).unbind(2))
            return out(attn(q, k, v).reshape(*x.shape[:2], H))

        blocks = [torch.randn(S // G, 1, a.heads, d, device=device, dtype=dtype) for _ in range(4)]

        def comm_alone(*_):
            for b in blocks + blocks:
                _a2a(b, group)

        x = torch.randn(S // G, 1, H, generator=gen, device=device, dtype=dtype).requires_grad_(True)
        dense = list(qkv.parameters()) + list(out.parameters())
        variants["gemm_alone"] = step(compute_alone, x, dense)
        variants["comm_alone"] = (comm_alone, None)
        variants["unfused"], forwards["unfused"] = step(unfused, x, dense), unfused
        for name, cfg in _fused_configs(a):
            mod = UlyssesAttention.from_linears(attn, group, qkv, out, a.heads, config=cfg)
            forwards[name] = fwd = (lambda x, mod=mod: mod(x, 1))
            variants[name] = step(fwd, x, dense + list(mod.parameters()))
    else:
        if a.ffn % G:
            raise SystemExit(f"dp: --ffn ({a.ffn}) must be divisible by the {G} ranks")
        T = 16 * G if a.dry_run else a.tokens // G
        full = torch.nn.Linear(H, a.ffn, bias=False).to(device, dtype)
        shard = full.weight.detach()[dist.get_rank() * (a.ffn // G):][:a.ffn // G].clone().requires_grad_(True)
        grad = torch.zeros(a.ffn, H, dtype=dtype, device=device)
        grad_shard = torch.empty(a.ffn // G, H, dtype=dtype, device=device)

        def comm_alone(*_):
            for _ in range(2):
                _gathered(shard, group, gloo)
            reduce_scatter_to(grad_shard, grad, group, gloo)

        x = torch.randn(T, H, generator=gen, device=device, dtype=dtype).requires_grad_(True)
        variants["gemm_alone"] = step(lambda x: F.linear(x, full.weight), x, [full.weight])
        variants["comm_alone"] = (comm_alone, None)
        forwards["unfused"] = lambda x: _Zero3Linear.apply(x, shard, group, gloo)  # noqa: E731
        variants["unfused"] = step(forwards["unfused"], x, [shard])
        for name, cfg in _fused_configs(a):
            mod = ShardedLinear.from_linear(full, group, cfg)
            variants[name], forwards[name] = step(mod, x, mod.parameters()), mod
    if device.type != "cuda":
        variants = {k: v for k, v in variants.items() if ".copy_engine." not in k}
    per_mode = {}
    for mode, before in modes.items():
        timed = bench_interleaved(variants, a.warmup, a.repeats, sync=sync, cuda=device.type == "cuda",
                                  on_error=lambda n, e: dist.get_rank() == 0 and traceback.print_exception(e),
                                  before=before)
        per_mode[mode] = collect(timed, device, before is not None)
    best = min((k for k in per_mode["launched"] if k.startswith("cf.") and per_mode["launched"][k]["median_ms"]),
               key=lambda k: per_mode["launched"][k]["median_ms"], default=None)
    timeline = profiled_timeline(variants[best][0], device) if best else None
    with torch.no_grad():
        ref = forwards["unfused"](x).float()
        checks = {k: (f(x).float() - ref).abs().max().item() for k, f in forwards.items() if k in variants and k != "unfused"}
    return per_mode, best, timeline, checks


def profiled_timeline(run, device):
    """Rank 0's kernels of one run (after a warm one), from torch's profiler: NCCL kernels and
    copies as transfers, the rest as compute. Spans in ms from the first kernel's start."""
    if device.type != "cuda":
        return {"spans": [], "transfer_after_last_compute_ms": float("nan"), "error": "needs CUDA"}
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    if not kernels:
        return {"spans": [], "transfer_after_last_compute_ms": float("nan"), "error": "no kernels profiled"}
    t0 = min(e.time_range.start for e in kernels)
    spans = []
    for i, e in enumerate(sorted(kernels, key=lambda e: e.time_range.start)):
        n = e.name.lower()
        kind = "transfer" if "nccl" in n or "memcpy" in n else "gemm"
        spans.append((kind, i, (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3))
    t_end = max([e for k, _, _, e in spans if k == "transfer"], default=0.0)
    g_end = max([e for k, _, _, e in spans if k != "transfer"], default=0.0)
    return {"spans": spans, "transfer_after_last_compute_ms": max(0.0, t_end - g_end)}
