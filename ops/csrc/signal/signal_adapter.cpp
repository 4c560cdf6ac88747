// Signal family: device guard and stream for launch_barrier.
#include <cuda.h>
#include <cudaTypedefs.h>

#include "../adapters.h"
#include "../host_utils.h"
#include "signal.cuh"

namespace uniep {

void barrier(const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns, const torch::Tensor& error_record,
             int64_t layer_id, int64_t device_index) {
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  UNIEP_CHECK_LAUNCH(launch_barrier(s, static_cast<uint32_t>(epoch), w, c10::cuda::getCurrentCUDAStream()));
}

void signal_raise(const std::vector<int64_t>& sym, int64_t phase, int64_t epoch, int64_t device_index) {
  const SymView s = sym_from_descriptor(sym);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  UNIEP_CHECK_LAUNCH(launch_raise(s, static_cast<int>(phase), static_cast<uint32_t>(epoch),
                                  c10::cuda::getCurrentCUDAStream()));
}

namespace {

// A driver entry point of the 11.7 ABI (no link against the driver library); null where the driver
// does not offer it. Callers keep it in a function-local static, so each is looked up once.
void* driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 11070, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    fn = nullptr;
  }
  return fn;
}

}  // namespace

bool stream_wait_word(const torch::Tensor& word, int64_t value) {
  UNIEP_CHECK_INPUT(word);
  UNIEP_CHECK_DTYPE(word, torch::kInt32);
  TORCH_CHECK(word.numel() >= 1, "stream_wait_word: the word tensor is empty");
  static const auto wait_value = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(driver_entry("cuStreamWaitValue32"));
  if (wait_value == nullptr) return false;
  const c10::cuda::CUDAGuard guard(word.device());
  const CUresult r = wait_value(c10::cuda::getCurrentCUDAStream().stream(), reinterpret_cast<CUdeviceptr>(word.data_ptr()),
                                static_cast<cuuint32_t>(static_cast<uint32_t>(value)), CU_STREAM_WAIT_VALUE_GEQ);
  return r == CUDA_SUCCESS;
}

bool stream_write_word(const torch::Tensor& word, int64_t value) {
  UNIEP_CHECK_INPUT(word);
  UNIEP_CHECK_DTYPE(word, torch::kInt32);
  TORCH_CHECK(word.numel() >= 1, "stream_write_word: the word tensor is empty");
  static const auto write_value =
      reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(driver_entry("cuStreamWriteValue32"));
  if (write_value == nullptr) return false;
  const c10::cuda::CUDAGuard guard(word.device());
  // Default flags: a fence orders the stream's earlier writes (copies included) before this one.
  const CUresult r = write_value(c10::cuda::getCurrentCUDAStream().stream(), reinterpret_cast<CUdeviceptr>(word.data_ptr()),
                                 static_cast<cuuint32_t>(static_cast<uint32_t>(value)), CU_STREAM_WRITE_VALUE_DEFAULT);
  return r == CUDA_SUCCESS;
}

void wait_words(const torch::Tensor& words, int64_t mask, int64_t epoch, int64_t timeout_ns,
                const torch::Tensor& error_record, const torch::Tensor& poison, int64_t layer_id, int64_t rank,
                int64_t phase) {
  UNIEP_CHECK_INPUT(words);
  UNIEP_CHECK_DTYPE(words, torch::kInt32);
  UNIEP_CHECK_INPUT(poison);
  UNIEP_CHECK_DTYPE(poison, torch::kInt32);
  TORCH_CHECK(mask >= 0 && mask < (int64_t(1) << 32) && (mask >> words.numel()) == 0,
              "wait_words: mask ", mask, " names words beyond the ", words.numel(), " given (at most 32)");
  TORCH_CHECK(poison.device() == words.device(), "wait_words: poison must be on the words' device");
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const c10::cuda::CUDAGuard guard(words.device());
  UNIEP_CHECK_LAUNCH(launch_wait_words(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
                                       static_cast<uint32_t>(mask), static_cast<uint32_t>(epoch), w,
                                       reinterpret_cast<uint32_t*>(poison.data_ptr<int32_t>()),
                                       static_cast<int>(rank), static_cast<int>(phase),
                                       c10::cuda::getCurrentCUDAStream()));
}

}  // namespace uniep
