"""Base + top-k residual migration: exact at ratio 1, bounded and deterministic below it."""
import math

import pytest
import torch
from conftest import needs_gpus

from ds_uniep.hybrid.compress import (decode, decode_experts, decode_rows, encode, encode_experts, num_kept,
                                      shared_base, wire_bytes)
from ds_uniep.hybrid.model import compressed_expert_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 19, 111, 989]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _experts(num_experts, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_experts, numel, generator=g, dtype=torch.float32)
    if numel > 3:
        # Far-apart magnitudes, where base + (w - base) would not round-trip.
        w[0, 0], w[1, 1], w[-1, 2], w[0, 3] = 1e-30, 3e4, -6e4, -0.0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_ratio_one_is_bitwise(dtype, numel):
    w = _experts(4, numel, dtype)
    base, enc = encode_experts(w, 1.0)
    out = decode_experts(base, enc)
    assert out.dtype == dtype and out.shape == w.shape
    assert torch.equal(out.view(_INT_VIEW[dtype]), w.view(_INT_VIEW[dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
def test_bounded_error(dtype, numel, ratio):
    w = _experts(3, numel, dtype, seed=1)
    base = shared_base(w)
    for e in range(3):
        enc = encode(w[e], base, ratio)
        k = num_kept(numel, ratio)
        assert enc.values.numel() == enc.indices.numel() == k
        out = decode(enc, base)
        kept = torch.zeros(numel, dtype=torch.bool)
        kept[enc.indices.long()] = True
        assert torch.equal(out[kept], w[e][kept])  # kept positions exact
        assert torch.equal(out[~kept], base[~kept])  # dropped positions fall back to the base
        resid = (w[e].float() - base.float()).abs()
        if k < numel:
            # Top-k: no dropped residual exceeds a kept one.
            assert resid[~kept].max() <= resid[kept].min()
        err = (out.float() - w[e].float()).norm()
        assert err <= math.sqrt((numel - k) / numel) * resid.norm() * (1 + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_is_decode_of_every_row(dtype):
    w = _experts(5, 111, dtype, seed=2)
    base, enc = encode_experts(w, 0.1)
    out = torch.full((5, 111), 7.0, dtype=dtype)  # overwritten everywhere
    got = decode_rows(out, base, torch.stack([e.indices for e in enc]), torch.stack([e.values for e in enc]))
    assert got is out
    want = base.reshape(1, -1).repeat(5, 1)  # by hand: the base, each row's kept positions overwritten
    for r, e in enumerate(enc):
        want[r, e.indices.long()] = e.values
    assert torch.equal(got.view(_INT_VIEW[dtype]), want.view(_INT_VIEW[dtype]))
    assert not torch.equal(got[0], got[1])  # the rows differ where each expert's kept values differ


def test_ties_broken_by_index_and_deterministic():
    base = torch.zeros(10)
    w = torch.tensor([1., -1., 1., 2., -1., 1., 1., -2., 1., 1.])
    enc = encode(w, base, 0.5)  # keeps 5: |2| at 3 and 7, then the first three of the |1| ties: 0, 1, 2
    assert enc.indices.tolist() == [0, 1, 2, 3, 7]
    assert enc.values.tolist() == [1., -1., 1., 2., -2.]
    again = encode(w, base, 0.5)
    assert torch.equal(enc.indices, again.indices) and torch.equal(enc.values, again.values)


@pytest.mark.parametrize("numel, ratio", [(2, 0.5), (19, 0.1), (111, 0.25), (989, 0.03), (4096, 0.3)])
@pytest.mark.parametrize("levels", [None, 3, 16])
def test_selection_is_the_stable_sort_rule(numel, ratio, levels):
    """The kept positions are the first k of a stable descending sort of |w - base| (ties to the
    smaller index), with many ties (values on a few levels) or none."""
    g = torch.Generator().manual_seed(numel)
    w = torch.randn(numel, generator=g)
    if levels is not None:
        w = torch.randint(-levels, levels + 1, (numel, ), generator=g).float()
    base = torch.zeros(numel) if levels is not None else torch.randn(numel, generator=g) * 0.1
    k = num_kept(numel, ratio)
    mag = (w - base).abs()
    want = torch.sort(torch.sort(mag, descending=True, stable=True).indices[:k]).values
    enc = encode(w, base, ratio)
    assert enc.indices.tolist() == want.tolist()
    assert torch.equal(enc.values, w[want])


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels", [None, 3])
def test_gpu_encode_never_synchronises_and_keeps_the_cpu_positions(dtype, levels):
    """On a GPU, encoding and decoding queue without a host synchronisation (CUDA's sync debug mode
    raises on one), keep the CPU's positions and values, and decode to the CPU's bits."""
    g = torch.Generator().manual_seed(7)
    numel = 1 << 20
    w = torch.randn(numel, generator=g)
    if levels is not None:  # many ties at the k-th magnitude
        w = torch.randint(-levels, levels + 1, (numel, ), generator=g).float()
    base = torch.zeros(numel) if levels is not None else torch.randn(numel, generator=g) * 0.1
    w, base = w.to(dtype), base.to(dtype)
    k = num_kept(numel, 0.03)
    mag = (w.float() - base.float()).abs()
    kth = torch.sort(mag, descending=True).values[k - 1]
    assert levels is None or int((mag == kth).sum()) > k // 2  # many ties at the k-th magnitude
    want = encode(w, base, 0.03)
    wc, bc = w.cuda(), base.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        enc = encode(wc, bc, 0.03)
        dec = decode(enc, bc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(enc.indices.cpu(), want.indices) and torch.equal(enc.values.cpu(), want.values)
    assert torch.equal(dec.cpu(), decode(want, base))


@pytest.mark.parametrize("dtype, itemsize", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
@pytest.mark.parametrize("numel, ratio", [(1, 0.1), (19, 0.1), (111, 0.25), (989, 0.03), (989, 1.0)])
def test_wire_bytes_exact(dtype, itemsize, numel, ratio):
    w = _experts(2, numel, dtype)
    base = shared_base(w)
    enc = encode(w[0], base, ratio)
    k = max(1, min(numel, math.floor(ratio * numel + 0.5)))  # nearest whole number, at least 1
    assert enc.wire_bytes == k * (itemsize + 4)
    assert wire_bytes(numel, dtype, ratio) == enc.wire_bytes
    assert compressed_expert_bytes(numel * itemsize, itemsize, ratio) == enc.wire_bytes


def test_shared_base_is_the_mean():
    w = torch.tensor([[1., 2.], [3., 6.], [5., 1.]])
    assert torch.equal(shared_base(w), torch.tensor([3., 3.]))
    wb = w.to(torch.bfloat16)
    assert shared_base(wb).dtype == torch.bfloat16


def test_shapes_kept():
    w = _experts(2, 24, torch.float32).reshape(2, 4, 6)
    base, enc = encode_experts(w, 0.25)
    assert enc[0].shape == (4, 6) and decode(enc[0], base).shape == (4, 6)


def test_errors():
    with pytest.raises(ValueError, match="ratio"):
        num_kept(10, 0.0)
    with pytest.raises(ValueError, match="ratio"):
        num_kept(10, 1.5)
    with pytest.raises(ValueError, match="must match"):
        encode(torch.zeros(3), torch.zeros(4), 0.5)
    with pytest.raises(ValueError, match="floating point"):
        encode(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 0.5)
    with pytest.raises(ValueError, match=r"\[E, \.\.\.\]"):
        shared_base(torch.zeros(3))
    enc = encode(torch.ones(3), torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="does not match"):
        decode(enc, torch.zeros(3, dtype=torch.float16))
