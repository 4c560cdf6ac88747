// Dispatch of grouped_gemm() over (op, config) to the instances built in their own files.
#include "grouped_gemm.cuh"

namespace uniep {
namespace gemm {

namespace {

template <int Op>
size_t workspace_of(int config, int groups, int sm_count, int device) {
  switch (config) {
    case kCoop128x256: return Instance<Op, kCoop128x256>::workspace(groups, sm_count, device);
    case kCoop256x128: return Instance<Op, kCoop256x128>::workspace(groups, sm_count, device);
    case kPingpong128x128: return Instance<Op, kPingpong128x128>::workspace(groups, sm_count, device);
    default: return 0;
  }
}

template <int Op>
cudaError_t run_of(int config, const GroupedGemmArgs& args, void* ws, size_t bytes, cudaStream_t stream, int* detail) {
  switch (config) {
    case kCoop128x256: return Instance<Op, kCoop128x256>::run(args, ws, bytes, stream, detail);
    case kCoop256x128: return Instance<Op, kCoop256x128>::run(args, ws, bytes, stream, detail);
    case kPingpong128x128: return Instance<Op, kPingpong128x128>::run(args, ws, bytes, stream, detail);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

size_t grouped_gemm_workspace(int op, int config, int groups, int sm_count, int device) {
  switch (op) {
    case kFwd: return workspace_of<kFwd>(config, groups, sm_count, device);
    case kDgrad: return workspace_of<kDgrad>(config, groups, sm_count, device);
    case kWgrad: return workspace_of<kWgrad>(config, groups, sm_count, device);
    default: return 0;
  }
}

cudaError_t grouped_gemm(int op, int config, const GroupedGemmArgs& args, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream, int* detail) {
  switch (op) {
    case kFwd: return run_of<kFwd>(config, args, workspace, workspace_bytes, stream, detail);
    case kDgrad: return run_of<kDgrad>(config, args, workspace, workspace_bytes, stream, detail);
    case kWgrad: return run_of<kWgrad>(config, args, workspace, workspace_bytes, stream, detail);
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
