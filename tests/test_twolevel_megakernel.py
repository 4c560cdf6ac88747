"""The megakernel across nodes (``ds_uniep.twolevel.TwoLevelNVLinkDispatcher``) on GPUs, nodes
emulated with ``uniep.topology.node_size``: 4 ranks as 2 nodes of 2, 2 ranks as 2 nodes of 1 (no
NVLink move inside a node: the relay is the expert rank).

The dispatcher gives the flat reference's bits (received rows, counts, outputs, the input and weight
gradients; the gate gradient to fp32 rounding: the megakernel forms it in another fixed order)
for test_twolevel.py's cases it runs, in one phase and in two; the layer on 2 nodes of 2 gives the
single-node megakernel's outputs and gradients bit for bit, on both expert GEMMs, and on ds_uniep's
GEMM under the pipelined schedule across nodes too (this node's rows start the first GEMM while
the other node's cross).
"""
import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from test_megakernel_layer import _make as make_layer
from test_twolevel import CASES, _run_case


def _dispatcher_cases(rank, world_size):
    import torch.distributed as dist
    from ds_uniep.twolevel import TwoLevelNVLinkDispatcher
    group = dist.new_group(list(range(world_size)))
    cases = [c for c in CASES if c.get("dispatch_dtype", "activation") == "activation" and
             c.get("combine", "slots") == "slots" and c["k"] <= c.get("E", 2 * world_size)]
    node_size = world_size // 2
    for case in cases:
        _run_case(case, rank, world_size, node_size, group, device=rank_gpu(rank), node=TwoLevelNVLinkDispatcher)
    dist.barrier()
    if rank == 0:
        print(f"megakernel across 2 nodes of {node_size}: {len(cases)} dispatcher cases, in one phase and in two, "
              "bitwise the flat reference (gate gradients to fp32 rounding)", flush=True)


def _layers(rank, world_size):
    from ds_uniep.schedules import NodePipelined
    from ds_uniep.twolevel import TwoLevelNVLinkDispatcher
    device = rank_gpu(rank)
    T = [0, 1, 300, 19][rank]
    checked = 0
    for k in (1, 2, 6):
        for gemm in ("torch", "uniep"):
            res = []
            # one node; two nodes (sequential); on ds_uniep's GEMM, two nodes pipelined (two phases)
            half = world_size // 2
            variants = [(world_size, "sequential"), (half, "sequential")] + [(half, "pipelined")] * (gemm == "uniep")
            for node_size, schedule in variants:
                layer = make_layer(rank, world_size, k, "megakernel", expert_gemm=gemm, M=512, F=256,
                                   max_tokens=512, overlap={"schedule": schedule},
                                   extra={"topology": {"node_size": node_size}})
                gx = torch.Generator(device=device).manual_seed(rank)
                x = torch.randn(T, 512, device=device, generator=gx).to(torch.bfloat16).requires_grad_(True)
                gy = torch.randn(T, 512, device=device, generator=gx).to(torch.bfloat16)
                phases = []
                if schedule == "pipelined":
                    real = TwoLevelNVLinkDispatcher.dispatch

                    def counted(self, *args, **kwargs):
                        on_phase = kwargs.get("on_phase")
                        if on_phase is not None:
                            kwargs["on_phase"] = lambda recv, ph: (phases.append(ph.local), on_phase(recv, ph))
                        return real(self, *args, **kwargs)
                    TwoLevelNVLinkDispatcher.dispatch = counted
                try:
                    out, l_aux, _ = layer(x)
                finally:
                    if schedule == "pipelined":
                        TwoLevelNVLinkDispatcher.dispatch = real
                torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
                two_level = isinstance(layer._dispatchers[device], TwoLevelNVLinkDispatcher)
                assert two_level == (node_size < world_size) and layer.backend_name() == "megakernel"
                ran = layer._schedules[device, x.dtype][1]
                assert isinstance(ran, NodePipelined) == (schedule == "pipelined"), type(ran)
                assert phases == ([True, False] if schedule == "pipelined" else []), phases
                res.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
                del layer
            for name, other in zip(("2 nodes", "2 nodes pipelined"), res[1:]):
                for i, (a, b) in enumerate(zip(res[0], other)):
                    assert torch.equal(a, b), f"rank {rank} k={k} {gemm}: tensor {i} on {name} differs from one node"
            checked += len(res) - 1
    torch.distributed.barrier()
    if rank == 0:
        print(f"megakernel layer on 2 nodes of {world_size // 2}: {checked} cases (sequential; pipelined on ds_uniep's "
              f"GEMM) bitwise one node of {world_size}", flush=True)


def _both(rank, world_size):
    _dispatcher_cases(rank, world_size)
    _layers(rank, world_size)


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (2, 4)])
def test_megakernel_on_two_nodes_gives_the_single_node_bits(world_size):
    """2 nodes of 1 or of 2: dispatcher cases bitwise the flat reference; the layer (k 1, 2, 6, both
    GEMMs, pipelined across nodes on ds_uniep's GEMM, a rank without tokens) bitwise the single-node
    megakernel."""
    run_distributed(_both, world_size, backend="nccl", timeout=600)


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
