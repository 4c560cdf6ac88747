// Layout family: routing counts exchanged over the symmetric buffer, then every
// kept (token, slot) pair's row on its destination, as ds_uniep/layout.py defines it.
// Host launchers; no torch.
#pragma once

#include <cuda_runtime.h>

#include "../types.h"

namespace uniep {

// Letters: T tokens on this rank, k slots, E experts, G ranks, L = E / G.
// 1. counts of this rank's kept pairs per expert, stored into every rank's buffer;
// 2. wait for every rank's counts (epoch-tagged signal kPhaseCounts);
// 3. per expert e: block_base[e] = first row, on e's rank, of this rank's block of e;
//    local_expert_counts [L] int64 and num_recv [1] int32 (R) of this rank;
//    counts_all [G, E] int64 (the layout's counts_all);
// 4. dest_row [T, k] int32: block_base[e] + number of this rank's earlier pairs to e
//    (token-major, slot order), -1 for a dropped pair (index -1 or out of range).
// direct_ok: this rank's direct receive region is free for the next dispatch (published
// to every rank beside the counts, see DirectView).
cudaError_t launch_layout(const int* expert_idx, int num_tokens, int k, int num_experts, const SymView& sym,
                          uint32_t epoch, const WaitPolicy& wait, int direct_ok, int* block_base,
                          int64_t* local_expert_counts, int* num_recv, int64_t* counts_all, int* dest_row,
                          cudaStream_t stream);

// The fused schedule's runs of this rank's receive rows: segs [G * L][4] int32 (first row, rows,
// local expert, source), one per (arrival round, local expert), rounds in order (source this
// rank, rank - 1, rank - 2, ...), from counts_all [G, E] int64 (the rows of expert l are ordered
// by source, then token; experts in order). The run of (round, expert) holds the tiles of `align`
// rows of the expert's block whose latest source is the round's (ds_uniep.layout.fused_runs).
// One small block, no host sync.
cudaError_t launch_fused_segments(const int64_t* counts_all, int num_ranks, int num_experts, int rank, int align,
                                  int* segs, cudaStream_t stream);

}  // namespace uniep
