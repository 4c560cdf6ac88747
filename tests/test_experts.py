"""The grouped-GEMM expert runner computes what the per-expert loop computes."""
import pytest
import torch

from ds_uniep.experts import GeLUExpert, SwiGLUExpert, _grouped_ok, run_experts


@pytest.mark.parametrize("kind", [SwiGLUExpert, GeLUExpert])
def test_grouped_matches_loop_forward_and_backward(kind):
    torch.manual_seed(0)
    M, F = 32, 48
    experts = [kind(M, F).to(torch.bfloat16) for _ in range(4)]
    counts = torch.tensor([5, 0, 19, 1])  # an expert with no rows, one with a single row
    x = torch.randn(int(counts.sum()), M, dtype=torch.bfloat16)
    assert _grouped_ok(experts, x)
    results = []
    for grouped in (True, False):
        for e in experts:
            e.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = run_experts(experts, xi, counts, grouped=grouped)
        (y.float() * torch.linspace(-1, 1, M)).sum().backward()
        results.append([y.detach().float(), xi.grad.float()] + [p.grad.float() for e in experts
                                                                 for p in e.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert results[0][0].abs().sum() > 0


def test_unrecognised_or_fp32_experts_take_the_loop():
    assert not _grouped_ok([torch.nn.Linear(8, 8)], torch.randn(2, 8, dtype=torch.bfloat16))
    assert not _grouped_ok([SwiGLUExpert(8, 8)], torch.randn(2, 8))


def test_a_dropped_expert_bias_is_announced():
    from moe_models import BiasTupleMLP
    experts = [BiasTupleMLP(8, 8)]
    with pytest.warns(UserWarning, match=r"returned \(out, bias\): the bias is not added"):
        y = run_experts(experts, torch.randn(3, 8), torch.tensor([3]))
    assert y.shape == (3, 8)
