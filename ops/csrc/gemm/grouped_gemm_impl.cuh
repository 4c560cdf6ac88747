// The CUTLASS kernel types behind grouped_gemm.cuh and their launch: a prepare kernel turns
// the device offsets (or segments) into per-group problem shapes, pointers and strides (no host
// sync), then the ptr-array grouped kernel runs with device-side problem shapes. Its mainloop is
// CUTLASS's, extended by one step: before a group's first operand load, the producer warp waits
// for that group's arrival word (when it has one). kFwdInterleaved adds a second: a spare warp
// of the producer warpgroup runs the interleaved dispatch's job (dispatch/interleaved.cuh).
#pragma once

#include "grouped_gemm.cuh"
#include "../common.cuh"
#include "../dispatch/interleaved.cuh"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace uniep {
namespace gemm {
namespace detail {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// CUTLASS's A is (M, K), B is (N, K) and D is (M, N); the layout tags say which index is
// contiguous. See grouped_gemm.cuh for what A, B and D are per op.
template <int Op> struct OpLayouts;
template <> struct OpLayouts<kFwd> { using A = RowMajor; using B = ColumnMajor; };    // x, w[g] (K contiguous)
template <> struct OpLayouts<kFwdInterleaved> : OpLayouts<kFwd> {};
template <> struct OpLayouts<kDgrad> { using A = RowMajor; using B = RowMajor; };     // dy, w[g] (N contiguous)
template <> struct OpLayouts<kWgrad> { using A = ColumnMajor; using B = RowMajor; };  // dy^T, x (M, N contiguous)

template <int Config> struct ConfigTraits;
template <> struct ConfigTraits<kCoop128x256> {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <> struct ConfigTraits<kCoop256x128> {
  using Tile = Shape<_256, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <> struct ConfigTraits<kPingpong128x128> {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

constexpr int kAlign = 8;  // elements per 16-byte access

// The stride of a packed (mode0, mode1) operand: the non-unit stride is the extent of the
// contiguous mode. These are the two stride forms the ptr-array kernels use per group.
template <class IntT>
CUTE_HOST_DEVICE Stride<IntT, _1, _0> packed_stride(Stride<IntT, _1, _0> s, int, int extent1) {
  get<0>(s) = static_cast<IntT>(extent1);
  return s;
}
template <class IntT>
CUTE_HOST_DEVICE Stride<_1, IntT, _0> packed_stride(Stride<_1, IntT, _0> s, int extent0, int) {
  get<1>(s) = static_cast<IntT>(extent0);
  return s;
}

// The NVLink kernels' wait (common.cuh) on a group's arrival word; the record names the word's
// index (for the fused dispatch, the source rank). Returns either way: a GEMM tile cannot leave
// its pipeline, so after a timeout it computes on whatever rows are there and the host raises.
__device__ inline void wait_arrival(const uint32_t* word, const WaitControl& c) {
  wait_until(word, c.epoch, c.timeout_ns, c.poison, c.error_record, c.phase, static_cast<int>(word - c.words), c.rank,
             c.layer_id);
}

// CUTLASS's ptr-array mainloop plus arrival waits. The kernel calls tensors_perform_update in
// the producer warp whenever the group changes, before any TMA load of the new group: the wait
// goes there. Lane 0 spins, the warp then fences the generic proxy (where the acquire saw the
// rows' release) against the async proxy that the TMA loads read through. `comm` carries the
// interleaved dispatch's job to InterleavedGemmKernel (null otherwise).
template <class Base>
struct WaitingMainloop : Base {
  struct Arguments : Base::Arguments {
    const uint32_t* const* ready;  // [groups]: the word each group waits for, or null
    const WaitControl* control;
    const InterleavedDispatch* comm;  // kFwdInterleaved: the job (in the workspace)
  };
  struct Params : Base::Params {
    const uint32_t* const* ready;
    const WaitControl* control;
    const InterleavedDispatch* comm;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    return Params{Base::to_underlying_arguments(problem_shapes, args, workspace), args.ready, args.control,
                  args.comm};
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& input_tensors, Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    if (params.ready != nullptr) {
      const uint32_t* word = params.ready[next_batch];
      if (word != nullptr) {
        if (threadIdx.x % 32 == 0) wait_arrival(word, *params.control);
        __syncwarp();
        asm volatile("fence.proxy.async.global;" ::: "memory");
      }
    }
    return Base::tensors_perform_update(input_tensors, params, problem_shape_mnkl, next_batch);
  }
};

// The interleaved forward's kernel: CUTLASS's, then the interleaved dispatch's job in warp 1 (and,
// with comm->warps 2, warp 2) of the producer warpgroup (warpgroup 0 in both kernels). Without an
// auxiliary load CUTLASS gives warp 1 no role, and warp 2 (the epilogue's load warp) none when
// the epilogue reads no C: they pass the kernel's setup (barrier inits, the cluster wait, the
// warpgroup's register release) and return, so the job runs beside the GEMM from the start and
// nothing in the GEMM waits for them. (CUTLASS's auxiliary-load warp would be a consumer of the
// grouped tile scheduler's 8-stage pipeline, so a CTA's GEMM could get at most 8 tiles ahead of
// that warp's job.) A CTA without tiles returns before the release and runs the job alone.
template <class Base>
struct InterleavedGemmKernel : Base {
  static_assert(cute::is_void_v<typename Base::CollectiveEpilogue::ElementC>, "warp 2 must have no C to load");
  CUTLASS_DEVICE void operator()(typename Base::Params const& params, char* smem_buf) {
    Base::operator()(params, smem_buf);
    const int warp = threadIdx.x / 32;
    const InterleavedDispatch* job = params.mainloop.comm;
    if (job != nullptr && (warp == 1 || (warp == 2 && job->warps > 1))) interleaved::run(*job);
  }
};

template <int Op, int Config>
struct Kernel {
  using Layouts = OpLayouts<Op>;
  using Traits = ConfigTraits<Config>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::Tile, typename Traits::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, RowMajor*, kAlign,  // no C operand: D = accumulator, cast once
      Bf16, RowMajor*, kAlign, typename Traits::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Bf16, float>>::CollectiveOp;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, typename Layouts::A*, kAlign, Bf16,
      typename Layouts::B*, kAlign, float, typename Traits::Tile, typename Traits::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Traits::Mainloop>::CollectiveOp;
  using CollectiveMainloop = WaitingMainloop<BaseMainloop>;
  using CutlassKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using GemmKernel = cute::conditional_t<Op == kFwdInterleaved, InterleavedGemmKernel<CutlassKernel>, CutlassKernel>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

// Per-group argument arrays, carved from a State's workspace after CUTLASS's own part.
template <class K>
struct ArgArrays {
  Shape3* shapes;
  const Bf16** a;
  const Bf16** b;
  Bf16** d;
  typename K::StrideA* sa;
  typename K::StrideB* sb;
  typename K::StrideD* sd;
  const uint32_t** ready;
  WaitControl* control;
  InterleavedDispatch* comm;

  static size_t align(size_t bytes) { return (bytes + 255) & ~size_t(255); }
  static size_t bytes(int groups) {
    const size_t g = static_cast<size_t>(groups);
    return align(g * sizeof(Shape3)) + 3 * align(g * sizeof(void*)) + align(g * sizeof(typename K::StrideA)) +
           align(g * sizeof(typename K::StrideB)) + align(g * sizeof(typename K::StrideD)) +
           align(g * sizeof(void*)) + align(sizeof(WaitControl)) + align(sizeof(InterleavedDispatch));
  }
  static ArgArrays carve(char* p, int groups) {
    const size_t g = static_cast<size_t>(groups);
    ArgArrays r;
    r.shapes = reinterpret_cast<Shape3*>(p);
    p += align(g * sizeof(Shape3));
    r.a = reinterpret_cast<const Bf16**>(p);
    p += align(g * sizeof(void*));
    r.b = reinterpret_cast<const Bf16**>(p);
    p += align(g * sizeof(void*));
    r.d = reinterpret_cast<Bf16**>(p);
    p += align(g * sizeof(void*));
    r.sa = reinterpret_cast<typename K::StrideA*>(p);
    p += align(g * sizeof(typename K::StrideA));
    r.sb = reinterpret_cast<typename K::StrideB*>(p);
    p += align(g * sizeof(typename K::StrideB));
    r.sd = reinterpret_cast<typename K::StrideD*>(p);
    p += align(g * sizeof(typename K::StrideD));
    r.ready = reinterpret_cast<const uint32_t**>(p);
    p += align(g * sizeof(void*));
    r.control = reinterpret_cast<WaitControl*>(p);
    p += align(sizeof(WaitControl));
    r.comm = reinterpret_cast<InterleavedDispatch*>(p);
    return r;
  }
};

// One thread per group: its problem shape and operand pointers from the row offsets (or its
// segment), and its arrival word. Every operand is packed, so the strides are the same for all
// groups and come in by value. kFwdInterleaved: thread 0 also writes the dispatch's job and
// zeroes its item counter (the GEMM runs after this kernel, on the same stream).
template <int Op, class K>
__global__ void prepare_groups(GroupedGemmArgs args, ArgArrays<K> out, typename K::StrideA sa,
                               typename K::StrideB sb, typename K::StrideD sd) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g == 0) {
    *out.control = WaitControl{args.ready,    args.ready_epoch, args.timeout_ns, args.error_record,
                               args.poison,   args.layer_id,    args.rank,       args.phase};
    if (Op == kFwdInterleaved) {
      *out.comm = args.comm;
      status_words(args.comm.s)[kInterleavedClaimWord] = 0;
    }
  }
  if (g >= args.groups) return;
  const bool seg = Op != kWgrad && args.segs != nullptr;
  const int32_t* sg = seg ? args.segs + 4 * g : nullptr;
  const int64_t start = seg ? sg[0] : g == 0 ? 0 : args.offs[g - 1];
  const int rows = seg ? sg[1] : static_cast<int>(args.offs[g] - start);
  const bool alt = seg && args.a_alt != nullptr && (sg[2] & kSegAltRows) != 0;
  const int64_t wi = seg ? (sg[2] & ~kSegAltRows) : g;
  out.ready[g] = seg && args.ready != nullptr && sg[3] >= 0 ? args.ready + sg[3] : nullptr;
  const int64_t n = args.n, k = args.k;
  const Bf16* a = static_cast<const Bf16*>(alt ? args.a_alt : args.a);
  const Bf16* b = static_cast<const Bf16*>(args.b);
  Bf16* d = static_cast<Bf16*>(args.d);
  if (Op == kFwd || Op == kFwdInterleaved) {
    out.shapes[g] = Shape3{rows, args.n, args.k};
    out.a[g] = a + (alt ? start - args.alt_row0 : start) * k;
    out.b[g] = b + wi * n * k;
    out.d[g] = seg && args.seg_out != nullptr ? reinterpret_cast<Bf16*>(args.seg_out[g]) : d + start * n;
  } else if (Op == kDgrad) {
    out.shapes[g] = Shape3{rows, args.k, args.n};
    out.a[g] = a + (alt ? start - args.alt_row0 : start) * n;
    out.b[g] = b + wi * n * k;
    out.d[g] = seg && args.seg_out != nullptr ? reinterpret_cast<Bf16*>(args.seg_out[g]) : d + start * k;
  } else {
    // K = rows: a group without rows has no tiles here (M = 0); zero_empty_groups clears it.
    out.shapes[g] = Shape3{rows > 0 ? args.n : 0, args.k, rows};
    out.a[g] = a + start * n;
    out.b[g] = b + start * k;
    out.d[g] = d + g * n * k;
  }
  out.sa[g] = sa;
  out.sb[g] = sb;
  out.sd[g] = sd;
}

// dw[g] = 0 for every group without rows (the wgrad of an expert that received nothing).
static __global__ void zero_empty_groups(const int32_t* offs, uint4* dw, int64_t vec_per_group) {
  const int g = blockIdx.y;
  const int32_t start = g == 0 ? 0 : offs[g - 1];
  if (offs[g] != start) return;
  uint4* p = dw + g * vec_per_group;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < vec_per_group; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(0, 0, 0, 0);
}

inline int device_sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  if (cached[device] == 0) cached[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return cached[device];
}

template <class K>
typename K::Gemm::Arguments make_arguments(int groups, const ArgArrays<K>& arr, int sm_count, int device,
                                           int raster_n = 0, int swizzle = 1) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count > 0 ? sm_count : device_sm_count(device);
  typename K::Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, arr.shapes, nullptr},  // shapes live on the device only
      {{arr.a, arr.sa, arr.b, arr.sb}, arr.ready, arr.control, arr.comm},
      {{}, nullptr, arr.sd, arr.d, arr.sd},  // alpha 1, beta 0, no C
      hw};
  using Raster = decltype(arguments.scheduler.raster_order);
  arguments.scheduler.raster_order = raster_n ? Raster::AlongN : Raster::AlongM;
  arguments.scheduler.max_swizzle_size = swizzle;
  return arguments;
}

// What one (op, config, device, stream, groups, SM count, tile order) keeps between calls: its
// device workspace (CUTLASS's part, then the per-group argument arrays) and the initialised
// kernel parameters. The parameters only point at the arrays, which prepare_groups rewrites in
// stream order on every call, so a call costs two launches and no host-side setup.
template <class K>
struct State {
  typename K::Gemm gemm;
  ArgArrays<K> arr{};
  char* ws = nullptr;
};

struct StateKey {
  int device, groups, sm_count, raster_n, swizzle;
  cudaStream_t stream;
  bool operator<(const StateKey& o) const {
    return std::tie(device, groups, sm_count, raster_n, swizzle, stream) <
           std::tie(o.device, o.groups, o.sm_count, o.raster_n, o.swizzle, o.stream);
  }
};

// A first call on a stream that is capturing a CUDA graph makes its state then: the workspace's
// allocation is not a graph operation, and under the global capture mode that CUDA graphs are
// captured in by default it would end the capture (and the process). The state is made in the
// relaxed mode, which allows it, and the thread's mode is put back after.
class RelaxedWhileCapturing {
 public:
  explicit RelaxedWhileCapturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    active_ = cudaStreamIsCapturing(stream, &status) == cudaSuccess && status == cudaStreamCaptureStatusActive;
    if (active_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  ~RelaxedWhileCapturing() {
    if (active_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }

 private:
  bool active_ = false;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

template <class K>
cudaError_t state_for(const GroupedGemmArgs& args, cudaStream_t stream, State<K>** out, int* cutlass_status) {
  static std::mutex mutex;
  static std::map<StateKey, std::unique_ptr<State<K>>> states;  // kept for the process's life
  const StateKey key{args.device, args.groups, args.sm_count, args.raster_n, args.swizzle, stream};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = states.find(key);
  if (it != states.end()) {
    *out = it->second.get();
    return cudaSuccess;
  }
  const RelaxedWhileCapturing relaxed(stream);
  auto st = std::make_unique<State<K>>();
  ArgArrays<K> none{};
  const size_t cutlass_bytes = ArgArrays<K>::align(
      K::Gemm::get_workspace_size(make_arguments<K>(args.groups, none, args.sm_count, args.device)));
  cudaError_t err = cudaMalloc(&st->ws, cutlass_bytes + ArgArrays<K>::bytes(args.groups));
  if (err != cudaSuccess) return err;
  st->arr = ArgArrays<K>::carve(st->ws + cutlass_bytes, args.groups);
  const auto arguments =
      make_arguments<K>(args.groups, st->arr, args.sm_count, args.device, args.raster_n, args.swizzle);
  cutlass::Status status = st->gemm.can_implement(arguments);
  if (status == cutlass::Status::kSuccess) status = st->gemm.initialize(arguments, st->ws, stream);
  if (status != cutlass::Status::kSuccess) {
    if (cutlass_status) *cutlass_status = static_cast<int>(status);
    cudaFree(st->ws);
    return cudaErrorInvalidValue;
  }
  *out = st.get();
  states.emplace(key, std::move(st));
  return cudaSuccess;
}

}  // namespace detail

template <int Op, int Config>
cudaError_t Instance<Op, Config>::run(const GroupedGemmArgs& args, cudaStream_t stream, int* cutlass_status) {
  using K = detail::Kernel<Op, Config>;
  if (cutlass_status) *cutlass_status = 0;
  if (args.groups <= 0 || args.n <= 0 || args.k <= 0 || args.n % detail::kAlign || args.k % detail::kAlign)
    return cudaErrorInvalidValue;
  if (args.sm_count < 0 || args.sm_count % 2) return cudaErrorInvalidValue;  // 2-CTA clusters
  if (args.segs != nullptr && (Op == kWgrad || args.weights <= 0)) return cudaErrorInvalidValue;
  if (args.ready != nullptr && (args.segs == nullptr || args.error_record == nullptr || args.poison == nullptr))
    return cudaErrorInvalidValue;
  if (Op == kFwdInterleaved && (args.ready == nullptr || args.comm.f.segs == nullptr || args.comm.x == nullptr ||
                                args.comm.tokens_per_item <= 0 || args.comm.rows_per_item <= 0))
    return cudaErrorInvalidValue;
  if (args.raster_n < 0 || args.raster_n > 1 || !(args.swizzle == 1 || args.swizzle == 2 || args.swizzle == 4 ||
                                                  args.swizzle == 8))
    return cudaErrorInvalidValue;
  detail::State<K>* st = nullptr;
  cudaError_t err = detail::state_for<K>(args, stream, &st, cutlass_status);
  if (err != cudaSuccess) return err;

  // Packed strides from representative shapes (M and N or K) of this op; see prepare_groups.
  const int n = args.n, k = args.k;
  typename K::StrideA sa;
  typename K::StrideB sb;
  typename K::StrideD sd;
  if (Op == kFwd || Op == kFwdInterleaved) {  // A x (M, K=k), B w[g] (N=n, K=k), D (M, n)
    sa = detail::packed_stride(typename K::StrideA{}, 1, k);
    sb = detail::packed_stride(typename K::StrideB{}, n, k);
    sd = detail::packed_stride(typename K::StrideD{}, 1, n);
  } else if (Op == kDgrad) {  // A dy (M, K=n), B w[g] (N=k, K=n), D (M, k)
    sa = detail::packed_stride(typename K::StrideA{}, 1, n);
    sb = detail::packed_stride(typename K::StrideB{}, k, n);
    sd = detail::packed_stride(typename K::StrideD{}, 1, k);
  } else {  // A dy^T (M=n, K=rows), B x (N=k, K=rows), D dw[g] (n, k)
    sa = detail::packed_stride(typename K::StrideA{}, n, 1);
    sb = detail::packed_stride(typename K::StrideB{}, k, 1);
    sd = detail::packed_stride(typename K::StrideD{}, n, k);
  }
  const int threads = 128;
  detail::prepare_groups<Op, K><<<(args.groups + threads - 1) / threads, threads, 0, stream>>>(args, st->arr, sa, sb,
                                                                                             sd);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (Op == kWgrad) {
    const int64_t vec = static_cast<int64_t>(n) * k / 8;
    detail::zero_empty_groups<<<dim3(16, args.groups), 256, 0, stream>>>(args.offs, static_cast<uint4*>(args.d), vec);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const cutlass::Status status = st->gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    if (cutlass_status) *cutlass_status = static_cast<int>(status);
    const cudaError_t last = cudaGetLastError();
    return last != cudaSuccess ? last : cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace gemm
}  // namespace uniep
