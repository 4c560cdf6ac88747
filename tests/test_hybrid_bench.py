"""Inter-site pacing (emulated slow links between sites) and the HybridEP benchmark's core, on 4 gloo ranks
as 2 sites of 2: pacing holds ranks for exactly the inter-site bytes and changes no numbers; the benchmark
reports every option at every point, and HybridEP's outputs equal plain EP's."""
import json
import os
import sys
import time

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pacing_rejects_bad_arguments():
    from ds_uniep.hybrid.pacing import InterSitePacing
    for kwargs, word in (({"site_size": 0, "bytes_per_s": 1e9}, "site_size"),
                         ({"site_size": 2, "bytes_per_s": 0}, "bytes_per_s"),
                         ({"site_size": 2, "bytes_per_s": float("inf")}, "bytes_per_s"),
                         ({"site_size": 2, "bytes_per_s": 1e9, "hold": "later"}, "hold")):
        with pytest.raises(ValueError, match=word):
            InterSitePacing(**kwargs)


def test_background_transfers_yield_to_blocking_ones_and_overlap_compute():
    """One far peer, 1 MB/s: a 40 ms background transfer behind which a 20 ms blocking one goes first
    ends at 60 ms; compute done meanwhile is not added; a second background one queues behind the first."""
    from ds_uniep.hybrid.pacing import InterSitePacing
    cpu = torch.device("cpu")
    pacing = InterSitePacing(2, 1e6)
    pacing.remote = lambda group: [False, True]
    t0 = time.perf_counter()
    bg = pacing.start(None, [0, 40_000], [0, 40_000], cpu)
    assert pacing.pace(None, [0, 20_000], [0, 10_000], cpu) == pytest.approx(0.02)
    pacing.finish(bg, cpu)
    assert 0.058 <= time.perf_counter() - t0 < 0.1
    t0 = time.perf_counter()
    first = pacing.start(None, [0, 30_000], [0, 0], cpu)
    second = pacing.start(None, [0, 30_000], [0, 0], cpu)
    time.sleep(0.05)  # compute while the bytes cross
    pacing.finish(first, cpu)
    assert 0.05 <= time.perf_counter() - t0 < 0.058
    pacing.finish(second, cpu)
    assert 0.059 <= time.perf_counter() - t0 < 0.1
    assert pacing.start(None, [5, 0], [5, 0], cpu) is None  # nothing crosses sites
    assert pacing.paced_transfers == 4 and pacing.paced_bytes == 120_000
    assert pacing.paced_s == pytest.approx(0.12)


M, F, BW = 16, 24, 20e6  # 20 MB/s between sites


def _layer(world_size, rank, S, pacing):
    from moe_models import MLP, distinct_experts

    from ds_uniep import UniEPMoE
    torch.manual_seed(3)
    cfg = {"backend": "reference"}
    if S > 1:
        cfg["hybrid"] = {"enabled": True, "domain_size": S, "site_size": 2}
    layer = UniEPMoE(M, MLP(M, F), num_experts=2 * world_size, ep_size=world_size, k=2, drop_tokens=False,
                     use_rts=False, top2_2nd_expert_sampling=False, config=cfg)
    distinct_experts(layer, rank)
    if pacing is not None:
        layer.set_inter_site_pacing(pacing)
    layer.set_deepspeed_parallelism()
    return layer


def _fwd_bwd(layer, x, gy):
    x = x.clone().requires_grad_(True)
    out, l_aux, _ = layer(x)
    ((out * gy).sum() + l_aux).backward()
    with torch.no_grad():
        route_idx = layer.deepspeed_moe.gate(x, None, True)[3]  # [k, T] experts, -1 where dropped
    counts = torch.bincount(route_idx[route_idx >= 0].flatten(), minlength=layer.num_experts)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()], counts


def _expected_token_bytes(rank, world_size, S, counts):
    """2 sites of 2 ranks, 2 experts per rank; 4 all-to-alls (dispatch, combine and their gradients), each
    holding this rank for max(rows sent to, rows received from the other site) * M * 4 bytes. Plain EP
    receives the far ranks' rows for its own experts; with S = 2 (domain = site) the offset peer's rows for
    the experts of the whole site."""
    import torch.distributed as dist
    everyone = [torch.empty_like(counts) for _ in range(world_size)]
    dist.all_gather(everyone, counts)
    c = torch.stack(everyone)  # [G, E]: rows of rank j's tokens for expert e
    site = rank // 2
    site_of_expert = torch.arange(2 * world_size) // 4
    sent = int(c[rank, site_of_expert != site].sum())
    if S == 1:
        mine = torch.arange(2 * world_size) // 2 == rank
        received = int(c[[j for j in range(world_size) if j // 2 != site]][:, mine].sum())
    else:
        received = int(c[(rank + 2) % world_size, site_of_expert == site].sum())
    return 4 * max(sent, received) * M * 4


def _expert_bytes():
    from moe_models import MLP
    return sum(p.numel() * 4 for p in MLP(M, F).parameters())


def _pacing_body(rank, world_size):
    import torch.distributed as dist

    from ds_uniep.hybrid.pacing import InterSitePacing
    from ds_uniep.hybrid.planning import measure_bandwidths
    g = torch.Generator().manual_seed(rank)
    x, gy = torch.randn(40, M, generator=g), torch.randn(40, M, generator=g)
    for S in (1, 2, 4):
        free, _ = _fwd_bwd(_layer(world_size, rank, S, None), x, gy)
        pacing = InterSitePacing(2, BW)
        t0 = time.perf_counter()
        paced, counts = _fwd_bwd(_layer(world_size, rank, S, pacing), x, gy)
        elapsed = time.perf_counter() - t0
        for a, b in zip(free, paced):
            assert torch.equal(a, b), f"rank {rank} S={S}: pacing changed a number"
        if S == 4:  # no tokens cross sites; each far peer gets, and returns gradients of, every local expert
            expected = 2 * (2 * 2 * _expert_bytes())
        else:
            expected = _expected_token_bytes(rank, world_size, S, counts)
        assert pacing.paced_bytes == expected, (rank, S, pacing.paced_bytes, expected)
        # S = 4: one gather and one gradient return, whatever the number of tensors; else 4 all-to-alls.
        assert pacing.paced_transfers == (2 if S == 4 else 4), (rank, S, pacing.paced_transfers)
        assert pacing.paced_s == pytest.approx(expected / BW)
        assert elapsed >= 0.95 * pacing.paced_s, (rank, S, elapsed, pacing.paced_s)
    intra, inter = measure_bandwidths(dist.group.WORLD, 2, nbytes=256 << 10, repeats=2,
                                      pacing=InterSitePacing(2, BW))
    assert 0.5 * BW < inter <= BW, inter
    assert intra > inter, (intra, inter)


def test_pacing_holds_ranks_for_inter_site_bytes_and_changes_no_numbers():
    run_distributed(_pacing_body, 4)


# --------------------------------------------------------------------------- the benchmark's core
def _bench_body(rank, world_size, out_dir):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_hybrid
    args = bench_hybrid.parse_args(["--device", "cpu", "--tokens", "16", "96", "--experts", "16x16", "--inter-bw",
                                    "20MB/s", "--warmup", "0", "--repeats", "1", "--probe-bytes", str(64 << 10),
                                    "--out", out_dir])
    results = bench_hybrid.run(args, log=lambda *a, **k: None)
    assert [p["T"] for p in results["points"]] == [16, 96]
    for p in results["points"]:
        assert set(p["options"]) == {"EP", "S=2", "S=4"}, p["options"].keys()
        for name, o in p["options"].items():
            for key in ("measured_ms", "predicted_ms", "ratio", "inter_bytes_measured", "inter_bytes_model"):
                assert o[key] > 0, (name, key, o[key])
            if name == "EP":  # the reference the others are checked against
                assert o["rel_err_out"] is None and o["rel_err_dx"] is None and o["outputs_match"] is None, o
                continue
            assert o["rel_err_out"] <= 1e-5 and o["rel_err_dx"] <= 1e-5, (name, o)
            assert o["outputs_match"], (name, o)
        # Expert gather and gradient return are deterministic, and the model is fed with the checked
        # run's routing: paced bytes are the model's exactly, tokens included.
        for name, o in p["options"].items():
            assert o["inter_bytes_measured"] == o["inter_bytes_model"], (name, o)
        s4 = p["options"]["S=4"]
        assert s4["inter_bytes_measured"] == 4 * 2 * p["expert_bytes"], s4
        assert s4["inter_transfers_measured"] == 2 and p["options"]["EP"]["inter_transfers_measured"] == 4
        assert p["planner"]["runtime_choice"] in p["options"] and p["best"] in p["options"]
        assert p["speedup_best_hybrid"] > 0 and p["compute"]["c_b"] >= 1
        assert (p["planner"]["auto_overhead"] is None) == (p["planner"]["runtime_choice"] != "EP")
    s = results["summary"]
    assert s["predictions"] == 6 and s["points"] == 2 and s["outputs_match"]
    assert set(s["checks"]) == {"model_within_15pct_everywhere", "planner_within_5pct_in_most",
                                "speedup_grows_with_token_bytes", "speedup_at_least_2x_at_largest",
                                "overhead_at_most_2pct_where_planner_keeps_ep"}
    if rank == 0:
        bench_hybrid.write(results, out_dir, with_plot=True)
        bench_hybrid.print_table(results)


def _one_tiny_point(*extra):
    """(the bench module, its results) for one point of 32 tokens and 16x16 experts on the CPU ranks."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_hybrid
    args = bench_hybrid.parse_args(["--device", "cpu", "--tokens", "32", "--experts", "16x16", "--inter-bw",
                                    "20MB/s", "--warmup", "0", "--repeats", "1", "--probe-bytes", str(64 << 10),
                                    "--out", "unused", *extra])
    return bench_hybrid, bench_hybrid.run(args, log=lambda *a, **k: None)


def _bench_steps(rank, world_size):
    """--microbatches 3: HybridEP gathers and returns once per step; the step's paced bytes are the model's."""
    _, results = _one_tiny_point("--microbatches", "3")
    (p, ) = results["points"]
    assert p["microbatches"] == 3
    for name, o in p["options"].items():
        assert o["measured_ms"] > 0 and o["predicted_ms"] > 0 and o["step_inter_bytes_measured"] > 0, (name, o)
        if name != "EP":
            assert (o["gathers_per_step"], o["returns_per_step"]) == (1, 1), (name, o)
            assert o["outputs_match"], (name, o)
    # S = 4 (one domain: no tokens cross sites, so no routing enters): one gather and one return of
    # 2 experts per peer per step, the model's bytes exactly (the token bytes follow the routing).
    s4 = p["options"]["S=4"]
    assert s4["step_inter_bytes_measured"] == s4["step_inter_bytes_model"] == 4 * 2 * p["expert_bytes"], s4


def _bench_fractions(rank, world_size):
    """--fractions 0.5: partial-migration options beside whole domains, every one matching plain EP."""
    bench_hybrid, results = _one_tiny_point("--fractions", "0.5")
    (p, ) = results["points"]
    assert results["option_names"] == ["EP", "S=2", "S=2 m=1", "S=4", "S=4 m=1"], results["option_names"]
    for name, o in p["options"].items():
        assert o["migrated_experts"] == {"EP": 0, "S=2": 2, "S=4": 2}.get(name, 1), (name, o)
        assert o["measured_ms"] > 0 and o["predicted_ms"] > 0, (name, o)
        if name != "EP":
            assert o["outputs_match"], (name, o)
    # One domain of 4, one expert of 2 migrated: half the experts gathered and returned, tokens for the
    # other half sent; at these sizes the model's inter-site bytes are fewer than migrating both.
    half, whole = p["options"]["S=4 m=1"], p["options"]["S=4"]
    assert half["inter_bytes_model"] < whole["inter_bytes_model"]
    if rank == 0:
        bench_hybrid.print_table(results)


def _bench_compressions(rank, world_size):
    """--compressions 0.25 1: compressed options beside dense ones; ratio 1 gives plain EP's numbers,
    0.25 is lossy (errors reported, not checked) and puts fewer bytes on the links, the model's."""
    bench_hybrid, results = _one_tiny_point("--compressions", "0.25", "1")
    (p, ) = results["points"]
    assert results["option_names"] == ["EP", "S=2", "S=2 c=0.25", "S=2 c=1", "S=4", "S=4 c=0.25", "S=4 c=1"], \
        results["option_names"]
    for name, o in p["options"].items():
        assert o["compression_ratio"] == {"c=0.25": 0.25, "c=1": 1.0}.get(name.split()[-1]), (name, o)
        assert o["measured_ms"] > 0 and o["predicted_ms"] > 0, (name, o)
        if name.endswith("c=0.25"):
            assert o["outputs_match"] is None and o["rel_err_out"] > 1e-4, (name, o)
        elif name != "EP":
            assert o["outputs_match"], (name, o)
    # One domain of 4: the gather's inter-site bytes are the model's, and compression sends fewer.
    for name in ("S=4", "S=4 c=0.25", "S=4 c=1"):
        o = p["options"][name]
        assert o["inter_bytes_measured"] == o["inter_bytes_model"], (name, o)
    assert p["options"]["S=4 c=0.25"]["inter_bytes_model"] < p["options"]["S=4"]["inter_bytes_model"]
    if rank == 0:
        bench_hybrid.print_table(results)


def test_bench_hybrid_times_compressed_migration_options():
    run_distributed(_bench_compressions, 4)


def _bench_hottest(rank, world_size):
    """--fractions 0.5 --hottest --skew 3: beside each partial option its hottest form, matching plain
    EP; with every rank's tokens skewed to the same experts, in one domain of 4 the hottest form moves
    fewer inter-site bytes than migrating each rank's first expert, and chooses differently."""
    bench_hybrid, results = _one_tiny_point("--fractions", "0.5", "--hottest", "--skew", "3", "--replan")
    (p, ) = results["points"]
    assert results["option_names"] == ["EP", "S=2", "S=2 m=1", "S=2 m=1 hot", "S=4", "S=4 m=1", "S=4 m=1 hot"], \
        results["option_names"]
    for name, o in p["options"].items():
        assert o["migration_choice"] == ("hottest" if name.endswith("hot") else "first"), (name, o)
        if name != "EP":
            assert o["outputs_match"], (name, o)
    first, hot = p["options"]["S=4 m=1"], p["options"]["S=4 m=1 hot"]
    assert first["chosen_experts"] == [[0]] * 4 and hot["chosen_experts"] != first["chosen_experts"], (first, hot)
    assert hot["inter_bytes_measured"] < first["inter_bytes_measured"], (first, hot)
    # The model fed with the checked run's routing and migrated experts: its inter-site bytes are the
    # paced ones exactly for every option, tokens included (the uniform routing's are not, here).
    for name, o in p["options"].items():
        assert o["inter_bytes_measured"] == o["inter_bytes_model"], (name, o)
    ep = p["options"]["EP"]
    assert abs(ep["predicted_uniform_ms"] / ep["predicted_ms"] - 1) > 0.01, ep
    load = np.asarray(p["load"])
    assert load.shape == (4, 8) and abs(load.sum() - 4 * 32 * 2) < 1e-9, load
    # The model's planner saw the same routing and picked a timed option.
    assert p["planner"]["model_choice"] in p["options"], p["planner"]
    # --replan: the layer planned again after its first step (the same plan on every rank, as the
    # bench's slowest() reductions need), and it matches plain EP.
    r = p["replanned"]
    assert r["domain_size"] in (1, 2, 4) and 0 <= r["migrated_experts"] <= 2 and r["ms"] > 0, r
    assert (r["domain_size"], r["migrated_experts"]) == (tuple(r["planned"]) if r["switched"] else tuple(r["start"]))
    assert r["switched"] == (r["planned"] != r["start"] and r["predicted_gain"] >= 0.05), r
    assert r["outputs_match"] and r["rel_err_out"] <= 1e-5, r
    # It planned with its experts' forward measured (the default), the compute before the router scaled
    # from its estimate by the same ratio.
    assert r["compute"] == "measure" and r["expert_compute_ms"] > 0 and r["pre_expert_compute_ms"] > 0, r
    if rank == 0:
        bench_hybrid.print_table(results)


def test_bench_hybrid_times_hottest_migration_under_skewed_routing():
    run_distributed(_bench_hottest, 4)


def test_bench_hybrid_times_partial_migration_options():
    run_distributed(_bench_fractions, 4)


def test_bench_hybrid_times_whole_steps_of_micro_batches():
    run_distributed(_bench_steps, 4)


def test_bench_hybrid_core_reports_every_option_and_matches_plain_ep(tmp_path, capsys):
    run_distributed(_bench_body, 4, str(tmp_path))
    with open(tmp_path / "bench_hybrid.json") as f:
        saved = json.load(f)
    assert len(saved["points"]) == 2 and saved["summary"]["outputs_match"]
    assert (tmp_path / "bench_hybrid.png").stat().st_size > 0


@pytest.mark.parametrize("flag, values", [("--fractions", ["1.0"]), ("--fractions", ["0"]),
                                          ("--replan", ["--microbatches", "2"]),
                                          ("--compressions", ["0"]), ("--compressions", ["1.5"]),
                                          ("--microbatches", ["0"]), ("--hottest", []), ("--skew", ["-1"])])
def test_bench_hybrid_refuses_out_of_range_options(flag, values, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_hybrid
    with pytest.raises(SystemExit) as exc:
        bench_hybrid.parse_args(["--device", "cpu", flag, *values])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
