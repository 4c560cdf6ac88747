"""``compression.combine: "rank_partials"``: each rank sums its rows of a token before they travel.

The pure-torch sum (``ds_uniep.reference.rank_partial_sum``) against an explicit per-token loop,
the reference backend under it over gloo (deterministic, within bf16 tolerance of the slot-order
combine, and not that combine's bits), and where it may run (tuning space, cache key, layer
checks). The megakernel's kernels are compared with the reference backend on GPUs in
``test_megakernel_layer.py``.
"""
import pytest
import torch

from dist_utils import run_distributed


def _loop_sum(pair_rows, gates, slot_rank, dtype):
    """The rule, token by token: each rank's slots in slot order in fp32 (weighted), cast; then
    the partials in the order of each rank's first slot, fp32, cast once."""
    T, k, M = pair_rows.shape
    out = torch.empty(T, M, dtype=dtype)
    for t in range(T):
        acc = torch.zeros(M, dtype=torch.float32)
        seen = []
        for j in range(k):
            r = int(slot_rank[t, j])
            if r < 0 or r in seen:
                continue
            seen.append(r)
            part = torch.zeros(M, dtype=torch.float32)
            for jj in range(j, k):
                if int(slot_rank[t, jj]) == r:
                    row = pair_rows[t, jj].float()
                    part = part + (row if gates is None else gates[t, jj].float() * row)
            acc = acc + part.to(dtype).float()
        out[t] = acc.to(dtype)
    return out


def _inputs(T=37, k=6, M=24, ranks=4, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Self-identifying rows: token t, slot j, element m carry t + j / 10 + m / 1000 around a random scale.
    base = torch.arange(T).view(T, 1, 1) + torch.arange(k).view(1, k, 1) / 10 + torch.arange(M).view(1, 1, M) / 1000
    rows = (base * (1 + torch.randn(T, k, M, generator=g))).to(dtype)
    gates = torch.rand(T, k, generator=g)
    slot_rank = torch.randint(-1, ranks, (T, k), generator=g)
    slot_rank[0] = 0  # a token with every slot on one rank
    slot_rank[1] = -1  # a token with every slot dropped
    return rows, gates, slot_rank


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rank_partial_sum_is_the_rule(weighted, dtype):
    from ds_uniep.reference import rank_partial_sum
    rows, gates, slot_rank = _inputs(dtype=dtype)
    g = gates if weighted else None
    got = rank_partial_sum(rows, g, slot_rank, dtype)
    assert torch.equal(got, _loop_sum(rows, g, slot_rank, dtype))
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_one_slot_per_rank_in_fp32_is_the_slot_order_sum():
    # With no two slots of a token on one rank and fp32 rows, the partials are the weighted rows
    # themselves and the first-slot order is the slot order.
    from ds_uniep.reference import rank_partial_sum, weighted_slot_sum
    rows, gates, _ = _inputs(k=4, dtype=torch.float32)
    slot_rank = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t)) for t in range(37)])
    assert torch.equal(rank_partial_sum(rows, gates, slot_rank, torch.float32),
                       weighted_slot_sum(rows, gates, torch.float32))


def test_bf16_partials_round_once_more():
    # Two slots of a token on one rank: their bf16 sum is rounded before the other rank's row is
    # added, which the slot-order sum does not do.
    from ds_uniep.reference import rank_partial_sum, weighted_slot_sum
    rows = torch.tensor([[[1.0], [2.0**-8], [2.0**-8]]], dtype=torch.bfloat16)
    gates = torch.ones(1, 3)
    slot_rank = torch.tensor([[0, 1, 1]])
    # slots: (1 + 2^-8) + 2^-8 = 1 + 2^-7, representable; partials: rank 1's 2^-7, then 1 + 2^-7.
    assert weighted_slot_sum(rows, gates, torch.bfloat16).item() == 1 + 2.0**-7
    assert rank_partial_sum(rows, gates, slot_rank, torch.bfloat16).item() == 1 + 2.0**-7
    slot_rank = torch.tensor([[0, 0, 1]])  # rank 0: 1 + 2^-8 rounds to 1 in bf16, then + 2^-8 rounds to 1
    assert rank_partial_sum(rows, gates, slot_rank, torch.bfloat16).item() == 1.0


def _layer(world_size, combine):
    from ds_uniep import SwiGLUExpert, UniEPMoE
    torch.manual_seed(3)
    layer = UniEPMoE(32, SwiGLUExpert(32, 48), num_experts=4 * world_size, ep_size=world_size, k=6, min_capacity=0,
                     drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                     config={"backend": "reference", "compression": {"combine": combine}})
    with torch.no_grad():
        g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        for p in layer.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
    layer = layer.to(torch.bfloat16)
    layer.deepspeed_moe.gate.wg.float()
    layer.set_deepspeed_parallelism()
    return layer


def _step(layer, rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
    gy = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    out, l_aux, _ = layer(x)
    torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
    return [out, x.grad] + [p.grad for p in layer.parameters()]


def _reference_layer(rank, world_size):
    slots = _step(_layer(world_size, "slots"), rank)
    first = _step(_layer(world_size, "rank_partials"), rank)
    again = _step(_layer(world_size, "rank_partials"), rank)
    assert not torch.equal(first[0], slots[0]), "rank partials gave the slot-order output bit for bit: not acting"
    assert not torch.equal(first[1], slots[1]), "the dispatch's backward gave the slot-order bits: not acting"
    for i, (a, b, c) in enumerate(zip(slots, first, again)):
        assert torch.equal(b, c), f"rank {rank}: tensor {i} not repeatable"
        rel = ((b.float() - a.float()).norm() / a.float().norm().clamp_min(1e-30)).item()
        assert rel <= 2e-2, f"rank {rank}: tensor {i} {rel:.3e} from the slot-order combine"


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_backend_rank_partials(world_size):
    run_distributed(_reference_layer, world_size)


def test_tuning_space_keeps_rank_partials_in_the_combine_kernels():
    from ds_uniep.tuning import GPUInfo, Plan, Shape, Space
    from ds_uniep.tuning.cache import cache_key
    shape = Shape(T=4096, M=2048, F=1408, E=64, k=6, ep=4)
    h200 = GPUInfo.preset("h200")
    space = Space(shape, h200, backend="megakernel", expert_gemm="uniep", combine="rank_partials")
    slots = Space(shape, h200, backend="megakernel", expert_gemm="uniep")
    # (the plans run ds_uniep's GEMM, the one these spaces walk)
    assert space.check(Plan(schedule="sequential", expert_gemm="uniep")) is None
    assert space.check(Plan(schedule="fused", epilogue_combine=False)) is None
    for plan in (Plan(schedule="pipelined", num_chunks=2, expert_gemm="uniep"), Plan(schedule="fused")):
        assert "rank_partials" in space.check(plan)
        assert slots.check(plan) is None
    plans = space.enumerate()
    assert plans and all(p.runs_combine_kernels() for p in plans)
    # the combine's chunks and queue are not read under it: one value each
    assert len({(p.combine_chunks, p.combine_queue) for p in plans}) == 1
    assert len({(p.combine_chunks, p.combine_queue) for p in slots.enumerate()}) > 1
    assert space.digest() != slots.digest()
    assert cache_key(shape, h200, combine="rank_partials") != cache_key(shape, h200)
    with pytest.raises(ValueError, match="combine"):
        Space(shape, h200, combine="ranks")


@pytest.mark.parametrize("overlap, needs", [({"schedule": "pipelined"}, "sequential schedule"),
                                            ({"schedule": "fused"}, "epilogue_combine false")])
def test_layer_refuses_rank_partials_where_no_combine_kernel_runs(overlap, needs):
    from ds_uniep import SwiGLUExpert, UniEPMoE
    from ds_uniep.config import UniEPConfig
    cfg = UniEPConfig.coerce({"overlap": overlap, "compression": {"combine": "rank_partials"}})
    layer = UniEPMoE(16, SwiGLUExpert(16, 16), num_experts=4, k=2, config=cfg)
    from ds_uniep.schedules import check_combine_mode
    with pytest.raises(ValueError, match=needs):
        check_combine_mode(cfg, "megakernel", layer.layer_name)
    check_combine_mode(cfg, "reference", layer.layer_name)  # the reference backend builds it everywhere
    with pytest.raises(Exception, match="slots"):
        UniEPConfig.coerce({"compression": {"combine": "ranks"}})
