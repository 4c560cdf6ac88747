// Grouped GEMM instance: fwd, configuration kPingpong128x128 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kFwd, uniep::gemm::kPingpong128x128>;
