// Grouped GEMM instance: wgrad, configuration kCoop256x128 (see grouped_gemm.cuh).
#include "grouped_gemm_impl.cuh"

template struct uniep::gemm::Instance<uniep::gemm::kWgrad, uniep::gemm::kCoop256x128>;
