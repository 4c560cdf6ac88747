"""Randomized MoE cases and a pure-torch, single-process MoE to check ``UniEPMoE`` against.

:func:`draw_case` turns ``(seed, world_size)`` (and, for the megakernel, a schedule) into one
:class:`Case`: per-rank token counts (0, 1 and ``max_tokens_per_rank`` among them), k, E, hidden
and FFN sizes, expert kind, dtype, routing (uniform, skewed toward a few experts, every token's
first choice on one expert) and token dropping. Everything a case needs is a function of the case
alone (:func:`case_inputs`, :func:`case_experts`, :func:`case_gate_weight`), so every rank builds
every rank's inputs and every expert's weights without communicating.

:func:`reference_moe` is the layer's contract written out with plain torch ops over all ranks'
tokens at once: DeepSpeed's own gate (the layer's ``deepspeed_moe.gate``, so the routes are the
layer's) routes each rank's tokens, each token's output is the sum over its k slots, in slot order,
of gate value times expert(token), accumulated in ``acc_dtype`` and cast once; the gradients come
from torch's autograd through that. Each expert runs once over the rows routed to it from every
rank, its biases added after the product's rounding (as ds_uniep's grouped GEMMs do), so that the
reference at the layer's precision rounds where the layer does.
"""
import contextlib
import copy
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

# Megakernel schedules (``uniep.overlap``), by the name the summaries use. The fused ones need
# ds_uniep's GEMM (``expert_gemm: "uniep"``), bf16 and a hidden size that is a multiple of 8.
SCHEDULES: Dict[str, dict] = {
    "sequential": {"schedule": "sequential"},
    "pipelined": {"schedule": "pipelined", "num_chunks": 2},
    "fused-interleaved": {"schedule": "fused", "roles": "interleaved"},
    "fused-partitioned": {"schedule": "fused", "roles": "partitioned", "num_comm_sms": 8},
}

CPU_HIDDEN = (24, 40, 72, 136)  # none a multiple of 128
CPU_FFN = (16, 40, 56)
GPU_HIDDEN = (72, 136, 200, 264)  # megakernel rows: a multiple of 16 bytes (8 bf16 values)
GPU_FUSED_HIDDEN = (136, 264, 520)
GPU_FFN = (64, 136, 200)  # ds_uniep's GEMM: N and K multiples of 8


@dataclass(frozen=True)
class Case:
    seed: int
    world_size: int
    tokens: Tuple[int, ...]  # per rank
    max_tokens: int  # uniep.max_tokens_per_rank
    k: int
    num_experts: int
    hidden: int
    ffn: int
    expert: str  # "swiglu" | "gelu"
    dtype: str  # "float32" | "bfloat16"
    routing: str  # "uniform" | "skewed" | "one_expert"
    favored: Tuple[int, ...]  # experts the routing leans toward (skewed, one_expert)
    drop_tokens: bool
    capacity_factor: float
    schedule: Optional[str] = None  # a SCHEDULES key on the megakernel; None: the reference backend

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        drop = f"drop cf={self.capacity_factor}" if self.drop_tokens else "dropless"
        sched = f" {self.schedule}" if self.schedule else ""
        return (f"seed={self.seed} ep={self.world_size}{sched} T={list(self.tokens)} (max {self.max_tokens}) "
                f"k={self.k} E={self.num_experts} M={self.hidden} F={self.ffn} {self.expert} {self.dtype} "
                f"{self.routing}{list(self.favored) if self.favored else ''} {drop}")


def _token_count(rnd: random.Random, max_tokens: int) -> int:
    u = rnd.random()
    return 0 if u < 0.2 else 1 if u < 0.35 else max_tokens if u < 0.6 else rnd.randint(2, max_tokens - 1)


def draw_case(seed: int, world_size: int, schedule: Optional[str] = None) -> Case:
    """One case, a function of its arguments only. ``schedule`` None: a CPU case for the reference
    backend (fp32 or bf16); else a megakernel case (bf16) for that :data:`SCHEDULES` entry."""
    rnd = random.Random(f"uniep-randomized:{world_size}:{schedule}:{seed}")
    gpu = schedule is not None
    max_tokens = rnd.choice((128, 256) if gpu else (16, 32, 48))
    # (the pipelined schedule chunks the local experts: at least two of them there)
    E = world_size * rnd.choice((2, 3, 4) if schedule == "pipelined" else (1, 2, 3, 4))
    k = rnd.randint(1, min(8, E))
    if gpu:
        hidden = rnd.choice(GPU_FUSED_HIDDEN if schedule.startswith("fused") else GPU_HIDDEN)
        ffn, dtype = rnd.choice(GPU_FFN), "bfloat16"
    else:
        hidden, ffn, dtype = rnd.choice(CPU_HIDDEN), rnd.choice(CPU_FFN), rnd.choice(("float32", "bfloat16"))
    routing = rnd.choice(("uniform", "uniform", "skewed", "skewed", "one_expert"))
    favored = (tuple(sorted(rnd.sample(range(E), min(E, rnd.randint(1, 3))))) if routing == "skewed" else
               (rnd.randrange(E), ) if routing == "one_expert" else ())
    # DeepSpeed's capacity is a function of the rank's own token count, and every rank's padded
    # exchange must agree on it: with dropping, every rank feeds the same count (as DeepSpeed's MoE needs).
    drop = rnd.random() < 0.25
    if drop:
        T = rnd.choice((1, max_tokens, rnd.randint(2, max_tokens - 1)))
        tokens = (T, ) * world_size
        capacity_factor = rnd.choice((0.5, 1.0, 2.0))
    else:
        tokens = tuple(_token_count(rnd, max_tokens) for _ in range(world_size))
        capacity_factor = 1.0
    return Case(seed, world_size, tokens, max_tokens, k, E, hidden, ffn, rnd.choice(("swiglu", "gelu")), dtype,
                routing, favored, drop, capacity_factor, schedule)


# ---------------------------------------------------------------------------- what a case holds
def case_inputs(case: Case, rank: int) -> Tuple[Tensor, Tensor]:
    """``(x, gy)`` of ``rank`` in the case's dtype: x's row t starts ``[rank, t / 64, 1]`` (a row
    names its origin; the constant column carries the routing's skew), the rest random; gy is
    the output gradient."""
    T, M = case.tokens[rank], case.hidden
    g = torch.Generator().manual_seed(case.seed * 7919 + rank)
    x = torch.randn(T, M, generator=g)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32) / 64
    x[:, 2] = 1.0
    gy = torch.randn(T, M, generator=g)
    return x.to(case.torch_dtype), gy.to(case.torch_dtype)


def case_gate_weight(case: Case) -> Tensor:
    """``[E, M]`` fp32 gate weight: random logits of about unit size, plus the routing's lean on the
    constant column (skewed: a few experts a little ahead; one_expert: one expert first for every token)."""
    g = torch.Generator().manual_seed(case.seed * 104729 + 1)
    w = torch.randn(case.num_experts, case.hidden, generator=g) * case.hidden**-0.5
    if case.routing == "skewed":
        for e in case.favored:
            w[e, 2] += 1.0 + 2.0 * torch.rand((), generator=g).item()
    elif case.routing == "one_expert":
        w[case.favored[0], 2] += 30.0
    return w


def expert_class(case: Case):
    from ds_uniep import GeLUExpert, SwiGLUExpert
    return SwiGLUExpert if case.expert == "swiglu" else GeLUExpert


def case_experts(case: Case) -> List[nn.Module]:
    """All ``E`` experts in fp32, expert e's weights drawn from its own seed (a misrouted row gets
    another expert's answer)."""
    kind = expert_class(case)
    experts = []
    for e in range(case.num_experts):
        expert = kind(case.hidden, case.ffn)
        g = torch.Generator().manual_seed(case.seed * 1000003 + e)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1]**-0.5 if p.dim() > 1 else 0.1))
        experts.append(expert)
    return experts


# ---------------------------------------------------------------------------- the reference
@contextlib.contextmanager
def gate_without_group(gate):
    """DeepSpeed's dropless gates all-reduce their largest expert count over the expert-parallel
    group, for a capacity the reference does not use: run the gate on one rank's tokens alone."""
    group = gate.ep_group
    gate.ep_group = None
    try:
        yield gate
    finally:
        gate.ep_group = group


class _Rounding(torch.autograd.Function):
    """One rounding of the rounding model: ``t * (1 + u * r)`` forward and ``g * (1 + u * r')``
    backward, ``r`` and ``r'`` uniform in [-1, 1] from ``generator``."""

    @staticmethod
    def forward(ctx, t, u, generator):
        ctx.u, ctx.generator = u, generator
        return t * (1 + u * (2 * torch.rand(t.shape, generator=generator, dtype=t.dtype) - 1).to(t.device))

    @staticmethod
    def backward(ctx, g):
        r = 2 * torch.rand(g.shape, generator=ctx.generator, dtype=g.dtype) - 1
        return g * (1 + ctx.u * r.to(g.device)), None, None


_ROUNDING: List[Optional[Tuple[float, torch.Generator]]] = [None]


@contextlib.contextmanager
def rounding_model(seed: int, u: float = 2.0**-8):
    """Inside: every expert projection and activation of :func:`expert_forward`, forward and
    backward, takes one random relative error of at most ``u`` (bf16's unit roundoff by default),
    as a kernel that rounds its result to bf16 does, drawn from ``seed``."""
    _ROUNDING[0] = (u, torch.Generator().manual_seed(seed))
    try:
        yield
    finally:
        _ROUNDING[0] = None


def _rounded(t: Tensor) -> Tensor:
    return t if _ROUNDING[0] is None else _Rounding.apply(t, *_ROUNDING[0])


def _linear(x: Tensor, layer: nn.Linear) -> Tensor:
    """``layer(x)`` with the bias added to the product after its rounding to ``x``'s dtype, as
    ds_uniep's grouped GEMMs add it (``nn.Linear`` on CPU rounds once, after the bias)."""
    y = _rounded(torch.nn.functional.linear(x, layer.weight))
    return y if layer.bias is None else y + layer.bias


def expert_forward(expert: nn.Module, x: Tensor) -> Tensor:
    """``expert(x)`` for SwiGLUExpert and GeLUExpert, in the expert's dtype, each projection a :func:`_linear`."""
    from ds_uniep import GeLUExpert, SwiGLUExpert
    x = x.to(next(expert.parameters()).dtype)
    if isinstance(expert, SwiGLUExpert):
        return _linear(_rounded(torch.nn.functional.silu(_linear(x, expert.w1)) * _linear(x, expert.w3)), expert.w2)
    if isinstance(expert, GeLUExpert):
        return _linear(_rounded(torch.nn.functional.gelu(_linear(x, expert.fc1))), expert.fc2)
    raise TypeError(f"no reference forward for {type(expert).__name__}")


def expert_rows(xs: Sequence[Tensor], expert_idx: Sequence[Tensor], experts: Sequence[nn.Module]) -> List[Tensor]:
    """``[T_r, k, M]`` per rank: row ``[t, j]`` is ``experts[expert_idx[r][t, j]](xs[r][t])`` in the
    experts' dtype, zeros for a dropped slot (-1). Each expert runs once, over its rows of every
    rank in (rank, token, slot) order."""
    k = expert_idx[0].shape[1]
    dtype = next(experts[0].parameters()).dtype
    rows = [x.new_zeros(x.shape[0] * k, x.shape[1], dtype=dtype) for x in xs]
    for e, expert in enumerate(experts):
        pairs = [(idx.reshape(-1) == e).nonzero().squeeze(1) for idx in expert_idx]
        if not sum(p.numel() for p in pairs):
            continue
        y = expert_forward(expert, torch.cat([x.index_select(0, p // k) for x, p in zip(xs, pairs)]))
        for r, part in enumerate(y.split([p.numel() for p in pairs])):
            if part.numel():
                rows[r] = rows[r].index_copy(0, pairs[r], part)
    return [r.view(x.shape[0], k, x.shape[1]) for r, x in zip(rows, xs)]


def slot_sum(pair_rows: Tensor, gates: Tensor, acc_dtype: torch.dtype, out_dtype: torch.dtype) -> Tensor:
    """``out[t] = sum_j gates[t, j] * pair_rows[t, j]`` over the slots j in order, in ``acc_dtype``,
    cast once to ``out_dtype``."""
    acc = pair_rows.new_zeros(pair_rows.shape[0], pair_rows.shape[2], dtype=acc_dtype)
    for j in range(pair_rows.shape[1]):
        acc = acc + gates[:, j:j + 1].to(acc_dtype) * pair_rows[:, j].to(acc_dtype)
    return acc.to(out_dtype)


@dataclass
class Reference:
    out: List[Tensor]  # per rank
    l_aux: List[Tensor]
    exp_counts: List[Tensor]
    expert_idx: List[Tensor]  # [T, k], -1 dropped
    x_grad: List[Tensor]
    expert_grads: List[List[Optional[Tensor]]]  # [E][parameter]
    gate_grad: Optional[Tensor]  # of rank ``rank``'s loss only (each rank's gate sees its own tokens)


def reference_moe(gate, experts: Sequence[nn.Module], xs: Sequence[Tensor], gys: Sequence[Tensor], aux_coef: float,
                  rank: int, acc_dtype: torch.dtype, out_dtype: torch.dtype) -> Reference:
    """The whole layer over every rank's tokens ``xs`` in one process, forward and backward: each
    rank's tokens routed by ``gate`` (``gate(x, None, True)``, DeepSpeed's sparse routes), combined
    by :func:`slot_sum`; the backward of ``sum_r <out_r, gys[r]> + aux_coef * l_aux_r``. The tokens
    go to the experts as ``xs``'s dtype converted to theirs; the gate reads them as fp32 either way,
    so the routes are those of ``xs``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    l_auxes, counts, routes, gates = [], [], [], []
    with gate_without_group(gate):
        for x in leaves:
            l_aux, _, _, route_idx, _, route_gates, exp_counts = gate(x, None, True)
            l_auxes.append(l_aux)
            counts.append(exp_counts)
            routes.append(route_idx.t().long())
            gates.append(route_gates.t())
    outs = [slot_sum(rows, g, acc_dtype, out_dtype) for rows, g in zip(expert_rows(leaves, routes, experts), gates)]
    # (an output without a graph: a rank without tokens, or whose every route was dropped)
    heads = [(h, g) for h, g in zip(outs + l_auxes, [gy.to(out_dtype) for gy in gys] +
                                    [torch.full_like(a, aux_coef) for a in l_auxes]) if h.requires_grad]
    wg = gate.wg.weight
    own = [(h, g) for h, g in heads if any(h is t for t in (outs[rank], l_auxes[rank]))]
    gate_grad = None
    if own:
        (gate_grad, ) = torch.autograd.grad([h for h, _ in own], [wg], [g for _, g in own], retain_graph=True,
                                            allow_unused=True)
    params = [list(e.parameters()) for e in experts]
    flat = [p for ps in params for p in ps]
    grads = list(torch.autograd.grad([h for h, _ in heads], leaves + flat, [g for _, g in heads], allow_unused=True))
    x_grad, rest = grads[:len(xs)], grads[len(xs):]
    expert_grads = []
    for ps in params:
        expert_grads.append(rest[:len(ps)])
        rest = rest[len(ps):]
    return Reference([o.detach() for o in outs], [a.detach() for a in l_auxes], counts, routes,
                     [g if g is not None else torch.zeros_like(x) for g, x in zip(x_grad, leaves)], expert_grads,
                     gate_grad)


def _case_tensors(case: Case, device):
    """Every rank's tokens and output gradients on ``device``, and all experts in the case's dtype
    (as the layer holds them) and those weights in fp64."""
    xs, gys = zip(*(case_inputs(case, r) for r in range(case.world_size)))
    low = [copy.deepcopy(e).to(device=device, dtype=case.torch_dtype) for e in case_experts(case)]
    return [x.to(device) for x in xs], [gy.to(device) for gy in gys], low, [copy.deepcopy(e).double() for e in low]


def reference_pair(gate, case: Case, device, rank: int) -> Tuple[Reference, Reference]:
    """The reference at the case's precision (experts in its dtype, fp32 accumulation, output in its
    dtype: what the layer computes) and at high precision (the same weights and tokens in fp64,
    fp64 accumulation; the gate in fp32 as DeepSpeed's is)."""
    xs, gys, low, high = _case_tensors(case, device)
    ref = reference_moe(gate, low, xs, gys, AUX_COEF, rank, torch.float32, case.torch_dtype)
    hi = reference_moe(gate, high, [x.double() for x in xs], gys, AUX_COEF, rank, torch.float64, torch.float64)
    return ref, hi


def rounding_draws(gate, case: Case, device, rank: int, draws: int = 8) -> List[Reference]:
    """The high-precision reference ``draws`` times under :func:`rounding_model` (seeds from the
    case's): how far roundings like a bf16 layer's, at other points than the bf16 reference's, can
    move each result. A result with few terms (a rank with one token) or with cancellation (the
    gate's gradient) can land anywhere in that spread, so one bf16 reference's error is no bound."""
    xs, gys, _, high = _case_tensors(case, device)
    xs = [x.double() for x in xs]
    out = []
    for d in range(draws):
        with rounding_model(case.seed * 7919 + d):
            out.append(reference_moe(gate, high, xs, gys, AUX_COEF, rank, torch.float64, torch.float64))
    return out


AUX_COEF = 0.01  # weight of the auxiliary loss in the backward
