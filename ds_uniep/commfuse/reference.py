"""Single-process references that the CommFuse ops are checked against.

They take every rank's data as lists (rank order) and run the same per-block
GEMMs as the ops, so equality is bitwise (``torch.equal``) where promised.
"""
from typing import List, Optional, Sequence

import torch

from .common import _chunks, _offsets, _remote_runs, even_split


def _local_first_rows(sizes: Sequence[int], me: int, own_chunks: int = 1):
    """``(start, rows)`` of every GEMM the ``local_first`` schedule runs on rank ``me`` (its own
    block as ``own_chunks`` row chunks)."""
    return _own_rows(sizes, me, own_chunks) + [(r0, n) for r0, n, _ in _remote_runs(sizes, me)]


def _own_rows(sizes: Sequence[int], me: int, own_chunks: int):
    """``(start, rows)`` of the GEMMs of rank ``me``'s own block: ``own_chunks`` row chunks
    (``_chunks``), or the whole block."""
    r0 = _offsets(sizes)[me]
    if own_chunks > 1 and sizes[me] > 1:
        return [(r0 + c0, n) for c0, n in _chunks(sizes[me], own_chunks)]
    return [(r0, sizes[me])]


def ref_all_gather_matmul(x_shards: Sequence[torch.Tensor], w: torch.Tensor,
                          local_first_rank: Optional[int] = None, gemm: str = "torch") -> torch.Tensor:
    """``torch.cat([x_r @ w for r])``: x_shards ``[T_r, K]`` per rank, w ``[K, N]`` -> ``[T, N]``.

    ``local_first_rank=me``: the ``local_first`` schedule's grouping on rank ``me`` instead: its own
    block, the blocks after it and the blocks before it, each group one GEMM. ``gemm="uniep"``
    (the ``arrival`` schedule's reference): ds_uniep's grouped GEMM over all gathered rows (bf16,
    CUDA), whose row results do not depend on how the rows are cut."""
    if gemm == "uniep":
        from ..gemm import grouped_mm
        x_full = torch.cat(list(x_shards))
        offs = torch.tensor([x_full.shape[0]], dtype=torch.int32, device=x_full.device)
        return grouped_mm(x_full, w.t().contiguous().unsqueeze(0), offs, "fwd")
    if gemm != "torch":
        raise ValueError(f"ref_all_gather_matmul: gemm must be 'torch' or 'uniep', got {gemm!r}")
    if local_first_rank is None:
        return torch.cat([x @ w for x in x_shards])
    x_full = torch.cat(list(x_shards))
    out = torch.empty(x_full.shape[0], w.shape[1], dtype=torch.result_type(x_full, w))
    out = out.to(x_full.device)
    for r0, n in _local_first_rows([x.shape[0] for x in x_shards], local_first_rank):
        out[r0:r0 + n] = x_full[r0:r0 + n].clone() @ w
    return out


def ref_matmul_reduce_scatter(xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                              out_sizes: Optional[Sequence[int]] = None,
                              local_first: bool = False, own_chunks: int = 1) -> List[torch.Tensor]:
    """Every rank's output block of ``sum_r xs[r] @ ws[r]``.

    xs ``[T, K_r]`` and ws ``[K_r, N]`` per rank r. Block j (rows
    ``out_sizes[j]``, default :func:`even_split`) is the partials
    ``xs[r][rows_j] @ ws[r]`` in the input dtype, added in rank order in fp32,
    cast once. Returns ``[out_sizes[j], N]`` per rank j. ``local_first``: rank
    r's partials come from its ``local_first`` GEMMs (its own rows, the rows
    after them, the rows before them, each group one GEMM), sliced per block.
    ``own_chunks`` (the copy-engine transport's ``num_chunks``): rank j's own
    partial of block j comes from one GEMM per row chunk of the block."""
    G, T = len(xs), xs[0].shape[0]
    sizes = even_split(T, G) if out_sizes is None else list(out_sizes)
    offs = _offsets(sizes)

    def gemms(r, rows):
        full = torch.empty(T, ws[r].shape[1], dtype=torch.result_type(xs[r], ws[r])).to(xs[r].device)
        for r0, n in rows:
            full[r0:r0 + n] = xs[r][r0:r0 + n] @ ws[r]
        return full

    if local_first:
        partial_rows = [gemms(r, _local_first_rows(sizes, r, own_chunks)) for r in range(G)]

        def partial(r, j):
            return partial_rows[r][offs[j]:offs[j] + sizes[j]]
    else:
        own_rows = [gemms(r, _own_rows(sizes, r, own_chunks)) for r in range(G)]

        def partial(r, j):
            if r == j:
                return own_rows[r][offs[j]:offs[j] + sizes[j]]
            return xs[r][offs[j]:offs[j] + sizes[j]] @ ws[r]
    out = []
    for j in range(G):
        acc = partial(0, j).to(torch.promote_types(xs[0].dtype, torch.float32), copy=True)
        for r in range(1, G):
            acc.add_(partial(r, j))
        out.append(acc.to(xs[0].dtype))
    return out


def ref_matmul_reduce_scatter_relay(xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                                    out_sizes: Optional[Sequence[int]] = None,
                                    num_chunks: int = 1) -> List[torch.Tensor]:
    """Every rank's output block as the ``relay`` schedule sums it: per row chunk of block j
    (``relay_chunks``), ``acc = acc_mm(xs[j+1][rows], ws[j+1])``, then
    ``acc = acc_mm(xs[r][rows], ws[r], acc)`` for r = j+2, ..., j+G-1, j (fp32 GEMM products, each
    added in a GEMM's epilogue), cast once to the input dtype."""
    from .relay import acc_mm, relay_chunks, relay_sources
    G, T = len(xs), xs[0].shape[0]
    sizes = even_split(T, G) if out_sizes is None else list(out_sizes)
    offs = _offsets(sizes)
    dtype = torch.result_type(xs[0], ws[0])
    out = []
    for j in range(G):
        blk = torch.empty(sizes[j], ws[0].shape[1], dtype=dtype, device=xs[0].device)
        for c0, n in relay_chunks(sizes[j], num_chunks):
            if n == 0:
                continue
            acc = None
            for r in relay_sources(G, j):
                acc = acc_mm(xs[r][offs[j] + c0:offs[j] + c0 + n], ws[r], acc)
            blk[c0:c0 + n].copy_(acc)
        out.append(blk)
    return out
