"""Single-process references that the CommFuse ops are checked against.

They take every rank's data as lists (rank order) and run the same per-block
GEMMs as the ops, so equality is bitwise (``torch.equal``) where promised.
"""
from typing import List, Optional, Sequence

import torch

from .ops import even_split


def ref_all_gather_matmul(x_shards: Sequence[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """``torch.cat([x_r @ w for r])``: x_shards ``[T_r, K]`` per rank, w ``[K, N]`` -> ``[T, N]``."""
    return torch.cat([x @ w for x in x_shards])


def ref_matmul_reduce_scatter(xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                              out_sizes: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """Every rank's output block of ``sum_r xs[r] @ ws[r]``.

    xs ``[T, K_r]`` and ws ``[K_r, N]`` per rank r. Block j (rows
    ``out_sizes[j]``, default :func:`even_split`) is the partials
    ``xs[r][rows_j] @ ws[r]`` in the input dtype, added in rank order in fp32,
    cast once. Returns ``[out_sizes[j], N]`` per rank j."""
    G, T = len(xs), xs[0].shape[0]
    sizes = even_split(T, G) if out_sizes is None else list(out_sizes)
    out, start = [], 0
    for n in sizes:
        acc = (xs[0][start:start + n] @ ws[0]).to(torch.float32, copy=True)
        for r in range(1, G):
            acc.add_(xs[r][start:start + n] @ ws[r])
        out.append(acc.to(xs[0].dtype))
        start += n
    return out
