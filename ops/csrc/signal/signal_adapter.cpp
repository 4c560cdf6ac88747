// Signal family: device guard and stream for launch_barrier.
#include "../adapters.h"
#include "../host_utils.h"
#include "signal.cuh"

namespace uniep {

void barrier(const std::vector<int64_t>& sym, int64_t epoch, int64_t timeout_ns, const torch::Tensor& error_record,
             int64_t layer_id, int64_t device_index) {
  const SymView s = sym_from_descriptor(sym);
  const WaitPolicy w = wait_from_args(timeout_ns, error_record, layer_id);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  UNIEP_CHECK_LAUNCH(launch_barrier(s, static_cast<uint32_t>(epoch), w, c10::cuda::getCurrentCUDAStream()));
}

void signal_raise(const std::vector<int64_t>& sym, int64_t phase, int64_t epoch, int64_t device_index) {
  const SymView s = sym_from_descriptor(sym);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  UNIEP_CHECK_LAUNCH(launch_raise(s, static_cast<int>(phase), static_cast<uint32_t>(epoch),
                                  c10::cuda::getCurrentCUDAStream()));
}

}  // namespace uniep
