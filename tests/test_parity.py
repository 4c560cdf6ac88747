"""Parity with stock DeepSpeed MoE over gloo: same weights, same inputs, same everything.

use_rts=False and no 2nd-expert sampling make the gate deterministic, so output,
l_aux, exp_counts and every gradient must match (fp32, tolerance for GEMM row
blocking: the stock layer runs experts over capacity-padded buffers). The
random gate options (RTS, noisy gates, 2nd-expert sampling) draw from torch's
global generator, so reseeding it before each layer's forward makes them
comparable too.
"""
import itertools

import pytest
import torch

from dist_utils import run_distributed

CASES = [dict(k=k, drop_tokens=d, use_residual=r)
         for k, d, r in itertools.product((1, 2, 4), (True, False), (False, True))]
# DeepSpeed's other gate options, 2-D input, Megatron-style (out, bias) experts, used_token.
CASES += [
    dict(k=1, drop_tokens=True, use_rts=True, noisy_gate_policy="RSample", two_d=True),
    dict(k=1, drop_tokens=True, used_token=True, bias_tuple=True),
    dict(k=2, drop_tokens=True, noisy_gate_policy="Jitter", top2_2nd_expert_sampling=True),
    dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=True, bias_tuple=True, two_d=True),
]


def _parity(rank, world_size):
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
    from moe_models import MLP, BiasTupleMLP, distinct_experts, twin_of

    M, F, T = 16, 32, 24
    E = 2 * world_size
    for case in CASES:
        torch.manual_seed(1234)  # same non-expert weights on every rank
        expert = (BiasTupleMLP if case.get("bias_tuple") else MLP)(M, F)
        stock = MoE(M, expert, num_experts=E, ep_size=world_size, k=case["k"], capacity_factor=1.0,
                    min_capacity=4, use_residual=case.get("use_residual", False), drop_tokens=case["drop_tokens"],
                    use_rts=case.get("use_rts", False), noisy_gate_policy=case.get("noisy_gate_policy"),
                    top2_2nd_expert_sampling=case.get("top2_2nd_expert_sampling", False))
        distinct_experts(stock, rank)
        uni = twin_of(stock)
        stock.set_deepspeed_parallelism()
        uni.set_deepspeed_parallelism()
        assert uni.ep_group is groups._get_expert_parallel_group(f"ep_size_{world_size}")

        g = torch.Generator().manual_seed(100 + rank)
        shape = (T, M) if case.get("two_d") else (3, T // 3, M)
        x = torch.randn(shape, generator=g)
        grad_out = torch.randn(shape, generator=g)
        used = (torch.rand(T, generator=g) > 0.3).float() if case.get("used_token") else None
        results = []
        for layer in (stock, uni):
            xi = x.clone().requires_grad_(True)
            torch.manual_seed(99 + rank)  # the same gate noise for both layers
            out, l_aux, counts = layer(xi, used)
            ((out * grad_out).sum() + 0.37 * l_aux).backward()
            grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
            results.append((out.detach(), l_aux.detach(), counts, xi.grad, grads))
        (o1, a1, c1, gx1, gp1), (o2, a2, c2, gx2, gp2) = results
        where = f"rank {rank} case {case}"
        assert torch.equal(c1, c2), where
        torch.testing.assert_close(a2, a1, rtol=0, atol=0, msg=where)
        torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6, msg=where)
        torch.testing.assert_close(gx2, gx1, rtol=1e-5, atol=1e-6, msg=where)
        assert gp1.keys() == gp2.keys()
        for n in gp1:
            # A parameter gradient sums over tokens; summed in another order (the stock layer's
            # capacity-padded buffers) an element near zero keeps the rounding of its largest terms,
            # so the absolute tolerance scales with the gradient's largest element.
            atol = 1e-6 * max(1.0, gp1[n].abs().max().item())
            torch.testing.assert_close(gp2[n], gp1[n], rtol=1e-5, atol=atol, msg=f"{where} grad {n}")
        # The output depends on the experts: a zero output would pass the checks above vacuously.
        assert o2.abs().sum() > 0 and gx2.abs().sum() > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_deepspeed_moe(world_size):
    run_distributed(_parity, world_size)
