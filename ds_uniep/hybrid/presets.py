"""MoE shapes, bandwidth strings and the workload they give the cost model.

Letters: M hidden, F expert FFN width, E experts, k experts per token, T
tokens per rank. Experts are SwiGLU (three ``[M, F]`` matrices), weights and
activations bf16 (2 bytes) unless said otherwise.
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, Optional

from .model import GBPS, Workload

DEFAULT_TFLOPS = 400.0
"""Assumed dense bf16 rate (TFLOP/s) when compute times are not given: between
the ~550 TFLOP/s forward and ~330 TFLOP/s backward grouped GEMMs measured on H200."""

_BANDWIDTH_UNITS: Dict[str, float] = {
    "bytes/s": 1.0, "B/s": 1.0,
    "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
    "bps": 0.125, "Kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": GBPS, "Tbps": 1e12 / 8,
}


def parse_bandwidth(text: str) -> float:
    """``"10Gbps"`` -> 1.25e9 bytes/s. Units are case-sensitive (``Gb`` bits, ``GB`` bytes): one of
    bytes/s, B/s, KB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s, bps, Kbps, Mbps, Gbps, Tbps; ``inf`` alone
    means an infinitely fast link."""
    s = str(text).strip()
    if s.lower() in ("inf", "infinity"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(\S*)", s)
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected a number and a unit, e.g. 10Gbps or 400GB/s")
    value, unit = float(m.group(1)), m.group(2)
    if unit not in _BANDWIDTH_UNITS:
        raise ValueError(f"bandwidth {text!r}: unknown unit {unit!r}; use one of {', '.join(_BANDWIDTH_UNITS)}")
    if value <= 0:
        raise ValueError(f"bandwidth {text!r}: must be positive")
    return value * _BANDWIDTH_UNITS[unit]


def format_bandwidth(bytes_per_s: float) -> str:
    if math.isinf(bytes_per_s):
        return "inf"
    return f"{bytes_per_s / GBPS:g} Gbps ({bytes_per_s / 1e9:g} GB/s)"


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    tokens_per_rank: int
    bytes_per_value: int = 2

    def __post_init__(self):
        for f in ("hidden", "ffn", "num_experts", "top_k", "tokens_per_rank", "bytes_per_value"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEShape.{f}: must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEShape.top_k: {self.top_k} exceeds num_experts {self.num_experts}")

    @property
    def token_bytes(self) -> int:
        """D = T * k * M * bytes: one rank's dispatch payload."""
        return self.tokens_per_rank * self.top_k * self.hidden * self.bytes_per_value

    @property
    def expert_bytes(self) -> int:
        """3 * M * F * bytes: one SwiGLU expert."""
        return 3 * self.hidden * self.ffn * self.bytes_per_value

    @property
    def expert_flops(self) -> float:
        """Forward FLOPs of one rank's expert work: 2 * 3 * M * F per routed token copy."""
        return 2.0 * 3 * self.hidden * self.ffn * self.tokens_per_rank * self.top_k

    @property
    def pre_expert_flops(self) -> float:
        """Forward FLOPs before the router, taken as the attention projections (2 * T * 4 * M^2).

        A rough stand-in; give the measured time where it matters."""
        return 2.0 * self.tokens_per_rank * 4 * self.hidden * self.hidden

    def workload(self, num_ranks: int, tflops: float = DEFAULT_TFLOPS, num_microbatches: int = 1,
                 pre_expert_s: Optional[float] = None, expert_s: Optional[float] = None,
                 experts_per_rank: Optional[float] = None, returns_every_microbatch: bool = False) -> Workload:
        """Workload of one rank; compute times from ``tflops`` unless given (seconds)."""
        rate = tflops * 1e12
        return Workload(
            token_bytes=float(self.token_bytes), expert_bytes=float(self.expert_bytes),
            experts_per_rank=self.num_experts / num_ranks if experts_per_rank is None else experts_per_rank,
            pre_expert_compute_s=self.pre_expert_flops / rate if pre_expert_s is None else pre_expert_s,
            expert_compute_s=self.expert_flops / rate if expert_s is None else expert_s,
            num_microbatches=num_microbatches, returns_every_microbatch=returns_every_microbatch)


PRESETS: Dict[str, MoEShape] = {
    "mixtral-like": MoEShape("mixtral-like", hidden=4096, ffn=14336, num_experts=8, top_k=2, tokens_per_rank=8192),
    "dsv2lite-like": MoEShape("dsv2lite-like", hidden=2048, ffn=1408, num_experts=64, top_k=6,
                              tokens_per_rank=8192),
    "dsv3-like": MoEShape("dsv3-like", hidden=7168, ffn=2048, num_experts=256, top_k=8, tokens_per_rank=4096),
    # A layer small enough that its fixed costs (host work, synchronisations, launches) dominate.
    "small-like": MoEShape("small-like", hidden=1024, ffn=2048, num_experts=16, top_k=2, tokens_per_rank=512),
}
"""The shapes of docs/performance.md (dsv3-like with its 256 experts of EP 8 and wider)."""

_SHAPE_KEYS = {"hidden": "hidden", "M": "hidden", "ffn": "ffn", "F": "ffn", "experts": "num_experts",
               "E": "num_experts", "topk": "top_k", "k": "top_k", "tokens": "tokens_per_rank", "T": "tokens_per_rank",
               "bytes": "bytes_per_value"}


def parse_shape(text: str) -> MoEShape:
    """A preset name, or explicit sizes ``hidden=4096,ffn=14336,experts=8,topk=2,tokens=8192[,bytes=2]``."""
    if text in PRESETS:
        return PRESETS[text]
    if "=" not in text:
        raise ValueError(f"model {text!r}: not a preset ({', '.join(PRESETS)}) nor explicit sizes "
                         "like hidden=4096,ffn=14336,experts=8,topk=2,tokens=8192")
    kw = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in _SHAPE_KEYS:
            raise ValueError(f"model {text!r}: unknown size {key!r}; use {', '.join(sorted(set(_SHAPE_KEYS)))}")
        try:
            kw[_SHAPE_KEYS[key]] = int(value)
        except ValueError:
            raise ValueError(f"model {text!r}: {key} must be an integer, got {value!r}") from None
    missing = {"hidden", "ffn", "num_experts", "top_k", "tokens_per_rank"} - set(kw)
    if missing:
        raise ValueError(f"model {text!r}: missing {', '.join(sorted(missing))}")
    return MoEShape("custom", **kw)
