"""Dispatch and combine of NVLinkDispatcher against the NVLink peer copy and NCCL all_to_all_single.

    torchrun --nproc_per_node N benchmarks/bench_dispatch.py --out dispatch.json
    torchrun --nproc_per_node 4 benchmarks/bench_dispatch.py --tokens 8192 --combine-variants 16/0/0.5 32/0/0.5/q

Per rank: T tokens [T, M] bf16, top-k routing over E = 32 * N / 4 experts (at least k),
each token's k experts distinct. Payload = T * k * M * 2 bytes per rank (every pair row;
the NCCL baseline exchanges the same buffer with equal splits). GB/s = bytes / time; the
bytes counted are those leaving each rank (pairs routed to other ranks; for NCCL
(G-1)/G of its buffer); the ceiling is one large GPU0 -> GPU1 tensor copy measured in the same run. Times are the
median of CUDA-event timings after warm-up, each iteration started behind a barrier, the slowest
rank's, taken two ways: "launched" (the GPU starts on the first kernel while the host still
launches the rest, so host launch time between kernels counts) and "queued" (every launch is
queued behind a GPU spin and a GPU-side barrier first, so the GPU work alone is timed from a
common start, as in a training step whose launches run ahead of the GPU; each run checks that
the spin outlasted the launches).
Rows: NCCL alone and NCCL as a dispatch needs it (rows permuted into destination
order first); the megakernel dispatch receiving in place (its direct region) and
through staging plus copy-out; the NVLink stores alone; FP8; combine (the dispatcher's
default, chunked push+reduce in one kernel with the pushing warps sharing one queue, then the
variants of COMBINE_VARIANTS (or of --combine-variants), and the copy-engine
combine of the pipelined schedule in one chunk (each (expert, source) segment copied into its
source's combine buffer by cudaMemcpyAsync, one stream per destination, then the slot-order
sum; it needs the exact-R dispatch, whose host sync comes before it and is not timed), each
checked bitwise against the default; the script exits non-zero after its table when one is not).
At each SM budget of ``--sms`` (default 24, DeepEP's test budget, and every SM) ds_uniep's bf16
dispatch and combine are timed beside DeepEP's intranode ones (``deep_ep.Buffer``, built from its
source: benchmarks/README.md; left out, saying why, where it is not importable).
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from timing import queued_start


# Combine variants timed beside the default (combine_chunks, combine_reduce_blocks, pushing blocks as a
# share of num_blocks (one per SM), combine_queue); every one must give the default's bits.
# (0, None, _, _): push, then reduce, as two kernels; None: the dispatcher's default (half).
COMBINE_VARIANTS = [(0, None, 1, False), (16, None, 1, False), (16, None, 1 / 2, False), (16, None, 1 / 4, False),
                    (16, None, None, False), (8, None, None, False), (32, None, None, False),
                    (4, None, None, True), (8, None, None, True), (16, None, None, True), (16, None, 1, True)]


def parse_variant(text):
    """``"C/R/S[/q[/s]]"`` -> a COMBINE_VARIANTS entry plus the fence flag (R 0 and S 0 mean the
    dispatcher's defaults; ``/q``: the pushing warps share one queue, ``combine_queue``, each
    fencing at GPU scope; ``/q/s``: each fencing at system scope, ``combine_queue_gpu_fence=False``)."""
    fields = text.split("/")
    queue = len(fields) >= 4 and fields[3] == "q"
    sys_fence = queue and len(fields) == 5 and fields[4] == "s"
    try:
        if len(fields) != 3 + queue + sys_fence:
            raise ValueError
        chunks, reducers, share = int(fields[0]), int(fields[1]), float(fields[2])
    except ValueError:
        raise SystemExit(f"--combine-variants: {text!r} is not chunks/reduce_blocks/push_share[/q[/s]], "
                         "e.g. 16/0/0.5, 16/0/0.5/q or 16/0/0.5/q/s") from None
    if chunks < 0 or reducers < 0 or not 0 <= share <= 1:
        raise SystemExit(f"--combine-variants: {text!r} has a negative count or a share outside [0, 1]")
    return chunks, reducers or None, share or None, queue, sys_fence


def _median_over_ranks(times, device):
    t = torch.tensor(times, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank bounds a collective step
    return statistics.median(t.tolist())


def timed(fn, iters, warmup, device):
    """``(launched, queued, host)``: median milliseconds of fn() over iters runs (CUDA events),
    after warmup runs, each run started behind a barrier; per run the slowest rank's time.
    ``launched``: host barrier, then the GPU starts on fn's first kernel while the host still
    launches the rest, so host launch time between kernels counts, and so does the skew with
    which ranks leave the host barrier. ``queued``: the stream first spins (torch.cuda._sleep,
    the same length on every rank, longer than fn takes to launch) and then passes a GPU-side
    barrier, so fn starts at the same moment on every GPU with all its launches queued: the GPU
    work alone, as in a training step whose launches run ahead of the GPU. Every queued run
    checks that the spin outlasted the launches. ``host``: this rank's median host time to
    launch fn (warm-up runs)."""
    host = []
    for _ in range(warmup):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sleep = torch.tensor([3 * statistics.median(host) * 1e3 + 0.2], device=device)
    dist.all_reduce(sleep, op=dist.ReduceOp.MAX)
    sleep_ms = float(sleep)
    launched, queued = [], []
    for mode, times in (("launched", launched), ("queued", queued)):
        while len(times) < iters:
            dist.barrier()
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if mode == "queued":
                queued_start(sleep_ms)()
            start.record()
            fn()
            end.record()
            # Whether the GPU reached the start before the last launch: then this run timed launches too.
            late = torch.tensor([float(mode == "queued" and start.query())], device=device)
            end.synchronize()
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
            if late.item():
                sleep_ms *= 2  # every rank drops the run and spins longer
                continue
            times.append(start.elapsed_time(end))
    return _median_over_ranks(launched, device), _median_over_ranks(queued, device), statistics.median(host) * 1e3


def peer_copy_gbps(nbytes, iters, device):
    """GPU0 -> GPU1 copy bandwidth (rank 0 measures; broadcast to all)."""
    out = torch.zeros(1, device=device)
    if dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        src = torch.randint(0, 255, (nbytes, ), dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        for _ in range(3):
            dst.copy_(src)
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        out[0] = nbytes / (statistics.median(times) * 1e-3) / 1e9
        del src, dst
    dist.broadcast(out, 0)
    return float(out[0])


def sm_budget_rows(a, x, idx, gates, E, G, M, k, dev, put, results):
    """ds_uniep's bf16 dispatch (in place) and combine, and DeepEP's intranode dispatch and combine (its V1
    line, cached handle as its own test times them, and the dispatch with its layout), at each SM budget of
    ``--sms``. Returns ``(label, key, deduplicated bytes)`` per row; without DeepEP its rows are left out
    and ``results["deepep_why_not"]`` says why."""
    from ds_uniep.config import UniEPConfig
    from ds_uniep.megakernel import NVLinkDispatcher
    all_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for sms in a.sms:
        n = sms or all_sms
        cfg = UniEPConfig.from_dict({"max_tokens_per_rank": x.shape[0], "overlap": {"num_comm_sms": n}})
        disp = NVLinkDispatcher.from_config(f"bench.sms{n}", E, G, M, k, torch.bfloat16, cfg)
        disp.padded_recv = True
        state = {}

        def dispatch():
            state.pop("recv", None)
            state["recv"], _, state["handle"] = disp.dispatch(x, idx)

        put(f"uniep_sms{n}_dispatch", dispatch)
        dispatch()
        recv, h = state["recv"], state["handle"]
        put(f"uniep_sms{n}_combine", lambda: disp.combine(recv, gates, h))
        rows += [(f"dispatch bf16, {n} SMs (ds_uniep, layout+stores)", f"uniep_sms{n}_dispatch", True),
                 (f"combine bf16, {n} SMs (ds_uniep)", f"uniep_sms{n}_combine", False)]
        disp.check(synchronize=True)
        disp = state = recv = h = None
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from deepep_layer import import_deep_ep, make_buffer
        deep_ep = import_deep_ep()
        budgets = [(sms or all_sms) // 2 * 2 for sms in a.sms]
        # DeepEP sizes its buffer for the SM count set when it is made (a channel per two SMs): make it at the
        # largest budget, which serves the smaller ones
        deep_ep.Buffer.set_num_sms(max(budgets))
        buf = make_buffer(deep_ep, dist.group.WORLD, M * 2)
    except Exception as e:  # noqa: BLE001 - the table says why
        results["deepep_why_not"] = f"{type(e).__name__}: {e}"
        return rows
    topk_idx, weights = idx.long(), gates.float().contiguous()
    for n in budgets:
        deep_ep.Buffer.set_num_sms(n)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                  topk_weights=weights)

        def with_layout():
            pr, _, pe, ir, _ = buf.get_dispatch_layout(topk_idx, E)
            buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe, topk_idx=topk_idx,
                         topk_weights=weights)

        put(f"deepep_sms{n}_dispatch", lambda: buf.dispatch(x, handle=handle))
        put(f"deepep_sms{n}_dispatch_layout", with_layout)
        put(f"deepep_sms{n}_combine", lambda: buf.combine(recv_x, handle))
        rows += [(f"dispatch bf16, {n} SMs (DeepEP, cached handle)", f"deepep_sms{n}_dispatch", True),
                 (f"dispatch bf16, {n} SMs (DeepEP, with layout)", f"deepep_sms{n}_dispatch_layout", True),
                 (f"combine bf16, {n} SMs (DeepEP, a row per token and rank)", f"deepep_sms{n}_combine", True)]
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--combine-variants", nargs="+", metavar="C/R/S[/q[/s]]",
                   help="combine variants to time instead of the built-in list: chunks/reduce blocks (0: one per "
                        "SM)/pushing blocks as a share of num_blocks (0: the default half), and /q for the pushing "
                        "warps' shared queue (/q/s: its warps fence at system scope), e.g. 16/0/0.4 or 16/0/0.5/q")
    p.add_argument("--sms", type=int, nargs="+", default=[24, 0],
                   help="SM budgets at which ds_uniep's bf16 dispatch and combine and DeepEP's are timed side by side "
                        "(0: every SM; DeepEP takes even counts; default 24 0)")
    p.add_argument("--out", default="bench_dispatch.json")
    a = p.parse_args()
    variants = ([v + (False,) for v in COMBINE_VARIANTS] if not a.combine_variants
                else [parse_variant(v) for v in a.combine_variants])

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    G, rank, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", local)
    from ds_uniep.config import UniEPConfig
    from ds_uniep.megakernel import NVLinkDispatcher
    from ds_uniep.pipelined import PipelinedCall

    T, M, k = a.tokens, a.hidden, a.topk
    E = max(32 * G // 4, k, G)
    E += (-E) % G
    gen = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32).to(dev)
    x = torch.randn(T, M, generator=gen).to(torch.bfloat16).to(dev)
    gates = torch.rand(T, k, generator=gen).to(dev)
    payload = T * k * M * 2
    # Bytes that leave this rank: pairs routed to experts of other ranks (max over ranks).
    dest = idx.long() // (E // G)
    off = (dest != rank).sum().to(torch.float64) * M * 2
    dist.all_reduce(off, op=dist.ReduceOp.MAX)
    off_rank = float(off)
    # A deduplicated dispatch sends a token once per other rank that any of its slots goes to.
    hit = torch.zeros(T, G, dtype=torch.bool, device=dev).scatter_(1, dest, True)
    hit[:, rank] = False
    dedup_off = hit.sum().to(torch.float64) * M * 2
    dist.all_reduce(dedup_off, op=dist.ReduceOp.MAX)
    dedup_off_rank = float(dedup_off)
    nccl_off_rank = payload * (G - 1) / G
    results = {"world_size": G, "tokens": T, "hidden": M, "topk": k, "experts": E, "payload_bytes": payload,
               "off_rank_bytes": off_rank, "dedup_off_rank_bytes": dedup_off_rank,
               "nccl_off_rank_bytes": nccl_off_rank}

    results["peer_copy_GBps"] = peer_copy_gbps(1 << 30, 10, dev)

    def put(key, fn):
        results[f"{key}_ms"], results[f"{key}_queued_ms"], results[f"{key}_host_ms"] = timed(fn, a.iters, a.warmup,
                                                                                             dev)

    send = torch.randn(T * k, M, device=dev).to(torch.bfloat16)
    recv_nccl = torch.empty_like(send)
    put("nccl_a2a", lambda: dist.all_to_all_single(recv_nccl, send))
    # What a dispatch over NCCL does as a whole: rows permuted into destination order, then exchanged.
    order = torch.argsort(idx.reshape(-1).long(), stable=True) // k

    def nccl_dispatch():
        torch.index_select(x, 0, order, out=send)
        dist.all_to_all_single(recv_nccl, send)

    put("nccl_dispatch", nccl_dispatch)
    send = recv_nccl = None  # frees them; the closures above ran already

    for name, dtype_cfg, direct in (("bf16", "activation", True), ("bf16_staging", "activation", False),
                                    ("fp8", "fp8_e4m3", True)):
        cfg = UniEPConfig.from_dict({"max_tokens_per_rank": T, "compression": {"dispatch_dtype": dtype_cfg}})
        disp = NVLinkDispatcher.from_config(f"bench.{name}", E, G, M, k, torch.bfloat16, cfg)
        disp.padded_recv = True
        if not direct:
            disp.direct = None  # every dispatch through staging and copy-out
        state = {}

        def do_dispatch():
            state.pop("recv", None)  # as in training: the previous rows are no longer held
            state["recv"], state["counts"], state["handle"] = disp.dispatch(x, idx)

        put(f"{name}_dispatch", do_dispatch)
        h = state["handle"]
        own_whole = disp.dedup and direct  # as the dispatch received in place stores its own rows

        def stores_only():
            # The NVLink stores alone: no counts exchange and no copy-out (nobody waits on them).
            disp.ext.dispatch_rows(x, h.expert_idx, h.dest_row, None, disp.fp8, E, disp.bufs.descriptor,
                                   disp.direct_descriptor(True, disp._set.epochs[0]), disp._next_epoch(1),
                                   disp.num_blocks, disp.dedup, own_whole)

        put(f"{name}_dispatch_stores", stores_only)
        do_dispatch()  # leave buffers and epochs in step on every rank
        results[f"{name}_direct_stats"] = dict(disp.direct_stats)
        if name == "bf16":
            y = state["recv"]
            put("combine", lambda: disp.combine(y, gates, h))
            results["combine_default_chunking"] = list(disp.combine_chunking())  # (tokens per chunk, chunks)
            knobs = disp.knobs
            default = (disp.combine_reduce_blocks, disp.combine_push_blocks, disp.combine_queue_gpu_fence)
            first = combine_first = disp.combine(y, gates, h)
            results["combine_variants"] = {}
            min_chunk = disp.combine_min_chunk_tokens
            disp.combine_min_chunk_tokens = 1  # a variant's chunk count is what it says
            for chunks, reducers, share, queue, sys_fence in variants:
                disp.set_knobs(dataclasses.replace(knobs, combine_chunks=chunks, combine_queue=queue))
                disp.combine_reduce_blocks = reducers
                disp.combine_push_blocks = round(share * disp.num_blocks) if share else None
                disp.combine_queue_gpu_fence = not sys_fence
                pushers = disp.combine_pushers()
                ms, queued_ms, _ = timed(lambda: disp.combine(y, gates, h), a.iters, a.warmup, dev)
                same = bool(torch.equal(disp.combine(y, gates, h), first))
                key = f"{chunks}/{reducers}/{pushers}" + ("/queue" if queue else "")
                key += "/sys" if sys_fence else ""
                results["combine_variants"][key] = {
                    "chunks": chunks, "reduce_blocks": reducers, "push_blocks": pushers, "push_queue": queue,
                    "queue_sys_fence": sys_fence, "ms": ms, "queued_ms": queued_ms, "bitwise_equal": same,
                    "reduce_blocks_used": disp.combine_reducers()}
            disp.set_knobs(knobs)
            disp.combine_reduce_blocks, disp.combine_push_blocks, disp.combine_queue_gpu_fence = default
            disp.combine_min_chunk_tokens = min_chunk
            results["combine_stats"] = dict(disp.combine_stats)
        disp.check(synchronize=True)
        disp = state = None  # frees them; the closures above ran already
        torch.cuda.empty_cache()

    budget_rows = sm_budget_rows(a, x, idx, gates, E, G, M, k, dev, put, results)

    # The copy-engine combine: an exact-R dispatch (its counts read on the host), then the segments of
    # the received rows copied back into their sources' combine buffers and summed in slot order.
    cfg = UniEPConfig.from_dict({"max_tokens_per_rank": T})
    disp = NVLinkDispatcher.from_config("bench.copy_engine", E, G, M, k, torch.bfloat16, cfg)
    y, _, dest_row, _, _, _ = disp._dispatch_fwd(x, idx, host_counts=True)
    call = PipelinedCall(disp, 1)
    call.setup(disp._counts_host.numpy().copy())

    def ce_combine():
        call.push(0, y, backward=False)
        return call.reduce(idx, dest_row, gates, torch.bfloat16)

    put("combine_ce", ce_combine)
    results["combine_ce_bitwise_equal"] = bool(torch.equal(ce_combine(), combine_first))
    results["combine_ce_segments"] = int(sum(len(s) for s in call.plan.segments))
    disp.check(synchronize=True)
    disp = call = y = None
    torch.cuda.empty_cache()

    def gbps(ms, nbytes=payload):
        return nbytes / (ms * 1e-3) / 1e9

    # %peer divides the bytes that cross NVLink: bf16 dispatches are deduplicated (a token once per
    # destination rank); fp8 rows are counted at their bf16 size (the rate at which activations
    # leave the rank). Every xNCCL compares times for the same routed rows.
    rows = [("NCCL all_to_all_single", "nccl_a2a", nccl_off_rank),
            ("NCCL dispatch (permute+all_to_all)", "nccl_dispatch", nccl_off_rank),
            ("dispatch bf16 (layout+stores, in place)", "bf16_dispatch", dedup_off_rank),
            ("dispatch bf16 (layout+stores+copy-out)", "bf16_staging_dispatch", dedup_off_rank),
            ("dispatch bf16 stores only", "bf16_dispatch_stores", dedup_off_rank),
            ("dispatch fp8 (layout+stores+copy-out)", "fp8_dispatch", off_rank),
            ("dispatch fp8 stores only", "fp8_dispatch_stores", off_rank),
            ("combine bf16 (chunked push+reduce, {} chunks)".format(results["combine_default_chunking"][1]), "combine",
             off_rank),
            ("combine bf16 (copy engines, then reduce)", "combine_ce", off_rank)]
    rows = [(label, results[f"{key}_ms"], results[f"{key}_queued_ms"], nbytes) for label, key, nbytes in rows]
    print(f"rank {rank}: host ms to launch: dispatch bf16 {results['bf16_dispatch_host_ms']:.3f}, combine "
          f"{results['combine_host_ms']:.3f}, NCCL "
          f"{results['nccl_a2a_host_ms']:.3f}")
    rows += [(f"combine bf16 ({v['chunks']} chunks, {v['push_blocks']}/"
              f"{v.get('reduce_blocks_used') or v['reduce_blocks'] or 'default'} push/reduce blocks"
              f"{', one queue' if v['push_queue'] else ''}{', system fences' if v.get('queue_sys_fence') else ''})"
              if v["chunks"] else "combine bf16 (push, then reduce)", v["ms"], v["queued_ms"], off_rank)
             for v in results["combine_variants"].values()]
    rows += [(label, results[f"{key}_ms"], results[f"{key}_queued_ms"], dedup_off_rank if dedup else off_rank)
             for label, key, dedup in budget_rows]
    table = []
    nccl, nccl_q = results["nccl_a2a_ms"], results["nccl_a2a_queued_ms"]
    peer = results["peer_copy_GBps"] or None  # 0 where rank 0 sees a single GPU: no ceiling measured
    for label, ms, queued_ms, nbytes in rows:
        bw, bw_q = gbps(ms, nbytes), gbps(queued_ms, nbytes)
        table.append({"op": label, "ms": ms, "GBps": bw, "of_peer_copy": bw / peer if peer else None,
                      "vs_nccl": nccl / ms, "vs_nccl_dispatch": results["nccl_dispatch_ms"] / ms,
                      "queued_ms": queued_ms, "queued_GBps": bw_q,
                      "queued_of_peer_copy": bw_q / peer if peer else None, "queued_vs_nccl": nccl_q / queued_ms})
    results["table"] = table
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nG={G} T={T} M={M} k={k} E={E} payload/rank={payload / 2**20:.0f} MiB, leaving the rank {off_rank / 2**20:.0f} MiB "
              f"(NCCL {nccl_off_rank / 2**20:.0f} MiB; bf16-equivalent bytes), deduplicated bf16 dispatch "
              f"{dedup_off_rank / 2**20:.0f} MiB; peer copy {results['peer_copy_GBps']:.0f} GB/s")
        print("combine variants bitwise equal to the default:",
              all(v["bitwise_equal"] for v in results["combine_variants"].values()), results["combine_stats"],
              "; copy-engine combine:", results["combine_ce_bitwise_equal"],
              f"({results['combine_ce_segments']} segment copies)")
        if "deepep_why_not" in results:
            print("DeepEP rows left out:", results["deepep_why_not"])
        print("forward dispatches received in place / copied out:",
              {n: results[f"{n}_direct_stats"] for n in ("bf16", "bf16_staging", "fp8")})
        print("launched: timing starts with the first launch (host launch time included); queued: the "
              "launches were queued behind a GPU spin, so the GPU work alone is timed")
        print(f"{'op':48s} {'launched ms':>11s} {'%peer':>6s} {'xNCCL':>6s} {'queued ms':>10s} {'%peer':>6s} "
              f"{'xNCCL':>6s}")
        def pct(frac):
            return f"{'-':>6s}" if frac is None else f"{100 * frac:5.0f}%"

        for r in table:
            print(f"{r['op']:48s} {r['ms']:11.3f} {pct(r['of_peer_copy'])} {r['vs_nccl']:6.2f} "
                  f"{r['queued_ms']:10.3f} {pct(r['queued_of_peer_copy'])} {r['queued_vs_nccl']:6.2f}")
    dist.barrier()
    dist.destroy_process_group()
    failed = [f"combine variant {name}" for name, v in results["combine_variants"].items() if not v["bitwise_equal"]]
    failed += ["copy-engine combine"] if not results["combine_ce_bitwise_equal"] else []
    if failed:
        raise SystemExit(f"bench_dispatch rank {rank}: not bitwise the default: {', '.join(failed)}")


if __name__ == "__main__":
    main()
