// Grouped GEMM instance: fwd with the interleaved dispatch, configuration kPingpong128x128 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kFwdInterleaved, uniep::gemm::kPingpong128x128>;
