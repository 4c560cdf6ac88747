// Dispatch of grouped_gemm() over (op, config) to the instances built in their own files.
#include "grouped_gemm.cuh"

namespace uniep {
namespace gemm {

namespace {

template <int Op>
cudaError_t run_of(int config, const GroupedGemmArgs& args, cudaStream_t stream, int* status) {
  switch (config) {
    case kCoop128x256: return Instance<Op, kCoop128x256>::run(args, stream, status);
    case kCoop256x128: return Instance<Op, kCoop256x128>::run(args, stream, status);
    case kPingpong128x128: return Instance<Op, kPingpong128x128>::run(args, stream, status);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t grouped_gemm(int op, int config, const GroupedGemmArgs& args, cudaStream_t stream, int* status) {
  switch (op) {
    case kFwd: return run_of<kFwd>(config, args, stream, status);
    case kDgrad: return run_of<kDgrad>(config, args, stream, status);
    case kWgrad: return run_of<kWgrad>(config, args, stream, status);
    case kFwdInterleaved: return run_of<kFwdInterleaved>(config, args, stream, status);
    default: return cudaErrorInvalidValue;
  }
}

const char* config_name(int config) {
  switch (config) {
    case kCoop128x256: return "coop128x256";
    case kCoop256x128: return "coop256x128";
    case kPingpong128x128: return "pingpong128x128";
    default: return "unknown";
  }
}

}  // namespace gemm
}  // namespace uniep
