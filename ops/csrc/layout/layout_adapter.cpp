// Layout family: tensor checks, device guard and stream for launch_layout.
#include "../adapters.h"
#include "../host_utils.h"
#include "layout.cuh"

namespace uniep {

std::vector<torch::Tensor> layout(const torch::Tensor& expert_idx, int64_t num_experts,
                                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                                  const torch::Tensor& error_record, int64_t layer_id, bool direct_ok) {
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  TORCH_CHECK(expert_idx.dim() == 2, "expert_idx must be [T, k], got ", expert_idx.sizes());
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  TORCH_CHECK(num_experts > 0 && num_experts <= kMaxExperts && num_experts % s.num_ranks == 0, "num_experts ",
              num_experts, " must be in 1..", kMaxExperts, " and divisible by ", s.num_ranks, " ranks");
  const int T = static_cast<int>(expert_idx.size(0)), k = static_cast<int>(expert_idx.size(1));
  TORCH_CHECK(k >= 1 && k <= kMaxTopK, "k = ", k, " outside 1..", kMaxTopK);
  const c10::cuda::CUDAGuard guard(expert_idx.device());
  const auto i32 = expert_idx.options().dtype(torch::kInt32);
  const auto i64 = expert_idx.options().dtype(torch::kInt64);
  const int64_t L = num_experts / s.num_ranks;
  torch::Tensor block_base = torch::empty({num_experts}, i32);
  torch::Tensor local_expert_counts = torch::empty({L}, i64);
  torch::Tensor num_recv = torch::empty({1}, i32);
  torch::Tensor counts_all = torch::empty({s.num_ranks, num_experts}, i64);
  torch::Tensor dest_row = torch::empty({T, k}, i32);
  UNIEP_CHECK_LAUNCH(launch_layout(expert_idx.data_ptr<int>(), T, k, static_cast<int>(num_experts), s,
                                   static_cast<uint32_t>(epoch), w, direct_ok ? 1 : 0, block_base.data_ptr<int>(),
                                   local_expert_counts.data_ptr<int64_t>(), num_recv.data_ptr<int>(),
                                   counts_all.data_ptr<int64_t>(), dest_row.data_ptr<int>(),
                                   c10::cuda::getCurrentCUDAStream()));
  return {local_expert_counts, num_recv, counts_all, dest_row};
}

torch::Tensor fused_segments(const torch::Tensor& counts_all, int64_t rank, int64_t align) {
  UNIEP_CHECK_INPUT(counts_all);
  UNIEP_CHECK_DTYPE(counts_all, torch::kInt64);
  TORCH_CHECK(counts_all.dim() == 2, "counts_all must be [G, E], got ", counts_all.sizes());
  const int64_t G = counts_all.size(0), E = counts_all.size(1);
  TORCH_CHECK(G >= 1 && G <= kMaxRanks && E % G == 0 && rank >= 0 && rank < G, "counts_all [", G, ", ", E,
              "] and rank ", rank, " do not make a layout");
  TORCH_CHECK(align >= 1 && align <= (1 << 30), "fused segments: align must be 1 to 2^30 rows, got ", align);
  const c10::cuda::CUDAGuard guard(counts_all.device());
  torch::Tensor segs = torch::empty({E, 4}, counts_all.options().dtype(torch::kInt32));  // G * L = E runs
  UNIEP_CHECK_LAUNCH(launch_fused_segments(counts_all.data_ptr<int64_t>(), static_cast<int>(G), static_cast<int>(E),
                                           static_cast<int>(rank), static_cast<int>(align), segs.data_ptr<int>(),
                                           c10::cuda::getCurrentCUDAStream()));
  return segs;
}

}  // namespace uniep
