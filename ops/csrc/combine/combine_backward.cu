// Combine family, backward: the gate gradients (launch_gate_grad, launch_gate_grad_mirror,
// launch_gate_collect) and the expert side of the backward of combine (launch_combine_bwd_rows).
#include "../common.cuh"
#include "combine.cuh"
#include "combine_rows.cuh"

namespace uniep {
namespace {

// grad_gates[t, j] = <grad_out[t], row of (t, j)>; Rows: CombRows (after every rank's push,
// kPhaseCombine, when `wait`) or MirrorRows (the fused schedule's rows in expert order, no wait).
template <typename T, typename Rows>
__global__ void __launch_bounds__(kCopyThreads) gate_grad_kernel(SymView s, uint32_t epoch, WaitPolicy w, bool wait,
                                                                 Rows rows, const int* __restrict__ expert_idx,
                                                                 const T* __restrict__ grad_out, int num_tokens,
                                                                 int k, int hidden, int num_experts,
                                                                 float* __restrict__ grad_gates) {
  constexpr int kElems = Vec<T>::kElems;
  // (Without `wait`, s is unused: launch_gate_grad_mirror passes an empty view.)
  if (wait && !block_wait_all(s, w, kPhaseCombine, device_epoch(s, kPhaseCombine, epoch))) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int num_vecs = hidden / kElems;
  for (int t = warp; t < num_tokens; t += num_warps) {
    const int4* go = reinterpret_cast<const int4*>(grad_out + static_cast<int64_t>(t) * hidden);
    for (int j = 0; j < k; ++j) {
      const int64_t pair = static_cast<int64_t>(t) * k + j;
      const int e = __ldg(expert_idx + pair);
      float partial = 0.0f;
      if (e >= 0 && e < num_experts) {
        const int code = rows.slot(static_cast<int>(pair), e);
        for (int c = lane; c < num_vecs; c += 32) {
          float a[kElems], b[kElems];
          unpack<T>(__ldg(go + c), a);
          unpack<T>(rows.load(code, c), b);
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

// Backward of combine on the expert side (one warp per received row r): the row holds
// grad_out[t] of its pair (t, j), unweighted; the pair's gate is read from the source's gates
// region. grad_y[r] = cast(gate * float(grad_out[t])), and <grad_out[t], y[r]> goes back into the
// source's gates region at the pair, summed in gate_grad_kernel's order (lane-strided
// partials, then the butterfly), so both give the same bits.
template <typename T>
__global__ void __launch_bounds__(kCopyThreads) combine_bwd_rows_kernel(
    SymView s, uint32_t dispatch_epoch, uint32_t epoch, WaitPolicy w, const int* __restrict__ num_recv,
    int row_begin, int y_rows, int hidden, const T* __restrict__ y, T* __restrict__ grad_y, bool dedup,
    bool raise) {
  constexpr int kElems = Vec<T>::kElems;
  dispatch_epoch = device_epoch(s, kPhaseDispatch, dispatch_epoch);
  epoch = device_epoch(s, kPhaseCombine, epoch);
  if (!block_wait_all(s, w, kPhaseDispatch, dispatch_epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int R = min(*num_recv, row_begin + y_rows);
  const int num_vecs = hidden / kElems;
  const int* meta = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.meta_off);
  for (int r = row_begin + warp; r < R; r += num_warps) {
    const int pair = __ldcg(meta + r);
    const int src = static_cast<int>(pair / s.pairs_per_rank);
    float* gate_word = reinterpret_cast<float*>(s.ptrs[src] + s.gates_off) + pair % s.pairs_per_rank;
    const float gate = __shfl_sync(0xffffffffu, lane == 0 ? __ldcg(gate_word) : 0.0f, 0);
    int from = r;  // a deduplicated dispatch left this row's grad_out in the token's first row here
    if (dedup) {
      const int first = __ldcg(reinterpret_cast<const int*>(s.ptrs[s.rank] + s.dup_off) + r);
      if (first >= 0) from = first;
    }
    const int4* g =
        reinterpret_cast<const int4*>(s.ptrs[s.rank] + s.recv_off + static_cast<int64_t>(from) * s.recv_row_bytes);
    int4* out = reinterpret_cast<int4*>(grad_y + static_cast<int64_t>(r - row_begin) * hidden);
    if (y == nullptr) {  // grad_y only: the source forms the gate gradients from its own copy of y
      for (int c0 = lane; c0 < num_vecs; c0 += 32 * kUnroll) {
        int4 gv[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (c0 + 32 * u < num_vecs) gv[u] = __ldcg(g + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + 32 * u >= num_vecs) continue;
          float a[kElems], o[kElems];
          unpack<T>(gv[u], a);
#pragma unroll
          for (int i = 0; i < kElems; ++i) o[i] = __fmul_rn(gate, a[i]);
          out[c0 + 32 * u] = pack<T>(o);
        }
      }
      continue;
    }
    const int4* yr = reinterpret_cast<const int4*>(y + static_cast<int64_t>(r - row_begin) * hidden);
    float partial = 0.0f;
    for (int c0 = lane; c0 < num_vecs; c0 += 32 * kUnroll) {
      int4 gv[kUnroll], yv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + 32 * u < num_vecs) {
          gv[u] = __ldcg(g + c0 + 32 * u);
          yv[u] = __ldg(yr + c0 + 32 * u);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + 32 * u >= num_vecs) continue;
        float a[kElems], b[kElems], o[kElems];
        unpack<T>(gv[u], a);
        unpack<T>(yv[u], b);
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
          partial = __fadd_rn(partial, __fmul_rn(a[i], b[i]));
          o[i] = __fmul_rn(gate, a[i]);
        }
        out[c0 + 32 * u] = pack<T>(o);
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) partial = __fadd_rn(partial, __shfl_xor_sync(0xffffffffu, partial, off));
    if (lane == 0) *gate_word = partial;
  }
  if (raise) signal_when_grid_done(s, status_words(s) + 3, kPhaseCombine, epoch);
}

// Waits for kPhaseCombine of every rank, then reads the gate gradients the expert ranks left
// in this rank's gates region; 0 for a dropped pair.
__global__ void __launch_bounds__(kCopyThreads) gate_collect_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                    const int* __restrict__ expert_idx,
                                                                    int num_pairs, int num_experts,
                                                                    float* __restrict__ grad_gates) {
  epoch = device_epoch(s, kPhaseCombine, epoch);
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const float* gates = reinterpret_cast<const float*>(s.ptrs[s.rank] + s.gates_off);
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < num_pairs; p += gridDim.x * blockDim.x) {
    const int e = __ldg(expert_idx + p);
    grad_gates[p] = (e >= 0 && e < num_experts) ? __ldcg(gates + p) : 0.0f;
  }
}

}  // namespace

cudaError_t launch_gate_grad(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                             const int* expert_idx, const void* grad_out, int num_tokens, int k, int hidden,
                             int num_experts, float* grad_gates, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    gate_grad_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(sym, epoch, wait, true, comb_rows(sym), expert_idx,
                                                                 static_cast<const T*>(grad_out), num_tokens, k,
                                                                 hidden, num_experts, grad_gates);
  });
  return cudaGetLastError();
}

cudaError_t launch_gate_grad_mirror(DType dtype, const void* rows_base, const int* dest_row, const int* mirror_off,
                                    const int* expert_idx, const void* grad_out, int num_tokens, int k, int hidden,
                                    int num_experts, float* grad_gates, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  SymView unused{};
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    const MirrorRows rows{static_cast<const int4*>(rows_base), dest_row, mirror_off,
                          static_cast<int64_t>(hidden) * static_cast<int64_t>(sizeof(T)) / 16};
    gate_grad_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(unused, 0, WaitPolicy{}, false, rows, expert_idx,
                                                                 static_cast<const T*>(grad_out), num_tokens, k,
                                                                 hidden, num_experts, grad_gates);
  });
  return cudaGetLastError();
}

cudaError_t launch_combine_bwd_rows(DType dtype, const SymView& sym, uint32_t dispatch_epoch, uint32_t epoch,
                                    const WaitPolicy& wait, const int* num_recv, int row_begin, int y_rows,
                                    int hidden, const void* y, void* grad_y, int num_blocks, cudaStream_t stream,
                                    bool dedup, bool raise) {
  if (num_blocks <= 0 || row_begin < 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    combine_bwd_rows_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(
        sym, dispatch_epoch, epoch, wait, num_recv, row_begin, y_rows, hidden, static_cast<const T*>(y),
        static_cast<T*>(grad_y), dedup, raise);
  });
  return cudaGetLastError();
}

cudaError_t launch_gate_collect(const SymView& sym, uint32_t epoch, const WaitPolicy& wait, const int* expert_idx,
                                int num_pairs, int num_experts, float* grad_gates, int num_blocks,
                                cudaStream_t stream) {
  if (num_blocks <= 0) return cudaErrorInvalidValue;
  gate_collect_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(sym, epoch, wait, expert_idx, num_pairs, num_experts,
                                                               grad_gates);
  return cudaGetLastError();
}

}  // namespace uniep
