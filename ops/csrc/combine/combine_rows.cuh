// Combine family, device side shared by its kernel files: where a token's k rows are read
// from (CombRows, MirrorRows) and the slot-order sum of one token (reduce_token). Included by
// the combine .cu files only, after common.cuh.
#pragma once

#include "../common.cuh"

namespace uniep {
namespace {

constexpr int kUnroll = 4;  // 16-byte vectors each lane has in flight per step

// Where reduce_token finds the row of slot (t, j). slot() turns a kept pair into one int, not
// a pointer (fewer registers; -1 is taken by dropped pairs), load() reads a vector of it.
// CombRows: this rank's combine buffer, row t * k + j (rows pushed back by the experts' ranks).
struct CombRows {
  const int4* base;
  int64_t row_vecs;
  __device__ __forceinline__ int slot(int pair, int /*expert*/) const { return pair; }
  __device__ __forceinline__ int4 load(int code, int c) const { return __ldcg(base + code * row_vecs + c); }
};

// Token t's output over the vectors [c_begin, c_end) of its row, one warp, a lane per
// 16-byte vector: the k slots are added in slot order, product then sum rounded separately
// (no contraction), so the result depends neither on the schedule that moved the rows nor on
// where they are read from. kSlots >= k is a compile-time bound, so a token's rows and gates
// stay in registers and a lane issues the loads of up to 4 slots before adding them.
template <typename T, bool kWeighted, int kSlots, typename Rows, int kMaxGroup = 4>
__device__ __forceinline__ void reduce_token(const Rows& rows, const int* __restrict__ expert_idx,
                                             const float* __restrict__ weights, int t, int k, int hidden,
                                             int num_experts, int c_begin, int c_end, int lane,
                                             T* __restrict__ out) {
  constexpr int kElems = Vec<T>::kElems;
  int code[kSlots];
  float g[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    code[j] = -1;
    g[j] = 1.0f;
    if (j < k) {
      const int pair = t * k + j;
      const int e = __ldg(expert_idx + pair);
      if (e >= 0 && e < num_experts) {  // a dropped pair sent no row
        code[j] = rows.slot(pair, e);
        if (kWeighted) g[j] = __ldg(weights + pair);
      }
    }
  }
  int4* row_out = reinterpret_cast<int4*>(out + static_cast<int64_t>(t) * hidden);
  for (int c = c_begin + lane; c < c_end; c += 32) {
    float acc[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[i] = 0.0f;
    // Slots in groups of up to kMaxGroup (all loads of a group issued, then added in slot order):
    // with 4 the registers of a lane fit two blocks per SM.
    constexpr int kGroup = kSlots < kMaxGroup ? kSlots : kMaxGroup;
#pragma unroll
    for (int j0 = 0; j0 < kSlots; j0 += kGroup) {
      int4 v[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup; ++j)
        if (code[j0 + j] >= 0) v[j] = rows.load(code[j0 + j], c);
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (code[j0 + j] < 0) continue;
        float f[kElems];
        unpack<T>(v[j], f);
        if (kWeighted) {
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(g[j0 + j], f[i]));
        } else {
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
        }
      }
    }
    row_out[c] = pack<T>(acc);
  }
}

__host__ __device__ __forceinline__ CombRows comb_rows(const SymView& s) {
  return CombRows{reinterpret_cast<const int4*>(s.ptrs[s.rank] + s.comb_off), s.comb_row_bytes / 16};
}

// MirrorRows: this rank's combine buffer filled by the copy engines in expert order (the
// pipelined schedule): the rows of this rank's pairs of expert e sit from mirror_base[e] on, in
// the order of the destination's layout, so the row of (t, j) is dest_row[t, j] + off[e] with
// off[e] = mirror_base[e] - (first row of this rank's pairs of e on the destination).
struct MirrorRows {
  const int4* base;
  const int* dest_row;
  const int* off;
  int64_t row_vecs;
  __device__ __forceinline__ int slot(int pair, int expert) const {
    return __ldg(dest_row + pair) + __ldg(off + expert);
  }
  __device__ __forceinline__ int4 load(int code, int c) const { return __ldcg(base + code * row_vecs + c); }
};

}  // namespace
}  // namespace uniep
