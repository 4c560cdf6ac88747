// Plain structs shared by the host launchers and the kernels; no device code, no torch,
// so host-only translation units (the torch adapters) can include the launcher headers.
#pragma once

#include <cstdint>

#include "configs.cuh"

namespace uniep {

// Element types a row can have in device memory (the activation dtype).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// One layer's symmetric buffer as seen from one rank. Every rank's buffer has the
// same byte layout, so one set of offsets serves all peers:
//   counts   [2][kMaxRanks][E] int32   routing counts, double-buffered by epoch parity
//   signals  [kNumPhases][kMaxRanks] uint32, then the chunked combine's flags
//            [kMaxCombineChunks][kMaxRanks] uint32 and local counters [kMaxCombineChunks] uint32
//   status   [32] uint32               local only: [0] poisoned flag, [1..3] done counters, [4..12) the
//                                      fused dispatch's send rounds' counters, [12..20) its arrival
//                                      rounds' counters, [20] its start counter, [21] the
//                                      interleaved dispatch's item counter, [24..24 + kNumPhases)
//                                      the epoch base of each signal phase (kEpochBaseWord)
//   meta     [R_max] int32             source pair of each received row: src * pairs_per_rank + t * k + j
//   dup      [R_max] int32             deduplicated dispatch: the row already holding the same token
//            (its first slot on this rank), or -1 when the row itself was stored
//   scales   [R_max][M / 128] fp32     FP8 dispatch only
//   recv     [R_max][recv_row_bytes]   received rows (activation dtype, or e4m3 bytes)
//   comb     [pairs_per_rank][comb_row_bytes] rows pushed back by combine, at pair t * k + j
//   gates    [pairs_per_rank] fp32     backward of combine: the source's gates, which the expert
//            rank of each pair reads and overwrites with the pair's gate gradient
struct SymView {
  char* ptrs[kMaxRanks];  // base of each rank's buffer (ptrs[rank] is local)
  int rank;
  int num_ranks;
  int64_t counts_off;
  int64_t signals_off;
  int64_t status_off;
  int64_t meta_off;
  int64_t scales_off;
  int64_t recv_off;
  int64_t comb_off;
  int64_t gates_off;
  int64_t dup_off;
  int64_t recv_rows;       // R_max
  int64_t recv_row_bytes;  // M * sizeof(activation) (or M for e4m3)
  int64_t comb_row_bytes;  // M * sizeof(activation)
  int64_t pairs_per_rank;  // T_max * k
};

// Direct receive: a second receive region per rank, a separate symmetric allocation
// that the receiver hands to the caller as its output (no copy-out). Each forward
// dispatch, every rank says in the counts exchange whether its direct region is free
// (nothing still reads the previous rows there); a source stores a destination's rows
// into its direct region when it is free, else into the staging region (recv_off).
// The flags live after the counts: int32 [2 parity][kMaxRanks] at
// counts_off + 2 * kMaxRanks * E * 4 (see direct_flags() in common.cuh).
struct DirectView {
  char* ptrs[kMaxRanks];  // base of each rank's direct region (null when unused)
  int use;                // 0: every destination gets the staging region (backward dispatches)
  uint32_t counts_epoch;  // epoch of the layout whose flags apply
};

// How a wait on a peer gives up: after timeout_ns it fills the error record and
// marks the layer poisoned, so later kernels of the layer do nothing instead of
// hanging or moving rows by a layout they never received.
// The fused schedule's dispatch (launch_dispatch with `fused`): it sends its rows one
// destination per round (round r: rank + r) and, with `take`, takes this rank's arriving rows
// source by source (round r: source rank - r). A launch sends rounds [send_begin, send_end).
// segs: [G * L][4] int32 (first row, rows, local expert, source), the (source, expert) blocks of
// this rank's receive rows in round order (round r: blocks [r * L, (r + 1) * L), all of source
// rank - r; launch_fused_segments with align 1). out: this rank's direct region (rows in place).
// started (or null): a word (device or pinned host memory) that gets the epoch once every block
// of the grid is running (the waiting GEMM is queued behind it).
struct FusedArrive {
  const int* segs;
  int experts_per_rank;
  void* out;
  int* recv_pair;
  int* started;
  int send_begin;
  int send_end;
  bool take;
};

struct WaitPolicy {
  uint64_t timeout_ns;
  int64_t* error_record;  // host-mapped pinned, kErrorRecordWords words
  int layer_id;
};

// The fused schedule's dispatch with interleaved roles: the waiting GEMM's own SMs move the rows.
// One spare warp of each GEMM CTA's producer warpgroup (warp 1, which CUTLASS leaves idle; with
// warps 2, warp 2 as well) claims items of this job one at a time from a counter (status word
// kInterleavedClaimWord, zeroed before the GEMM starts): first the take items of this rank's own
// rows, then every send item (round r from f.send_begin on, a chunk of tokens_per_item tokens)
// storing the rows bound for rank + r, then the other take items (round r, a chunk of rows_per_item
// of source rank - r's rows here) writing their source pairs and deduplicated copies as
// FusedArrive's take does. The last item of a send round raises kPhaseDispatch on its destination,
// the last of a take round kPhaseArrived here for its source once the previous round's word is up:
// the words rise in round order, as with partitioned roles, since a GEMM tile waits only for the
// latest round among its rows. Rounds before f.send_begin (round 0, this rank's own rows, at
// least) are stored by a launch_dispatch before the GEMM. Claiming in order means every send is
// claimed before any remote take waits, and items are not tied to CTAs, so no CTA waits on another
// that may not be running.
struct InterleavedDispatch {
  const void* x;           // [T, M] bf16
  const int* expert_idx;   // [T, k]
  const int* dest_row;     // [T, k]
  int num_tokens;
  int k;
  int hidden;
  int experts_per_rank;
  int dedup;
  int tokens_per_item;
  int rows_per_item;
  int warps;               // warps per CTA that run the job: 1 or 2 (see InterleavedGemmKernel)
  int prefetch;            // bulk-prefetch the rows about to be read into L2
  uint32_t epoch;          // the dispatch's epoch (kPhaseDispatch and kPhaseArrived)
  SymView s;
  DirectView dv;
  FusedArrive f;           // segs, out, recv_pair, send_begin: the first round sent here (1, or G when
                           // launch_dispatch sent every round before the GEMM); started, send_end, take unused
  WaitPolicy w;
};

// Status word of the interleaved dispatch's item counter (see InterleavedDispatch).
constexpr int kInterleavedClaimWord = 21;

// Status words [kEpochBaseWord, kEpochBaseWord + kNumPhases): one epoch base per signal phase. A kernel's
// epoch of a phase is its epoch argument plus that base (device_epoch in common.cuh). Layers whose host
// counts the epochs leave the bases at 0; sync-free layers pass epochs relative to one op (1, 2, ...)
// and add the op's epochs to the bases on the stream after the op, so a captured CUDA graph replays
// with growing epochs.
constexpr int kEpochBaseWord = 24;

}  // namespace uniep
