"""ds_uniep.swiglu: silu(a) * b on the [R, 2F] output of SwiGLU's joint w1/w3 GEMM.

Against the same math in fp64 (forward and backward), within bf16 rounding; bitwise
repeatable. The Triton kernels run on a GPU, and on CPU through Triton's interpreter where
Triton is installed; elsewhere the torch ops are checked.
"""
import os
import subprocess
import sys

import pytest
import torch

from conftest import needs_gpus

_CHECK = r'''
import os, sys, torch
from ds_uniep import swiglu as S
dev = sys.argv[1]
force = len(sys.argv) > 2
big = 5 if os.environ.get("TRITON_INTERPRET") == "1" else 300  # the interpreter runs each program in Python
for R, F in ((1, 8), (19, 24), (big, 1032)):  # F past one 1024-wide block
    g = torch.Generator().manual_seed(R)
    # self-identifying: row r's values grow with r, so rows swapped or shifted land far off
    h = (torch.randn(R, 2 * F, generator=g) + 0.01 * torch.arange(R)[:, None]).to(dev, torch.bfloat16)
    gy = torch.randn(R, F, generator=g).to(dev, torch.bfloat16)
    outs = []
    for _ in range(2):
        hi = h.clone().requires_grad_(True)
        y = S._SwiGLU.apply(hi) if force else S.swiglu(hi)
        y.backward(gy)
        outs.append((y, hi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), "not repeatable"
    hr = h.double().requires_grad_(True)
    a, b = hr.chunk(2, dim=-1)
    yr = torch.nn.functional.silu(a) * b
    yr.backward(gy.double())
    for got, ref, what in ((outs[0][0], yr, "y"), (outs[0][1], hr.grad, "dh")):
        err = ((got.double() - ref).abs() / (ref.abs() + 1e-2)).max().item()
        assert err < 8e-3, f"R={R} F={F} {what}: relative error {err:.3e}"
    assert outs[0][1].shape == h.shape and outs[0][0].shape == (R, F)
print("ok", "kernels" if (force or S.uses_kernels(h)) else "torch ops")
'''


def _run(device, force, env=None):
    return subprocess.run([sys.executable, "-c", _CHECK, device] + (["force"] if force else []),
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_torch_ops_path_on_cpu():
    r = _run("cpu", False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch ops" in r.stdout


def test_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    r = _run("cpu", True, {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok kernels" in r.stdout


@needs_gpus(1)
def test_kernels_on_gpu():
    r = _run("cuda", False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok kernels" in r.stdout


def test_shape_is_checked():
    from ds_uniep.swiglu import swiglu
    with pytest.raises(ValueError, match=r"\[R, 2F\]"):
        swiglu(torch.zeros(3, 5))
