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

// Where reduce_token finds the row of slot (t, j). slot() turns a kept pair into one int, not
// a pointer (fewer registers; -1 is taken by dropped pairs), load() reads a vector of it.
// CombRows: this rank's combine buffer, row t * k + j (rows pushed back by the experts' ranks).
struct CombRows {
  const int4* base;
  int64_t row_vecs;
  __device__ __forceinline__ int slot(int pair, int /*expert*/) const { return pair; }
  __device__ __forceinline__ int4 load(int code, int c) const { return __ldcg(base + code * row_vecs + c); }
};

// PeerRows: the expert outputs where they were computed, read over NVLink: rank d's source
// region, row dest_row[t, j] (the row the pair was dispatched to); code = row * kMaxRanks + d.
// ptrs points at a shared-memory copy of the region bases (indexing a kernel parameter array
// by a computed rank would go through local memory).
struct PeerRows {
  const char* const* ptrs;
  const int* dest_row;
  int64_t row_vecs;
  int experts_per_rank;
  __device__ __forceinline__ int slot(int pair, int expert) const {
    return __ldg(dest_row + pair) * kMaxRanks + expert / experts_per_rank;
  }
  __device__ __forceinline__ int4 load(int code, int c) const {
    const int4* row = reinterpret_cast<const int4*>(ptrs[code % kMaxRanks]) + (code / kMaxRanks) * row_vecs;
    return __ldcg(row + c);
  }
};

// The region bases of every rank, passed by value to the pulling kernel.
struct SourceRegions {
  const char* ptrs[kMaxRanks];
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

// One warp per token, after every rank's whole push (kPhaseCombine); Rows: CombRows or MirrorRows.
template <typename T, bool kWeighted, int kSlots, typename Rows>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                      Rows rows, const int* __restrict__ expert_idx,
                                                                      const float* __restrict__ weights,
                                                                      int num_tokens, int k, int hidden,
                                                                      int num_experts, T* __restrict__ out) {
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  for (int t = warp; t < num_tokens; t += num_warps)
    reduce_token<T, kWeighted, kSlots>(rows, expert_idx, weights, t, k, hidden, num_experts, 0,
                                       hidden / Vec<T>::kElems, lane, out);
}

// Combine by pulling: every rank's expert outputs stay in its source region (a symmetric
// allocation, the same row layout as the receive rows), and each source reads its tokens'
// rows from there over NVLink, summing them in slot order as combine_reduce_kernel does (the
// same bits, with no combine buffer and no per-chunk signals). Block 0 raises kPhasePull on
// every rank (this rank's outputs are in place: the kernels that wrote them have finished),
// then every block waits for every rank's. Nothing here marks the end of the reads: a rank
// rewrites its source region only after the next counts exchange, or after a barrier. Two
// blocks fit on an SM, so more rows are in flight over NVLink.
template <typename T, bool kWeighted, int kSlots>
__global__ void __launch_bounds__(kCopyThreads, 2) combine_pull_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                    SourceRegions regions,
                                                                    const int* __restrict__ dest_row,
                                                                    const int* __restrict__ expert_idx,
                                                                    const float* __restrict__ weights,
                                                                    int num_tokens, int k, int hidden,
                                                                    int num_experts, T* __restrict__ out) {
  __shared__ const char* bases[kMaxRanks];
  if (poisoned(s)) return;
  if (threadIdx.x < kMaxRanks) bases[threadIdx.x] = regions.ptrs[threadIdx.x];  // before the wait's barriers
  const PeerRows rows{bases, dest_row, hidden / Vec<T>::kElems, num_experts / s.num_ranks};
  if (blockIdx.x == 0 && threadIdx.x < s.num_ranks) raise_signal(s, threadIdx.x, kPhasePull, epoch);
  if (!block_wait_all(s, w, kPhasePull, epoch)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  for (int t = warp; t < num_tokens; t += num_warps)
    reduce_token<T, kWeighted, kSlots>(rows, expert_idx, weights, t, k, hidden, num_experts, 0,
                                       hidden / Vec<T>::kElems, lane, out);
}

// The chunked combine's optional timeline (trace != nullptr; the caller zeroes it first): %globaltimer
// stamps in ns. Block b's words from b * kTraceBlockWords: [0] its start, [1] its end (a pushing
// block: when its last warp had pushed), [2] a pushing block's rows sorted (queue: its own rows
// scattered into the global order), and for each chunk c a block sums (a reducing block; with the
// queue a pushing block too, for the last chunk) [3 + c] chunk c's flags seen,
// [3 + kMaxCombineChunks + c] chunk c summed.
// After the blocks' words, [c]: when chunk c's flags were raised (0 for a chunk without rows here).
constexpr int kTraceBlockWords = 3 + 2 * kMaxCombineChunks;

__host__ __device__ __forceinline__ int64_t trace_words(int grid) {
  return static_cast<int64_t>(grid) * kTraceBlockWords + kMaxCombineChunks;
}

__device__ __forceinline__ void trace_block(unsigned long long* trace, int word) {
  if (trace != nullptr) trace[static_cast<int64_t>(blockIdx.x) * kTraceBlockWords + word] = global_timer_ns();
}

__device__ __forceinline__ void trace_chunk_raised(unsigned long long* trace, int c) {
  if (trace != nullptr) trace[static_cast<int64_t>(gridDim.x) * kTraceBlockWords + c] = global_timer_ns();
}

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
                                                    uint32_t epoch, unsigned long long* trace) {
  bool last = false;
  if (lane == 0) {
    __threadfence_system();
    uint32_t* counter = chunk_counter(s, c);
    last = atomicAdd(counter, 1u) == static_cast<uint32_t>(pushing_blocks - 1);
    if (last) {
      *counter = 0;
      __threadfence_system();  // every block's rows (seen through the counter) before the flags
      trace_chunk_raised(trace, c);
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
// nothing spills and a reducing warp issues all k slots' loads of a vector at once. Timelines
// (bench_dispatch.py --trace) showed why the roles want SMs of their own: beside pushing blocks
// the reducing blocks took twice as long per chunk and fell behind the flags, and pushing beside
// reducing blocks ended later.
//
// Which rows a pushing block stores, in what order:
// - sorted (list_cap > 0): the block owns granules b, b + P, b + 2P, ... of kPushGranule rows
//   of y (so every block's rows go to every source), sorts them by chunk once in shared memory
//   (list_cap ints of dynamic shared memory) and its warps stream through the sorted segments
//   without a barrier between chunks; each warp counts the segments it stored per chunk, and the
//   signalling warp raises chunk c once the count reaches the block's segments of c. A warp
//   starts on chunk c only once chunk c - push_lead is signalled: a chunk's flag waits for the
//   signalling warp's fence, and pushing far ahead would leave the sums of many chunks to the end.
// - by chunk (list_cap == 0): for chunk c = 0, 1, ... the block gathers the rows of its slices
//   of y whose source token lies in chunk c into a shared list and its warps store them; the
//   pushing warps meet at a barrier after each slice.
// Any order gives the same bits: a row's bytes and where they land do not depend on it.
constexpr int kPushGranule = 8;

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
// fixed shares, blocks finished at 35-100% of the kernel's time). A warp counts its segments per
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
                                                   uint32_t epoch, bool gpu_fence, unsigned long long* trace) {
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
      trace_chunk_raised(trace, c);
    }
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last && lane < s.num_ranks) st_release_sys(chunk_flag(s, lane, c, s.rank), epoch);
}

template <typename T>
__device__ void push_by_queue(const T* __restrict__ y, const int* __restrict__ recv_pair, int R, int k,
                              int chunk_tokens, int num_chunks, int segs, int num_vecs, int hidden, const SymView& s,
                              uint32_t epoch, int P, int* q, int* chunk_fill, int* chunk_begin, int* chunk_total,
                              bool gpu_fence, unsigned long long* trace) {
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
  if (threadIdx.x == 0) trace_block(trace, 2);
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
        queue_chunk_stored(s, q, c, pending, chunk_total[c] * segs, lane, epoch, gpu_fence, trace);
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
  queue_chunk_stored(s, q, c, pending, chunk_total[c] * segs, lane, epoch, gpu_fence, trace);
  if (trace != nullptr && lane == 0)
    atomicMax(trace + static_cast<int64_t>(blockIdx.x) * kTraceBlockWords + 1, global_timer_ns());
}

template <typename T, bool kWeighted, int kSlots, int kMinBlocks>
__global__ void __launch_bounds__(kCopyThreads, kMinBlocks) combine_chunked_kernel(
    const T* __restrict__ y, const int* __restrict__ recv_pair, const int* __restrict__ num_recv, int y_rows,
    SymView s, uint32_t epoch, WaitPolicy w, const int* __restrict__ expert_idx, const float* __restrict__ weights,
    int num_tokens, int k, int hidden, int num_experts, int reduce_blocks, int chunk_tokens, int num_chunks,
    int list_cap, int push_lead, int* __restrict__ queue, bool queue_gpu_fence, unsigned long long* trace,
    T* __restrict__ out) {
  constexpr int kElems = Vec<T>::kElems;
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
  if (threadIdx.x == 0) trace_block(trace, 0);
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
    if (threadIdx.x == 0) trace_block(trace, 3 + c);
    const int t0 = c * chunk_tokens;
    const int items = min(chunk_tokens, num_tokens - t0) * segs;
    for (int item = q * kWarpsPerCopyBlock + warp; item < items; item += nq * kWarpsPerCopyBlock) {
      const int seg = item % segs;
      reduce_token<T, kWeighted, kSlots, CombRows, kMinBlocks == 1 ? 8 : 4>(
          rows, expert_idx, weights, t0 + item / segs, k, hidden, num_experts, seg * kCombineSegVecs,
          min(num_vecs, (seg + 1) * kCombineSegVecs), lane, out);
    }
    __syncthreads();  // flag_shared is rewritten by the next chunk
    if (threadIdx.x == 0) trace_block(trace, 3 + kMaxCombineChunks + c);
    return true;
  };
  // Queue mode: once a pushing block has pushed, it sums this rank's last chunk beside the reducing
  // blocks (reducer reduce_blocks + b of reduce_blocks + P), so the tail after the last flag has
  // every block of the grid (the reducing ones alone kept up with the chunks before, not with it).
  const bool help = queue != nullptr;
  if (blockIdx.x < P && queue != nullptr) {
    push_by_queue<T>(y, recv_pair, min(*num_recv, y_rows), k, chunk_tokens, num_chunks, segs, num_vecs, hidden, s,
                     epoch, P, queue, chunk_fill, chunk_begin, chunk_total, queue_gpu_fence, trace);
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
    if (threadIdx.x == 0) trace_block(trace, 2);
    if (warp < kPushWarps) {
      const int items = chunk_begin[num_chunks] * segs;
      int c = 0;
      for (int item = warp; item < items; item += kPushWarps) {
        const int at = item / segs;
        if (at >= chunk_begin[c + 1]) {
          while (at >= chunk_begin[c + 1]) ++c;
          while (*reinterpret_cast<volatile int*>(&chunks_signalled) + push_lead <= c) __nanosleep(64);
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
        signal_chunk_pushed(s, c, P, lane, epoch, trace);
        if (lane == 0) atomicExch(&chunks_signalled, c + 1);
      }
      if (lane == 0) trace_block(trace, 1);
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
        signal_chunk_pushed(s, c, P, lane, epoch, trace);
        named_barrier_arrive(4 + c % 2, kCopyThreads);
      }
    }
    return;
  }
  const int q = blockIdx.x - P;
  for (int c = 0; c < my_chunks; ++c)
    if (!reduce_chunk(c, q, help && c == my_chunks - 1 ? reduce_blocks + P : reduce_blocks)) return;
  if (threadIdx.x == 0) trace_block(trace, 1);
}

// grad_gates[t, j] = <grad_out[t], row of (t, j)>; Rows: CombRows (after every rank's push,
// kPhaseCombine, when `wait`) or MirrorRows (the fused schedule's rows in expert order, no wait).
template <typename T, typename Rows>
__global__ void __launch_bounds__(kCopyThreads) gate_grad_kernel(SymView s, uint32_t epoch, WaitPolicy w, bool wait,
                                                                 Rows rows, const int* __restrict__ expert_idx,
                                                                 const T* __restrict__ grad_out, int num_tokens,
                                                                 int k, int hidden, int num_experts,
                                                                 float* __restrict__ grad_gates) {
  constexpr int kElems = Vec<T>::kElems;
  if (wait && !block_wait_all(s, w, kPhaseCombine, epoch)) return;
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
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const float* gates = reinterpret_cast<const float*>(s.ptrs[s.rank] + s.gates_off);
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < num_pairs; p += gridDim.x * blockDim.x) {
    const int e = __ldg(expert_idx + p);
    grad_gates[p] = (e >= 0 && e < num_experts) ? __ldcg(gates + p) : 0.0f;
  }
}

// Arrival ordering: row r of y goes, times its gate when weighted, into the fp32 accumulator
// row of its token at the source by vector atomics; the sum's order is the arrival order.
__device__ __forceinline__ void red_add_v4(float* addr, float a, float b, float c, float d) {
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}

template <typename T, bool kWeighted>
__global__ void __launch_bounds__(kCopyThreads) combine_atomic_kernel(const T* __restrict__ y,
                                                                      const int* __restrict__ recv_pair,
                                                                      const int* __restrict__ num_recv, int y_rows,
                                                                      int hidden, int k, SymView s, SourceRegions acc,
                                                                      uint32_t epoch) {
  constexpr int kElems = Vec<T>::kElems;
  static_assert(kElems % 4 == 0, "whole float4s per vector");
  if (poisoned(s)) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  const int R = min(*num_recv, y_rows);
  const int num_vecs = hidden / kElems;
  for (int r = warp; r < R; r += num_warps) {
    const int pair = recv_pair[r];
    const int src = static_cast<int>(pair / s.pairs_per_rank);
    const int64_t slot = pair % s.pairs_per_rank;
    float gate = 1.0f;
    if (kWeighted) {
      const float* gw = reinterpret_cast<const float*>(s.ptrs[src] + s.gates_off) + slot;
      gate = __shfl_sync(0xffffffffu, lane == 0 ? __ldcg(gw) : 0.0f, 0);
    }
    float* dst = reinterpret_cast<float*>(const_cast<char*>(acc.ptrs[src])) + (slot / k) * hidden;
    const int4* in = reinterpret_cast<const int4*>(y + static_cast<int64_t>(r) * hidden);
    warp_row_vectors<kUnroll>(num_vecs, lane, [&](int i) { return __ldg(in + i); }, [&](int c, const int4& v) {
      float f[kElems];
      unpack<T>(v, f);
      if (kWeighted) {
#pragma unroll
        for (int i = 0; i < kElems; ++i) f[i] = __fmul_rn(gate, f[i]);
      }
      float* out = dst + static_cast<int64_t>(c) * kElems;
#pragma unroll
      for (int i = 0; i < kElems; i += 4) red_add_v4(out + i, f[i], f[i + 1], f[i + 2], f[i + 3]);
    });
  }
  signal_when_grid_done(s, status_words(s) + 2, kPhaseCombine, epoch);
}

template <typename T>
__global__ void __launch_bounds__(kCopyThreads) acc_cast_kernel(SymView s, uint32_t epoch, WaitPolicy w,
                                                                float* __restrict__ acc, int num_tokens, int hidden,
                                                                T* __restrict__ out) {
  constexpr int kElems = Vec<T>::kElems;
  if (!block_wait_all(s, w, kPhaseCombine, epoch)) return;
  const int64_t num_vecs = static_cast<int64_t>(num_tokens) * hidden / kElems;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4* a = reinterpret_cast<float4*>(acc + v * kElems);
    float f[kElems];
#pragma unroll
    for (int i = 0; i < kElems / 4; ++i) {
      const float4 q = __ldcg(a + i);
      f[4 * i] = q.x;
      f[4 * i + 1] = q.y;
      f[4 * i + 2] = q.z;
      f[4 * i + 3] = q.w;
      a[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    reinterpret_cast<int4*>(out)[v] = pack<T>(f);
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

int64_t combine_queue_words(int num_blocks, int y_rows) { return queue_words(num_blocks, y_rows); }

int64_t combine_trace_words(int grid) { return trace_words(grid); }

cudaError_t launch_combine_chunked(DType dtype, const void* y, const int* recv_pair, const int* num_recv,
                                   int y_rows, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                   const int* expert_idx, const float* weights, int num_tokens, int k, int hidden,
                                   int num_experts, void* out, int num_blocks, int reduce_blocks, int chunk_tokens,
                                   int num_chunks, int push_lead, int* queue, int64_t queue_words_given,
                                   bool queue_gpu_fence, unsigned long long* trace, int64_t trace_words_given,
                                   cudaStream_t stream) {
  if (queue != nullptr && queue_words_given < queue_words(num_blocks, y_rows)) return cudaErrorInvalidValue;
  if (trace != nullptr && trace_words_given < trace_words(num_blocks + reduce_blocks)) return cudaErrorInvalidValue;
  if (k <= 0 || num_blocks < 1 || reduce_blocks < 1 || chunk_tokens < 1 || num_chunks < 1 ||
      num_chunks > kMaxCombineChunks || static_cast<int64_t>(chunk_tokens) * num_chunks < num_tokens || push_lead < 0)
    return cudaErrorInvalidValue;
  // A sorting block's share of y's rows: whole granules, every num_blocks-th one.
  const int64_t granules = (static_cast<int64_t>(y_rows) + kPushGranule - 1) / kPushGranule;
  const int64_t list_cap = push_lead > 0 ? (granules + num_blocks - 1) / num_blocks * kPushGranule : 0;
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
                  num_tokens, k, hidden, num_experts, reduce_blocks, chunk_tokens, num_chunks, cap, push_lead,
                  queue, queue_gpu_fence, trace, static_cast<T*>(out));
        });
      });
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_combine_pull(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait,
                                const char* const* source_ptrs, const int* dest_row, const int* expert_idx,
                                const float* weights, int num_tokens, int k, int hidden, int num_experts, void* out,
                                int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0 || num_experts % sym.num_ranks != 0) return cudaErrorInvalidValue;
  SourceRegions regions;
  for (int i = 0; i < kMaxRanks; ++i) regions.ptrs[i] = source_ptrs[i];
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weights != nullptr, kWeighted, {
      UNIEP_SWITCH_SLOTS(k, kSlots, {
        combine_pull_kernel<T, kWeighted, kSlots><<<num_blocks, kCopyThreads, 0, stream>>>(
            sym, epoch, wait, regions, dest_row, expert_idx, weights, num_tokens, k, hidden, num_experts,
            static_cast<T*>(out));
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

cudaError_t launch_combine_atomic(DType dtype, const void* y, const int* recv_pair, const int* num_recv, int y_rows,
                                  int hidden, int k, bool weighted, const SymView& sym, const char* const* acc_ptrs,
                                  uint32_t epoch, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0 || k <= 0) return cudaErrorInvalidValue;
  SourceRegions acc;
  for (int i = 0; i < kMaxRanks; ++i) acc.ptrs[i] = acc_ptrs[i];
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    UNIEP_SWITCH_BOOL(weighted, kWeighted, {
      combine_atomic_kernel<T, kWeighted><<<num_blocks, kCopyThreads, 0, stream>>>(
          static_cast<const T*>(y), recv_pair, num_recv, y_rows, hidden, k, sym, acc, epoch);
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_acc_cast(DType dtype, const SymView& sym, uint32_t epoch, const WaitPolicy& wait, float* acc,
                            int num_tokens, int hidden, void* out, int num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0) return cudaErrorInvalidValue;
  UNIEP_SWITCH_DTYPE(dtype, T, {
    if (hidden % Vec<T>::kElems != 0) return cudaErrorInvalidValue;
    acc_cast_kernel<T><<<num_blocks, kCopyThreads, 0, stream>>>(sym, epoch, wait, acc, num_tokens, hidden,
                                                                static_cast<T*>(out));
  });
  return cudaGetLastError();
}

namespace {

struct SmSegments {
  int n;
  const uint4* src[kMaxSmSegments];
  uint4* dst[kMaxSmSegments];
  int64_t vecs[kMaxSmSegments];
};

__global__ void copy_segments_sm_kernel(SmSegments t) {
  constexpr int kUnroll = 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int i = 0; i < t.n; ++i) {
    const uint4* __restrict__ s = t.src[i];
    uint4* __restrict__ d = t.dst[i];
    const int64_t n = t.vecs[i];
    int64_t v = first;
    for (; v + (kUnroll - 1) * stride < n; v += kUnroll * stride) {  // loads in flight before the stores
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = s[v + u * stride];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[v + u * stride] = r[u];
    }
    for (; v < n; v += stride) d[v] = s[v];
  }
  __threadfence_system();
}

}  // namespace

cudaError_t launch_copy_segments_sm(int n, const char* const* src, char* const* dst, const int64_t* bytes,
                                    int num_blocks, cudaStream_t stream) {
  if (n < 0 || n > kMaxSmSegments || num_blocks <= 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  SmSegments t;
  t.n = n;
  for (int i = 0; i < n; ++i) {
    if ((reinterpret_cast<uintptr_t>(src[i]) | reinterpret_cast<uintptr_t>(dst[i]) |
         static_cast<uintptr_t>(bytes[i])) % sizeof(uint4) != 0 || bytes[i] < 0) {
      return cudaErrorInvalidValue;
    }
    t.src[i] = reinterpret_cast<const uint4*>(src[i]);
    t.dst[i] = reinterpret_cast<uint4*>(dst[i]);
    t.vecs[i] = bytes[i] / static_cast<int64_t>(sizeof(uint4));
  }
  copy_segments_sm_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(t);
  return cudaGetLastError();
}

}  // namespace uniep
