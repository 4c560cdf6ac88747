"""CommFuse against unfused NCCL collectives + GEMM and PyTorch's symmetric-memory fused ops.

    torchrun --nproc_per_node 4 benchmarks/bench_commfuse.py --out bench_out/commfuse

Llama-70B-like MLP shapes by default (hidden 8192, FFN 28672, 8192 tokens in
total split over the G tensor-parallel ranks), bf16, forward:

* all_gather_matmul (up projection): x_shard ``[T/G, H]`` @ w ``[H, F/G]`` -> ``[T, F/G]``, w given as
  ``weight.t()`` of an ``nn.Linear``-layout ``[F/G, H]`` weight, as ``ColumnParallelLinear`` passes it
  (``--weight-layout kn``: a contiguous ``[H, F/G]`` tensor instead, the layout of the older results in docs/results)
* matmul_reduce_scatter (down projection): x ``[T, F/G]`` @ w ``[F/G, H]`` -> ``[T/G, H]``, w given as
  ``weight.t()`` of an ``[H, F/G]`` weight, as ``RowParallelLinear`` passes it (``kn``: contiguous)

Per op, in one run: GEMM alone, collective alone, unfused (collective then
GEMM, or GEMM then collective), ``torch.ops.symm_mem`` fused op, and CommFuse
per transport (``p2p``: NCCL send/recv; ``copy_engine``: copies into peers'
symmetric buffers), schedule and chunk count (``p2p``: messages per step; copy engine,
reduce-scatter only, ``--ce-chunks``: row chunks of the own partial's GEMM and closing sum;
``relay``, reduce-scatter only: row chunks of every step's GEMM, on either transport),
named ``cf.<transport>.<schedule>.c<chunks>``. On CUDA every variant is timed twice: launched
(each run after a host barrier, so the ranks' launch skew counts) and queued (each run after a
GPU spin and a GPU-side barrier, so every GPU starts at once with the run's launches queued, as
in a training step whose launches run ahead). Where the copy-engine transport runs, floors
that its schedules cannot beat: ``gemm_blocks`` (the G block GEMMs the ring schedules split the
GEMM into, no communication), ``gemm_local_first`` (all-gather: the GEMMs ``local_first`` splits
it into on this rank: its own block, then each run of the others' rows), ``sum_alone``
(reduce-scatter: the rank-order fp32 sum of the G partials, which follows the last GEMM),
``gemm_relay.c<C>`` (with the ``relay`` schedule: its GEMMs alone, C row chunks per step, each
from the second step on adding a running sum in its epilogue) and
``gemm_beside_copies`` (the whole GEMM while the same bytes are copied into the peers' symmetric
buffers on a side stream, nothing waiting on anything: what the GEMM costs beside the
transfers). With the ``arrival`` schedule (all-gather on ds_uniep's grouped GEMM, one launch;
copy engine only, skipped on gloo) also ``gemm_alone_uniep``: that GEMM alone over the gathered
rows with the configuration ``arrival`` runs; ``arrival``'s exposure over it is reported beside
the one over the cuBLAS GEMM alone (``exposed_vs_own_gemm``). Exposed communication = time - GEMM alone (for ``sum_alone``: its time), as a
fraction of the collective-alone time. Times are the slowest rank's median; the variants take
turns run by run (``timing.bench_interleaved``), so a drift of the clocks weighs on all alike.
``--cases ulysses dp`` time forward + backward of ``UlyssesAttention`` (against DeepSpeed's
``DistributedAttention`` between the same ``nn.Linear`` projections) and of ``ShardedLinear``
(against ZeRO-3's collectives: weight all-gather before the forward and the input-gradient GEMMs,
reduce-scatter after the weight-gradient GEMM), each with the floors ``gemm_alone`` (the same
GEMMs and attention with no communication) and ``comm_alone`` (the unfused collectives alone).
Writes ``commfuse_results.json`` and ``commfuse_timeline.png`` (CUDA events per
step: transfers on the side stream, GEMMs and adds on the compute stream; for the Ulysses and DP
cases, the fastest fused variant's kernels from torch's profiler: NCCL kernels and copies as
transfers, the rest as compute) to
``--out``; prints the table last. ``--dry-run`` runs tiny shapes on CPU/gloo to
check the harness.
"""
import argparse
import json
import math
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import bench_interleaved, queued_start, rotating  # noqa: E402
from commfuse_cases import all_gather_to, collect, reduce_scatter_to, time_case  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=8192, help="H, model width")
    p.add_argument("--ffn", type=int, default=28672, help="F, MLP width (all ranks together)")
    p.add_argument("--tokens", type=int, default=8192, help="T, tokens in total (split over ranks)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--schedules", nargs="+", default=["ring", "bidirectional_ring", "local_first", "arrival"],
                   choices=["ring", "bidirectional_ring", "local_first", "arrival", "relay"],
                   help="arrival runs on the copy engine only (all-gather; its reduce-scatter is bidirectional_ring); "
                   "relay is timed for the reduce-scatter only (its all-gather is ring's), its chunk counts from "
                   "--num-chunks (p2p) and --ce-chunks (copy engine)")
    p.add_argument("--weight-layout", choices=["linear", "kn"], default="linear",
                   help="w: weight.t() of an nn.Linear-layout weight (what ColumnParallelLinear and "
                   "RowParallelLinear pass) or a contiguous [K, N] tensor")
    p.add_argument("--num-chunks", type=int, nargs="+", default=[1], help="CommFuse chunk counts to time (p2p)")
    p.add_argument("--ce-chunks", type=int, nargs="+", default=[1, 4],
                   help="chunk counts to time on the copy engine (reduce-scatter only: its own partial's GEMM and "
                   "the closing sum in that many row chunks)")
    p.add_argument("--transports", nargs="+", default=["p2p", "copy_engine"], choices=["p2p", "copy_engine"],
                   help="CommFuse transports to time (copy_engine needs CUDA; skipped on gloo)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--pool", type=int, default=3, help="fresh input sets cycled through the runs")
    p.add_argument("--skip-symm-mem", action="store_true", help="do not time torch.ops.symm_mem")
    p.add_argument("--queue-spin-ms", type=float, default=3.0,
                   help="queued timing (CUDA): GPU spin ahead of each run, longer than any variant takes to launch")
    p.add_argument("--out", default="bench_out/commfuse", help="directory for the JSON and the PNG")
    p.add_argument("--cases", nargs="+", default=["tp"], choices=["tp", "ulysses", "dp"],
                   help="tp: the two ops above; ulysses: UlyssesAttention against DeepSpeed's DistributedAttention "
                   "with nn.Linear projections (forward + backward); dp: ShardedLinear against all-gather + GEMM "
                   "and GEMM + reduce-scatter with NCCL collectives (forward + backward)")
    p.add_argument("--seq", type=int, default=32768, help="ulysses: S, sequence length (all ranks together)")
    p.add_argument("--heads", type=int, default=64, help="ulysses: attention heads (head dim = --hidden / --heads)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, 1 warm-up, 2 repeats, gloo on CPU: checks the script, times nothing useful")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- variants
def _commfuse_points(a, gloo, op):
    """``(name, transport, schedule, chunks)`` of every CommFuse variant of ``op`` to time."""
    out = []
    for t in a.transports:
        if t == "copy_engine" and gloo:
            continue
        for s in a.schedules:
            if (s == "arrival" and t != "copy_engine") or (s == "relay" and op != "matmul_reduce_scatter"):
                continue
            ce = a.ce_chunks if op == "matmul_reduce_scatter" and s != "arrival" else [1]
            for c in (a.num_chunks if t == "p2p" else ce):
                out.append((f"cf.{t}.{s}.c{c}", t, s, c))
    return out


def _variants(op, a, G, group, device, dtype, gloo, symm):
    """``{name: (fn, setup)}`` for one op. Shapes from ``a`` (parsed args)."""
    from ds_uniep.commfuse import all_gather_matmul_impl, even_split, matmul_reduce_scatter_impl
    H, F, T = a.hidden, a.ffn // G, a.tokens
    rank = dist.get_rank(group)
    sizes = even_split(T, G)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)

    def rnd(*shape):
        # Fresh, rank-specific and never zero; scaled so bf16 sums stay in range.
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) / math.sqrt(shape[-1])
        return t.to(dtype)

    out = {}
    if op == "all_gather_matmul":
        inputs = rotating(lambda i: (rnd(T // G, H), _weight(rnd, H, F, a)), a.pool)
        full = rotating(lambda i: (rnd(T, H), _weight(rnd, H, F, a)), a.pool)
        gathered = torch.empty(T, H, dtype=dtype, device=device)

        def unfused(x, w):
            all_gather_to(gathered, x, group, gloo)
            return gathered @ w

        out["gemm_alone"] = (lambda x, w: x @ w, full)
        out["comm_alone"] = (lambda x, w: all_gather_to(gathered, x, group, gloo), inputs)
        out["unfused"] = (unfused, inputs)
        if symm:
            name = group.group_name
            out["torch_symm_mem"] = (
                lambda x, w: torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 0, name, return_A=False)[1][0],
                inputs)
        for key, t, s, c in _commfuse_points(a, gloo, op):
            out[key] = (lambda x, w, s=s, c=c, t=t: all_gather_matmul_impl(
                x, w, group, s, c, shard_sizes=sizes, transport=t, keep_full=False)[0], inputs)
    else:
        inputs = rotating(lambda i: (rnd(T, F), _weight(rnd, F, H, a)), a.pool)
        partials = rotating(lambda i: (rnd(T, H), ), a.pool)
        scattered = torch.empty(T // G, H, dtype=dtype, device=device)

        def unfused(x, w):
            reduce_scatter_to(scattered, x @ w, group, gloo)
            return scattered

        out["gemm_alone"] = (lambda x, w: x @ w, inputs)
        out["comm_alone"] = (lambda y: reduce_scatter_to(scattered, y, group, gloo), partials)
        out["unfused"] = (unfused, inputs)
        if symm:
            name = group.group_name
            out["torch_symm_mem"] = (
                lambda x, w: torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w, "sum", 0, name), inputs)
        for key, t, s, c in _commfuse_points(a, gloo, op):
            out[key] = (lambda x, w, s=s, c=c, t=t: matmul_reduce_scatter_impl(
                x, w, group, s, c, out_sizes=sizes, transport=t)[0], inputs)
    if "copy_engine" in a.transports and not gloo:
        out.update(_floors(op, a, G, group, device, dtype, rnd))
        if op == "all_gather_matmul" and "arrival" in a.schedules:
            out["gemm_alone_uniep"] = (_uniep_gemm(T, device), full)
    return out


def _uniep_gemm(T, device):
    """ds_uniep's grouped GEMM over all T rows (one group) with the configuration the ``arrival``
    schedule runs."""
    from ds_uniep.commfuse.arrival import default_config
    from ds_uniep.gemm import grouped_mm
    offs = torch.tensor([T], dtype=torch.int32, device=device)

    def run(x, w):
        wt = w.t().contiguous().unsqueeze(0)  # a view, no copy, for the default weight layout
        return grouped_mm(x, wt, offs, "fwd", default_config())
    return run


def _weight(rnd, K, N, a):
    """``w [K, N]``: ``weight.t()`` of an ``nn.Linear``-layout ``[N, K]`` weight, as the parallel linears
    pass it (``--weight-layout linear``), or a contiguous ``[K, N]``."""
    return rnd(N, K).t() if a.weight_layout == "linear" else rnd(K, N)


def _floors(op, a, G, group, device, dtype, rnd):
    """``{name: (fn, setup)}``: the copy-engine transport's floors (see the module doc)."""
    from ds_uniep.commfuse.copy_engine import _workspace
    from ds_uniep.commfuse.common import ordered_sum, side_stream
    H, F, T = a.hidden, a.ffn // G, a.tokens
    rank = dist.get_rank(group)
    # All-gather moves x's row blocks [T/G, H], reduce-scatter partials of the same shape.
    K, N = (H, F) if op == "all_gather_matmul" else (F, H)
    inputs = rotating(lambda i: (rnd(T, K), _weight(rnd, K, N, a)), a.pool)  # w as the op's variants take it
    block_rows = T // G
    ws = _workspace(group, device, G * block_rows * H * torch.empty(0, dtype=dtype).element_size())
    block = rnd(block_rows, H)
    out = torch.empty(T, N, dtype=dtype, device=device)

    def gemms_over(runs):
        """One GEMM per ``(first row, rows)`` run, into ``out``'s same rows."""
        def run(x, w):
            for r0, n in runs:
                torch.matmul(x[r0:r0 + n], w, out=out[r0:r0 + n])
            return out
        return run

    def beside(x, w):
        compute = torch.cuda.current_stream(device)
        comm = side_stream(device, compute)
        comm.wait_stream(compute)
        torch.matmul(x, w, out=out)
        with torch.cuda.stream(comm):
            for d in range(1, G):  # the same peers in the same order as the ring's copies
                p = (rank + d) % G
                ws.view(p, (G, block_rows, H), dtype)[rank].copy_(block)
        compute.wait_stream(comm)
        return out

    floors = {"gemm_blocks": (gemms_over([(b * block_rows, block_rows) for b in range(G)]), inputs),
              "gemm_beside_copies": (beside, inputs)}
    if op == "all_gather_matmul":
        from ds_uniep.commfuse.common import _remote_runs
        runs = [(rank * block_rows, block_rows)] + [(r0, n) for r0, n, _ in _remote_runs([block_rows] * G, rank)]
        floors["gemm_local_first"] = (gemms_over(runs), inputs)
    else:
        parts = rotating(lambda i: tuple(rnd(block_rows, N) for _ in range(G)), a.pool)
        floors["sum_alone"] = (lambda *p: ordered_sum(list(p)), parts)
        if "relay" in a.schedules:
            from ds_uniep.commfuse.relay import acc_mm, relay_chunks
            running = torch.zeros(block_rows, N, dtype=torch.float32, device=device)

            def relay_gemms(chunks):
                """The relay's GEMMs, no communication: per block its row chunks, the running sum
                (here a local buffer) as C from the second step on."""
                def run(x, w):
                    for s in range(G):
                        b = (rank - s - 1) % G
                        for c0, n in relay_chunks(block_rows, chunks):
                            rows = x[b * block_rows + c0:b * block_rows + c0 + n]
                            acc_mm(rows, w, running[c0:c0 + n] if s else None)
                    return out
                return run
            for c in a.ce_chunks:
                floors[f"gemm_relay.c{c}"] = (relay_gemms(c), inputs)
    return floors


def _is_bare(name):
    """Floors that run only part of the op (some of its GEMMs, or its sum): not checked."""
    return (name in ("gemm_blocks", "gemm_local_first", "sum_alone", "gemm_alone_uniep")
            or name.startswith("gemm_relay"))


def _checks(op, variants, G, group, gloo, points):
    """Max |difference| of every variant's output against the unfused one, on the same input."""
    fn0, setup = variants["unfused"]
    args = setup(0)
    ref = fn0(*args).float().clone()
    out = {}
    for name, (fn, _) in variants.items():
        if name in ("unfused", "gemm_alone", "comm_alone", "gemm_beside_copies") or _is_bare(name):
            continue
        try:
            out[name] = (fn(*args).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[name] = f"error: {type(e).__name__}: {e}"
    if op == "all_gather_matmul" and not gloo:
        # Bitwise promise: the same GEMMs as all_gather then the reference's GEMMs (block-wise, or
        # local_first's row groups); local_first is also compared with block-wise.
        from ds_uniep.commfuse import all_gather_matmul_impl, ref_all_gather_matmul
        x, w = args
        gathered = torch.empty(x.shape[0] * G, x.shape[1], dtype=x.dtype, device=x.device)
        all_gather_to(gathered, x.contiguous(), group, gloo)
        blocks = list(gathered.chunk(G))
        blockwise = torch.cat([b.clone() @ w for b in blocks])
        grouped = ref_all_gather_matmul(blocks, w, dist.get_rank(group))
        refs = {"local_first": grouped}
        if any(p[2] == "arrival" for p in points):
            refs["arrival"] = ref_all_gather_matmul(blocks, w, gemm="uniep")
        for name, t, sched, c in points:
            y = all_gather_matmul_impl(x, w, group, sched, c, transport=t)[0]
            out[name + "_bitwise_vs_reference"] = bool(torch.equal(y, refs.get(sched, blockwise)))
            if sched in ("local_first", "arrival"):
                out[name + "_max_diff_vs_blockwise"] = (y.float() - blockwise.float()).abs().max().item()
    if op == "matmul_reduce_scatter":
        # Bitwise promise: every rank's partials (its GEMMs: local_first's row groups, the copy
        # engine's own partial in row chunks) added in rank order in fp32 (reference.py); relay:
        # the fp32 products added along the ring, per chunk.
        from ds_uniep.commfuse import (matmul_reduce_scatter_impl, ref_matmul_reduce_scatter,
                                       ref_matmul_reduce_scatter_relay)
        x, w = args
        me = dist.get_rank(group)
        xs = [torch.empty_like(x) for _ in range(G)]
        dist.all_gather(xs, x.contiguous(), group=group)
        base = w if w.is_contiguous() else w.t().contiguous()  # the weight as its rank holds it
        bases = [torch.empty_like(base) for _ in range(G)]
        dist.all_gather(bases, base, group=group)
        ws = bases if w.is_contiguous() else [b.t() for b in bases]
        for name, t, sched, c in points:
            lf = sched == "local_first"
            if sched == "relay":
                ref = ref_matmul_reduce_scatter_relay(xs, ws, num_chunks=c)[me]
            else:
                ref = ref_matmul_reduce_scatter(xs, ws, local_first=lf, own_chunks=c if t == "copy_engine" else 1)[me]
            y = matmul_reduce_scatter_impl(x, w, group, sched, c, transport=t)[0]
            out[name + "_bitwise_vs_reference"] = bool(torch.equal(y, ref))
    return out


def _timeline(op, a, G, group, device, dtype, schedule, num_chunks, transport):
    from ds_uniep.commfuse import Timeline, all_gather_matmul_impl, even_split, matmul_reduce_scatter_impl
    H, F, T = a.hidden, a.ffn // G, a.tokens
    sizes = even_split(T, G)
    if op == "all_gather_matmul":
        x = torch.randn(T // G, H, device=device, dtype=dtype)
        w = _weight(lambda *sh: torch.randn(*sh, device=device, dtype=dtype), H, F, a)
        run = lambda tl: all_gather_matmul_impl(x, w, group, schedule, num_chunks, sizes, timeline=tl,  # noqa
                                                transport=transport, keep_full=False)
    else:
        x = torch.randn(T, F, device=device, dtype=dtype)
        w = _weight(lambda *sh: torch.randn(*sh, device=device, dtype=dtype), F, H, a)
        run = lambda tl: matmul_reduce_scatter_impl(x, w, group, schedule, num_chunks, sizes, timeline=tl,  # noqa
                                                    transport=transport)
    run(None)  # warm
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=group)
    tl = Timeline()
    run(tl)
    if device.type == "cuda":
        torch.cuda.synchronize()
    spans = tl.spans_ms()
    t_end = max([e for k, _, _, e in spans if k == "transfer"], default=0.0)
    g_end = max([e for k, _, _, e in spans if k != "transfer"], default=0.0)
    return {"spans": spans, "transfer_after_last_compute_ms": max(0.0, t_end - g_end)}


def _plot(timelines, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(timelines)
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.6 + 1.2 * len(keys)), squeeze=False)
    colors = {"transfer": "tab:orange", "gemm": "tab:blue", "reduce": "tab:green"}
    for ax, key in zip(axes[:, 0], keys):
        for kind, step, s, e in timelines[key]["spans"]:
            lane = 1 if kind == "transfer" else 0
            ax.barh(lane, max(e - s, 1e-6), left=s, color=colors.get(kind, "grey"), edgecolor="black", height=0.6)
            ax.text((s + e) / 2, lane, str(step), ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["compute", "comm"])
        tail = timelines[key]["transfer_after_last_compute_ms"]
        ax.set_title(f"{key}: transfer left after the last GEMM/add: {tail:.3f} ms", fontsize=9)
    axes[-1, 0].set_xlabel("ms (rank 0)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    a = parse_args(argv)
    if a.dry_run:
        a.warmup, a.repeats, a.pool = 1, 2, 2
    if not dist.is_initialized():
        backend = "gloo" if a.dry_run or not torch.cuda.is_available() else "nccl"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    group = dist.group.WORLD
    G, rank = dist.get_world_size(), dist.get_rank()
    gloo = dist.get_backend(group) == "gloo"
    device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
    if a.dry_run:
        a.hidden, a.ffn, a.tokens, a.heads = 64, 48 * G, 16 * G, 4
    if a.ffn % G or a.tokens % G:
        raise SystemExit(f"--ffn ({a.ffn}) and --tokens ({a.tokens}) must be divisible by the {G} ranks")
    dtype = DTYPES[a.dtype]

    symm, symm_note = False, None
    if a.skip_symm_mem:
        symm_note = "skipped (--skip-symm-mem)"
    elif device.type != "cuda":
        symm_note = "skipped: needs CUDA"
    else:
        try:
            import torch.distributed._symmetric_memory as symm_mem
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated (and unnecessary) on newer torch
                symm_mem.enable_symm_mem_for_group(group.group_name)
            symm = True
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            symm_note = f"unavailable: {type(e).__name__}: {e}"

    results = {"config": {k: v for k, v in vars(a).items()}, "world_size": G,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "symm_mem": symm_note or "enabled", "ops": {}}
    timelines = {}
    if gloo:
        sync = (lambda: dist.barrier(group=group))  # noqa: E731
    else:
        sync = (lambda: dist.barrier(group=group, device_ids=[device.index]))  # noqa: E731
    modes = {"launched": None}
    if device.type == "cuda":
        modes["queued"] = queued_start(a.queue_spin_ms, group)
    for case in [c for c in a.cases if c != "tp"]:
        per_mode, best, timeline, checks = time_case(case, a, G, group, device, dtype, sync, modes)
        results["ops"][case] = {"times": per_mode["launched"], "checks": checks}
        if "queued" in per_mode:
            results["ops"][case]["times_queued"] = per_mode["queued"]
        if timeline is not None:
            timelines[f"{case} {best[3:]} (fwd+bwd)"] = timeline
    for op in (("all_gather_matmul", "matmul_reduce_scatter") if "tp" in a.cases else ()):
        variants = _variants(op, a, G, group, device, dtype, gloo, symm)
        per_mode = {}
        for mode, before in modes.items():
            # Variants take turns, so a drift of the clocks over the run weighs on all of them alike.
            timed = bench_interleaved(variants, a.warmup, a.repeats, sync=sync, cuda=device.type == "cuda",
                                      on_error=lambda n, e: rank == 0 and traceback.print_exception(e),
                                      before=before)
            per_mode[mode] = collect(timed, device, before is not None)
        res = per_mode["launched"]
        try:
            checks = _checks(op, variants, G, group, gloo, _commfuse_points(a, gloo, op))
        except Exception as e:  # noqa: BLE001
            checks = {"error": f"{type(e).__name__}: {e}"}
        results["ops"][op] = {"times": res, "checks": checks}
        if "queued" in per_mode:
            results["ops"][op]["times_queued"] = per_mode["queued"]
        for _, t, s, c in _commfuse_points(a, gloo, op):
            if c != (a.num_chunks[0] if t == "p2p" else max(a.ce_chunks if op == "matmul_reduce_scatter" else [1])):
                continue
            key = f"{op} {t} {s} c{c}"
            try:
                timelines[key] = _timeline(op, a, G, group, device, dtype, s, c, t)
            except Exception as e:  # noqa: BLE001
                timelines[key] = {"spans": [], "transfer_after_last_compute_ms": float("nan"),
                                  "error": f"{type(e).__name__}: {e}"}
        del variants
    results["timeline_rank0"] = timelines

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        png = os.path.join(a.out, "commfuse_timeline.png")
        if timelines:
            _plot(timelines, png)
            results["timeline_png"] = png
        with open(os.path.join(a.out, "commfuse_results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        seq = f" S={8 * G * a.heads if a.dry_run else a.seq} heads={a.heads}" if "ulysses" in a.cases else ""
        print(f"\nCommFuse, {G} ranks, {results['device']}, H={a.hidden} F={a.ffn} T={a.tokens}{seq} {a.dtype}; "
              f"slowest rank's median of {a.repeats}; symm_mem: {results['symm_mem']}")
        print("launched: each run starts after a host barrier (the ranks' launch skew counts); queued: after a "
              f"{a.queue_spin_ms:g} ms GPU spin and a GPU-side barrier (the GPU work alone, launches queued ahead)")
        head = f"{'ms':>9} {'vs unf.':>8} {'exposed':>8}"
        print(f"{'op':<22} {'variant':<34} {head} |{head}  check")

        def cells(r):
            if r is None or r["median_ms"] is None:
                return f"{'failed':>9} {'':>8} {'':>8}"
            sp, ex = r.get("speedup_vs_unfused"), r.get("exposed_frac_of_unfused_comm")
            late = "*" if r.get("late_runs") else ""
            return (f"{r['median_ms']:8.3f}{late:1s} {'' if sp is None else f'{sp:7.2f}x':>8} "
                    f"{'' if ex is None else f'{100 * ex:7.1f}%':>8}")

        for op, d in results["ops"].items():
            queued = d.get("times_queued", {})
            for name, r in d["times"].items():
                chk = d["checks"].get(name, "")
                bit = d["checks"].get(name + "_bitwise_vs_reference")
                chk = (f"max|d|={chk:.3g}" if isinstance(chk, float) else str(chk)) + \
                    ("" if bit is None else f" bitwise={bit}")
                if r["median_ms"] is None:
                    chk = f"{r['error']} {chk}"
                if "exposed_vs_own_gemm_frac" in r:
                    q = queued.get(name, {}).get("exposed_vs_own_gemm_frac")
                    chk += f" exposed over gemm_alone_uniep {100 * r['exposed_vs_own_gemm_frac']:.1f}%" + \
                        ("" if q is None else f" | {100 * q:.1f}%")
                print(f"{op:<22} {name:<34} {cells(r)} |{cells(queued.get(name)) if queued else ''}  {chk}")
        if any(r.get("late_runs") for d in results["ops"].values() for r in d.get("times_queued", {}).values()):
            print("*: some queued runs started before their launches ended (raise --queue-spin-ms)")
        print(f"timeline: {png}; JSON: {os.path.join(a.out, 'commfuse_results.json')}")
    dist.barrier(group=group)
    return results


def failed_checks(results):
    """What the checks of ``main``'s results found wrong: a check run that raised, a variant whose
    check raised, a bitwise promise not kept. Empty when every check held."""
    bad = []
    for op, d in results["ops"].items():
        checks = d["checks"]
        if "error" in checks:
            bad.append(f"{op}: the checks raised {checks['error']}")
            continue
        for name, v in checks.items():
            if isinstance(v, str):
                bad.append(f"{op} {name}: {v}")
            elif name.endswith("_bitwise_vs_reference") and not v:
                bad.append(f"{op} {name[:-len('_bitwise_vs_reference')]}: not bitwise the reference")
    return bad


if __name__ == "__main__":
    failed = failed_checks(main())
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        sys.exit("bench_commfuse: checks failed:\n  " + "\n  ".join(failed))
