"""Benchmark scripts parse their arguments without a GPU (their runs need GPUs and live outside tests)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["bench_moe_layer.py"])
def test_help(script):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout
