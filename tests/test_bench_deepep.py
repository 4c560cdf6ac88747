"""The benchmark's ``deepep`` row (benchmarks/deepep_layer.py): DeepEP's dispatch and combine around torch's
grouped GEMM compute the stock DeepSpeed MoE layer's function, forward and backward, on 2 GPUs over
NCCL (bf16 tolerance: its rows are weighted and summed in another order). Skipped without 2 GPUs or
without DeepEP built (benchmarks/README.md)."""
import importlib.util
import os
import sys

import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, F, E, K, T = 256, 512, 8, 2, 300


def _body(rank, world_size):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from deepep_layer import DeepEPLayer
    from deepspeed.moe.layer import MoE

    from ds_uniep import SwiGLUExpert
    device = rank_gpu(rank)
    torch.manual_seed(0)
    proto = MoE(M, SwiGLUExpert(M, F), num_experts=E, ep_size=world_size, k=K, min_capacity=0, drop_tokens=False,
                use_rts=False, top2_2nd_expert_sampling=False)
    g = torch.Generator().manual_seed(1 + rank)
    with torch.no_grad():
        for p in proto.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
    stock = proto.to(device=device, dtype=torch.bfloat16)
    stock.deepspeed_moe.gate.wg.float()
    stock.set_deepspeed_parallelism()
    deepep = DeepEPLayer(proto, device, torch.bfloat16)
    x = torch.randn(T + 17 * rank, M, device=device, generator=torch.Generator(device=device).manual_seed(rank))
    x = x.to(torch.bfloat16)
    gy = torch.randn_like(x)
    outs = []
    for layer in (stock, deepep):
        xx = x.clone().requires_grad_(True)
        out, l_aux, counts = layer(xx)
        out.backward(gy)
        outs.append((out.float(), xx.grad.float(), l_aux, counts))
    (want, want_gx, want_aux, want_counts), (got, got_gx, got_aux, got_counts) = outs
    assert torch.equal(got_counts.cpu(), want_counts.cpu()) and torch.equal(got_aux, want_aux)  # the same gate
    for name, a, b in (("output", got, want), ("input gradient", got_gx, want_gx)):
        err = (a - b).norm() / b.norm()
        assert err < 2e-2, f"rank {rank}: deepep {name} off the stock layer's by {err:.3g} (relative)"


@needs_gpus(2)
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                    reason="DeepEP is not built here (benchmarks/README.md says how)")
def test_deepep_row_is_the_stock_layer():
    run_distributed(_body, 2, backend="nccl")
