// Grouped GEMM instance: fwd with the interleaved dispatch, configuration kCoop256x128 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kFwdInterleaved, uniep::gemm::kCoop256x128>;
