// Dispatch family: tensor checks, dtype, device guard and stream for the dispatch launchers.
#include <cstring>

#include "../adapters.h"
#include "../host_utils.h"
#include "dispatch.cuh"

namespace uniep {

void dispatch_rows(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                   const c10::optional<torch::Tensor>& weights, bool fp8, int64_t num_experts,
                   const std::vector<int64_t>& sym, const std::vector<int64_t>& direct, int64_t epoch,
                   int64_t num_blocks, bool dedup, bool own_whole) {
  UNIEP_CHECK_INPUT(x);
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_INPUT(dest_row);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  UNIEP_CHECK_DTYPE(dest_row, torch::kInt32);
  TORCH_CHECK(x.dim() == 2 && expert_idx.dim() == 2, "x must be [T, M] and expert_idx [T, k]");
  UNIEP_CHECK_SHAPE(expert_idx, x.size(0), expert_idx.size(1));
  UNIEP_CHECK_SHAPE(dest_row, x.size(0), expert_idx.size(1));
  const SymView s = sym_from_descriptor(sym);
  const DirectView dv = direct_from_descriptor(direct);
  TORCH_CHECK(!(dv.use && fp8), "FP8 rows are dequantized on arrival: they cannot be received in place");
  const int hidden = static_cast<int>(x.size(1));
  const int64_t row_bytes = fp8 ? hidden : hidden * static_cast<int64_t>(x.element_size());
  // e4m3 rows use the first M bytes of each receive row (stride recv_row_bytes).
  TORCH_CHECK(row_bytes <= s.recv_row_bytes, "x rows are ", row_bytes, " bytes, the receive buffer's ",
              s.recv_row_bytes);
  TORCH_CHECK(x.size(0) * expert_idx.size(1) <= s.pairs_per_rank, "x has ", x.size(0) * expert_idx.size(1),
              " pairs, the buffers hold ", s.pairs_per_rank);
  const float* w = optional_weights(weights, expert_idx);
  TORCH_CHECK(!(dedup && (fp8 || w)), "a deduplicated dispatch moves unweighted rows in the activation dtype");
  TORCH_CHECK(!own_whole || dedup, "own_whole is a form of the deduplicated dispatch");
  const c10::cuda::CUDAGuard guard(x.device());
  UNIEP_CHECK_LAUNCH(launch_dispatch(dtype_of(x), fp8, x.data_ptr(), expert_idx.data_ptr<int>(),
                                     dest_row.data_ptr<int>(), w, static_cast<int>(x.size(0)),
                                     static_cast<int>(expert_idx.size(1)), hidden, static_cast<int>(num_experts), s,
                                     dv, static_cast<uint32_t>(epoch), static_cast<int>(num_blocks),
                                     c10::cuda::getCurrentCUDAStream(), dedup, nullptr, nullptr, own_whole));
}

namespace {

// What the fused dispatch's two forms check and share: the views, the wait policy and the
// FusedArrive (started, rounds and take left for the caller).
struct FusedSetup {
  SymView s;
  DirectView dv;
  WaitPolicy w;
  FusedArrive fused;
};

FusedSetup fused_setup(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                       int64_t num_experts, const std::vector<int64_t>& sym, const std::vector<int64_t>& direct,
                       const torch::Tensor& segs, torch::Tensor& out, torch::Tensor& recv_pair, int64_t timeout_ns,
                       const torch::Tensor& error_record, int64_t layer_id) {
  UNIEP_CHECK_INPUT(x);
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_INPUT(dest_row);
  UNIEP_CHECK_INPUT(segs);
  UNIEP_CHECK_INPUT(out);
  UNIEP_CHECK_INPUT(recv_pair);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  UNIEP_CHECK_DTYPE(dest_row, torch::kInt32);
  UNIEP_CHECK_DTYPE(segs, torch::kInt32);
  UNIEP_CHECK_DTYPE(recv_pair, torch::kInt32);
  TORCH_CHECK(x.dim() == 2 && expert_idx.dim() == 2, "x must be [T, M] and expert_idx [T, k]");
  UNIEP_CHECK_SHAPE(expert_idx, x.size(0), expert_idx.size(1));
  UNIEP_CHECK_SHAPE(dest_row, x.size(0), expert_idx.size(1));
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out must have x's dtype");
  FusedSetup f;
  f.s = sym_from_descriptor(sym);
  f.dv = direct_from_descriptor(direct);
  f.w = wait_from_args(timeout_ns, error_record, layer_id);
  TORCH_CHECK(f.dv.use, "the fused dispatch receives in place (direct regions)");
  const int L = static_cast<int>(num_experts / f.s.num_ranks);
  UNIEP_CHECK_SHAPE(segs, static_cast<int64_t>(f.s.num_ranks) * L, 4);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == f.s.recv_rows && out.size(1) == x.size(1),
              "out must be the direct region [R_max = ", f.s.recv_rows, ", ", x.size(1), "], got ", out.sizes());
  UNIEP_CHECK_SHAPE(recv_pair, f.s.recv_rows);
  TORCH_CHECK(x.size(1) * x.element_size() <= f.s.recv_row_bytes, "x rows are wider than the receive rows");
  TORCH_CHECK(x.size(0) * expert_idx.size(1) <= f.s.pairs_per_rank, "x has ", x.size(0) * expert_idx.size(1),
              " pairs, the buffers hold ", f.s.pairs_per_rank);
  f.fused = FusedArrive{segs.data_ptr<int>(), L, out.data_ptr(), recv_pair.data_ptr<int>(), nullptr, 0, 0, false};
  return f;
}

}  // namespace

void dispatch_fused(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                    int64_t num_experts, const std::vector<int64_t>& sym, const std::vector<int64_t>& direct,
                    int64_t epoch, int64_t num_blocks, bool dedup, const torch::Tensor& segs, torch::Tensor& out,
                    torch::Tensor& recv_pair, const c10::optional<torch::Tensor>& started, int64_t send_begin,
                    int64_t send_end, bool take, int64_t timeout_ns, const torch::Tensor& error_record,
                    int64_t layer_id) {
  FusedSetup f = fused_setup(x, expert_idx, dest_row, num_experts, sym, direct, segs, out, recv_pair, timeout_ns,
                             error_record, layer_id);
  if (started.has_value()) {
    UNIEP_CHECK_DTYPE((*started), torch::kInt32);
    TORCH_CHECK(started->numel() >= 1 && (started->is_cuda() ? started->device() == x.device() : started->is_pinned()),
                "started must be an int32 word on the rows' GPU or in pinned host memory");
    f.fused.started = started->data_ptr<int>();
  }
  TORCH_CHECK(0 <= send_begin && send_begin <= send_end && send_end <= f.s.num_ranks, "send rounds [", send_begin,
              ", ", send_end, ") outside [0, ", f.s.num_ranks, "]");
  f.fused.send_begin = static_cast<int>(send_begin);
  f.fused.send_end = static_cast<int>(send_end);
  f.fused.take = take;
  const c10::cuda::CUDAGuard guard(x.device());
  UNIEP_CHECK_LAUNCH(launch_dispatch(dtype_of(x), false, x.data_ptr(), expert_idx.data_ptr<int>(),
                                     dest_row.data_ptr<int>(), nullptr, static_cast<int>(x.size(0)),
                                     static_cast<int>(expert_idx.size(1)), static_cast<int>(x.size(1)),
                                     static_cast<int>(num_experts), f.s, f.dv, static_cast<uint32_t>(epoch),
                                     static_cast<int>(num_blocks), c10::cuda::getCurrentCUDAStream(), dedup,
                                     &f.fused, &f.w));
}

torch::Tensor interleaved_job(const torch::Tensor& x, const torch::Tensor& expert_idx, const torch::Tensor& dest_row,
                              int64_t num_experts, const std::vector<int64_t>& sym,
                              const std::vector<int64_t>& direct, int64_t epoch, bool dedup, const torch::Tensor& segs,
                              torch::Tensor& out, torch::Tensor& recv_pair, int64_t tokens_per_item,
                              int64_t rows_per_item, bool prefetch, int64_t warps, int64_t send_begin,
                              int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id) {
  const FusedSetup f = fused_setup(x, expert_idx, dest_row, num_experts, sym, direct, segs, out, recv_pair,
                                   timeout_ns, error_record, layer_id);
  UNIEP_CHECK_DTYPE(x, torch::kBFloat16);
  TORCH_CHECK(x.size(1) % 8 == 0, "the interleaved dispatch moves rows of 16-byte vectors");
  TORCH_CHECK(expert_idx.size(1) >= 1 && expert_idx.size(1) <= kMaxTopK, "k must be in 1..", kMaxTopK);
  TORCH_CHECK(tokens_per_item >= 1 && rows_per_item >= 1, "items need at least one token and one row, got ",
              tokens_per_item, " and ", rows_per_item);
  TORCH_CHECK(warps == 1 || warps == 2, "the job runs in 1 or 2 warps per CTA, got ", warps);
  TORCH_CHECK(send_begin >= 1 && send_begin <= f.s.num_ranks, "send_begin must be in 1..", f.s.num_ranks, ", got ",
              send_begin);
  InterleavedDispatch job{};
  job.x = x.data_ptr();
  job.expert_idx = expert_idx.data_ptr<int>();
  job.dest_row = dest_row.data_ptr<int>();
  job.num_tokens = static_cast<int>(x.size(0));
  job.k = static_cast<int>(expert_idx.size(1));
  job.hidden = static_cast<int>(x.size(1));
  job.experts_per_rank = f.fused.experts_per_rank;
  job.dedup = dedup ? 1 : 0;
  job.tokens_per_item = static_cast<int>(tokens_per_item);
  job.rows_per_item = static_cast<int>(rows_per_item);
  job.warps = static_cast<int>(warps);
  job.prefetch = prefetch ? 1 : 0;
  job.epoch = static_cast<uint32_t>(epoch);
  job.s = f.s;
  job.dv = f.dv;
  job.f = f.fused;
  job.f.send_begin = static_cast<int>(send_begin);
  job.w = f.w;
  torch::Tensor bytes = torch::empty({static_cast<int64_t>(sizeof(job))}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), &job, sizeof(job));
  return bytes;
}

void recv_copyout(const torch::Tensor& num_recv, bool fp8, torch::Tensor& out, torch::Tensor& recv_pair,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                  const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks, bool copy_rows,
                  bool dedup) {
  UNIEP_CHECK_INPUT(num_recv);
  UNIEP_CHECK_INPUT(out);
  UNIEP_CHECK_INPUT(recv_pair);
  UNIEP_CHECK_DTYPE(num_recv, torch::kInt32);
  UNIEP_CHECK_DTYPE(recv_pair, torch::kInt32);
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  TORCH_CHECK(out.dim() == 2 && out.size(0) <= s.recv_rows, "out must be [R, M] with R <= R_max = ", s.recv_rows,
              ", got ", out.sizes());
  UNIEP_CHECK_SHAPE(recv_pair, out.size(0));
  const int hidden = static_cast<int>(out.size(1));
  const c10::cuda::CUDAGuard guard(out.device());
  UNIEP_CHECK_LAUNCH(launch_recv_copyout(dtype_of(out), fp8, s, static_cast<uint32_t>(epoch), w,
                                         num_recv.data_ptr<int>(), static_cast<int>(out.size(0)), hidden, out.data_ptr(), recv_pair.data_ptr<int>(),
                                         static_cast<int>(num_blocks), copy_rows, c10::cuda::getCurrentCUDAStream(),
                                         dedup));
}

}  // namespace uniep
