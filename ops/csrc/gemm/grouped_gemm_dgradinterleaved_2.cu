// Grouped GEMM instance: dgrad with the interleaved dispatch (the backward's takes), configuration kPingpong128x128 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kDgradInterleaved, uniep::gemm::kPingpong128x128>;
