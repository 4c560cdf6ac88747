"""CommFuse: all-gather+GEMM and GEMM+reduce-scatter as overlapped peer-to-peer steps, exact."""
from .linear import ColumnParallelLinear, RowParallelLinear
from .common import SCHEDULES, TRANSPORTS, Timeline, even_split, gather_shard_sizes
from .ops import all_gather_matmul, all_gather_matmul_impl, matmul_reduce_scatter, matmul_reduce_scatter_impl
from .ulysses import UlyssesAttention
from .data_parallel import ShardedLinear
from .reference import ref_all_gather_matmul, ref_matmul_reduce_scatter, ref_matmul_reduce_scatter_relay

__all__ = [
    "SCHEDULES", "TRANSPORTS", "Timeline", "all_gather_matmul", "all_gather_matmul_impl", "even_split",
    "gather_shard_sizes", "matmul_reduce_scatter", "matmul_reduce_scatter_impl", "ref_all_gather_matmul",
    "ref_matmul_reduce_scatter", "ref_matmul_reduce_scatter_relay", "ColumnParallelLinear", "RowParallelLinear",
    "UlyssesAttention", "ShardedLinear"
]
