"""Layers of one expert-parallel group share megakernel buffers, bit for bit.

A stack of four megakernel layers (residual stream; the third has a larger ``max_tokens_per_rank``,
so it makes a new set unless the group's newest is that large already, and the fourth shares it) runs two
forwards, then both backwards, on every schedule: with shared buffer sets and with a set per layer,
outputs, input gradients and every parameter gradient are bitwise equal; the largest layer's set is
the size of its per-layer set. The sizes' arithmetic is checked on the CPU.
"""
from types import SimpleNamespace

import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from test_megakernel_layer import _make as make_layer

M, F, K = 256, 512, 2
SCHEDULES = [
    ("sequential", {"schedule": "sequential"}, "torch"),
    ("pipelined", {"schedule": "pipelined", "num_chunks": 2}, "torch"),
    ("fused", {"schedule": "fused", "roles": "interleaved"}, "uniep"),
    ("fused-no-epilogue", {"schedule": "fused", "epilogue_combine": False}, "uniep"),
]
MAX_TOKENS = (512, 512, 1024, 512)  # the third layer makes a second set


def _stack(rank, world_size, overlap, gemm):
    layers = []
    for i, max_tokens in enumerate(MAX_TOKENS):
        layer = make_layer(rank, world_size, K, "megakernel", overlap=overlap, expert_gemm=gemm, M=M, F=F,
                           max_tokens=max_tokens)
        with torch.no_grad():  # layers differ from each other, the same in both stacks
            for p in layer.deepspeed_moe.experts.parameters():
                p.mul_(1.0 + 0.25 * i)
        layers.append(layer)
    return layers


def _run_stack(layers, rank, shared):
    """Two forwards of the stack (300 and 0 or 19 tokens), then both backwards, the first one's
    last: [outputs, input gradients, every parameter's gradient]. A layer's dispatcher (and its
    buffers) is made at its first forward: ``shared`` holds while the stack runs."""
    from ds_uniep.megakernel import buffers
    buffers.SHARED = shared
    try:
        return _forward_backward(layers, rank)
    finally:
        buffers.SHARED = True


def _forward_backward(layers, rank):
    device = rank_gpu(rank)
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    g = torch.Generator(device=device).manual_seed(70 + rank)
    xs = [torch.randn(T, M, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
          for T in (300, 19 if rank else 0)]
    outs = []
    for x in xs:
        h = x
        for layer in layers:
            h = h + layer(h)[0]
        outs.append(h)
    gys = [torch.randn(o.shape, device=device, generator=g).to(torch.bfloat16) for o in outs]
    outs[1].backward(gys[1])
    outs[0].backward(gys[0])
    return outs + [x.grad for x in xs] + [p.grad for layer in layers for p in layer.parameters()]


def _body(rank, world_size):
    for name, overlap, gemm in SCHEDULES:
        shared, private = _stack(rank, world_size, overlap, gemm), _stack(rank, world_size, overlap, gemm)
        got, want = _run_stack(shared, rank, True), _run_stack(private, rank, False)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a is not None and b is not None, f"{name}: tensor {i} missing"
            assert torch.equal(a, b), f"rank {rank} {name}: tensor {i} differs between shared and per-layer buffers"
        ds = [next(iter(layer._dispatchers.values())) for layer in shared]
        dp = [next(iter(layer._dispatchers.values())) for layer in private]
        sets = [d._set for d in ds]
        # The first two share a set (a new one, or the group's newest, which an earlier stack made), the
        # last two the third layer's.
        assert sets[0] is sets[1] and sets[2] is sets[3], f"{name}: sets {sets}"
        assert len({id(d._set) for d in dp}) == len(dp), f"{name}: per-layer buffers were shared"
        nbytes = lambda b: (b.sym.total_bytes, b.direct_bytes)
        assert nbytes(sets[2]) == nbytes(dp[2]._set), name
        assert sets[0] is sets[2] or nbytes(sets[0]) == nbytes(dp[0]._set), name
        for d in ds + dp:
            d.check(synchronize=True)
        if rank == 0:
            size = lambda bs: sum(b.sym.total_bytes + b.direct_bytes for b in {id(b): b for b in bs}.values())
            print(f"shared buffers ep {world_size} {name}: bitwise per-layer buffers; "
                  f"{size(sets) / 2**30:.4f} GiB in {len({id(b) for b in sets})} set(s) vs {size([d._set for d in dp]) / 2**30:.4f} GiB "
                  "per layer", flush=True)
        del shared, private, ds, dp, sets
        torch.cuda.synchronize()


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2, 4)])
def test_layers_sharing_buffers_give_the_per_layer_bits(world_size):
    run_distributed(_body, world_size, backend="nccl")


def test_a_set_is_sized_by_its_largest_layer():
    """A set made for one layer does not fit a layer that needs more of any region; one sized by
    the larger of both (as ``buffer_set`` makes it) fits both. The byte count is the module doc's
    formula."""
    from ds_uniep.megakernel.buffers import MAX_RANKS, BufferSet, _Dims
    E, G, k, M = 64, 4, 6, 2048
    a = _Dims(E, G, 4096, k, M, 2, False)
    b = _Dims(2 * E, G, 2048, 8, M // 2, 2, False)
    made_for = lambda regions, direct: SimpleNamespace(regions=regions, direct_bytes=direct)  # noqa: E731
    assert BufferSet.fits(made_for(a.regions, a.direct_bytes), a)
    assert not BufferSet.fits(made_for(a.regions, a.direct_bytes), b)  # more experts: a larger counts region
    assert not BufferSet.fits(made_for(b.regions, b.direct_bytes), a)  # more rows
    both = made_for({n: max(a.regions[n], b.regions[n]) for n in a.regions}, max(a.direct_bytes, b.direct_bytes))
    assert BufferSet.fits(both, a) and BufferSet.fits(both, b)
    R = G * 4096 * min(k, E // G)
    assert a.recv_rows == R and a.direct_bytes == R * M * 2
    rows = (a.regions["recv"] + a.direct_bytes + a.regions["comb"]) // (M * 2)
    assert rows == 2 * R + 4096 * k
    assert a.regions["meta"] + a.regions["dup"] == 8 * R and a.regions["gates"] == 4 * 4096 * k
    assert a.regions["counts"] == 4 * E * 2 * MAX_RANKS + 8 * MAX_RANKS
    fp8 = _Dims(E, G, 4096, k, M, 2, True)
    assert fp8.direct_bytes == 0 and fp8.regions["scales"] == 4 * R * M // 128


def test_a_timeout_in_one_layer_stops_every_layer_sharing_its_buffers():
    """The kernels' error record is the set's, as is the poison word that stops later kernels: every
    layer of the set raises at its next check, naming the layer whose wait gave up."""
    from ds_uniep.errors import UniEPTimeoutError
    from ds_uniep.megakernel import NVLinkDispatcher, autograd

    class Layer:  # what check() reads of a dispatcher (weakly referable, as the registry needs)
        def __init__(self, name, record):
            self.layer_name, self.error_record, self.timeout_ns = name, record, int(5e9)

    record = torch.zeros(8, dtype=torch.int64)
    a, b = Layer("UniEPMoE[0]", record), Layer("UniEPMoE[1]", record)
    a_id = autograd.register(a)
    check = NVLinkDispatcher.check
    check(a), check(b)  # nothing recorded: nothing raised
    record.copy_(torch.tensor([1, 1, 1, 7, 6, 0, a_id, 0]))  # as wait_until in ops/csrc/common.cuh fills it
    with pytest.raises(UniEPTimeoutError, match=r"^UniEPMoE\[0\]: rank 0 timed out after 5 s waiting for the "
                       r"'dispatch' signal of rank 1 \(epoch 7, saw 6\)"):
        check(a)
    with pytest.raises(UniEPTimeoutError, match=r"^UniEPMoE\[1\]: rank 0 timed out \(in UniEPMoE\[0\], which shares "
                       r"its buffers\) after 5 s"):
        check(b)


def test_the_choice_of_set_does_not_wait_for_the_garbage_collector(monkeypatch):
    """Making a set is collective, so every rank must choose the same set for a layer: the newest set
    of a group stays chosen after its layers are gone (however late a rank's collector frees them),
    until ``release_buffers``."""
    import gc

    from ds_uniep.megakernel import buffers

    made = []

    class FakeSet:  # what buffer_set reads of a set, and no symmetric memory
        def __init__(self, regions, direct, *args):
            self.regions, self.direct_bytes = regions, direct
            made.append(1)

        fits = buffers.BufferSet.fits

    monkeypatch.setattr(buffers, "BufferSet", FakeSet)
    monkeypatch.setattr(buffers, "_SETS", {})
    small, large = buffers._Dims(16, 2, 64, 2, 128, 2, False), buffers._Dims(16, 2, 128, 2, 128, 2, False)
    dev, group = torch.device("cpu"), SimpleNamespace(group_name="g")
    first = buffers.buffer_set(small, torch.bfloat16, False, group, dev)
    first_id = id(first)
    del first
    gc.collect()
    assert id(buffers.buffer_set(small, torch.bfloat16, False, group, dev)) == first_id and len(made) == 1
    grown = buffers.buffer_set(large, torch.bfloat16, False, group, dev)  # larger: a new set for both
    assert len(made) == 2 and buffers.buffer_set(small, torch.bfloat16, False, group, dev) is grown
    again = SimpleNamespace(group_name="g")  # a group made again under the same name: not the old one's set
    third = buffers.buffer_set(small, torch.bfloat16, False, again, dev)
    assert third is not grown and len(made) == 3
    buffers.release_buffers()
    assert buffers.buffer_set(small, torch.bfloat16, False, again, dev) is not third and len(made) == 4
