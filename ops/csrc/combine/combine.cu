#include "../common.cuh"
#include "combine.cuh"

namespace uniep {
namespace {

constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kCopyThreads) combine_push_kernel(const T* __restrict__ y,
                                                                    const int* __restrict__ recv_pair,
                                                                    const int* __restrict__ num_recv, int y_rows,
                                                                    int hidden, SymView s, uint32_t epoch) {
  if (poisoned(s)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int R = min(*num_recv, y_rows);
  const int num_vecs = hidden / Vec<T>::kElems;
  for (int r = warp; r < R; r += num_warps) {
    const int pair = recv_pair[r];
    const int src = static_cast<int>(pair / s.pairs_per_rank);
    const int64_t slot = pair % s.pairs_per_rank;
    int4* dst = reinterpret_cast<int4*>(s.ptrs[src] + s.comb_off + slot * s.comb_row_bytes);
    const int4* in = reinterpret_cast<const int4*>(y + static_cast<int64_t>(r) * hidden);
    for (int c0 = lane; c0 < num_vecs; c0 += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + 32 * u < num_vecs) v[u] = __ldg(in + c0 + 32 * u);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + 32 * u < num_vecs) dst[c0 + 32 * u] = v[u];
    }
  }
  signal_when_grid_done(s, status_words(s) + 2, kPhaseCombine, epoch);
}

// One warp per token, a lane per 16-byte vector: the k slots are added in slot
// order, product then sum rounded separately (no contraction), so the result does
// not depend on the schedule that moved the rows. kSlots >= k is a compile-time
// bound, so a token's row pointers and gates stay in registers and a lane issues
// the loads of all k slots before adding any of them.
template <typename T, bool kWeighted, int kSlots>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                      const int* __restrict__ expert_idx,
                                                                      const float* __restrict__ weights,
                                                                      int num_tokens, int k, int hidden,
                                                                      int num_experts, T* __restrict__ out) {
  constexpr int kElems = Vec<T>::kElems;
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int num_vecs = hidden / kElems;
  const char* comb = s.ptrs[s.rank] + s.comb_off;
  for (int t = warp; t < num_tokens; t += num_warps) {
    const int4* rows[kSlots];
    float g[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      rows[j] = nullptr;
      g[j] = 1.0f;
      if (j < k) {
        const int64_t pair = static_cast<int64_t>(t) * k + j;
        const int e = __ldg(expert_idx + pair);
        if (e >= 0 && e < num_experts) {  // a dropped pair sent no row
          rows[j] = reinterpret_cast<const int4*>(comb + pair * s.comb_row_bytes);
          if (kWeighted) g[j] = __ldg(weights + pair);
        }
      }
    }
    int4* row_out = reinterpret_cast<int4*>(out + static_cast<int64_t>(t) * hidden);
    for (int c = lane; c < num_vecs; c += 32) {
      int4 v[kSlots];
#pragma unroll
      for (int j = 0; j < kSlots; ++j)
        if (rows[j] != nullptr) v[j] = __ldcg(rows[j] + c);
      float acc[kElems];
#pragma unroll
      for (int i = 0; i < kElems; ++i) acc[i] = 0.0f;
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (rows[j] == nullptr) continue;
        float f[kElems];
        unpack<T>(v[j], f);
        if (kWeighted) {
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(g[j], f[i]));
        } else {
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
        }
      }
      row_out[c] = pack<T>(acc);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kCopyThreads) gate_grad_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                 const int* __restrict__ expert_idx,
                                                                 const T* __restrict__ grad_out, int num_tokens,
                                                                 int k, int hidden, int num_experts,
                                                                 float* __restrict__ grad_gates) {
  constexpr int kElems = Vec<T>::kElems;
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int num_vecs = hidden / kElems;
  const char* comb = s.ptrs[s.rank] + s.comb_off;
  for (int t = warp; t < num_tokens; t += num_warps) {
    const int4* go = reinterpret_cast<const int4*>(grad_out + static_cast<int64_t>(t) * hidden);
    for (int j = 0; j < k; ++j) {
      const int64_t pair = static_cast<int64_t>(t) * k + j;
      const int e = __ldg(expert_idx + pair);
      float partial = 0.0f;
      if (e >= 0 && e < num_experts) {
        const int4* yr = reinterpret_cast<const int4*>(comb + pair * s.comb_row_bytes);
        for (int c = lane; c < num_vecs; c += 32) {
          float a[kElems], b[kElems];
          unpack<T>(__ldg(go + c), a);
          unpack<T>(__ldcg(yr + c), b);
#pragma unroll
          for (int i = 0; i < kElems; ++i) partial = __fadd_rn(partial, __fmul_rn(a[i], b[i]));
        }
      }
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) partial = __fadd_rn(partial, __shfl_xor_sync(0xffffffffu, partial, off));
      if (lane == 0) grad_gates[pair] = partial;
    }
  }
}

}  // namespace

cudaError_t launch_combine_push(DType dtype, const void* y, const int* recv_pair, const int* num_recv, int y_rows,
                                int hidden, const SymView& sym, uint32_t epoch, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    combine_push_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(static_cast<const T*>(y), recv_pair, num_recv,
                                                                    y_rows, hidden, sym, epoch);
  });
  return cudaGetLastError();
}

cudaError_t launch_combine_reduce(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                  const int* expert_idx, const float* weights, int num_tokens, int k, int hidden,
                                  int num_experts, void* out, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weights != nullptr, kWeighted, {
      UNIEP_SWITCH_SLOTS(k, kSlots, {
        combine_reduce_kernel<T, kWeighted, kSlots><<<num_blocks, kCopyThreads, 0, stream>>>(
            sym, epoch, wait, expert_idx, weights, num_tokens, k, hidden, num_experts, static_cast<T*>(out));
      });
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_gate_grad(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                             const int* expert_idx, const void* grad_out, int num_tokens, int k, int hidden,
                             int num_experts, float* grad_gates, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    gate_grad_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(sym, epoch, wait, expert_idx,
                                                                 static_cast<const T*>(grad_out), num_tokens, k,
                                                                 hidden, num_experts, grad_gates);
  });
  return cudaGetLastError();
}

}  // namespace uniep
