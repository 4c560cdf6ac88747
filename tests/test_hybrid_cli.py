"""``python -m ds_uniep.hybrid`` and the site sweep behind ``simulate``."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from ds_uniep.hybrid.__main__ import build_parser, main
from ds_uniep.hybrid.model import GBPS
from ds_uniep.hybrid.presets import PRESETS, parse_shape
from ds_uniep.hybrid.simulate import default_site_counts, sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_prints_hybrid_choice(capsys):
    rc = main(["plan", "--model", "dsv2lite-like", "--gpus", "16", "--site-size", "8", "--domain-size", "auto",
               "--inter-bw", "10Gbps", "--intra-bw", "400GB/s", "--microbatches", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "plan: HybridEP; domain size 16, migrated fraction 1.00" in out
    assert "EP " in out and "HybridEP " in out
    speedup = float(out.split("speedup ")[1].split("x")[0])
    assert speedup > 2  # 192 MiB of tokens per rank against 66 MiB of experts per rank


def test_plan_with_returns_every_microbatch(capsys):
    argv = ["plan", "--model", "dsv2lite-like", "--gpus", "16", "--site-size", "8", "--domain-size", "16",
            "--inter-bw", "10Gbps", "--microbatches", "8"]
    kept = {}
    for extra in ([], ["--returns-every-microbatch"]):
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        assert ("replica gradients returned every micro-batch" in out) == bool(extra)
        kept[bool(extra)] = out.split("plan: ")[1].split(";")[0]
    # 10 Gbps between sites: migration pays when 8 micro-batches share one gather and one gradient
    # return (66 MiB each per rank), not when every micro-batch returns the gradients.
    assert kept == {False: "HybridEP", True: "plain EP kept"}, kept


def test_plan_keeps_ep_when_links_are_fast(capsys):
    rc = main(["plan", "--model", "mixtral-like", "--gpus", "8", "--site-size", "1", "--inter-bw", "inf",
               "--intra-bw", "inf"])
    out = capsys.readouterr().out
    assert rc == 0 and "plain EP kept; domain size 1" in out and "speedup 1.000x" in out


def test_plan_explicit_sizes_and_measured_times(capsys):
    rc = main(["plan", "--model", "hidden=1024,ffn=512,experts=16,topk=2,tokens=4096", "--gpus", "8",
               "--site-size", "2", "--domain-size", "4", "--inter-bw", "1Gbps", "--pre-expert-ms", "2",
               "--expert-ms", "3", "--compression-ratio", "0.25"])
    out = capsys.readouterr().out
    assert rc == 0 and "domain size 4" in out and "compression ratio 0.25" in out
    assert "pre-expert 2.000 ms, expert 3.000 ms" in out


def test_plan_for_a_measured_load(tmp_path, capsys):
    """--load: the same routing skewed on both ranks (each rank's experts 1 and 2 hot): the plan
    migrates the hottest half of the experts and prints them; a uniform load gives the uniform plan."""
    argv = ["plan", "--model", "hidden=2048,ffn=768,experts=8,topk=2,tokens=8192", "--gpus", "2", "--site-size",
            "1", "--inter-bw", "2GB/s", "--intra-bw", "100GB/s", "--pre-expert-ms", "4", "--expert-ms", "1"]
    row = [100, 4000, 4000, 100, 100, 4000, 4000, 100]
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"load": [row, row]}))
    assert main(argv + ["--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert "routing: measured load" in out and "migrated fraction 0.50" in out, out
    assert "migrated experts (local indices per rank): [[1, 2], [1, 2]]" in out, out
    path.write_text(json.dumps([[1] * 8] * 2))
    assert main(argv + ["--load", str(path)]) == 0
    routed = capsys.readouterr().out
    assert main(argv) == 0
    uniform = capsys.readouterr().out
    assert routed.split("plan: ")[1].split("\n")[0] == uniform.split("plan: ")[1].split("\n")[0]


@pytest.mark.parametrize("content, message", [("[1, 2]", "list of lists"), ('{"x": 1}', '"load" key'),
                                              ("not json", "cannot read"), ("[[1, 2]]", "load: expected")])
def test_plan_refuses_a_bad_load(tmp_path, capsys, content, message):
    path = tmp_path / "load.json"
    path.write_text(content)
    rc = main(["plan", "--model", "mixtral-like", "--gpus", "2", "--site-size", "1", "--inter-bw", "2GB/s",
               "--load", str(path)])
    assert rc == 2 and message in capsys.readouterr().err


def test_bad_unit_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "mixtral-like", "--gpus", "8", "--inter-bw", "10Gbs"])
    assert e.value.code == 2
    assert "unknown unit 'Gbs'" in capsys.readouterr().err


def test_bad_model_and_domain_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt5", "--gpus", "8", "--inter-bw", "10Gbps"])
    assert "not a preset" in capsys.readouterr().err
    rc = main(["plan", "--model", "mixtral-like", "--gpus", "8", "--site-size", "2", "--domain-size", "3",
               "--inter-bw", "10Gbps"])
    assert rc == 2 and "domain_size: 3 does not divide" in capsys.readouterr().err


def test_presets_match_benchmarks():
    m = PRESETS["mixtral-like"]
    assert (m.hidden, m.ffn, m.num_experts, m.top_k, m.tokens_per_rank) == (4096, 14336, 8, 2, 8192)
    assert m.token_bytes == 8192 * 2 * 4096 * 2 and m.expert_bytes == 3 * 4096 * 14336 * 2
    assert parse_shape("M=2048,F=1408,E=64,k=6,T=8192").token_bytes == PRESETS["dsv2lite-like"].token_bytes
    with pytest.raises(ValueError, match="missing"):
        parse_shape("hidden=1")


def test_thousand_site_sweep_is_fast_and_shows_the_trend():
    shape = PRESETS["dsv2lite-like"]
    wl = shape.workload(8, num_microbatches=8)
    sites = default_site_counts(1000)
    assert sites[-1] == 1000
    t0 = time.perf_counter()
    r = sweep(wl, 8, 4e11, num_sites=sites, num_experts=shape.num_experts, progress=False)
    assert time.perf_counter() - t0 < 5.0
    assert r.ep_s.shape == (41, len(sites)) and r.hybrid_s.shape == (41, len(sites), 3)
    assert (r.best_speedup >= 1 - 1e-12).all()
    i8 = int(np.searchsorted(r.num_sites, 8))
    k8 = 2  # 8 sites per domain
    # Gains grow as bandwidth falls (bandwidths ascend along axis 0).
    s = r.speedup[:, i8, k8]
    assert (np.diff(s) <= 1e-9).all() and s[0] > 2.5 and s[-1] < s[0]
    # With the domain size fixed, the speedup tends to 1 as sites are added.
    b10 = int(np.argmin(np.abs(r.inter_bandwidths_bytes_per_s - 10 * GBPS)))
    col = r.speedup[b10, :, k8]
    col = col[~np.isnan(col)]
    assert (np.diff(col) <= 1e-9).all() and col[0] > 2 and col[-1] < 1.01
    # Where a domain size does not divide the site count there is no number.
    assert np.isnan(r.hybrid_s[:, int(np.searchsorted(r.num_sites, 2)), k8]).all()


def test_simulate_writes_png(tmp_path, capsys):
    out = tmp_path / "sweep.png"
    js = tmp_path / "sweep.json"
    rc = main(["simulate", "--max-sites", "1000", "--model", "dsv2lite-like", "--microbatches", "8",
               "--out", str(out), "--json", str(js), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert js.stat().st_size > 0
    assert "up to 1000" in text and "speedup" in text
    assert json.loads(js.read_text())["num_sites"][-1] == 1000
    # the older spelling of the flag still sets the same number
    assert build_parser().parse_args(["simulate", "--max-domains", "24"]).max_sites == 24


def test_sweep_shows_progress_on_stderr(capsys):
    r = sweep(PRESETS["dsv2lite-like"].workload(8), 8, 4e11, num_sites=[2, 4, 8], progress=True)  # 0/41 shown
    assert r.ep_s.shape[1] == 3
    assert "bandwidths:" in capsys.readouterr().err  # a bar over the 41 bandwidths (cleared when done)


@pytest.mark.parametrize("argv,message", [
    (["plan", "--gpus", "16", "--inter-bw", "10Gbps", "--tflops", "0"], "--tflops: must be a positive number"),
    (["plan", "--gpus", "16", "--inter-bw", "10Gbps", "--microbatches", "0"], "--microbatches: must be a positive"),
    (["simulate", "--max-sites", "0"], "--max-sites/--max-domains: must be a positive integer"),
])
def test_cli_refuses_non_positive_numbers(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sweep_refuses_fractions_outside_zero_one():
    with pytest.raises(ValueError, match=r"fractions: every fraction must be in \[0, 1\]"):
        sweep(PRESETS["dsv2lite-like"].workload(8), 8, 4e11, num_sites=[2, 4], fractions=[0, 5.0], progress=False)


def test_module_entry_point():
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "ds_uniep.hybrid", "plan", "--model", "dsv3-like", "--gpus", "16",
                        "--inter-bw", "100Gbps", "--intra-bw", "400GB/s"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "speedup" in p.stdout
