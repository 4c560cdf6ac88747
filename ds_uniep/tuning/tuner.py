"""Measure the valid plans of a :class:`~ds_uniep.tuning.space.Space` and pick one for every rank.

The seam to the kernels is ``run_plan(plan) -> None``: it runs one layer
forward (+backward) on the live shapes under ``plan`` and returns when the
work is queued (GPU) or done (CPU). The tuner times it, never looks inside.

1. Cache: rank 0 looks the key up and broadcasts what it found, so all ranks
   take the same branch; a hit returns without calling ``run_plan``.
2. Order: the config's default plan (projected onto a backend space: the knobs
   the backend does not act on take their fixed values, so it is the plan that
   runs the same code), the sequential baseline, then the other valid plans by
   the cost model's estimate (ties by enumeration order).
3. Per plan: ``warmup`` untimed runs, ``probe`` timed runs; once a best median
   exists, a plan whose probe median is over ``prune_ratio`` x best is pruned.
   Survivors run the rest of ``repeats``; the median counts.
4. Agreement: every decision uses values all-reduced with MAX over the group
   (the slowest rank sets the layer's time; elapsed time is the slowest
   rank's too), so every rank prunes, stops and picks identically.
5. Confirmation: the ``confirm_top`` fastest measured plans and the default
   plan take turns for ``confirm_rounds`` rounds (each round: every finalist's
   ``warmup`` and ``repeats`` runs, the order rotated by one per round); a
   finalist's confirmed time is the median of its rounds' (MAX over ranks)
   medians. Among many plans within a few percent of each other one of them
   times fast by chance; its rerun does not. The winner is the smallest
   confirmed time (without confirmation, the smallest median), a tie going to
   the earlier plan in enumeration order. The search (3) stops early enough to
   leave this round its expected time inside ``budget_s``.
6. Rank 0 writes the cache atomically.
"""

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import cache as cache_mod
from .cost import estimate_ms
from .space import GPUInfo, Plan, Shape, Space

RunPlan = Callable[[Plan], None]
CostModel = Callable[[Plan, Space], float]

PRUNE_RATIO = 1.5
PROBE_RUNS = 3


@dataclass
class PlanRecord:
    """One row of the tuning table.

    ``status``: ``measured`` (``median_ms`` is the MAX over ranks of each rank's
    median), ``pruned`` (``median_ms`` is the probe median that stopped it),
    ``rejected`` (``reason`` says why it cannot run), ``skipped`` (budget spent).
    ``confirmed_ms``: a finalist's median over the confirmation rounds (None for the others)."""

    plan: Plan
    status: str
    index: int
    median_ms: Optional[float] = None
    estimate_ms: Optional[float] = None
    reason: Optional[str] = None
    confirmed_ms: Optional[float] = None

    @property
    def ms(self) -> Optional[float]:
        """The time that ranks it: confirmed where it was confirmed, else its search median."""
        return self.confirmed_ms if self.confirmed_ms is not None else self.median_ms

    def to_dict(self) -> Dict[str, Any]:
        return {"plan": self.plan.to_dict(), "label": self.plan.label(), "status": self.status,
                "index": self.index, "median_ms": self.median_ms, "estimate_ms": self.estimate_ms,
                "reason": self.reason, "confirmed_ms": self.confirmed_ms}


@dataclass
class TuneResult:
    """The winner, its time, the default plan's time and every plan's fate."""

    winner: Plan
    best_ms: Optional[float]
    default_plan: Plan
    default_ms: Optional[float]
    baseline_plan: Plan
    baseline_ms: Optional[float]
    records: List[PlanRecord] = field(default_factory=list)
    from_cache: bool = False
    cache_file: Optional[str] = None
    elapsed_s: float = 0.0
    timer: str = ""

    def by_status(self, status: str) -> List[PlanRecord]:
        return [r for r in self.records if r.status == status]

    def best(self, n: int = 10) -> List[PlanRecord]:
        """The fastest measured plans, confirmed ones first (by confirmed time), then by search median."""
        return sorted(self.by_status("measured"), key=lambda r: (r.confirmed_ms is None, r.ms, r.index))[:n]

    @property
    def best_fixed_ms(self) -> Optional[float]:
        """The faster of the two fixed choices a user has without tuning: the config default and sequential."""
        times = [t for t in (self.default_ms, self.baseline_ms) if t is not None]
        return min(times) if times else None

    @property
    def speedup(self) -> Optional[float]:
        """Best fixed default's time over the tuned plan's (>= 1 means tuning paid)."""
        if self.best_ms is None or self.best_fixed_ms is None or self.best_ms <= 0:
            return None
        return self.best_fixed_ms / self.best_ms

    def table(self, n: int = 10) -> str:
        lines = [f"{'#':>3} {'plan':<44} {'median ms':>10} {'confirmed':>10} {'estimate':>9}"]
        for i, r in enumerate(self.best(n)):
            lines.append(f"{i + 1:>3} {r.plan.label():<44} {r.median_ms:>10.3f} {_fmt(r.confirmed_ms):>10} "
                         f"{_fmt(r.estimate_ms):>9}")
        return "\n".join(lines)

    def summary(self) -> str:
        counts = {s: len(self.by_status(s)) for s in ("measured", "pruned", "rejected", "skipped")}
        src = f"cache {self.cache_file}" if self.from_cache else f"{self.elapsed_s:.1f} s, {self.timer}"
        out = [f"winner {self.winner.label()}: {_fmt(self.best_ms)} ms ({src})",
               f"default {self.default_plan.label()}: {_fmt(self.default_ms)} ms; "
               f"sequential baseline: {_fmt(self.baseline_ms)} ms"]
        if self.speedup is not None:
            out.append(f"speedup of the tuned plan over the best fixed default: {self.speedup:.3f}x")
        if not self.from_cache:
            out.append(", ".join(f"{v} {k}" for k, v in counts.items()))
        return "\n".join(out)

    def to_dict(self) -> Dict[str, Any]:
        return {"winner": self.winner.to_dict(), "best_ms": self.best_ms,
                "default_plan": self.default_plan.to_dict(), "default_ms": self.default_ms,
                "baseline_plan": self.baseline_plan.to_dict(), "baseline_ms": self.baseline_ms,
                "best_fixed_ms": self.best_fixed_ms, "speedup": self.speedup, "from_cache": self.from_cache,
                "cache_file": self.cache_file, "elapsed_s": self.elapsed_s, "timer": self.timer,
                "records": [r.to_dict() for r in self.records]}


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


# ---------------------------------------------------------------------- ranks
_LOCAL = object()
"""Stands for "no group": the tuner runs no collective (``tune(..., local=True)``)."""


def _dist_initialized(group=None) -> bool:
    return group is not _LOCAL and torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank(group) -> int:
    return torch.distributed.get_rank(group) if _dist_initialized(group) else 0


def _allreduce_max(values: Sequence[float], group) -> List[float]:
    if not _dist_initialized(group):
        return list(values)
    backend = str(torch.distributed.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t.tolist()


def _broadcast_from_first(obj, group):
    if not _dist_initialized(group):
        return obj
    src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]


# ---------------------------------------------------------------------- timing
class _Timer:
    """Milliseconds of each call: CUDA events on GPU (device time, one sync per batch), else perf_counter."""

    def __init__(self, kind: str):
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"timer must be auto, cuda or cpu, got {kind!r}")
        self.kind = kind
        self.name = "CUDA events" if kind == "cuda" else "time.perf_counter"

    def run(self, fn: Callable[[], None], n: int) -> List[float]:
        if n <= 0:
            return []
        if self.kind == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in events]
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def sync(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()


# ---------------------------------------------------------------------- tune
def tune(space: Space, run_plan: RunPlan, *, budget_s: float = 60.0, warmup: int = 3, repeats: int = 10,
         group=None, progress: bool = True, cost_model: Optional[CostModel] = None,
         default_plan: Optional[Plan] = None, cache_dir: Optional[str] = None, backend: Optional[str] = None,
         timer: str = "auto", prune_ratio: float = PRUNE_RATIO, probe_runs: int = PROBE_RUNS,
         local: bool = False, confirm_top: int = 0, confirm_rounds: int = 3) -> TuneResult:
    """Pick the fastest valid plan of ``space`` for ``run_plan``, the same on every rank of ``group``.

    Every rank of ``group`` must call this with the same space and arguments
    (``run_plan`` may run collectives: all ranks run the same plans in the
    same order). ``local=True`` tunes on this rank alone with no collective
    (a layer without expert parallelism). ``default_plan`` is the plan the
    layer would run untuned (default: :meth:`Space.layer_default` of the config defaults), projected onto
    the space (:meth:`Space.project`). ``cache_dir`` enables the plan cache;
    ``backend`` (default: the space's, else ``"megakernel"``) is part of its key. ``budget_s`` bounds the measuring after
    the default and baseline plans (a plan once started is finished) and the confirmation of the
    ``confirm_top`` fastest plans and the default (``confirm_rounds`` rounds) that follows it: the
    search stops early enough to leave the confirmation its expected time (its runs at the
    finalists' medians so far)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"tune: need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if confirm_top < 0 or confirm_rounds < 1:
        raise ValueError(f"tune: need confirm_top >= 0 and confirm_rounds >= 1, got confirm_top={confirm_top}, "
                         f"confirm_rounds={confirm_rounds}")
    t0 = time.perf_counter()
    if backend is None:
        backend = space.backend or "megakernel"
    elif space.backend is not None and backend != space.backend:
        raise ValueError(f"tune: backend {backend!r} but the space walks the knobs of {space.backend!r}")
    if local:
        group = _LOCAL
    rank = _rank(group)
    if default_plan is None:
        from ..config import UniEPConfig
        default_plan = space.layer_default(UniEPConfig())
    default_plan = space.project(default_plan)
    baseline = space.baseline()
    cost_model = cost_model if cost_model is not None else estimate_ms

    # 1. Cache.
    key = cache_mod.cache_key(space.shape, space.gpu, backend, combine=space.combine) if cache_dir is not None else None
    if key is not None:
        entry = cache_mod.load(cache_dir, key, space) if rank == 0 else None
        entry = _broadcast_from_first(entry, group)
        if entry is not None:
            return TuneResult(entry.plan, entry.median_ms, default_plan, entry.default_ms, baseline, None,
                              from_cache=True, cache_file=entry.path, elapsed_s=time.perf_counter() - t0,
                              timer="cache")

    problem = space.shape_problem()
    if problem:
        raise ValueError(f"tune: no plan can run {space.shape}: {problem}")

    # 2. Order.
    valid = space.enumerate()
    index = {p: i for i, p in enumerate(valid)}
    records: Dict[Plan, PlanRecord] = {}
    for p, reason in space.table():
        if reason is not None:
            records[p] = PlanRecord(p, "rejected", -1, reason=reason)
    default_reason = space.check(default_plan)
    if default_reason is not None and default_plan not in records:
        records[default_plan] = PlanRecord(default_plan, "rejected", -1, reason=default_reason)
    for p in (default_plan, baseline):
        if p not in index and space.check(p) is None:
            index[p] = len(index)  # outside the enumerated knob values: ranks after them in ties
    estimates = {p: float(cost_model(p, space)) for p in index}
    mandatory = [p for p in dict.fromkeys((default_plan, baseline)) if p in index]
    rest = sorted((p for p in index if p not in mandatory), key=lambda p: (estimates[p], index[p]))
    order = mandatory + rest
    if not order:
        reasons = sorted({r.reason for r in records.values() if r.reason})
        raise ValueError(f"tune: no valid plan for {space.shape} in this space; rejected because: "
                         + "; ".join(reasons[:5]) + (f" (and {len(reasons) - 5} more reasons)" if len(reasons) > 5
                                                     else ""))

    # 3-4. Measure.
    clock = _Timer(timer)
    best: Optional[float] = None
    t_budget = t0  # the budget counts from the end of the mandatory plans
    confirm_runs = confirm_rounds * (warmup + repeats) if confirm_top else 0  # per finalist
    bar = _progress(len(order), f"tuning {space.shape}", progress and rank == 0)
    try:
        for pos, plan in enumerate(order):
            for _ in range(warmup):
                run_plan(plan)
            clock.sync()
            n_probe = min(probe_runs, repeats)
            times = clock.run(lambda p=plan: run_plan(p), n_probe)
            rec = PlanRecord(plan, "measured", index[plan], estimate_ms=estimates[plan])
            if best is not None and n_probe < repeats and pos >= len(mandatory):  # the mandatory plans are timed whole
                probe_ms, elapsed = _allreduce_max([statistics.median(times), time.perf_counter() - t_budget], group)
                if probe_ms > prune_ratio * best:
                    rec.status, rec.median_ms = "pruned", probe_ms
                    rec.reason = f"first {n_probe} runs {probe_ms:.3f} ms > {prune_ratio:g} x best {best:.3f} ms"
            if rec.status == "measured":
                times += clock.run(lambda p=plan: run_plan(p), repeats - n_probe)
                rec.median_ms, elapsed = _allreduce_max([statistics.median(times), time.perf_counter() - t_budget],
                                                        group)
                if best is None or rec.median_ms < best:
                    best = rec.median_ms
            records[plan] = rec
            bar.update(1)
            bar.set_postfix_str(f"best {best:.3f} ms")
            if pos + 1 == len(mandatory):
                t_budget = time.perf_counter()
            elif pos + 1 > len(mandatory) and pos + 1 < len(order):
                # The confirmation's expected time: its runs of the finalists so far at their medians (the
                # slowest rank's, so every rank stops at the same plan).
                kept = confirm_runs * sum(r.median_ms for r in _finalists(records, confirm_top, default_plan)) / 1e3
                if elapsed + kept > budget_s:
                    why = f"budget of {budget_s:g} s spent" + (
                        f" ({kept:.1f} s of it kept for the confirmation)" if confirm_runs else "")
                    for p in order[pos + 1:]:
                        records[p] = PlanRecord(p, "skipped", index[p], estimate_ms=estimates[p], reason=why)
                    break
    finally:
        bar.close()

    # 5. Confirm.
    measured = [r for r in records.values() if r.status == "measured"]
    finalists = _finalists(records, confirm_top, default_plan)
    if len(finalists) > 1:
        _confirm(finalists, run_plan, clock, warmup, repeats, confirm_rounds, group, progress and rank == 0)
    winner_rec = min(measured, key=lambda r: (r.confirmed_ms is None, r.ms, r.index))
    default_ms = _measured_ms(records.get(default_plan))
    baseline_ms = _measured_ms(records.get(baseline))
    table = sorted(records.values(), key=lambda r: (r.index < 0, r.index))
    result = TuneResult(winner_rec.plan, winner_rec.ms, default_plan, default_ms, baseline, baseline_ms,
                        records=table, elapsed_s=time.perf_counter() - t0, timer=clock.name)

    # 6. Cache write.
    if key is not None and rank == 0:
        result.cache_file = cache_mod.store(cache_dir, key, space, result.winner, result.best_ms, default_ms)
    return result


def _finalists(records: Dict[Plan, PlanRecord], top: int, default_plan: Plan) -> List[PlanRecord]:
    """The ``top`` fastest measured plans, and the default plan when measured (none when ``top`` is 0)."""
    if not top:
        return []
    measured = sorted((r for r in records.values() if r.status == "measured"), key=lambda r: (r.median_ms, r.index))
    finalists = measured[:top]
    default = records.get(default_plan)
    if default is not None and default.status == "measured" and default not in finalists:
        finalists.append(default)
    return finalists


def _measured_ms(rec: Optional[PlanRecord]) -> Optional[float]:
    return rec.ms if rec is not None and rec.status == "measured" else None


def _confirm(finalists: List[PlanRecord], run_plan: RunPlan, clock: "_Timer", warmup: int, repeats: int,
             rounds: int, group, progress: bool) -> None:
    """Time the finalists again, taking turns (the order rotated by one each round), and set each one's
    ``confirmed_ms``: the median over rounds of the slowest rank's median of ``repeats`` runs."""
    per_round: List[List[float]] = [[] for _ in finalists]
    bar = _progress(rounds * len(finalists), "confirming the fastest plans", progress)
    try:
        for r in range(rounds):
            for j in range(len(finalists)):
                i = (j + r) % len(finalists)
                plan = finalists[i].plan
                for _ in range(warmup):
                    run_plan(plan)
                clock.sync()
                times = clock.run(lambda p=plan: run_plan(p), repeats)
                per_round[i].append(_allreduce_max([statistics.median(times)], group)[0])
                bar.update(1)
    finally:
        bar.close()
    for rec, ms in zip(finalists, per_round):
        rec.confirmed_ms = statistics.median(ms)


def tune_from_config(config, shape: Shape, run_plan: RunPlan, *, gpu: Optional[GPUInfo] = None, group=None,
                     backend: str = "megakernel", progress: bool = True, local: bool = False,
                     **space_kw) -> TuneResult:
    """Tune one layer shape as the ``"uniep"`` block says (``autotune`` settings, ``max_tokens_per_rank``,
    the configured ``overlap`` as the default plan) over the knobs ``backend`` acts on. This is what a
    layer calls on its first forward with a new shape."""
    from ..config import UniEPConfig
    cfg = UniEPConfig.coerce(config)
    gpu = gpu if gpu is not None else (GPUInfo.detect() if torch.cuda.is_available() else GPUInfo.cpu())
    space = Space.from_config(cfg, shape, gpu, backend=backend, **space_kw)
    at = cfg.autotune
    return tune(space, run_plan, budget_s=at.budget_s, warmup=at.warmup, repeats=at.repeats, group=group,
                progress=progress, default_plan=space.layer_default(cfg), cache_dir=at.cache_dir, backend=backend,
                local=local, confirm_top=at.confirm_top, confirm_rounds=at.confirm_rounds)


class _NoBar:
    def update(self, n):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="plan", leave=True)
