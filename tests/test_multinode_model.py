"""The multi-node cost model (benchmarks/multinode_model.py): its expectation formula against sampled
routing counted by ``TwoLevelDispatcher._count_bytes``, its bounds, and its command line (CPU)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "multinode_model.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import multinode_model as mm  # noqa: E402

KEYS = ("dispatch_rows", "routing", "combine_rows", "backward_rows", "two_level", "flat", "nvlink_two_level",
        "nvlink_flat")


# (M, E, k, T, N, P): nodes of 1, 2 and 4 ranks, k from 1 to E / 2
@pytest.mark.parametrize("cfg", [(16, 8, 2, 4000, 2, 2), (32, 16, 3, 2000, 4, 2), (8, 12, 4, 2000, 3, 2),
                                 (16, 32, 8, 1000, 2, 4), (16, 8, 1, 3000, 4, 1)])
@pytest.mark.parametrize("once", [True, False], ids=["megakernel", "reference"])
def test_formula_matches_sampled_routing(cfg, once):
    exp = mm.expected_bytes(*cfg, grad_tokens_once=once)
    got = mm.sampled_bytes(*cfg, seed=1, grad_tokens_once=once)
    assert set(KEYS) <= set(got)
    for key in KEYS:
        assert got[key] == pytest.approx(exp[key], rel=0.03), key


def test_probability_of_a_remote_node():
    assert mm.p_token_on_node(16, 1, 4) == pytest.approx(1 / 4)  # one expert: its node
    assert mm.p_token_on_node(16, 16, 4) == 1.0  # every expert: every node
    assert mm.p_token_on_node(16, 2, 2) == pytest.approx(1 - (8 * 7) / (16 * 15))


@pytest.mark.parametrize("N", [2, 3, 8])
@pytest.mark.parametrize("E,k", [(48, 1), (48, 6), (48, 24)])
def test_two_level_never_sends_more_rows_across_nodes(N, E, k):
    # The reference path: only the dispatch is deduplicated; combine and backward are 3 of flat's 4 row
    # movements.
    b = mm.expected_bytes(1024, E * N, k, 512, N, 2, grad_tokens_once=False)
    flat_rows = b["flat"] - (N - 1) * 2 * E * N * 8  # less the counts all-gather
    rows = b["dispatch_rows"] + b["combine_rows"] + b["backward_rows"]
    assert 0 < rows <= flat_rows * (1 + 1e-12)  # equal at k = 1
    assert b["combine_rows"] + b["backward_rows"] == pytest.approx(0.75 * flat_rows)
    if k == 1:  # nothing to deduplicate: the expert indices make two-level send a little more
        assert rows == pytest.approx(flat_rows) and b["flat"] < b["two_level"] < 1.01 * b["flat"]
    # The megakernel across nodes: the combine's gradient is deduplicated too (grad_out once per node,
    # 8 bytes of gate and gate gradient per remote (token, slot) beside it).
    m = mm.expected_bytes(1024, E * N, k, 512, N, 2)
    pairs = b["combine_rows"] / 2048
    assert m["backward_rows"] == pytest.approx(b["dispatch_rows"] + b["combine_rows"] + 8 * pairs)
    assert m["two_level"] <= b["two_level"] + 8 * pairs * (1 + 1e-12)  # less wherever a token has 2 slots there


@pytest.mark.parametrize("shape", list(mm.PRESETS))
@pytest.mark.parametrize("N,P", [(2, 4), (2, 8), (8, 8), (4, 2)])
def test_two_level_sends_less_at_the_benchmark_shapes(shape, N, P):
    s = mm.PRESETS[shape]
    E = max(s.num_experts, N * P)
    b = mm.expected_bytes(s.hidden, E, s.top_k, s.tokens_per_rank, N, P)
    assert 0 < b["two_level"] < b["flat"]


def test_one_node_sends_nothing_across():
    b = mm.expected_bytes(2048, 64, 6, 1024, 1, 8)
    assert b["two_level"] == 0 and b["flat"] == 0
    # One node: both schemes are the node's all-to-all (two-level's counts carry one more number).
    assert b["nvlink_two_level"] - b["nvlink_flat"] == 7 * 8 and b["nvlink_flat"] > 0
    s = mm.sampled_bytes(64, 16, 2, 200, 1, 4)
    assert s["two_level"] == 0 and s["flat"] == 0


def test_times_bracket_the_layer():
    b = mm.expected_bytes(2048, 64, 6, 8192, 2, 8)
    t = mm.layer_times(b, 6.5, 50.0, 350.0)
    for scheme in ("two_level", "flat"):
        x = t[scheme]
        assert x["network_ms"] == pytest.approx(b[scheme] / 50e9 * 1e3)
        assert max(6.5, x["network_ms"], x["nvlink_ms"]) == x["overlap_ms"] <= x["no_overlap_ms"]
        assert x["no_overlap_ms"] == pytest.approx(6.5 + x["network_ms"] + x["nvlink_ms"])


def test_uneven_experts_are_refused():
    with pytest.raises(ValueError, match="cannot be spread"):
        mm.expected_bytes(64, 8, 2, 16, 2, 8)


def test_cli_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, "--nodes", "1", "2", "--gpus-per-node", "4", "--network-gbps", "25",
                          "--compute-ms", "dsv3-like=20", "--check", "--check-tokens", "64", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| dsv3-like | 256 | 2 x 4 |" in out.stdout
    assert "mixtral-like at 2 x 4: 8 experts cannot be spread evenly over 8 ranks" not in out.stdout  # 8 divides 8
    assert "not a measurement" in out.stdout
    data = json.loads((tmp_path / "multinode_model.json").read_text())
    assert data["network_gbps"] == 25
    pts = {(p["shape"], p["nodes"]): p for p in data["points"]}
    assert set(pts) == {(s, n) for s in ("mixtral-like", "dsv2lite-like", "dsv3-like") for n in (1, 2)}
    assert pts[("dsv3-like", 2)]["compute_ms"] == 20
    assert pts[("dsv2lite-like", 1)]["bytes_per_gpu"]["two_level"] == 0
    assert all(p["check"]["max_rel_deviation"] < 0.2 for p in data["points"])
    assert (tmp_path / "multinode_model.png").stat().st_size > 1000


def test_cli_skips_shapes_with_too_few_experts(tmp_path):
    assert mm.main(["--shapes", "mixtral-like", "dsv3-like", "--nodes", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "multinode_model.json").read_text())
    assert [p["shape"] for p in data["points"]] == ["dsv3-like"]
    assert "mixtral-like at 2 x 8: 8 experts cannot be spread evenly over 16 ranks" in data["skipped"][0]
