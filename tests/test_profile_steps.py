"""benchmarks/profile_steps.py: kernel names sorted into kinds, and busy / idle / concurrent time from
device intervals (the profiler run itself needs a GPU and lives in bench_moe_layer.py --profile-steps)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from profile_steps import _trace_events, classify_kernel, profile_steps, short_name, summarize_events  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "NCCL"),
    ("void cutlass::device_kernel<ds_uniep::GroupedGemm<cutlass::gemm::kernel::GemmUniversal<int> > >(int)",
     "grouped GEMMs (CUTLASS)"),
    ("void prepare_groups<K>(GroupedGemmArgs, ArgArrays<K>)", "grouped GEMMs (CUTLASS)"),
    ("nvjet_sst_64x8_64x16_4x1_v_bz_TNT", "dense GEMMs (cuBLAS)"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "dense GEMMs (cuBLAS)"),
    ("void dispatch_kernel<__nv_bfloat16>(SymView, int)", "dispatch + layout"),
    ("void layout_counts_kernel(int const*, int)", "dispatch + layout"),
    ("void combine_chunked_kernel<__nv_bfloat16, true, 8>(SymView)", "combine"),
    ("void gate_grad_kernel<float>(float const*)", "gate kernels"),
    ("swiglu_fwd", "SwiGLU"),
    ("void wait_words_kernel(unsigned int const*)", "signals + waits"),
    ("void cub::DeviceRadixSortOnesweepKernel<int>(int)", "sort + scan"),
    ("Memcpy DtoD (Device -> Device)", "copies + memsets"),
    ("Memset (Device)", "copies + memsets"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)", "other"),
])
def test_kernels_are_sorted_into_kinds_by_name(name, kind):
    assert classify_kernel(name) == kind


def test_short_names_drop_void_and_arguments():
    assert short_name("void combine_chunked_kernel<float>(SymView, int)") == "combine_chunked_kernel<float>"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    assert short_name("x" * 300, width=20) == "x" * 17 + "..."


def test_busy_idle_and_concurrent_time_per_step():
    # Two steps (us): a GEMM 0-100 with a combine 80-130 beside it (30 us at once), idle 130-200, then a
    # dispatch 200-240 and a GEMM 240-400; window 400 us, busy 130 + 200 = 330, durations 100+50+40+160 = 350.
    events = [("void cutlass::device_kernel<GemmUniversal>(x)", 0, 100), ("combine_reduce_kernel", 80, 50),
              ("dispatch_kernel", 200, 40), ("void cutlass::device_kernel<GemmUniversal>(x)", 240, 160)]
    s = summarize_events(events, steps=2)
    assert s["window_ms"] == pytest.approx(0.2)
    assert s["busy_ms"] == pytest.approx(0.165)
    assert s["idle_ms"] == pytest.approx(0.035)
    assert s["concurrent_ms"] == pytest.approx(0.010)
    assert s["categories"] == pytest.approx({"grouped GEMMs (CUTLASS)": 0.13, "combine": 0.025,
                                             "dispatch + layout": 0.02})
    assert list(s["categories"]) == ["grouped GEMMs (CUTLASS)", "combine", "dispatch + layout"]  # most first
    top = s["top_kernels"][0]
    assert top["name"] == "cutlass::device_kernel<GemmUniversal>" and top["calls"] == 1.0
    assert top["ms"] == pytest.approx(0.13)


def test_idle_time_is_told_by_the_kernels_around_it():
    # 2 steps (us): a layout kernel 0-10, idle 10-60 (the host reads the counts), a dispatch 60-100 with
    # a GEMM 70-200 beside it (the GEMM ends last), idle 200-220, then the layout 220-230 again, idle
    # 230-250, and the dispatch 250-260.
    events = [("layout_kernel", 0, 10), ("dispatch_kernel", 60, 40), ("cutlass::device_kernel<Gemm>", 70, 130),
              ("layout_kernel", 220, 10), ("dispatch_kernel", 250, 10)]
    s = summarize_events(events, steps=2)
    assert s["idle_ms"] == pytest.approx((50 + 20 + 20) / 2e3)
    gaps = {(g["after"], g["before"]): g for g in s["top_gaps"]}
    assert set(gaps) == {("layout_kernel", "dispatch_kernel"), ("cutlass::device_kernel<Gemm>", "layout_kernel")}
    first = s["top_gaps"][0]  # most idle first, per step
    assert (first["after"], first["before"]) == ("layout_kernel", "dispatch_kernel")
    assert first["ms"] == pytest.approx(70 / 2e3) and first["count"] == 1.0 and first["longest_us"] == 50.0
    assert gaps["cutlass::device_kernel<Gemm>", "layout_kernel"]["ms"] == pytest.approx(20 / 2e3)
    assert sum(g["ms"] for g in s["top_gaps"]) == pytest.approx(s["idle_ms"])


def test_nested_and_touching_intervals_count_once():
    s = summarize_events([("a", 0, 100), ("b", 10, 20), ("c", 100, 50)], steps=1)
    assert s["busy_ms"] == pytest.approx(0.15) and s["idle_ms"] == pytest.approx(0.0)
    assert s["concurrent_ms"] == pytest.approx(0.02)


def test_empty_traces_and_bad_steps_are_refused():
    with pytest.raises(ValueError, match="no device event"):
        summarize_events([], steps=1)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        summarize_events([("a", 0, 1)], steps=0)


def test_the_chrome_trace_gives_kernels_copies_and_memsets_only(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "dispatch_kernel", "ts": 10.0, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 20.0, "dur": 2.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 30.0, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 3.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5.0}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert _trace_events(str(path)) == [("dispatch_kernel", 10.0, 5.0), ("Memcpy DtoD (Device -> Device)", 20.0, 2.0),
                                        ("Memset (Device)", 30.0, 1.0)]


def test_profiling_without_a_gpu_says_so(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    ran = []
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        profile_steps(ran.append, steps=1)
    assert not ran


def test_bench_prints_each_profiled_layer_with_the_spread_over_ranks(capsys):
    from bench_moe_layer import print_profiles
    mine = summarize_events([("void cutlass::device_kernel<GemmUniversal>(x)", 0, 300),
                             ("combine_chunked_kernel", 300, 100)], steps=1)
    other = dict(mine, busy_ms=0.5, categories={"grouped GEMMs (CUTLASS)": 0.3, "combine": 0.2})
    rows = [{"shape": "dsv3-like", "mode": "fwdbwd", "megakernel_profile": dict(mine, ranks=[mine, other])},
            {"shape": "dsv3-like", "mode": "fwd", "megakernel_ms": 1.0}]
    print_profiles({"rows": rows})
    out = capsys.readouterr().out
    assert "dsv3-like fwdbwd megakernel: 0.40 ms from the first kernel to the last, busy 0.40, idle 0.00" in out
    assert "grouped GEMMs (CUTLASS) 0.30, combine 0.10" in out
    assert "over the ranks (min-max): busy 0.40-0.50, grouped GEMMs (CUTLASS) 0.30-0.30, combine 0.10-0.20" in out
    assert "dsv3-like fwd megakernel" not in out  # not profiled
    assert "idle" not in out.split("over the ranks")[1]  # no gap: no idle line
    gapped = summarize_events([("layout_kernel", 0, 10), ("dispatch_kernel", 60, 40)], steps=1)
    print_profiles({"rows": [{"shape": "dsv2lite-like", "mode": "fwd", "megakernel_profile": gapped}]})
    out = capsys.readouterr().out
    assert "idle 0.05 (1 per step, longest 50 us) after layout_kernel | before dispatch_kernel" in out
    assert "most idle" not in out  # one rank
    # the rank that idles most has its gaps told too
    idler = summarize_events([("layout_kernel", 0, 10), ("dispatch_kernel", 90, 10)], steps=1)
    print_profiles({"rows": [{"shape": "dsv2lite-like", "mode": "fwd",
                              "megakernel_profile": dict(gapped, ranks=[gapped, idler])}]})
    out = capsys.readouterr().out
    assert "  rank 1, the most idle: idle 0.08 (1 per step, longest 80 us) after layout_kernel" in out
