"""HybridEP: expert parallelism over slow links, trading token transmission for expert migration.

- :mod:`.model`: the stream-based cost model and the planner (:func:`plan`).
- :mod:`.topology`: domain > node > GPU topology, renumbering, gather and token pairs.
- :mod:`.compress`: base + top-k residual encoding of migrated experts.
- :mod:`.simulate`: the model over up to 1,000 sites, and its plot.
- ``python -m ds_uniep.hybrid plan|simulate``: the command line.
"""

from .compress import (SparseExpert, decode, decode_experts, encode, encode_experts, num_kept, shared_base,
                       wire_bytes)
from .model import (GBPS, Cluster, LayerTime, Plan, Workload, compressed_expert_bytes, hottest_choice, kept_count,
                    layer_times, migrated_count, migration_bytes, plan, predict, predict_routed, token_flows)
from .presets import PRESETS, MoEShape, parse_bandwidth, parse_shape
from .simulate import SweepResult, plot, sweep
from .topology import (LEVELS, RankCoord, Topology, gather_pairs, num_gather_pairs, num_token_pairs, token_pairs)

__all__ = [
    "GBPS", "Cluster", "LayerTime", "Plan", "Workload", "compressed_expert_bytes", "kept_count", "layer_times",
    "migration_bytes", "plan", "predict", "hottest_choice", "migrated_count", "predict_routed", "token_flows",
    "SparseExpert", "decode", "decode_experts", "encode", "encode_experts", "num_kept", "shared_base",
    "wire_bytes", "PRESETS", "MoEShape", "parse_bandwidth", "parse_shape", "SweepResult", "plot", "sweep", "LEVELS",
    "RankCoord", "Topology", "gather_pairs", "num_gather_pairs", "num_token_pairs", "token_pairs"
]
