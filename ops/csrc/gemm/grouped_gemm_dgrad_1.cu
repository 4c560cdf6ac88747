// Grouped GEMM instance: dgrad, configuration kCoop256x128 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kDgrad, uniep::gemm::kCoop256x128>;
