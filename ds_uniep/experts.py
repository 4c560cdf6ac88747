"""MLP experts that ds_uniep recognises, and the runner of a rank's local experts.

Any ``nn.Module`` works as an expert: it is called once per local expert on
that expert's rows. The two MLP experts here (SwiGLU as in Mixtral/DeepSeek,
GELU as in GPT/DeepSpeed-MoE examples) are also recognised, so all local
experts of a rank run as one grouped GEMM per projection (``torch._grouped_mm``, or
ds_uniep's own, :mod:`ds_uniep.gemm`) instead of a Python loop. Letters: R rows, M hidden, F expert FFN width, L
local experts.
"""

import warnings
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .swiglu import swiglu


class SwiGLUExpert(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; ``w1``, ``w3``: ``[F, M]``, ``w2``: ``[M, F]`` (nn.Linear, no bias)."""

    def __init__(self, hidden_size: int, ffn_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeLUExpert(nn.Module):
    """``fc2(gelu(fc1 x))``; ``fc1``: ``[F, M]``, ``fc2``: ``[M, F]``, with biases."""

    def __init__(self, hidden_size: int, ffn_size: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _AddGroupBias(torch.autograd.Function):
    """``y [R, N] + bias[l]`` on the rows of group ``l``; the bias gradient sums each group's rows
    with one reduction per group (a fixed order), not a scatter-add over rows."""

    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor, counts: Tensor) -> Tensor:
        ctx.splits = counts.tolist()
        return y + torch.repeat_interleave(bias, counts, dim=0, output_size=y.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = grad.split(ctx.splits)
        return grad, torch.stack([p.sum(0) for p in parts]), None


def _grouped_linear(x: Tensor, w: Tensor, bias: Optional[Tensor], offs: Tensor, counts: Tensor,
                    gemm: str = "torch", sm_count: int = 0, waits=None, configs=None, into=None) -> Tensor:
    """Rows of group ``l`` of ``x [R, K]`` times ``w[l].T`` (``w [L, N, K]``, nn.Linear's layout), plus
    ``bias[l]`` (``[L, N]``); ``offs``: ``[L]`` int32 ends. ``gemm``: ``torch._grouped_mm`` or ds_uniep's
    grouped GEMM (see :data:`GEMMS`; ``sm_count``: the SMs it uses, 0 for all; ``waits``: its forward
    runs while the rows arrive, :class:`ds_uniep.gemm.ArrivalWaits`; ``configs``: its tile
    configuration per operation, default its own; ``into``: its dgrad runs with the dispatch's
    backward, see :func:`ds_uniep.gemm.grouped_linear`)."""
    if gemm == "uniep":
        from .gemm import grouped_linear
        y = grouped_linear(x, w, offs, configs=configs, sm_count=sm_count, waits=waits, into=into)
    else:  # viewed as [L, K, N]: the column-major B operand grouped_mm takes
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if bias is not None:
        y = _AddGroupBias.apply(y, bias, counts)
    return y


class _Stacks(Mapping):
    """GEMM name -> its stacked operand, each built on first access (for parameters, with the autograd
    node that hands them their gradients). Built where the GEMM reads it, that node comes right
    before the GEMM in the graph's order, so the backward runs it (and the parameters' gradient
    accumulation, one host step per parameter) as soon as that GEMM's weight gradient is queued,
    while the device computes it, instead of after the rest of the layer's backward."""

    def __init__(self, makers: Dict[str, Callable[[], Optional[Tensor]]], copies: Sequence[str] = ()):
        self._makers: Dict[str, Callable[[], Optional[Tensor]]] = makers
        self._copies = set(copies)  # operands built as a copy (their parameters do not lie as one view)
        self._built: Dict[str, Optional[Tensor]] = {}

    def __getitem__(self, name: str) -> Optional[Tensor]:
        if name not in self._built:
            self._built[name] = self._makers[name]()
        return self._built[name]

    def __contains__(self, name) -> bool:
        return name in self._makers

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def detached(self, name: str) -> Optional[Tensor]:
        """The operand's values without an autograd node, for kernels that only read it: a view
        made without the node, which the GEMM makes later; an operand that is a copy is built now,
        node and all, and detached, so that it is copied once."""
        if name in self._built or name in self._copies:
            t = self[name]
            return None if t is None else t.detach()
        with torch.no_grad():
            return self._makers[name]()


class StackedExperts:
    """A rank's recognised experts as grouped-GEMM operands: per GEMM the weights stacked
    ``[L, N, K]`` and the biases ``[L, N]`` (or None). SwiGLU's ``w1`` and ``w3`` form one GEMM,
    ``"w13"`` (``[L, 2F, M]``: ``w1[l]`` over ``w3[l]``; :func:`ds_uniep.swiglu.swiglu` then reads its
    ``[R, 2F]`` output), then ``"w2"``. GeLU runs ``"fc1"``, ``"fc2"``. ``groups``: L.
    Built by :func:`stack_experts`, differentiable, so the experts' own parameters get their gradients;
    ``weights`` and ``biases`` build each operand when it is first read (see :class:`_Stacks`)."""

    def __init__(self, kind: type, weights: Mapping, biases: Mapping, groups: int):
        self.kind, self.weights, self.biases, self.groups = kind, weights, biases, groups


# The grouped GEMMs of each recognised expert, in the order the forward runs them, and the
# projections (nn.Linear children) stacked along N in each.
_GEMMS = {SwiGLUExpert: (("w13", ("w1", "w3")), ("w2", ("w2", ))), GeLUExpert: (("fc1", ("fc1", )), ("fc2", ("fc2", )))}


class _StackedView(torch.autograd.Function):
    """Parameters that already lie in one storage at one stride, seen as one ``[L, N, ...]`` tensor
    without a copy. ``parts = (P, n)``: parameter ``i`` (of ``P = L * per``, group by group) is rows
    ``(i % per) * n`` to ``+ n`` of group ``i // per``; the backward hands it that slice of the
    stacked gradient (a view, not a copy), all of them from one ``unbind``."""

    @staticmethod
    def forward(ctx, size, stride, offset, parts, *params):
        ctx.parts = parts
        return params[0].detach().as_strided(size, stride, offset)

    @staticmethod
    def backward(ctx, grad: Tensor):
        count, n = ctx.parts
        return (None, None, None, None) + grad.reshape((count, n) + tuple(grad.shape[2:])).unbind(0)


def _stack_plan(groups: Sequence[Sequence[Tensor]]):
    """How :func:`_stacked` stacks ``groups``: ``(size, stride, offset, parts)`` of the view when the
    tensors already lie that way in one storage, else ``(size, None, None, None)`` (a copy)."""
    flat = [t for g in groups for t in g]
    t0, per = flat[0], len(groups[0])
    size = (len(groups), per * t0.shape[0]) + tuple(t0.shape[1:])
    numel = t0.numel()
    step = flat[per].storage_offset() - t0.storage_offset() if len(groups) > 1 else per * numel
    storage = t0.untyped_storage().data_ptr()
    if step >= per * numel and all(
            t.shape == t0.shape and t.dtype == t0.dtype and t.device == t0.device and t.is_contiguous()
            and t.untyped_storage().data_ptr() == storage
            and t.storage_offset() == t0.storage_offset() + l * step + j * numel
            for l, g in enumerate(groups) for j, t in enumerate(g)):
        return size, (step, ) + t0.stride(), t0.storage_offset(), (len(flat), t0.shape[0])
    return size, None, None, None


def _stacked(flat: Sequence[Tensor], plan) -> Tensor:
    """``flat`` (groups of tensors concatenated along dim 0 within a group, group after group)
    stacked ``[L, sum of dim 0, ...]`` by ``plan`` (:func:`_stack_plan`): a view when they already lie
    that way in one storage (as :func:`pack_experts` and DeepSpeed's flat parameter buffers leave
    them), else a copy."""
    size, stride, offset, parts = plan
    if stride is None:
        return torch.stack(list(flat)).view(size)
    return _StackedView.apply(size, stride, offset, parts, *flat)


def _expert_tensors(experts: Sequence[nn.Module], params: Optional[Sequence[Dict[str, Tensor]]], kind: type
                    ) -> Dict[str, List[Optional[Tensor]]]:
    """``{"w1.weight": [one per group], ...}``. The modules' own parameters are read from their
    parameter dicts directly: once per group and projection on every forward, where
    ``named_parameters()`` would cost tens of microseconds of host time per expert."""
    out: Dict[str, List[Optional[Tensor]]] = {}
    for _, projs in _GEMMS[kind]:
        for proj in projs:
            for what in ("weight", "bias"):
                name = f"{proj}.{what}"
                if params is not None:
                    out[name] = [p.get(name) for p in params]
                else:
                    out[name] = [e._modules[proj]._parameters.get(what) for e in experts]
    return out


def _grouped_operands(experts: Sequence[nn.Module], dtype: torch.dtype, device: torch.device,
                      params: Optional[Sequence[Dict[str, Tensor]]] = None):
    """``(kind, tensors)`` where the experts can run as grouped GEMMs on rows of ``dtype`` on
    ``device`` (all of one recognised kind, bf16 on ``device``, every dimension a multiple of 8:
    grouped_mm wants 16-byte aligned rows; biases on all groups or on none), else None."""
    if not hasattr(torch, "_grouped_mm") or not experts or dtype != torch.bfloat16:
        return None
    kind = type(experts[0])
    if kind not in _GEMMS or any(type(e) is not kind for e in experts):
        return None
    tensors = _expert_tensors(experts, params, kind)
    for _, projs in _GEMMS[kind]:
        for proj in projs:
            ws, bs = tensors[f"{proj}.weight"], tensors[f"{proj}.bias"]
            if any(b is None for b in bs) and any(b is not None for b in bs):
                return None
            for t in ws + [b for b in bs if b is not None]:
                if t is None or t.dtype != torch.bfloat16 or t.device != device or any(d % 8 for d in t.shape):
                    return None
            if any(w.shape != ws[0].shape for w in ws):
                return None
    return kind, tensors


def stack_experts(experts: Sequence[nn.Module], dtype: torch.dtype, device: torch.device,
                  params: Optional[Sequence[Dict[str, Tensor]]] = None,
                  cache: Optional[Dict] = None) -> Optional[StackedExperts]:
    """``experts`` (with their own parameters, or ``params``, one ``named_parameters``-style dict per
    group) stacked for grouped GEMMs on rows of ``dtype`` on ``device``, or None where they cannot
    run as grouped GEMMs (see :func:`_grouped_operands`). Parameters packed by
    :func:`pack_experts` (or flattened by DeepSpeed's optimizers, expert by expert) are viewed, not
    copied. ``cache``: a dict the caller keeps, so that the checks and the layout search run once
    per parameter storage (keyed by the tensors' addresses), not on every forward."""
    key = None
    if cache is not None and params is None and experts and type(experts[0]) in _GEMMS:
        kind = type(experts[0])
        names = {(proj, what): i for i, (proj, what) in enumerate(
            (proj, what) for _, projs in _GEMMS[kind] for proj in projs for what in ("weight", "bias"))}
        flat = [e._modules[proj]._parameters.get(what) for e in experts for proj, what in names]
        if flat[0] is not None:
            # Every address, plus the first storage and shapes: the stacking plan is then valid.
            key = (dtype, device, tuple(type(e) for e in experts), flat[0].untyped_storage().data_ptr(),
                   tuple(t.shape if t is not None else None for t in flat[:len(names)]),
                   tuple(t.data_ptr() if t is not None else 0 for t in flat))
            hit = cache.get(key)
            if hit is not None:
                return None if hit is False else _stack_with(hit, lambda name, g: flat[g * len(names) + names[name]])
    found = _grouped_operands(experts, dtype, device, params)
    if found is None:
        if key is not None:
            cache[key] = False
        return None
    kind, tensors = found
    n = len(params) if params is not None else len(experts)
    plans = {"kind": kind, "n": n}
    for gemm, projs in _GEMMS[kind]:
        for what in ("weight", "bias"):
            if tensors[f"{projs[0]}.{what}"][0] is not None:
                plans[gemm, what] = _stack_plan([[tensors[f"{p}.{what}"][g] for p in projs] for g in range(n)])
    if key is not None:
        if len(cache) >= 72:  # parameters moved again and again (chunks of the pipelined schedule: one each)
            cache.clear()
        cache[key] = plans
    return _stack_with(plans, lambda name, g: tensors[f"{name[0]}.{name[1]}"][g])


def _stack_with(plans: Dict, tensor) -> StackedExperts:
    """The stacked operands by ``plans`` (see :func:`stack_experts`); ``tensor((proj, what), g)``:
    group ``g``'s parameter."""
    kind, n = plans["kind"], plans["n"]
    makers = {"weight": {}, "bias": {}}
    copies = {"weight": [], "bias": []}

    def maker(gemm, projs, what):
        plan = plans.get((gemm, what))
        if plan is None:
            return lambda: None
        if plan[1] is None:  # no stride: _stacked copies
            copies[what].append(gemm)
        return lambda: _stacked([tensor((p, what), g) for g in range(n) for p in projs], plan)
    for gemm, projs in _GEMMS[kind]:
        for what in makers:
            makers[what][gemm] = maker(gemm, projs, what)
    return StackedExperts(kind, *(_Stacks(makers[what], copies[what]) for what in ("weight", "bias")), n)


def pack_experts(experts: Sequence[nn.Module]) -> bool:
    """Lay the parameters of recognised experts (all of one kind, shape, dtype and device) out as
    the grouped GEMMs read them: one buffer per GEMM, ``[L, N, K]``, with every parameter a view of
    its rows (SwiGLU's ``w1[l]`` directly over ``w3[l]``), so :func:`stack_experts` needs no copy.
    Values, parameter objects and names do not change. Returns whether it packed. Call it before
    an optimizer flattens the parameters (``UniEPMoE`` does, on construction and after ``.to()``)."""
    if not experts or type(experts[0]) not in _GEMMS or any(type(e) is not type(experts[0]) for e in experts):
        return False
    kind = type(experts[0])
    for _, projs in _GEMMS[kind]:
        for proj in projs:
            for what in ("weight", "bias"):
                ts = [e._modules[proj]._parameters.get(what) for e in experts]
                t0 = ts[0]
                if t0 is None and all(t is None for t in ts):
                    continue
                if any(t is None or t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device for t in ts):
                    return False
                if any(hasattr(t, "ds_id") or t.numel() == 0 for t in ts):  # ZeRO-3 owns (partitions) them
                    return False
        t0s = [experts[0]._modules[p]._parameters["weight"] for p in projs]
        if any(t.shape[1:] != t0s[0].shape[1:] or t.dtype != t0s[0].dtype or t.device != t0s[0].device for t in t0s):
            return False
    with torch.no_grad():
        for _, projs in _GEMMS[kind]:
            for what in ("weight", "bias"):
                ps = [[e._modules[p]._parameters.get(what) for p in projs] for e in experts]
                if ps[0][0] is None:
                    continue
                rows = [t.shape[0] for t in ps[0]]
                buf = torch.empty((len(experts), sum(rows)) + tuple(ps[0][0].shape[1:]), dtype=ps[0][0].dtype,
                                  device=ps[0][0].device)
                for l, group in enumerate(ps):
                    for t, part in zip(group, buf[l].split(rows)):
                        part.copy_(t)
                        t.data = part
    return True


def _grouped_ok(experts: Sequence[nn.Module], recv: Tensor, params: Optional[Sequence[Dict[str, Tensor]]] = None
                ) -> bool:
    """Whether ``experts`` (with their own parameters, or ``params``, one dict per group) run as grouped GEMMs."""
    return _grouped_operands(experts, recv.dtype, recv.device, params) is not None


GEMMS = ("torch", "uniep")
"""Grouped GEMMs the recognised experts run on: ``torch._grouped_mm`` or ds_uniep's own
(:mod:`ds_uniep.gemm`, Hopper GPUs)."""


def row_ends(counts: Tensor) -> Tensor:
    """The grouped GEMMs' ``offs``: the int32 end row of each group, from its row ``counts``."""
    return torch.cumsum(counts, 0).to(torch.int32)


def run_grouped(experts: Sequence[nn.Module], recv: Tensor, counts: Tensor, gemm: str = "torch",
                params: Optional[Sequence[Dict[str, Tensor]]] = None,
                stacked: Optional[StackedExperts] = None, offs: Optional[Tensor] = None,
                sm_count: int = 0, waits=None, configs: Optional[Dict[str, str]] = None,
                last: Optional[Callable[[Tensor, Tensor, Tensor], Tensor]] = None, into=None) -> Tensor:
    """All groups as grouped GEMMs. ``recv [R, M]`` bf16, ``counts [G]`` rows per group; group ``g``
    runs expert ``experts[g]`` with its own parameters, or, given ``params`` (``G`` dicts of
    ``named_parameters`` form, e.g. gathered replicas), the module of ``experts[0]``'s kind with
    ``params[g]``; ``stacked``: those already stacked by :func:`stack_experts`. ``gemm``: one of
    :data:`GEMMS` (the same GEMMs and elementwise ops on either). ``offs``: the ``[G]`` int32 row ends
    on the device when the caller has them (else computed from ``counts``). ``sm_count``: the SMs
    ds_uniep's GEMM uses, forward and backward (0: all; the same bits); only with ``gemm="uniep"``.
    ``waits`` (:class:`ds_uniep.gemm.ArrivalWaits`, ``gemm="uniep"`` only): the first projection's
    forward starts while ``recv``'s rows still arrive, segment by segment (the fused schedule).
    ``configs`` (``gemm="uniep"`` only): ds_uniep's GEMM configuration per operation, as
    :func:`ds_uniep.gemm.grouped_linear` takes them (the same bits under every one). ``last``: runs
    the last projection instead, as ``last(activation, weight [G, N, K], offs)`` (a projection
    without bias; the fused schedule's epilogue combine), and its result is returned. ``into``
    (``gemm="uniep"`` only): the first projection's dgrad runs with the dispatch's backward and
    stores into the sources' combine buffers (``ds_uniep.epilogue_combine.DgradCombine``)."""
    if (sm_count or waits is not None or configs or into is not None) and gemm != "uniep":
        raise ValueError(f"sm_count, waits, configs and into apply to ds_uniep's grouped GEMM (gemm='uniep'), not "
                         f"{gemm!r}")
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    if stacked is None:
        stacked = stack_experts(experts, recv.dtype, recv.device, params)
        if stacked is None:
            raise ValueError("these experts cannot run as grouped GEMMs (see stack_experts)")
    groups = stacked.groups
    if groups != counts.numel():
        raise ValueError(f"{counts.numel()} row counts for {groups} expert groups")
    counts = counts.to(recv.device)
    if offs is None:
        offs = row_ends(counts)

    def linear(x, proj, w=None, into=None):
        return _grouped_linear(x, stacked.weights[proj], stacked.biases[proj], offs, counts, gemm, sm_count, w,
                               configs, into)
    first, second = ("w13", "w2") if stacked.kind is SwiGLUExpert else ("fc1", "fc2")
    act = swiglu if stacked.kind is SwiGLUExpert else F.gelu
    h = act(linear(recv, first, waits, into))
    if last is None:
        return linear(h, second)
    if stacked.biases[second] is not None:
        raise ValueError(f"run_grouped: last replaces the projection {second!r}, which has a bias")
    return last(h, stacked.weights[second], offs)


def run_experts(experts: Sequence[nn.Module], recv: Tensor, local_expert_counts: Tensor,
                grouped: bool = True, gemm: str = "torch", stacked: Optional[StackedExperts] = None,
                configs: Optional[Dict[str, str]] = None, offs: Optional[Tensor] = None) -> Tensor:
    """Run local expert ``l`` over its rows of ``recv [R, M]``; returns ``[R, M]`` in the same order.

    Recognised bf16 MLP experts run as grouped GEMMs (when ``grouped``) on ``gemm`` (see
    :func:`run_grouped`; ``stacked``: their operands, stacked beforehand by :func:`stack_experts`;
    ``configs``: ds_uniep's GEMM configurations there; ``offs``: the ``[L]`` int32 row ends where the
    caller has them).
    Otherwise every
    expert is called, also with zero rows, so its parameters always join the autograd
    graph (zero gradients rather than None, as with DeepSpeed's padded buffers). A
    ``(out, bias)`` tuple keeps ``out``, as DeepSpeed's Experts does.
    """
    if grouped:
        if stacked is None:
            stacked = stack_experts(experts, recv.dtype, recv.device)
        if stacked is not None:
            return run_grouped(experts, recv, local_expert_counts, gemm, stacked=stacked, configs=configs, offs=offs)
    outs: List[Tensor] = []
    for expert, rows in zip(experts, recv.split(local_expert_counts.tolist())):
        out = expert(rows)
        if isinstance(out, tuple):
            if len(out) > 1 and out[1] is not None:
                warnings.warn(f"{type(expert).__name__} returned (out, bias): the bias is not added, as in "
                              "DeepSpeed's MoE; add it inside the expert if it belongs to the output", UserWarning)
            out = out[0]
        outs.append(out)
    return torch.cat(outs) if outs else recv
