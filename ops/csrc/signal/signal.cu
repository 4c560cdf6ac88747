#include "../common.cuh"
#include "signal.cuh"

namespace uniep {
namespace {

__global__ void barrier_kernel(SymView s, uint32_t epoch, WaitPolicy w) {
  if (poisoned(s)) return;
  epoch = device_epoch(s, kPhaseBarrier, epoch);
  __threadfence_system();
  if (threadIdx.x < s.num_ranks) raise_signal(s, threadIdx.x, kPhaseBarrier, epoch);
  block_wait_all(s, w, kPhaseBarrier, epoch);
}

__global__ void raise_kernel(SymView s, int phase, uint32_t epoch) {
  if (poisoned(s)) return;
  epoch = device_epoch(s, phase, epoch);
  __threadfence_system();
  if (threadIdx.x < s.num_ranks) raise_signal(s, threadIdx.x, phase, epoch);
}

__global__ void wait_words_kernel(const uint32_t* words, uint32_t mask, uint32_t epoch, WaitPolicy w,
                                  uint32_t* poison, int rank, int phase) {
  const int i = threadIdx.x;
  if ((mask >> i) & 1u) wait_until(words + i, epoch, w.timeout_ns, poison, w.error_record, phase, i, rank, w.layer_id);
}

}  // namespace

cudaError_t launch_wait_words(const uint32_t* words, uint32_t mask, uint32_t epoch, const WaitPolicy& wait,
                              uint32_t* poison, int rank, int phase, cudaStream_t stream) {
  if (mask == 0) return cudaSuccess;
  wait_words_kernel<<<1, 32, 0, stream>>>(words, mask, epoch, wait, poison, rank, phase);
  return cudaGetLastError();
}

cudaError_t launch_raise(const SymView& sym, int phase, uint32_t epoch, cudaStream_t stream) {
  if (phase < 0 || phase >= kNumPhases) return cudaErrorInvalidValue;
  raise_kernel<<<1, 32, 0, stream>>>(sym, phase, epoch);
  return cudaGetLastError();
}

cudaError_t launch_barrier(const SymView& sym, uint32_t epoch, const WaitPolicy& wait, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(sym, epoch, wait);
  return cudaGetLastError();
}

}  // namespace uniep
