// Combine family, reduce: once every rank has pushed, each token's k rows summed in slot order
// in fp32 and cast once, read from the combine buffer at pair t * k + j (launch_combine_reduce)
// or where the pipelined schedule's copy-engine pushes left them (launch_combine_mirror).
#include "../common.cuh"
#include "combine.cuh"
#include "combine_rows.cuh"

namespace uniep {
namespace {

// One warp per token, after every rank's whole push (kPhaseCombine); Rows: CombRows or MirrorRows.
template <typename T, bool kWeighted, int kSlots, typename Rows>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                      Rows rows, const int* __restrict__ expert_idx,
                                                                      const float* __restrict__ weights,
                                                                      int num_tokens, int k, int hidden,
                                                                      int num_experts, T* __restrict__ out) {
  epoch = device_epoch(s, kPhaseCombine, epoch);
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  for (int t = warp; t < num_tokens; t += num_warps)
    reduce_token<T, kWeighted, kSlots>(rows, expert_idx, weights, t, k, hidden, num_experts, 0,
                                       hidden / Vec<T>::kElems, lane, out);
}

}  // namespace

cudaError_t launch_combine_reduce(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                  const int* expert_idx, const float* weights, int num_tokens, int k, int hidden,
                                  int num_experts, void* out, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weights != nullptr, kWeighted, {
      UNIEP_SWITCH_SLOTS(k, kSlots, {
        combine_reduce_kernel<T, kWeighted, kSlots><<<num_blocks, kCopyThreads, 0, stream>>>(
            sym, epoch, wait, comb_rows(sym), expert_idx, weights, num_tokens, k, hidden, num_experts,
            static_cast<T*>(out));
      });
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_combine_mirror(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                  const int* dest_row, const int* mirror_off, const int* expert_idx,
                                  const float* weights, int num_tokens, int k, int hidden, int num_experts, void* out,
                                  int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  const CombRows comb = comb_rows(sym);
  const MirrorRows rows{comb.base, dest_row, mirror_off, comb.row_vecs};
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weights != nullptr, kWeighted, {
      UNIEP_SWITCH_SLOTS(k, kSlots, {
        combine_reduce_kernel<T, kWeighted, kSlots><<<num_blocks, kCopyThreads, 0, stream>>>(
            sym, epoch, wait, rows, expert_idx, weights, num_tokens, k, hidden, num_experts, static_cast<T*>(out));
      });
    });
  });
  return cudaGetLastError();
}

}  // namespace uniep
