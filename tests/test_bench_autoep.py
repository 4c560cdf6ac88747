"""The benchmark's AutoEP row (``build_autoep`` in benchmarks/bench_moe_layer.py) on 2 gloo ranks.

DeepSpeed's ``AutoEPMoELayer``, built from a stock DeepSpeed MoE's gate and SwiGLU experts, routes as a plain
softmax/top-k/renormalise computation over the same fp32 logits, and its output and gradients (input and this
rank's experts) equal a pure-torch MoE with every global expert's own weights, and the stock layer's output.
Inputs identify themselves (column 0 is the source rank, column 1 the token), and every global expert has its
own weights, so a row sent to the wrong expert or returned to the wrong token gives a wrong answer.
"""
import os
import sys

import pytest
import torch

from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, F, T, K, L = 16, 24, 24, 2, 2  # hidden, ffn, tokens per rank, top-k, local experts


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_moe_layer
    return bench_moe_layer


def _expert_weights(e):
    """Global expert ``e``'s (w1, w3, w2), fp32, the same on every rank."""
    g = torch.Generator().manual_seed(5000 + e)
    return (torch.randn(F, M, generator=g) * M**-0.5, torch.randn(F, M, generator=g) * M**-0.5,
            torch.randn(M, F, generator=g) * F**-0.5)


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, M, generator=g)
    x[:, 0] = rank + 1
    x[:, 1] = torch.arange(T) / T
    return x, torch.randn(T, M, generator=g)


def _reference(x, wg, weights):
    """Pure torch: fp32 logits, softmax, top-k, weights renormalised over the k, SwiGLU experts."""
    probs = torch.softmax(x.float() @ wg.t(), dim=-1)
    top, idx = probs.topk(K, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e, (w1, w3, w2) in enumerate(weights):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        y = (torch.nn.functional.silu(x[tok] @ w1.t()) * (x[tok] @ w3.t())) @ w2.t()
        out = out.index_add(0, tok, y * top[tok, slot, None])
    return out, top, idx


def _close(got, want, dtype, msg):
    """fp32: elementwise; bf16: the error's norm against the value's (AutoEP rounds rows, expert outputs and
    gradients to bf16 where the reference keeps fp32; a misrouted row is off by its whole size)."""
    got = got.detach().float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=msg)
    else:
        err = float((got - want).norm() / want.norm())
        assert err < 2e-2, f"{msg}: relative error {err:.3g}"


def _autoep_matches(rank, world_size, dtype_name, use_grouped_mm):
    from deepspeed.moe.layer import MoE

    from ds_uniep import SwiGLUExpert
    bench = _bench()
    dtype = getattr(torch, dtype_name)
    E = L * world_size
    torch.manual_seed(1234)  # the same gate on every rank
    stock = MoE(M, SwiGLUExpert(M, F), num_experts=E, ep_size=world_size, k=K, min_capacity=0, drop_tokens=False,
                use_rts=False, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        for j, expert in enumerate(stock.deepspeed_moe.experts.deepspeed_experts):
            for lin, w in zip((expert.w1, expert.w3, expert.w2), _expert_weights(rank * L + j)):
                lin.weight.copy_(w)
    stock.set_deepspeed_parallelism()
    row = bench.build_autoep(stock, world_size, torch.device("cpu"), dtype, use_grouped_mm=use_grouped_mm)
    layer = row.autoep
    where = f"rank {rank} {dtype_name} grouped_mm={use_grouped_mm}"

    # The weights went where they should: the fp32 gate, this rank's experts, in the benchmark's dtype.
    wg = stock.deepspeed_moe.gate.wg.weight.detach()
    assert layer.router.gate.weight.dtype == torch.float32 and torch.equal(layer.router.gate.weight, wg), where
    assert layer.ep_rank == rank and layer.num_local_experts == L, where
    for j in range(L):
        w1, w3, w2 = _expert_weights(rank * L + j)
        for got, want in ((layer.experts.w1[j], w1), (layer.experts.w3[j], w3), (layer.experts.w2[j], w2)):
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)), where

    weights = [[w.to(dtype).float().requires_grad_(True) for w in _expert_weights(e)] for e in range(E)]
    x, g = _inputs(rank)
    x = x.to(dtype)
    g = g.to(dtype)

    # Routing: the same experts and weights as a plain softmax/top-k/renormalise over fp32 logits.
    with torch.no_grad():
        scores, chosen, _ = layer.router(x)
        _, top, idx = _reference(x.float(), wg, weights)
    order, ref_order = chosen.sort(-1), idx.sort(-1)
    assert torch.equal(order.values, ref_order.values), where
    torch.testing.assert_close(scores.gather(1, order.indices), top.gather(1, ref_order.indices), rtol=1e-6,
                               atol=1e-6, msg=where)

    # Forward and backward through AutoEP's all-to-alls.
    xa = x.clone().requires_grad_(True)
    out, l_aux, _ = row(xa)
    assert l_aux is None and out.shape == (T, M) and out.dtype == dtype, where
    out.backward(g)

    # The reference sees every rank's tokens (each rank rebuilds the others' inputs), so this rank's expert
    # gradients include what the other rank's tokens sent here.
    loss = 0
    for r in range(world_size):
        xr, gr = _inputs(r)
        xr = xr.to(dtype).float().requires_grad_(r == rank)
        yr, _, _ = _reference(xr, wg, weights)
        loss = loss + (yr * gr.to(dtype).float()).sum()
        if r == rank:
            x_ref, y_ref = xr, yr
    loss.backward()
    _close(out, y_ref.detach(), dtype, f"{where} output")
    _close(xa.grad, x_ref.grad, dtype, f"{where} input grad")
    for j in range(L):
        w1, w3, w2 = weights[rank * L + j]
        for name, got, want in (("w1", layer.experts.w1.grad[j], w1.grad), ("w3", layer.experts.w3.grad[j], w3.grad),
                                ("w2", layer.experts.w2.grad[j], w2.grad)):
            _close(got, want, dtype, f"{where} expert {rank * L + j} {name} grad")
    assert out.abs().sum() > 0 and xa.grad.abs().sum() > 0, where
    # Tokens really crossed ranks: some of this rank's went to the other rank's experts, and came back.
    assert ((idx // L) != rank).any(), where

    if dtype == torch.float32:  # and the stock DeepSpeed layer (dropless) computes the same
        with torch.no_grad():
            stock_out, _, _ = stock(x)
        torch.testing.assert_close(out.detach(), stock_out, rtol=1e-5, atol=1e-5, msg=where)


def _deepspeed_accelerator() -> str:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name()


@pytest.mark.skipif(_deepspeed_accelerator() != "cpu",
                    reason="checks AutoEP on CPU tensors over gloo; with a CUDA accelerator DeepSpeed's AutoEP picks its "
                    "Triton kernels, which cannot read CPU tensors (bench_moe_layer.py runs it on the GPUs)")
@pytest.mark.parametrize("dtype_name,use_grouped_mm", [("float32", True), ("float32", False), ("bfloat16", True)])
def test_autoep_row_matches_pure_torch_moe(dtype_name, use_grouped_mm):
    run_distributed(_autoep_matches, 2, dtype_name, use_grouped_mm)


def _unbuildable_row_says_why(rank, world_size):
    from ds_uniep.hybrid.presets import MoEShape
    bench = _bench()
    why_not = {}
    shape = MoEShape("tiny", hidden=M, ffn=F, num_experts=2 * world_size, top_k=K, tokens_per_rank=T)
    # No CUDA here: the benchmark's AutoEP layer cannot be built, and build_layers must say so.
    layers = bench.build_layers(shape, 2 * world_size, world_size, ["autoep"], (False, "no GPU"), why_not)
    assert layers == {} and why_not["autoep"], why_not


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report when the layer cannot be built (no CUDA)")
def test_autoep_row_that_cannot_be_built_says_why():
    # A hang (a rank waiting on a peer that is gone) fails within the limit, with each live rank's stack.
    run_distributed(_unbuildable_row_says_why, 2, timeout=300)


def test_table_prints_autoep_and_why_not(capsys):
    bench = _bench()
    base = {"shape": "s", "T": 1, "M": 1, "F": 1, "E": 2, "k": 1, "stock_ms": 2.0, "reference_ms": 1.0,
            "gemm_alone_ms": 0.5, "practical_bound_ms": 0.5, "physical_bound_ms": 0.25}
    results = {"ep": 2, "peer_copy_GBps": 100.0, "dense_bf16_TFLOPs": 500.0, "megakernel": [False, "no"],
               "autoep_note": bench.AUTOEP_NOTE,
               "rows": [dict(base, mode="fwd", autoep_ms=3.0),
                        dict(base, mode="fwdbwd", autoep_why_not="RuntimeError while running: boom")]}
    bench.print_table(results)
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("shape |"))
    assert "autoep" in head and "vs fastest peer" in head and "| 3.00 |" in out and "3.00x" in out
    assert "n/a*" in out and "* autoep could not run (s fwdbwd): RuntimeError while running: boom" in out
    assert "autoep: AutoEPMoELayer" in out


def test_autoep_is_a_default_backend():
    args = _bench().parse_args([])
    assert "autoep" in args.backends


def test_table_prints_streamed_times_and_their_ratios(capsys):
    bench = _bench()
    base = {"shape": "s", "T": 1, "M": 1, "F": 1, "E": 2, "k": 1, "mode": "fwdbwd", "stock_ms": 2.0,
            "reference_ms": 1.0, "stock_streamed_ms": 6.0, "reference_streamed_ms": 1.5, "autoep_ms": 3.0,
            "autoep_streamed_ms": 2.25, "gemm_alone_ms": 0.5, "practical_bound_ms": 0.5, "physical_bound_ms": 0.25}
    results = {"ep": 2, "peer_copy_GBps": 100.0, "dense_bf16_TFLOPs": 500.0, "megakernel": [False, "no"],
               "streamed": {"steps": 8, "rounds": 3}, "rows": [base]}
    bench.print_table(results)
    out = capsys.readouterr().out
    launched, streamed = out.split("streamed: ms per step of 8 back-to-back steps")
    # vs stock (stock / best), vs the fastest peer (autoep / best), best / practical
    assert "| 2.00 | 3.00 | 1.00 |" in launched and "| 2.00x | 3.00x | 2.00" in launched
    assert "| 6.00 | 2.25 | 1.50 |" in streamed and "| 4.00x | 1.50x | 3.00" in streamed


class _CountingLayer(torch.nn.Module):
    """A layer for the timing loops: counts its forwards, backwards and zero_grads."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.calls = {"forward": 0, "backward": 0, "zero_grad": 0}

    def forward(self, x):
        self.calls["forward"] += 1
        out = x * self.w
        if out.requires_grad:
            out.register_hook(lambda g: self.calls.__setitem__("backward", self.calls["backward"] + 1))
        return out, None, None

    def zero_grad(self, set_to_none=True):
        self.calls["zero_grad"] += 1
        super().zero_grad(set_to_none=set_to_none)


class _OneRank:
    def barrier(self):
        pass

    def all_reduce(self, t, op=None):
        pass

    class ReduceOp:
        MAX = None


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_streamed_timing_runs_every_step_back_to_back(mode):
    bench = _bench()
    layer = _CountingLayer()
    seen = []

    def inputs(run):
        seen.append(run)
        return torch.full((4,), float(run)), torch.ones(4)

    args = bench.parse_args(["--streamed-steps", "5", "--streamed-rounds", "3", "--warmup", "2"])
    ms = bench.time_layer_streamed(layer, inputs, mode, args, _OneRank())
    assert ms > 0
    steps = 2 + 3 * 5
    assert layer.calls["forward"] == layer.calls["zero_grad"] == steps
    assert layer.calls["backward"] == (steps if mode == "fwdbwd" else 0)
    assert seen == [0, 1] + [0, 1, 2, 3, 4] * 3  # a fresh input in every step of a burst
    assert (layer.w.grad is not None) == (mode == "fwdbwd")  # the last step's gradient, only with a backward


def test_streamed_timing_is_off_by_default():
    assert _bench().parse_args([]).streamed_steps == 0


def test_table_compares_with_the_fastest_peer(capsys):
    """Peers (AutoEP on NCCL or DeepEP, DeepEP + grouped GEMM) get a column each where timed; the ratio is
    the fastest peer's time over the best ds_uniep layer's; a peer that could not be built says why."""
    bench = _bench()
    row = {"shape": "s", "T": 1, "M": 1, "F": 1, "E": 2, "k": 1, "mode": "fwd", "stock_ms": 4.0, "autoep_ms": 3.0,
           "deepep_ms": 1.5, "megakernel_ms": 1.0, "autoep-deepep_why_not": "ImportError: no ElasticBuffer",
           "gemm_alone_ms": 0.5, "practical_bound_ms": 0.5, "physical_bound_ms": 0.25}
    bench.print_table({"ep": 2, "peer_copy_GBps": 100.0, "dense_bf16_TFLOPs": 500.0, "megakernel": [True, ""],
                       "rows": [row]})
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("shape |"))
    assert head.startswith("shape | mode | stock | autoep | autoep deepep | deepep | megakernel |"), head
    assert "| 4.00 | 3.00 | n/a* | 1.50 | 1.00 |" in out and "| 4.00x | 1.50x | 2.00" in out
    assert "* autoep-deepep could not run (s fwd): ImportError: no ElasticBuffer" in out
