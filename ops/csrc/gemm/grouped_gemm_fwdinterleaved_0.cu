// Grouped GEMM instance: fwd with the interleaved dispatch, configuration kCoop128x256 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kFwdInterleaved, uniep::gemm::kCoop128x256>;
