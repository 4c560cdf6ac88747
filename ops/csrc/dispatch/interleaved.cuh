// The fused schedule's dispatch with interleaved roles (InterleavedDispatch in types.h): run by
// one (or two) spare warps of each CTA of the waiting GEMM, beside its warpgroups. Device code
// only; the rows, meta words, dup words and source pairs are those of launch_dispatch's fused
// rounds.
#pragma once

#include "../common.cuh"

namespace uniep {
namespace interleaved {

constexpr int kPrefetchTokens = 4;  // send items: token rows prefetched into L2 ahead of the copy

// 16-byte vectors a lane keeps in flight in a row copy: the warp runs on the producer warpgroup's
// 40 registers (after its release), and each further instance of the row copy costs spills there.
constexpr int kUnroll = 4;

__device__ __forceinline__ int send_items(const InterleavedDispatch& j) {
  return max(1, (j.num_tokens + j.tokens_per_item - 1) / j.tokens_per_item);
}

// Items of take round `round` (source rank - round): its rows here in chunks, at least one item
// (which only waits and raises the word) when the source sent none. Warp-wide.
__device__ __forceinline__ int take_items(const InterleavedDispatch& j, int round, int lane) {
  const int L = j.f.experts_per_rank;
  const int* seg = j.f.segs + 4 * round * L;
  int rows = 0;
  for (int l = lane; l < L; l += 32) rows += seg[4 * l + 1];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) rows += __shfl_xor_sync(0xffffffffu, rows, o);
  return max(1, (rows + j.rows_per_item - 1) / j.rows_per_item);
}

// After an item's stores (each lane fences its own): whether it was the last of the `total`
// items that `counter` counts (left at 0 then, after a fence). The whole warp gets the answer.
__device__ __forceinline__ bool last_item(uint32_t* counter, int total, int lane) {
  __threadfence_system();
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    last = atomicAdd(counter, 1u) == static_cast<uint32_t>(total - 1);
    if (last) {
      *counter = 0;
      __threadfence_system();
    }
  }
  return __shfl_sync(0xffffffffu, last, 0) != 0;
}

// Send item: tokens [item * tokens_per_item, ...) to rank + round. A token's row crosses once
// (dedup): its later slots there get the meta word and, in the dup word, the row of its first.
__device__ inline void send(const InterleavedDispatch& j, int round, int item, int lane) {
  const SymView& s = j.s;
  const int dst = (s.rank + round) % s.num_ranks;
  const int L = j.experts_per_rank;
  const int t_end = min(j.num_tokens, (item + 1) * j.tokens_per_item);
  const int num_vecs = j.hidden / 8;  // bf16
  char* region = recv_region(s, j.dv, dst, L * s.num_ranks);
  int* meta = reinterpret_cast<int*>(s.ptrs[dst] + s.meta_off);
  int* dups = reinterpret_cast<int*>(s.ptrs[dst] + s.dup_off);
  const int t_begin = item * j.tokens_per_item;
  const char* x = static_cast<const char*>(j.x);
  const uint32_t row_bytes = static_cast<uint32_t>(j.hidden) * 2;
  if (j.prefetch && lane < kPrefetchTokens && t_begin + lane < t_end)
    prefetch_l2(x + static_cast<int64_t>(t_begin + lane) * row_bytes, row_bytes);
  for (int t = t_begin; t < t_end; ++t) {
    // The rows kPrefetchTokens tokens ahead go to L2 while this one is copied.
    if (j.prefetch && lane == 0 && t + kPrefetchTokens < t_end)
      prefetch_l2(x + static_cast<int64_t>(t + kPrefetchTokens) * row_bytes, row_bytes);
    const int4* src = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * row_bytes);
    int first_row = -1;
    for (int q = 0; q < j.k; ++q) {
      const int64_t pair = static_cast<int64_t>(t) * j.k + q;
      const int row = j.dest_row[pair];
      if (row < 0 || j.expert_idx[pair] / L != dst) continue;
      const bool stored = !j.dedup || first_row < 0;
      if (lane == 0) {
        meta[row] = static_cast<int>(s.rank * s.pairs_per_rank + pair);
        if (j.dedup) dups[row] = stored ? -1 : first_row;
      }
      if (stored) {
        int4* out = reinterpret_cast<int4*>(region + static_cast<int64_t>(row) * s.recv_row_bytes);
        warp_row_vectors<kUnroll>(num_vecs, lane, [&](int i) { return __ldg(src + i); },
                                  [&](int i, const int4& v) { out[i] = v; });
      }
      if (first_row < 0) first_row = row;
    }
  }
}

// Take item: rows [item * rows_per_item, ...) of source round `round`'s rows here (its (source,
// expert) blocks back to back), once the source signalled: each row's source pair, and the copy
// of a deduplicated row from its token's first row here. False when the wait gave up.
__device__ inline bool take(const InterleavedDispatch& j, int round, int item, int lane) {
  const SymView& s = j.s;
  const int L = j.f.experts_per_rank;
  const int* seg = j.f.segs + 4 * round * L;
  int ok = 1;
  if (lane == 0) ok = wait_signal(s, j.w, seg[3], kPhaseDispatch, j.epoch);
  if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
  const int row_bytes = j.hidden * 2;
  const int* meta = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.meta_off);
  const int* dups = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.dup_off);
  char* out = static_cast<char*>(j.f.out);
  const int begin = item * j.rows_per_item, end = begin + j.rows_per_item;
  int pos = 0;  // the round's rows before block l
  for (int l = 0; l < L && pos < end; ++l) {
    const int first = seg[4 * l], rows = seg[4 * l + 1];
    const int stop = min(end, pos + rows);
    for (int p = max(begin, pos); p < stop; p += 32)
      take_rows<kUnroll>(meta, dups, j.f.recv_pair, out, first + (p - pos), min(32, stop - p), row_bytes,
                         j.dedup != 0, j.prefetch != 0, lane);
    pos += rows;
  }
  return true;
}

// Round `round`'s rows are all taken: raise kPhaseArrived for its source here, once the previous
// round's word is up. A run of the GEMM waits only for the latest round among its rows (see
// layout.fused_runs), so the words must rise in round order; the items of different rounds finish
// in any order, and the previous round's items were all claimed earlier, by warps that are running.
// False when the wait gave up. Warp-wide.
__device__ __forceinline__ bool raise_arrived(const InterleavedDispatch& j, int round, int lane) {
  const SymView& s = j.s;
  const int* seg = j.f.segs + 4 * j.f.experts_per_rank * round;
  int ok = 1;
  if (lane == 0) {
    if (round > 0) ok = wait_signal(s, j.w, seg[3 - 4 * j.f.experts_per_rank], kPhaseArrived, j.epoch);
    if (ok) st_release_sys(signal_word(s, s.rank, kPhaseArrived, seg[3]), j.epoch);
  }
  return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// The whole job, by one warp, claiming items until none is left: this rank's own take round
// first (its rows are already stored, so the GEMM's first tiles can start), then every send,
// then the other take rounds in round order (the order the sources send to this rank).
__device__ inline void run(const InterleavedDispatch& j) {
  const int lane = threadIdx.x % 32;
  const SymView& s = j.s;
  if (poisoned(s)) return;
  const int G = s.num_ranks;
  uint32_t* status = status_words(s);
  const int own = take_items(j, 0, lane);
  const int per_send = send_items(j);
  const int first_send = j.f.send_begin;  // rounds before it were sent before the GEMM
  const int sends = (G - first_send) * per_send;
  while (true) {
    int item = 0;
    if (lane == 0) item = static_cast<int>(atomicAdd(status + kInterleavedClaimWord, 1u));
    item = __shfl_sync(0xffffffffu, item, 0);
    int round = 0, items = own;
    if (item >= own && item < own + sends) {
      round = first_send + (item - own) / per_send;
      send(j, round, (item - own) % per_send, lane);
      if (last_item(status + 4 + round, per_send, lane) && lane == 0)
        raise_signal(s, (s.rank + round) % G, kPhaseDispatch, j.epoch);
      continue;
    }
    if (item >= own) {
      item -= own + sends;
      for (round = 1; round < G; ++round) {
        items = take_items(j, round, lane);
        if (item < items) break;
        item -= items;
      }
      if (round == G) return;  // every item claimed
    }
    if (!take(j, round, item, lane)) return;
    if (last_item(status + 12 + round, items, lane) && !raise_arrived(j, round, lane)) return;
  }
}

}  // namespace interleaved
}  // namespace uniep
