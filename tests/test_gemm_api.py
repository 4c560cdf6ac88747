"""ds_uniep.gemm's host side, on CPU: configuration names, input checks, the fp32 reference."""
import pytest
import torch

from ds_uniep import gemm


def test_parse_config():
    assert gemm.parse_config("coop128x256") == (0, 0, 1)
    assert gemm.parse_config("pingpong128x128:n4") == (2, 1, 4)
    assert gemm.parse_config("coop256x128:m8") == (1, 0, 8)
    for bad in ("coop128x256:x3", "coop128x256:n3", "huge", "coop128x256:"):
        with pytest.raises(ValueError, match="grouped GEMM config"):
            gemm.parse_config(bad)
    assert len(gemm.candidates()) == len(gemm.CONFIGS) * len(gemm.ORDERS)
    assert all(gemm.parse_config(c) for c in gemm.candidates())


def test_inputs_are_checked_before_any_kernel():
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16"):
        gemm.grouped_mm(x.float(), w, offs, "fwd")
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        gemm.grouped_mm(x, w, offs, "fwd")
    with pytest.raises(ValueError, match="op"):
        gemm.grouped_mm(x, w, offs, "sideways")
    with pytest.raises(ValueError, match="configs names unknown op"):
        gemm.grouped_linear(x, w, offs, {"forward": "coop128x256"})
    with pytest.raises(ValueError, match=r"w \[G, N, K\]"):
        gemm.grouped_linear(x, w[0], offs)
    segs = torch.tensor([[0, 8, 0, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="op must be 'fwd' or 'dgrad'"):  # no wgrad over runs of rows
        gemm.grouped_mm_segments(x, w, segs, "coop128x256", op="wgrad")
    ok, why = gemm.available("cpu")
    assert not ok and "not a CUDA device" in why


def test_reference_is_per_group():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    y = gemm.reference("fwd", a, b, offs)
    assert torch.equal(y[:2], a[:2] @ b[0].t()) and torch.equal(y[2:], a[2:] @ b[2].t())
    dy = torch.randn(7, 8, generator=g)
    assert torch.equal(gemm.reference("dgrad", dy, b, offs)[2:], dy[2:] @ b[2])
    dw = gemm.reference("wgrad", dy, a, offs)
    assert torch.equal(dw[1], torch.zeros(8, 16)) and torch.equal(dw[2], dy[2:].t() @ a[2:])


def test_fused_runs_align_to_the_tiles_the_scheduler_counts():
    """A run of the fused GEMM is cut at tile M x cluster 2 x band rows."""
    assert gemm.run_alignment("coop128x256") == 256 and gemm.run_alignment("pingpong128x128:n1") == 256
    assert gemm.run_alignment("coop256x128") == 512 and gemm.run_alignment("coop128x256:m4") == 1024
    with pytest.raises(ValueError, match="tile"):
        gemm.run_alignment("coop64x64")


def test_default_configs_are_built_ones_and_the_fused_gemm_takes_the_tiles_it_is_given(monkeypatch):
    assert set(gemm.DEFAULT_CONFIGS) == set(gemm.OPS)
    for op, config in gemm.DEFAULT_CONFIGS.items():
        assert config == "auto" or gemm.parse_config(config), op  # parse_config raises on unbuilt ones
    # The fused GEMM's default is a built band-1 configuration, and nothing is timed for it ...
    assert gemm.parse_config(gemm.FUSED_DEFAULT)[2] == 1
    monkeypatch.setattr(gemm, "_choose", lambda *a, **kw: pytest.fail("the fused GEMM's configuration was timed"))
    assert gemm.fused_config(None) == gemm.fused_config({}) == gemm.FUSED_DEFAULT
    # ... and a configuration named by the block's tiles is taken as it is.
    assert gemm.fused_config({"fwd": "pingpong128x128:n1"}) == "pingpong128x128:n1"
    assert gemm.fused_config(gemm.configs_for_tiles(256, 128)) == "coop256x128"


def test_grouped_linear_hands_its_dgrad_to_into(monkeypatch):
    """``grouped_linear(..., into=)``: the rows go in detached (no gradient reaches them, so the
    dispatch's own backward never runs), the backward calls ``into.start`` before the wgrad and
    ``into.finish`` after it, and what ``finish`` returns is the gradient of ``into.source``; the
    wgrad is the usual one. Without a gradient wanted for the source, ``into`` is not called.
    (The GEMMs are the CPU reference here; the kernels' part is tested on GPUs.)"""
    calls = []

    def fake_mm(a, b, offs, op, config=None, sm_count=0):
        calls.append(op)
        return gemm.reference(op, a, b, offs).to(a.dtype)
    monkeypatch.setattr(gemm, "grouped_mm", fake_mm)

    class Into:
        def __init__(self, source):
            self.source = source

        def start(self, grad, w, offs, configs):
            calls.append("start")
            self.dx = gemm.reference("dgrad", grad, w, offs)

        def finish(self):
            calls.append("finish")
            return self.dx[:self.source.shape[0]].to(self.source.dtype) * 2  # the sources' sums, here a stand-in

    g = torch.Generator().manual_seed(0)
    source = torch.randn(8, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    rows = (source.float() * 1).to(torch.bfloat16)  # stands for the dispatch's output: in source's graph
    w = torch.randn(2, 24, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    grad = torch.randn(8, 24, generator=g).to(torch.bfloat16)
    into = Into(source)
    y = gemm.grouped_linear(rows, w, offs, into=into)  # rows in source's graph: only into may reach it
    assert calls == ["fwd"]
    y.backward(grad)
    assert calls == ["fwd", "start", "wgrad", "finish"]
    torch.testing.assert_close(source.grad.float(), (gemm.reference("dgrad", grad, w, offs) * 2).to(
        torch.bfloat16).float())
    assert torch.equal(w.grad, gemm.reference("wgrad", grad, rows, offs).to(torch.bfloat16))
    # no gradient wanted for the source: the wgrad only
    calls.clear()
    frozen = source.detach()
    w.grad = None
    gemm.grouped_linear(rows.detach(), w, offs, into=Into(frozen)).backward(grad)
    assert calls == ["fwd", "wgrad"] and w.grad is not None
