// The chunks of source tokens of the chunked combine (host and device; no torch).
#pragma once

#include <cuda_runtime.h>

namespace uniep {

// The chunks of source tokens the chunked combine pushes and reduces in order: `uniform` chunks of
// `tokens` tokens, except that with split > 0 the last of them is cut into split + 1 chunks of
// halves (tokens / 2, tokens / 4, ..., and two of tokens >> split), so that the sum left after the
// last rows arrive covers tokens >> split tokens instead of tokens. Every rank uses the same.
struct Chunking {
  int tokens;
  int uniform;
  int split;
  __host__ __device__ __forceinline__ int count() const { return uniform + split; }
  // First token of chunk c, for 0 <= c <= count().
  __host__ __device__ __forceinline__ int begin(int c) const {
    const int last = uniform - 1;
    if (c <= last) return c * tokens;
    if (c >= count()) return uniform * tokens;
    return last * tokens + tokens - (tokens >> (c - last));
  }
  // The chunk of source token t (t < uniform * tokens).
  __host__ __device__ __forceinline__ int of(int t) const {
    const int c = t / tokens;
    if (split == 0 || c < uniform - 1) return c;
    const int off = t - (uniform - 1) * tokens;
    int j = 0;
    while (j < split && off >= tokens - (tokens >> (j + 1))) ++j;
    return uniform - 1 + j;
  }
};

}  // namespace uniep
