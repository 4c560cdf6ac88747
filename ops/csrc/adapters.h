// Torch-facing functions of every kernel family (one adapter .cpp per family).
// Shapes: T tokens, k slots, M hidden, E experts, G ranks, L = E / G, R_max receive rows.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace uniep {

// layout_adapter.cpp
// expert_idx [T, k] int32 -> (local_expert_counts [L] int64, num_recv [1] int32,
// counts_all [G, E] int64, dest_row [T, k] int32).
std::vector<torch::Tensor> layout(const torch::Tensor& expert_idx, int64_t num_experts,
                                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                                  const torch::Tensor& error_record, int64_t layer_id, bool direct_ok);

// The fused schedule's runs of this rank's receive rows, [E, 4] int32, cut into tiles of `align`
// rows (launch_fused_segments).
torch::Tensor fused_segments(const torch::Tensor& counts_all, int64_t rank, int64_t align);

// dispatch_adapter.cpp
// direct: [kMaxRanks] direct-region bases, then use, then counts_epoch (DirectView).
// own_whole (with dedup): this rank's own rows are stored whole, not deduplicated (launch_dispatch).
void dispatch_rows(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                   const c10::optional<torch::Tensor>& weights, bool fp8, int64_t num_experts,
                   const std::vector<int64_t>& sym, const std::vector<int64_t>& direct, int64_t epoch,
                   int64_t num_blocks, bool dedup, bool own_whole);
// The fused schedule's dispatch (FusedArrive in types.h): segs [G * L, 4] int32 (the (source,
// expert) blocks), out the direct region [R_max, M], recv_pair [R_max] int32 (every received
// row's source pair, written as its source arrives), started [1] int32 on the device or in pinned
// host memory, or None (gets epoch once every block runs); sends rounds [send_begin, send_end),
// takes every round's arrivals with `take`. No copy-out after.
void dispatch_fused(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                    int64_t num_experts, const std::vector<int64_t>& sym, const std::vector<int64_t>& direct,
                    int64_t epoch, int64_t num_blocks, bool dedup, const torch::Tensor& segs, torch::Tensor& out,
                    torch::Tensor& recv_pair, const c10::optional<torch::Tensor>& started, int64_t send_begin,
                    int64_t send_end, bool take, int64_t timeout_ns, const torch::Tensor& error_record,
                    int64_t layer_id);
// The fused schedule's dispatch with interleaved roles: the job (InterleavedDispatch in
// types.h, as bytes in a CPU uint8 tensor) that grouped_mm_segments' comm_job hands to the
// GEMM's spare warps. The same arguments and checks as dispatch_fused (bf16 rows); the tensors
// must live until the GEMM has run. Round 0 (this rank's own rows) is dispatch_fused's, first.
torch::Tensor interleaved_job(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                              int64_t num_experts, const std::vector<int64_t>& sym,
                              const std::vector<int64_t>& direct, int64_t epoch, bool dedup, const torch::Tensor& segs,
                              torch::Tensor& out, torch::Tensor& recv_pair, int64_t tokens_per_item,
                              int64_t rows_per_item, bool prefetch, int64_t warps, int64_t send_begin,
                              int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id);
// copy_rows false: wait and copy the meta words only (the rows were received in place).
// dedup: after a deduplicated dispatch (copies each row its token's first row on this rank).
void recv_copyout(const torch::Tensor& num_recv, bool fp8, torch::Tensor& out, torch::Tensor& recv_pair,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                  const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks, bool copy_rows,
                  bool dedup);

// combine_adapter.cpp
void combine_push(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t num_blocks);
// Each source token's rows here summed (slot order, fp32, times the source's gates when weighted, once
// every rank raised kPhaseGates of gates_epoch), cast once and stored at its first slot here in the
// source's combine buffer (compression.combine "rank_partials"); table: [G * pairs_per_rank] int64 on
// the device, this rank's own (zero at first), table_epoch a new value > 0 each call.
void combine_partials_push(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                           torch::Tensor& table, int64_t table_epoch, int64_t k, bool weighted, int64_t gates_epoch,
                           const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                           const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
void combine_reduce(const torch::Tensor& expert_idx, const c10::optional<torch::Tensor>& weights,
                    int64_t num_experts, torch::Tensor& out, const std::vector<int64_t>& sym, int64_t epoch,
                    int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
// combine_push then combine_reduce as one kernel pipelined by chunks of source tokens: the
// same output bits. num_blocks blocks push and reduce_blocks more sum; chunk_tokens * num_chunks covers the
// largest token count of any rank and num_chunks is the same on every rank.
void combine_chunked(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                     const torch::Tensor& expert_idx, const c10::optional<torch::Tensor>& weights,
                     int64_t num_experts, torch::Tensor& out, const std::vector<int64_t>& sym, int64_t epoch,
                     int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks,
                     int64_t reduce_blocks, int64_t chunk_tokens, int64_t num_chunks,
                     const c10::optional<torch::Tensor>& queue, bool queue_gpu_fence);
// int32 words of combine_chunked's queue workspace for num_blocks pushing blocks and rows rows.
int64_t combine_queue_size(int64_t num_blocks, int64_t rows);
void gate_grad(const torch::Tensor& expert_idx, const torch::Tensor& grad_out, int64_t num_experts,
               torch::Tensor& grad_gates, const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
               const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
// grad_gates [T, k] = <grad_out[t], row of (t, j)> with the rows in expert order, as the fused
// schedule's second GEMM left them (see combine_mirror): row dest_row[t, j] + mirror_off[e] of
// `rows` ([*, M], a copy of them) or, without it, of this rank's combine buffer. No wait.
void gate_grad_mirror(const torch::Tensor& expert_idx, const torch::Tensor& dest_row, const torch::Tensor& mirror_off,
                      const torch::Tensor& grad_out, const c10::optional<torch::Tensor>& rows, int64_t num_experts,
                      torch::Tensor& grad_gates, const std::vector<int64_t>& sym, int64_t num_blocks);
// Backward of combine on the expert side (see launch_combine_bwd_rows): y [R, M] the expert
// outputs, grad_y [R, M] out; after a dispatch of grad_out (dispatch_epoch) with the gates in
// every source's gates region; dedup: that dispatch was deduplicated. y None: grad_y only (the
// gate gradients are formed at the sources, gate_grad_mirror), nothing stored into the gates words.
void combine_bwd_rows(const c10::optional<torch::Tensor>& y, const torch::Tensor& num_recv, torch::Tensor& grad_y,
                      const std::vector<int64_t>& sym, int64_t dispatch_epoch, int64_t epoch, int64_t timeout_ns,
                      const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks, bool dedup,
                      int64_t row_begin, bool raise);
// Slot-order sums as combine_reduce, reading the rows the pipelined schedule's copy-engine pushes
// left in this rank's combine buffer in expert order: row dest_row[t, j] + mirror_off[e] ([E] int32).
void combine_mirror(const torch::Tensor& expert_idx, const torch::Tensor& dest_row, const torch::Tensor& mirror_off,
                    const c10::optional<torch::Tensor>& weights, int64_t num_experts, torch::Tensor& out,
                    const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                    const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
// Copy-engine copies on the current stream: table [n, 3] CPU int64 rows of (source address,
// destination address, bytes); addresses may be peers' symmetric memory.
void copy_segments(const torch::Tensor& table, int64_t device_index);
void copy_segments_sm(const torch::Tensor& table, int64_t num_blocks, int64_t device_index);
// Wait, then grad_gates [T, k] fp32 from this rank's gates region (0 for dropped pairs).
void gate_collect(const torch::Tensor& expert_idx, int64_t num_experts, torch::Tensor& grad_gates,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                  const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);

// signal_adapter.cpp
void barrier(const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns, const torch::Tensor& error_record,
             int64_t layer_id, int64_t device_index);
// Raise `phase` = epoch on every rank (after this stream's earlier work); no wait.
void signal_raise(const std::vector<int64_t>& sym, int64_t phase, int64_t epoch, int64_t device_index);
// Holds the current stream's later work until the int32 `word` (device memory) reaches `value`
// (cyclic compare, as epochs wrap), without the host waiting: the driver's stream memory wait.
// False when the driver does not offer it (nothing was queued then).
bool stream_wait_word(const torch::Tensor& word, int64_t value);
// Writes `value` into the int32 `word` (device memory, a peer's mapped word included) once the
// current stream's earlier work, copy-engine copies included, is done and visible: the driver's
// stream memory write, which takes no SM. False when the driver does not offer it (nothing queued).
bool stream_write_word(const torch::Tensor& word, int64_t value);
// On the current stream: waits until words[i] reaches `epoch` (cyclic compare) for every i whose
// bit is set in `mask`; a wait past timeout_ns fills error_record (pinned), sets `poison` and ends.
void wait_words(const torch::Tensor& words, int64_t mask, int64_t epoch, int64_t timeout_ns,
                const torch::Tensor& error_record, const torch::Tensor& poison, int64_t layer_id, int64_t rank,
                int64_t phase);

// gemm/gemm_adapter.cpp
// op 0 (fwd): a = x [R, K], b = w [G, N, K] -> y [R, N]; op 1 (dgrad): a = dy [R, N], b = w -> dx [R, K];
// op 2 (wgrad): a = dy [R, N], b = x [R, K] -> dw [G, N, K]. offs: [G] int32 row ends. bf16 only.
// raster_n / swizzle: the persistent scheduler's tile order (no effect on the values).
torch::Tensor grouped_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs, int64_t op,
                         int64_t config, int64_t sm_count, int64_t raster_n, int64_t swizzle);
// Forward (op 0) or dgrad (op 1) over segments: group g is rows [segs[g, 0], + segs[g, 1]) of a
// and out, with w[segs[g, 2]] (w: [W, N, K]; fwd: a [R, K], out [R, N]; dgrad: a = dy [R, N],
// out = dx [R, K]). With `ready` (int32 words): group g's tiles wait until
// ready[segs[g, 3]] reaches `epoch` (segs[g, 3] < 0: no wait); a wait past timeout_ns fills
// error_record (pinned) and sets the poison word. out: bf16, rows outside every segment
// left untouched. With `a_alt` (bf16, a's columns): segments whose weight index has bit 30 set read
// their rows from a_alt at (first row - alt_row0) instead of from a. With `seg_out` ([G] int64,
// on a's device): group g's rows go to address seg_out[g] (rows back to back, a peer's
// symmetric memory allowed) and out is neither checked nor written. With `comm_job` (fwd with
// waits; interleaved_job's bytes): the GEMM's spare warps run that dispatch (kFwdInterleaved).
void grouped_mm_segments(const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& segs, torch::Tensor& out,
                         int64_t config, int64_t sm_count, int64_t raster_n, int64_t swizzle,
                         const c10::optional<torch::Tensor>& ready, int64_t epoch, int64_t timeout_ns,
                         const c10::optional<torch::Tensor>& error_record, const c10::optional<torch::Tensor>& poison,
                         int64_t layer_id, int64_t rank, int64_t phase, const c10::optional<torch::Tensor>& a_alt,
                         int64_t alt_row0, const c10::optional<torch::Tensor>& seg_out, int64_t op,
                         const c10::optional<torch::Tensor>& comm_job);
std::string grouped_mm_config_name(int64_t config);

}  // namespace uniep
