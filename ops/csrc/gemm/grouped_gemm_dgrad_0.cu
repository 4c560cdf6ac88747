// Grouped GEMM instance: dgrad, configuration kCoop128x256 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kDgrad, uniep::gemm::kCoop128x256>;
