"""ds_uniep.gating.route and route_split against DeepSpeed's TopKGate itself: the same bits.

On the dropless top-2 and top-k paths (k >= 2, no token dropping) route() skips the
locations cumsum and the capacity all-reduce, so its routes, gates, auxiliary loss, counts
and every gradient must still be exactly the gate's (random draws included: input jitter and
top-2's second-expert sampling, with the generator reseeded); any other gate is called as it is.
"""
import itertools

import torch

from dist_utils import run_distributed


def _inputs(T, M, case, ties):
    g = torch.Generator().manual_seed(1000 + case)
    x = torch.randn(T, M, generator=g)
    if ties and T > 2:
        x[1] = 0.0  # a uniform softmax: every top-k pick is a tie
        x[2] = x[0]  # two tokens with the same routes
    return x


def _gate_vs_route(rank, world_size):
    from deepspeed.moe.layer import MoE

    from ds_uniep import gating
    from moe_models import MLP

    M = 16
    case = 0
    for k, E_per_rank, T, training, policy, ties, sampling in itertools.product(
            (2, 3, 6, 8), (4, 8), (1, 19, 64), (True, False), (None, "Jitter"), (False, True), (False, True)):
        E = E_per_rank * world_size
        if k > E or (sampling and k != 2):
            continue
        case += 1
        torch.manual_seed(7)
        moe = MoE(M, MLP(M, 8), num_experts=E, ep_size=world_size, k=k, min_capacity=0, drop_tokens=False,
                  use_rts=False, noisy_gate_policy=policy, top2_2nd_expert_sampling=sampling)
        moe.set_deepspeed_parallelism()
        gate = moe.deepspeed_moe.gate
        gate.train(training)
        assert gating._dropless_kind(gate) == ("top2" if k == 2 else "topk")
        x0 = _inputs(T, M, case, ties)
        w = torch.randn(k, T, generator=torch.Generator().manual_seed(case))
        results = []
        for how in ("gate", "route", "split"):
            gate.wg.weight.grad = None
            x = x0.clone().requires_grad_(True)
            torch.manual_seed(50 + case)  # the same jitter noise for every call
            if how == "route":
                l_aux, capacity, idx, gates, counts = gating.route(gate, x)
                assert capacity is None
            elif how == "split":  # the routes, then (after a dispatch could start) the rest
                idx_tk, finish = gating.route_split(gate, x)
                assert idx_tk.dtype == torch.int32 and idx_tk.is_contiguous() and idx_tk.shape == (T, k)
                l_aux, gates_tk, counts = finish()
                assert gates_tk.is_contiguous() and gates_tk.shape == (T, k)
                idx, gates = idx_tk.t(), gates_tk.t()
            else:
                l_aux, _, _, idx, _, gates, counts = gate(x, None, True)
            (l_aux * 0.37 + (gates * w).sum()).backward()
            results.append((l_aux.detach(), idx, gates.detach(), counts, x.grad, gate.wg.weight.grad.clone()))
        where = f"rank {rank} k={k} E={E} T={T} training={training} policy={policy} ties={ties} sampling={sampling}"
        for other, how in ((results[1], "route"), (results[2], "route_split")):
            for a, b, name in zip(results[0], other,
                                  ("l_aux", "route_idx", "route_gates", "exp_counts", "grad_x", "grad_wg")):
                assert a.dtype == b.dtype and a.shape == b.shape, f"{how} {name}: {where}"
                assert torch.equal(a, b), f"{how}: {name} differs: {where}"
        assert int(results[1][3].sum()) == T * k, where  # dropless: every pair counted
        assert results[1][4].abs().sum() > 0, where
        assert gating.splits(gate), where
        gate.wall_clock_breakdown = True  # its timer would time a dispatch queued between the steps
        assert gating.route_split(gate, x0) is None and not gating.splits(gate), where
        gate.wall_clock_breakdown = False
        if k == 2 and T > 1:  # DeepSpeed's top-2 gate does not read used_token: the split path stays, same bits
            used = (torch.arange(T) % 2).float()
            assert gating.route_split(gate, x0, used) is not None, where
            torch.manual_seed(50 + case)
            got = gating.route(gate, x0, used)
            torch.manual_seed(50 + case)
            ref = gate(x0, used, True)
            assert torch.equal(got[2], ref[3]) and torch.equal(got[3], ref[5]) and torch.equal(got[4], ref[6]), where

    # Anything else goes through the gate as it is.
    for k, drop in ((1, False), (1, True), (2, True), (4, True)):
        moe = MoE(M, MLP(M, 8), num_experts=4 * world_size, ep_size=world_size, k=k, min_capacity=4,
                  drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False)
        moe.set_deepspeed_parallelism()
        gate = moe.deepspeed_moe.gate
        assert gating._dropless_kind(gate) is None and not gating.splits(gate)
        x = _inputs(19, M, 0, False)
        l_aux, capacity, idx, gates, counts = gating.route(gate, x)
        ref = gate(x, None, True)
        where = f"rank {rank} k={k} drop_tokens={drop}"
        assert torch.equal(idx, ref[3]) and torch.equal(gates, ref[5]) and torch.equal(l_aux, ref[0]), where
        assert torch.equal(counts, ref[6]), where


def test_route_equals_deepspeed_gate():
    run_distributed(_gate_vs_route, 2)
