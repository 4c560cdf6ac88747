// Hard limits of the UniEP kernels, in one place. The Python side reads none of
// these by parsing: ds_uniep/megakernel/buffers.py repeats the few it validates against or sizes
// buffers by (kMaxRanks, kMaxExperts, kMaxTopK, kFp8GroupSize, ...) and test_ops_compile checks
// they agree.
#pragma once

#include <cstdint>

namespace uniep {

// Ranks of one expert-parallel group reachable by NVLink stores (one host).
constexpr int kMaxRanks = 8;
// Experts of one layer; the counts kernel keeps one int per expert in shared memory.
constexpr int kMaxExperts = 1024;
// Slots per token; the dispatch kernel keeps k destinations in registers.
constexpr int kMaxTopK = 16;
// FP8 dispatch: one fp32 scale per this many consecutive elements of a row.
constexpr int kFp8GroupSize = 128;
// Largest finite e4m3 value; amax of a group maps onto it.
constexpr float kFp8Max = 448.0f;
// Its fp32 reciprocal: the scale is amax * (1 / 448), rounded as torch rounds a division
// by a Python scalar (multiplication by the reciprocal), so FP8 rows match the reference.
constexpr float kFp8InvMax = 1.0f / 448.0f;
// Floor of a group's amax, so an all-zero group gets a finite scale.
constexpr float kFp8MinAmax = 1e-12f;

// Signal slots: one row of kMaxRanks uint32 words per phase in every rank's buffer.
// Writer s sets word [phase][s] of the destination to the phase's epoch.
enum SignalPhase : int {
  kPhaseCounts = 0,    // routing counts exchanged (layout)
  kPhaseDispatch = 1,  // all rows of a dispatch stored
  kPhaseCombine = 2,   // all rows of a combine push stored
  kPhaseBarrier = 3,   // entry barrier of backward ops
  kPhaseArrived = 4,   // fused schedule, local only: word [4][s] says source s's rows are usable here
  kPhaseGates = 5,     // a source's gates are in its gates region (combine of rank partials)
  kNumPhases = 6,
};

// Chunked combine: a source's tokens fall into at most this many chunks; every rank raises one
// flag per (chunk, source) once it has pushed all its rows of that chunk, so the source sums a
// chunk while later chunks are still on the wire. The flags ([kMaxCombineChunks][kMaxRanks]
// uint32) and the local arrival counters ([kMaxCombineChunks] uint32) follow the phase signals.
constexpr int kMaxCombineChunks = 64;
// A chunk's rows are moved and summed in segments of this many 16-byte vectors per row.
constexpr int kCombineSegVecs = 128;
// A pushing block of the chunked combine sorts its rows by chunk in at most this much dynamic
// shared memory (one int per row); a larger share pushes chunk by chunk instead (the same bits).
constexpr int kMaxSortedListBytes = 48 * 1024;
// Dynamic shared memory a launch may take without opting in to more: a kernel's static and dynamic
// shared memory together get 48 KiB unless its cudaFuncAttributeMaxDynamicSharedMemorySize is raised.
// The chunked combine's static arrays take about 3 KiB (ptxas -v), so a sorted list above this
// bound is launched with the attribute raised to its size.
constexpr int kDynamicSmemNoOptIn = 40 * 1024;

// Threads of the copy kernels; one warp moves one row (or one token's k rows).
constexpr int kCopyThreads = 512;
constexpr int kWarpsPerCopyBlock = kCopyThreads / 32;
// Threads of the layout kernels.
constexpr int kLayoutThreads = 1024;
constexpr int kRowsThreads = 1024;

// Words of the error record a timed-out wait fills (host-mapped pinned memory):
// [0] 1 once set, [1] phase, [2] source rank waited on, [3] epoch expected,
// [4] value seen, [5] this rank, [6] layer id.
constexpr int kErrorRecordWords = 8;

}  // namespace uniep
