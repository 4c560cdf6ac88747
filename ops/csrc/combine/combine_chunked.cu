// Combine family, chunked: push and reduce in one kernel, pipelined by chunks of source tokens
// (launch_combine_chunked); the same bits as launch_combine_push then launch_combine_reduce.
#include "../common.cuh"
#include "combine.cuh"
#include "combine_rows.cuh"

namespace uniep {
namespace {

// One segment (kCombineSegVecs vectors) of expert-output row `row` stored into its source's
// combine buffer at the pair's slot, by one warp.
template <typename T>
__device__ __forceinline__ void push_segment(const T* __restrict__ y, const int* __restrict__ recv_pair,
                                             const SymView& s, int row, int seg, int num_vecs, int hidden,
                                             int lane) {
  const int pair = __ldg(recv_pair + row);
  const int src = static_cast<int>(pair / s.pairs_per_rank);
  const int64_t slot = pair % s.pairs_per_rank;
  int4* dst = reinterpret_cast<int4*>(s.ptrs[src] + s.comb_off + slot * s.comb_row_bytes);
  const int4* in = reinterpret_cast<const int4*>(y + static_cast<int64_t>(row) * hidden);
  const int c_end = min(num_vecs, (seg + 1) * kCombineSegVecs);
  constexpr int kUnrollSeg = kCombineSegVecs / 32;
  int4 v[kUnrollSeg];
#pragma unroll
  for (int u = 0; u < kUnrollSeg; ++u) {
    const int cv = seg * kCombineSegVecs + lane + 32 * u;
    if (cv < c_end) v[u] = __ldg(in + cv);
  }
#pragma unroll
  for (int u = 0; u < kUnrollSeg; ++u) {
    const int cv = seg * kCombineSegVecs + lane + 32 * u;
    if (cv < c_end) dst[cv] = v[u];
  }
}

// The signalling warp of a pushing block, once the block's rows of chunk c are stored (and
// ordered before this call): a system fence, then the block that arrives last at the chunk's
// counter raises the chunk's flag on every rank.
__device__ __forceinline__ void signal_chunk_pushed(const SymView& s, int c, int pushing_blocks, int lane,
                                                    uint32_t epoch) {
  bool last = false;
  if (lane == 0) {
    __threadfence_system();
    uint32_t* counter = chunk_counter(s, c);
    last = atomicAdd(counter, 1u) == static_cast<uint32_t>(pushing_blocks - 1);
    if (last) {
      *counter = 0;
      __threadfence_system();  // every block's rows (seen through the counter) before the flags
    }
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last && lane < s.num_ranks) st_release_sys(chunk_flag(s, lane, c, s.rank), epoch);
}

// Push and reduce in one kernel, by chunks of source tokens. Blocks [0, P) push, blocks
// [P, gridDim.x) reduce: for each of this rank's chunks in order they wait for the flags of all
// ranks, then sum the chunk's tokens (segments of rows spread over all reducing warps) as
// combine_reduce_kernel does, so the bits are the same. In a pushing block warps 0..14 push
// and warp 15 signals: once the block's rows of chunk c are stored it fences and, in the block
// that finishes the chunk last, raises the chunk's flag on every rank, so no pushing warp stalls
// on a fence. Pushing blocks wait for nothing, and have the lower block indices, so they always
// run. Two blocks fit on an SM (kMinBlocks 2), so the P pushing blocks (by default half as many
// as SMs) and the reducing blocks (one per SM) are all resident at once. A grid of at most one
// block per SM (the queue's default: P pushing and SMs - P reducing blocks, each role on SMs of its
// own) runs the build for one block per SM (kMinBlocks 1): twice the registers per thread, so
// nothing spills and a reducing warp issues all k slots' loads of a vector at once. The roles
// want SMs of their own: beside pushing blocks the reducing blocks fall behind the flags, and
// pushing beside reducing blocks ends later.
//
// Which rows a pushing block stores, in what order:
// - sorted (list_cap > 0): the block owns granules b, b + P, b + 2P, ... of kPushGranule rows
//   of y (so every block's rows go to every source), sorts them by chunk once in shared memory
//   (list_cap ints of dynamic shared memory) and its warps stream through the sorted segments
//   without a barrier between chunks; each warp counts the segments it stored per chunk, and the
//   signalling warp raises chunk c once the count reaches the block's segments of c. A warp
//   starts on chunk c only once chunk c - kPushLead is signalled: a chunk's flag waits for the
//   signalling warp's fence, and pushing far ahead would leave the sums of many chunks to the end.
// - by chunk (list_cap == 0): for chunk c = 0, 1, ... the block gathers the rows of its slices
//   of y whose source token lies in chunk c into a shared list and its warps store them; the
//   pushing warps meet at a barrier after each slice.
// Any order gives the same bits: a row's bytes and where they land do not depend on it.
constexpr int kPushGranule = 8;
// The sorted walk's bound: how many chunks a pushing warp may run ahead of the last chunk its
// block has signalled.
constexpr int kPushLead = 2;

// One warp: begin[c] = counts[0] + ... + counts[c - 1] for c <= n (n <= 64, two per lane).
__device__ __forceinline__ void scan_chunks(const int* counts, int* begin, int n, int lane) {
  const int a = 2 * lane < n ? counts[2 * lane] : 0;
  const int b = 2 * lane + 1 < n ? counts[2 * lane + 1] : 0;
  int incl = a + b;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += up;
  }
  const int excl = incl - a - b;
  if (2 * lane < n) begin[2 * lane] = excl;
  if (2 * lane + 1 < n) begin[2 * lane + 1] = excl + a;
  if (lane == 31) begin[n] = incl;
}

// Queue mode of the chunked combine's pushing blocks (launch_combine_chunked with a queue
// workspace): the P pushing blocks first sort all of y's rows by chunk into one global order
// (each block counts its granules' rows per chunk, a barrier, each scatters them to its place,
// tagged with the launch's epoch), then every pushing warp claims kQueueClaim segments at a time
// from one global cursor over that order, waiting at a position until its entry carries this
// launch's epoch (the blocks scatter at once, so no second barrier is needed). Blocks whose
// stores drain faster take more of the work, so no block is left pushing alone at the end (with
// fixed shares, blocks finish at very different times). A warp counts its segments per
// chunk; when it moves past a chunk it fences (GPU scope, or system scope without gpu_fence) and
// adds them to the chunk's global count, and the warp that completes a chunk fences again and
// raises the chunk's flag on every rank. Chunks come out of the queue in order, so no lead bound
// is needed. Once pushed, the pushing blocks sum this rank's last chunk beside the reducing
// blocks. Any order gives the same bits.
// Workspace (int32 words): the header [0, kQueueCounts), zero when the workspace is allocated and
// left ready for the next launch by every launch (so nothing zeroes it between launches: the
// barrier's counter goes back to 0 and its generation word moves on; the last block to reach the
// barrier zeroes the cursor and the chunk counts before it releases the others, and nothing
// reads them before then); the per-block counts from kQueueCounts; the order after them, one
// 64-bit entry (epoch << 32 | row) per row, so an entry of an earlier launch never passes for one
// of this launch (epochs move on every call) and nothing zeroes the order either.
// The barrier's counter and generation, the cursor and the chunk counts sit on separate
// 128-byte lines.
constexpr int kQueueBar = 0;
constexpr int kQueueGen = 32;  // the barrier's generation word, after its counter
constexpr int kQueueCursor = 128;
constexpr int kQueueDone = 160;  // [kMaxCombineChunks] segments stored per chunk
constexpr int kQueueCounts = kQueueDone + kMaxCombineChunks;  // [P][kMaxCombineChunks] rows per (block, chunk)
constexpr int kQueueClaim = 4;
static_assert(kQueueCounts % 2 == 0 && kMaxCombineChunks % 2 == 0, "the order's 64-bit entries must be aligned");

__host__ __device__ __forceinline__ int64_t queue_words(int pushing_blocks, int y_rows) {
  return kQueueCounts + static_cast<int64_t>(pushing_blocks) * kMaxCombineChunks + 2 * static_cast<int64_t>(y_rows);
}

// The row at an order position, once a pushing block has scattered this launch's entry there
// (-1 if the layer is poisoned meanwhile); one lane waits and the warp takes its answer.
__device__ __forceinline__ int queue_row(const unsigned long long* entry, uint32_t epoch, const SymView& s) {
  unsigned long long v = *reinterpret_cast<const volatile unsigned long long*>(entry);
  while (static_cast<uint32_t>(v >> 32) != epoch) {
    if (poisoned(s)) return -1;
    __nanosleep(32);
    v = *reinterpret_cast<const volatile unsigned long long*>(entry);
  }
  return static_cast<int>(static_cast<uint32_t>(v));
}

// The P pushing blocks meet (a sense-reversing barrier): thread 0 notes the barrier's generation,
// arrives at its counter and spins until the generation moves on (or the layer is poisoned). The
// block that arrives last puts the counter back to 0, runs on_last and then moves the generation
// on, so the barrier is ready for the next launch without being zeroed. A block reads the
// generation before it arrives, and the last block arrives after all the others, so every block
// waits for the same move.
template <typename OnLast>
__device__ __forceinline__ bool queue_barrier(int* q, int P, const SymView& s, OnLast on_last) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    volatile int* gen = q + kQueueGen;
    const int g = *gen;
    __threadfence();
    if (atomicAdd(q + kQueueBar, 1) == P - 1) {
      atomicExch(q + kQueueBar, 0);
      on_last();
      __threadfence();
      atomicExch(const_cast<int*>(gen), g + 1);
    } else {
      while (*gen == g) {
        if (poisoned(s)) {
          ok = 0;
          break;
        }
        __nanosleep(64);
      }
    }
    __threadfence();
  }
  __syncthreads();
  return ok != 0;
}

// A pushing warp's `n` segments of chunk c are stored: fence, count them, and raise the chunk's
// flag on every rank if they complete it (`total`: the chunk's segments). gpu_fence: the warp's
// fence before its count is GPU-scoped (a release to the warps of this GPU); the warp that completes
// the chunk still fences at system scope before its release of the flags, and by the PTX memory
// model's causality (release gpu -> acquire gpu -> release sys -> acquire sys on the peer) the peer
// that sees the flag sees every warp's rows.
__device__ __forceinline__ void queue_chunk_stored(const SymView& s, int* q, int c, int n, int total, int lane,
                                                   uint32_t epoch, bool gpu_fence) {
  if (n == 0) return;
  __syncwarp();  // the lanes' stores before lane 0's fence
  bool last = false;
  if (lane == 0) {
    if (gpu_fence)
      __threadfence();
    else
      __threadfence_system();
    last = atomicAdd(q + kQueueDone + c, n) + n == total;
    if (last) {
      __threadfence_system();  // every warp's stores (seen through the count) before the flags
    }
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last && lane < s.num_ranks) st_release_sys(chunk_flag(s, lane, c, s.rank), epoch);
}

template <typename T>
__device__ void push_by_queue(const T* __restrict__ y, const int* __restrict__ recv_pair, int R, int k,
                              int chunk_tokens, int num_chunks, int segs, int num_vecs, int hidden, const SymView& s,
                              uint32_t epoch, int P, int* q, int* chunk_fill, int* chunk_begin, int* chunk_total,
                              bool gpu_fence) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  int* counts = q + kQueueCounts;
  auto* order = reinterpret_cast<unsigned long long*>(counts + static_cast<int64_t>(P) * kMaxCombineChunks);
  const int64_t granules = (static_cast<int64_t>(R) + kPushGranule - 1) / kPushGranule;
  const int mine = granules > blockIdx.x ? static_cast<int>((granules - 1 - blockIdx.x) / P + 1) * kPushGranule : 0;
  auto row_at = [&](int i) {
    return (static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(P) * (i / kPushGranule)) * kPushGranule +
           i % kPushGranule;
  };
  auto chunk_of = [&](int64_t r) {
    return static_cast<int>(__ldg(recv_pair + r) % s.pairs_per_rank / k / chunk_tokens);
  };
  for (int c = threadIdx.x; c < num_chunks; c += blockDim.x) chunk_fill[c] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < mine; i += blockDim.x) {
    const int64_t r = row_at(i);
    if (r < R) atomicAdd(&chunk_fill[chunk_of(r)], 1);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < num_chunks; c += blockDim.x) counts[blockIdx.x * kMaxCombineChunks + c] = chunk_fill[c];
  __syncthreads();
  const auto fresh_counts = [&] {  // the last block at the barrier, before any claim or count
    atomicExch(q + kQueueCursor, 0);
    for (int c = 0; c < num_chunks; ++c) atomicExch(q + kQueueDone + c, 0);
  };
  if (!queue_barrier(q, P, s, fresh_counts)) return;
  // Each chunk's rows in all blocks and in the blocks before this one: every (block, chunk) count
  // read by a thread of its own (one round trip, not P), summed in shared memory.
  if (threadIdx.x < num_chunks) chunk_total[threadIdx.x] = chunk_fill[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < num_chunks * P; i += blockDim.x) {
    const int c = i % num_chunks, b = i / num_chunks;
    const int n = __ldcg(counts + b * kMaxCombineChunks + c);
    atomicAdd(&chunk_total[c], n);
    if (b < static_cast<int>(blockIdx.x)) atomicAdd(&chunk_fill[c], n);
  }
  __syncthreads();
  if (warp == 0) scan_chunks(chunk_total, chunk_begin, num_chunks, lane);  // each chunk's first position
  __syncthreads();
  if (threadIdx.x < num_chunks) chunk_fill[threadIdx.x] += chunk_begin[threadIdx.x];
  __syncthreads();
  for (int i = threadIdx.x; i < mine; i += blockDim.x) {
    const int64_t r = row_at(i);
    if (r < R)  // any order within a chunk
      __stcg(order + atomicAdd(&chunk_fill[chunk_of(r)], 1),
             (static_cast<unsigned long long>(epoch) << 32) | static_cast<uint32_t>(r));
  }
  // A chunk without rows here is stored already: block 0 raises its flags.
  if (blockIdx.x == 0 && threadIdx.x < num_chunks && chunk_total[threadIdx.x] == 0)
    for (int d = 0; d < s.num_ranks; ++d) st_release_sys(chunk_flag(s, d, threadIdx.x, s.rank), epoch);
  __syncthreads();
  const int items = chunk_begin[num_chunks] * segs;
  int c = 0, pending = 0;
  for (;;) {
    int first = 0;
    if (lane == 0) first = atomicAdd(q + kQueueCursor, kQueueClaim);
    first = __shfl_sync(0xffffffffu, first, 0);
    if (first >= items) break;
    const int last = min(items, first + kQueueClaim);
    for (int item = first; item < last; ++item) {
      const int at = item / segs;
      if (at >= chunk_begin[c + 1]) {
        queue_chunk_stored(s, q, c, pending, chunk_total[c] * segs, lane, epoch, gpu_fence);
        pending = 0;
        while (at >= chunk_begin[c + 1]) ++c;
      }
      int row = 0;
      if (lane == 0) row = queue_row(order + at, epoch, s);
      row = __shfl_sync(0xffffffffu, row, 0);
      if (row < 0) return;
      push_segment<T>(y, recv_pair, s, row, item % segs, num_vecs, hidden, lane);
      ++pending;
    }
  }
  queue_chunk_stored(s, q, c, pending, chunk_total[c] * segs, lane, epoch, gpu_fence);
}

template <typename T, bool kWeighted, int kSlots, int kMinBlocks>
__global__ void __launch_bounds__(kCopyThreads, kMinBlocks) combine_chunked_kernel(
    const T* __restrict__ y, const int* __restrict__ recv_pair, const int* __restrict__ num_recv, int y_rows,
    SymView s, uint32_t epoch, WaitPolicy w, const int* __restrict__ expert_idx, const float* __restrict__ weights,
    int num_tokens, int k, int hidden, int num_experts, int reduce_blocks, int chunk_tokens, int num_chunks,
    int list_cap, int* __restrict__ queue, bool queue_gpu_fence, T* __restrict__ out) {
  constexpr int kElems = Vec<T>::kElems;
  epoch = device_epoch(s, kPhaseCombine, epoch);
  constexpr int kPushWarps = kWarpsPerCopyBlock - 1;
  constexpr int kPushThreads = kPushWarps * 32;
  static_assert(kMaxCombineChunks <= 64, "the chunk scan takes two counts per lane");
  extern __shared__ int sorted_rows[];
  __shared__ int list[kCopyThreads];
  __shared__ int list_len;
  __shared__ int flag_shared;
  __shared__ int chunk_begin[kMaxCombineChunks + 1];
  __shared__ int chunk_fill[kMaxCombineChunks];
  __shared__ int chunk_done[kMaxCombineChunks];
  __shared__ int chunks_signalled;
  __shared__ int chunk_total[kMaxCombineChunks];
  if (poisoned(s)) return;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_vecs = hidden / kElems;
  const int segs = (num_vecs + kCombineSegVecs - 1) / kCombineSegVecs;
  const int P = gridDim.x - reduce_blocks;
  const CombRows rows = comb_rows(s);
  const int my_chunks = (num_tokens + chunk_tokens - 1) / chunk_tokens;
  // Chunk c: wait for every rank's flag, then sum its tokens' segments as reducer q of nq blocks
  // (segments spread over all their warps). False when a wait failed.
  auto reduce_chunk = [&](int c, int q, int nq) {
    if (threadIdx.x == 0) flag_shared = 1;
    __syncthreads();
    if (threadIdx.x < s.num_ranks &&
        !wait_word(s, w, chunk_flag(s, s.rank, c, threadIdx.x), threadIdx.x, kPhaseCombine, epoch))
      atomicAnd(&flag_shared, 0);
    __syncthreads();
    if (!flag_shared) return false;
    const int t0 = c * chunk_tokens;
    const int items = min(chunk_tokens, num_tokens - t0) * segs;
    for (int item = q * kWarpsPerCopyBlock + warp; item < items; item += nq * kWarpsPerCopyBlock) {
      const int seg = item % segs;
      reduce_token<T, kWeighted, kSlots, CombRows, kMinBlocks == 1 ? 8 : 4>(
          rows, expert_idx, weights, t0 + item / segs, k, hidden, num_experts, seg * kCombineSegVecs,
          min(num_vecs, (seg + 1) * kCombineSegVecs), lane, out);
    }
    __syncthreads();  // flag_shared is rewritten by the next chunk
    return true;
  };
  // Queue mode: once a pushing block has pushed, it sums this rank's last chunk beside the reducing
  // blocks (reducer reduce_blocks + b of reduce_blocks + P), so the tail after the last flag has
  // every block of the grid (the reducing ones alone kept up with the chunks before, not with it).
  const bool help = queue != nullptr;
  if (blockIdx.x < P && queue != nullptr) {
    push_by_queue<T>(y, recv_pair, min(*num_recv, y_rows), k, chunk_tokens, num_chunks, segs, num_vecs, hidden, s,
                     epoch, P, queue, chunk_fill, chunk_begin, chunk_total, queue_gpu_fence);
    if (my_chunks > 0) reduce_chunk(my_chunks - 1, reduce_blocks + blockIdx.x, reduce_blocks + P);
    return;
  }
  if (blockIdx.x < P && list_cap > 0) {
    const int R = min(*num_recv, y_rows);
    // This block's share: granules b, b + P, b + 2P, ... of y's R rows (<= list_cap rows).
    const int64_t granules = (static_cast<int64_t>(R) + kPushGranule - 1) / kPushGranule;
    const int mine = granules > blockIdx.x ? static_cast<int>((granules - 1 - blockIdx.x) / P + 1) * kPushGranule : 0;
    auto row_at = [&](int i) {
      return (static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(P) * (i / kPushGranule)) * kPushGranule +
             i % kPushGranule;
    };
    auto chunk_of = [&](int64_t r) {
      return static_cast<int>(__ldg(recv_pair + r) % s.pairs_per_rank / k / chunk_tokens);
    };
    for (int c = threadIdx.x; c < num_chunks; c += blockDim.x) chunk_fill[c] = chunk_done[c] = 0;
    if (threadIdx.x == 0) chunks_signalled = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < mine; i += blockDim.x) {
      const int64_t r = row_at(i);
      if (r < R) atomicAdd(&chunk_fill[chunk_of(r)], 1);
    }
    __syncthreads();
    if (warp == 0) {
      scan_chunks(chunk_fill, chunk_begin, num_chunks, lane);
      __syncwarp();
      for (int c = lane; c < num_chunks; c += 32) chunk_fill[c] = chunk_begin[c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < mine; i += blockDim.x) {
      const int64_t r = row_at(i);
      if (r < R) sorted_rows[atomicAdd(&chunk_fill[chunk_of(r)], 1)] = static_cast<int>(r);  // any order
    }
    __syncthreads();
      if (warp < kPushWarps) {
      const int items = chunk_begin[num_chunks] * segs;
      int c = 0;
      for (int item = warp; item < items; item += kPushWarps) {
        const int at = item / segs;
        if (at >= chunk_begin[c + 1]) {
          while (at >= chunk_begin[c + 1]) ++c;
          while (*reinterpret_cast<volatile int*>(&chunks_signalled) + kPushLead <= c) __nanosleep(64);
        }
        push_segment<T>(y, recv_pair, s, sorted_rows[at], item % segs, num_vecs, hidden, lane);
        __syncwarp();  // the lanes' stores before lane 0's release below
        if (lane == 0) {
          __threadfence_block();
          atomicAdd(&chunk_done[c], 1);
        }
      }
    } else {
      for (int c = 0; c < num_chunks; ++c) {
        if (lane == 0) {
          const int need = (chunk_begin[c + 1] - chunk_begin[c]) * segs;
          while (*reinterpret_cast<volatile int*>(&chunk_done[c]) < need) __nanosleep(32);
          __threadfence_block();
        }
        __syncwarp();
        signal_chunk_pushed(s, c, P, lane, epoch);
        if (lane == 0) atomicExch(&chunks_signalled, c + 1);
      }
    }
    return;
  }
  if (blockIdx.x < P) {
    // Barriers: 1 the pushing warps' list; 2 + c % 2 chunk c pushed (pushers arrive, the
    // signaller waits); 4 + c % 2 chunk c signalled (the signaller arrives, pushers wait before
    // arriving for chunk c + 2, so a barrier is never reused early).
    if (warp < kPushWarps) {
      const int R = min(*num_recv, y_rows);
      for (int c = 0; c < num_chunks; ++c) {
        for (int64_t base = static_cast<int64_t>(blockIdx.x) * kPushThreads; base < R;
             base += static_cast<int64_t>(P) * kPushThreads) {
          if (threadIdx.x == 0) list_len = 0;
          named_barrier_sync(1, kPushThreads);
          const int64_t r = base + threadIdx.x;
          if (r < R) {
            const int64_t slot = __ldg(recv_pair + r) % s.pairs_per_rank;
            if (slot / k / chunk_tokens == c) list[atomicAdd(&list_len, 1)] = static_cast<int>(r);  // any order
          }
          named_barrier_sync(1, kPushThreads);
          const int items = list_len * segs;
          for (int item = warp; item < items; item += kPushWarps)
            push_segment<T>(y, recv_pair, s, list[item / segs], item % segs, num_vecs, hidden, lane);
          named_barrier_sync(1, kPushThreads);  // the list is refilled next
        }
        if (c >= 2) named_barrier_sync(4 + c % 2, kCopyThreads);
        named_barrier_arrive(2 + c % 2, kCopyThreads);
      }
      for (int c = max(0, num_chunks - 2); c < num_chunks; ++c) named_barrier_sync(4 + c % 2, kCopyThreads);
    } else {
      for (int c = 0; c < num_chunks; ++c) {
        named_barrier_sync(2 + c % 2, kCopyThreads);  // the barrier makes the pushed rows part of the fence
        signal_chunk_pushed(s, c, P, lane, epoch);
        named_barrier_arrive(4 + c % 2, kCopyThreads);
      }
    }
    return;
  }
  const int q = blockIdx.x - P;
  for (int c = 0; c < my_chunks; ++c)
    if (!reduce_chunk(c, q, help && c == my_chunks - 1 ? reduce_blocks + P : reduce_blocks)) return;
}

}  // namespace

int64_t combine_queue_words(int num_blocks, int y_rows) { return queue_words(num_blocks, y_rows); }

cudaError_t launch_combine_chunked(DType dtype, const void* y, const int* recv_pair, const int* num_recv,
                                   int y_rows, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                   const int* expert_idx, const float* weights, int num_tokens, int k, int hidden,
                                   int num_experts, void* out, int num_blocks, int reduce_blocks, int chunk_tokens,
                                   int num_chunks, int* queue, int64_t queue_words_given, bool queue_gpu_fence,
                                   cudaStream_t stream) {
  if (queue != nullptr && queue_words_given < queue_words(num_blocks, y_rows)) return cudaErrorInvalidValue;
  if (k <= 0 || num_blocks < 1 || reduce_blocks < 1 || chunk_tokens < 1 || num_chunks < 1 ||
      num_chunks > kMaxCombineChunks || static_cast<int64_t>(chunk_tokens) * num_chunks < num_tokens)
    return cudaErrorInvalidValue;
  // A sorting block's share of y's rows: whole granules, every num_blocks-th one.
  const int64_t granules = (static_cast<int64_t>(y_rows) + kPushGranule - 1) / kPushGranule;
  const int64_t list_cap = (granules + num_blocks - 1) / num_blocks * kPushGranule;
  const int cap = list_cap * static_cast<int64_t>(sizeof(int)) > kMaxSortedListBytes ? 0 : static_cast<int>(list_cap);
  // The queue sorts in global memory; the sorted walk in shared memory.
  const size_t smem = queue != nullptr ? 0 : static_cast<size_t>(cap) * sizeof(int);
  // A grid no larger than the SMs runs one block per SM: the kernel built for that keeps twice the
  // registers per thread (no spills, all slots' loads of a token issued at once).
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return cudaGetLastError();
  const bool wide = num_blocks + reduce_blocks <= sms;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weights != nullptr, kWeighted, {
      UNIEP_SWITCH_SLOTS(k, kSlots, {
        UNIEP_SWITCH_BOOL(wide, kWide, {
          constexpr int kMinBlocks = kWide ? 1 : 2;
          if (smem > static_cast<size_t>(kDynamicSmemNoOptIn)) {  // beside the static arrays: past 48 KiB
            const cudaError_t err =
                cudaFuncSetAttribute(combine_chunked_kernel<T, kWeighted, kSlots, kMinBlocks>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
            if (err != cudaSuccess) return err;
          }
          combine_chunked_kernel<T, kWeighted, kSlots, kMinBlocks>
              <<<num_blocks + reduce_blocks, kCopyThreads, smem, stream>>>(
                  static_cast<const T*>(y), recv_pair, num_recv, y_rows, sym, epoch, wait, expert_idx, weights,
                  num_tokens, k, hidden, num_experts, reduce_blocks, chunk_tokens, num_chunks, cap, queue,
                  queue_gpu_fence, static_cast<T*>(out));
        });
      });
    });
  });
  return cudaGetLastError();
}

}  // namespace uniep
