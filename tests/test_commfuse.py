"""CommFuse: exactness of all_gather_matmul / matmul_reduce_scatter and the parallel linears.

Every rank rebuilds every rank's inputs from per-rank seeds, so it can run the
single-process references (ds_uniep.commfuse.reference) itself. Checks are
packed into one spawned group per world size (a group costs seconds).
"""
import os
import subprocess
import sys

import pytest
import torch

from conftest import needs_gpus
from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_commfuse.py")


def _rand(shape, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    # Offset by the seed so blocks from different ranks never look alike.
    t = torch.randn(*shape, generator=g) + (seed % 97) * 0.01
    return t.to(dtype).to(device)


def _shard_sizes(G):
    return [1, 19, 111, 5][:G] if G <= 4 else [1, 19, 111] + [7] * (G - 3)


# --------------------------------------------------------------------------- exactness
def _check_ops(me, G, device, dtype, schedule, num_chunks, seed, transport="auto"):
    from ds_uniep.commfuse import (all_gather_matmul, matmul_reduce_scatter, ref_all_gather_matmul,
                                   ref_matmul_reduce_scatter)
    tag = f"[{dtype} {schedule} chunks={num_chunks} transport={transport}]"
    K, N = 37, 29

    # all_gather_matmul: odd blocks, a different w per rank (column-parallel).
    sizes = _shard_sizes(G)
    xs = [_rand((sizes[r], K), seed + r, dtype, device) for r in range(G)]
    ws = [_rand((K, N), seed + 100 + r, dtype, device) for r in range(G)]
    gys = [_rand((sum(sizes), N), seed + 200 + r, dtype, device) for r in range(G)]
    x = xs[me].clone().requires_grad_()
    w = ws[me].clone().requires_grad_()
    lf = schedule == "local_first"
    # On the copy engine, chunks cut the reduce-scatter's own partial GEMM (its closing sum overlapped).
    oc = num_chunks if transport == "copy_engine" else 1
    y = all_gather_matmul(x, w, schedule=schedule, num_chunks=num_chunks, transport=transport)
    assert torch.equal(y, ref_all_gather_matmul(xs, ws[me], me if lf else None)), f"all_gather_matmul forward {tag}"
    y.backward(gys[me])
    ref_gx = ref_matmul_reduce_scatter(gys, [wr.t() for wr in ws], out_sizes=sizes, local_first=lf,
                                       own_chunks=oc)[me]
    assert torch.equal(x.grad, ref_gx), f"all_gather_matmul d x_shard {tag}"
    assert torch.equal(w.grad, torch.cat(xs).t() @ gys[me]), f"all_gather_matmul d w {tag}"
    # Known sizes skip the size gather and give the same bits.
    y2 = all_gather_matmul(xs[me], ws[me], schedule=schedule, num_chunks=num_chunks, shard_sizes=sizes,
                           transport=transport)
    assert torch.equal(y2, y), f"all_gather_matmul with shard_sizes {tag}"
    # Empty blocks (this rank's among them on rank 0) move nothing and change nothing.
    sizes0 = [0 if r % 2 == 0 else sizes[r] for r in range(G)]
    xs0 = [x_[:n] for x_, n in zip(xs, sizes0)]
    y0 = all_gather_matmul(xs0[me].clone(), ws[me], schedule=schedule, num_chunks=num_chunks, shard_sizes=sizes0,
                           transport=transport)
    assert torch.equal(y0, ref_all_gather_matmul(xs0, ws[me], me if lf else None)), f"empty blocks {tag}"
    o0 = matmul_reduce_scatter(gys[me][:sum(sizes0)].contiguous(), ws[me].t().contiguous(), schedule=schedule,
                               num_chunks=num_chunks, out_sizes=sizes0, transport=transport)
    ref0 = ref_matmul_reduce_scatter([g[:sum(sizes0)] for g in gys], [w_.t().contiguous() for w_ in ws], sizes0,
                                     local_first=lf, own_chunks=oc)[me]
    assert torch.equal(o0, ref0), f"empty output blocks {tag}"

    # matmul_reduce_scatter: odd T, a different K_r per rank, default and explicit row splits.
    T = 131
    xs = [_rand((T, 11 + 7 * r), seed + 300 + r, dtype, device) for r in range(G)]
    ws = [_rand((11 + 7 * r, N), seed + 400 + r, dtype, device) for r in range(G)]
    for out_sizes in (None, sizes[:-1] + [T - sum(sizes[:-1])] if sum(sizes[:-1]) <= T else None):
        ref = ref_matmul_reduce_scatter(xs, ws, out_sizes, local_first=lf, own_chunks=oc)
        x = xs[me].clone().requires_grad_()
        w = ws[me].clone().requires_grad_()
        out = matmul_reduce_scatter(x, w, schedule=schedule, num_chunks=num_chunks, out_sizes=out_sizes,
                                    transport=transport)
        assert out.dtype == dtype
        assert torch.equal(out, ref[me]), f"matmul_reduce_scatter forward {tag} out_sizes={out_sizes}"
        again = matmul_reduce_scatter(xs[me], ws[me], schedule=schedule, num_chunks=num_chunks,
                                      out_sizes=out_sizes, transport=transport)
        assert torch.equal(again, out), f"matmul_reduce_scatter run to run {tag}"
        gos = [_rand(tuple(r_.shape), seed + 500 + r, dtype, device) for r, r_ in enumerate(ref)]
        out.backward(gos[me])
        go_full = torch.cat(gos)
        assert torch.equal(x.grad, ref_all_gather_matmul(gos, ws[me].t(), me if lf else None)), \
            f"matmul_reduce_scatter d x {tag}"
        assert torch.equal(w.grad, xs[me].t() @ go_full), f"matmul_reduce_scatter d w {tag}"


def _check_fixed_order(me, G, device, transport="auto"):
    """Partials that cancel only in rank order: the fp32 sum must follow it exactly. (Two partials
    add to the same bits in either order; there the values only show that both are in the sum.)"""
    from ds_uniep.commfuse import matmul_reduce_scatter
    # Rank r's partial is c_r * ones; the sum in rank order 0..G-1 of
    # (1e8, 1, -1e8, 1, ...) in fp32 is 1.0 + ..., any other order differs.
    vals = [1e8, 1.0, -1e8, 1.0, 3.0, 5.0, 7.0, 9.0][:G] if G > 2 else [3.0, 5.0][:G]
    x = torch.full((G * 3, 1), vals[me], dtype=torch.float32, device=device)
    w = torch.ones(1, 4, dtype=torch.float32, device=device)
    acc = torch.tensor(vals[0], dtype=torch.float32)
    for v in vals[1:]:
        acc = acc + torch.tensor(v, dtype=torch.float32)
    for schedule in ("ring", "bidirectional_ring", "local_first"):
        for c in ((1, 3) if transport == "copy_engine" else (1, )):
            out = matmul_reduce_scatter(x, w, schedule=schedule, num_chunks=c, transport=transport)
            assert torch.equal(out.cpu(), torch.full((3, 4), acc.item())), \
                f"rank-order sum {schedule} {transport} chunks={c}: {out[0, 0]}"


def _check_fp64(me, G, device, transport="auto"):
    """fp64 partials are added in fp64, in rank order: differences an fp32 sum would round away stay."""
    from ds_uniep.commfuse import matmul_reduce_scatter
    vals = [1.0 + r * 1e-10 for r in range(G)]
    x = torch.full((G * 2, 1), vals[me], dtype=torch.float64, device=device)
    w = torch.ones(1, 3, dtype=torch.float64, device=device)
    acc = torch.tensor(vals[0], dtype=torch.float64)
    for v in vals[1:]:
        acc = acc + v
    for schedule in ("ring", "bidirectional_ring", "local_first"):
        out = matmul_reduce_scatter(x, w, schedule=schedule, transport=transport)
        assert out.dtype == torch.float64 and torch.equal(out.cpu(), torch.full((2, 3), acc.item(), dtype=torch.float64)), \
            f"fp64 reduce-scatter {schedule}: {out[0, 0].item()!r} against {acc.item()!r}"


def _check_relay(me, G, device, transport):
    """The ``relay`` reduce-scatter: bitwise its reference (the running sum added in ring order in
    fp32 GEMM products), run to run, odd and empty blocks, chunks; within the input dtype's
    rounding of the exact sum; its backward is the ring all-gather; and the order is the relay's."""
    from ds_uniep.commfuse import (matmul_reduce_scatter, ref_all_gather_matmul, ref_matmul_reduce_scatter_relay,
                                   ref_matmul_reduce_scatter)
    from ds_uniep.commfuse.relay import relay_sources
    T, N = 131, 29
    sizes = _shard_sizes(G)
    uneven = [0] + sizes[1:-1] + [T - sum(sizes[1:-1])]  # rank 0's block empty
    for i, (dtype, c) in enumerate([(torch.bfloat16, 3), (torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 4)]):
        seed = 9000 + 100 * i
        xs = [_rand((T, 11 + 7 * r), seed + r, dtype, device) for r in range(G)]
        ws = [_rand((11 + 7 * r, N), seed + 50 + r, dtype, device) for r in range(G)]
        for out_sizes in (None, uneven):
            tag = f"[relay {dtype} chunks={c} {transport} out_sizes={out_sizes}]"
            ref = ref_matmul_reduce_scatter_relay(xs, ws, out_sizes, c)
            x = xs[me].clone().requires_grad_()
            w = ws[me].clone().requires_grad_()
            out = matmul_reduce_scatter(x, w, schedule="relay", num_chunks=c, out_sizes=out_sizes, transport=transport)
            assert out.dtype == dtype and torch.equal(out, ref[me]), f"forward {tag}"
            again = matmul_reduce_scatter(xs[me], ws[me], schedule="relay", num_chunks=c, out_sizes=out_sizes,
                                          transport=transport)
            assert torch.equal(again, out), f"run to run {tag}"
            # Against the exact sum: one rounding to the output dtype (plus fp32 adds), no more.
            exact = ref_matmul_reduce_scatter([a.double() for a in xs], [b.double() for b in ws], out_sizes)[me]
            ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20
            assert ((out.double() - exact).abs() <= ulp * exact.abs() + 1e-4).all(), f"accuracy {tag}"
            # 16-bit inputs: the rank-order schedules round each partial first; the relay does not.
            rank_order = ref_matmul_reduce_scatter(xs, ws, out_sizes)[me]
            assert out.numel() == 0 or dtype == torch.float32 or (out.double() - exact).abs().max() <= \
                (rank_order.double() - exact).abs().max() + 1e-6, f"less accurate than the rank-order sum {tag}"
            gos = [_rand(tuple(r_.shape), seed + 70 + r, dtype, device) for r, r_ in enumerate(ref)]
            out.backward(gos[me])
            assert torch.equal(x.grad, ref_all_gather_matmul(gos, ws[me].t())), f"d x {tag}"
            assert torch.equal(w.grad, xs[me].t() @ torch.cat(gos)), f"d w {tag}"
    # Partials that cancel only in the relay's order (j+1, ..., j+G-1, then the owner j).
    vals = [1e8, 1.0, -1e8, 1.0, 3.0, 5.0, 7.0, 9.0][:G]
    x = torch.full((G * 3, 1), vals[me], dtype=torch.float32, device=device)
    w = torch.ones(1, 4, dtype=torch.float32, device=device)
    order = [(me + i) % G for i in range(1, G + 1)]  # written out, not taken from the code under test
    assert relay_sources(G, me) == order
    acc = torch.tensor(vals[order[0]], dtype=torch.float32)
    for r in order[1:]:
        acc = acc + torch.tensor(vals[r], dtype=torch.float32)
    out = matmul_reduce_scatter(x, w, schedule="relay", num_chunks=2, transport=transport)
    assert torch.equal(out.cpu(), torch.full((3, 4), acc.item())), f"relay order {transport}: {out[0, 0]} vs {acc}"
    with pytest.raises(ValueError, match="schedule 'relay' takes at most 16 chunks per step"):
        matmul_reduce_scatter(x, w, schedule="relay", num_chunks=17, transport=transport)


def _check_back_to_back(me, G, device, calls=12):
    """Copy-engine calls queued back to back (no host sync between them), all-gather and
    reduce-scatter in turn on the one workspace, with the ranks pulled apart by GPU spins of
    different lengths: no call may copy into a peer's buffer while that peer still reads it, so
    every result equals its reference. Returns how many calls differed."""
    from ds_uniep.commfuse import (all_gather_matmul, matmul_reduce_scatter, ref_all_gather_matmul,
                                   ref_matmul_reduce_scatter)
    from ds_uniep.commfuse.arrival import available
    schedules = ("ring", "bidirectional_ring", "local_first")
    K, N, rows = 2048, 1024, 1024
    probe = torch.empty(1, K, dtype=torch.bfloat16, device=device)
    if available(probe, torch.empty(K, N, dtype=torch.bfloat16, device=device), None)[0]:
        schedules += ("arrival", )
    cases, refs = [], []
    for i in range(calls):  # inputs and references first: nothing below waits for the host
        schedule = schedules[(i // 2) % len(schedules)]
        lf = schedule == "local_first"
        seed = 9000 + 100 * i
        if i % 2 == 0:
            xs = [_rand((rows, K), seed + r, torch.bfloat16, device) for r in range(G)]
            w = _rand((K, N), seed + 50 + me, torch.bfloat16, device)
            cases.append((all_gather_matmul, xs[me], w, schedule))
            refs.append(ref_all_gather_matmul(xs, w, me if lf else None,
                                              gemm="uniep" if schedule == "arrival" else "torch"))
        else:
            xs = [_rand((rows * G, K), seed + r, torch.bfloat16, device) for r in range(G)]
            ws = [_rand((K, N), seed + 50 + r, torch.bfloat16, device) for r in range(G)]
            cases.append((matmul_reduce_scatter, xs[me], ws[me], schedule))
            refs.append(ref_matmul_reduce_scatter(xs, ws, local_first=lf)[me])
    torch.cuda.synchronize(device)
    outs = []
    for i, (op, x, w, schedule) in enumerate(cases):
        if (i + me) % 3 == 0:
            torch.cuda._sleep(1_000_000 * (1 + me))  # this rank reaches this call late
        sizes = {"shard_sizes": [rows] * G} if op is all_gather_matmul else {}  # no size exchange (a host sync)
        outs.append(op(x, w, schedule=schedule, transport="copy_engine", **sizes))
    torch.cuda.synchronize(device)
    return sum(not torch.equal(o, r) for o, r in zip(outs, refs))


def _check_fresh_workspace_late_peer(me, G, device):
    """The first copy-engine call on a new group's (fresh) workspace, each rank's copies held back
    by a GPU spin of a rank-dependent length, so that the peers' blocks land late: the result is
    still the reference's (a wait that returned before the block landed would read the empty
    buffer). Returns how many calls differed."""
    import torch.distributed as dist

    from ds_uniep.commfuse import all_gather_matmul, ref_all_gather_matmul
    sizes, differed = _shard_sizes(G), 0
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32)):
        group = dist.new_group(list(range(G)))
        xs = [_rand((sizes[r], 37), 12000 + 100 * i + r, dtype, device) for r in range(G)]
        w = _rand((37, 29), 12050 + 100 * i + me, dtype, device)
        ref = ref_all_gather_matmul(xs, w)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(2_000_000 * (1 + (me + i) % G))  # this rank's copies start late
        y = all_gather_matmul(xs[me], w, group, schedule="ring", shard_sizes=sizes, transport="copy_engine")
        torch.cuda.synchronize(device)
        differed += not torch.equal(y, ref)
    return differed


def _check_arrival_timeout(me, G, device):
    """A peer that never makes the call: the waiting rank does not hang, and its next call raises
    ArrivalTimeoutError naming itself and a missing peer. On a group of its own, whose buffers the
    timeout leaves unusable."""
    import time

    import torch.distributed as dist

    from ds_uniep.commfuse import all_gather_matmul, arrival
    group = dist.new_group(list(range(G)))
    rows, K, N = 16, 64, 64
    x = _rand((rows, K), 8000 + me, torch.bfloat16, device)
    w = _rand((K, N), 8100, torch.bfloat16, device)
    all_gather_matmul(x, w, group, schedule="arrival", shard_sizes=[rows] * G)  # buffers and words: collective
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    if me == 0:
        old = arrival.TIMEOUT_S
        arrival.TIMEOUT_S = 0.5
        try:
            t0 = time.monotonic()
            all_gather_matmul(x, w, group, schedule="arrival", shard_sizes=[rows] * G)  # no peer comes
            torch.cuda.synchronize(device)
            waited = time.monotonic() - t0
            with pytest.raises(arrival.ArrivalTimeoutError,
                               match=r"rank 0 waited more than 0.5 s for the block of group rank [1-9]"):
                all_gather_matmul(x, w, group, schedule="arrival", shard_sizes=[rows] * G)
        finally:
            arrival.TIMEOUT_S = old
        assert waited < 30, f"the timed-out call took {waited:.1f} s"
    dist.barrier(group=group)


def _check_arrival(me, G, device):
    """The ``arrival`` schedule: the bits of ds_uniep's GEMM over the gathered rows (odd blocks,
    empty ones, this rank's among them), within rounding of the cuBLAS block GEMMs; its backward
    and its reduce-scatter are bidirectional_ring's, bit for bit."""
    from ds_uniep.commfuse import (all_gather_matmul, matmul_reduce_scatter, ref_all_gather_matmul,
                                   ref_matmul_reduce_scatter)
    bf16 = torch.bfloat16
    K, N = 264, 136  # multiples of 8, not of any tile
    sizes = _shard_sizes(G)
    xs = [_rand((sizes[r], K), 7000 + r, bf16, device) for r in range(G)]
    weights = [_rand((N, K), 7100 + r, bf16, device) for r in range(G)]  # nn.Linear layout
    gys = [_rand((sum(sizes), N), 7200 + r, bf16, device) for r in range(G)]
    x = xs[me].clone().requires_grad_()
    weight = weights[me].clone().requires_grad_()
    y = all_gather_matmul(x, weight.t(), schedule="arrival")
    want = ref_all_gather_matmul(xs, weights[me].t(), gemm="uniep")
    assert torch.equal(y, want), "arrival forward against ds_uniep's GEMM over the gathered rows"
    cublas = ref_all_gather_matmul(xs, weights[me].t())
    assert (y.float() - cublas.float()).abs().max().item() <= 0.02 * cublas.float().abs().max().item()
    y.backward(gys[me])
    assert torch.equal(x.grad, ref_matmul_reduce_scatter(gys, weights, out_sizes=sizes)[me]), "arrival d x_shard"
    assert torch.equal(weight.grad, (torch.cat(xs).t() @ gys[me]).t()), "arrival d weight"
    # A [K, N] w that is not a transposed view (copied into the GEMM's layout): the same bits.
    assert torch.equal(all_gather_matmul(xs[me], weights[me].t().contiguous(), schedule="arrival",
                                         shard_sizes=sizes), want)
    # Empty blocks (this rank's on every even rank) move nothing and change nothing.
    sizes0 = [0 if r % 2 == 0 else sizes[r] for r in range(G)]
    xs0 = [x_[:n] for x_, n in zip(xs, sizes0)]
    y0 = all_gather_matmul(xs0[me].clone(), weights[me].t(), schedule="arrival", shard_sizes=sizes0)
    assert torch.equal(y0, ref_all_gather_matmul(xs0, weights[me].t(), gemm="uniep")), "arrival, empty blocks"
    # Its reduce-scatter is bidirectional_ring's.
    T = 131
    xr = [_rand((T, 16 + 8 * r), 7300 + r, bf16, device) for r in range(G)]
    wr = [_rand((16 + 8 * r, N), 7400 + r, bf16, device) for r in range(G)]
    out = matmul_reduce_scatter(xr[me], wr[me], schedule="arrival")
    assert torch.equal(out, ref_matmul_reduce_scatter(xr, wr)[me]), "arrival reduce-scatter"
    with pytest.raises(ValueError, match="transport 'p2p' does not apply"):
        all_gather_matmul(xs[me], weights[me].t(), schedule="arrival", transport="p2p")
    with pytest.raises(RuntimeError, match="'arrival' cannot run here: it runs ds_uniep's grouped GEMM, which "
                       "takes bf16"):
        all_gather_matmul(xs[me].float(), weights[me].t().float(), schedule="arrival")


# --------------------------------------------------------------------------- parallel linears
def _check_linears(me, G, device, dtype):
    from ds_uniep.commfuse import ColumnParallelLinear, RowParallelLinear
    from ds_uniep.config import UniEPConfig
    H, F, B = 24, 12 * G, 2
    seq = [3, 5, 2, 7][:G] if G <= 4 else [3] * G
    off = sum(seq[:me])
    torch.manual_seed(1234)  # the same full layers on every rank
    lin1, lin2 = torch.nn.Linear(H, F), torch.nn.Linear(F, H)
    with torch.no_grad():
        lin1.bias.normal_()
        lin2.bias.normal_()
    x_full = _rand((sum(seq), B, H), 77, torch.float32, "cpu")
    g_full = _rand((sum(seq), B, H), 78, torch.float32, "cpu")

    def single(dt):
        l1 = torch.nn.Linear(H, F).to(dt)
        l2 = torch.nn.Linear(F, H).to(dt)
        l1.load_state_dict(lin1.state_dict())
        l2.load_state_dict(lin2.state_dict())
        x = x_full.to(dt, copy=True).requires_grad_()
        out = l2(torch.nn.functional.gelu(l1(x)))
        out.backward(g_full.to(dt))
        return [t.float() for t in (out, x.grad, l1.weight.grad, l1.bias.grad, l2.weight.grad, l2.bias.grad)]

    ref32 = single(torch.float32)
    ref_lp = single(dtype)

    for schedule in ("ring", "bidirectional_ring"):
        cfg = UniEPConfig.from_dict({"commfuse": {"schedule": schedule, "num_chunks": 2}})
        col = ColumnParallelLinear.from_linear(lin1, config=cfg.commfuse).to(device=device, dtype=dtype)
        row = RowParallelLinear.from_linear(lin2, config=cfg.commfuse).to(device=device, dtype=dtype)
        assert isinstance(col.weight, torch.nn.Parameter) and col.weight.shape == (F // G, H)
        assert isinstance(row.weight, torch.nn.Parameter) and row.weight.shape == (H, F // G)
        x = x_full[off:off + seq[me]].to(device=device, dtype=dtype, copy=True).requires_grad_()
        h = col(x)
        assert h.shape == (sum(seq), B, F // G)
        out = row(torch.nn.functional.gelu(h), seq_sizes=seq)
        assert out.shape == (seq[me], B, H)
        out.backward(g_full[off:off + seq[me]].to(device=device, dtype=dtype))
        n, k = F // G, F // G
        ours = [out, x.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad]
        want = [ref32[0][off:off + seq[me]], ref32[1][off:off + seq[me]], ref32[2][me * n:(me + 1) * n],
                ref32[3][me * n:(me + 1) * n], ref32[4][:, me * k:(me + 1) * k], ref32[5]]
        lp = [ref_lp[0][off:off + seq[me]], ref_lp[1][off:off + seq[me]], ref_lp[2][me * n:(me + 1) * n],
              ref_lp[3][me * n:(me + 1) * n], ref_lp[4][:, me * k:(me + 1) * k], ref_lp[5]]
        names = ["output", "d x", "d column weight", "d column bias", "d row weight", "d row bias"]
        for name, o, w32, wlp in zip(names, ours, want, lp):
            assert o is not None, f"{name} {schedule}: no gradient"
            o = o.float().cpu()
            assert o.shape == w32.shape, f"{name}: {o.shape} vs {w32.shape}"
            if dtype == torch.float32:
                torch.testing.assert_close(o, w32, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {schedule}: {m}")
            else:
                # At most twice the single-process low-precision error against fp32.
                err, err_ref = (o - w32).abs().max().item(), (wlp - w32).abs().max().item()
                tol = max(2 * err_ref, 1e-2 * w32.abs().max().item())
                assert err <= tol, f"{name} {schedule} {dtype}: error {err} > {tol} (reference's own {err_ref})"


def _check_errors(me, G, device):
    from ds_uniep.commfuse import ColumnParallelLinear, RowParallelLinear, all_gather_matmul, matmul_reduce_scatter
    x = _rand((5, 7), 1, torch.float32, device)
    with pytest.raises(ValueError, match=r"x_shard \(5, 7\) and w \(8, 3\)"):
        all_gather_matmul(x, _rand((8, 3), 2, torch.float32, device))
    with pytest.raises(TypeError, match="x_shard is torch.float32 but w is torch.bfloat16"):
        all_gather_matmul(x, _rand((7, 3), 2, torch.bfloat16, device))
    with pytest.raises(ValueError, match="x_shard must be 2-D"):
        all_gather_matmul(x[None], _rand((7, 3), 2, torch.float32, device))
    with pytest.raises(ValueError, match="schedule must be one of ring, bidirectional_ring"):
        all_gather_matmul(x, _rand((7, 3), 2, torch.float32, device), schedule="tree")
    with pytest.raises(ValueError, match="num_chunks must be a positive integer"):
        matmul_reduce_scatter(x, _rand((7, 3), 2, torch.float32, device), num_chunks=0)
    with pytest.raises(ValueError, match="shard_sizes"):
        all_gather_matmul(x, _rand((7, 3), 2, torch.float32, device), shard_sizes=[5] * (G + 1))
    with pytest.raises(ValueError, match="out_sizes"):
        matmul_reduce_scatter(x, _rand((7, 3), 2, torch.float32, device), out_sizes=[1] * G)
    with pytest.raises(ValueError, match=f"out_features={3 * G + 1} is not divisible by the group size {G}"):
        ColumnParallelLinear(8, 3 * G + 1)
    with pytest.raises(ValueError, match=f"in_features={3 * G + 1} is not divisible by the group size {G}"):
        RowParallelLinear(3 * G + 1, 8)
    col = ColumnParallelLinear(8, 2 * G, device=device)
    with pytest.raises(ValueError, match=r"input x has shape \(4, 9\); expected \[S_r, \*B, 8\]"):
        col(_rand((4, 9), 3, torch.float32, device))
    with pytest.raises(TypeError, match="input x is torch.bfloat16 but weight is torch.float32"):
        col(_rand((4, 8), 3, torch.bfloat16, device))
    with pytest.raises(TypeError, match="CommFuseConfig"):
        ColumnParallelLinear(8, 2 * G, config={"schedule": "ring"})


def _plans_consistent():
    """Pure schedule check: every send has a matching receive and every block/partial arrives once."""
    from ds_uniep.commfuse.common import _offsets, _remote_runs
    from ds_uniep.commfuse.ops import _ag_plan, _rs_plan
    for G in range(1, 9):
        # local_first: the runs cover every row but this rank's once, each run whole blocks.
        for sizes in ([3] * G, [0, 5, 0, 2, 7, 0, 1, 4][:G], [1, 19, 111, 5, 0, 7, 7, 7][:G]):
            offs = _offsets(sizes)
            for me in range(G):
                covered = sorted(i for r0, n, _ in _remote_runs(sizes, me) for i in range(r0, r0 + n))
                assert covered == [i for i in range(sum(sizes)) if not offs[me] <= i < offs[me] + sizes[me]]
                for r0, n, blocks in _remote_runs(sizes, me):
                    assert sum(sizes[b] for b in blocks) == n and offs[blocks[0]] == r0 and me not in blocks
        for schedule in ("ring", "bidirectional_ring"):
            plans = [_ag_plan(G, r, schedule) for r in range(G)]
            assert len({len(p) for p in plans}) == 1
            for r in range(G):
                got = [b for gemm, _ in plans[r] for b in gemm]
                assert sorted(got) == list(range(G)), (G, schedule, r, got)
            for s in range(len(plans[0])):
                sends = sorted((r, to, b, tag) for r in range(G) for b, to, _, _, tag in plans[r][s][1])
                recvs = sorted((frm, r, b, tag) for r in range(G) for _, _, b, frm, tag in plans[r][s][1])
                assert sends == recvs, (G, schedule, s)
            steps = _rs_plan(G, schedule)
            offsets = sorted(d % G for ds in steps for d in ds)
            assert offsets == list(range(1, G)), (G, schedule, offsets)
            if schedule == "bidirectional_ring":
                assert len(steps) == G // 2


class _TensorParallelMPU:
    """The whole world is one tensor-parallel group; each rank is its own data-parallel group."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.dp = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]

    def get_model_parallel_rank(self):
        return self.dist.get_rank()

    def get_model_parallel_world_size(self):
        return self.dist.get_world_size()

    def get_model_parallel_group(self):
        return self.dist.group.WORLD

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self.dp


def _check_deepspeed(me, G):
    """The linears train inside a DeepSpeed engine: one SGD step equals the single-process one."""
    import deepspeed
    from ds_uniep.commfuse import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(5)
    l1, l2 = torch.nn.Linear(16, 8 * G), torch.nn.Linear(8 * G, 16)
    model = torch.nn.Sequential(ColumnParallelLinear.from_linear(l1), torch.nn.GELU(),
                                RowParallelLinear.from_linear(l2))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      mpu=_TensorParallelMPU())
    x = _rand((5 * G, 16), 9, torch.float32, "cpu")
    engine.backward(engine(x.chunk(G)[me].clone().to(engine.device)).square().sum())
    engine.step()
    model.cpu()
    ref = torch.nn.Sequential(l1, torch.nn.GELU(), l2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).square().sum().backward()
    opt.step()
    n = 8
    torch.testing.assert_close(model[0].weight, l1.weight[me * n:(me + 1) * n].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[0].bias, l1.bias[me * n:(me + 1) * n].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[2].weight, l2.weight[:, me * n:(me + 1) * n].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[2].bias, l2.bias.detach(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- spawned bodies
def _body(rank, G, device_kind, bench_out=None):
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    combos = [(d, s, c) for d in (torch.float32, torch.bfloat16) for s in ("ring", "bidirectional_ring", "local_first")
              for c in (1, 3)]
    if G > 2 and device_kind == "cpu":
        # Every value of each option, and every pair of dtype and schedule, at a third of the cost.
        combos = [combos[i] for i in (0, 3, 5, 7, 8, 10)]
    for i, (dtype, schedule, num_chunks) in enumerate(combos):
        _check_ops(rank, G, device, dtype, schedule, num_chunks, 1000 * (i + 1), transport="p2p")
    _check_fixed_order(rank, G, device, "p2p")
    _check_fp64(rank, G, device, "p2p")
    _check_relay(rank, G, device, "p2p")
    if device_kind == "cuda":
        # The copy-engine transport: the same bits as the references (chunks: the reduce-scatter's
        # own partial GEMM in row chunks, each chunk's sum overlapped with the next).
        for i, (dtype, schedule, c) in enumerate([(d, s, c) for d in (torch.float32, torch.bfloat16)
                                                  for s in ("ring", "bidirectional_ring", "local_first")
                                                  for c in (1, 3)]):
            _check_ops(rank, G, device, dtype, schedule, c, 5000 + 1000 * i, transport="copy_engine")
        _check_fixed_order(rank, G, device, "copy_engine")
        _check_relay(rank, G, device, "copy_engine")
        from ds_uniep.commfuse.arrival import available
        probe = torch.empty(1, 8, dtype=torch.bfloat16, device=device)
        arrival_ok = available(probe, torch.empty(8, 8, dtype=torch.bfloat16, device=device), None)[0]
        if arrival_ok:
            _check_arrival(rank, G, device)
        assert _check_back_to_back(rank, G, device) == 0, "back-to-back copy-engine calls differ from references"
        assert _check_fresh_workspace_late_peer(rank, G, device) == 0, \
            "first copy-engine calls on a fresh workspace with a late peer differ from references"
        if arrival_ok:
            _check_arrival_timeout(rank, G, device)
    else:
        from ds_uniep.commfuse import all_gather_matmul
        x = torch.ones(2, 3)
        with pytest.raises(RuntimeError, match="copy_engine.*needs CUDA"):
            all_gather_matmul(x, torch.ones(3, 2), transport="copy_engine")
        with pytest.raises(ValueError, match="transport must be one of"):
            all_gather_matmul(x, torch.ones(3, 2), transport="nvlink")
        from ds_uniep.commfuse import matmul_reduce_scatter
        xb, wb = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, 16, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="all_gather_matmul: commfuse schedule 'arrival' cannot run here: it "
                           "needs the copy-engine transport, which needs CUDA tensors"):
            all_gather_matmul(xb, wb, schedule="arrival")
        with pytest.raises(RuntimeError, match="matmul_reduce_scatter: commfuse schedule 'arrival' cannot run here"):
            matmul_reduce_scatter(torch.ones(4, 16, dtype=torch.bfloat16), wb.t(), schedule="arrival")
        with pytest.raises(ValueError, match="matmul_reduce_scatter: commfuse schedule 'arrival' .* transport 'p2p' "
                           "does not apply"):  # its backward would refuse it only after the forward ran
            matmul_reduce_scatter(torch.ones(4, 16, dtype=torch.bfloat16), wb.t(), schedule="arrival", transport="p2p")
    for dtype in (torch.float32, torch.bfloat16):
        _check_linears(rank, G, device, dtype)
    _check_errors(rank, G, device)
    from deepspeed.accelerator import get_accelerator
    if G == 2 and (device_kind == "cuda") == (get_accelerator().device_name() == "cuda"):
        # Where DeepSpeed's accelerator is CUDA its engine moves the model there: checked over NCCL.
        _check_deepspeed(rank, G)
    if bench_out is not None:
        sys.path.insert(0, os.path.dirname(BENCH))
        import bench_commfuse
        results = bench_commfuse.main(["--dry-run", "--out", bench_out])
        bits = {f"{op} {k}": v for op, d in results["ops"].items() for k, v in d["checks"].items()
                if k.endswith("_bitwise_vs_reference")}
        assert any(k.startswith("matmul_reduce_scatter") for k in bits) and all(bits.values()), bits
        assert bench_commfuse.failed_checks(results) == []
        # what the script's exit reports: a check that raised and a broken bitwise promise
        broken = {"ops": {"x": {"checks": {"error": "RuntimeError: lost"}},
                          "y": {"checks": {"ring_bitwise_vs_reference": False, "ring": 0.0, "arrival": "error: E"}}}}
        assert len(bench_commfuse.failed_checks(broken)) == 3
        cases = bench_commfuse.main(["--dry-run", "--cases", "ulysses", "dp", "--out", bench_out])["ops"]
        for case in ("ulysses", "dp"):
            times = cases[case]["times"]
            assert {"gemm_alone", "comm_alone", "unfused", "cf.p2p.ring.c1"} <= set(times), (case, list(times))
            for name, r in times.items():
                assert r["median_ms"] is not None and r["speedup_vs_unfused"] is not None, (case, name, r)
                assert ("exposed_frac_of_unfused_comm" in r) == (name not in ("gemm_alone", "comm_alone")), (case, r)
            # the fused forms' outputs against the unfused ones (bitwise at these CPU sizes)
            assert cases[case]["checks"] == {k: 0.0 for k in times if k.startswith("cf.")}, cases[case]["checks"]


class _GemmRows(torch.overrides.TorchFunctionMode):
    """Records the row count of every ``@`` / ``torch.matmul`` left operand."""

    def __enter__(self):
        self.rows = []
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__matmul__", "matmul"):
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_reference_own_chunks_cuts_only_the_owners_partial():
    """``ref_matmul_reduce_scatter(own_chunks=C)``: block j's own partial (rank j's) is one GEMM per
    row chunk of the block (``_chunks``), every other partial one GEMM per block, added in rank
    order in fp32 and cast once; C = 1 and blocks of one row or none keep the whole-block GEMM."""
    from ds_uniep.commfuse import ref_matmul_reduce_scatter
    from ds_uniep.commfuse.common import _chunks, _offsets
    G, N = 3, 5
    for sizes in ([4, 3, 3], [1, 0, 9]):
        T = sum(sizes)
        xs = [_rand((T, 6 + r), 40 + r, torch.bfloat16, "cpu") for r in range(G)]
        ws = [_rand((6 + r, N), 50 + r, torch.bfloat16, "cpu") for r in range(G)]
        offs = _offsets(sizes)
        for local_first in (False, True):
            assert all(torch.equal(a, b) for a, b in zip(
                ref_matmul_reduce_scatter(xs, ws, sizes, local_first, own_chunks=1),
                ref_matmul_reduce_scatter(xs, ws, sizes, local_first)))
        with _GemmRows() as seen:
            got = ref_matmul_reduce_scatter(xs, ws, sizes, own_chunks=2)
        want_rows = sorted([n for j in range(G) if sizes[j] > 1 for _, n in _chunks(sizes[j], 2)] +
                           [sizes[j] for j in range(G) for r in range(G) if r != j or sizes[j] <= 1])
        assert sorted(seen.rows) == want_rows, (sizes, seen.rows)
        for j in range(G):
            rows = slice(offs[j], offs[j] + sizes[j])
            acc = None
            for r in range(G):
                if r == j and sizes[j] > 1:
                    part = torch.cat([xs[r][offs[j] + c0:offs[j] + c0 + n] @ ws[r] for c0, n in _chunks(sizes[j], 2)])
                else:
                    part = xs[r][rows] @ ws[r]
                acc = part.float() if acc is None else acc + part.float()
            assert torch.equal(got[j], acc.to(torch.bfloat16)), f"block {j} of sizes {sizes}"


def test_schedules_cover_every_block_once():
    _plans_consistent()


def test_arrival_segments_cover_every_row_once_own_block_first():
    """The arrival schedule's one GEMM: this rank's block first (read from the caller's tensor, no
    wait), then the blocks of me-1, me-2, ... each waiting for its owner's word; empty blocks have
    no segment, and together the segments cover every row once."""
    from ds_uniep.commfuse.arrival import segments
    from ds_uniep.commfuse.common import _offsets
    from ds_uniep.gemm import SEG_ALT_ROWS
    for sizes in ([3], [5, 7], [1, 19, 111, 5], [0, 5, 0, 2, 7, 0, 1, 4], [0, 0, 0]):
        offs = _offsets(sizes)
        for me in range(len(sizes)):
            segs = segments(sizes, offs, me)
            rows = sorted(i for r0, n, _, _ in segs for i in range(r0, r0 + n))
            assert rows == list(range(sum(sizes))), (sizes, me, segs)
            if sizes[me]:
                assert segs[0] == (offs[me], sizes[me], SEG_ALT_ROWS, -1)
                segs = segs[1:]
            owners = [(me - d) % len(sizes) for d in range(1, len(sizes)) if sizes[(me - d) % len(sizes)]]
            assert [(r0, n, w, word) for r0, n, w, word in segs] == [(offs[o], sizes[o], 0, o) for o in owners]


def test_two_ranks_gloo(tmp_path):
    run_distributed(_body, 2, "cpu", str(tmp_path))
    for name in ("commfuse_results.json", "commfuse_timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_four_ranks_gloo():
    run_distributed(_body, 4, "cpu")


def test_bench_help():
    r = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--dry-run" in r.stdout and "--out" in r.stdout


@needs_gpus(2)
def test_two_ranks_nccl():
    run_distributed(_body, 2, "cuda", backend="nccl")


@needs_gpus(4)
def test_four_ranks_nccl():
    run_distributed(_body, 4, "cuda", backend="nccl")


def _sum_inputs(n_parts, shape, dtype, device):
    # Self-identifying and wide-ranging, so a changed addition order changes the rounded bits.
    g = torch.Generator().manual_seed(7)
    return [((torch.randn(shape, generator=g) * 10.0 ** (i % 4 - 2)) + i).to(device=device, dtype=dtype)
            for i in range(n_parts)]


def _sum_by_steps(parts):
    acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:]:
        acc.add_(p)
    return acc.to(parts[0].dtype)


def test_ordered_sum_rejects_mismatched_parts():
    from ds_uniep.commfuse.common import ordered_sum
    with pytest.raises(ValueError, match="every part must have the shape"):
        ordered_sum([torch.zeros(3, 2), torch.zeros(2, 3)])
    parts = _sum_inputs(3, (5, 7), torch.bfloat16, "cpu")
    assert torch.equal(ordered_sum(parts), _sum_by_steps(parts))


@needs_gpus(1)
def test_ordered_sum_on_cuda_adds_in_list_order():
    """The one-pass CUDA kernel gives the bits of fp32 adds in list order and one cast; a sum in another
    order gives other bits on these inputs (so the check can fail)."""
    from ds_uniep.commfuse import common
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n_parts in (2, 3, 4, 8):
            for shape in ((1,), (19, 33), (2048, 4099 + n_parts)):
                parts = _sum_inputs(n_parts, shape, dtype, "cuda")
                want = _sum_by_steps(parts)
                got = common.ordered_sum(parts)
                strided = common.ordered_sum([torch.stack([p, p], -1)[..., 0] for p in parts])
                assert got.dtype == dtype and torch.equal(got, want), (dtype, n_parts, shape)
                assert torch.equal(strided, want), ("strided", dtype, n_parts, shape)
        parts = _sum_inputs(4, (2048, 4096), dtype, "cuda")
        assert not torch.equal(_sum_by_steps(parts), _sum_by_steps(parts[::-1])), dtype
    assert not common._SUM_FALLBACK[0], "the one-pass kernel fell back to step-by-step adds"
