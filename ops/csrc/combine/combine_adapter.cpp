// Combine family: tensor checks, dtype, device guard and stream for the combine launchers.
#include <algorithm>

#include "../adapters.h"
#include "../host_utils.h"
#include "combine.cuh"

namespace uniep {
namespace {

// The segment tables of copy_segments and copy_segments_sm.
void check_segment_table(const torch::Tensor& table) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == torch::kInt64 && table.dim() == 2 &&
                  table.size(1) == 3 && table.is_contiguous(),
              "table must be a contiguous CPU int64 [n, 3] tensor of (source address, destination address, bytes)");
}

// expert_idx [T, k] int32 and out [T, M], on the device: what every summing launcher reads and writes.
void check_routing_and_out(const torch::Tensor& expert_idx, const torch::Tensor& out) {
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_INPUT(out);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  TORCH_CHECK(expert_idx.dim() == 2 && out.dim() == 2 && out.size(0) == expert_idx.size(0),
              "expert_idx must be [T, k] and out [T, M]");
}

// y [R, M] rows of this rank's layout with their source pairs recv_pair [R] and num_recv [1]
// int32, going back to their sources' [pairs_per_rank, M] buffers: the checks every pushing
// launcher makes; returns the layer's SymView.
SymView check_rows_back(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                        const std::vector<int64_t>& sym) {
  UNIEP_CHECK_INPUT(y);
  UNIEP_CHECK_INPUT(recv_pair);
  UNIEP_CHECK_INPUT(num_recv);
  UNIEP_CHECK_DTYPE(recv_pair, torch::kInt32);
  UNIEP_CHECK_DTYPE(num_recv, torch::kInt32);
  const SymView s = sym_from_descriptor(sym);
  TORCH_CHECK(y.dim() == 2 && y.size(0) <= s.recv_rows, "y must be [R, M] with R <= R_max = ", s.recv_rows,
              ", got ", y.sizes());
  UNIEP_CHECK_SHAPE(recv_pair, y.size(0));
  TORCH_CHECK(y.size(1) * static_cast<int64_t>(y.element_size()) == s.comb_row_bytes, "y rows are ",
              y.size(1) * y.element_size(), " bytes, the combine buffer's ", s.comb_row_bytes);
  return s;
}

}  // namespace

void combine_push(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t num_blocks) {
  const SymView s = check_rows_back(y, recv_pair, num_recv, sym);
  const c10::cuda::CUDAGuard guard(y.device());
  UNIEP_CHECK_LAUNCH(launch_combine_push(dtype_of(y), y.data_ptr(), recv_pair.data_ptr<int>(),
                                         num_recv.data_ptr<int>(), static_cast<int>(y.size(0)),
                                         static_cast<int>(y.size(1)), s,
                                         static_cast<uint32_t>(epoch), static_cast<int>(num_blocks),
                                         c10::cuda::getCurrentCUDAStream()));
}

void combine_partials_push(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                           torch::Tensor& table, int64_t table_epoch, int64_t k, bool weighted, int64_t gates_epoch,
                           const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                           const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks) {
  const SymView s = check_rows_back(y, recv_pair, num_recv, sym);
  UNIEP_CHECK_INPUT(table);
  UNIEP_CHECK_DTYPE(table, torch::kInt64);
  TORCH_CHECK(table.numel() >= s.num_ranks * s.pairs_per_rank, "the pair table holds ", table.numel(),
              " entries, fewer than the ", s.num_ranks * s.pairs_per_rank, " pair codes");
  TORCH_CHECK(k >= 1 && s.pairs_per_rank % k == 0, "k = ", k, " does not divide the ", s.pairs_per_rank,
              " pairs per rank");
  TORCH_CHECK(table_epoch > 0 && table_epoch <= 0xffffffffLL, "table_epoch must be in 1..2^32-1, got ", table_epoch);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const c10::cuda::CUDAGuard guard(y.device());
  UNIEP_CHECK_LAUNCH(launch_combine_partials_push(
      dtype_of(y), y.data_ptr(), recv_pair.data_ptr<int>(), num_recv.data_ptr<int>(), static_cast<int>(y.size(0)),
      reinterpret_cast<uint64_t*>(table.data_ptr<int64_t>()), static_cast<uint32_t>(table_epoch),
      static_cast<int>(k), static_cast<int>(y.size(1)), weighted, static_cast<uint32_t>(gates_epoch), s,
      static_cast<uint32_t>(epoch), w, static_cast<int>(num_blocks), c10::cuda::getCurrentCUDAStream()));
}

void combine_reduce(const torch::Tensor& expert_idx, const c10::optional<torch::Tensor>& weights,
                    int64_t num_experts, torch::Tensor& out, const std::vector<int64_t>& sym, int64_t epoch,
                    int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks) {
  check_routing_and_out(expert_idx, out);
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  TORCH_CHECK(out.size(1) * static_cast<int64_t>(out.element_size()) == s.comb_row_bytes, "out rows are ",
              out.size(1) * out.element_size(), " bytes, the combine buffer's ", s.comb_row_bytes);
  const float* wp = optional_weights(weights, expert_idx);
  const c10::cuda::CUDAGuard guard(out.device());
  UNIEP_CHECK_LAUNCH(launch_combine_reduce(dtype_of(out), s, static_cast<uint32_t>(epoch), w,
                                           expert_idx.data_ptr<int>(), wp, static_cast<int>(out.size(0)),
                                           static_cast<int>(expert_idx.size(1)), static_cast<int>(out.size(1)),
                                           static_cast<int>(num_experts), out.data_ptr(),
                                           static_cast<int>(num_blocks), c10::cuda::getCurrentCUDAStream()));
}

void combine_chunked(const torch::Tensor& y, const torch::Tensor& recv_pair, const torch::Tensor& num_recv,
                     const torch::Tensor& expert_idx, const c10::optional<torch::Tensor>& weights,
                     int64_t num_experts, torch::Tensor& out, const std::vector<int64_t>& sym, int64_t epoch,
                     int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks,
                     int64_t reduce_blocks, int64_t chunk_tokens, int64_t num_chunks,
                     const c10::optional<torch::Tensor>& queue, bool queue_gpu_fence) {
  UNIEP_CHECK_INPUT(y);
  UNIEP_CHECK_INPUT(recv_pair);
  UNIEP_CHECK_INPUT(num_recv);
  UNIEP_CHECK_DTYPE(recv_pair, torch::kInt32);
  UNIEP_CHECK_DTYPE(num_recv, torch::kInt32);
  check_routing_and_out(expert_idx, out);
  const SymView s = sym_from_descriptor(sym);
  TORCH_CHECK(y.dim() == 2 && y.size(0) <= s.recv_rows, "y must be [R, M] with R <= R_max");
  UNIEP_CHECK_SHAPE(recv_pair, y.size(0));
  TORCH_CHECK(y.scalar_type() == out.scalar_type(), "y and out must have one dtype");
  TORCH_CHECK(y.size(1) * static_cast<int64_t>(y.element_size()) == s.comb_row_bytes &&
                  out.size(1) == y.size(1),
              "y and out rows must match the combine buffer's row bytes");
  int* qp = nullptr;
  int64_t q_words = 0;
  if (queue.has_value()) {
    UNIEP_CHECK_INPUT((*queue));
    UNIEP_CHECK_DTYPE((*queue), torch::kInt32);
    q_words = queue->numel();
    TORCH_CHECK(q_words >= combine_queue_words(static_cast<int>(num_blocks), static_cast<int>(y.size(0))),
                "the combine queue holds ", q_words, " words; ", num_blocks, " pushing blocks and ", y.size(0),
                " rows need ", combine_queue_words(static_cast<int>(num_blocks), static_cast<int>(y.size(0))));
    qp = queue->data_ptr<int>();
  }
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const float* wp = optional_weights(weights, expert_idx);
  const c10::cuda::CUDAGuard guard(out.device());
  UNIEP_CHECK_LAUNCH(launch_combine_chunked(
      dtype_of(out), y.data_ptr(), recv_pair.data_ptr<int>(), num_recv.data_ptr<int>(), static_cast<int>(y.size(0)),
      s, static_cast<uint32_t>(epoch), w, expert_idx.data_ptr<int>(), wp, static_cast<int>(out.size(0)),
      static_cast<int>(expert_idx.size(1)), static_cast<int>(out.size(1)), static_cast<int>(num_experts),
      out.data_ptr(), static_cast<int>(num_blocks), static_cast<int>(reduce_blocks), static_cast<int>(chunk_tokens),
      static_cast<int>(num_chunks), qp, q_words, queue_gpu_fence, c10::cuda::getCurrentCUDAStream()));
}

int64_t combine_queue_size(int64_t num_blocks, int64_t rows) {
  return combine_queue_words(static_cast<int>(num_blocks), static_cast<int>(rows));
}

void combine_mirror(const torch::Tensor& expert_idx, const torch::Tensor& dest_row, const torch::Tensor& mirror_off,
                    const c10::optional<torch::Tensor>& weights, int64_t num_experts, torch::Tensor& out,
                    const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                    const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks) {
  check_routing_and_out(expert_idx, out);
  UNIEP_CHECK_INPUT(dest_row);
  UNIEP_CHECK_INPUT(mirror_off);
  UNIEP_CHECK_DTYPE(dest_row, torch::kInt32);
  UNIEP_CHECK_DTYPE(mirror_off, torch::kInt32);
  TORCH_CHECK(dest_row.sizes() == expert_idx.sizes(), "dest_row must have expert_idx's shape");
  UNIEP_CHECK_SHAPE(mirror_off, num_experts);
  const SymView s = sym_from_descriptor(sym);
  TORCH_CHECK(out.size(1) * static_cast<int64_t>(out.element_size()) == s.comb_row_bytes, "out rows are ",
              out.size(1) * out.element_size(), " bytes, the combine buffer's ", s.comb_row_bytes);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const float* wp = optional_weights(weights, expert_idx);
  const c10::cuda::CUDAGuard guard(out.device());
  UNIEP_CHECK_LAUNCH(launch_combine_mirror(dtype_of(out), s, static_cast<uint32_t>(epoch), w,
                                           dest_row.data_ptr<int>(), mirror_off.data_ptr<int>(),
                                           expert_idx.data_ptr<int>(), wp, static_cast<int>(out.size(0)),
                                           static_cast<int>(expert_idx.size(1)), static_cast<int>(out.size(1)),
                                           static_cast<int>(num_experts), out.data_ptr(),
                                           static_cast<int>(num_blocks), c10::cuda::getCurrentCUDAStream()));
}

void copy_segments(const torch::Tensor& table, int64_t device_index) {
  check_segment_table(table);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* row = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < table.size(0); ++i, row += 3) {
    TORCH_CHECK(row[0] != 0 && row[1] != 0 && row[2] >= 0, "copy_segments: bad segment ", i);
    if (row[2] == 0) continue;
    UNIEP_CHECK_LAUNCH(cudaMemcpyAsync(reinterpret_cast<void*>(row[1]), reinterpret_cast<const void*>(row[0]),
                                       static_cast<size_t>(row[2]), cudaMemcpyDeviceToDevice, stream));
  }
}

void copy_segments_sm(const torch::Tensor& table, int64_t num_blocks, int64_t device_index) {
  check_segment_table(table);
  TORCH_CHECK(num_blocks > 0, "copy_segments_sm: num_blocks must be positive");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* row = table.data_ptr<int64_t>();
  const int64_t n = table.size(0);
  for (int64_t start = 0; start < n; start += kMaxSmSegments) {
    const int m = static_cast<int>(std::min<int64_t>(kMaxSmSegments, n - start));
    std::vector<const char*> src(m);
    std::vector<char*> dst(m);
    std::vector<int64_t> bytes(m);
    for (int i = 0; i < m; ++i) {
      const int64_t* r = row + 3 * (start + i);
      TORCH_CHECK(r[0] != 0 && r[1] != 0 && r[2] >= 0 && (r[0] | r[1] | r[2]) % 16 == 0,
                  "copy_segments_sm: segment addresses and sizes must be non-null multiples of 16 bytes");
      src[i] = reinterpret_cast<const char*>(r[0]);
      dst[i] = reinterpret_cast<char*>(r[1]);
      bytes[i] = r[2];
    }
    UNIEP_CHECK_LAUNCH(launch_copy_segments_sm(m, src.data(), dst.data(), bytes.data(),
                                               static_cast<int>(num_blocks), stream));
  }
}

void gate_grad(const torch::Tensor& expert_idx, const torch::Tensor& grad_out, int64_t num_experts,
               torch::Tensor& grad_gates, const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
               const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks) {
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_INPUT(grad_out);
  UNIEP_CHECK_INPUT(grad_gates);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  UNIEP_CHECK_DTYPE(grad_gates, torch::kFloat32);
  TORCH_CHECK(expert_idx.dim() == 2 && grad_out.dim() == 2 && grad_out.size(0) == expert_idx.size(0),
              "expert_idx must be [T, k] and grad_out [T, M]");
  UNIEP_CHECK_SHAPE(grad_gates, expert_idx.size(0), expert_idx.size(1));
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  TORCH_CHECK(grad_out.size(1) * static_cast<int64_t>(grad_out.element_size()) == s.comb_row_bytes,
              "grad_out rows do not match the combine buffer's ", s.comb_row_bytes, " bytes");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  UNIEP_CHECK_LAUNCH(launch_gate_grad(dtype_of(grad_out), s, static_cast<uint32_t>(epoch), w,
                                      expert_idx.data_ptr<int>(), grad_out.data_ptr(),
                                      static_cast<int>(grad_out.size(0)), static_cast<int>(expert_idx.size(1)),
                                      static_cast<int>(grad_out.size(1)), static_cast<int>(num_experts),
                                      grad_gates.data_ptr<float>(), static_cast<int>(num_blocks),
                                      c10::cuda::getCurrentCUDAStream()));
}

void gate_grad_mirror(const torch::Tensor& expert_idx, const torch::Tensor& dest_row, const torch::Tensor& mirror_off,
                      const torch::Tensor& grad_out, const c10::optional<torch::Tensor>& rows, int64_t num_experts,
                      torch::Tensor& grad_gates, const std::vector<int64_t>& sym, int64_t num_blocks) {
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_INPUT(dest_row);
  UNIEP_CHECK_INPUT(mirror_off);
  UNIEP_CHECK_INPUT(grad_out);
  UNIEP_CHECK_INPUT(grad_gates);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  UNIEP_CHECK_DTYPE(dest_row, torch::kInt32);
  UNIEP_CHECK_DTYPE(mirror_off, torch::kInt32);
  UNIEP_CHECK_DTYPE(grad_gates, torch::kFloat32);
  TORCH_CHECK(expert_idx.dim() == 2 && grad_out.dim() == 2 && grad_out.size(0) == expert_idx.size(0),
              "expert_idx must be [T, k] and grad_out [T, M]");
  TORCH_CHECK(dest_row.sizes() == expert_idx.sizes(), "dest_row must have expert_idx's shape");
  UNIEP_CHECK_SHAPE(mirror_off, num_experts);
  UNIEP_CHECK_SHAPE(grad_gates, expert_idx.size(0), expert_idx.size(1));
  const SymView s = sym_from_descriptor(sym);
  TORCH_CHECK(grad_out.size(1) * static_cast<int64_t>(grad_out.element_size()) == s.comb_row_bytes,
              "grad_out rows do not match the combine buffer's ", s.comb_row_bytes, " bytes");
  const void* base = s.ptrs[s.rank] + s.comb_off;
  if (rows.has_value()) {
    UNIEP_CHECK_INPUT((*rows));
    TORCH_CHECK(rows->dim() == 2 && rows->size(1) == grad_out.size(1) &&
                    rows->scalar_type() == grad_out.scalar_type() && rows->device() == grad_out.device(),
                "rows must be [*, M] of grad_out's dtype on its device, got ", rows->sizes());
    base = rows->data_ptr();
  }
  const c10::cuda::CUDAGuard guard(grad_out.device());
  UNIEP_CHECK_LAUNCH(launch_gate_grad_mirror(dtype_of(grad_out), base, dest_row.data_ptr<int>(),
                                             mirror_off.data_ptr<int>(), expert_idx.data_ptr<int>(),
                                             grad_out.data_ptr(), static_cast<int>(grad_out.size(0)),
                                             static_cast<int>(expert_idx.size(1)), static_cast<int>(grad_out.size(1)),
                                             static_cast<int>(num_experts), grad_gates.data_ptr<float>(),
                                             static_cast<int>(num_blocks), c10::cuda::getCurrentCUDAStream()));
}

void combine_bwd_rows(const c10::optional<torch::Tensor>& y, const torch::Tensor& num_recv, torch::Tensor& grad_y,
                      const std::vector<int64_t>& sym, int64_t dispatch_epoch, int64_t epoch, int64_t timeout_ns,
                      const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks, bool dedup,
                      int64_t row_begin, bool raise) {
  UNIEP_CHECK_INPUT(num_recv);
  UNIEP_CHECK_INPUT(grad_y);
  UNIEP_CHECK_DTYPE(num_recv, torch::kInt32);
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  if (y.has_value()) {
    UNIEP_CHECK_INPUT((*y));
    TORCH_CHECK(grad_y.sizes() == y->sizes() && grad_y.scalar_type() == y->scalar_type(),
                "grad_y must have y's shape and dtype");
  }
  TORCH_CHECK(grad_y.dim() == 2 && row_begin >= 0 && row_begin + grad_y.size(0) <= s.recv_rows,
              "grad_y must be rows [row_begin, row_begin + rows) of at most R_max = ", s.recv_rows, ", got ",
              grad_y.sizes(), " from row ", row_begin);
  TORCH_CHECK(grad_y.size(1) * static_cast<int64_t>(grad_y.element_size()) == s.recv_row_bytes, "grad_y rows are ",
              grad_y.size(1) * grad_y.element_size(), " bytes, the receive buffer's ", s.recv_row_bytes);
  const c10::cuda::CUDAGuard guard(grad_y.device());
  UNIEP_CHECK_LAUNCH(launch_combine_bwd_rows(dtype_of(grad_y), s, static_cast<uint32_t>(dispatch_epoch),
                                             static_cast<uint32_t>(epoch), w, num_recv.data_ptr<int>(),
                                             static_cast<int>(row_begin), static_cast<int>(grad_y.size(0)),
                                             static_cast<int>(grad_y.size(1)),
                                             y.has_value() ? y->data_ptr() : nullptr, grad_y.data_ptr(),
                                             static_cast<int>(num_blocks), c10::cuda::getCurrentCUDAStream(), dedup,
                                             raise));
}

void gate_collect(const torch::Tensor& expert_idx, int64_t num_experts, torch::Tensor& grad_gates,
                  const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns,
                  const torch::Tensor& error_record, int64_t layer_id, int64_t num_blocks) {
  UNIEP_CHECK_INPUT(expert_idx);
  UNIEP_CHECK_INPUT(grad_gates);
  UNIEP_CHECK_DTYPE(expert_idx, torch::kInt32);
  UNIEP_CHECK_DTYPE(grad_gates, torch::kFloat32);
  TORCH_CHECK(expert_idx.dim() == 2, "expert_idx must be [T, k]");
  UNIEP_CHECK_SHAPE(grad_gates, expert_idx.size(0), expert_idx.size(1));
  const SymView s = sym_from_descriptor(sym);
  TORCH_CHECK(expert_idx.numel() <= s.pairs_per_rank, "expert_idx has ", expert_idx.numel(),
              " pairs, the gates region holds ", s.pairs_per_rank);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const c10::cuda::CUDAGuard guard(grad_gates.device());
  UNIEP_CHECK_LAUNCH(launch_gate_collect(s, static_cast<uint32_t>(epoch), w, expert_idx.data_ptr<int>(),
                                         static_cast<int>(expert_idx.numel()), static_cast<int>(num_experts),
                                         grad_gates.data_ptr<float>(), static_cast<int>(num_blocks),
                                         c10::cuda::getCurrentCUDAStream()));
}

}  // namespace uniep
