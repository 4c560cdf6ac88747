"""NVLink dispatch/combine kernels on 2 and 4 GPUs against ds_uniep.layout and a pure torch computation.

Inputs identify themselves: column 0 of x holds the source rank, columns 1 and 2 the
token index (t // 64, t % 64; exact in bf16), so a misplaced row names itself. The
expert outputs are y = x * (e + 1) / 8 for the row's global expert e, which makes
the whole layer a per-token function every rank can compute alone in torch.
"""
import dataclasses

import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed

M = 256
T_MAX = 4096


def _routing(src, case, T, k, E, mode):
    gen = torch.Generator().manual_seed(7919 * src + 104729 * case + T)
    if mode == "empty_experts":  # only even experts get tokens
        pool = torch.arange(0, E, 2)
    else:
        pool = torch.arange(E)
    idx = torch.full((T, k), -1, dtype=torch.int32)
    n = min(k, len(pool))  # slots past the pool's size stay dropped
    if T:
        idx[:, :n] = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:n]] for _ in range(T)])
    if mode == "one_expert":  # every token's slot 0 goes to expert 1; the others are dropped
        idx[:, 0] = 1
        idx[:, 1:] = -1
    elif mode == "random":
        idx[torch.rand(idx.shape, generator=gen) < 0.1] = -1
    gates = torch.rand(idx.shape, generator=gen) * (idx >= 0)
    return idx, gates.float()


def _inputs(src, case, T, dtype):
    gen = torch.Generator().manual_seed(31 * src + 1009 * case + T)
    x = torch.randn(T, M, generator=gen)
    t = torch.arange(T)
    x[:, 0], x[:, 1], x[:, 2] = float(src), (t // 64).float(), (t % 64).float()
    return x.to(dtype)


def _expert_fn(rows, experts):
    return (rows.float() * (experts.float().unsqueeze(1) + 1) / 8).to(rows.dtype)


def _disp(name, E, G, k, dtype, cfg, knobs=None, **hooks):
    """An NVLinkDispatcher built from the block ``cfg``, with ``knobs`` (a dict) replacing some of
    its knobs and ``hooks`` set as its test attributes (padded_recv, dedup, combine_push_blocks, ...)."""
    from ds_uniep.megakernel import NVLinkDispatcher
    d = NVLinkDispatcher.from_config(name, E, G, M, k, dtype, cfg)
    if knobs:
        d.set_knobs(dataclasses.replace(d.knobs, **knobs))
    for attr, value in hooks.items():
        assert hasattr(d, attr), f"NVLinkDispatcher has no test attribute {attr}"
        setattr(d, attr, value)
    return d


def _body(rank, G, dtype_name):
    import deepspeed.comm as dist
    from ds_uniep.config import UniEPConfig
    from ds_uniep.layout import build_layout, expert_counts
    from ds_uniep.megakernel import UniEPCapacityError
    from ds_uniep.reference import fp8_roundtrip, weighted_slot_sum

    dtype = getattr(torch, dtype_name)
    dev = rank_gpu(rank)
    E = 4 * G
    L = E // G
    cfg = UniEPConfig.from_dict({"max_tokens_per_rank": T_MAX, "overlap": {"timeout_s": 30.0}})
    report = []
    case = 0
    for k in (1, 2, 6, 8):
        disp = _disp(f"test.k{k}", E, G, k, dtype, cfg)
        # The same layer (whose default combine pushes from one queue shared by the pushing warps,
        # with the default blocks, one per SM) with combine as push-then-reduce kernels, chunked over
        # 7 chunks with five pushing blocks and one reducing block in fixed shares, each pushing block
        # a fixed share of the rows, pushing from the queue with five pushing and 300 reducing blocks
        # (more than fit one per SM) and system-scoped fences per warp, with the gate gradients formed
        # at the sources (y sent back) instead of on the experts, and sending a token once per slot
        # rather than once per destination rank: when and where rows move and are summed changes,
        # never the bits.
        variants = [_disp(f"test.k{k}.two_pass", E, G, k, dtype, cfg, knobs={"combine_chunks": 0}),
                    _disp(f"test.k{k}.chunks7", E, G, k, dtype, cfg, knobs={"combine_chunks": 7, "combine_queue": False},
                          combine_reduce_blocks=1, combine_push_blocks=5),
                    _disp(f"test.k{k}.gates_at_sources", E, G, k, dtype, cfg, gate_grad_on_experts=False),
                    _disp(f"test.k{k}.no_dedup", E, G, k, dtype, cfg, dedup=False),
                    _disp(f"test.k{k}.shares", E, G, k, dtype, cfg, knobs={"combine_queue": False}),
                    _disp(f"test.k{k}.queue7", E, G, k, dtype, cfg, knobs={"combine_chunks": 7},
                          combine_reduce_blocks=300, combine_push_blocks=5, combine_queue_gpu_fence=False)]
        queue = disp  # the default combine pushes from one queue
        assert queue.combine_queue and not variants[-2].combine_queue and variants[-1].combine_queue
        assert queue.combine_pushers() + queue.combine_reducers() == queue.num_blocks
        modes = [("random", 1), ("random", 19), ("random", T_MAX), ("one_expert", 19), ("empty_experts", 19),
                 ("one_expert", T_MAX)]
        for mode, T in modes:
            if mode == "one_expert" and k == 1 and T == 19:
                mode = "empty_experts"
            case += 1
            routs = [_routing(s, case, T, k, E, mode) for s in range(G)]
            xs = [_inputs(s, case, T, dtype) for s in range(G)]
            counts_all = torch.stack([expert_counts(r[0], E) for r in routs])
            lays = [build_layout(r[0], counts_all, s) for s, r in enumerate(routs)]
            idx, gates = routs[rank][0].to(dev), routs[rank][1].to(dev)
            outs = []
            for d in [disp, disp] + variants:  # two runs and the combine variants, bitwise identical
                x = xs[rank].to(dev).requires_grad_(True)
                g = gates.clone().requires_grad_(True)
                recv, counts, handle = d.dispatch(x, idx)
                R = int(counts.sum())
                experts = torch.repeat_interleave(torch.arange(L, device=dev) + rank * L, counts)
                y = _expert_fn(recv, experts)
                queued = d.combine_stats["queued"]
                out = d.combine(y, g, handle)
                assert d.combine_stats["queued"] == queued + bool(d.combine_chunks and d.combine_queue), \
                    f"the queue was not taken as the knobs say (k={k}, T={T}, {mode}, R={R})"
                w = torch.randn(out.shape, generator=torch.Generator().manual_seed(case)).to(dev)
                (out.float() * w).sum().backward()
                outs.append((recv.detach().clone(), out.detach().clone(), x.grad.clone(), g.grad.clone()))
            recv, out, gx, gg = outs[0]
            labels = ("a second run", "push-then-reduce combine", "7-chunk combine",
                      "gate gradients at the sources", "one row per slot (no dedup)",
                      "chunked combine, each pushing block a fixed share of the rows",
                      "7-chunk combine pushing from one queue (5 pushing and 300 reducing blocks, system-scoped "
                      "warp fences)")
            assert len(labels) == len(outs) - 1
            for other, what in zip(outs[1:], labels):
                for a, b, name in zip(outs[0], other, ("recv", "out", "grad_x", "grad_gates")):
                    assert torch.equal(a, b), f"{name} differs in {what} (k={k}, T={T}, {mode})"
            # Layout: counts and rows are exactly ds_uniep.layout's.
            lay = lays[rank]
            assert torch.equal(handle.counts_all.cpu(), counts_all), f"counts_all (k={k}, T={T}, {mode})"
            assert torch.equal(counts.cpu(), lay.local_expert_counts), f"local_expert_counts (k={k}, T={T})"
            assert torch.equal(handle.dest_row.cpu().long(), lay.dest_row), f"dest_row (k={k}, T={T}, {mode})"
            # Every row landed where the layout says: row dest_row of (s, t, j) holds x_s[t].
            expected = torch.empty(R, M, dtype=dtype)
            for s in range(G):
                mine = lays[s].dest_rank == rank
                t_of = torch.arange(T).unsqueeze(1).expand(T, k)[mine]
                expected[lays[s].dest_row[mine]] = xs[s][t_of]
            got = recv.cpu()
            if not torch.equal(got, expected):
                bad = (got != expected).any(1).nonzero().flatten()[:5].tolist()
                who = [(int(got[i, 0]), int(got[i, 1]) * 64 + int(got[i, 2])) for i in bad]
                want = [(int(expected[i, 0]), int(expected[i, 1]) * 64 + int(expected[i, 2])) for i in bad]
                raise AssertionError(f"rows {bad} hold (src, token) {who}, layout wants {want} "
                                     f"(k={k}, T={T}, {mode})")
            # Outputs and gradients against the same function in torch, on fp32 and in dtype.
            xr = xs[rank].to(dev).requires_grad_(True)
            gr = gates.clone().requires_grad_(True)
            safe = idx.clamp_min(0).long()
            pair_rows = _expert_fn(xr.unsqueeze(1).expand(T, k, M).reshape(-1, M), safe.reshape(-1)).view(T, k, M)
            pair_rows = pair_rows * (idx >= 0).unsqueeze(-1).to(dtype)
            ref = weighted_slot_sum(pair_rows, gr, dtype)
            w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(case)).to(dev)
            (ref.float() * w).sum().backward()
            x64 = xs[rank].to(dev).double().requires_grad_(True)
            g64 = gates.double().requires_grad_(True)
            pr64 = (x64.unsqueeze(1) * (safe.double().unsqueeze(-1) + 1) / 8) * (idx >= 0).unsqueeze(-1)
            ref64 = (g64.unsqueeze(-1) * pr64).sum(1)
            (ref64 * w.double()).sum().backward()

            def rel(a, b):
                return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

            for name, mine_v, ref_v, v64 in (("out", out, ref.detach(), ref64.detach()),
                                             ("grad_x", gx, xr.grad, x64.grad), ("grad_gates", gg, gr.grad,
                                                                                  g64.grad)):
                err, ref_err = rel(mine_v, v64), rel(ref_v, v64)
                assert err <= 2 * ref_err + 1e-6, f"{name}: error {err:.2e} > 2x reference's {ref_err:.2e} " \
                                                  f"(k={k}, T={T}, {mode})"
            if rank == 0:
                report.append(f"k={k} T={T} {mode}: R={R} out bitwise==torch: {torch.equal(out, ref.detach())}")
    # padded_recv: R_max rows, the first R valid; no host sync.
    disp = _disp("test.padded", E, G, 2, dtype, cfg, padded_recv=True)
    idx, gates = (v.to(dev) for v in _routing(rank, 999, 19, 2, E, "random"))
    x = _inputs(rank, 999, 19, dtype).to(dev)
    recv, counts, handle = disp.dispatch(x, idx)
    assert recv.shape[0] == G * T_MAX * 2
    recv2, counts2, _ = _disp("test.exact", E, G, 2, dtype, cfg).dispatch(x, idx)
    assert torch.equal(recv[:int(counts.sum())], recv2)
    # FP8 dispatch: the reference's roundtrip exactly, deterministic, error reported.
    fcfg = UniEPConfig.from_dict({"max_tokens_per_rank": T_MAX, "compression": {"dispatch_dtype": "fp8_e4m3"}})
    fdisp = _disp("test.fp8", E, G, 8, dtype, fcfg)
    exact = _disp("test.fp8ref", E, G, 8, dtype, cfg)
    idx, _ = _routing(rank, 555, T_MAX, 8, E, "random")
    x = torch.randn(T_MAX, M, generator=torch.Generator().manual_seed(rank)).to(dtype).to(dev)
    r1, _, _ = fdisp.dispatch(x, idx.to(dev))
    r2, _, _ = fdisp.dispatch(x, idx.to(dev))
    r0, _, _ = exact.dispatch(x, idx.to(dev))
    assert torch.equal(r1, r2), "FP8 dispatch differs between two runs"
    ref8 = fp8_roundtrip(r0)
    fp8_err = float((r1.double() - r0.double()).norm() / r0.double().norm())
    ref8_err = float((ref8.double() - r0.double()).norm() / r0.double().norm())
    diff = (r1 != ref8)
    fp8_note = f"{int(diff.sum())} of {diff.numel()} elements differ from the reference's fp8_roundtrip"
    if diff.any():
        i = diff.nonzero()[:3].tolist()
        fp8_note += " e.g. " + ", ".join(f"x={float(r0[a, b]):.6g} mine={float(r1[a, b]):.6g} "
                                         f"ref={float(ref8[a, b]):.6g}" for a, b in i)
    assert fp8_err <= 1.05 * ref8_err + 1e-6, f"FP8 error {fp8_err:.3e} vs the reference roundtrip's {ref8_err:.3e}"
    assert not diff.any(), "FP8 dispatch must round exactly as ds_uniep.reference.fp8_roundtrip: " + fp8_note
    # Capacity: an error naming layer, rank and size, before anything moves.
    with pytest.raises(UniEPCapacityError, match=f"rank {rank} got {T_MAX + 1} tokens"):
        disp.dispatch(torch.zeros(T_MAX + 1, M, dtype=dtype, device=dev),
                      torch.zeros(T_MAX + 1, 2, dtype=torch.int32, device=dev))
    # One pushing block whose sorted list of rows fills all 48 KiB of dynamic shared memory it may take
    # (12288 rows: every rank receives 8 rows per token), beside the kernel's static arrays: the launch
    # raises the kernel's shared memory limit; one more token's rows overflow the sorted list, and
    # the block pushes chunk by chunk instead. The same bits each way.
    one_pusher = _disp("test.one_pusher", E, G, 8, dtype, cfg, knobs={"combine_queue": False}, combine_push_blocks=1)
    reference = _disp("test.one_pusher_ref", E, G, 8, dtype, cfg, knobs={"combine_queue": False})
    for t_big in (12288 // 8, 12288 // 8 + 1):
        idx_b = torch.tensor([[(j % G) * L + (j // G + t) % L for j in range(8)] for t in range(t_big)],
                             dtype=torch.int32, device=dev)
        gates_b = torch.rand(t_big, 8, generator=torch.Generator().manual_seed(rank)).to(dev)
        x_b = _inputs(rank, 2000, t_big, dtype).to(dev)
        combined = []
        for d in (one_pusher, reference):
            recv_b, _, handle_b = d.dispatch(x_b, idx_b)
            assert recv_b.shape[0] == 8 * t_big, recv_b.shape
            combined.append(d.combine(recv_b, gates_b, handle_b))
        assert torch.equal(combined[0], combined[1]), f"one pushing block over {8 * t_big} rows changed the bits"
    # The shared push queue's blocks meet at barriers: more of them than fit on the GPU at once are
    # refused before anything moves (every rank refuses, so the layer stays in step).
    over = _disp("test.queue_over", E, G, 2, dtype, cfg, combine_push_blocks=10_000)
    idx_o, gates_o = _routing(rank, 1000, 19, 2, E, "random")
    recv_o, _, handle_o = over.dispatch(_inputs(rank, 1000, 19, dtype).to(dev), idx_o.to(dev))
    with pytest.raises(ValueError, match="test.queue_over: combine_queue needs every pushing block resident"):
        over.combine(recv_o, gates_o.to(dev), handle_o)
    torch.cuda.synchronize()
    dist.barrier()
    # Timeout: rank 0 dispatches alone; its wait gives up and names the layer, rank and signal.
    tcfg = UniEPConfig.from_dict({"max_tokens_per_rank": 64, "overlap": {"timeout_s": 0.5}})
    lonely = _disp("test.lonely", E, G, 1, dtype, tcfg, padded_recv=True)
    if rank == 0:
        lonely.dispatch(torch.ones(4, M, dtype=dtype, device=dev), torch.zeros(4, 1, dtype=torch.int32, device=dev))
        with pytest.raises(Exception, match="test.lonely: rank 0 timed out .* 'counts' signal of rank 1"):
            lonely.check(synchronize=True)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"\n[nvlink G={G} {dtype_name}] " + "; ".join(report))
        print(f"[nvlink G={G} {dtype_name}] FP8 e4m3 dispatch relative error {fp8_err:.3e} (reference roundtrip "
              f"{ref8_err:.3e}); {fp8_note}")


@needs_gpus(2)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_nvlink_ep2(dtype_name):
    run_distributed(_body, 2, dtype_name, backend="nccl")


@needs_gpus(4)
def test_nvlink_ep4():
    run_distributed(_body, 4, "bfloat16", backend="nccl")


def _direct_body(rank, G):
    """In-place receive: a rank still holding its rows (or a view of them) gets the next rows by
    staging and copy-out, its held rows stay as they were, and both paths give the same rows."""
    from ds_uniep.config import UniEPConfig

    dev = rank_gpu(rank)
    E, k, T = 4 * G, 2, 257
    cfg = UniEPConfig.from_dict({"max_tokens_per_rank": T, "overlap": {"timeout_s": 30.0}})
    disp = _disp("test.direct", E, G, k, torch.bfloat16, cfg)
    plain = _disp("test.staging", E, G, k, torch.bfloat16, cfg, direct=None)  # staging only
    idx = _routing(rank, 4242, T, k, E, "random")[0].to(dev)
    x1, x2 = (_inputs(rank, c, T, torch.bfloat16).to(dev) for c in (1, 2))
    want1, want2 = (plain.dispatch(x, idx)[0].clone() for x in (x1, x2))
    assert not torch.equal(want1, want2)

    r1 = disp.dispatch(x1, idx)[0]
    assert disp.direct_stats == {"in_place": 1, "copied": 0}, disp.direct_stats
    assert torch.equal(r1, want1), "rows received in place differ from staging's"
    if rank != 0:
        del r1  # rank 0 keeps its rows, so its region is busy; the others' are free
    r2 = disp.dispatch(x2, idx)[0]
    stats = {"in_place": 1, "copied": 1} if rank == 0 else {"in_place": 2, "copied": 0}
    assert disp.direct_stats == stats, (rank, disp.direct_stats)
    assert torch.equal(r2, want2), "rows of a mixed dispatch (one region busy) differ"
    if rank == 0:
        assert torch.equal(r1, want1), "held rows were overwritten by the next dispatch"
        del r1
    del r2
    # A view taken without autograd keeps no reference to its base, only to the storage.
    with torch.no_grad():
        head = disp.dispatch(x1, idx)[0][:7]
    r4 = disp.dispatch(x2, idx)[0]
    assert torch.equal(head, want1[:7]), "a surviving view was overwritten"
    assert torch.equal(r4, want2)
    assert disp.direct_stats["copied"] == (2 if rank == 0 else 1), (rank, disp.direct_stats)
    disp.check(synchronize=True)


@needs_gpus(2)
def test_direct_receive_never_overwrites_held_rows():
    run_distributed(_direct_body, 2, backend="nccl")


def test_combine_chunks_hold_at_least_the_minimum_tokens():
    """The chunked combine's (tokens per chunk, chunks), which every rank derives from
    max_tokens_per_rank alone: 16 chunks, none under combine_min_chunk_tokens (CPU: arithmetic only)."""
    from types import SimpleNamespace

    from ds_uniep.megakernel import NVLinkDispatcher

    def chunking(max_tokens, chunks=16, min_tokens=256):
        d = SimpleNamespace(max_tokens=max_tokens, combine_chunks=chunks, combine_min_chunk_tokens=min_tokens)
        return NVLinkDispatcher.combine_chunking(d)

    assert chunking(19) == (256, 1)
    assert chunking(2048) == (256, 8)
    assert chunking(4096) == (256, 16)
    assert chunking(8192) == (512, 16)
    assert chunking(4096, chunks=7) == (586, 7)
    assert chunking(2048, min_tokens=1) == (128, 16)
    assert chunking(4096, chunks=0) == (0, 0)  # push, then reduce
