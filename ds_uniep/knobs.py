"""The expert-parallel knobs of one layer, as one value: :class:`Knobs`.

``UniEPConfig.knobs()`` reads them from the ``uniep`` block (``overlap`` plus
``compression.dispatch_dtype`` and ``expert_gemm``), :meth:`Knobs.apply` writes
them back into a config, and the tuner (:mod:`ds_uniep.tuning`) walks them as the
points of its space. The allowed values and integer ranges live here only: the
config's fields validate through :func:`check`.

This module imports nothing but the standard library.
"""

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

SCHEDULES = ("sequential", "pipelined", "fused")
ROLES = ("partitioned", "interleaved")
GRANULARITIES = ("tile", "expert", "rank")
TILES = (64, 128, 256)
DISPATCH_DTYPES = ("activation", "fp8_e4m3")
EXPERT_GEMMS = ("torch", "uniep")
"""The grouped GEMMs the experts run on: ``torch._grouped_mm`` or ds_uniep's own (Hopper, bf16). Both
give the same bits (see :mod:`ds_uniep.gemm`), so choosing between them is a speed choice."""

MAX_CHUNKS = 64
"""Largest ``num_chunks`` of the pipelined schedule."""
MAX_COMM_SMS = 132
"""Largest ``num_comm_sms``."""
MAX_COMBINE_CHUNKS = 64
"""Largest ``combine_chunks`` (``kMaxCombineChunks`` of ops/csrc/configs.cuh)."""
FUSED_COMM_SMS = 20
"""SMs the fused schedule's dispatch takes in partitioned roles when ``num_comm_sms`` is unset."""
DEFAULT_TILE = 128
"""The tile side ds_uniep's GEMM takes for ``tile_m`` or ``tile_n`` left unset while the other is set."""

CHOICES: Dict[str, Tuple[Any, ...]] = {
    "schedule": SCHEDULES,
    "roles": ROLES,
    "signal_granularity": GRANULARITIES,
    "tile_m": TILES,
    "tile_n": TILES,
    "dispatch_dtype": DISPATCH_DTYPES,
    "expert_gemm": EXPERT_GEMMS,
}
"""Knobs that take one of a few values."""

RANGES: Dict[str, Tuple[int, int]] = {
    "num_chunks": (1, MAX_CHUNKS),
    "num_comm_sms": (1, MAX_COMM_SMS),
    "combine_chunks": (0, MAX_COMBINE_CHUNKS),
}
"""Integer knobs and their inclusive ranges."""

FLAGS = ("fused_dispatch", "epilogue_combine", "combine_queue")
"""Knobs that are True or False."""

OPTIONAL = ("num_comm_sms", "tile_m", "tile_n")
"""Knobs that may be None (unset)."""

CONFIG_ONLY = ("dispatch_dtype", "expert_gemm")
"""Knobs that live outside the ``overlap`` block (``compression.dispatch_dtype``, ``expert_gemm``)."""


def check(name: str, value: Any) -> Any:
    """``value`` if it is allowed for knob ``name``, else ValueError saying what is allowed."""
    if value is None and name in OPTIONAL:
        return value
    if name in FLAGS:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
    elif name in CHOICES:
        if isinstance(value, bool) or value not in CHOICES[name]:
            raise ValueError(f"must be one of {', '.join(map(str, CHOICES[name]))}, got {value!r}")
    elif name in RANGES:
        lo, hi = RANGES[name]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {value!r}")
    else:
        raise ValueError(f"unknown knob {name!r}")
    return value


@dataclass(frozen=True)
class Knobs:
    """How a layer overlaps, tiles and compresses, and which grouped GEMM runs its experts.

    ``None`` leaves a knob unset: ``num_comm_sms`` None gives the copy kernels one
    block per SM (and the fused dispatch in partitioned roles :data:`FUSED_COMM_SMS`
    SMs); ``tile_m``/``tile_n`` None lets ds_uniep's GEMM pick its tile.

    Knobs that mean nothing under the chosen schedule are normalised so that two
    values that run the same way compare and hash equal: ``num_chunks`` is 1 unless
    ``schedule == "pipelined"``; ``fused_dispatch`` and ``epilogue_combine`` are True
    unless ``schedule == "fused"``, whose first GEMM runs on ds_uniep's GEMM
    (``expert_gemm`` "uniep"); ``roles`` is "partitioned" and ``signal_granularity``
    "tile" unless the fused dispatch runs; under the fused schedule ``num_comm_sms`` is
    what its dispatch takes (:data:`FUSED_COMM_SMS` when unset) in partitioned roles
    and None otherwise (its copy kernels run on every SM); ``combine_chunks`` and
    ``combine_queue`` are 16 and True where the combine kernels do not move the rows
    (:meth:`runs_combine_kernels`), and ``combine_queue`` is False with
    ``combine_chunks`` 0.
    """

    schedule: str = "sequential"
    num_chunks: int = 2
    num_comm_sms: Optional[int] = None
    roles: str = "interleaved"
    signal_granularity: str = "tile"
    fused_dispatch: bool = True
    epilogue_combine: bool = True
    combine_chunks: int = 16
    combine_queue: bool = True
    tile_m: Optional[int] = None
    tile_n: Optional[int] = None
    dispatch_dtype: str = "activation"
    expert_gemm: str = "torch"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            try:
                check(f.name, getattr(self, f.name))
            except ValueError as e:
                raise ValueError(f"Knobs.{f.name}: {e}") from None
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        fused = self.schedule == "fused"
        if self.schedule != "pipelined":
            put("num_chunks", 1)
        if fused:
            put("expert_gemm", "uniep")
        else:
            put("fused_dispatch", True)
            put("epilogue_combine", True)
        if not (fused and self.fused_dispatch):
            put("signal_granularity", "tile")
            put("roles", "partitioned")
        if fused:
            partitioned = self.fused_dispatch and self.roles == "partitioned"
            put("num_comm_sms", (self.num_comm_sms or FUSED_COMM_SMS) if partitioned else None)
        if not self.runs_combine_kernels():
            put("combine_chunks", 16)
            put("combine_queue", True)
        elif self.combine_chunks == 0:
            put("combine_queue", False)

    def runs_combine_kernels(self) -> bool:
        """Whether the combine kernels (``combine_chunks``, ``combine_queue``) move the output rows and
        the input gradient's: the sequential schedule, and the fused one without its epilogues (the
        pipelined schedule copies chunks back by itself; the epilogues store the rows)."""
        return self.schedule == "sequential" or (self.schedule == "fused" and not self.epilogue_combine)

    def gemm_tiles(self) -> Optional[Tuple[int, int]]:
        """``(tile_m, tile_n)`` for ds_uniep's GEMM when either is set (the other :data:`DEFAULT_TILE`),
        else None (the GEMM picks its tiles)."""
        if self.tile_m is None and self.tile_n is None:
            return None
        return (self.tile_m or DEFAULT_TILE, self.tile_n or DEFAULT_TILE)

    # ------------------------------------------------------------------ forms
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Knobs":
        """Inverse of :meth:`to_dict`; unknown or missing keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, Mapping) or set(d) != names:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"knobs need exactly the keys {sorted(names)}, got {got}")
        return cls(**d)

    def key(self) -> str:
        """Stable text naming these knobs (the same on every rank, run and version of Python)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def label(self) -> str:
        """Short human form for tables and plots."""
        s = {"sequential": "seq", "pipelined": f"pipe{self.num_chunks}", "fused": "fused"}[self.schedule]
        if self.schedule == "fused":
            parts = ("d" if self.fused_dispatch else "") + ("e" if self.epilogue_combine else "")
            s += f"[{parts}]/{self.roles[:5]}/{self.signal_granularity}"
        s += f" sm{'-' if self.num_comm_sms is None else self.num_comm_sms}"
        if self.gemm_tiles() is not None:
            s += " {}x{}".format(*self.gemm_tiles())
        if self.runs_combine_kernels():
            s += f" c{self.combine_chunks}" + ("q" if self.combine_queue else "")
        if self.dispatch_dtype != "activation":
            s += " fp8"
        if self.expert_gemm != "torch" and self.schedule != "fused":
            s += " uniep"
        return s

    def replace(self, **changes) -> "Knobs":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ config
    @classmethod
    def from_config(cls, config, **changes) -> "Knobs":
        """The knobs a :class:`~ds_uniep.config.UniEPConfig` names, with ``changes`` applied before they
        are normalised (``from_config(cfg, schedule="sequential")`` keeps the block's combine knobs,
        which the fused schedule's epilogues would normalise away)."""
        if not hasattr(config, "overlap"):
            raise TypeError(f"Knobs.from_config takes a UniEPConfig, got {type(config).__name__} "
                            "(UniEPConfig.coerce(...) reads a dict or a ds_config path)")
        o = config.overlap
        values = {f.name: getattr(o, f.name) for f in dataclasses.fields(cls) if f.name not in CONFIG_ONLY}
        values.update(dispatch_dtype=config.compression.dispatch_dtype, expert_gemm=config.expert_gemm)
        values.update(changes)
        return cls(**values)

    def apply(self, config):
        """A copy of ``config`` (a UniEPConfig) running these knobs; every other field is kept. The tile
        sizes and signal granularity are kept from ``config`` (:data:`KEPT`): the tuner does not walk
        them, so applying a tuned plan neither sets nor changes them."""
        overlap = config.overlap
        kept = {k: getattr(overlap, k) for k in KEPT if k in overlap.model_fields_set}
        knobs = self.replace(**kept)  # normalised as these knobs run
        d = {k: v for k, v in knobs.to_dict().items() if k not in CONFIG_ONLY and (k not in KEPT or k in kept)}
        new_overlap = type(overlap)(timeout_s=overlap.timeout_s, **d)
        compression = config.compression.model_copy(update={"dispatch_dtype": self.dispatch_dtype})
        return config.model_copy(update={"overlap": new_overlap, "compression": compression,
                                         "expert_gemm": self.expert_gemm})


KEPT = ("tile_m", "tile_n", "signal_granularity")
"""Knobs :meth:`Knobs.apply` keeps from the config (set or unset) rather than writing."""
