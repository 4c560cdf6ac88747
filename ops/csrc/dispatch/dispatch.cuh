// Dispatch family: every kept (token, slot) row stored straight into its
// destination's receive buffer at its layout row, then copied out on arrival.
// Host launchers; no torch.
#pragma once

#include <cuda_runtime.h>

#include "../types.h"

namespace uniep {

// x [T, M] (dtype), expert_idx [T, k] int32, dest_row [T, k] int32 (launch_layout),
// weights [T, k] fp32 or null: with weights the row sent for (t, j) is
// cast(weights[t, j] * float(x[t])) (the backward of combine). fp8: rows travel as
// e4m3 with one fp32 scale per 128 elements (M % 128 == 0; no weights).
// The receive row of (t, j) on rank expert_idx / L gets the row and its meta word
// rank * pairs_per_rank + t * k + j; the last block raises kPhaseDispatch on every rank.
// With direct.use, a destination whose direct-receive flag (from the layout of
// direct.counts_epoch) is set gets its rows in its direct region instead (DirectView).
// dedup (unweighted, not fp8): a token's row crosses to a destination rank once; each later slot
// of the token on that rank stores only its meta word and, in the dup region, the row of the
// token's first slot there (-1 in the dup word of a row that was stored). launch_recv_copyout
// (with dedup) or launch_combine_bwd_rows then reads that row in its place: the same bits.
// own_whole (with dedup): rows bound for this rank itself are all stored, none deduplicated (the
// forward's in-place receive, where a deduplicated row would be copied after the wait anyway).
// fused (the fused schedule; not fp8, unweighted, this rank's rows in place,
// `wait` set): the rows go out one destination at a time, this rank first, each destination
// signalled as soon as its rows are stored, and (with fused->take) between rounds the same grid
// takes this rank's arriving rows source by source (FusedArrive in types.h), raising
// kPhaseArrived for each, so no launch_recv_copyout follows. A launch may send only some
// rounds. The same rows, meta words and source pairs as without it.
cudaError_t launch_dispatch(DType dtype, bool fp8, const void* x, const int* expert_idx, const int* dest_row,
                            const float* weights, int num_tokens, int k, int hidden, int num_experts,
                            const SymView& sym, const DirectView& direct, uint32_t epoch, int num_blocks,
                            cudaStream_t stream, bool dedup = false, const FusedArrive* fused = nullptr,
                            const WaitPolicy* wait = nullptr, bool own_whole = false);

// Waits for kPhaseDispatch of every rank, then copies the first R = *num_recv rows of the
// receive buffer into out [out_rows, M] (dtype; e4m3 rows are scaled back) and their meta
// words into recv_pair [out_rows] int32, R clamped to out_rows (out_rows = R_max when the
// host does not know R; rows R.. are then left untouched). copy_rows false: the rows were
// received in place (direct region), only the wait and the meta words remain.
// dedup (after a deduplicated dispatch, not fp8): a row whose dup word names another row is
// copied from that one (out of staging, or within out when the rows are in place).
cudaError_t launch_recv_copyout(DType dtype, bool fp8, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                const int* num_recv, int out_rows, int hidden, void* out, int* recv_pair,
                                int num_blocks, bool copy_rows, cudaStream_t stream, bool dedup = false);

}  // namespace uniep
