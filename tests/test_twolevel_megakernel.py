"""The megakernel across nodes (``ds_uniep.twolevel.TwoLevelNVLinkDispatcher``) on GPUs, nodes
emulated with ``uniep.topology.node_size``: 4 ranks as 2 nodes of 2.

The dispatcher gives the flat reference's bits (received rows, counts, outputs, the input and weight
gradients; the gate gradient to fp32 rounding: the megakernel forms it in another fixed order)
for test_twolevel.py's cases it runs; the layer on 2 nodes of 2 gives the single-node
megakernel's outputs and gradients bit for bit, on both expert GEMMs.
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
             c.get("combine", "slots") == "slots"]
    for case in cases:
        _run_case(case, rank, world_size, 2, group, device=rank_gpu(rank), node=TwoLevelNVLinkDispatcher)
    dist.barrier()
    if rank == 0:
        print(f"megakernel across 2 nodes of 2: {len(cases)} dispatcher cases bitwise the flat reference (gate "
              "gradients to fp32 rounding)", flush=True)


def _layers(rank, world_size):
    from ds_uniep.twolevel import TwoLevelNVLinkDispatcher
    device = rank_gpu(rank)
    T = [0, 1, 300, 19][rank]
    checked = 0
    for k in (1, 2, 6):
        for gemm in ("torch", "uniep"):
            res = []
            for node_size in (world_size, 2):
                layer = make_layer(rank, world_size, k, "megakernel", expert_gemm=gemm, M=512, F=256,
                                   max_tokens=512, extra={"topology": {"node_size": node_size}})
                gx = torch.Generator(device=device).manual_seed(rank)
                x = torch.randn(T, 512, device=device, generator=gx).to(torch.bfloat16).requires_grad_(True)
                gy = torch.randn(T, 512, device=device, generator=gx).to(torch.bfloat16)
                out, l_aux, _ = layer(x)
                torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
                two_level = isinstance(layer._dispatchers[device], TwoLevelNVLinkDispatcher)
                assert two_level == (node_size < world_size) and layer.backend_name() == "megakernel"
                res.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
                del layer
            for i, (a, b) in enumerate(zip(*res)):
                assert torch.equal(a, b), f"rank {rank} k={k} {gemm}: tensor {i} on 2 nodes differs from one node"
            checked += 1
    torch.distributed.barrier()
    if rank == 0:
        print(f"megakernel layer on 2 nodes of 2: {checked} cases bitwise one node of 4", flush=True)


def _both(rank, world_size):
    _dispatcher_cases(rank, world_size)
    _layers(rank, world_size)


@needs_gpus(4)
def test_megakernel_on_two_nodes_of_two_gives_the_single_node_bits():
    """Dispatcher cases bitwise the flat reference; the layer (k 1, 2, 6, both GEMMs, a rank without
    tokens) bitwise the single-node megakernel."""
    run_distributed(_both, 4, backend="nccl", timeout=600)


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
