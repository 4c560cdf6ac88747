// Host-side helpers of the torch adapters: named tensor checks and the
// conversion of the Python-side descriptors into the kernels' structs.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <vector>

#include "types.h"

#define UNIEP_CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor")
#define UNIEP_CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define UNIEP_CHECK_DTYPE(x, dt) TORCH_CHECK((x).scalar_type() == (dt), #x " must be " #dt ", got ", (x).scalar_type())
#define UNIEP_CHECK_SHAPE(x, ...)                                                                         \
  TORCH_CHECK((x).sizes() == torch::IntArrayRef({__VA_ARGS__}), #x " must have shape (" #__VA_ARGS__ \
              "), got ",                                                                                   \
              (x).sizes())
#define UNIEP_CHECK_INPUT(x) \
  UNIEP_CHECK_CUDA(x);       \
  UNIEP_CHECK_CONTIGUOUS(x)
#define UNIEP_CHECK_LAUNCH(call)                                                                             \
  do {                                                                                                       \
    const cudaError_t uniep_err_ = (call);                                                                   \
    TORCH_CHECK(uniep_err_ == cudaSuccess, #call " failed: ", cudaGetErrorString(uniep_err_));              \
  } while (0)

namespace uniep {

// Index of each field in the sym descriptor built by ds_uniep/megakernel/buffers.py (_SymBuffers.descriptor).
enum SymField : int {
  kSymPtrs = 0,  // kMaxRanks entries
  kSymRank = kMaxRanks,
  kSymNumRanks,
  kSymCountsOff,
  kSymSignalsOff,
  kSymStatusOff,
  kSymMetaOff,
  kSymScalesOff,
  kSymRecvOff,
  kSymCombOff,
  kSymGatesOff,
  kSymDupOff,
  kSymRecvRows,
  kSymRecvRowBytes,
  kSymCombRowBytes,
  kSymPairsPerRank,
  kSymNumFields,
};

inline SymView sym_from_descriptor(const std::vector<int64_t>& d) {
  TORCH_CHECK(static_cast<int>(d.size()) == kSymNumFields, "sym descriptor must have ", kSymNumFields,
              " entries, got ", d.size());
  SymView s;
  for (int i = 0; i < kMaxRanks; ++i) s.ptrs[i] = reinterpret_cast<char*>(d[kSymPtrs + i]);
  s.rank = static_cast<int>(d[kSymRank]);
  s.num_ranks = static_cast<int>(d[kSymNumRanks]);
  TORCH_CHECK(s.num_ranks >= 1 && s.num_ranks <= kMaxRanks, "sym descriptor: num_ranks ", s.num_ranks,
              " outside 1..", kMaxRanks);
  TORCH_CHECK(s.rank >= 0 && s.rank < s.num_ranks, "sym descriptor: rank ", s.rank, " outside the group");
  s.counts_off = d[kSymCountsOff];
  s.signals_off = d[kSymSignalsOff];
  s.status_off = d[kSymStatusOff];
  s.meta_off = d[kSymMetaOff];
  s.scales_off = d[kSymScalesOff];
  s.recv_off = d[kSymRecvOff];
  s.comb_off = d[kSymCombOff];
  s.gates_off = d[kSymGatesOff];
  s.dup_off = d[kSymDupOff];
  s.recv_rows = d[kSymRecvRows];
  s.recv_row_bytes = d[kSymRecvRowBytes];
  s.comb_row_bytes = d[kSymCombRowBytes];
  s.pairs_per_rank = d[kSymPairsPerRank];
  return s;
}

inline DirectView direct_from_descriptor(const std::vector<int64_t>& d) {
  TORCH_CHECK(static_cast<int>(d.size()) == kMaxRanks + 2, "direct descriptor must have ", kMaxRanks + 2,
              " entries, got ", d.size());
  DirectView v;
  for (int i = 0; i < kMaxRanks; ++i) v.ptrs[i] = reinterpret_cast<char*>(d[i]);
  v.use = static_cast<int>(d[kMaxRanks]);
  v.counts_epoch = static_cast<uint32_t>(d[kMaxRanks + 1]);
  return v;
}

// error_record: [kErrorRecordWords] int64 in pinned host memory (mapped into the device's address space).
// Its owners allocate it pinned once (ds_uniep's BufferSet, CommFuse's arrival waits); it is not asked
// here at every launch (a driver query, refused while a CUDA graph is captured).
inline WaitPolicy wait_from_args(int64_t timeout_ns, const torch::Tensor& error_record, int64_t layer_id) {
  TORCH_CHECK(!error_record.is_cuda(), "error_record must be pinned host memory, got a CUDA tensor");
  UNIEP_CHECK_DTYPE(error_record, torch::kInt64);
  TORCH_CHECK(error_record.numel() >= kErrorRecordWords, "error_record needs ", kErrorRecordWords, " words");
  TORCH_CHECK(timeout_ns > 0, "timeout_ns must be positive");
  WaitPolicy w;
  w.timeout_ns = static_cast<uint64_t>(timeout_ns);
  w.error_record = error_record.data_ptr<int64_t>();
  w.layer_id = static_cast<int>(layer_id);
  return w;
}

inline DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return DType::kFloat32;
    case torch::kBFloat16:
      return DType::kBFloat16;
    case torch::kFloat16:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "rows must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline const float* optional_weights(const c10::optional<torch::Tensor>& w, const torch::Tensor& expert_idx) {
  if (!w.has_value()) return nullptr;
  const torch::Tensor& weights = *w;
  UNIEP_CHECK_INPUT(weights);
  UNIEP_CHECK_DTYPE(weights, torch::kFloat32);
  UNIEP_CHECK_SHAPE(weights, expert_idx.size(0), expert_idx.size(1));
  return weights.data_ptr<float>();
}

}  // namespace uniep
