#include <cub/block/block_scan.cuh>

#include "../common.cuh"
#include "layout.cuh"

namespace uniep {
namespace {

// One block: E <= kMaxExperts <= kLayoutThreads, so thread e owns expert e where it matters.
__global__ void __launch_bounds__(kLayoutThreads) layout_counts_kernel(
    const int* __restrict__ expert_idx, int64_t num_pairs, int num_experts, SymView s, uint32_t epoch,
    WaitPolicy w, int direct_ok, int* __restrict__ block_base, int64_t* __restrict__ local_expert_counts,
    int* __restrict__ num_recv, int64_t* __restrict__ counts_all) {
  __shared__ int mine[kMaxExperts];
  __shared__ int all[kMaxRanks * kMaxExperts];
  if (poisoned(s)) return;
  epoch = device_epoch(s, kPhaseCounts, epoch);
  const int E = num_experts, G = s.num_ranks, L = E / G;
  for (int e = threadIdx.x; e < E; e += blockDim.x) mine[e] = 0;
  __syncthreads();
  // Shared atomics only count; no row is ever placed by their order. Lanes of a warp that hold
  // the same expert add once, by their leader (the same counts, fewer colliding atomics); each
  // thread takes 4 pairs per step, so 4 loads are in flight.
  const int lane = threadIdx.x % 32;
  for (int64_t p0 = static_cast<int64_t>(threadIdx.x) * 4; p0 < num_pairs; p0 += static_cast<int64_t>(blockDim.x) * 4) {
    int es[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) es[u] = p0 + u < num_pairs ? __ldg(expert_idx + p0 + u) : -1;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int e = es[u] >= 0 && es[u] < E ? es[u] : -1;
      const unsigned active = __activemask();
      const unsigned same = __match_any_sync(active, e);
      if (e >= 0 && lane == __ffs(same) - 1) atomicAdd(&mine[e], __popc(same));
    }
  }
  __syncthreads();

  // Double-buffered by epoch parity: a peer can run at most one epoch ahead of this
  // rank here, because epoch n+1's counts need this rank's epoch n+1 signal.
  const int64_t parity_off = static_cast<int64_t>(epoch & 1u) * kMaxRanks * E;
  for (int i = threadIdx.x; i < G * E; i += blockDim.x) {
    const int dst = i / E, e = i % E;
    int* slot = reinterpret_cast<int*>(s.ptrs[dst] + s.counts_off) + parity_off + s.rank * E + e;
    *slot = mine[e];
  }
  // Whether this rank's direct receive region may take this dispatch's rows.
  if (threadIdx.x < G) direct_flags(s, threadIdx.x, E, epoch)[s.rank] = direct_ok;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < G) raise_signal(s, threadIdx.x, kPhaseCounts, epoch);
  if (!block_wait_all(s, w, kPhaseCounts, epoch)) return;

  // After the wait, all[src][e] is rank src's count for expert e, identical on every rank.
  const int* local = reinterpret_cast<const int*>(s.ptrs[s.rank] + s.counts_off) + parity_off;
  for (int i = threadIdx.x; i < G * E; i += blockDim.x) {
    all[i] = __ldcg(local + i);
    counts_all[i] = all[i];
  }
  __syncthreads();
  // mine[] is free again: reuse it for the total of every expert over all sources.
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int total = 0;
    for (int src = 0; src < G; ++src) total += all[src * E + e];
    mine[e] = total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int first = (e / L) * L;
    int base = 0;
    for (int f = first; f < e; ++f) base += mine[f];  // earlier experts of e's rank
    for (int src = 0; src < s.rank; ++src) base += all[src * E + e];  // earlier sources of e
    block_base[e] = base;
  }
  if (threadIdx.x == 0) {
    int total = 0;
    for (int l = 0; l < L; ++l) {
      local_expert_counts[l] = mine[s.rank * L + l];
      total += mine[s.rank * L + l];
    }
    *num_recv = total;
  }
}

// Block e places expert e's pairs: a block-wide exclusive scan over tokens of the
// number of slots routed to e gives each pair its position, in (token, slot) order.
__global__ void __launch_bounds__(kRowsThreads) layout_rows_kernel(const int* __restrict__ expert_idx,
                                                                   int num_tokens, int k, int num_experts,
                                                                   const SymView s,
                                                                   const int* __restrict__ block_base,
                                                                   int* __restrict__ dest_row) {
  using Scan = cub::BlockScan<int, kRowsThreads>;
  __shared__ typename Scan::TempStorage temp;
  if (poisoned(s)) return;
  const int e = blockIdx.x;
  const int base = block_base[e];
  int running = 0;
  for (int t0 = 0; t0 < num_tokens; t0 += kRowsThreads) {
    const int t = t0 + threadIdx.x;
    int hits = 0;
    if (t < num_tokens) {
      for (int j = 0; j < k; ++j) {
        const int ej = expert_idx[static_cast<int64_t>(t) * k + j];
        hits += ej == e;
        // Block 0 also marks dropped pairs, so every entry of dest_row is written once.
        if (e == 0 && (ej < 0 || ej >= num_experts)) dest_row[static_cast<int64_t>(t) * k + j] = -1;
      }
    }
    int before, total;
    Scan(temp).ExclusiveSum(hits, before, total);
    if (hits) {
      int pos = base + running + before;
      for (int j = 0; j < k; ++j)
        if (expert_idx[static_cast<int64_t>(t) * k + j] == e) dest_row[static_cast<int64_t>(t) * k + j] = pos++;
    }
    running += total;
    __syncthreads();  // temp is reused by the next chunk
  }
}

// The latest arrival round among the sources with rows in [lo, hi) of a block whose source s
// holds rows [pre[s], pre[s] + cnt[s]).
__device__ int latest_round(const int64_t* pre, const int64_t* cnt, int G, int rank, int64_t lo, int64_t hi) {
  int latest = -1;
  for (int s = 0; s < G; ++s)
    if (cnt[s] > 0 && pre[s] < hi && pre[s] + cnt[s] > lo) latest = max(latest, (rank - s + G) % G);
  return latest;
}

// One thread per (round, local expert): the tiles of `align` rows of the expert's block whose
// latest source is the round's (layout.fused_runs says why they are one range).
__global__ void fused_segments_kernel(const int64_t* __restrict__ counts_all, int G, int E, int rank, int align,
                                      int* __restrict__ segs) {
  const int L = E / G;
  for (int i = threadIdx.x; i < G * L; i += blockDim.x) {
    const int round = i / L, l = i % L;
    const int src = (rank - round + G) % G;
    const int col = rank * L + l;
    int64_t base = 0;
    for (int e = 0; e < l; ++e)
      for (int s = 0; s < G; ++s) base += counts_all[s * E + rank * L + e];
    int64_t pre[kMaxRanks], cnt[kMaxRanks], total = 0;
    for (int s = 0; s < G; ++s) {
      pre[s] = total;
      cnt[s] = counts_all[s * E + col];
      total += cnt[s];
    }
    int64_t first = base + pre[src], rows = 0;
    if (cnt[src] > 0) {
      const int64_t t0 = pre[src] / align, t1 = (pre[src] + cnt[src] - 1) / align;
      const auto latest = [&](int64_t t) { return latest_round(pre, cnt, G, rank, t * align, min(t * align + align, total)); };
      const int64_t ts = latest(t0) == round ? t0 : t0 + 1;
      const int64_t te = latest(t1) == round ? t1 : t1 - 1;
      if (ts <= te) {
        first = base + ts * align;
        rows = min((te + 1) * align, total) - ts * align;
      }
    }
    segs[4 * i] = static_cast<int>(first);
    segs[4 * i + 1] = static_cast<int>(rows);
    segs[4 * i + 2] = l;
    segs[4 * i + 3] = src;
  }
}

}  // namespace

cudaError_t launch_fused_segments(const int64_t* counts_all, int num_ranks, int num_experts, int rank, int align,
                                  int* segs, cudaStream_t stream) {
  if (num_ranks <= 0 || num_ranks > kMaxRanks || num_experts % num_ranks || rank < 0 || rank >= num_ranks || align < 1)
    return cudaErrorInvalidValue;
  fused_segments_kernel<<<1, 256, 0, stream>>>(counts_all, num_ranks, num_experts, rank, align, segs);
  return cudaGetLastError();
}

cudaError_t launch_layout(const int* expert_idx, int num_tokens, int k, int num_experts, const SymView& sym,
                          uint32_t epoch, const WaitPolicy& wait, int direct_ok, int* block_base,
                          int64_t* local_expert_counts, int* num_recv, int64_t* counts_all, int* dest_row,
                          cudaStream_t stream) {
  if (num_experts <= 0 || num_experts > kMaxExperts || sym.num_ranks <= 0 || sym.num_ranks > kMaxRanks ||
      num_experts % sym.num_ranks != 0 || k <= 0 || k > kMaxTopK || num_tokens < 0)
    return cudaErrorInvalidValue;
  layout_counts_kernel<<<1, kLayoutThreads, 0, stream>>>(expert_idx, static_cast<int64_t>(num_tokens) * k,
                                                         num_experts, sym, epoch, wait, direct_ok, block_base,
                                                         local_expert_counts, num_recv, counts_all);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  layout_rows_kernel<<<num_experts, kRowsThreads, 0, stream>>>(expert_idx, num_tokens, k, num_experts, sym,
                                                               block_base, dest_row);
  return cudaGetLastError();
}

}  // namespace uniep
