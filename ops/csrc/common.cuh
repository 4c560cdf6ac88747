// Shared device helpers of the UniEP kernels: the symmetric buffer view, signals
// with timed waits, and dtype switches. Knows nothing of torch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "configs.cuh"
#include "types.h"

namespace uniep {

// A runtime value becomes a template argument here; an unknown value is an error,
// never a silent fall-through.
#define UNIEP_SWITCH_DTYPE(dtype, T, ...)                      \
  switch (dtype) {                                             \
    case ::uniep::DType::kFloat32: {                           \
      using T = float;                                         \
      __VA_ARGS__;                                             \
      break;                                                   \
    }                                                          \
    case ::uniep::DType::kBFloat16: {                          \
      using T = __nv_bfloat16;                                 \
      __VA_ARGS__;                                             \
      break;                                                   \
    }                                                          \
    case ::uniep::DType::kFloat16: {                           \
      using T = __half;                                        \
      __VA_ARGS__;                                             \
      break;                                                   \
    }                                                          \
    default:                                                   \
      return cudaErrorInvalidValue; /* unknown dtype */        \
  }

#define UNIEP_SWITCH_BOOL(value, kName, ...) \
  if (value) {                               \
    constexpr bool kName = true;             \
    __VA_ARGS__;                             \
  } else {                                   \
    constexpr bool kName = false;            \
    __VA_ARGS__;                             \
  }

// k (1..kMaxTopK) becomes kSlots, the next bound in {2, 4, 8, kMaxTopK}: per-slot arrays of
// that length stay in registers. A k outside the range is an error.
#define UNIEP_SWITCH_SLOTS(k, kSlots, ...)      \
  if ((k) < 1 || (k) > ::uniep::kMaxTopK) {     \
    return cudaErrorInvalidValue;               \
  } else if ((k) <= 2) {                        \
    constexpr int kSlots = 2;                   \
    __VA_ARGS__;                                \
  } else if ((k) <= 4) {                        \
    constexpr int kSlots = 4;                   \
    __VA_ARGS__;                                \
  } else if ((k) <= 8) {                        \
    constexpr int kSlots = 8;                   \
    __VA_ARGS__;                                \
  } else {                                      \
    constexpr int kSlots = ::uniep::kMaxTopK;   \
    __VA_ARGS__;                                \
  }

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void st_release_sys(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t* signal_word(const SymView& s, int owner, int phase, int src) {
  return reinterpret_cast<uint32_t*>(s.ptrs[owner] + s.signals_off) + phase * kMaxRanks + src;
}

__device__ __forceinline__ uint32_t* status_words(const SymView& s) {
  return reinterpret_cast<uint32_t*>(s.ptrs[s.rank] + s.status_off);
}

// The epoch of `phase` a kernel given `epoch` works at: its argument plus the phase's epoch base
// (status word kEpochBaseWord + phase; see types.h). Read once at a kernel's entry; the base moves
// only between ops, on the stream.
__device__ __forceinline__ uint32_t device_epoch(const SymView& s, int phase, uint32_t epoch) {
  static_assert(kEpochBaseWord + kNumPhases <= 32, "the epoch bases must fit the status words");
  return epoch + __ldcg(status_words(s) + kEpochBaseWord + phase);
}

__device__ __forceinline__ bool poisoned(const SymView& s) {
  return *reinterpret_cast<volatile uint32_t*>(status_words(s)) != 0;
}

// Tell `dst` that this rank reached `epoch` of `phase`. Callers fence first.
__device__ __forceinline__ void raise_signal(const SymView& s, int dst, int phase, uint32_t epoch) {
  st_release_sys(signal_word(s, dst, phase, s.rank), epoch);
}

// Every wait of every kernel: spin until `word` reaches at least `epoch` (epochs only grow, so
// a signal of an older epoch never satisfies a newer wait and no reset is needed). Returns false
// when the layer is poisoned or after `timeout_ns`; then the first waiter to give up sets the
// poison word (which stops the layer's later kernels) and records who waited for what: the
// phase, the rank or word waited for (`src`), the epoch, what it saw, its rank and layer.
__device__ inline bool wait_until(const uint32_t* word, uint32_t epoch, uint64_t timeout_ns, uint32_t* poison,
                                  int64_t* error_record, int phase, int src, int rank, int layer_id) {
  uint32_t seen = ld_acquire_sys(word);
  if (static_cast<int32_t>(seen - epoch) >= 0) return true;
  const uint64_t start = global_timer_ns();
  while (true) {
    seen = ld_acquire_sys(word);
    if (static_cast<int32_t>(seen - epoch) >= 0) return true;
    if (*reinterpret_cast<volatile uint32_t*>(poison) != 0) return false;
    if (global_timer_ns() - start > timeout_ns) break;
    __nanosleep(64);
  }
  if (atomicCAS(poison, 0u, 1u) == 0u) {
    volatile int64_t* rec = error_record;
    rec[1] = phase;
    rec[2] = src;
    rec[3] = epoch;
    rec[4] = seen;
    rec[5] = rank;
    rec[6] = layer_id;
    __threadfence_system();
    rec[0] = 1;
    __threadfence_system();
  }
  return false;
}

// wait_until on a symmetric buffer's signal word raised by `src`, under the layer's policy.
__device__ inline bool wait_word(const SymView& s, const WaitPolicy& w, const uint32_t* word, int src, int phase,
                                 uint32_t epoch) {
  return wait_until(word, epoch, w.timeout_ns, status_words(s), w.error_record, phase, src, s.rank, w.layer_id);
}

// Wait until `src` raised `phase` to at least `epoch`.
__device__ __forceinline__ bool wait_signal(const SymView& s, const WaitPolicy& w, int src, int phase,
                                            uint32_t epoch) {
  return wait_word(s, w, signal_word(s, s.rank, phase, src), src, phase, epoch);
}

// Combine chunk flags in `owner`'s buffer: word [chunk][writer], after the phase signals.
__device__ __forceinline__ uint32_t* chunk_flag(const SymView& s, int owner, int chunk, int writer) {
  return reinterpret_cast<uint32_t*>(s.ptrs[owner] + s.signals_off) + kNumPhases * kMaxRanks +
         chunk * kMaxRanks + writer;
}

// Local arrival counters of the chunked combine, one per chunk, left at 0.
__device__ __forceinline__ uint32_t* chunk_counter(const SymView& s, int chunk) {
  return reinterpret_cast<uint32_t*>(s.ptrs[s.rank] + s.signals_off) + kNumPhases * kMaxRanks +
         kMaxCombineChunks * kMaxRanks + chunk;
}

// Block-wide: threads 0..num_ranks-1 wait on one source each. Returns false (in
// every thread) if any wait gave up or the layer is poisoned.
__device__ __forceinline__ bool block_wait_all(const SymView& s, const WaitPolicy& w, int phase, uint32_t epoch) {
  __shared__ int ok_shared;
  if (threadIdx.x == 0) ok_shared = 1;
  __syncthreads();
  if (threadIdx.x < s.num_ranks) {
    if (!wait_signal(s, w, threadIdx.x, phase, epoch)) atomicAnd(&ok_shared, 0);
  }
  __syncthreads();
  const bool ok = ok_shared != 0;
  __syncthreads();
  return ok;
}

// Called by every block at the end of a kernel that stores into peers: the last
// block to finish (an atomic counts arrivals, it orders nothing) fences and
// raises `phase` on every peer. `counter` is a local status word, left at 0.
// Block-wide: whether this block is the grid's last to get here (`counter` counts arrivals and
// is left at 0). The last block has then fenced after every block's stores.
__device__ __forceinline__ bool last_block_of_grid(uint32_t* counter) {
  // Each thread fences its own peer stores; the barrier then lets thread 0 speak for the block.
  __threadfence_system();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    const uint32_t arrived = atomicAdd(counter, 1u);
    last = arrived == gridDim.x - 1;
    if (last) {
      *counter = 0;
      __threadfence_system();  // every block's stores (seen through the counter) before the signals
    }
  }
  __syncthreads();
  const bool result = last;
  __syncthreads();  // `last` is reused by the next call
  return result;
}

__device__ __forceinline__ void signal_when_grid_done(const SymView& s, uint32_t* counter, int phase,
                                                      uint32_t epoch) {
  if (last_block_of_grid(counter) && threadIdx.x < s.num_ranks) raise_signal(s, threadIdx.x, phase, epoch);
}

// The same for stores into one destination: the last block raises `phase` on `dst` only.
__device__ __forceinline__ void signal_dst_when_grid_done(const SymView& s, uint32_t* counter, int dst, int phase,
                                                          uint32_t epoch) {
  if (last_block_of_grid(counter) && threadIdx.x == 0) raise_signal(s, dst, phase, epoch);
}

// Direct-receive flags of the layout of `counts_epoch` in this rank's buffer: [kMaxRanks] int32.
__device__ __forceinline__ int* direct_flags(const SymView& s, int owner, int num_experts, uint32_t counts_epoch) {
  return reinterpret_cast<int*>(s.ptrs[owner] + s.counts_off) + 2 * kMaxRanks * num_experts +
         static_cast<int>(counts_epoch & 1u) * kMaxRanks;
}

// Where rank d's receive rows go this time: its direct region if it said free, else staging.
__device__ __forceinline__ char* recv_region(const SymView& s, const DirectView& dv, int d, int num_experts) {
  if (dv.use && __ldcg(direct_flags(s, s.rank, num_experts, dv.counts_epoch) + d)) return dv.ptrs[d];
  return s.ptrs[d] + s.recv_off;
}

// Named barriers (ids 1..15; 0 is __syncthreads): `count` threads, a multiple of 32. arrive
// does not wait; sync waits for `count` arrivals in all. Both order memory as a barrier does.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// 16-byte vector of one row: kVec elements of T.
template <typename T>
struct Vec {
  static constexpr int kElems = 16 / sizeof(T);
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Unpack / pack a 16-byte vector to / from floats.
template <typename T>
__device__ __forceinline__ void unpack(const int4& v, float* out) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) out[i] = to_float<T>(e[i]);
}

template <typename T>
__device__ __forceinline__ int4 pack(const float* in) {
  int4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) e[i] = from_float<T>(in[i]);
  return v;
}

// One warp walks a row of num_vecs 16-byte vectors: each lane issues kUnroll loads (load(i) of
// vector i) before it uses any of them (use(i, v)), so kUnroll loads per lane are in flight.
template <int kUnroll, typename Load, typename Use>
__device__ __forceinline__ void warp_row_vectors(int num_vecs, int lane, Load load, Use use) {
  for (int c0 = lane; c0 < num_vecs; c0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + 32 * u < num_vecs) v[u] = load(c0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + 32 * u < num_vecs) use(c0 + 32 * u, v[u]);
  }
}

// One bulk prefetch of `bytes` (a multiple of 16, 16-byte aligned) into L2, from one thread: the
// loads that follow wait on L2, not on memory, without registers held for the bytes in flight.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// The fused dispatch's receiving side, by one warp: rows [first, first + count) (count <= 32) of a
// (source, expert) block that has landed here in `out`. Each lane takes one row's source pair
// (meta word) into recv_pair; the rows whose dup word names an earlier row (a deduplicated token:
// it crossed once, into its first row here) are then copied from it, one row at a time by the
// whole warp, kUnroll 16-byte vectors per lane in flight. With `prefetch`, those source rows are
// bulk-prefetched into L2 first.
template <int kUnroll>
__device__ __forceinline__ void take_rows(const int* meta, const int* dups, int* recv_pair, char* out, int first,
                                          int count, int row_bytes, bool dedup, bool prefetch, int lane) {
  const int r = first + lane;
  int from = -1;
  if (lane < count) {
    recv_pair[r] = __ldcg(meta + r);
    if (dedup) from = __ldcg(dups + r);
  }
  if (prefetch && from >= 0) prefetch_l2(out + static_cast<int64_t>(from) * row_bytes, static_cast<uint32_t>(row_bytes));
  for (uint32_t todo = __ballot_sync(0xffffffffu, from >= 0); todo != 0; todo &= todo - 1) {
    const int l = __ffs(todo) - 1;
    const int src = __shfl_sync(0xffffffffu, from, l);
    const int4* in = reinterpret_cast<const int4*>(out + static_cast<int64_t>(src) * row_bytes);
    int4* dst = reinterpret_cast<int4*>(out + static_cast<int64_t>(first + l) * row_bytes);
    warp_row_vectors<kUnroll>(row_bytes / 16, lane, [&](int v) { return __ldcg(in + v); },
                              [&](int v, const int4& x) { dst[v] = x; });
  }
}

// Loads that skip L1: peers' rows and rows written by other kernels are read once.
__device__ __forceinline__ int4 ld_stream(const int4* p) { return __ldcs(p); }
__device__ __forceinline__ void st_stream(int4* p, const int4& v) { __stcs(p, v); }

}  // namespace uniep
