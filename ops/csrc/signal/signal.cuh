// Signal family: an entry barrier over the EP group, for ops that store into peers'
// buffers without a preceding exchange (the backward ops). Host launcher; no torch.
#pragma once

#include <cuda_runtime.h>

#include "../types.h"

namespace uniep {

// Every rank raises kPhaseBarrier = epoch on every rank, then waits for all of them.
// Stream order makes it cover all earlier work of this rank on the stream.
cudaError_t launch_barrier(const SymView& sym, uint32_t epoch, const WaitPolicy& wait, cudaStream_t stream);

// Raises `phase` = epoch on every rank after this stream's earlier work (copy-engine copies
// included: they finish before the kernel starts); waits for nothing.
cudaError_t launch_raise(const SymView& sym, int phase, uint32_t epoch, cudaStream_t stream);

// Waits until words[i] reaches `epoch` for every bit i of `mask` (i < 32), one thread per word;
// a wait past the policy's timeout sets `poison` and fills the record (phase, word index, rank).
cudaError_t launch_wait_words(const uint32_t* words, uint32_t mask, uint32_t epoch, const WaitPolicy& wait,
                              uint32_t* poison, int rank, int phase, cudaStream_t stream);

}  // namespace uniep
