"""Benchmark scripts parse their arguments without a GPU (their runs need GPUs and live outside tests)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["bench_moe_layer.py", "bench_host.py", "bench_dispatcher_settings.py",
                                    "bench_dispatch.py", "bench_hf_model.py"])
def test_help(script):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout


def test_interleaved_timing_takes_turns_and_reports_errors():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from timing import bench_interleaved
    calls = []

    def make(name):
        return (lambda v: calls.append((name, v)), lambda run: (run,))

    def broken():
        raise ValueError("no such kernel")

    res = bench_interleaved({"a": make("a"), "b": make("b"), "bad": (broken, None), "c": make("c")},
                            warmup=1, repeats=3, cuda=False)
    # Round r starts at variant r (rotated) and every live variant runs once per round.
    assert "".join(n for n, _ in calls) == "abc" + "bca" + "cab" + "cab"
    assert [v for n, v in calls if n == "a"] == [0, 1, 2, 3]
    assert len(res["a"]["all_ms"]) == 3 and res["a"]["median_ms"] >= 0
    assert res["bad"] == {"error": "ValueError: no such kernel"}


def test_bench_host_refuses_no_steps():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_host.py"), "--steps", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--steps and --rounds must be at least 1" in out.stderr, out.stderr


@pytest.mark.parametrize("setting, said", [("own_rows_whole=False", "expected NAME:attr=value"),
                                           ("x:no_such_knob=1", "is not attr=value"),
                                           ("x:combine_chunks=sixteen", "is not a Python literal"),
                                           ("default:combine_chunks=8", "expected NAME:attr=value")])
def test_bench_dispatcher_settings_refuses_bad_settings(setting, said):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_dispatcher_settings.py"),
                          "--setting", setting], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and said in out.stderr, out.stderr


def test_bench_dispatcher_settings_parses_literals():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_dispatcher_settings import parse_setting
    assert parse_setting("a:dedup=False,combine_chunks=16,combine_push_blocks=None") == (
        "a", {"dedup": False, "combine_chunks": 16, "combine_push_blocks": None})


def test_bench_dispatch_parses_combine_variants():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_dispatch import parse_variant
    assert parse_variant("16/0/0.5") == (16, None, 0.5, False, False)
    assert parse_variant("8/33/0/q") == (8, 33, None, True, False)  # the queue's default GPU fences
    assert parse_variant("8/0/0.5/q/s") == (8, None, 0.5, True, True)  # system fences per warp
    for bad in ("16/0", "16/0/0.5/x", "16/0/0.5/q/q", "a/0/0.5", "16/0/1.5", "16/0/0.5/s", "16/0/0.5/q/g",
                "16/0/0.5/q/s/s"):
        with pytest.raises(SystemExit, match="--combine-variants"):
            parse_variant(bad)


def test_autotune_fixed_plans_are_every_plan_of_the_space_by_label():
    """``bench_moe_layer.py --autotune`` times the config default and every plan of the megakernel's space,
    each under its own label (none hides another), the default as the layer runs it (copy kernels on
    every SM, 16 combine chunks pushed from one queue)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_moe_layer import fixed_plans

    from ds_uniep.tuning import GPUInfo, Shape, Space
    space = Space(Shape(T=4096, M=2048, F=1408, E=64, k=6, ep=4), GPUInfo.preset("h200"), backend="megakernel")
    plans = fixed_plans(space)
    (default_name, default), *rest = plans.items()
    assert len(rest) == len(space.enumerate()) and [p for _, p in rest] == space.enumerate()
    assert all(name == p.label() for name, p in rest)
    assert default_name.startswith("config default") and plans[default.label()] == default
    assert (default.schedule, default.num_comm_sms, default.combine_chunks, default.combine_queue) == (
        "sequential", 132, 16, True)
    assert any(p.combine_queue for _, p in rest) and len({p.combine_chunks for _, p in rest}) == 3


def test_autotune_fixed_plans_are_timed_in_the_order_the_search_ranked_them():
    """With ``--autotune-fixed-s`` the benchmark times the fixed plans until the time is spent, so they
    come in the search's order: the config default, then the plans it timed by their confirmed time or
    median (pruned ones by their probe), then those it did not time, in the space's order."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_moe_layer import fixed_plan_order, fixed_plans

    from ds_uniep.tuning import GPUInfo, Shape, Space
    from ds_uniep.tuning.tuner import PlanRecord
    space = Space(Shape(T=4096, M=2048, F=1408, E=64, k=6, ep=4), GPUInfo.preset("h200"), backend="megakernel")
    plans = fixed_plans(space)
    names = list(plans)
    a, b, c, d = (plans[n] for n in names[5:9])
    records = [PlanRecord(a, "measured", 0, median_ms=3.0), PlanRecord(b, "measured", 1, median_ms=1.0,
                                                                       confirmed_ms=4.0),
               PlanRecord(c, "pruned", 2, median_ms=2.0), PlanRecord(d, "skipped", 3, reason="budget")]
    order = fixed_plan_order(plans, records)
    assert sorted(order) == sorted(names) and order[0] == names[0]
    assert order[1:4] == [names[7], names[5], names[6]]  # 2.0 (pruned), 3.0, then 4.0 (confirmed, not 1.0)
    assert order[4:] == [n for n in names[1:] if n not in names[5:8]]
    assert fixed_plan_order(plans, []) == names  # from the cache: no records, the space's order


def test_autotune_summary_compares_the_tuned_plan_with_the_best_single_and_the_default(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_moe_layer import print_autotune, summarize_autotune

    def row(shape, tuned, fixed):
        return {"shape": shape, "tuned_label": "t", "from_cache": False, "tune_wall_s": 1.0,
                "modes": {"fwdbwd": {"tuned_ms": tuned, "fixed_ms": fixed}}}
    auto = {"budget_s": 5.0, "rows": [row("a", 2.0, {"config default (x)": 4.0, "x": 4.1, "y": 3.0}),
                                      row("b", 1.0, {"config default (x)": 1.0, "x": 1.1, "y": 2.0})]}
    # streamed timings too (--streamed-steps): there y is the best single fixed plan
    for r, tuned, fixed in ((auto["rows"][0], 3.0, {"config default (x)": 3.0, "x": 3.3, "y": 1.5}),
                            (auto["rows"][1], 2.0, {"config default (x)": 2.0, "x": 2.2, "y": 2.0})):
        r["modes"]["fwdbwd"].update(tuned_streamed_ms=tuned, fixed_streamed_ms=fixed)
    summarize_autotune(auto, ["fwdbwd"])
    a, b = (r["modes"]["fwdbwd"] for r in auto["rows"])
    # geometric means: default 2.0, x 2.12, y 2.45: the default is the best single fixed plan
    assert a["best_single_fixed"] == "config default (x)" and a["speedup_vs_best_single_fixed"] == 2.0
    assert (a["speedup_vs_config_default"], b["speedup_vs_config_default"]) == (2.0, 1.0)
    assert a["fastest_fixed_here"] == "y" and b["fastest_fixed_here"] == "config default (x)"
    assert a["best_single_fixed_streamed"] == "y" and a["speedup_streamed_vs_best_single_fixed"] == 0.5
    assert (a["speedup_streamed_vs_config_default"], b["speedup_streamed_vs_config_default"]) == (1.0, 1.0)
    assert set(auto["best_single_fixed"]) == {"fwdbwd", "fwdbwd_streamed"}
    print_autotune(auto)
    out = capsys.readouterr().out
    assert "vs default" in out and "2.000x" in out and "fwdbwd streamed" in out and "0.500x" in out
    # --autotune-fixed-s: a shape that timed only some plans; the best single one is among those timed everywhere
    part = {"budget_s": 5.0, "rows": [row("a", 2.0, {"config default (x)": 4.0, "x": 4.1, "y": 1.0}),
                                      dict(row("b", 1.0, {"config default (x)": 1.0, "x": 1.1}), fixed_not_timed=["y"])]}
    summarize_autotune(part, ["fwdbwd"])
    assert part["rows"][0]["modes"]["fwdbwd"]["best_single_fixed"] == "config default (x)"
    assert part["rows"][0]["modes"]["fwdbwd"]["fastest_fixed_here"] == "y"
    print_autotune(part)
    out = capsys.readouterr().out
    assert "config default (x) 1.00 (of 2 timed)" in out and out.count("timed)") == 1


def test_bench_hf_model_runs_both_engines_on_cpu(tmp_path):
    """``bench_hf_model.py --cpu`` on 2 gloo ranks: a tiny Qwen3-MoE trains a step on AutoEP and on ds_uniep
    (times on a CPU mean nothing; the GPU run is in docs/performance.md's commands)."""
    import json

    from dist_utils import run_launcher
    out = tmp_path / "hf.json"
    run = run_launcher(lambda port: [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        os.path.join(ROOT, "benchmarks", "bench_hf_model.py"), "--cpu", "--families", "qwen3_moe", "--hidden", "32",
        "--layers", "1", "--heads", "4", "--experts", "4", "--topk", "2", "--expert-ffn", "32", "--seq", "16",
        "--micro-batch", "2", "--steps", "1", "--rounds", "1", "--warmup", "1", "--out", str(out)],
        timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["family"] == "qwen3_moe" and row["autoep_ms"] > 0 and row["ds_uniep_ms"] > 0, row
    assert "qwen3_moe |" in run.stdout


def test_breakdown_draws_each_profiled_shape_and_mode(tmp_path):
    """``--breakdown`` profiles 5 steps unless told otherwise; a PNG per (shape, mode) that has a
    profiled layer, none for the others."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_moe_layer
    from bench_tables import plot_breakdown
    assert bench_moe_layer.parse_args(["--breakdown"]).profile_steps == 5
    assert bench_moe_layer.parse_args(["--breakdown", "--profile-steps", "2"]).profile_steps == 2
    assert bench_moe_layer.parse_args([]).profile_steps == 0

    def profile(gemm, idle):
        return {"window_ms": gemm + 1.0 + idle, "busy_ms": gemm + 1.0, "idle_ms": idle, "concurrent_ms": 0.0,
                "categories": {"grouped GEMMs (CUTLASS)": gemm, "combine": 1.0}}

    rows = [{"shape": "s", "mode": "fwdbwd", "practical_bound_ms": 2.0, "physical_bound_ms": 1.5,
             "stock_ms": 9.0, "stock_profile": profile(5.0, 2.0), "megakernel_profile": profile(2.5, 0.2)},
            {"shape": "s", "mode": "fwd", "stock_ms": 3.0}]
    written = plot_breakdown({"ep": 2, "rows": rows}, str(tmp_path))
    assert written == [str(tmp_path / "breakdown_s_fwdbwd.png")]
    with open(written[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_node_size_rows_report_their_bytes_across_nodes(capsys):
    """``--node-size``: a layer whose dispatcher crossed nodes reports that step's bytes beside a flat
    all-to-all's, and the table prints them; a layer on one node reports none."""
    import types
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_moe_layer
    from bench_tables import print_table
    assert bench_moe_layer.parse_args(["--node-size", "2"]).node_size == 2
    crossed = types.SimpleNamespace(cross_node_bytes={"two_level": 3 << 20, "flat": 4 << 20, "combine_rows": 1})
    two = types.SimpleNamespace(_dispatchers={"cuda:0": crossed})
    one = types.SimpleNamespace(_dispatchers={"cuda:0": types.SimpleNamespace()})
    assert bench_moe_layer.cross_node_bytes(two) == {"two_level": 3 << 20, "flat": 4 << 20}
    assert bench_moe_layer.cross_node_bytes(one) is None
    row = {"shape": "s", "mode": "fwdbwd", "T": 8, "M": 16, "F": 32, "E": 4, "k": 2, "megakernel_ms": 1.0,
           "practical_bound_ms": 0.5, "physical_bound_ms": 0.4, "megakernel_cross_node_bytes": {
               "two_level": 3 << 20, "flat": 4 << 20}}
    print_table({"ep": 4, "peer_copy_GBps": 1.0, "dense_bf16_TFLOPs": 1.0, "megakernel": [True, ""], "rows": [row]})
    out = capsys.readouterr().out
    assert "bytes across nodes, megakernel, s fwdbwd" in out
    assert "two-level 3.0 MiB, a flat all-to-all 4.0 MiB (0.750x)" in out
