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

// dispatch_adapter.cpp
// direct: [kMaxRanks] direct-region bases, then use, then counts_epoch (DirectView).
void dispatch_rows(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                   const c10::optional<torch::Tensor>& weights, bool fp8, int64_t num_experts,
                   const std::vector<int64_t>& sym, const std::vector<int64_t>& direct, int64_t epoch,
                   int64_t num_blocks);
// copy_rows false: wait and copy the meta words only (the rows were received in place).
void recv_copyout(const torch::Tensor& num_recv, bool fp8, torch::Tensor& out, torch::Tensor& recv_pair,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                  const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks, bool copy_rows);

// combine_adapter.cpp
void combine_push(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t num_blocks);
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
                     int64_t reduce_blocks, int64_t chunk_tokens, int64_t num_chunks);
// Pulling combine: out [T, M] from every rank's source region (source: kMaxRanks region bases).
void combine_pull(const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                  const c10::optional<torch::Tensor>& weights, int64_t num_experts, torch::Tensor& out,
                  const std::vector<int64_t>& source, const std::vector<int64_t>& sym, int64_t epoch,
                  int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
void gate_grad(const torch::Tensor& expert_idx, const torch::Tensor& grad_out, int64_t num_experts,
               torch::Tensor& grad_gates, const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
               const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
// Backward of combine on the expert side (see launch_combine_bwd_rows): y [R, M] the expert
// outputs, grad_y [R, M] out; after a dispatch of grad_out (dispatch_epoch) with the gates in
// every source's gates region.
void combine_bwd_rows(const torch::Tensor& y, const torch::Tensor& num_recv, torch::Tensor& grad_y,
                      const std::vector<int64_t>& sym, int64_t dispatch_epoch, int64_t epoch, int64_t timeout_ns,
                      const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);
// Wait, then grad_gates [T, k] fp32 from this rank's gates region (0 for dropped pairs).
void gate_collect(const torch::Tensor& expert_idx, int64_t num_experts, torch::Tensor& grad_gates,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                  const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks);

// signal_adapter.cpp
void barrier(const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns, const torch::Tensor& error_record,
             int64_t layer_id, int64_t device_index);

// gemm/gemm_adapter.cpp
// op 0 (fwd): a = x [R, K], b = w [G, N, K] -> y [R, N]; op 1 (dgrad): a = dy [R, N], b = w -> dx [R, K];
// op 2 (wgrad): a = dy [R, N], b = x [R, K] -> dw [G, N, K]. offs: [G] int32 row ends. bf16 only.
// raster_n / swizzle: the persistent scheduler's tile order (no effect on the values).
torch::Tensor grouped_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs, int64_t op,
                         int64_t config, int64_t sm_count, int64_t raster_n, int64_t swizzle);
std::string grouped_mm_config_name(int64_t config);

}  // namespace uniep
