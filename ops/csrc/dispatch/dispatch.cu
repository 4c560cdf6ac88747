#include "../common.cuh"
#include "dispatch.cuh"

namespace uniep {
namespace {

constexpr int kUnroll = 4;  // 16-byte vectors each lane has in flight per step

// Fused dispatch: the last block of the grid to start writes the epoch into the `started` word
// (device memory, which the stream queueing the GEMM waits on, or pinned host memory, which the
// host polls), so the GEMM that waits for these blocks' rows starts only once every block holds its SM.
__device__ __forceinline__ void announce_start(const SymView& s, int* started, uint32_t epoch) {
  if (threadIdx.x != 0) return;
  uint32_t* counter = status_words(s) + 20;
  if (atomicAdd(counter, 1u) == gridDim.x - 1) {
    *counter = 0;
    *reinterpret_cast<volatile int*>(started) = static_cast<int>(epoch);
    __threadfence_system();
  }
}

// Fused dispatch, after send round `round`: the rows of source (rank - round) on this rank, once
// it signalled: each row's source pair, and the copy of a deduplicated row from the row its
// token first landed in here (the same source, so already there), 32 rows per warp (take_rows).
// The grid's last block then raises kPhaseArrived for the source on this rank. False when the
// wait gave up.
__device__ bool take_arrivals(const SymView& s, const WaitPolicy& w, uint32_t epoch, const FusedArrive& f,
                              int round, int row_bytes, bool dedup) {
  const int L = f.experts_per_rank;
  const int* seg = f.segs + 4 * round * L;
  const int src = seg[3];
  __shared__ int ok;
  if (threadIdx.x == 0) ok = wait_signal(s, w, src, kPhaseDispatch, epoch);
  __syncthreads();
  if (!ok) return false;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int* meta = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.meta_off);
  const int* dups = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.dup_off);
  char* out = static_cast<char*>(f.out);
  for (int l = 0; l < L; ++l) {
    const int first = seg[4 * l], rows = seg[4 * l + 1];
    for (int i = 32 * warp; i < rows; i += 32 * num_warps)
      take_rows<kUnroll>(meta, dups, f.recv_pair, out, first + i, min(32, rows - i), row_bytes, dedup, false, lane);
  }
  if (last_block_of_grid(status_words(s) + 12 + round) && threadIdx.x == 0)
    st_release_sys(signal_word(s, s.rank, kPhaseArrived, src), epoch);
  __syncthreads();  // `ok` is reused by the next round
  return true;
}

// One warp per token: the token's row is read once and stored to its k destinations.
// With `fused` (the fused schedule): one round per destination instead, this rank first, then
// rank + 1, ...; a round stores only the rows bound for its destination (the token is read again
// each round), and the grid's last block to finish a round signals that destination at once.
// Each round then takes this rank's rows from the source whose round it is (rank - round):
// after that source's signal, the runs of its rows get their source pairs and deduplicated
// copies, and the grid's last block raises kPhaseArrived for it here, so the GEMM can start on
// them while later rounds still travel. Rows, meta words and bits are the same either way.
template <typename T, bool kWeighted>
__global__ void __launch_bounds__(kCopyThreads) dispatch_kernel(
    const T* __restrict__ x, const int* __restrict__ expert_idx, const int* __restrict__ dest_row,
    const float* __restrict__ weights, int num_tokens, int k, int hidden, int experts_per_rank, SymView s,
    DirectView dv, uint32_t epoch, bool dedup, bool own_whole, FusedArrive fused, WaitPolicy w) {
  const bool by_destination = fused.segs != nullptr;
  // Announced even when poisoned: the stream that queues the GEMM waits for this word.
  if (by_destination && fused.started != nullptr) announce_start(s, fused.started, epoch);
  if (poisoned(s)) return;
  epoch = device_epoch(s, kPhaseDispatch, epoch);
  dv.counts_epoch = device_epoch(s, kPhaseCounts, dv.counts_epoch);
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int num_vecs = hidden / Vec<T>::kElems;
  const int rounds = by_destination ? s.num_ranks : 1;
  for (int round = 0; round < rounds; ++round) {
  const int only = by_destination ? (s.rank + round) % s.num_ranks : -1;  // -1: every destination
  const bool sends = !by_destination || (round >= fused.send_begin && round < fused.send_end);
  for (int t = sends ? warp : num_tokens; t < num_tokens; t += num_warps) {
    char* dst[kMaxTopK];
    float wgt[kMaxTopK];
    int dest_rank[kMaxTopK];
    int dest_at[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      dst[j] = nullptr;
      wgt[j] = 1.0f;
      dest_rank[j] = -1;
      if (j < k) {
        const int64_t pair = static_cast<int64_t>(t) * k + j;
        const int row = dest_row[pair];
        if (row >= 0 && (only < 0 || expert_idx[pair] / experts_per_rank == only)) {
          const int d = expert_idx[pair] / experts_per_rank;
          // Deduplicated: a token travels once per destination rank; its later slots there name
          // the row of its first one, and the receiver copies it locally (the same bits).
          // The fused dispatch (and, with own_whole, the forward's in-place one) keeps this rank's own
          // rows whole: their copies would be local either way, and storing them here, beside the
          // NVLink stores, spares the receiver copies after the wait (on few SMs, when fused).
          int first = -1;
          if (!kWeighted && dedup && !((by_destination || own_whole) && d == s.rank)) {
#pragma unroll
            for (int i = 0; i < j; ++i)
              if (first < 0 && dest_rank[i] == d) first = dest_at[i];
          }
          dest_rank[j] = d;
          dest_at[j] = row;
          if (first < 0) dst[j] = recv_region(s, dv, d, experts_per_rank * s.num_ranks) + row * s.recv_row_bytes;
          if (kWeighted) wgt[j] = weights[pair];
          if (lane == 0) {
            reinterpret_cast<int*>(s.ptrs[d] + s.meta_off)[row] = static_cast<int>(s.rank * s.pairs_per_rank + pair);
            if (!kWeighted && dedup) reinterpret_cast<int*>(s.ptrs[d] + s.dup_off)[row] = first;
          }
        }
      }
    }
    const int4* src = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * hidden);
    for (int c0 = lane; c0 < num_vecs; c0 += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + 32 * u < num_vecs) v[u] = __ldg(src + c0 + 32 * u);
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {
        if (dst[j] == nullptr) continue;
        int4* out = reinterpret_cast<int4*>(dst[j]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + 32 * u >= num_vecs) continue;
          if (kWeighted) {
            float f[Vec<T>::kElems];
            unpack<T>(v[u], f);
#pragma unroll
            for (int i = 0; i < Vec<T>::kElems; ++i) f[i] = __fmul_rn(wgt[j], f[i]);
            out[c0 + 32 * u] = pack<T>(f);
          } else {
            out[c0 + 32 * u] = v[u];
          }
        }
      }
    }
  }
  if (by_destination && sends) signal_dst_when_grid_done(s, status_words(s) + 4 + round, only, kPhaseDispatch, epoch);
  if (by_destination && fused.take &&
      !take_arrivals(s, w, epoch, fused, round, hidden * static_cast<int>(sizeof(T)), dedup))
    return;
  }
  if (!by_destination) signal_when_grid_done(s, status_words(s) + 1, kPhaseDispatch, epoch);
}

// FP8 rows: a lane quantizes 16 consecutive elements, 8 lanes one 128-element group
// sharing one scale = amax / 448. The whole warp steps together (the group amax is
// a shuffle), so the loop bound is warp-uniform and lanes past the row idle.
template <typename T>
__global__ void __launch_bounds__(kCopyThreads) dispatch_fp8_kernel(
    const T* __restrict__ x, const int* __restrict__ expert_idx, const int* __restrict__ dest_row,
    int num_tokens, int k, int hidden, int experts_per_rank, SymView s, DirectView dv, uint32_t epoch) {
  static_assert(kFp8GroupSize == 8 * 16, "8 lanes of 16 elements make one scale group");
  constexpr int kLoads = 16 / Vec<T>::kElems;  // 16-byte loads per 16 elements
  if (poisoned(s)) return;
  epoch = device_epoch(s, kPhaseDispatch, epoch);
  dv.counts_epoch = device_epoch(s, kPhaseCounts, dv.counts_epoch);
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int num_groups = hidden / kFp8GroupSize;
  for (int t = warp; t < num_tokens; t += num_warps) {
    char* dst[kMaxTopK];
    float* dst_scale[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      dst[j] = nullptr;
      dst_scale[j] = nullptr;
      if (j < k) {
        const int64_t pair = static_cast<int64_t>(t) * k + j;
        const int row = dest_row[pair];
        if (row >= 0) {
          const int d = expert_idx[pair] / experts_per_rank;
          dst[j] = recv_region(s, dv, d, experts_per_rank * s.num_ranks) + row * s.recv_row_bytes;
          dst_scale[j] = reinterpret_cast<float*>(s.ptrs[d] + s.scales_off) + static_cast<int64_t>(row) * num_groups;
          if (lane == 0)
            reinterpret_cast<int*>(s.ptrs[d] + s.meta_off)[row] = static_cast<int>(s.rank * s.pairs_per_rank + pair);
        }
      }
    }
    const T* row_in = x + static_cast<int64_t>(t) * hidden;
    for (int base = 0; base < hidden; base += 32 * 16) {
      const int first = base + lane * 16;
      const bool active = first < hidden;
      float f[16];
      float amax = 0.0f;
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        int4 v = make_int4(0, 0, 0, 0);
        if (active) v = __ldg(reinterpret_cast<const int4*>(row_in + first) + l);
        unpack<T>(v, f + l * Vec<T>::kElems);
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
      for (int off = 4; off >= 1; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      // The reference's rounding exactly: scale = max(amax, 1e-12) * fp32(1 / 448), q = e4m3(x / scale).
      const float scale = __fmul_rn(fmaxf(amax, kFp8MinAmax), kFp8InvMax);
      int4 q;
      __nv_fp8x2_storage_t* qp = reinterpret_cast<__nv_fp8x2_storage_t*>(&q);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        qp[i] = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(f[2 * i], scale), __fdiv_rn(f[2 * i + 1], scale)),
                                         __NV_SATFINITE, __NV_E4M3);
      if (!active) continue;
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {
        if (dst[j] == nullptr) continue;
        *reinterpret_cast<int4*>(dst[j] + first) = q;
        if (lane % 8 == 0) dst_scale[j][first / kFp8GroupSize] = scale;
      }
    }
  }
  signal_when_grid_done(s, status_words(s) + 1, kPhaseDispatch, epoch);
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kCopyThreads) recv_copyout_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                    const int* __restrict__ num_recv, int out_rows,
                                                                    int hidden, T* __restrict__ out,
                                                                    int* __restrict__ recv_pair, bool copy_rows,
                                                                    bool dedup) {
  epoch = device_epoch(s, kPhaseDispatch, epoch);
  if (!block_wait_all(s, w, kPhaseDispatch, epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int R = min(*num_recv, out_rows);
  const int* meta = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.meta_off);
  const int* dups = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.dup_off);
  for (int r = warp; r < R; r += num_warps) {
    if (lane == 0) recv_pair[r] = __ldcg(meta + r);
    // A deduplicated row is a copy of the row its token first landed in on this rank.
    int from = r;
    if (!kFp8 && dedup) {
      const int first = __ldcg(dups + r);
      if (first >= 0) from = first;
    }
    if (!copy_rows && from == r) continue;
    // copy_rows: out of staging; else the rows are in place in out, and only copies remain.
    const char* in = copy_rows ? s.ptrs[s.rank] + s.recv_off + static_cast<int64_t>(from) * s.recv_row_bytes
                               : reinterpret_cast<const char*>(out + static_cast<int64_t>(from) * hidden);
    T* row_out = out + static_cast<int64_t>(r) * hidden;
    if constexpr (!kFp8) {
      const int4* src = reinterpret_cast<const int4*>(in);
      int4* dst = reinterpret_cast<int4*>(row_out);
      warp_row_vectors<kUnroll>(hidden / Vec<T>::kElems, lane, [&](int i) { return __ldcg(src + i); },
                                [&](int i, const int4& v) { dst[i] = v; });
    } else {
      const float* scales =
          reinterpret_cast<const float*>(s.ptrs[s.rank] + s.scales_off) + static_cast<int64_t>(r) * (hidden / kFp8GroupSize);
      for (int first = lane * 16; first < hidden; first += 32 * 16) {
        const int4 q = __ldcg(reinterpret_cast<const int4*>(in + first));
        const float scale = __ldcg(scales + first / kFp8GroupSize);
        const __nv_fp8x2_storage_t* qp = reinterpret_cast<const __nv_fp8x2_storage_t*>(&q);
        float f[16];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(qp[i], __NV_E4M3);
          const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&h));
          f[2 * i] = __fmul_rn(p.x, scale);
          f[2 * i + 1] = __fmul_rn(p.y, scale);
        }
#pragma unroll
        for (int l = 0; l < 16 / Vec<T>::kElems; ++l)
          reinterpret_cast<int4*>(row_out + first)[l] = pack<T>(f + l * Vec<T>::kElems);
      }
    }
  }
}

}  // namespace

cudaError_t launch_dispatch(DType dtype, bool fp8, const void* x, const int* expert_idx, const int* dest_row,
                            const float* weights, int num_tokens, int k, int hidden, int num_experts,
                            const SymView& sym, const DirectView& direct, uint32_t epoch, int num_blocks,
                            cudaStream_t stream, bool dedup, const FusedArrive* fused, const WaitPolicy* wait,
                            bool own_whole) {
  const bool by_destination = fused != nullptr;
  if (k <= 0 || k > kMaxTopK || num_experts % sym.num_ranks != 0 || num_blocks <= 0 || (fp8 && weights) ||
      (fp8 && hidden % kFp8GroupSize != 0) || (dedup && (fp8 || weights)) || (own_whole && !dedup) ||
      (by_destination && (fp8 || weights || wait == nullptr)))
    return cudaErrorInvalidValue;
  const int experts_per_rank = num_experts / sym.num_ranks;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    if (fp8) {
      dispatch_fp8_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(static_cast<const T*>(x), expert_idx,
                                                                      dest_row, num_tokens, k, hidden,
                                                                      experts_per_rank, sym, direct, epoch);
    } else {
      UNIEP_SWITCH_BOOL(weights != nullptr, kWeighted, {
        dispatch_kernel<T, kWeighted><<<num_blocks, kCopyThreads, 0, stream>>>(
            static_cast<const T*>(x), expert_idx, dest_row, weights, num_tokens, k, hidden, experts_per_rank, sym,
            direct, epoch, dedup, own_whole, fused ? *fused : FusedArrive{},
            wait ? *wait : WaitPolicy{});
      });
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_recv_copyout(DType dtype, bool fp8, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                const int* num_recv, int out_rows, int hidden, void* out, int* recv_pair,
                                int num_blocks, bool copy_rows, cudaStream_t stream, bool dedup) {
  if (num_blocks <= 0 || (fp8 && hidden % kFp8GroupSize != 0) || (fp8 && dedup)) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(fp8, kFp8, {
      recv_copyout_kernel<T, kFp8><<<num_blocks, kCopyThreads, 0, stream>>>(sym, epoch, wait, num_recv, out_rows, hidden,
                                                                            static_cast<T*>(out), recv_pair, copy_rows,
                                                                            dedup);
    });
  });
  return cudaGetLastError();
}

}  // namespace uniep
