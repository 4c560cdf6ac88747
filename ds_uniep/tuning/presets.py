"""The three layer shapes of docs/performance.md (per rank), as :class:`Shape` for a given ep."""

from ..hybrid.presets import PRESETS
from .space import Shape

PRESET_NAMES = tuple(PRESETS)


def num_experts_at(name: str, ep: int) -> int:
    """``dsv3-like`` has 32 experts up to ep=4 and 256 from ep=8 on, as benchmarked; others their own."""
    if name == "dsv3-like" and ep <= 4:
        return 32
    return PRESETS[name].num_experts


def preset_shape(name: str, ep: int = 1, dtype: str = "bf16") -> Shape:
    """One of the shapes of docs/performance.md (``ds_uniep.hybrid.presets.PRESETS``) at ``ep``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    p = PRESETS[name]
    return Shape(T=p.tokens_per_rank, M=p.hidden, F=p.ffn, E=num_experts_at(name, ep), k=p.top_k, dtype=dtype,
                 ep=ep)


def parse_shape(text: str, ep: int = 1, dtype: str = "bf16") -> Shape:
    """``"T,M,F,E,k"`` -> Shape."""
    parts = text.split(",")
    try:
        T, M, F, E, k = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected five integers T,M,F,E,k (tokens per rank, hidden, "
                         "expert FFN, experts, top-k)") from None
    return Shape(T=T, M=M, F=F, E=E, k=k, dtype=dtype, ep=ep)
