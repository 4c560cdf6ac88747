"""Determinism and the layout on real ranks: bitwise repeatable, rows land in (expert, source, token, slot) order."""
import pytest
import torch

from conftest import needs_gpus
from dist_utils import run_distributed


def _identify(rank, T, M):
    """Row t of rank r is [r, t, 1, 1, ...]: a row that lands anywhere names its origin."""
    x = torch.ones(T, M)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32)
    return x


def _landing(rank, world_size):
    import deepspeed.comm as dist
    from ds_uniep import UniEPMoE
    from moe_models import Recorder

    M, E = 8, 2 * world_size
    L = E // world_size
    for T, k, all_to_one in ((1, 1, None), (19, 2, None), (111, 4, None), (19, 2, 3 % E)):
        torch.manual_seed(7)
        layer = UniEPMoE(M, Recorder(), num_experts=E, ep_size=world_size, k=k, min_capacity=0, drop_tokens=False, use_rts=False,
                         top2_2nd_expert_sampling=False, config={"backend": "reference"})
        layer.set_deepspeed_parallelism()
        if all_to_one is not None:
            with torch.no_grad():  # logits = 100 * (x . 1) for one expert, 0 for the rest
                layer.deepspeed_moe.gate.wg.weight.zero_()
                layer.deepspeed_moe.gate.wg.weight[all_to_one, 2:] = 100.0
        x = _identify(rank, T, M)
        gate_out = layer.deepspeed_moe.gate(x, None, True)
        routes, gates = gate_out[3].t(), gate_out[5].t().detach()  # [T, k]
        all_routes = [None] * world_size
        dist.all_gather_object(all_routes, routes)
        for expert in layer.deepspeed_moe.experts.deepspeed_experts:
            expert.seen.clear()
        out, _, counts = layer(x)
        for l, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = rank * L + l
            want = [(s, t) for s in range(world_size) for t in range(all_routes[s].shape[0])
                    for j in range(k) if int(all_routes[s][t, j]) == e]
            (got, ) = expert.seen
            assert [(int(r[0]), int(r[1])) for r in got] == want, f"rank {rank} expert {e} T={T} k={k}"
        if all_to_one is not None:
            assert int(counts[all_to_one]) == T and int(counts.sum()) == T * k
            assert (counts == 0).any(), "some experts must get no token in this case"
        # Identity experts: the output is the input times the sum of its kept gate values.
        torch.testing.assert_close(out, x * gates.sum(1, keepdim=True), rtol=1e-6, atol=1e-5)


def _repeatable(rank, world_size, device="cpu", backend="reference"):
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts

    M = 16
    for dtype in (torch.float32, torch.bfloat16):
        for drop in (True, False):
            runs = []
            for _ in range(2):
                torch.manual_seed(3)
                layer = UniEPMoE(M, MLP(M, 24), num_experts=2 * world_size, ep_size=world_size, k=2,
                                 drop_tokens=drop, use_rts=False, config={"backend": backend})
                distinct_experts(layer, rank)
                layer = layer.to(device=device, dtype=dtype)
                layer.set_deepspeed_parallelism()
                g = torch.Generator().manual_seed(rank)
                x = torch.randn(2, 19, M, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
                out, l_aux, _ = layer(x)
                assert out.dtype == dtype
                assert layer.backend_name(x.device) == backend
                (out.float().square().sum() + l_aux).backward()
                runs.append([out, x.grad] + [p.grad for p in layer.parameters()])
            for a, b in zip(*runs):
                assert torch.equal(a, b), f"rank {rank} {backend} {dtype} drop={drop}: not bitwise repeatable"


@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_land_in_layout_order(world_size):
    run_distributed(_landing, world_size)


def test_bitwise_repeatable_fp32_and_bf16():
    run_distributed(_repeatable, 2)


@needs_gpus(2)
@pytest.mark.parametrize("backend", ["reference", "megakernel"])
def test_bitwise_repeatable_on_gpus_over_nccl(backend):
    run_distributed(_repeatable, 2, "cuda", backend, backend="nccl")


@needs_gpus(2)
def test_rows_land_in_layout_order_over_nccl():
    run_distributed(_landing_gpu, 2, backend="nccl")


def _landing_gpu(rank, world_size):
    torch.set_default_device("cuda")
    _landing(rank, world_size)


def _empty_rank(rank, world_size, device="cpu", backend="reference"):
    """A rank with no tokens neither fails nor holds up the others, forward and backward (dropless,
    so the other ranks' outputs do not depend on its tokens: those of the run where it has some, up
    to the experts' GEMMs seeing other row counts)."""
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts

    M = 128  # FP8 rows of the megakernel take multiples of 128
    for k, fp8 in ((1, False), (2, False), (2, True)):
        outs = []
        for T0 in (3, 0):
            torch.manual_seed(3)
            cfg = {"backend": backend, "compression": {"dispatch_dtype": "fp8_e4m3" if fp8 else "activation"}}
            layer = UniEPMoE(M, MLP(M, 24), num_experts=2 * world_size, ep_size=world_size, k=k, min_capacity=0,
                             drop_tokens=False, use_rts=False, config=cfg)
            distinct_experts(layer, rank)
            layer = layer.to(device)
            layer.set_deepspeed_parallelism()
            T = T0 if rank == 0 else 7
            x = torch.randn(T, M, generator=torch.Generator().manual_seed(10 + rank)).to(device).requires_grad_(True)
            out, _, counts = layer(x)
            out.square().sum().backward()
            assert layer.backend_name(x.device) == backend
            assert out.shape == (T, M) and x.grad.shape == (T, M)
            outs.append((out.detach(), x.grad))
        if rank != 0:
            for a, b in zip(*outs):
                rel = ((a - b).norm() / a.norm()).item()  # the experts' GEMMs block other row counts otherwise
                assert rel < 1e-5, f"rank {rank} k={k} fp8={fp8}: a peer without tokens changed the results ({rel:.2e})"


def test_a_rank_without_tokens_takes_part():
    run_distributed(_empty_rank, 2)


@needs_gpus(2)
@pytest.mark.parametrize("backend", ["reference", "megakernel"])
def test_a_rank_without_tokens_takes_part_on_gpus(backend):
    run_distributed(_empty_rank, 2, "cuda", backend, backend="nccl")
