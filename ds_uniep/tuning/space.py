"""One tuning space: every expert-parallel knob of a layer as a point.

Letters (per rank): T tokens, M hidden, F expert FFN width, E experts,
k experts per token, ep expert-parallel ranks, L = E / ep local experts.

A point is a :class:`~ds_uniep.knobs.Knobs` (``Plan`` here, the same class). A
:class:`Space` knows the layer's :class:`Shape` and the :class:`GPUInfo` and says,
for every plan, whether it can run and if not why (:meth:`Space.check`). Validity
is a pure function of (plan, shape, GPU, max_tokens_per_rank,
allow_numerics_change, backend), so every rank of a job enumerates the same points
in the same order.

Two kinds of space:

- the design space (``backend=None``): every knob at the values of
  :data:`DEFAULT_VALUES`; what ``python -m ds_uniep.tune --backend none`` lists
  and validates;
- a backend's space (``backend="megakernel"`` or ``"reference"``): only the knobs
  that backend acts on (:data:`ACTING_KNOBS`) are walked; the others are fixed at
  the sequential baseline's values (:meth:`Space.fixed_knobs`), so the tuner never
  times two plans that run the same code. ``signal_granularity``, ``tile_m`` and
  ``tile_n`` are read but kept as configured (:data:`KEPT_KNOBS`). Under
  ``compression.combine`` "rank_partials" the megakernel's plans keep to the
  schedules whose combine kernels move the rows, and the combine knobs, which that
  combine does not read, take one value.
"""

import dataclasses
import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..knobs import DISPATCH_DTYPES, EXPERT_GEMMS, GRANULARITIES, KEPT, MAX_COMM_SMS, ROLES, SCHEDULES, TILES, Knobs

Plan = Knobs
"""A point of the space: the layer's :class:`~ds_uniep.knobs.Knobs`."""

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Activation dtypes a layer runs in, with their bytes per element."""

FP8_GROUP = 128
"""Elements per fp32 scale of an FP8 row (the megakernel's dispatch needs M divisible by it)."""

ROW_ROUNDING = 64
"""Rows per expert are compared with tile_m after rounding up to this (the smallest tile)."""

MIN_GEMM_SM_FRACTION = 0.5
"""While communication runs beside the GEMM on whole SMs, the GEMM keeps at least this share of SMs
(below it the GEMM, not the transfer, sets the layer's time)."""

DEFAULT_VALUES: Dict[str, Tuple[Any, ...]] = {
    "schedule": SCHEDULES,
    "num_chunks": (2, 4, 8),
    "num_comm_sms": (8, 16, 24, 32),
    "roles": ROLES,
    "tile_m": TILES,
    "tile_n": TILES,
    "signal_granularity": GRANULARITIES,
    "dispatch_dtype": DISPATCH_DTYPES,
    "fused_dispatch": (True, False),
    "epilogue_combine": (True, False),
    "combine_chunks": (16,),
    "combine_queue": (True,),
    "expert_gemm": EXPERT_GEMMS,
}
"""The values the design space (``backend=None``) walks, per knob (``expert_gemm``: those of
:attr:`Space.gemms`). The combine's chunk count and queue stay at their defaults there; a backend's
space walks them (:data:`BACKEND_COMBINE_CHUNKS`), and ``values`` may widen them."""

COMM_SMS_VALUES = (8, 16, 24, 32, 48, 64, 80, 96, 132)
"""``num_comm_sms`` values a backend space walks, capped by the GPU's SM count (:func:`comm_sms_values`)."""

ACTING_KNOBS: Dict[str, Tuple[str, ...]] = {
    "megakernel": ("schedule", "num_chunks", "num_comm_sms", "roles", "dispatch_dtype", "fused_dispatch",
                   "epilogue_combine", "combine_chunks", "combine_queue", "expert_gemm"),
    "reference": ("dispatch_dtype",),
}
"""The knobs each backend acts on. A backend's :class:`Space` walks these and fixes the others at the
sequential baseline's values. The reference backend reads only the dispatch dtype."""

KEPT_KNOBS = KEPT
"""Knobs a backend reads but its space does not walk: :meth:`Knobs.apply` keeps the config's values
(set or unset) in every plan it applies."""

BUILT_SCHEDULES = ("sequential", "pipelined", "fused")
"""The schedules the megakernel runs. A backend space walks the fused one only for layers it can run
for (:meth:`Space.built_schedules`: ds_uniep's grouped GEMM, bf16); elsewhere it runs as sequential."""

BACKEND_CHUNKS = (2, 4)
"""``num_chunks`` values a backend space walks for the pipelined schedule."""

BACKEND_COMBINE_CHUNKS = (4, 8, 16)
"""``combine_chunks`` values a backend space walks where the combine kernels move the rows (each with
and without ``combine_queue``)."""


def comm_sms_values(num_sms: int) -> Tuple[int, ...]:
    """:data:`COMM_SMS_VALUES` capped by ``num_sms`` (and :data:`~ds_uniep.knobs.MAX_COMM_SMS`), without
    repeats."""
    cap = min(num_sms, MAX_COMM_SMS)
    return tuple(sorted({min(v, cap) for v in COMM_SMS_VALUES}))


def _one_of(name: str, v: Any, allowed: Sequence[Any]) -> None:
    if v not in allowed or isinstance(v, bool):
        raise ValueError(f"Space.{name}: must be one of {', '.join(map(str, allowed))}, got {v!r}")


@dataclass(frozen=True)
class Shape:
    """A layer's per-rank shape: T tokens, M hidden, F expert FFN, E experts, k, activation dtype, ep ranks."""

    T: int
    M: int
    F: int
    E: int
    k: int
    dtype: str = "bf16"
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("T", "M", "F", "E", "k", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Shape.{name}: must be a positive integer, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape.dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.E % self.ep:
            raise ValueError(f"Shape: E={self.E} experts do not divide over ep={self.ep} ranks")
        if self.k > self.E:
            raise ValueError(f"Shape: k={self.k} is larger than E={self.E}")

    @property
    def num_local_experts(self) -> int:
        return self.E // self.ep

    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def rows_per_expert(self) -> int:
        """Rows one local expert receives on average: T*k rows leave each of ep ranks, spread over E experts."""
        return math.ceil(self.T * self.k * self.ep / self.E)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"T={self.T} M={self.M} F={self.F} E={self.E} k={self.k} {self.dtype} ep={self.ep}"


@dataclass(frozen=True)
class GPUInfo:
    """What validity depends on: the SM count and the shared memory one block may use (opt-in maximum)."""

    name: str
    num_sms: int
    smem_per_block: int

    @classmethod
    def detect(cls, device=None) -> "GPUInfo":
        """The GPU of ``device`` (default: the current CUDA device); raises when CUDA is absent."""
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("GPUInfo.detect: CUDA is not available; use GPUInfo.preset(...) for a stand-in")
        p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        smem = getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0)
        return cls(p.name, int(p.multi_processor_count), int(smem))

    @classmethod
    def preset(cls, name: str) -> "GPUInfo":
        """A stand-in for enumerating a GPU's space on a machine without it (see :data:`GPU_PRESETS`)."""
        try:
            return GPU_PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown GPU preset {name!r}; known: {', '.join(GPU_PRESETS)}") from None

    @classmethod
    def cpu(cls) -> "GPUInfo":
        """The stand-in used where no GPU exists: H100-sized limits under a name no real GPU reports."""
        return GPU_PRESETS["cpu"]


_HOPPER_SMEM_OPTIN = 227 * 1024
GPU_PRESETS: Dict[str, GPUInfo] = {
    "h100": GPUInfo("NVIDIA H100 80GB HBM3 (stand-in)", 132, _HOPPER_SMEM_OPTIN),
    "h200": GPUInfo("NVIDIA H200 (stand-in)", 132, _HOPPER_SMEM_OPTIN),
    "cpu": GPUInfo("cpu (H100-sized stand-in)", 132, _HOPPER_SMEM_OPTIN),
}


class Space:
    """The valid plans for one layer shape on one GPU and ep size.

    ``backend`` (None, ``"megakernel"`` or ``"reference"``) picks the knobs
    walked: None walks the design space (:data:`DEFAULT_VALUES`); a backend
    walks its :data:`ACTING_KNOBS` and fixes the others (:meth:`fixed_knobs`).
    ``values`` narrows or widens any knob (a mapping from a :class:`Plan` field
    to the values to try). ``dispatch_dtype`` is the configured one: without
    ``allow_numerics_change`` every plan keeps it, so tuning never changes the
    numbers the config asked for. :meth:`check` judges any plan, enumerated or not.
    """

    def __init__(self, shape: Shape, gpu: GPUInfo, ep: Optional[int] = None, max_tokens_per_rank: int = 8192,
                 allow_numerics_change: bool = False, values: Optional[Mapping[str, Sequence[Any]]] = None,
                 backend: Optional[str] = None, dispatch_dtype: str = "activation", expert_gemm: str = "torch",
                 combine: str = "slots", gemms: Optional[Sequence[str]] = None):
        if ep is not None and ep != shape.ep:
            raise ValueError(f"Space: ep={ep} disagrees with the shape's ep={shape.ep}")
        unknown = set(values or {}) - set(DEFAULT_VALUES)
        if unknown:
            raise ValueError(f"Space: unknown knobs {sorted(unknown)}; knobs are {', '.join(DEFAULT_VALUES)}")
        if backend is not None and backend not in ACTING_KNOBS:
            raise ValueError(f"Space: backend must be None or one of {', '.join(ACTING_KNOBS)}, got {backend!r}")
        _one_of("dispatch_dtype", dispatch_dtype, DISPATCH_DTYPES)
        self.dispatch_dtype = dispatch_dtype
        _one_of("combine", combine, ("slots", "rank_partials"))
        #: compression.combine: under "rank_partials" the megakernel runs only plans whose combine kernels
        #: move the rows (Plan.runs_combine_kernels)
        self.combine = combine
        _one_of("expert_gemm", expert_gemm, EXPERT_GEMMS)
        #: the configured grouped GEMM: a backend's baseline plan runs it
        self.expert_gemm = expert_gemm
        #: the grouped GEMMs the megakernel's space walks (``expert_gemm``): those the layer can run
        #: (default: the configured one only). ds_uniep's runs bf16 rows only; at other dtypes the
        #: experts do not run as grouped GEMMs, and only the configured one is walked.
        gemms = (expert_gemm, ) if gemms is None else tuple(gemms)
        for g in gemms:
            _one_of("expert_gemm", g, EXPERT_GEMMS)
        if expert_gemm not in gemms:
            raise ValueError(f"Space: the configured expert_gemm {expert_gemm!r} is not among gemms {gemms}")
        self.gemms = gemms if shape.dtype == "bf16" else (expert_gemm, )
        self.shape = shape
        self.gpu = gpu
        self.ep = shape.ep
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.allow_numerics_change = bool(allow_numerics_change)
        self.backend = backend
        walked = dict(DEFAULT_VALUES, expert_gemm=self.gemms) if backend is None else self._backend_values()
        self.values = {k: tuple((values or {}).get(k, v)) for k, v in walked.items()}

    @classmethod
    def from_config(cls, config, shape: Shape, gpu: GPUInfo, **kw) -> "Space":
        from ..config import UniEPConfig
        cfg = UniEPConfig.coerce(config)
        kw.setdefault("dispatch_dtype", cfg.compression.dispatch_dtype)
        kw.setdefault("expert_gemm", cfg.expert_gemm)
        kw.setdefault("combine", cfg.compression.combine)
        if kw.get("gemms") is not None and kw["expert_gemm"] not in kw["gemms"]:
            raise ValueError(f'Space.from_config: "expert_gemm": {kw["expert_gemm"]!r} is configured but the layer '
                             f"can run only {tuple(kw['gemms'])}")
        return cls(shape, gpu, shape.ep, cfg.max_tokens_per_rank, cfg.autotune.allow_numerics_change, **kw)

    def for_backend(self, backend: Optional[str], gemms: Optional[Sequence[str]] = None) -> "Space":
        """The same shape, GPU and settings, walking what ``backend`` acts on (None: the design space),
        and the grouped GEMMs ``gemms`` (default: this space's)."""
        return Space(self.shape, self.gpu, self.ep, self.max_tokens_per_rank, self.allow_numerics_change,
                     backend=backend, dispatch_dtype=self.dispatch_dtype, expert_gemm=self.expert_gemm,
                     combine=self.combine, gemms=self.gemms if gemms is None else gemms)

    # ------------------------------------------------------------------ knobs
    def acting_knobs(self) -> Tuple[str, ...]:
        """The knobs this space walks because its backend acts on them (all of them for the design space)."""
        return tuple(DEFAULT_VALUES) if self.backend is None else ACTING_KNOBS[self.backend]

    def fixed_knobs(self) -> Dict[str, Any]:
        """Knobs the backend does not act on yet, with the value they are fixed at (the sequential
        baseline's: valid at every shape); empty for the design space."""
        if self.backend is None:
            return {}
        base = self.baseline().to_dict()
        return {k: base[k] for k in DEFAULT_VALUES if k not in ACTING_KNOBS[self.backend]}

    def layer_default(self, config) -> Plan:
        """The plan a layer under ``config`` runs untuned, as a point of this space: the configured
        knobs (``UniEPConfig.knobs()``), projected (:meth:`project`). Where the layer runs the
        sequential schedule instead of the configured fused one (torch's GEMM, or a space without the
        fused schedule), the plan is the sequential one with the block's combine knobs and the copy
        kernels on every SM. On a backend that acts on ``num_comm_sms``, the sequential schedule's
        unset ``num_comm_sms`` (one block per SM) is this GPU's SM count."""
        from ..config import UniEPConfig
        cfg = UniEPConfig.coerce(config)
        configured = cfg.knobs()
        plan = self.project(configured)
        if configured.schedule == "fused" and (cfg.expert_gemm != "uniep" or plan.schedule != "fused"):
            plan = self.project(cfg.knobs(schedule="sequential", num_comm_sms=None))
        if self.backend is not None and "num_comm_sms" in ACTING_KNOBS[self.backend] and \
                plan.num_comm_sms is None and plan.schedule == "sequential":
            plan = plan.replace(num_comm_sms=min(self.gpu.num_sms, MAX_COMM_SMS))
        return plan

    def project(self, plan: Plan) -> Plan:
        """``plan`` with the knobs the backend does not act on set to their fixed values (and a schedule
        it does not run set to the sequential one, which is what runs): the plan that runs the same code
        and is a point of this space (unchanged for the design space)."""
        fixed = self.fixed_knobs()
        if self.backend is not None and plan.expert_gemm not in self.gemms:
            fixed["expert_gemm"] = self.expert_gemm  # the GEMM the layer runs
        if self.backend is not None and "schedule" in ACTING_KNOBS[self.backend] and \
                plan.schedule not in self.built_schedules():
            fixed["schedule"] = "sequential"
        return plan.replace(**fixed) if fixed else plan

    def built_schedules(self) -> Tuple[str, ...]:
        """The schedules the backend runs for this layer: the fused one needs ds_uniep's grouped GEMM
        (its first GEMM waits for rows inside it) and bf16 rows; the sequential one runs instead."""
        if "uniep" in self.gemms and self.shape.dtype == "bf16":
            return BUILT_SCHEDULES
        return tuple(s for s in BUILT_SCHEDULES if s != "fused")

    def _backend_values(self) -> Dict[str, Tuple[Any, ...]]:
        walked = {"schedule": self.built_schedules(), "num_chunks": BACKEND_CHUNKS,
                  "num_comm_sms": comm_sms_values(self.gpu.num_sms), "dispatch_dtype": DISPATCH_DTYPES,
                  "fused_dispatch": (True, False), "epilogue_combine": (True, False), "roles": ROLES,
                  "combine_chunks": BACKEND_COMBINE_CHUNKS, "combine_queue": (False, True), "expert_gemm": self.gemms}
        if self.combine == "rank_partials":  # its combine pushes, then sums: neither knob is read
            base = self.baseline()
            walked["combine_chunks"], walked["combine_queue"] = (base.combine_chunks,), (base.combine_queue,)
        out = {k: (v,) for k, v in self.fixed_knobs().items()}
        out.update({k: walked[k] for k in ACTING_KNOBS[self.backend]})
        return {k: out[k] for k in DEFAULT_VALUES}

    # ------------------------------------------------------------------ validity
    def min_gemm_sms(self) -> int:
        return math.ceil(self.gpu.num_sms * MIN_GEMM_SM_FRACTION)

    def shape_problem(self) -> Optional[str]:
        """Why no plan at all can run this shape (the symmetric buffer is sized by the config), or None.
        The reference backend has no symmetric buffer, so it has no such limit."""
        if self.backend != "reference" and self.shape.T > self.max_tokens_per_rank:
            return (f"symmetric buffer too small: T={self.shape.T} tokens per rank > max_tokens_per_rank="
                    f"{self.max_tokens_per_rank} (raise uniep.max_tokens_per_rank)")
        return None

    def check(self, plan: Plan) -> Optional[str]:
        """None when ``plan`` can run here, else every reason it cannot, joined by ``"; "``."""
        s, g = self.shape, self.gpu
        reasons: List[str] = []
        problem = self.shape_problem()
        if problem:
            reasons.append(problem)
        sms = plan.num_comm_sms  # None: the copy kernels take every SM, nothing runs beside them on SMs
        if sms is None:
            pass
        elif plan.schedule == "sequential":
            # Nothing runs beside the copy kernels: they may take every SM.
            if sms > g.num_sms:
                reasons.append(f"SM budget exceeded: num_comm_sms={sms} > {g.num_sms} SMs on {g.name}")
        elif sms >= g.num_sms:
            reasons.append(f"SM budget exceeded: num_comm_sms={sms} >= {g.num_sms} SMs on {g.name}")
        elif self.comm_shares_sms(plan) and g.num_sms - sms < self.min_gemm_sms():
            reasons.append(f"SM budget exceeded: the GEMM is left {g.num_sms - sms} of {g.num_sms} "
                           f"SMs, fewer than {self.min_gemm_sms()} ({MIN_GEMM_SM_FRACTION:.0%})")
        rows = _round_up(s.rows_per_expert, ROW_ROUNDING)
        if plan.tile_m is not None and plan.tile_m > rows:
            reasons.append(f"tile larger than the rows: tile_m={plan.tile_m} > {rows} rows per expert "
                           f"(T*k*ep/E = {s.rows_per_expert}, rounded up to {ROW_ROUNDING})")
        if plan.schedule == "pipelined" and plan.num_chunks < 2:
            reasons.append("pipelined with 1 chunk: the sequential schedule with extra launches (num_chunks >= 2)")
        if plan.schedule == "pipelined" and plan.num_chunks > s.T:
            reasons.append(f"more chunks than tokens: num_chunks={plan.num_chunks} > T={s.T}")
        if plan.schedule == "pipelined" and plan.num_chunks > s.num_local_experts:
            reasons.append(f"more chunks than local experts: num_chunks={plan.num_chunks} > E/ep="
                           f"{s.num_local_experts} (a chunk is whole experts; the schedule would run fewer)")
        if plan.schedule == "fused" and not (plan.fused_dispatch or plan.epilogue_combine):
            reasons.append("the fused schedule with neither its dispatch nor its combine fused runs the sequential "
                           "one (fused_dispatch or epilogue_combine)")
        if plan.schedule == "fused" and self.backend == "megakernel":
            if plan.dispatch_dtype != "activation":
                reasons.append("the fused schedule moves activation rows: FP8 rows are dequantized on arrival "
                               f"(dispatch_dtype={plan.dispatch_dtype})")
            if "fused" not in self.built_schedules():
                reasons.append('the fused schedule needs ds_uniep\'s grouped GEMM ("expert_gemm": "uniep") and '
                               f"bf16 rows (the layer runs {'/'.join(self.gemms)}, dtype={self.shape.dtype})")
        if self.backend is not None and plan.expert_gemm not in self.gemms:
            reasons.append(f"expert_gemm {plan.expert_gemm} is not a GEMM this layer runs here "
                           f"({'/'.join(self.gemms)})")
        if self.combine == "rank_partials" and self.backend == "megakernel" and not plan.runs_combine_kernels():
            reasons.append("compression.combine 'rank_partials' runs in the combine kernels: the sequential schedule "
                           f"or the fused one without epilogue_combine (schedule={plan.schedule}, "
                           f"epilogue_combine={plan.epilogue_combine})")
        if plan.dispatch_dtype == "fp8_e4m3" and self.backend == "megakernel" and s.M % FP8_GROUP:
            reasons.append(f"FP8 rows need the hidden size divisible by {FP8_GROUP}: M={s.M}")
        if plan.dispatch_dtype != self.dispatch_dtype and not self.allow_numerics_change:
            reasons.append(f"numerics change not allowed: dispatch_dtype={plan.dispatch_dtype} changes the numbers "
                           f"of the configured {self.dispatch_dtype} (set uniep.autotune.allow_numerics_change to "
                           "explore it)")
        return "; ".join(reasons) if reasons else None

    def comm_shares_sms(self, plan: Plan) -> bool:
        """Whether communication holds whole SMs while the GEMM runs (so the GEMM gets the rest only):
        the fused schedule's dispatch in partitioned roles, and the pipelined schedule on ds_uniep's GEMM
        with ``num_comm_sms`` set (SM-store copies beside it). Otherwise the pipelined schedule moves rows
        with the copy engines and its dispatch kernels run alone."""
        if plan.schedule == "pipelined":
            return plan.expert_gemm == "uniep" and plan.num_comm_sms is not None
        return plan.schedule == "fused" and plan.fused_dispatch and plan.roles == "partitioned"

    def is_valid(self, plan: Plan) -> bool:
        return self.check(plan) is None

    # ------------------------------------------------------------------ points
    def baseline(self) -> Plan:
        """The sequential plan, tiles left to the GEMM: valid whenever :meth:`shape_problem` is None
        (the sequential schedule never runs communication beside the GEMM, so only
        ``num_comm_sms <= num_sms`` binds). Its dispatch dtype and GEMM are the configured ones: the
        baseline's numbers are the ones every plan keeps."""
        sms = min(16, max(1, self.gpu.num_sms - 1))
        return Plan(schedule="sequential", num_comm_sms=sms, dispatch_dtype=self.dispatch_dtype,
                    expert_gemm=self.expert_gemm)

    def candidates(self) -> Iterator[Plan]:
        """Every distinct plan the knob values make, valid or not, in a fixed order."""
        seen = set()
        names = list(DEFAULT_VALUES)
        for combo in itertools.product(*(self.values[n] for n in names)):
            plan = Plan(**dict(zip(names, combo)))
            if plan in seen:
                continue
            seen.add(plan)
            yield plan

    def enumerate(self) -> List[Plan]:
        """Valid plans only, in :meth:`candidates` order (the tie-break order of the tuner)."""
        return [p for p in self.candidates() if self.check(p) is None]

    def table(self) -> List[Tuple[Plan, Optional[str]]]:
        """(plan, reason or None) for every candidate."""
        return [(p, self.check(p)) for p in self.candidates()]

    def digest(self) -> str:
        """Hash of the valid plans and the GPU limits: a cached winner from a different space is stale."""
        h = hashlib.sha256()
        h.update(json.dumps(dataclasses.asdict(self.gpu), sort_keys=True).encode())
        h.update(str(self.backend).encode())
        for p in self.enumerate():
            h.update(p.key().encode())
        return h.hexdigest()[:16]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
