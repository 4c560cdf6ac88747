"""Parameter-efficient expert migration: a shared base once, then a sparse residual per expert.

Letters: E experts of one domain, ``[...]`` one expert's weight shape, n its
element count, k the values kept (:func:`ds_uniep.hybrid.model.kept_count`).

1. ``base = shared_base(weights)``: the mean of the domain's experts
   (``[E, ...] -> [...]``, same dtype), summed in fp32 in expert order so every
   rank computes the same bits.
2. ``encode(w, base, ratio)``: the residual ``w - base`` (in fp32) picks the
   k positions of largest magnitude, ties broken by the smaller flat index;
   the wire carries those positions (int32, ascending) and the expert's own
   weights there (``w`` dtype).
3. ``decode(enc, base)``: ``base`` with the kept positions overwritten
   (``decode_rows``: many encoded rows into one ``[R, n]`` tensor at once).

Sending ``w`` at the kept positions costs the same bytes as sending the
residual there, and needs no ``base + (w - base)`` round trip, so ratio 1.0
gives ``w`` back bitwise. For ratio < 1 the error is the residual at the
dropped positions: every dropped ``|w - base|`` is at most the smallest kept
one, and ``||decode - w||_2 <= sqrt((n - k)/n) * ||w - base||_2``.

Numerics change only when a caller encodes with ratio < 1; callers choose.
"""

from dataclasses import dataclass
from typing import Tuple

import torch

from .model import INDEX_BYTES, kept_count

INDEX_DTYPE = torch.int32


def num_kept(numel: int, ratio: float) -> int:
    """Values kept of ``numel`` for ``ratio`` in (0, 1] (nearest whole number, at least 1)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio: must be in (0, 1], got {ratio}")
    return kept_count(numel, ratio)


@dataclass(frozen=True)
class SparseExpert:
    """One expert on the wire: ``values`` ``[k]`` in the weight dtype, ``indices`` ``[k]`` int32 ascending."""

    values: torch.Tensor
    indices: torch.Tensor
    shape: Tuple[int, ...]

    @property
    def wire_bytes(self) -> int:
        """Exact bytes of values and indices (the shape travels once per layer, not counted)."""
        return self.values.numel() * self.values.element_size() + self.indices.numel() * self.indices.element_size()


def wire_bytes(numel: int, dtype: torch.dtype, ratio: float) -> int:
    """Bytes :func:`encode` will put on the wire for an expert of ``numel`` elements."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_kept(numel, ratio) * (itemsize + INDEX_BYTES)


def shared_base(weights: torch.Tensor) -> torch.Tensor:
    """``[E, ...] -> [...]``: mean of the experts, accumulated in fp32 in expert order."""
    if weights.dim() < 2 or weights.shape[0] < 1:
        raise ValueError(f"weights: expected [E, ...] with E >= 1, got shape {tuple(weights.shape)}")
    acc = weights[0].to(torch.float32).clone()
    for e in range(1, weights.shape[0]):
        acc += weights[e].to(torch.float32)
    return (acc / weights.shape[0]).to(weights.dtype)


def encode(weight: torch.Tensor, base: torch.Tensor, ratio: float) -> SparseExpert:
    """Top-k of ``weight - base`` by magnitude; see the module docstring."""
    if weight.shape != base.shape or weight.dtype != base.dtype:
        raise ValueError(f"encode: weight {tuple(weight.shape)} {weight.dtype} and base {tuple(base.shape)} "
                         f"{base.dtype} must match")
    if not weight.is_floating_point():
        raise ValueError(f"encode: weight must be floating point, got {weight.dtype}")
    flat_w = weight.reshape(-1)
    n = flat_w.numel()
    k = num_kept(n, ratio)
    if n >= 2**31:
        raise ValueError(f"encode: {n} elements do not fit int32 indices")
    if k == n:
        idx = torch.arange(n, device=weight.device)
    else:
        mag = (flat_w.to(torch.float32) - base.reshape(-1).to(torch.float32)).abs()
        # The k-th largest magnitude by selection (no full sort; torch.topk, whose values are exact
        # whatever order it leaves ties in): every larger one is kept, then as many of those equal
        # to it as fit, smallest index first. Exactly k positions, ascending, found without reading
        # a count back to the host (nonzero_static), so a GPU encodes without synchronising.
        t = torch.topk(mag, k, sorted=False).values.min()
        above = mag > t
        ties = mag == t
        room = k - above.sum()
        keep = above | (ties & (torch.cumsum(ties, 0) <= room))
        idx = torch.nonzero_static(keep, size=k).flatten()
    return SparseExpert(values=flat_w[idx].clone(), indices=idx.to(INDEX_DTYPE), shape=tuple(weight.shape))


def decode(enc: SparseExpert, base: torch.Tensor) -> torch.Tensor:
    """``base`` with ``enc``'s positions overwritten; same shape and dtype as the encoded weight."""
    _check_base(enc, base)
    out = base.new_empty(1, base.numel())
    return decode_rows(out, base, enc.indices[None], enc.values[None]).reshape(enc.shape)


def _check_base(enc: SparseExpert, base: torch.Tensor) -> None:
    if tuple(base.shape) != enc.shape or base.dtype != enc.values.dtype:
        raise ValueError(f"decode: base {tuple(base.shape)} {base.dtype} does not match the encoded expert "
                         f"{enc.shape} {enc.values.dtype}")


def decode_rows(out: torch.Tensor, base: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """:func:`decode` of R encoded rows at once, into ``out`` ``[R, n]``: every row ``base``
    (flattened, n elements), then row r's ``positions[r]`` (distinct within a row, as :func:`encode`
    gives them) overwritten by ``values[r]`` (both ``[R, k]``). Returns ``out``."""
    out.copy_(base.reshape(-1).expand_as(out))
    return out.scatter_(1, positions.long(), values)


def encode_experts(weights: torch.Tensor, ratio: float):
    """``[E, ...]`` -> (base ``[...]``, list of E :class:`SparseExpert`)."""
    base = shared_base(weights)
    return base, [encode(weights[e], base, ratio) for e in range(weights.shape[0])]


def decode_experts(base: torch.Tensor, encoded) -> torch.Tensor:
    """Inverse of :func:`encode_experts`: ``[E, ...]``, the E rows decoded at once (:func:`decode_rows`)."""
    for enc in encoded:
        _check_base(enc, base)
    out = base.new_empty(len(encoded), base.numel())
    return decode_rows(out, base, torch.stack([e.indices for e in encoded]),
                       torch.stack([e.values for e in encoded])).reshape(len(encoded), *base.shape)
