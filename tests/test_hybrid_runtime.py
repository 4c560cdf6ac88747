"""HybridEP inside UniEPMoE on 4 gloo ranks as 2 domains (the compressed migration, reused replicas and
partial migration also over NCCL on GPUs): exact against plain EP, replica gradients reduced once."""
import dataclasses
import itertools
import re

import pytest
import torch

from conftest import cuda_gpus, needs_gpus
from dist_utils import run_distributed

CASES = list(itertools.product((1, 2, 4), (True, False)))


def _rel(a, b, dtype=torch.float32):
    a, b = a.detach().to(dtype), b.detach().to(dtype)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _layer_pair(world_size, k, drop, dtype, domain_size, rank, expert=None, migrated_fraction=1.0):
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts
    expert = expert if expert is not None else MLP(16, 24)
    layers = []
    for S in (None, domain_size):
        torch.manual_seed(5)
        cfg = {"backend": "reference"}
        if S is not None:
            cfg["hybrid"] = {"enabled": True, "domain_size": S, "migrated_fraction": migrated_fraction}
        layer = UniEPMoE(16, expert, num_experts=2 * world_size, ep_size=world_size, k=k, min_capacity=4,
                         drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False, config=cfg)
        distinct_experts(layer, rank)
        layer = layer.to(dtype)
        layer.set_deepspeed_parallelism()
        layers.append(layer)
    return layers


def _fwd_bwd_pair(layers, rank, dtype, device="cpu"):
    """Each layer's output, input gradient and parameter gradients on the same rank-seeded input."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(24, 16, generator=g).to(device, dtype)
    gy = torch.randn(24, 16, generator=g).to(device, dtype)
    res = []
    for layer in layers:
        xi = x.clone().requires_grad_(True)
        out, l_aux, _ = layer(xi)
        ((out.float() * gy.float()).sum() + l_aux).backward()
        res.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    return res


def _layer_exactness(rank, world_size):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for k, drop in CASES:
            for S in (1, 2):
                plain, hybrid = _layer_pair(world_size, k, drop, dtype, S, rank)
                assert (hybrid._hybrid is None) == (S == 1)
                res = _fwd_bwd_pair((plain, hybrid), rank, dtype)
                where = f"rank {rank} {dtype} k={k} drop={drop} S={S}"
                for a, b in zip(*res):
                    if S == 1:
                        assert torch.equal(a, b), where  # domain size 1 is plain EP, bit for bit
                    else:
                        assert _rel(b, a) <= tol, f"{where}: relative error {_rel(b, a)}"
                if S == 2:
                    assert hybrid._hybrid.counter["owner_reductions"] == 1, where


@pytest.mark.parametrize("world_size", [4])
def test_hybrid_layer_matches_plain_ep(world_size):
    run_distributed(_layer_exactness, world_size)


def _partial(rank, world_size, device="cpu"):
    """migrated_fraction < 1: each rank migrates its first m of L = 4 experts inside its domain, tokens
    for the others go to their owners; outputs and every gradient match plain EP (fp32 1e-5, bf16
    1e-2), only the migrated experts' weights travel, and each owner's gradients arrive once."""
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts
    L = 4
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for fraction, m in ((0.25, 1), (0.5, 2), (0.75, 3)):
            for k, drop in ((1, False), (2, True), (4, False)):
                layers = []
                for hyb in (None, {"enabled": True, "domain_size": 2, "migrated_fraction": fraction}):
                    torch.manual_seed(5)
                    cfg = {"backend": "reference"} if hyb is None else {"backend": "reference", "hybrid": hyb}
                    layer = UniEPMoE(16, MLP(16, 24), num_experts=L * world_size, ep_size=world_size, k=k,
                                     min_capacity=4, drop_tokens=drop, use_rts=False,
                                     top2_2nd_expert_sampling=False, config=cfg)
                    distinct_experts(layer, rank)
                    layer = layer.to(device, dtype)
                    layer.set_deepspeed_parallelism()
                    layers.append(layer)
                h = layers[1]._hybrid
                where = f"rank {rank} {dtype} fraction {fraction} k={k} drop={drop}"
                assert h.migrated == m == layers[1].hybrid_migrated_experts, where
                res = _fwd_bwd_pair(layers, rank, dtype, device)
                for i, (a, b) in enumerate(zip(*res)):
                    assert _rel(b, a) <= tol, f"{where} tensor {i}: relative error {_rel(b, a)}"
                expert_bytes = sum(p.numel() * p.element_size()
                                   for p in layers[1].deepspeed_moe.experts.deepspeed_experts[0].parameters())
                assert h.last_wire_bytes == (2 - 1) * m * expert_bytes, (where, h.last_wire_bytes)
                assert h.counter["owner_reductions"] == 1, where


def test_partial_migration_matches_plain_ep():
    run_distributed(_partial, 4)


@needs_gpus(2)
def test_partial_migration_over_nccl():
    run_distributed(_partial, _nccl_ranks(), "cuda", backend="nccl")


def _hot_routing(rank, world_size, L, M, T, seed):
    """``(x, gy, gate weight)``: token t prefers owner t % G's experts 2 and 3 (then 0, then 1)."""
    E = L * world_size
    g = torch.Generator().manual_seed(seed + rank)
    group = torch.arange(T) % world_size
    x = torch.nn.functional.one_hot(group, world_size).repeat_interleave(M // world_size, 1).float()
    x = x + 0.01 * torch.randn(T, M, generator=g)
    gy = torch.randn(T, M, generator=g)
    w = torch.zeros(E, M)
    pref = torch.tensor([0.2, 0.1, 2.0, 1.5])
    for e in range(E):
        o, j = divmod(e, L)
        w[e, o * (M // world_size):(o + 1) * (M // world_size)] = pref[j] + 0.01 * e
    return x, gy, w


def _gated_layer(rank, world_size, M, F, w, cfg, device):
    """A reference-backend top-2 layer (dropless) with rank-distinct experts and gate weight ``w``."""
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts
    torch.manual_seed(5)
    layer = UniEPMoE(M, MLP(M, F), num_experts=w.shape[0], ep_size=world_size, k=2, min_capacity=4, drop_tokens=False,
                     use_rts=False, top2_2nd_expert_sampling=False, config=cfg)
    distinct_experts(layer, rank)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(w)
    layer = layer.to(device)
    layer.set_deepspeed_parallelism()
    return layer


def _forward_against_plain(layers, x, gy, device, rank, what):
    """One forward+backward of every layer on ``x``; each layer's output, input gradient and parameter
    gradients match the ``"plain"`` layer's (1e-5)."""
    res = {}
    for name, layer in layers.items():
        xi = x.to(device).requires_grad_(True)
        out, l_aux, _ = layer(xi)
        ((out * gy.to(device)).sum() + l_aux).backward()
        res[name] = [out, xi.grad] + [p.grad for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
    for name in layers:
        for i, (a, b) in enumerate(zip(res["plain"], res[name])):
            assert _rel(b, a) <= 1e-5, f"rank {rank} {what}, {name} tensor {i}: relative error {_rel(b, a)}"


def _hottest(rank, world_size, device="cpu"):
    """migrated_experts "hottest": every rank's tokens prefer local experts 2 and 3 of each owner, so
    from the second forward on each rank migrates those two (first: 0 and 1), the same choice on
    every rank; the domain peer's tokens for them then stay on the sender (fewer rows sent away
    than with the first two migrated); outputs and every gradient match plain EP at each forward;
    with reuse_replicas the choice changes only at the first gather after an optimizer step."""
    L, M, T = 4, 16, 32
    x, gy, w = _hot_routing(rank, world_size, L, M, T, 100)
    layers = {}
    for name, hyb in (("plain", None), ("first", {"migrated_experts": "first"}),
                      ("hottest", {"migrated_experts": "hottest"}),
                      ("hottest reuse", {"migrated_experts": "hottest", "reuse_replicas": True})):
        cfg = {"backend": "reference"}
        if hyb is not None:
            cfg["hybrid"] = dict(hyb, enabled=True, domain_size=2, migrated_fraction=0.5)
        layers[name] = _gated_layer(rank, world_size, M, 24, w, cfg, device)
    sent = {}
    for name, layer in layers.items():
        h = layer._hybrid
        if h is None:
            continue
        orig = h.dispatcher.dispatch

        def counting(*a, _orig=orig, _name=name, **kw):
            out = _orig(*a, **kw)
            splits = out[2].send_splits
            sent[_name] = sum(splits) - splits[rank]  # rows this rank sent to other ranks
            return out
        h.dispatcher.dispatch = counting

    def forward(what):
        _forward_against_plain(layers, x, gy, device, rank, what)

    def chosen(name):
        h = layers[name]._hybrid
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, h.dispatcher.chosen)
        assert all(c == everyone[0] for c in everyone), f"rank {rank} {name}: ranks route differently {everyone}"
        assert h.chosen == h.dispatcher.chosen[rank]
        return h.chosen

    forward("forward 1")
    assert chosen("first") == chosen("hottest") == chosen("hottest reuse") == [0, 1]  # no tokens seen yet
    assert sent["hottest"] == sent["first"]
    forward("forward 2")
    assert chosen("first") == [0, 1] and chosen("hottest") == [2, 3], rank
    assert chosen("hottest reuse") == [0, 1], rank  # no optimizer step yet: the kept gather serves
    assert sent["hottest"] < sent["first"], (rank, sent)
    for layer in layers.values():
        _DataSGD(layer.parameters(), 0.0).step()  # a step (lr 0: the weights stay, the comparison holds)
    forward("forward 3, after an optimizer step")
    assert chosen("hottest reuse") == [2, 3], rank
    assert sent["hottest reuse"] == sent["hottest"] < sent["first"], (rank, sent)
    assert layers["hottest reuse"]._hybrid.counter["gathers"] == 2


def test_hottest_migration_chooses_the_experts_that_keep_tokens_local():
    run_distributed(_hottest, 4)


@needs_gpus(2)
def test_hottest_migration_over_nccl():
    run_distributed(_hottest, _nccl_ranks(), "cuda", backend="nccl")


def _replan(rank, world_size, device="cpu"):
    """replan_after_steps 1: every rank's tokens prefer experts 2 and 3 of each owner. Planned at
    start-up for uniform routing, the layer migrates every expert in one domain of 4; after one
    optimizer step its next forward plans again with the tokens per expert routed so far (all-gathered)
    and switches to the plan the cost model gives for that load (the test computes it from the gate's
    own top-2), migrating the hot experts; every rank chooses alike, and outputs and every gradient
    match plain EP before and after the switch."""
    from ds_uniep.config import UniEPConfig
    from ds_uniep.hybrid.model import plan, predict_routed
    from ds_uniep.hybrid.planning import planner_inputs
    from moe_models import MLP
    L, M, T, F, T_MAX = 4, 16, 32, 64, 1024
    E = L * world_size
    x, gy, w = _hot_routing(rank, world_size, L, M, T, 200)
    # Slow links (planner inputs only): the replan's measured compute (under 1 ms here) would have to
    # reach tens of milliseconds before the predicted gain of the partial migration fell under 5%.
    hyb = {"enabled": True, "domain_size": "auto", "site_size": 1, "intra_site_bandwidth": 4e11,
           "inter_site_bandwidth": 1.25e6, "replan_after_steps": 1}
    layers = {}
    # "kept": the same, but it switches only for a 99% predicted gain, so it keeps its start-up plan, and
    # it plans with the start-up plan's estimated compute.
    for name, h in (("plain", None), ("replan", hyb),
                    ("kept", dict(hyb, replan_min_gain=0.99, replan_compute="estimate"))):
        cfg = {"backend": "reference", "max_tokens_per_rank": T_MAX}
        if h is not None:
            cfg["hybrid"] = h
        layers[name] = _gated_layer(rank, world_size, M, F, w, cfg, device)
    replan = layers["replan"]

    def forward(what):
        _forward_against_plain(layers, x, gy, device, rank, what)

    start = (replan.hybrid_domain_size, replan.hybrid_migrated_experts)
    forward("forward 1")
    forward("forward 2, no optimizer step yet")
    assert (replan.hybrid_domain_size, replan.hybrid_migrated_experts) == start and replan.hybrid_replanned is None
    for layer in layers.values():
        _DataSGD(layer.parameters(), 0.0).step()  # a step (lr 0: the weights stay, the comparison holds)
    forward("forward 3, planned again")
    # What the cost model plans for the routing of forwards 1 and 2 (the gate's top-2, twice).
    counts = torch.bincount(torch.topk(x @ w.t(), 2, dim=1).indices.flatten(), minlength=E).double() * 2
    rows = [None] * world_size
    torch.distributed.all_gather_object(rows, counts.tolist())
    cfg = UniEPConfig.from_dict({"hybrid": hyb}).hybrid
    estimated = planner_inputs(cfg, world_size, MLP(M, F), M, 2, T_MAX, L, world_size)
    wl, cl, fractions, ratio, elsize = estimated
    uniform = plan(wl, cl, "auto", ratio, fractions, elsize)
    assert start == (uniform.domain_size, round(uniform.migrated_fraction * L)) == (world_size, L), start
    # The replan's compute: the experts' forward measured (the same number on every rank), the compute
    # before the router scaled from its estimate by the same ratio; the estimate where asked.
    got = replan.hybrid_replanned
    assert got["compute"] == "measure" and got["expert_compute_s"] > 0, got
    seen = [None] * world_size
    torch.distributed.all_gather_object(seen, (got["expert_compute_s"], got["pre_expert_compute_s"]))
    assert len(set(seen)) == 1, seen
    assert got["pre_expert_compute_s"] == pytest.approx(
        wl.pre_expert_compute_s * got["expert_compute_s"] / wl.expert_compute_s, rel=1e-12), got
    est = layers["kept"].hybrid_replanned
    assert (est["compute"], est["expert_compute_s"], est["pre_expert_compute_s"]) == (
        "estimate", wl.expert_compute_s, wl.pre_expert_compute_s), est
    est_want = plan(wl, cl, "auto", ratio, fractions, elsize, load=rows, migrated_experts="hottest")
    assert est["plan"] == (est_want.domain_size, round(est_want.migrated_fraction * L), est_want.migrated), est
    wl = dataclasses.replace(wl, expert_compute_s=got["expert_compute_s"],
                             pre_expert_compute_s=got["pre_expert_compute_s"])
    want = plan(wl, cl, "auto", ratio, fractions, elsize, load=rows, migrated_experts="hottest")
    m = round(want.migrated_fraction * L)
    assert want.domain_size > 1 and 0 < m < L, want  # the test's point: the skew changes the plan
    assert got["plan"] == (want.domain_size, m, want.migrated) and got["speedup"] == want.speedup, (rank, got)
    # Predicted gain over the start-up plan (all experts in one domain) for the same routing.
    now = predict_routed(wl, cl, rows, world_size, None, ratio, elsize).total_s
    assert got["switched"] and got["gain"] == pytest.approx(1 - want.hybrid.total_s / now) and got["gain"] > 0.05, got
    kept = layers["kept"]
    assert not kept.hybrid_replanned["switched"], kept.hybrid_replanned
    assert (kept.hybrid_domain_size, kept.hybrid_migrated_experts) == start
    assert (replan.hybrid_domain_size, replan.hybrid_migrated_experts) == (want.domain_size, m), rank
    h = replan._hybrid
    assert h.dispatcher.chosen == want.migrated and all(c == [2, 3][:m] for c in want.migrated), want.migrated
    assert h.chosen == want.migrated[rank]
    forward("forward 4")
    assert replan.hybrid_domain_size == want.domain_size and replan.hybrid.replan is None
    assert h.counter["gathers"] == 2, h.counter


def test_replan_after_steps_switches_to_the_plan_for_the_routing_seen():
    run_distributed(_replan, 4)


@needs_gpus(2)
def test_replan_after_steps_over_nccl():
    run_distributed(_replan, _nccl_ranks(), "cuda", backend="nccl")


def test_replan_after_steps_needs_an_automatic_domain_size():
    from ds_uniep.config import UniEPConfig
    with pytest.raises(ValueError, match="replan_after_steps 2 needs domain_size 'auto'"):
        UniEPConfig.from_dict({"hybrid": {"enabled": True, "domain_size": 2, "replan_after_steps": 2}})
    with pytest.raises(ValueError, match="replan_after_steps"):
        UniEPConfig.from_dict({"hybrid": {"enabled": True, "replan_after_steps": -1}})


def test_measured_expert_compute_times_the_experts_over_the_rows_given():
    """measure_expert_compute times the experts' forward (median after one untimed run, 3 runs or as many
    as fill min_seconds) over the rows split evenly among them; with_compute puts it in the planner's
    inputs and scales the compute before the router by the same ratio."""
    import time as _time

    from ds_uniep.config import UniEPConfig
    from ds_uniep.hybrid.planning import measure_expert_compute, planner_inputs, with_compute
    from moe_models import MLP

    class Slow(torch.nn.Module):
        """An expert that takes 20 ms per call plus 1 ms per row, and records the rows it saw."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.seen = []

        def forward(self, x):
            self.seen.append(x.shape[0])
            _time.sleep(0.02 + 0.001 * x.shape[0])
            return x * self.w

    experts = [Slow(), Slow(), Slow()]
    t = measure_expert_compute(experts, 10, 8, torch.float32, "cpu")
    assert [e.seen for e in experts] == [[4] * 4, [3] * 4, [3] * 4]  # one untimed run and 3 timed ones
    assert 0.07 <= t < 0.5, t  # three calls of 20 ms and 10 rows of 1 ms each
    with pytest.raises(ValueError, match="needs rows >= 1"):
        measure_expert_compute(experts, 0, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="repeats <= max_repeats"):
        measure_expert_compute(experts, 10, 8, torch.float32, "cpu", repeats=4, max_repeats=3)

    class Fast(torch.nn.Module):
        """An expert that takes 2 ms per call and counts its calls."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            _time.sleep(0.002)
            return x * self.w

    # A short forward is timed until the runs fill min_seconds (3 runs of >= 2 ms leave at most 44 ms:
    # at most 22 more), at most max_repeats in all; min_seconds 0 times it repeats times.
    fast = [Fast()]
    t = measure_expert_compute(fast, 4, 8, torch.float32, "cpu", min_seconds=0.05)
    timed = fast[0].calls - 1
    assert 3 < timed <= 25 and timed * t >= 0.04 and 0.002 <= t < 0.02, (timed, t)
    fast = [Fast()]
    measure_expert_compute(fast, 4, 8, torch.float32, "cpu", min_seconds=0.05, max_repeats=5)
    assert fast[0].calls == 1 + 5
    fast = [Fast()]
    measure_expert_compute(fast, 4, 8, torch.float32, "cpu", min_seconds=0)
    assert fast[0].calls == 1 + 3
    cfg = UniEPConfig.from_dict({"hybrid": {"enabled": True, "intra_site_bandwidth": 1e11,
                                            "inter_site_bandwidth": 1e9, "site_size": 1}}).hybrid
    inputs = planner_inputs(cfg, 2, MLP(8, 16), 8, 2, 64, 2, 2)
    wl, wl2 = inputs[0], with_compute(inputs, 2e-3)[0]
    assert wl2.expert_compute_s == 2e-3
    assert wl2.pre_expert_compute_s == pytest.approx(wl.pre_expert_compute_s * 2e-3 / wl.expert_compute_s)
    assert with_compute(inputs, 2e-3)[1:] == inputs[1:]
    with pytest.raises(ValueError, match="positive number of seconds"):
        with_compute(inputs, 0.0)


def _grouped_replicas(rank, world_size):
    """bf16 SwiGLU / GELU experts: the replicas run as grouped GEMMs (never one by one) and match plain EP."""
    from ds_uniep.experts import GeLUExpert, SwiGLUExpert
    from ds_uniep.hybrid import runtime

    def one_by_one(*args, **kwargs):
        raise AssertionError("replicas of recognised bf16 experts ran one by one")
    runtime.functional_call = one_by_one
    for make in (lambda: SwiGLUExpert(16, 24), lambda: GeLUExpert(16, 24)):
        for k, drop, fraction in ((1, False, 1.0), (2, True, 1.0), (4, False, 1.0), (2, False, 0.5)):
            plain, hybrid = _layer_pair(world_size, k, drop, torch.bfloat16, 2, rank, expert=make(),
                                        migrated_fraction=fraction)
            assert hybrid._hybrid.migrated == (1 if fraction < 1 else 2)
            res = _fwd_bwd_pair((plain, hybrid), rank, torch.bfloat16)
            where = (f"rank {rank} {type(plain.deepspeed_moe.experts.deepspeed_experts[0]).__name__} k={k} "
                     f"drop={drop} migrated fraction {fraction}")
            for a, b in zip(*res):
                assert _rel(b, a) <= 1e-2, f"{where}: relative error {_rel(b, a)}"
            assert hybrid._hybrid.counter["owner_reductions"] == 1, where


def test_hybrid_grouped_replicas_match_plain_ep():
    run_distributed(_grouped_replicas, 4)


def _compressed(rank, world_size, device="cpu"):
    """Compressed migration (domains of 2 ranks, 2 experts per rank): ratio 1 gives the
    dense gather's outputs and gradients bit for bit; at ratio 0.1 each other owner's replica holds
    that owner's weights at its kept positions and the shared base (the mean of the domain's
    experts) elsewhere, the same bits on both ranks of the domain, this rank's own copies exact;
    the bytes moved are the encoded tensors and the base all-reduce; a step trains."""
    from ds_uniep import UniEPMoE
    from ds_uniep.hybrid.compress import num_kept
    from moe_models import MLP, distinct_experts
    S, M, F, ratio = 2, 16, 24, 0.1
    layers = {}
    for name, comp in (("dense", None), ("ratio 1", 1.0), ("ratio", ratio)):
        torch.manual_seed(5)
        hyb = {"enabled": True, "domain_size": S}
        if comp is not None:
            hyb["compression"] = {"enabled": True, "ratio": comp}
        layer = UniEPMoE(M, MLP(M, F), num_experts=2 * world_size, ep_size=world_size, k=2, min_capacity=4,
                         drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                         config={"backend": "reference", "hybrid": hyb})
        distinct_experts(layer, rank)
        layer = layer.to(device)
        layer.set_deepspeed_parallelism()
        layers[name] = layer
    where = f"rank {rank} ({device})"
    dense, full = _fwd_bwd_pair((layers["dense"], layers["ratio 1"]), rank, torch.float32, device)
    for i, (a, b) in enumerate(zip(dense, full)):
        assert torch.equal(a, b), f"{where}: ratio 1 differs from the dense gather in tensor {i}"

    h = layers["ratio"]._hybrid
    h.prefetch()
    params = h.gather()  # [S * L] dicts, domain expert order (owner offset, then local index)
    gathered = h.last_gather()  # alive: the replicas' graph holds it
    experts = layers["ratio"].deepspeed_moe.experts.deepspeed_experts
    L, group, me = len(experts), h.groups.domain_group, h.groups.offset
    encoded = base_bytes = 0
    for name in h.names:
        mine = torch.stack([dict(e.named_parameters())[name].detach() for e in experts])  # [L, ...]
        true = [torch.empty_like(mine) for _ in range(S)]
        torch.distributed.all_gather(true, mine, group=group)
        true = torch.stack(true).reshape(S, L, -1)
        reps = torch.stack([params[s * L + l][name].detach() for s in range(S) for l in range(L)]).reshape(S, L, -1)
        mean = true.reshape(S * L, -1).double().mean(0)
        base = gathered.bases[h.names.index(name)].reshape(-1)
        torch.testing.assert_close(base.double(), mean, rtol=1e-6, atol=1e-6, msg=f"{where} {name}: base not the mean")
        bases = [torch.empty_like(base) for _ in range(S)]
        torch.distributed.all_gather(bases, base, group=group)
        assert all(torch.equal(b, base) for b in bases), f"{where} {name}: the base differs across the domain"
        n, k = true.shape[-1], num_kept(true.shape[-1], ratio)
        for s in range(S):
            for l in range(L):
                r, w = reps[s, l], true[s, l]
                if s == me:
                    assert torch.equal(r, w), f"{where} {name}: own expert {l} not exact"
                    continue
                kept = r == w
                # k positions kept (more only where the weight happens to equal the base)
                assert k <= int(kept.sum()) <= k + int((w == base).sum()), \
                    f"{where} {name} owner {s} expert {l}: {int(kept.sum())} exact positions, {k} kept"
                assert torch.equal(r[~kept], base[~kept]), f"{where} {name} owner {s} expert {l}: not the base"
                # Every dropped residual is at most the smallest kept one.
                res = (w.double() - mean).abs()
                order = torch.sort(res, descending=True, stable=True).indices
                assert res[~kept].max() <= res[order[k - 1]] + 1e-6, f"{where} {name}: a larger residual dropped"
        encoded += L * k * (4 + 4)
        base_bytes += n * 4
    want = (S - 1) * (encoded + 2 * base_bytes // S)
    assert gathered.wire_bytes == h.last_wire_bytes == want, (gathered.wire_bytes, want)
    assert layers["dense"]._hybrid.last_wire_bytes == (S - 1) * L * sum(p.numel() * 4 for p in experts[0].parameters())

    # A step: gradients reach the owners once, finite.
    layer = layers["ratio"]
    layer.zero_grad()
    x = torch.randn(24, M, generator=torch.Generator().manual_seed(rank)).to(device)
    out, l_aux, _ = layer(x)
    (out.square().sum() + l_aux).backward()
    assert h.counter["owner_reductions"] == 1
    for p in layer.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()


def test_compressed_migration_moves_encoded_experts_and_gives_their_numbers():
    run_distributed(_compressed, 4)


def _nccl_ranks() -> int:
    """4 ranks (2 domains of 2) where 4 GPUs are present, else 2 (one domain)."""
    return 4 if cuda_gpus() >= 4 else 2


@needs_gpus(2)
def test_compressed_migration_over_nccl():
    """The same checks with the layers on GPUs and the collectives over NCCL."""
    run_distributed(_compressed, _nccl_ranks(), "cuda", backend="nccl")


class _DataSGD(torch.optim.Optimizer):
    """SGD writing through ``.data``, as DeepSpeed's ZeRO updates land in flat buffers: the parameters'
    version counters do not move, so only the optimizer step hook tells that the weights changed."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _reuse(rank, world_size, device="cpu"):
    """``reuse_replicas``: the forwards between optimizer steps reuse one gather and give the bits of
    gathering at every forward (outputs, input and parameter gradients, accumulated over the
    micro-batches), dense and compressed; an optimizer step that writes through ``.data``, an in-place
    change of a parameter and ``refresh_replicas()`` each make the next forward gather again, on
    every rank of the domain when one rank sees the change (the ranks vote); a change through
    ``.data`` alone is not seen (as documented)."""
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts
    for ratio in (None, 0.25):
        layers = []
        for reuse in (False, True):
            torch.manual_seed(5)
            hyb = {"enabled": True, "domain_size": 2, "reuse_replicas": reuse}
            if ratio is not None:
                hyb["compression"] = {"enabled": True, "ratio": ratio}
            layer = UniEPMoE(16, MLP(16, 24), num_experts=2 * world_size, ep_size=world_size, k=2, min_capacity=4,
                             drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                             config={"backend": "reference", "hybrid": hyb})
            distinct_experts(layer, rank)
            layer = layer.to(device)
            layer.set_deepspeed_parallelism()
            layers.append(layer)
        every, kept = layers
        counter = kept._hybrid.counter
        seen = [0]

        def micro_batches(n, what, same=True):
            for _ in range(n):
                seen[0] += 1
                res = _fwd_bwd_pair(layers, 100 * rank + seen[0], torch.float32, device)
                equal = all(torch.equal(a, b) for a, b in zip(*res))
                assert equal == same, f"rank {rank} ratio {ratio} {what}, forward {seen[0]}: " \
                                      f"{'differs from' if same else 'equals'} gathering every forward"

        def expect(gathers, reuses):
            got = (counter.get("gathers"), counter.get("reuses"), counter.get("owner_reductions"))
            assert got == (gathers, reuses, seen[0]), f"rank {rank} ratio {ratio}: (gathers, reuses, " \
                                                     f"returns) {got}, expected {(gathers, reuses, seen[0])}"

        micro_batches(3, "three micro-batches")
        expect(1, 2)
        assert every._hybrid.counter["gathers"] == 3
        for layer in layers:
            _DataSGD(layer.parameters(), 0.05).step()
        micro_batches(2, "after an optimizer step through .data")
        expect(2, 3)
        with torch.no_grad():
            for layer in layers:
                next(layer.deepspeed_moe.experts.parameters()).mul_(1.5)
        micro_batches(1, "after an in-place change")
        expect(3, 3)
        with torch.no_grad():
            for layer in layers:
                next(layer.deepspeed_moe.experts.parameters()).data.mul_(0.5)
        micro_batches(1, "after a change through .data alone", same=False)  # the kept replicas are stale
        expect(3, 4)
        for layer in layers:
            layer.zero_grad(set_to_none=True)  # the stale forward's gradients differ too
        if rank % 2 == 0:  # one rank of each domain: the domain's ranks agree to gather together
            kept.refresh_replicas()
        micro_batches(2, "after refresh_replicas() on one rank of the domain")
        expect(4, 5)
        if rank == 1:  # one rank's in-place change makes its whole domain gather; the other domain reuses
            with torch.no_grad():
                for layer in layers:
                    next(layer.deepspeed_moe.experts.parameters()).mul_(1.0)
        micro_batches(1, "after an in-place change on one rank")
        if rank < 2:
            expect(5, 5)
        else:
            expect(4, 6)


def test_reused_replicas_give_the_bits_of_gathering_every_forward():
    run_distributed(_reuse, 4)


@needs_gpus(2)
def test_reused_replicas_over_nccl():
    run_distributed(_reuse, _nccl_ranks(), "cuda", backend="nccl")


def test_auto_domain_size_charges_compressed_bytes():
    from ds_uniep.config import UniEPConfig
    from ds_uniep.hybrid.planning import choose_domain_size
    from moe_models import MLP
    plans = {}
    for enabled in (False, True):  # small experts, many tokens, slow links: migration pays either way
        cfg = UniEPConfig.from_dict({"hybrid": {"enabled": True, "site_size": 1, "intra_site_bandwidth": 4e11,
                                                "inter_site_bandwidth": 1.25e6,
                                                "compression": {"enabled": enabled, "ratio": 0.05}}}).hybrid
        S, plans[enabled] = choose_domain_size(cfg, 4, MLP(16, 24), 16, 2, 4096, 2, 4)
        assert S > 1, enabled
    assert plans[False].compression_ratio is None and plans[True].compression_ratio == 0.05
    # The same layer and links: the plan charges the compressed gather's bytes.
    assert 0 < plans[True].hybrid.gather_bytes_inter < plans[False].hybrid.gather_bytes_inter


class _Net(torch.nn.Module):

    def __init__(self, world_size, rank, cfg, k, drop):
        from ds_uniep import UniEPMoE
        from moe_models import MLP
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.moe = UniEPMoE(16, MLP(16, 24), num_experts=2 * world_size, ep_size=world_size, k=k, min_capacity=4,
                            drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False, config=cfg)
        self.out = torch.nn.Linear(16, 1)
        with torch.no_grad():  # distinct experts per rank
            for p in self.moe.deepspeed_moe.experts.parameters():
                p.add_(0.1 * rank)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h).squeeze(-1), l_aux


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, generator=g)


def _cfg(hybrid):
    cfg = {"backend": "reference"}
    if hybrid:
        cfg["hybrid"] = {"enabled": True, "domain_size": 2}
    return cfg


# HybridEP's weights may differ from plain EP's by this multiple of fp32 plain EP's own error (against fp64).
ROUNDING_MULTIPLE = 10


def _hundred_steps(rank, world_size, steps):
    """Plain EP and HybridEP side by side for ``steps`` AdamW steps; weights must agree to rounding.

    HybridEP adds in another order than plain EP, so after many steps their weights differ by
    rounding, propagated by the training. The scale of that is measured, not assumed: a third net,
    plain EP in fp64, gives each parameter's fp32 error (relative, the largest over the ranks;
    at least fp32's epsilon), and HybridEP may differ from fp32 plain EP by ``ROUNDING_MULTIPLE``
    times it. A gradient lost, doubled or mixed up with another, even by a part in a hundred, moves
    the weights by more."""
    for k, drop in CASES:
        nets, opts = [], []
        for hybrid, dtype in ((False, torch.float32), (True, torch.float32), (False, torch.float64)):
            net = _Net(world_size, rank, _cfg(hybrid), k, drop)
            if dtype != torch.float32:
                net = net.to(dtype)
            net.moe.set_deepspeed_parallelism()
            nets.append(net)
            opts.append(torch.optim.AdamW(net.parameters(), lr=1e-3))
        for step in range(steps):
            x, y = _batch(step, rank)
            for net, opt in zip(nets, opts):
                dtype = net.out.weight.dtype
                opt.zero_grad()
                pred, l_aux = net(x.to(dtype))
                (((pred - y.to(dtype))**2).mean() + 0.01 * l_aux).backward()
                opt.step()
        assert nets[1].moe._hybrid.counter["owner_reductions"] == steps
        plain, hybrid, exact = (dict(net.named_parameters()) for net in nets)
        rounding = torch.tensor([_rel(plain[n], exact[n], torch.float64) for n in plain], dtype=torch.float64)
        torch.distributed.all_reduce(rounding, op=torch.distributed.ReduceOp.MAX)
        # fp32 must track fp64 closely, or the bound below would let real differences through.
        assert rounding.max() < 1e-4, f"k={k} drop={drop}: fp32 plain EP is {rounding.max()} from fp64"
        for n, r in zip(plain, rounding.clamp_min(torch.finfo(torch.float32).eps).tolist()):
            err = _rel(hybrid[n], plain[n])
            assert err <= ROUNDING_MULTIPLE * r, \
                f"rank {rank} k={k} drop={drop} {n}: {err} > {ROUNDING_MULTIPLE} x {r} (fp32 vs fp64 plain EP)"


def test_hybrid_weights_match_plain_ep_after_100_steps():
    run_distributed(_hundred_steps, 4, 100)


def _zero_counts(rank, world_size, steps):
    """Under ZeRO-1 and 2, every expert parameter gets exactly one gradient per step."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    for stage in (1, 2):
        weights = []
        for hybrid in (False, True):
            model = _Net(world_size, rank, _cfg(hybrid), 2, True)
            names = [n for n, _ in model.moe.deepspeed_moe.experts.named_parameters()]
            arrivals = dict.fromkeys(names, 0)
            for n, p in model.moe.deepspeed_moe.experts.named_parameters():
                p.register_hook(lambda g, n=n: arrivals.__setitem__(n, arrivals[n] + 1))
            groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                            "name": "params"})
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3),
                config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                        "zero_allow_untested_optimizer": True})
            for step in range(steps):
                x, y = _batch(step, rank)
                pred, l_aux = engine(x)
                engine.backward(((pred - y)**2).mean() + 0.01 * l_aux)
                engine.step()
            assert names and arrivals == dict.fromkeys(names, steps), (stage, hybrid, arrivals, steps)
            if hybrid:
                assert model.moe._hybrid.counter["owner_reductions"] == steps
            weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
        for n in weights[0]:
            assert _rel(weights[1][n], weights[0][n]) <= 1e-5, f"stage {stage} {n}"


def test_hybrid_under_zero_1_and_2_reduces_each_replica_gradient_once():
    run_distributed(_zero_counts, 4, 5)


def _zero_reuse(rank, world_size, steps, micro, device="cpu"):
    """Under ZeRO-1 and 2 with gradient accumulation, kept replicas are gathered once per optimizer
    step (DeepSpeed's optimizer runs torch's step hooks) and their gradients return once, at the
    step's last micro-batch (the engine's boundary; zeros before it), and the weights after training
    match gathering and returning at every micro-batch."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    for stage in (1, 2):
        weights = []
        for reuse in (False, True):
            cfg = {"backend": "reference", "hybrid": {"enabled": True, "domain_size": 2, "reuse_replicas": reuse}}
            model = _Net(world_size, rank, cfg, 2, False).to(device)
            names = [n for n, _ in model.moe.deepspeed_moe.experts.named_parameters()]
            arrivals = dict.fromkeys(names, 0)
            for n, p in model.moe.deepspeed_moe.experts.named_parameters():
                p.register_hook(lambda g, n=n: arrivals.__setitem__(n, arrivals[n] + (g is not None)))
            groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                            "name": "params"})
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2),
                config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": micro,
                        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True})
            h = model.moe._hybrid
            for step in range(steps * micro):
                x, y = (t.to(device) for t in _batch(step, rank))
                pred, l_aux = engine(x)
                engine.backward(((pred - y)**2).mean() + 0.01 * l_aux)
                last = (step + 1) % micro == 0
                if reuse:  # held until the step's last micro-batch, then returned
                    assert h.held.count == (0 if last else (step % micro) + 1), (stage, step, h.held.count)
                    assert (h.held.sums is None) == last, (stage, step)
                engine.step()
            per_step = steps if reuse else steps * micro
            got = (h.counter["gathers"], h.counter["owner_reductions"])
            assert got == (per_step, per_step), (stage, reuse, h.counter)
            # One gradient per micro-batch either way (zeros while held), which ZeRO-2's hooks reduce.
            assert names and arrivals == dict.fromkeys(names, steps * micro), (stage, reuse, arrivals)
            weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
        for n in weights[0]:
            err = _rel(weights[1][n], weights[0][n])
            assert err <= 1e-5, f"rank {rank} stage {stage} {n}: {err}"


def _held_then_changed(rank, world_size):
    """Replica gradients held for a boundary that never came, then new weights: an error naming the
    layer, not gradients silently lost or sent against the wrong replicas."""
    from ds_uniep import UniEPMoE
    from ds_uniep.hybrid.runtime import HeldGradients
    from moe_models import MLP
    layer = UniEPMoE(16, MLP(16, 24), num_experts=2 * world_size, ep_size=world_size, k=2,
                     config={"backend": "reference", "hybrid": {"enabled": True, "domain_size": 2,
                                                                "reuse_replicas": True}})
    layer.set_deepspeed_parallelism()
    layer._hybrid.held = HeldGradients(lambda: False)  # as an engine in the middle of a step
    out, l_aux, _ = layer(torch.randn(8, 16))
    (out.sum() + l_aux).backward()
    assert layer._hybrid.held.count == 1 and "owner_reductions" not in layer._hybrid.counter
    layer.refresh_replicas()
    said = re.escape(layer.layer_name) + ": the expert weights changed .* 1 micro-batch"
    with pytest.raises(RuntimeError, match=said):
        layer(torch.randn(8, 16))


def _own_loop_boundary(rank, world_size, steps=2, micro=3):
    """A training loop without an engine marks the step's last micro-batch itself
    (``set_accumulation_boundary``): one gather and one gradient return per step, the same outputs
    bit for bit and the same gradients (to fp32 rounding) as migrating at every micro-batch."""
    from ds_uniep import UniEPMoE
    from moe_models import MLP, distinct_experts
    last = [False]
    layers = []
    for reuse in (False, True):
        torch.manual_seed(5)
        layer = UniEPMoE(16, MLP(16, 24), num_experts=2 * world_size, ep_size=world_size, k=2, min_capacity=4,
                         drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                         config={"backend": "reference", "hybrid": {"enabled": True, "domain_size": 2,
                                                                    "reuse_replicas": reuse}})
        distinct_experts(layer, rank)
        if reuse:
            layer.set_accumulation_boundary(lambda: last[0])  # before set_deepspeed_parallelism: kept
        layer.set_deepspeed_parallelism()
        layers.append(layer)
    opts = [torch.optim.SGD(layer.parameters(), lr=0.05) for layer in layers]
    for step in range(steps):
        for mb in range(micro):
            last[0] = mb == micro - 1
            outs = []
            for layer in layers:
                x = torch.randn(24, 16, generator=torch.Generator().manual_seed(100 * rank + 10 * step + mb))
                out, l_aux, _ = layer(x)
                (out.square().sum() + l_aux).backward()
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), f"rank {rank} step {step} micro-batch {mb}"
        for (n, a), b in zip(layers[0].named_parameters(), layers[1].parameters()):
            assert _rel(b.grad, a.grad) <= 1e-6, f"rank {rank} step {step} {n}: {_rel(b.grad, a.grad)}"
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # the same weights again (the gradients' rounding differed)
            for a, b in zip(layers[0].parameters(), layers[1].parameters()):
                b.copy_(a)
    h = layers[1]._hybrid
    assert (h.counter["gathers"], h.counter["owner_reductions"]) == (steps, steps), h.counter
    assert layers[0]._hybrid.counter["owner_reductions"] == steps * micro


def test_a_loop_without_an_engine_marks_the_accumulation_boundary():
    run_distributed(_own_loop_boundary, 4)


def test_weights_changed_while_gradients_are_held_is_an_error():
    run_distributed(_held_then_changed, 2)


def test_reused_replicas_under_zero_1_and_2_with_gradient_accumulation():
    run_distributed(_zero_reuse, 4, 3, 2)


@needs_gpus(2)
def test_reused_replicas_under_zero_1_and_2_over_nccl():
    run_distributed(_zero_reuse, _nccl_ranks(), 3, 2, "cuda", backend="nccl")


def _auto_domain(rank, world_size):
    from ds_uniep import UniEPMoE
    from moe_models import MLP
    chosen = {}
    # Same 10 Mbps links between sites of one rank; what differs is what migration moves.
    for name, ffn, tokens in (("small experts, many tokens", 24, 4096), ("big experts, one token", 8192, 1)):
        cfg = {"backend": "reference", "max_tokens_per_rank": tokens,
               "hybrid": {"enabled": True, "domain_size": "auto", "site_size": 1, "intra_site_bandwidth": 4e11,
                          "inter_site_bandwidth": 1.25e6}}
        layer = UniEPMoE(16, MLP(16, ffn), num_experts=2 * world_size, ep_size=world_size, k=2, config=cfg)
        layer.set_deepspeed_parallelism()
        chosen[name] = layer.hybrid_domain_size
        assert (layer._hybrid is None) == (chosen[name] == 1)
    # Gathering 3 KiB experts beats sending 512 KiB of tokens; 1 MiB experts for 128 bytes of tokens do not.
    assert chosen["small experts, many tokens"] > 1 and chosen["big experts, one token"] == 1, chosen


def test_auto_domain_size_follows_the_planner():
    run_distributed(_auto_domain, 4)


def _auto_fraction(rank, world_size):
    """domain_size and migrated_fraction auto: where gathering half of each rank's experts hides behind
    the pre-expert compute and the rest would not pay, the planner migrates 2 of 4 (a fraction the
    runtime builds); told to migrate all of them, it keeps plain EP; the layer runs either way."""
    from ds_uniep import UniEPMoE
    from moe_models import MLP
    chosen = {}
    for fraction in ("auto", 1.0):
        cfg = {"backend": "reference", "max_tokens_per_rank": 1024,
               "hybrid": {"enabled": True, "site_size": 1, "intra_site_bandwidth": 4e12,
                          "inter_site_bandwidth": 4e11, "migrated_fraction": fraction}}
        layer = UniEPMoE(256, MLP(256, 256), num_experts=4 * world_size, ep_size=world_size, k=2, config=cfg)
        layer.set_deepspeed_parallelism()
        chosen[fraction] = (layer.hybrid_domain_size, layer.hybrid_migrated_experts)
        out, _, _ = layer(torch.randn(8, 256))
        assert out.shape == (8, 256)
    assert chosen == {"auto": (2, 2), 1.0: (1, 0)}, chosen


def test_auto_migrated_fraction_moves_whole_experts_the_planner_chooses():
    run_distributed(_auto_fraction, 4)


def _auto_domain_reuse(rank, world_size):
    """With reused replicas under an engine of 8 micro-batches per step, the planner charges one gather
    per 8 forwards: experts it keeps local when every forward gathers are migrated."""
    import deepspeed
    from ds_uniep import UniEPMoE
    from moe_models import MLP
    chosen = {}
    for reuse in (False, True):
        cfg = {"backend": "reference", "max_tokens_per_rank": 1024,
               "hybrid": {"enabled": True, "domain_size": "auto", "site_size": 1, "intra_site_bandwidth": 4e11,
                          "inter_site_bandwidth": 1.25e6, "reuse_replicas": reuse}}
        model = torch.nn.Sequential()
        model.moe = UniEPMoE(16, MLP(16, 256), num_experts=2 * world_size, ep_size=world_size, k=2, config=cfg)
        deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                  "gradient_accumulation_steps": 8})
        chosen[reuse] = model.moe.hybrid_domain_size
    assert chosen == {False: 1, True: 4}, chosen


def test_auto_domain_size_with_reused_replicas_counts_the_micro_batches():
    run_distributed(_auto_domain_reuse, 4)


def _measured(rank, world_size):
    import deepspeed.comm as dist
    from ds_uniep import UniEPMoE
    from ds_uniep.hybrid.planning import measure_bandwidths
    from moe_models import MLP
    layer = UniEPMoE(16, MLP(16, 24), num_experts=2 * world_size, ep_size=world_size, k=2,
                     config={"backend": "reference", "max_tokens_per_rank": 64,
                             "hybrid": {"enabled": True, "site_size": 2}})  # domain_size auto, bandwidths measured
    layer.set_deepspeed_parallelism()
    intra, inter = measure_bandwidths(layer.ep_group, 2, nbytes=1 << 20, repeats=2)
    assert 0 < intra < float("inf") and 0 < inter < float("inf")
    # Every rank must plan the same domains, or the groups would not match.
    sizes = [None] * world_size
    dist.all_gather_object(sizes, (layer.hybrid_domain_size, intra, inter))
    assert len(set(sizes)) == 1, sizes
    x = torch.randn(8, 16)
    out, _, _ = layer(x)
    assert out.shape == x.shape


def test_auto_domain_size_with_measured_bandwidths_is_the_same_on_every_rank():
    run_distributed(_measured, 4)


def _pipelined_asked(rank, world_size):
    import logging

    from ds_uniep import UniEPMoE
    from ds_uniep.env import logger
    from moe_models import MLP, distinct_experts
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        outs = []
        for overlap in ({}, {"schedule": "pipelined", "num_chunks": 2}):
            torch.manual_seed(5)
            layer = UniEPMoE(16, MLP(16, 24), num_experts=2 * world_size, ep_size=world_size, k=2, min_capacity=4,
                             drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                             config={"backend": "reference", "hybrid": {"enabled": True, "domain_size": 2},
                                     "overlap": overlap})
            distinct_experts(layer, rank)
            layer.set_deepspeed_parallelism()
            outs.append(_fwd_bwd_pair([layer], rank, torch.float32)[0])
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "pipelined schedule cannot run here" in r.getMessage()]
    assert len(said) == 1 and "HybridEP moves tokens on the reference transport" in said[0], said
    for i, (a, b) in enumerate(zip(*outs)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"rank {rank}: tensor {i} differs"


def test_pipelined_schedule_asked_with_hybrid_ep_says_why_and_runs_the_sequential_one():
    run_distributed(_pipelined_asked, 4)
