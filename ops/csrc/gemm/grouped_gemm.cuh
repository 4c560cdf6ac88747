// Grouped GEMM of the experts: bf16 operands, fp32 accumulation, bf16 output, on Hopper
// (wgmma + TMA, CUTLASS 3.x ptr-array grouped kernels from the nvidia-cutlass wheel's headers).
//
// Three operations over G groups of rows; group g owns rows [offs[g-1], offs[g]) of the row
// operands (offs: [G] int32 inclusive ends on the device, read by a prepare kernel, so the
// host never waits for the counts). All tensors are row-major and contiguous:
//   kFwd:   y[R, N]     = x[R, K]  @ w[g]^T      (w: [G, N, K], an nn.Linear weight per group)
//   kDgrad: dx[R, K]    = dy[R, N] @ w[g]        (same w)
//   kWgrad: dw[g][N, K] = dy_g^T   @ x_g         (dy: [R, N], x: [R, K]); a group without rows
//                                                 gets dw[g] = 0
// Segments (kFwd and kDgrad, `segs` set): group g is the run of rows [segs[4g], segs[4g] +
// segs[4g+1]) of the row operand and the output (x and y; dy and dx), with w[segs[4g+2]] (w:
// [weights, N, K]); runs may come in any order and `offs` is unused.
// Arrival waits (segments only, `ready` set): no operand tile of group g is loaded before
// ready[segs[4g+3]] reaches `ready_epoch` (segs[4g+3] < 0: no wait), so the rows of a run may
// still be arriving when the kernel starts; a wait that outlasts `timeout_ns` writes
// the error record as the NVLink kernels' waits do (common.cuh) and the tile is computed anyway.
// Second row operand (segments only, `a_alt` set): a segment whose weight index has kSegAltRows
// set reads its x (dy) rows from `a_alt` instead, at row (first row - alt_row0); its rows stay
// where its first row says. (CommFuse's all-gather: this rank's block is read where the caller
// holds it, the peers' blocks where they arrive.)
// Output addresses (segments only, `seg_out` set): segment g's output rows go to seg_out[g] (the
// address of its first output row, rows of N (kDgrad: K) elements back to back) instead of into
// `d`; an address may be a peer's symmetric memory (the MoE layer's second expert GEMM stores
// each (expert, source) run of rows straight into that source's combine buffer, and in the
// backward the first GEMM's dgrad stores the input gradient's rows there).
// Interleaved dispatch (kFwdInterleaved: kFwd over segments with arrival waits, `comm` set):
// one spare warp of every CTA's producer warpgroup runs the fused dispatch's job (moves the rows
// the tiles wait for; InterleavedDispatch in types.h) beside the tiles, so the GEMM has every SM.
// No split-K or stream-K: each output tile is computed by one CTA with a fixed k order
// (k16 wgmma steps in increasing k), so a row's result never depends on the tile shape, the
// raster order or how many SMs run the kernel. Tests check this bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../types.h"

namespace uniep {
namespace gemm {

// Flag in a segment's weight index: its x rows come from GroupedGemmArgs::a_alt.
constexpr int32_t kSegAltRows = 1 << 30;

enum GemmOp : int { kFwd = 0, kDgrad = 1, kWgrad = 2, kNumOps = 3 };
// kFwd with the interleaved dispatch's warps (built for every configuration, not an op of its own).
constexpr int kFwdInterleaved = 3;

// Tile configurations; every op is built with each. Names are reported by config_name().
enum GemmConfig : int {
  kCoop128x256 = 0,      // cooperative, tile 128x256x64, cluster 2x1
  kCoop256x128 = 1,      // cooperative, tile 256x128x64, cluster 2x1
  kPingpong128x128 = 2,  // ping-pong, tile 128x128x64, cluster 2x1
  kNumConfigs = 3,
};

struct GroupedGemmArgs {
  const void* a = nullptr;     // x (kFwd) or dy (kDgrad, kWgrad)
  const void* b = nullptr;     // w (kFwd, kDgrad) or x (kWgrad)
  void* d = nullptr;           // y, dx or dw
  const int32_t* offs = nullptr;
  int groups = 0;
  int n = 0;                   // the N and K of the [G, N, K] weight
  int k = 0;
  int sm_count = 0;            // SMs the persistent kernel may use; 0: all of the device's
  int raster_n = 0;            // tile order: 0 along M (consecutive CTAs share a B tile), 1 along N
  int swizzle = 1;             // CTAs per swizzle band (1, 2, 4 or 8)
  int device = 0;
  // Segments and arrival waits (see above); null: groups by `offs`, no waits.
  const int32_t* segs = nullptr;
  int weights = 0;                    // w's leading extent with segments
  const void* a_alt = nullptr;        // x rows of the segments flagged kSegAltRows
  int64_t alt_row0 = 0;               // the row of x that a_alt's first row stands for
  const int64_t* seg_out = nullptr;   // [groups] output address of each segment's first row
  const uint32_t* ready = nullptr;    // signal words, release-stored by the producers of the rows
  uint32_t ready_epoch = 0;
  uint64_t timeout_ns = 0;
  int64_t* error_record = nullptr;    // host-mapped, filled on a timeout (WaitPolicy's layout)
  uint32_t* poison = nullptr;         // set on a timeout; a set word ends every later wait
  int layer_id = 0;
  int rank = 0;
  int phase = 0;                      // recorded as the phase waited for
  // kFwdInterleaved only: the dispatch job its spare warps run (copied into the workspace).
  InterleavedDispatch comm{};
};

// What the waiting tiles read, written once per launch into the kernel's workspace.
struct WaitControl {
  const uint32_t* words;  // GroupedGemmArgs::ready: a timeout records the index of the word
  uint32_t epoch;
  uint64_t timeout_ns;
  int64_t* error_record;
  uint32_t* poison;
  int layer_id;
  int rank;
  int phase;
};

// Launches on `stream`. Returns cudaSuccess or the error (cudaErrorInvalidValue for an
// unsupported shape or an unknown op/config; CUTLASS's status goes to `cutlass_status`).
// The first call of an (op, config, device, stream, groups, SM count, tile order) allocates
// that combination's device workspace (kept for the process) and initialises the kernel's
// parameters; later calls only launch. Calls on one stream are ordered, so they may share it;
// make the first call outside CUDA graph capture (it allocates).
cudaError_t grouped_gemm(int op, int config, const GroupedGemmArgs& args, cudaStream_t stream, int* cutlass_status);

const char* config_name(int config);

// One (op, config) pair, defined in grouped_gemm_impl.cuh and instantiated in its own
// translation unit (grouped_gemm_<op>_<config>.cu), so the twelve kernels build in parallel.
template <int Op, int Config>
struct Instance {
  static cudaError_t run(const GroupedGemmArgs& args, cudaStream_t stream, int* cutlass_status);
};

}  // namespace gemm
}  // namespace uniep
