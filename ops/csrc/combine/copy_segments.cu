// Combine family, SM copies: segments copied by SM stores (launch_copy_segments_sm), the
// pipelined schedule's alternative to the copy engines.
#include "../common.cuh"
#include "combine.cuh"

namespace uniep {
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
