// Grouped GEMM instance: dgrad with the interleaved dispatch (the backward's takes), configuration kCoop128x256 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kDgradInterleaved, uniep::gemm::kCoop128x256>;
