// Combine family, push: every expert output row stored back into its source's combine buffer
// at its pair (launch_combine_push), or, with rank partials, one row per (token, rank) holding
// the sum of the token's rows on this rank (launch_combine_partials_push).
#include "../common.cuh"
#include "combine.cuh"
#include "combine_rows.cuh"

namespace uniep {
namespace {

template <typename T>
__global__ void __launch_bounds__(kCopyThreads) combine_push_kernel(const T* __restrict__ y,
                                                                    const int* __restrict__ recv_pair,
                                                                    const int* __restrict__ num_recv, int y_rows,
                                                                    int hidden, SymView s, uint32_t epoch) {
  if (poisoned(s)) return;
  epoch = device_epoch(s, kPhaseCombine, epoch);
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
    warp_row_vectors<kUnroll>(num_vecs, lane, [&](int i) { return __ldg(in + i); },
                              [&](int i, const int4& v) { dst[i] = v; });
  }
  signal_when_grid_done(s, status_words(s) + 2, kPhaseCombine, epoch);
}

// Rank partials, step 1: the pair table, entry pair = (epoch << 32) | row for every received row
// (rows of a token on this rank: the entries t * k + j of its source's pairs, j = 0..k-1).
__global__ void __launch_bounds__(kCopyThreads) pair_table_kernel(const int* __restrict__ recv_pair,
                                                                  const int* __restrict__ num_recv, int y_rows,
                                                                  uint64_t* __restrict__ table, uint32_t epoch) {
  const int R = min(*num_recv, y_rows);
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < R; r += gridDim.x * blockDim.x)
    table[__ldg(recv_pair + r)] = (static_cast<uint64_t>(epoch) << 32) | static_cast<uint32_t>(r);
}

// Rank partials, step 2: one warp per received row; the row of a token's first slot here (no
// earlier slot of the token in the table this epoch) sums the token's rows here in slot order in
// fp32, times the source's gates (read from its gates region once every rank raised kPhaseGates
// of gates_epoch) when kWeighted, casts once and stores the sum at that first slot in the source's
// combine buffer. Lane m holds slot j + m's row and gate, shuffled to every lane before the row
// loop; kUnroll vectors per lane and slot are loaded before they are added.
template <typename T, bool kWeighted, int kSlots>
__global__ void __launch_bounds__(kCopyThreads) combine_partials_push_kernel(
    const T* __restrict__ y, const int* __restrict__ recv_pair, const int* __restrict__ num_recv, int y_rows,
    const uint64_t* __restrict__ table, uint32_t epoch, int k, int hidden, SymView s, uint32_t combine_epoch,
    WaitPolicy w, uint32_t gates_epoch) {
  combine_epoch = device_epoch(s, kPhaseCombine, combine_epoch);
  gates_epoch = device_epoch(s, kPhaseGates, gates_epoch);
  if (kWeighted) {
    if (!block_wait_all(s, w, kPhaseGates, gates_epoch)) return;
  } else if (poisoned(s)) {
    return;
  }
  constexpr int kElems = Vec<T>::kElems;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int R = min(*num_recv, y_rows);
  const int num_vecs = hidden / kElems;
  for (int r = warp; r < R; r += num_warps) {
    const int pair = __ldg(recv_pair + r);
    const int j = pair % k;
    const int base = pair - j;  // slot 0 of the token
    // Lane m < j: an earlier slot of the token here? Lane m < k - j: slot j + m here?
    bool earlier = false, mine = false;
    int my_row = 0;
    float my_g = 1.0f;
    if (lane < j) earlier = static_cast<uint32_t>(__ldcg(table + base + lane) >> 32) == epoch;
    if (lane < k - j) {
      const uint64_t e = __ldcg(table + pair + lane);
      mine = static_cast<uint32_t>(e >> 32) == epoch;
      if (mine) {
        my_row = static_cast<int>(static_cast<uint32_t>(e));
        if (kWeighted) {
          const int src = pair / static_cast<int>(s.pairs_per_rank);
          my_g = __ldcg(reinterpret_cast<const float*>(s.ptrs[src] + s.gates_off) + (pair + lane) % s.pairs_per_rank);
        }
      }
    }
    if (__any_sync(kAll, earlier)) continue;  // not the token's first slot here
    const unsigned present = __ballot_sync(kAll, mine);
    int rows[kSlots];
    float g[kSlots];
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      rows[m] = __shfl_sync(kAll, my_row, m);
      g[m] = __shfl_sync(kAll, my_g, m);
    }
    const int src = pair / static_cast<int>(s.pairs_per_rank);
    int4* dst = reinterpret_cast<int4*>(s.ptrs[src] + s.comb_off + (pair % s.pairs_per_rank) * s.comb_row_bytes);
    for (int c0 = lane; c0 < num_vecs; c0 += 32 * kUnroll) {
      float acc[kUnroll][kElems];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[u][e] = 0.0f;
#pragma unroll
      for (int m = 0; m < kSlots; ++m) {
        if (!((present >> m) & 1u)) continue;
        const int4* in = reinterpret_cast<const int4*>(y + static_cast<int64_t>(rows[m]) * hidden);
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (c0 + 32 * u < num_vecs) v[u] = __ldg(in + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + 32 * u >= num_vecs) continue;
          float f[kElems];
          unpack<T>(v[u], f);
          if (kWeighted) {
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(g[m], f[e]));
          } else {
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[u][e] = __fadd_rn(acc[u][e], f[e]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + 32 * u < num_vecs) dst[c0 + 32 * u] = pack<T>(acc[u]);
    }
  }
  signal_when_grid_done(s, status_words(s) + 2, kPhaseCombine, combine_epoch);
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

cudaError_t launch_combine_partials_push(DType dtype, const void* y, const int* recv_pair, const int* num_recv,
                                         int y_rows, uint64_t* table, uint32_t table_epoch, int k, int hidden,
                                         bool weighted, uint32_t gates_epoch, const SymView& sym, uint32_t epoch,
                                         const WaitPolicy& wait, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0 || table_epoch == 0) return cudaErrorInvalidValue;
  pair_table_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(recv_pair, num_recv, y_rows, table, table_epoch);
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weighted, kWeighted, {
      UNIEP_SWITCH_SLOTS(k, kSlots, {
        combine_partials_push_kernel<T, kWeighted, kSlots><<<num_blocks, kCopyThreads, 0, stream>>>(
            static_cast<const T*>(y), recv_pair, num_recv, y_rows, table, table_epoch, k, hidden, sym, epoch, wait,
            gates_epoch);
      });
    });
  });
  return cudaGetLastError();
}

}  // namespace uniep
