"""UniEPMoE beside a tensor-parallel model (4 gloo ranks, TP 2), with replicated experts and with
TP-sharded experts (enable_expert_tensor_parallelism): the same tokens give the same output, input
gradient, l_aux, exp_counts and gate gradient as the layer without tensor parallelism on full experts,
and the expert gradients that follow from the tokens each expert saw (a shard: its slice of the full
expert's; a replicated expert: half, its TP group's tokens arriving once instead of twice).

(Stock DeepSpeed MoE cannot be the reference here: its gather_tokens calls all_gather_into_tensor
with shapes gloo refuses.)
"""
import itertools

import pytest
import torch

from dist_utils import run_distributed


def _tp_equivalence(rank, world_size, expert_tp):
    """expert_tp: False (replicated experts), "module" (a sharded expert doing its own all-reduce),
    or "commfuse" (ds_uniep's TPGeLUExpert, run through all_gather_matmul / matmul_reduce_scatter)."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    from ds_uniep import UniEPMoE
    from ds_uniep.tensor_parallel import TPGeLUExpert
    from moe_models import MLP, TinyMPU, TPMLP

    tp = 2
    mpu = TinyMPU(tp)
    M, F, T, E = 16, 32, 23, 4  # 23 tokens: TP slices of 12 and 11
    for k, drop in itertools.product((1, 2), (True, False)):
        layers, expert_grads, ep_ranks = {}, {}, {}
        # The TP layer first: DeepSpeed creates the "ep_size_2" groups once, and TP-sharded experts
        # need the groups it builds with the mpu (TP ranks of one expert in one EP position).
        for mode in ("tp", "plain"):
            groups.mpu = mpu if mode == "tp" else None
            sharded = mode == "tp" and bool(expert_tp)
            torch.manual_seed(1234)
            biased = expert_tp != "module"  # the Megatron-style test expert has no biases
            expert = MLP(M, F, bias=biased) if not sharded else TPMLP(M, F, tp) if expert_tp == "module" else \
                TPGeLUExpert(M, F, tp)
            layer = UniEPMoE(M, expert, num_experts=E, ep_size=2, k=k,
                             min_capacity=4, drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False,
                             enable_expert_tensor_parallelism=sharded,
                             config={"backend": "reference", "commfuse": {"schedule": "bidirectional_ring", "num_chunks": 2}})
            layer.set_deepspeed_parallelism()
            ep_rank = dist.get_rank(layer.ep_group)
            tp_rank = mpu.get_tensor_model_parallel_rank()
            with torch.no_grad():  # expert e: the same full weights, or this TP rank's shard of them
                layer.deepspeed_moe.gate.wg.weight.copy_(torch.randn(E, M, generator=torch.Generator().manual_seed(7)))
                for l, e in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
                    g = torch.Generator().manual_seed(100 + ep_rank * 2 + l)
                    w1, w2 = torch.randn(F, M, generator=g) * 0.3, torch.randn(M, F, generator=g) * 0.3
                    if e.fc1.bias is not None:  # fc1's bias sharded like its rows; fc2's whole
                        b1, b2 = torch.randn(F, generator=g), torch.randn(M, generator=g)
                        e.fc1.bias.copy_(b1.chunk(tp)[tp_rank] if sharded else b1)
                        e.fc2.bias.copy_(b2)
                    e.fc1.weight.copy_(w1.chunk(tp, 0)[tp_rank] if sharded else w1)
                    e.fc2.weight.copy_(w2.chunk(tp, 1)[tp_rank] if sharded else w2)
            # Activations are replicated over a TP group: seed by the TP group.
            gen = torch.Generator().manual_seed(rank // tp)
            x = torch.randn(T, M, generator=gen)
            gy = torch.randn(T, M, generator=gen)
            xi = x.clone().requires_grad_(True)
            out, l_aux, counts = layer(xi)
            ((out * gy).sum() + l_aux).backward()
            layers[mode] = [out.detach(), l_aux.detach(), counts, xi.grad, layer.deepspeed_moe.gate.wg.weight.grad]
            expert_grads[mode] = [{n: p.grad for n, p in e.named_parameters()}
                                  for e in layer.deepspeed_moe.experts.deepspeed_experts]
            ep_ranks[mode] = torch.distributed.get_process_group_ranks(layer.ep_group)
        groups.mpu = None
        where = f"rank {rank} expert_tp={expert_tp} k={k} drop={drop}"
        for i, (a, b) in enumerate(zip(layers["plain"], layers["tp"])):
            # fp32, reductions split over the TP ranks in another order: ~1e-6 absolute on values ~5.
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5, msg=f"{where} tensor {i}")
        assert layers["tp"][0].abs().sum() > 0
        # Expert gradients. Both layers use the EP groups built first (DeepSpeed keeps "ep_size_2").
        # Sharded experts: EP groups of one TP rank, so an expert sees the tokens of two TP groups in
        # both layers and each shard has its slice of the full expert's gradient (fc1 by rows, fc2 by
        # columns; fc2's bias whole). Replicated experts: EP groups are the TP groups; the TP layer's
        # ranks send their token slices, the plain layer's ranks the TP group's tokens twice over (its
        # ranks hold the same tokens), so its gradients are twice the TP layer's.
        tp_group = [rank // tp * tp + i for i in range(tp)]
        want_ep = [rank % tp + j * tp for j in range(world_size // tp)] if expert_tp else tp_group
        assert ep_ranks["tp"] == ep_ranks["plain"] == want_ep, (where, ep_ranks)
        for l, (full, got) in enumerate(zip(expert_grads["plain"], expert_grads["tp"])):
            for n, g in got.items():
                assert g is not None and full[n] is not None, f"{where} expert {l} {n}: no gradient"
                if expert_tp:
                    want = full[n].chunk(tp, 0 if n.startswith("fc1") else 1)[tp_rank] \
                        if n != "fc2.bias" else full[n]
                else:
                    want = full[n] / 2
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=f"{where} expert {l} {n}")
            assert sum(float(g.abs().sum()) for g in got.values()) > 0, f"{where} expert {l}: all zero"


@pytest.mark.parametrize("expert_tp", [False, "module", "commfuse"])
def test_tensor_parallel_matches_the_layer_without_it(expert_tp):
    run_distributed(_tp_equivalence, 4, expert_tp)


def _tp_expert_alone(rank, world_size):
    """TPGeLUExpert called alone on replicated rows (2 gloo ranks, TP 2) against the full MLP:
    output, input gradient and every parameter's gradient (each shard's, and the whole fc2 bias's,
    which every TP rank must get for all rows, not only its own)."""
    from deepspeed.utils import groups
    from ds_uniep.tensor_parallel import TPGeLUExpert
    from moe_models import TinyMPU

    tp, M, F, T = world_size, 16, 32, 23  # 23 rows: TP slices of 12 and 11
    groups.mpu = TinyMPU(tp)
    g = torch.Generator().manual_seed(3)
    w1, b1, w2, b2 = (torch.randn(F, M, generator=g) * 0.3, torch.randn(F, generator=g),
                      torch.randn(M, F, generator=g) * 0.3, torch.randn(M, generator=g))
    x, gy = torch.randn(T, M, generator=g), torch.randn(T, M, generator=g)
    full = [t.clone().requires_grad_(True) for t in (w1, b1, w2, b2)]
    xf = x.clone().requires_grad_(True)
    want = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(xf, full[0], full[1])),
                                      full[2], full[3])
    (want * gy).sum().backward()
    expert = TPGeLUExpert(M, F, tp)
    with torch.no_grad():
        expert.fc1.weight.copy_(w1.chunk(tp, 0)[rank])
        expert.fc1.bias.copy_(b1.chunk(tp)[rank])
        expert.fc2.weight.copy_(w2.chunk(tp, 1)[rank])
        expert.fc2.bias.copy_(b2)
    xt = x.clone().requires_grad_(True)
    out = expert(xt)
    (out * gy).sum().backward()
    groups.mpu = None
    pairs = [("output", out, want), ("x.grad", xt.grad, xf.grad),
             ("fc1.weight.grad", expert.fc1.weight.grad, full[0].grad.chunk(tp, 0)[rank]),
             ("fc1.bias.grad", expert.fc1.bias.grad, full[1].grad.chunk(tp)[rank]),
             ("fc2.weight.grad", expert.fc2.weight.grad, full[2].grad.chunk(tp, 1)[rank]),
             ("fc2.bias.grad", expert.fc2.bias.grad, full[3].grad)]
    for name, got, ref in pairs:
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


def test_tp_gelu_expert_alone_matches_the_full_mlp_with_every_gradient():
    run_distributed(_tp_expert_alone, 2)


def _hybrid_beside_tp(rank, world_size):
    """8 ranks, TP 2, EP 4 over the ranks of one TP position, HybridEP domains of 2: the same as
    plain EP beside the same TP (replicated experts; each TP rank moves its slice of the tokens)."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    from ds_uniep import UniEPMoE
    from moe_models import MLP, TinyMPU, distinct_experts

    tp = 2
    mpu = TinyMPU(tp)
    groups.mpu = mpu
    M, F, T, E = 16, 24, 23, 8
    for k, drop in ((1, False), (2, True), (2, False)):
        res = []
        for S in (None, 2):
            torch.manual_seed(5)
            cfg = {"backend": "reference"}
            if S is not None:
                cfg["hybrid"] = {"enabled": True, "domain_size": S}
            layer = UniEPMoE(M, MLP(M, F), num_experts=E, ep_size=4, k=k, min_capacity=4, drop_tokens=drop,
                             use_rts=False, top2_2nd_expert_sampling=False, config=cfg)
            layer.set_deepspeed_parallelism()
            assert (layer._hybrid is not None) == (S is not None)
            distinct_experts(layer, dist.get_rank(layer.ep_group))
            with torch.no_grad():
                layer.deepspeed_moe.gate.wg.weight.copy_(torch.randn(E, M, generator=torch.Generator().manual_seed(7)))
            gen = torch.Generator().manual_seed(rank // tp)  # activations replicated over a TP group
            x = torch.randn(T, M, generator=gen)
            gy = torch.randn(T, M, generator=gen)
            xi = x.clone().requires_grad_(True)
            out, l_aux, _ = layer(xi)
            ((out * gy).sum() + l_aux).backward()
            res.append([out.detach(), xi.grad] + [p.grad for p in layer.parameters()])
        where = f"rank {rank} k={k} drop={drop}"
        for i, (a, b) in enumerate(zip(*res)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{where} tensor {i}")
        assert res[0][0].abs().sum() > 0
    # TP-sharded experts are not whole experts: HybridEP refuses them with a reason.
    layer = UniEPMoE(M, MLP(M, F), num_experts=E, ep_size=4, k=1, enable_expert_tensor_parallelism=True,
                     config={"backend": "reference", "hybrid": {"enabled": True, "domain_size": 2}})
    with pytest.raises(ValueError, match="cannot run with enable_expert_tensor_parallelism=True"):
        layer.set_deepspeed_parallelism()
    groups.mpu = None


def test_hybrid_ep_beside_tensor_parallelism_matches_plain_ep():
    run_distributed(_hybrid_beside_tp, 8)
