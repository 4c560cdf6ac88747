"""Dispatch and combine of NVLinkDispatcher against the NVLink peer copy and NCCL all_to_all_single.

    torchrun --nproc_per_node N benchmarks/bench_dispatch.py --out dispatch.json
    torchrun --nproc_per_node 4 benchmarks/bench_dispatch.py --tokens 8192 --combine-variants 16/0/2/0.5 32/0/2/0.5

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
order first); the megakernel dispatch receiving in place (its direct region; again with this
rank's own rows deduplicated like the others', i.e. copied after the wait, checked bitwise) and
through staging plus copy-out; the NVLink stores alone; FP8; combine (the dispatcher's
default, chunked push+reduce in one kernel with the pushing warps sharing one queue, then the
variants of COMBINE_VARIANTS (or of --combine-variants) and the
pulling combine from source regions with one and two blocks per SM, and the copy-engine
combine of the pipelined schedule in one chunk (each (expert, source) segment copied into its
source's combine buffer by cudaMemcpyAsync, one stream per destination, then the slot-order
sum; it needs the exact-R dispatch, whose host sync comes before it and is not timed), each
checked bitwise against the default; the script exits non-zero after its table when one is not).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from timing import queued_start


# Combine variants timed beside the default (combine_chunks, combine_reduce_blocks,
# combine_push_lead, pushing blocks as a share of num_blocks (one per SM), combine_push_queue); every one must give
# the default's bits. (0, None, _, _): push, then reduce, as two kernels; lead 0: each pushing
# block gathers and pushes a chunk's rows at a time; None: the dispatcher's default (half).
COMBINE_VARIANTS = [(0, None, 0, 1, False), (16, None, 0, 1, False), (16, None, 2, 1, False),
                    (16, None, 2, 1 / 2, False), (16, None, 2, 1 / 4, False), (16, None, 4, None, False),
                    (8, None, 2, None, False), (32, None, 2, None, False), (16, None, 0, 1 / 2, False),
                    (4, None, 2, None, True), (8, None, 2, None, True), (16, None, 2, None, True),
                    (16, None, 2, 1, True)]
# Pulling combine variants: (result key, blocks per SM). The first is the dispatcher's default.
PULL_VARIANTS = [("combine_pull", 2), ("combine_pull_1x", 1)]


def parse_variant(text):
    """``"C/R/L/S[/q[/s]]"`` -> a COMBINE_VARIANTS entry (R 0 and S 0 mean the dispatcher's defaults;
    ``/q``: the pushing warps share one queue, ``combine_push_queue``, each fencing at GPU scope;
    ``/q/s``: each fencing at system scope, ``combine_queue_gpu_fence=False``)."""
    fields = text.split("/")
    queue = len(fields) >= 5 and fields[4] == "q"
    sys_fence = queue and len(fields) == 6 and fields[5] == "s"
    try:
        if len(fields) != 4 + queue + sys_fence:
            raise ValueError
        chunks, reducers, lead, share = int(fields[0]), int(fields[1]), int(fields[2]), float(fields[3])
    except ValueError:
        raise SystemExit(f"--combine-variants: {text!r} is not chunks/reduce_blocks/push_lead/push_share[/q[/s]], "
                         "e.g. 16/0/2/0.5, 16/0/2/0.5/q or 16/0/2/0.5/q/s") from None
    if chunks < 0 or reducers < 0 or lead < 0 or not 0 <= share <= 1:
        raise SystemExit(f"--combine-variants: {text!r} has a negative count or a share outside [0, 1]")
    return chunks, reducers or None, lead, share or None, queue, sys_fence


def summarize_trace(words, grid, pushers, num_chunks, block_words, max_chunks):
    """One chunked combine's timeline (``NVLinkDispatcher.combine_trace``'s words: %globaltimer ns,
    0 where nothing was stamped) as microseconds from the first block's start: when the last
    pushing and reducing blocks started, when the last pushing block had sorted its rows, when the
    first and last pushing blocks finished, when each chunk's flags were raised, seen by the last
    reducing block and summed by it, and the latest stamp of any block (the end). None where not
    stamped."""
    rows = [words[b * block_words:(b + 1) * block_words] for b in range(grid)]
    t0 = min(r[0] for r in rows)

    def last(values):
        values = list(values)
        return (max(values) - t0) / 1e3 if values and all(values) else None

    push, red = rows[:pushers], rows[pushers:]
    flags = words[grid * block_words:grid * block_words + num_chunks]
    return {"push_started": last(r[0] for r in push), "reduce_started": last(r[0] for r in red),
            "sorted": last(r[2] for r in push),
            "push_end_first": (min(r[1] for r in push) - t0) / 1e3 if all(r[1] for r in push) else None,
            "push_end": last(r[1] for r in push),
            "chunk_raised": [(f - t0) / 1e3 if f else None for f in flags],
            "chunk_seen": [last(r[3 + c] for r in red) for c in range(num_chunks)],
            "chunk_summed": [last(r[3 + max_chunks + c] for r in red) for c in range(num_chunks)],
            "end": (max(max(r) for r in rows) - t0) / 1e3}


def median_trace(summaries):
    """Field by field (list fields element by element) median of summarize_trace results; None
    where any run has None."""
    def med(values):
        return None if any(v is None for v in values) else statistics.median(values)

    first = summaries[0]
    return {key: [med([s[key][i] for s in summaries]) for i in range(len(first[key]))]
            if isinstance(first[key], list) else med([s[key] for s in summaries]) for key in first}


def trace_line(t):
    """A short text form of a median_trace result."""
    def f(v):
        return "-" if v is None else f"{v:.1f}"

    return (f"started {f(t['push_started'])}/{f(t['reduce_started'])} (push/reduce), sorted {f(t['sorted'])}, "
            f"push end {f(t['push_end_first'])}-{f(t['push_end'])}, flags raised "
            f"[{', '.join(f(v) for v in t['chunk_raised'])}], last chunk seen {f(t['chunk_seen'][-1])}, "
            f"end {f(t['end'])} us")


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


def traced_combine(disp, fn, runs, device):
    """median_trace of ``runs`` runs of fn (a chunked combine) with disp's combine timeline on, each
    started like a queued timing (a GPU spin, then a GPU-side barrier)."""
    pushers = disp.combine_pushers()
    grid = pushers + disp.combine_reducers()
    block_words, max_chunks = disp.combine_trace_layout()
    trace = torch.zeros(disp.ext.combine_trace_size(grid), dtype=torch.int64, device=device)
    summaries = []
    for _ in range(runs):
        trace.zero_()
        dist.barrier()
        torch.cuda.synchronize(device)
        disp.combine_trace = trace
        queued_start(1.0)()
        fn()
        disp.combine_trace = None
        torch.cuda.synchronize(device)
        summaries.append(summarize_trace(trace.tolist(), grid, pushers, disp.combine_chunking()[1], block_words,
                                         max_chunks))
    return median_trace(summaries)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--combine-variants", nargs="+", metavar="C/R/L/S[/q[/s]]",
                   help="combine variants to time instead of the built-in list: chunks/reduce blocks (0: one per "
                        "SM)/push lead/pushing blocks as a share of num_blocks (0: the default half), and /q for "
                        "the pushing warps' shared queue (/q/s: its warps fence at system scope), e.g. "
                        "16/0/2/0.4 or 16/0/2/0.5/q")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="also run each combine variant N more times with its timeline recorded (%%globaltimer "
                        "stamps) and report the median of each stamp (rank 0's)")
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
        disp = NVLinkDispatcher(f"bench.{name}", E, G, M, k, torch.bfloat16, cfg, padded_recv=True,
                                direct_receive=direct, pull_combine=name == "bf16")
        state = {}

        def do_dispatch():
            state.pop("recv", None)  # as in training: the previous rows are no longer held
            state["recv"], state["counts"], state["handle"] = disp.dispatch(x, idx)

        put(f"{name}_dispatch", do_dispatch)
        h = state["handle"]
        if name == "bf16":
            # The same dispatch with this rank's own rows deduplicated too (copied after the wait).
            rows = int(h.num_recv.item())
            first = state["recv"][:rows].clone()
            disp.own_rows_whole = False
            put("bf16_dispatch_own_dedup", do_dispatch)
            results["own_dedup_bitwise_equal"] = bool(torch.equal(state["recv"][:rows], first))
            disp.own_rows_whole = True
            do_dispatch()
            results["own_dedup_bitwise_equal"] &= bool(torch.equal(state["recv"][:rows], first))
            h, first = state["handle"], None
        own_whole = disp.stores_own_rows_whole(direct)

        def stores_only():
            # The NVLink stores alone: no counts exchange and no copy-out (nobody waits on them).
            disp.ext.dispatch_rows(x, h.expert_idx, h.dest_row, None, disp.fp8, E, disp.bufs.descriptor,
                                   disp.direct_descriptor(True, disp._epochs[0]), disp._next_epoch(1),
                                   disp.num_blocks, None, None, disp.dedup, own_whole)

        put(f"{name}_dispatch_stores", stores_only)
        do_dispatch()  # leave buffers and epochs in step on every rank
        results[f"{name}_direct_stats"] = dict(disp.direct_stats)
        if name == "bf16":
            y = state["recv"]
            put("combine", lambda: disp.combine(y, gates, h))
            results["combine_default_chunking"] = list(disp.combine_chunking())  # (tokens per chunk, chunks)
            default = (disp.combine_chunks, disp.combine_reduce_blocks, disp.combine_push_lead,
                       disp.combine_push_blocks, disp.combine_push_queue, disp.combine_queue_gpu_fence)
            first = combine_first = disp.combine(y, gates, h)
            results["combine_variants"] = {}
            min_chunk = disp.combine_min_chunk_tokens
            disp.combine_min_chunk_tokens = 1  # a variant's chunk count is what it says
            for chunks, reducers, lead, share, queue, sys_fence in variants:
                disp.combine_chunks, disp.combine_reduce_blocks, disp.combine_push_lead = chunks, reducers, lead
                disp.combine_push_blocks = round(share * disp.num_blocks) if share else None
                disp.combine_push_queue, disp.combine_queue_gpu_fence = queue, not sys_fence
                pushers = disp.combine_pushers()
                ms, queued_ms, _ = timed(lambda: disp.combine(y, gates, h), a.iters, a.warmup, dev)
                same = bool(torch.equal(disp.combine(y, gates, h), first))
                key = f"{chunks}/{reducers}/{lead}/{pushers}" + ("/queue" if queue else "")
                key += "/sys" if sys_fence else ""
                results["combine_variants"][key] = {
                    "chunks": chunks, "reduce_blocks": reducers, "push_lead": lead, "push_blocks": pushers,
                    "push_queue": queue, "queue_sys_fence": sys_fence, "ms": ms, "queued_ms": queued_ms,
                    "bitwise_equal": same, "reduce_blocks_used": disp.combine_reducers()}
                if a.trace and chunks:
                    results["combine_variants"][key]["trace"] = traced_combine(
                        disp, lambda: disp.combine(y, gates, h), a.trace, dev)
            (disp.combine_chunks, disp.combine_reduce_blocks, disp.combine_push_lead,
             disp.combine_push_blocks, disp.combine_push_queue, disp.combine_queue_gpu_fence) = default
            disp.combine_min_chunk_tokens = min_chunk
            # Pulling: the expert outputs sit in every rank's source region, each source reads its rows.
            src = disp.combine_source(y.shape[0])
            src.copy_(y)
            results["combine_pull_bitwise_equal"] = True
            default_pull = disp.pull_blocks
            for key, blocks in PULL_VARIANTS:
                disp.pull_blocks = blocks * disp.num_blocks
                put(key, lambda: disp.combine(src, gates, h))
                results["combine_pull_bitwise_equal"] &= bool(torch.equal(disp.combine(src, gates, h), first))
            disp.pull_blocks = default_pull
            results["combine_stats"] = dict(disp.combine_stats)
            del src
        disp.check(synchronize=True)
        disp = state = None  # frees them; the closures above ran already
        torch.cuda.empty_cache()

    # The copy-engine combine: an exact-R dispatch (its counts read on the host), then the segments of
    # the received rows copied back into their sources' combine buffers and summed in slot order.
    cfg = UniEPConfig.from_dict({"max_tokens_per_rank": T})
    disp = NVLinkDispatcher("bench.copy_engine", E, G, M, k, torch.bfloat16, cfg)
    y, _, dest_row, _, _, _ = disp._dispatch_fwd(x, idx, None, host_counts=True)
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
            ("dispatch bf16 (in place, own rows deduplicated)", "bf16_dispatch_own_dedup", dedup_off_rank),
            ("dispatch bf16 (layout+stores+copy-out)", "bf16_staging_dispatch", dedup_off_rank),
            ("dispatch bf16 stores only", "bf16_dispatch_stores", dedup_off_rank),
            ("dispatch fp8 (layout+stores+copy-out)", "fp8_dispatch", off_rank),
            ("dispatch fp8 stores only", "fp8_dispatch_stores", off_rank),
            ("combine bf16 (chunked push+reduce, {} chunks)".format(results["combine_default_chunking"][1]), "combine",
             off_rank),
            ("combine bf16 (copy engines, then reduce)", "combine_ce", off_rank)]
    rows = [(label, results[f"{key}_ms"], results[f"{key}_queued_ms"], nbytes) for label, key, nbytes in rows]
    print(f"rank {rank}: host ms to launch: dispatch bf16 {results['bf16_dispatch_host_ms']:.3f}, combine "
          f"{results['combine_host_ms']:.3f}, pulling combine {results['combine_pull_host_ms']:.3f}, NCCL "
          f"{results['nccl_a2a_host_ms']:.3f}")
    rows += [(f"combine bf16 ({v['chunks']} chunks, {v['push_blocks']}/"
              f"{v.get('reduce_blocks_used') or v['reduce_blocks'] or 'default'} push/reduce blocks, "
              f"{'lead ' + str(v['push_lead']) if v['push_lead'] else 'by chunk'}"
              f"{', one queue' if v['push_queue'] else ''}{', system fences' if v.get('queue_sys_fence') else ''})"
              if v["chunks"] else "combine bf16 (push, then reduce)", v["ms"], v["queued_ms"], off_rank)
             for v in results["combine_variants"].values()]
    rows += [(f"combine bf16 (pull, {blocks} block{'s' if blocks > 1 else ''} per SM)", results[f"{key}_ms"],
              results[f"{key}_queued_ms"], off_rank) for key, blocks in PULL_VARIANTS]
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
              all(v["bitwise_equal"] for v in results["combine_variants"].values()),
              "; pulling combine:", results["combine_pull_bitwise_equal"], results["combine_stats"],
              "; copy-engine combine:", results["combine_ce_bitwise_equal"],
              f"({results['combine_ce_segments']} segment copies)")
        print("in-place dispatch with own rows deduplicated, bitwise equal to the default:",
              results["own_dedup_bitwise_equal"])
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
        if a.trace:
            print(f"combine timelines (rank 0, median of {a.trace} runs, us from the first block's start):")
            for key, v in results["combine_variants"].items():
                if "trace" in v:
                    print(f"  {key}: {trace_line(v['trace'])}")
    dist.barrier()
    dist.destroy_process_group()
    failed = [f"combine variant {name}" for name, v in results["combine_variants"].items() if not v["bitwise_equal"]]
    failed += [what for what, key in (("own-rows-deduplicated dispatch", "own_dedup_bitwise_equal"),
                                      ("pulling combine", "combine_pull_bitwise_equal"),
                                      ("copy-engine combine", "combine_ce_bitwise_equal")) if not results[key]]
    if failed:
        raise SystemExit(f"bench_dispatch rank {rank}: not bitwise the default: {', '.join(failed)}")


if __name__ == "__main__":
    main()
