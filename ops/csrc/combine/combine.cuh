// Combine family: expert output rows pushed back to their source at (token, slot),
// then summed there in slot order in fp32 and cast once. Host launchers; no torch.
// Kernels by file: combine_push.cu (push, rank partials), combine_reduce.cu (reduce, mirror),
// combine_chunked.cu (push and reduce in one kernel), combine_backward.cu (gate gradients,
// the expert side of the backward of combine), copy_segments.cu (SM copies).
#pragma once

#include <cuda_runtime.h>

#include "../types.h"

namespace uniep {

// y [y_rows, M] (dtype, y_rows = R or R_max), rows in this rank's layout order; recv_pair
// [y_rows] int32 from launch_recv_copyout; the first min(R, y_rows) rows are pushed: row r goes to rank
// recv_pair[r] / pairs_per_rank, comb row recv_pair[r] % pairs_per_rank. The last block
// raises kPhaseCombine on every rank.
cudaError_t launch_combine_push(DType dtype, const void* y, const int* recv_pair, const int* num_recv, int y_rows,
                                int hidden, const SymView& sym, uint32_t epoch, int num_blocks, cudaStream_t stream);

// Rank partials (compression.combine "rank_partials"): for each source token with rows here, its
// rows summed in slot order in fp32, times the source's gate when weighted (read from its gates
// region, after every rank raised kPhaseGates of gates_epoch), cast once and stored at the token's
// first slot here in the source's combine buffer. table [G * pairs_per_rank] uint64, this rank's
// own, zero at first: entry pair = (table_epoch << 32) | row, rewritten here for the first
// min(R, y_rows) rows (table_epoch > 0, a new one each call, so no reset is needed). The last block
// raises kPhaseCombine of epoch on every rank; launch_combine_reduce then sums each token's rows at
// the first slot of each rank (an expert_idx with the other slots dropped), unweighted.
cudaError_t launch_combine_partials_push(DType dtype, const void* y, const int* recv_pair, const int* num_recv,
                                         int y_rows, uint64_t* table, uint32_t table_epoch, int k, int hidden,
                                         bool weighted, uint32_t gates_epoch, const SymView& sym, uint32_t epoch,
                                         const WaitPolicy& wait, int num_blocks, cudaStream_t stream);

// Waits for kPhaseCombine of every rank, then
// out[t] = cast(sum over j = 0..k-1 with expert_idx[t, j] kept of w[t, j] * float(comb[t * k + j])),
// fp32, left to right; w = weights [T, k] fp32, or 1 when weights is null (the backward
// of dispatch). out [T, M] dtype.
cudaError_t launch_combine_reduce(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                  const int* expert_idx, const float* weights, int num_tokens, int k, int hidden,
                                  int num_experts, void* out, int num_blocks, cudaStream_t stream);

// launch_combine_push and launch_combine_reduce in one kernel, pipelined by chunks of source
// tokens (chunk c: tokens [c * chunk_tokens, (c + 1) * chunk_tokens)): num_blocks blocks push
// chunk after chunk and raise each chunk's flag on every rank when it is stored; reduce_blocks
// more blocks sum a chunk once every rank's flag for it is up. The same output bits as
// push then reduce. num_chunks (<= kMaxCombineChunks) must be the same on every rank (it covers
// the largest token count of any rank); this rank's num_tokens <= chunk_tokens * num_chunks.
// Without a queue each pushing block sorts its share of the rows by chunk once and streams
// through them with no barrier between chunks, a bounded number of chunks ahead of the last chunk
// it signalled (chunk by chunk when its share exceeds kMaxSortedListBytes). queue (queue_words
// ints, at least combine_queue_words(num_blocks, y_rows); null: none): the pushing blocks sort all
// rows by chunk into one order and every pushing warp takes its next segments from one cursor, so
// faster blocks push more; zero when allocated, each launch leaves it ready for the
// next (stream-ordered launches may share it); queue_gpu_fence: its pushing warps fence at GPU
// scope before counting a chunk's rows, and only the warp that completes a chunk fences at system
// scope before raising its flags. The bits are the same.
cudaError_t launch_combine_chunked(DType dtype, const void* y, const int* recv_pair, const int* num_recv,
                                   int y_rows, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                   const int* expert_idx, const float* weights, int num_tokens, int k, int hidden,
                                   int num_experts, void* out, int num_blocks, int reduce_blocks, int chunk_tokens,
                                   int num_chunks, int* queue, int64_t queue_words, bool queue_gpu_fence,
                                   cudaStream_t stream);
// Words of the queue workspace for num_blocks pushing blocks and y_rows rows.
int64_t combine_queue_words(int num_blocks, int y_rows);

// As launch_combine_reduce, reading the row of (t, j) from this rank's combine buffer at
// dest_row[t, j] + mirror_off[expert_idx[t, j]] (mirror_off [E] int32): the buffer the
// pipelined schedule's copy-engine pushes fill in expert order (see MirrorRows).
cudaError_t launch_combine_mirror(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                  const int* dest_row, const int* mirror_off, const int* expert_idx,
                                  const float* weights, int num_tokens, int k, int hidden, int num_experts, void* out,
                                  int num_blocks, cudaStream_t stream);

// Waits for kPhaseCombine of every rank, then grad_gates [T, k] fp32:
// sum over m of float(grad_out[t, m]) * float(comb[t * k + j, m]), 0 for a dropped pair.
// The sum is a fixed tree (lane-strided partials, then a butterfly), the same every run.
cudaError_t launch_gate_grad(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                             const int* expert_idx, const void* grad_out, int num_tokens, int k, int hidden,
                             int num_experts, float* grad_gates, int num_blocks, cudaStream_t stream);

// grad_gates as launch_gate_grad (the same sum), with the row of (t, j) at
// rows_base + (dest_row[t, j] + mirror_off[expert_idx[t, j]]) rows of `hidden` elements: the rows in
// expert order that the fused schedule's second GEMM stored into this rank's combine buffer (or
// a copy of them). No wait: the forward's combine already waited for them.
cudaError_t launch_gate_grad_mirror(DType dtype, const void* rows_base, const int* dest_row, const int* mirror_off,
                                    const int* expert_idx, const void* grad_out, int num_tokens, int k, int hidden,
                                    int num_experts, float* grad_gates, int num_blocks, cudaStream_t stream);

// Backward of combine on the expert side, after a dispatch of grad_out (unweighted, epoch
// dispatch_epoch) and with each source's gates [T, k] fp32 in its gates region: waits for
// kPhaseDispatch of every rank, then for each of the first R = min(*num_recv, y_rows) received
// rows r of pair (t, j): grad_y[r] = cast(gates[t, j] * float(row)) (the bits of a weighted
// dispatch) and the source's gates word of the pair becomes <row, y[r]> (gate_grad's sum);
// raises kPhaseCombine (epoch) on every rank when `raise`. dedup: the dispatch was deduplicated
// (a row whose dup word names another row reads that one). y and grad_y may hold only the rows
// [row_begin, row_begin + y_rows) (chunks of the pipelined schedule: one launch per chunk, the
// last one raising). y null: grad_y only, no gates word written.
cudaError_t launch_combine_bwd_rows(DType dtype, const SymView& sym, uint32_t dispatch_epoch, uint32_t epoch,
                                    const WaitPolicy& wait, const int* num_recv, int row_begin, int y_rows,
                                    int hidden, const void* y, void* grad_y, int num_blocks, cudaStream_t stream,
                                    bool dedup, bool raise);

// Waits for kPhaseCombine of every rank, then grad_gates[p] = this rank's gates word p for a kept
// pair, 0 for a dropped one (p < num_pairs = T * k).
cudaError_t launch_gate_collect(const SymView& sym, uint32_t epoch, const WaitPolicy& wait, const int* expert_idx,
                                int num_pairs, int num_experts, float* grad_gates, int num_blocks,
                                cudaStream_t stream);

// Segments copied by SM stores (16-byte vectors, grid-stride, `num_blocks` blocks of kCopyThreads):
// dst[i][0, bytes[i]) = src[i][0, bytes[i]) for i < n (n <= kMaxSmSegments; every address and byte
// count a multiple of 16; destinations may be peers' buffers). Each block fences at system scope
// before it ends, so a signal raised after the kernel on the same stream covers the stores.
constexpr int kMaxSmSegments = 128;
cudaError_t launch_copy_segments_sm(int n, const char* const* src, char* const* dst, const int64_t* bytes,
                                    int num_blocks, cudaStream_t stream);

}  // namespace uniep
