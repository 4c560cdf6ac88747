"""The three layer shapes of BENCHMARKS.md (per rank), as :class:`Shape` for a given ep."""

from .space import Shape

PRESET_NAMES = ("mixtral-like", "dsv2lite-like", "dsv3-like")


def preset_shape(name: str, ep: int = 1, dtype: str = "bf16") -> Shape:
    """``dsv3-like`` has 32 experts up to ep=4 and 256 from ep=8 on, as benchmarked."""
    if name == "mixtral-like":
        return Shape(T=8192, M=4096, F=14336, E=8, k=2, dtype=dtype, ep=ep)
    if name == "dsv2lite-like":
        return Shape(T=8192, M=2048, F=1408, E=64, k=6, dtype=dtype, ep=ep)
    if name == "dsv3-like":
        return Shape(T=4096, M=7168, F=2048, E=32 if ep <= 4 else 256, k=8, dtype=dtype, ep=ep)
    raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")


def parse_shape(text: str, ep: int = 1, dtype: str = "bf16") -> Shape:
    """``"T,M,F,E,k"`` -> Shape."""
    parts = text.split(",")
    try:
        T, M, F, E, k = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected five integers T,M,F,E,k (tokens per rank, hidden, "
                         "expert FFN, experts, top-k)") from None
    return Shape(T=T, M=M, F=F, E=E, k=k, dtype=dtype, ep=ep)
