"""The sync-free megakernel layer (``"uniep": {"sync_free": true}``) under CUDA graphs.

No op of a sync-free layer reads a count on the host and its signal epochs live on the device,
so one forward and backward is captured in a ``torch.cuda.CUDAGraph`` and replayed with new
tokens and new routing (the gate's weights changed in place, one case sending every token's
first choice to one expert). Each replay must give the bits of the same step run eagerly by the
default (host-synchronised) layer: output, input gradient and every parameter gradient; eager
sync-free calls before and after the replays must too (the epoch bases carry on). On the CPU:
what ``sync_free`` refuses, by name.
"""
import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from test_megakernel_layer import _make as make_layer

M, F, K, T_MAX = 256, 512, 2, 512


def _tokens(rank):
    return 300 if rank == 0 else 77 * rank  # ranks see different counts


def _inputs(layer, rank, case):
    device = rank_gpu(rank)
    g = torch.Generator(device=device).manual_seed(1000 * case + rank)
    x = torch.randn(_tokens(rank), M, device=device, generator=g).to(torch.bfloat16)
    gy = torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16)
    wg = torch.randn(layer.deepspeed_moe.gate.wg.weight.shape, device=device,
                     generator=torch.Generator(device=device).manual_seed(case)) * M**-0.5
    if case % 3 == 2:  # every token's first choice on the last expert
        wg[-1] += 50.0
    return x, gy, wg


def _eager(layer, x, gy, wg):
    """[output, x.grad, every parameter's gradient] of one eager step from cleared gradients."""
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(wg)
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, l_aux, _ = layer(x)
    torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
    return [out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


class _Graphed:
    """One forward and backward of ``layer`` captured on static tensors, on ``stream`` (where the
    layer ran before: the gate's weight keeps its gradient accumulator, and that accumulator's stream,
    while the layer holds its last auxiliary loss, as DeepSpeed's MoE does)."""

    def __init__(self, layer, rank, stream):
        self.layer, self.stream = layer, stream
        device = rank_gpu(rank)
        self.x = torch.zeros(_tokens(rank), M, device=device, dtype=torch.bfloat16, requires_grad=True)
        self.gy = torch.zeros(_tokens(rank), M, device=device, dtype=torch.bfloat16)
        for _ in range(2):  # warm-up: caches, workspaces, the epoch advances' constants
            self._step()
        for p in list(layer.parameters()) + [self.x]:
            p.grad = None
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self.out = self._step()
        # The gradients the captured backward writes (an eager step in between gives the parameters new ones).
        self.grads = [self.x.grad] + [p.grad for p in layer.parameters()]

    def _step(self):
        out, l_aux, _ = self.layer(self.x)
        torch.autograd.backward([out, l_aux], [self.gy, torch.ones_like(l_aux)])
        return out

    def replay(self, x, gy, wg):
        with torch.no_grad():
            self.x.copy_(x)
            self.gy.copy_(gy)
            self.layer.deepspeed_moe.gate.wg.weight.copy_(wg)
        self.graph.replay()
        return [self.out.clone()] + [g.clone() for g in self.grads]


def _body(rank, world_size):
    for gemm in ("torch", "uniep"):
        default = make_layer(rank, world_size, K, "megakernel", expert_gemm=gemm, M=M, F=F, max_tokens=T_MAX)
        sync_free = make_layer(rank, world_size, K, "megakernel", expert_gemm=gemm, M=M, F=F, max_tokens=T_MAX,
                               extra={"sync_free": True})
        cases = range(6)
        want = [_eager(default, *_inputs(default, rank, c)) for c in cases]
        side = torch.cuda.Stream(rank_gpu(rank))  # not the legacy default stream, which capture refuses
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            before = _eager(sync_free, *_inputs(sync_free, rank, 0))
            graphed = _Graphed(sync_free, rank, side)
            got = [graphed.replay(*_inputs(sync_free, rank, c)) for c in cases]
            after = _eager(sync_free, *_inputs(sync_free, rank, 1))
            again = graphed.replay(*_inputs(sync_free, rank, 2))
        torch.cuda.current_stream().wait_stream(side)
        for name, a_list, b_list in [("eager before", before, want[0]), ("eager after", after, want[1]),
                                     ("replay after eager", again, want[2])] + [
                                         (f"replay {c}", got[c], want[c]) for c in cases]:
            assert len(a_list) == len(b_list)
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                assert torch.equal(a, b), f"rank {rank} {gemm} {name}: tensor {i} differs from the eager default layer"
        d = next(iter(sync_free._dispatchers.values()))
        assert d.sync_free and d.padded_recv and d.direct is None
        d.check(synchronize=True)
        if rank == 0:
            print(f"cuda graph ep {world_size} {gemm}: {len(cases)} replays with new tokens and routing, eager "
                  "before and after: bitwise the default layer", flush=True)
        del graphed, default, sync_free, d
        torch.cuda.synchronize()


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2, 4)])
def test_a_captured_step_replays_with_the_eager_bits(world_size):
    run_distributed(_body, world_size, backend="nccl")


def _keep_accumulators(layer):
    """What DeepSpeed's ZeRO-2 does at ``deepspeed.initialize``: keep every parameter's gradient accumulator
    (made on the current stream, here the legacy default one) with a hook on it; returns the hooks' log
    (the ids of the parameters whose gradient arrived)."""
    log = []
    layer.__dict__["_kept"] = []
    for p in layer.parameters():
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *_, i=id(p): log.append(i))
        layer.__dict__["_kept"].append(acc)
    return log


def _graphed_body(rank, world_size, kept):
    """``ds_uniep.graph_moe``: the layer's forward and backward graphs replayed inside eager steps (the
    parameters' gradients accumulated outside them) give the default layer's eager bits; another shape runs
    the layer eagerly; the layer keeps its parameter names. ``kept``: the parameters' gradient accumulators
    kept from before the capture, on the default stream, as ZeRO-2 keeps them; their hooks run once per
    parameter and step."""
    from ds_uniep import graph_moe
    default = make_layer(rank, world_size, K, "megakernel", M=M, F=F, max_tokens=T_MAX)
    layer = make_layer(rank, world_size, K, "megakernel", M=M, F=F, max_tokens=T_MAX, extra={"sync_free": True})
    log = _keep_accumulators(layer) if kept else None
    sample = torch.zeros(_tokens(rank), M, device=rank_gpu(rank), dtype=torch.bfloat16,
                         requires_grad=True)
    graphed = graph_moe(layer, sample)
    if kept:
        log.clear()
    assert graphed is layer
    for c in range(6):
        x, gy, wg = _inputs(default, rank, c)
        if c == 4:  # another shape: the layer runs eagerly
            x, gy = x[:-1], gy[:-1]
        want, got = _eager(default, x, gy, wg), _eager(graphed, x, gy, wg)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"rank {rank} graph_moe case {c}: tensor {i} differs from the eager default layer"
    assert [n for n, _ in graphed.named_parameters()] == [n for n, _ in default.named_parameters()]
    if kept:
        n = len(list(layer.parameters()))
        assert len(log) == 6 * n and all(log.count(id(p)) == 6 for p in layer.parameters()), (len(log), n)
    next(iter(layer._dispatchers.values())).check(synchronize=True)
    if rank == 0:
        print(f"graph_moe ep {world_size}{' (kept accumulators)' if kept else ''}: 5 replays inside eager steps "
              "and an eager fallback: bitwise the default layer", flush=True)


@pytest.mark.parametrize("kept", [False, True], ids=["", "kept-accumulators"])
@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2, 4)])
def test_graph_moe_replays_inside_eager_steps(world_size, kept):
    run_distributed(_graphed_body, world_size, kept, backend="nccl")


def _alias_body(rank, world_size):
    from ds_uniep import SwiGLUExpert, UniEPMoE
    from ds_uniep.cuda_graphs import _Alias, _Functional
    torch.manual_seed(0)
    layer = UniEPMoE(64, SwiGLUExpert(64, 128), num_experts=4, ep_size=world_size, k=2, drop_tokens=False,
                     use_rts=False, top2_2nd_expert_sampling=False, config={"backend": "reference"})
    layer.set_deepspeed_parallelism()
    log = _keep_accumulators(layer)
    x = torch.randn(10 + rank, 64, generator=torch.Generator().manual_seed(rank))
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + rank))

    def step(forward):
        for p in layer.parameters():
            p.grad = None
        xx = x.clone().requires_grad_(True)
        out, l_aux, _ = forward(xx)
        torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
        return [out.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]

    want = step(layer)
    params = [p for _, p in layer.named_parameters()]
    got = step(lambda xx: _Functional(layer)(xx, *_Alias.apply(*params)))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"rank {rank}: tensor {i} differs from the layer's own forward"
    assert len(log) == 2 * len(params) and all(log.count(id(p)) == 2 for p in params), (len(log), len(params))


def test_the_parameter_aliases_give_the_layer_bits_and_reach_kept_accumulators():
    """``graph_moe`` captures the layer as a function of aliases of its parameters (the CUDA graphs need a GPU;
    the function and the aliases do not): on 2 CPU ranks (reference backend) the function gives the layer's
    own forward and gradients bit for bit, and the parameters' kept gradient accumulators (as ZeRO-2 keeps
    them) see every gradient."""
    run_distributed(_alias_body, 2, timeout=200)


def _refused(rank, world_size):
    import ds_uniep
    from ds_uniep import GeLUExpert, SwiGLUExpert, UniEPMoE
    from ds_uniep.schedules import check_sync_free
    said = r'^UniEPMoE\[\d+\]: "uniep": \{"sync_free": true\} cannot run here: '
    layer = UniEPMoE(16, SwiGLUExpert(16, 32), num_experts=4, ep_size=1, k=2, drop_tokens=False,
                     config={"sync_free": True, "backend": "reference"})
    with pytest.raises(ValueError, match=said + "the reference backend exchanges row counts on the host"):
        layer(torch.randn(8, 16))
    # What the megakernel's dispatcher meets (a stand-in: the check reads only its class).
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    cases = [(SwiGLUExpert(16, 32), 1, False, "the gate reads counts on the host"),
             (SwiGLUExpert(16, 32), 2, True, "the gate reads counts on the host"),
             (GeLUExpert(16, 32), 2, False, "the experts have biases"),
             (torch.nn.Linear(16, 16), 2, False, "the experts do not run as grouped GEMMs"),
             (SwiGLUExpert(16, 32), 2, False, None), (GeLUExpert(16, 32, bias=False), 3, False, None)]
    for expert, k, drop, words in cases:
        layer = UniEPMoE(16, expert, num_experts=4, ep_size=1, k=k, drop_tokens=drop, min_capacity=0,
                         config={"sync_free": True}).to(torch.bfloat16)
        if words is None:
            check_sync_free(layer, x, object(), 1)
            continue
        with pytest.raises(ValueError, match=said + words):
            check_sync_free(layer, x, object(), 1)
    with pytest.raises(ValueError, match=said + "tensor parallelism"):
        check_sync_free(layer, x, object(), 2)
    assert ds_uniep.UniEPConfig.from_dict({"sync_free": True}).sync_free
    from ds_uniep.megakernel import NVLinkDispatcher
    with pytest.raises(ValueError, match=r"^t \(rank 0\): sync_free does not run compression.combine 'rank_partials'"):
        NVLinkDispatcher.from_config("t", 4, 1, 16, 2, torch.bfloat16,
                                     {"sync_free": True, "compression": {"combine": "rank_partials"}})
    with pytest.raises(ds_uniep.config.UniEPConfigError, match="sync_free"):
        ds_uniep.UniEPConfig.from_dict({"sync_free": "yes"})


def test_sync_free_refuses_what_reads_counts_on_the_host():
    run_distributed(_refused, 1, backend="gloo")


def _device_epoch_set(device_epochs):
    """A BufferSet's epoch bookkeeping alone (no symmetric memory), its bases in CPU tensors."""
    from ds_uniep.megakernel.buffers import _ADVANCE_ROWS, NUM_PHASES, BufferSet
    s = BufferSet.__new__(BufferSet)
    s.epochs, s.device_epochs, s.device = [0] * NUM_PHASES, device_epochs, torch.device("cpu")
    s.epoch_bases = torch.zeros(NUM_PHASES, dtype=torch.int32)
    s._advance_rows, s._advances = torch.zeros(_ADVANCE_ROWS, NUM_PHASES, dtype=torch.int32), {}
    return s


def test_device_epochs_are_the_host_counted_ones(monkeypatch):
    """The epoch a kernel works at (its argument plus the phase's base, ``device_epoch`` in
    ops/csrc/common.cuh) runs through 1, 2, 3, ... in every phase, as a host-counted set's epochs
    do (the counts' double buffer alternates by parity), over a random sequence of ops, some of them
    first met while a graph is captured; a host-counted set leaves its bases at 0."""
    import random

    from ds_uniep.megakernel.buffers import NUM_PHASES
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    ops = [(0, 1), (2,), (3, 1, 2, 2), (3, 2), (5, 2), (3, 3, 3, 1)]  # the phases each op's kernels use
    device, host = _device_epoch_set(True), _device_epoch_set(False)
    seen = {p: [] for p in range(NUM_PHASES)}
    rng = random.Random(5)
    for step in range(200):
        op = rng.choice(ops)
        capturing[0] = step % 7 == 3
        bases = device.epoch_bases.tolist()
        for phase in op:
            rel, absolute = device.next_epoch(phase), host.next_epoch(phase)
            assert bases[phase] + rel == absolute, f"step {step} phase {phase}"
            seen[phase].append(absolute)
        device.end_op()
        host.end_op()
        assert device.epochs == [0] * NUM_PHASES  # the next op counts from 1 again
    for phase, epochs in seen.items():
        assert epochs == list(range(1, len(epochs) + 1)), phase
    assert device.epoch_bases.tolist() == host.epochs and host.epoch_bases.tolist() == [0] * NUM_PHASES
    assert len(device._advances) == len(set(tuple(op.count(p) for p in range(NUM_PHASES)) for op in ops))
