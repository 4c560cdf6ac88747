"""The megakernel's gate-gradient order in torch (``ds_uniep.reference.warp_order_dot``) against a
literal scalar run of the kernels' loops (lane-strided 16-byte vectors, then the warp's pairwise
adds), and the slot sum whose backward uses it (``kernel_order_slot_sum``: the two-level dispatcher
with one rank per node) against autograd of ``weighted_slot_sum``."""
import numpy as np
import pytest
import torch

from ds_uniep.reference import kernel_order_slot_sum, warp_order_dot, weighted_slot_sum


def _kernel_dot(a, b):
    """One warp's loop of gate_grad_kernel / combine_bwd_rows_kernel, scalar by scalar in fp32."""
    elems = 16 // a.element_size()
    A, B = a.float().numpy(), b.float().numpy()
    lanes = []
    for lane in range(32):
        p = np.float32(0)
        for c in range(lane, a.numel() // elems, 32):
            for i in range(elems):
                p = np.float32(p + np.float32(A[c * elems + i] * B[c * elems + i]))
        lanes.append(p)
    for off in (16, 8, 4, 2, 1):
        lanes = [np.float32(lanes[lane] + lanes[lane ^ off]) for lane in range(32)]
    return lanes[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [96, 512, 1000])
def test_warp_order_dot_is_the_kernels_loop(M, dtype):
    g = torch.Generator().manual_seed(M)
    a = (torch.randn(5, M, generator=g) * torch.logspace(-3, 3, M)).to(dtype)
    b = torch.randn(5, M, generator=g).to(dtype)
    got = warp_order_dot(a, b)
    want = torch.tensor([_kernel_dot(a[p], b[p]) for p in range(5)])
    assert torch.equal(got, want), (got - want).abs().max()
    # torch's own reduction adds in another order: on these inputs its last bits differ somewhere
    assert not torch.equal((a.float() * b.float()).sum(1), got)


def test_kernel_order_slot_sum_backward():
    T, k, M = 7, 3, 256
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(T, k, M, generator=g).to(torch.bfloat16)
    rows[2, 1] = 0  # a dropped slot: zero rows and gate
    gates = torch.rand(T, k, generator=g)
    gates[2, 1] = 0
    grad_out = torch.randn(T, M, generator=g).to(torch.bfloat16)
    r1, g1 = rows.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    r2, g2 = rows.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    out1 = kernel_order_slot_sum(r1, g1, torch.bfloat16)
    out2 = weighted_slot_sum(r2, g2, torch.bfloat16)
    assert torch.equal(out1, out2)
    out1.backward(grad_out)
    out2.backward(grad_out)
    assert torch.equal(r1.grad, r2.grad)
    want = torch.tensor([[_kernel_dot(grad_out[t], rows[t, j]) for j in range(k)] for t in range(T)])
    assert torch.equal(g1.grad, want)
    assert g1.grad[2, 1] == 0
    torch.testing.assert_close(g1.grad, g2.grad, rtol=1e-5, atol=1e-5)
