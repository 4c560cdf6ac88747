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

}  // namespace uniep
