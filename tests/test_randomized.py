"""Randomized differential test: ``UniEPMoE`` against a pure-torch MoE over many drawn cases.

Cases come from a fixed seed list through ``randomized_cases.draw_case`` (per-rank token counts
0, 1, ``max_tokens_per_rank`` and between, k from 1 to min(8, E), hidden sizes that are no multiple
of 128, fp32 and bf16, uniform and skewed routing, dropless and token dropping). Each case runs one
forward and backward of the layer on every rank and compares, on every rank, the output, l_aux,
exp_counts (exactly), the input gradient and every parameter gradient with
``randomized_cases.reference_moe``, the layer written out in plain torch over all ranks' tokens in
one process and routed by the layer's own DeepSpeed gate.

Tolerances: fp32 against the fp32 reference, tight; bf16 as flash-attention checks its kernels: the
layer's largest error against the fp64 reference may be at most twice the bf16 reference's own; a
bf16 parameter gradient that misses that may instead keep its relative Frobenius error within twice
the bf16 reference's and 1e-2. One bf16 reference is one draw of where rounding lands, and a result
with few terms (a rank with one token) or with cancellation (the gate's gradient) spreads widely: a
bf16 result that misses both may instead lie within twice the farthest of eight draws of the fp64
reference under a rounding model (every expert projection and activation, forward and backward, off
by a random relative error of at most bf16's unit roundoff: ``randomized_cases.rounding_model``).

The CPU part runs the reference backend over gloo at 2 and 4 ranks (all cases of a world size in
one spawn of ranks). The GPU part runs the megakernel backend over NCCL at ep 2 and 4 under every
schedule of ``randomized_cases.SCHEDULES`` and prints a one-line summary per world size.
"""
import logging
import time
from collections import Counter

import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from randomized_cases import SCHEDULES, Case, draw_case, expert_class, reference_pair, rounding_draws

CPU_SEEDS = {2: range(50), 4: range(20)}
GPU_SEEDS_PER_SCHEDULE = 14  # 4 schedules: 56 cases per world size


def cpu_cases(world_size):
    return [draw_case(seed, world_size) for seed in CPU_SEEDS[world_size]]


def gpu_cases(world_size):
    return [draw_case(seed, world_size, schedule) for schedule in SCHEDULES for seed in range(GPU_SEEDS_PER_SCHEDULE)]


# ---------------------------------------------------------------------------- one case on one rank
def build_layer(case: Case, device):
    """The case's layer on this rank: the case's gate weight (fp32) and, for local expert l, the
    weights of global expert ``rank * L + l``, in the case's dtype."""
    import deepspeed.comm as dist
    from ds_uniep import UniEPMoE
    from randomized_cases import case_experts, case_gate_weight

    config = {"backend": "reference", "max_tokens_per_rank": case.max_tokens}
    if case.schedule is not None:
        overlap = dict(SCHEDULES[case.schedule], timeout_s=30.0)
        config.update(backend="megakernel", overlap=overlap,
                      expert_gemm="uniep" if overlap["schedule"] == "fused" else "torch")
    layer = UniEPMoE(case.hidden, expert_class(case)(case.hidden, case.ffn), num_experts=case.num_experts,
                     ep_size=case.world_size, k=case.k, capacity_factor=case.capacity_factor, min_capacity=0,
                     drop_tokens=case.drop_tokens, use_rts=False, top2_2nd_expert_sampling=False, config=config)
    rank, L = dist.get_rank(), case.num_experts // case.world_size
    experts = case_experts(case)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(case_gate_weight(case))
        for l, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            expert.load_state_dict(experts[rank * L + l].state_dict())
    layer = layer.to(device=device, dtype=case.torch_dtype)
    layer.deepspeed_moe.gate.wg.float()
    layer.set_deepspeed_parallelism()
    return layer


def run_layer(layer, case: Case, rank: int, device):
    """One forward and backward: ``(out, l_aux, exp_counts, x.grad, {parameter name: grad})``."""
    from randomized_cases import AUX_COEF, case_inputs
    x, gy = (t.to(device) for t in case_inputs(case, rank))
    x.requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    out, l_aux, exp_counts = layer(x)
    torch.autograd.backward([out, l_aux], [gy, torch.full_like(l_aux, AUX_COEF)])
    return out.detach(), l_aux.detach(), exp_counts, x.grad, {n: p.grad for n, p in layer.named_parameters()}


class Mismatch(AssertionError):
    pass


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _rel(a, b):
    n = b.double().norm().item()
    return (a.double() - b.double()).norm().item() / n if n else (a.double().norm().item() > 0) * 1.0


def compare(what: str, got, low, high, dtype, where: str, gradient: bool = False, draws=None) -> float:
    """``got`` (the layer's) against the reference at the case's precision (``low``) and at fp64
    (``high``); None: no gradient reached it, taken as zeros. ``draws()``: the same result under the
    rounding model's draws (``randomized_cases.rounding_draws``). Returns the error ratio the check bounds."""
    got = torch.zeros_like(low) if got is None else got
    if got.shape != low.shape or got.dtype != low.dtype:
        raise Mismatch(f"{where}: {what} is {tuple(got.shape)} {got.dtype}, the reference {tuple(low.shape)} "
                       f"{low.dtype}")
    if not torch.isfinite(got).all():
        raise Mismatch(f"{where}: {what} holds non-finite values")
    scale = max(high.abs().max().item() if high.numel() else 0.0, 1e-30)
    err = _max_err(got, high)
    if dtype == torch.float32:  # tight: what fp32 rounding in another summation order gives
        bound = 1e-5 * scale
    else:  # flash-attention's rule: at most twice the bf16 reference's own error (a floor for exact ones)
        bound = 2.0 * _max_err(low, high) + 1e-6 * scale
    if err > bound and gradient and dtype != torch.float32:
        # A parameter gradient sums many rows whose bf16 products the layer rounds at other points
        # than the reference, and the gate's cancels: the norm rule the megakernel's own tests use
        # (relative Frobenius error within twice the bf16 reference's, and at most 1e-2).
        rel = _rel(got, high)
        if rel <= max(2.0 * _rel(low, high), 1e-2):
            return rel / max(2.0 * _rel(low, high), 1e-2)
    if err > bound and dtype != torch.float32 and draws is not None:
        # One bf16 reference is one draw of where rounding lands; with few terms (a rank with one
        # token) or cancellation (the gate's gradient) the layer's own draw can land twice as far.
        # Bound by the spread of the rounding model's draws instead: twice the farthest of them.
        spread = max(_max_err(torch.zeros_like(high) if d is None else d, high) for d in draws())
        if err <= 2.0 * spread + 1e-6 * scale:
            return err / (2.0 * spread + 1e-6 * scale)
        bound = max(bound, 2.0 * spread + 1e-6 * scale)
    if err > bound:
        worst = (got.double() - high.double()).abs().argmax().item()
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))
        raise Mismatch(f"{where}: {what} off by {err:.3e} from the fp64 reference (bound {bound:.3e}, largest "
                       f"reference value {scale:.3e}; the {dtype} reference's own error {_max_err(low, high):.3e}) "
                       f"at {idx}: got {got[idx].item():.6g}, fp64 reference {high[idx].item():.6g}")
    return err / bound if bound else 0.0


def check_case(case: Case, rank: int, device) -> None:
    """Run the case on this rank and compare everything with the reference (raises Mismatch)."""
    layer = build_layer(case, device)
    out, l_aux, counts, x_grad, grads = run_layer(layer, case, rank, device)
    ref, hi = reference_pair(layer.deepspeed_moe.gate, case, device, rank)
    where = f"rank {rank} [{case.label()}]"
    cached = []

    def draws(pick):  # pick(reference) -> the compared result, under each draw of the rounding model
        if not cached:
            cached.extend(rounding_draws(layer.deepspeed_moe.gate, case, device, rank))
        return lambda: [pick(d) for d in cached]

    if case.schedule is not None and layer.backend_name(device) != "megakernel":
        raise Mismatch(f"{where}: ran on the {layer.backend_name(device)} backend")
    # exp_counts: exactly the gate's (before any dropping), and for a dropless layer the routes' histogram
    if not torch.equal(counts.cpu().long(), ref.exp_counts[rank].cpu().long()):
        raise Mismatch(f"{where}: exp_counts {counts.tolist()} != reference {ref.exp_counts[rank].tolist()}")
    if not case.drop_tokens:
        idx = ref.expert_idx[rank]
        hist = torch.bincount(idx[idx >= 0].cpu(), minlength=case.num_experts)
        if not torch.equal(hist, ref.exp_counts[rank].cpu().long()):
            raise Mismatch(f"{where}: the reference's routes {hist.tolist()} and counts disagree")
    if not torch.allclose(l_aux, ref.l_aux[rank], rtol=1e-6, atol=1e-7, equal_nan=True):  # (NaN without tokens)
        raise Mismatch(f"{where}: l_aux {l_aux.item()} != reference {ref.l_aux[rank].item()}")
    dtype = case.torch_dtype
    compare("output", out, ref.out[rank], hi.out[rank], dtype, where, draws=draws(lambda d: d.out[rank]))
    compare("input gradient", x_grad, ref.x_grad[rank], hi.x_grad[rank], dtype, where,
            draws=draws(lambda d: d.x_grad[rank]))
    L = case.num_experts // case.world_size
    for name, grad in grads.items():
        parts = name.split(".")
        if name == "deepspeed_moe.gate.wg.weight":
            low, high = ref.gate_grad, hi.gate_grad
            pick = lambda d: d.gate_grad  # noqa: E731
            shape_of = layer.deepspeed_moe.gate.wg.weight
            low = torch.zeros_like(shape_of) if low is None else low
            high = torch.zeros_like(shape_of, dtype=torch.float64) if high is None else high
        elif parts[:3] == ["deepspeed_moe", "experts", "deepspeed_experts"]:
            e = rank * L + int(parts[3])
            pnames = [n for n, _ in expert_class(case)(1, 1).named_parameters()]
            i = pnames.index(".".join(parts[4:]))
            low, high = ref.expert_grads[e][i], hi.expert_grads[e][i]
            pick = lambda d, e=e, i=i: d.expert_grads[e][i]  # noqa: E731
            p = dict(layer.named_parameters())[name]
            low = torch.zeros_like(p) if low is None else low
            high = torch.zeros_like(p, dtype=torch.float64) if high is None else high
        else:
            raise Mismatch(f"{where}: parameter {name} has no counterpart in the reference")
        compare(f"gradient of {name}", grad, low, high, dtype, where, gradient=True, draws=draws(pick))


def run_cases(rank, world_size, cases, device_kind, report=None):
    """Every case on this rank, each in its own layer; the mismatches of all cases are raised
    together at the end (a case's collectives are complete before its comparisons)."""
    device = rank_gpu(rank) if device_kind == "cuda" else torch.device("cpu")
    cannot = _CannotRun()
    logging.getLogger("ds_uniep").addHandler(cannot)
    failures = []
    start = time.monotonic()
    for case in cases:
        try:
            check_case(case, rank, device)
        except Mismatch as e:
            failures.append(str(e))
        if cannot.said:
            failures.append(f"rank {rank} [{case.label()}]: {cannot.said.pop()}")
            cannot.said.clear()
    if failures:
        raise AssertionError(f"{len(failures)} of {len(cases)} cases failed on rank {rank}:\n" + "\n".join(failures))
    if report is not None and rank == 0:
        with open(report, "w") as f:
            f.write(f"{time.monotonic() - start:.1f}")


class _CannotRun(logging.Handler):
    """Keeps the layer's "the <schedule> schedule cannot run here" warnings: a case asked for a
    schedule must run it, not the sequential fallback."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.said = []

    def emit(self, record):
        msg = record.getMessage()
        if "cannot run here" in msg:
            self.said.append(msg)


def summary(world_size, cases, what):
    by = Counter(c.schedule or c.dtype for c in cases)
    return f"randomized {what} {world_size}: {len(cases)} cases passed (" + ", ".join(
        f"{k} {v}" for k, v in by.items()) + ")"


# ---------------------------------------------------------------------------- the generator itself
def test_the_cases_cover_the_edges():
    """The fixed seed lists draw every edge the test is for (a change to the generator must keep them)."""
    for world_size in (2, 4):
        cases = cpu_cases(world_size) if world_size == 2 else cpu_cases(2) + cpu_cases(4)
        counts = {t for c in cases for t in c.tokens}
        assert {0, 1} <= counts and any(c.max_tokens in c.tokens for c in cases)
        assert {c.dtype for c in cases} == {"float32", "bfloat16"}
        assert {c.routing for c in cases} == {"uniform", "skewed", "one_expert"}
        assert {c.drop_tokens for c in cases} == {False, True}
        assert any(c.k == 1 for c in cases) and any(c.k == 2 for c in cases) and any(c.k >= 3 for c in cases)
        assert all(c.hidden % 128 for c in cases)
    for world_size in (2, 4):
        cases = gpu_cases(world_size)
        assert len(cases) >= 50 and {c.schedule for c in cases} == set(SCHEDULES)
        assert all(c.hidden % 8 == 0 and c.ffn % 8 == 0 and c.dtype == "bfloat16" for c in cases)
        assert {0, 1} <= {t for c in cases for t in c.tokens} and any(c.max_tokens in c.tokens for c in cases)
    assert draw_case(3, 2) == draw_case(3, 2), "a case must be a function of its seed"


def test_the_rounding_model_moves_results_by_roundings_only():
    """rounding_model: off, expert_forward is exact; on, each draw is a function of its seed and
    moves the result by about bf16 roundings, so twice its spread still catches a wrong row."""
    from randomized_cases import case_experts, expert_forward, rounding_model
    case = draw_case(11, 2)
    expert = case_experts(case)[0].double()
    x = torch.randn(16, case.hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = expert_forward(expert, x)
    assert torch.equal(exact, expert_forward(expert, x))
    with rounding_model(5):
        a = expert_forward(expert, x)
    with rounding_model(5):
        b = expert_forward(expert, x)
    with rounding_model(6):
        c = expert_forward(expert, x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    spread = max(_max_err(a, exact), _max_err(c, exact))
    assert 0 < spread < 0.05 * exact.abs().max().item()
    wrong = exact.clone()
    wrong[3] = expert_forward(case_experts(case)[1].double(), x[3:4])[0]  # another expert's answer
    with pytest.raises(Mismatch, match="output off by"):
        compare("output", wrong.bfloat16(), exact.bfloat16(), exact, torch.bfloat16, "here",
                draws=lambda: [a, c])


# ---------------------------------------------------------------------------- CPU: reference backend, gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_randomized_reference_backend(world_size, capsys, tmp_path):
    cases = cpu_cases(world_size)
    run_distributed(run_cases, world_size, cases, "cpu", str(tmp_path / "time"), timeout=300)
    with capsys.disabled():
        print(f"\n{summary(world_size, cases, 'reference ep')} in {(tmp_path / 'time').read_text()} s")


# ---------------------------------------------------------------------------- GPU: megakernel, NCCL
@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (2, 4)])
def test_randomized_megakernel(world_size, capsys, tmp_path):
    cases = gpu_cases(world_size)
    run_distributed(run_cases, world_size, cases, "cuda", str(tmp_path / "time"), backend="nccl", timeout=600)
    with capsys.disabled():
        print(f"\n{summary(world_size, cases, 'ep')} in {(tmp_path / 'time').read_text()} s")
