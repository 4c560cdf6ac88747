// Grouped GEMM family: tensor checks, output allocation, device guard and stream.
#include <cstring>

#include "../adapters.h"
#include "../host_utils.h"
#include "grouped_gemm.cuh"

namespace uniep {
namespace {

// What every grouped GEMM call checks: bf16 operands and an int32 index tensor (offs or segs),
// all contiguous on one CUDA device, and a known configuration and tile order.
void check_call(const char* what, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& index,
                int64_t config, int64_t raster_n, int64_t swizzle) {
  UNIEP_CHECK_INPUT(a);
  UNIEP_CHECK_INPUT(b);
  UNIEP_CHECK_INPUT(index);
  UNIEP_CHECK_DTYPE(a, torch::kBFloat16);
  UNIEP_CHECK_DTYPE(b, torch::kBFloat16);
  UNIEP_CHECK_DTYPE(index, torch::kInt32);
  TORCH_CHECK(a.device() == b.device() && a.device() == index.device(), what, ": operands must be on one device");
  TORCH_CHECK(config >= 0 && config < gemm::kNumConfigs, what, ": config ", config, " outside 0..",
              gemm::kNumConfigs - 1);
  TORCH_CHECK(raster_n == 0 || raster_n == 1, what, ": raster_n must be 0 (along M) or 1 (along N), got ", raster_n);
  TORCH_CHECK(swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8, what,
              ": swizzle must be 1, 2, 4 or 8, got ", swizzle);
}

}  // namespace

torch::Tensor grouped_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs, int64_t op,
                         int64_t config, int64_t sm_count, int64_t raster_n, int64_t swizzle) {
  check_call("grouped_mm", a, b, offs, config, raster_n, swizzle);
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) >= 1, "offs must be [G] int32 row ends, got ", offs.sizes());
  TORCH_CHECK(a.dim() == 2, "a must be [R, *], got ", a.sizes());
  const int64_t groups = offs.size(0);
  int64_t n = 0, k = 0;
  torch::Tensor out;
  if (op == gemm::kFwd || op == gemm::kDgrad) {
    TORCH_CHECK(b.dim() == 3 && b.size(0) == groups, "w must be [G, N, K] with G = ", groups, ", got ", b.sizes());
    n = b.size(1);
    k = b.size(2);
    const int64_t a_cols = op == gemm::kFwd ? k : n;
    TORCH_CHECK(a.size(1) == a_cols, op == gemm::kFwd ? "x" : "dy", " must have ", a_cols, " columns, got ",
                a.sizes());
    out = torch::empty({a.size(0), op == gemm::kFwd ? n : k}, a.options());
  } else if (op == gemm::kWgrad) {
    TORCH_CHECK(b.dim() == 2 && b.size(0) == a.size(0), "x must be [R, K] with the R of dy (", a.size(0), "), got ",
                b.sizes());
    n = a.size(1);
    k = b.size(1);
    out = torch::empty({groups, n, k}, a.options());
  } else {
    TORCH_CHECK(false, "grouped_mm: op ", op, " is not 0 (fwd), 1 (dgrad) or 2 (wgrad)");
  }
  TORCH_CHECK(n % 8 == 0 && k % 8 == 0, "grouped_mm needs N and K multiples of 8 (16-byte rows), got N=", n,
              " K=", k);
  TORCH_CHECK(n <= INT32_MAX && k <= INT32_MAX && a.size(0) <= INT32_MAX && groups <= INT32_MAX,
              "grouped_mm: sizes must fit int32");
  if (a.size(0) == 0) {
    if (op == gemm::kWgrad) out.zero_();
    return out;
  }
  const c10::cuda::CUDAGuard guard(a.device());
  gemm::GroupedGemmArgs args;
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.d = out.data_ptr();
  args.offs = offs.data_ptr<int32_t>();
  args.groups = static_cast<int>(groups);
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  args.sm_count = static_cast<int>(sm_count);
  args.device = a.get_device();
  args.raster_n = static_cast<int>(raster_n);
  args.swizzle = static_cast<int>(swizzle);
  int status = 0;
  const cudaError_t err = gemm::grouped_gemm(static_cast<int>(op), static_cast<int>(config), args,
                                             c10::cuda::getCurrentCUDAStream(), &status);
  TORCH_CHECK(err == cudaSuccess, "grouped_mm (op ", op, ", config ", gemm::config_name(static_cast<int>(config)),
              ", G=", groups, " N=", n, " K=", k, ") failed: ", cudaGetErrorString(err), " (CUTLASS status ",
              status, ")");
  return out;
}

void grouped_mm_segments(const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& segs, torch::Tensor& out,
                         int64_t config, int64_t sm_count, int64_t raster_n, int64_t swizzle,
                         const c10::optional<torch::Tensor>& ready, int64_t epoch, int64_t timeout_ns,
                         const c10::optional<torch::Tensor>& error_record, const c10::optional<torch::Tensor>& poison,
                         int64_t layer_id, int64_t rank, int64_t phase, const c10::optional<torch::Tensor>& a_alt,
                         int64_t alt_row0, const c10::optional<torch::Tensor>& seg_out, int64_t op,
                         const c10::optional<torch::Tensor>& comm_job) {
  check_call("grouped_mm_segments", a, w, segs, config, raster_n, swizzle);
  TORCH_CHECK(op == gemm::kFwd || op == gemm::kDgrad, "grouped_mm_segments: op ", op,
              " is not 0 (fwd) or 1 (dgrad)");
  const bool fwd = op == gemm::kFwd;
  // fwd: a = x [R, K], out [R, N]; dgrad: a = dy [R, N], out [R, K]; w [W, N, K] both ways.
  TORCH_CHECK(a.dim() == 2 && w.dim() == 3 && a.size(1) == w.size(fwd ? 2 : 1), "grouped_mm_segments: ",
              fwd ? "a must be [R, K] and w [W, N, K]" : "dy must be [R, N] and w [W, N, K]", ", got ", a.sizes(),
              " and ", w.sizes());
  const int64_t out_cols = w.size(fwd ? 1 : 2);
  TORCH_CHECK(segs.dim() == 2 && segs.size(1) == 4 && segs.size(0) >= 1,
              "segs must be [G, 4] int32 (first row, rows, weight, ready word), got ", segs.sizes());
  if (seg_out.has_value()) {  // every segment's rows go to its own address; out is not written
    UNIEP_CHECK_INPUT((*seg_out));
    UNIEP_CHECK_DTYPE((*seg_out), torch::kInt64);
    TORCH_CHECK(seg_out->device() == a.device(), "grouped_mm_segments: seg_out must be on a's device");
    TORCH_CHECK(seg_out->dim() == 1 && seg_out->size(0) == segs.size(0),
                "grouped_mm_segments: seg_out must be [G] int64 addresses, one per segment, got ", seg_out->sizes());
  } else {
    UNIEP_CHECK_INPUT(out);
    UNIEP_CHECK_DTYPE(out, torch::kBFloat16);
    TORCH_CHECK(out.device() == a.device(), "grouped_mm_segments: out must be on a's device");
    UNIEP_CHECK_SHAPE(out, a.size(0), out_cols);
  }
  TORCH_CHECK(w.size(1) % 8 == 0 && w.size(2) % 8 == 0, "grouped_mm_segments needs N and K multiples of 8");
  TORCH_CHECK(a.size(0) <= INT32_MAX && segs.size(0) <= INT32_MAX && w.size(0) <= INT32_MAX,
              "grouped_mm_segments: sizes must fit int32");
  gemm::GroupedGemmArgs args;
  if (ready.has_value()) {
    UNIEP_CHECK_INPUT((*ready));
    UNIEP_CHECK_DTYPE((*ready), torch::kInt32);
    TORCH_CHECK(ready->device() == a.device(), "ready must be on a's device");
    TORCH_CHECK(poison.has_value() && error_record.has_value(), "waits need poison and error_record");
    UNIEP_CHECK_DTYPE((*poison), torch::kInt32);
    TORCH_CHECK(poison->is_cuda() && poison->numel() >= 1, "poison must be a CUDA int32 word");
    const WaitPolicy wp = wait_from_args(timeout_ns, *error_record, layer_id);
    args.ready = reinterpret_cast<const uint32_t*>(ready->data_ptr<int32_t>());
    args.ready_epoch = static_cast<uint32_t>(epoch);
    args.timeout_ns = wp.timeout_ns;
    args.error_record = wp.error_record;
    args.poison = reinterpret_cast<uint32_t*>(poison->data_ptr<int32_t>());
    args.layer_id = wp.layer_id;
    args.rank = static_cast<int>(rank);
    args.phase = static_cast<int>(phase);
  }
  if (a_alt.has_value()) {
    UNIEP_CHECK_INPUT((*a_alt));
    UNIEP_CHECK_DTYPE((*a_alt), torch::kBFloat16);
    TORCH_CHECK(a_alt->device() == a.device(), "grouped_mm_segments: a_alt must be on a's device");
    TORCH_CHECK(a_alt->dim() == 2 && a_alt->size(1) == a.size(1), "grouped_mm_segments: a_alt must be [R', ",
                a.size(1), "], got ", a_alt->sizes());
    TORCH_CHECK(alt_row0 >= 0 && alt_row0 + a_alt->size(0) <= a.size(0),
                "grouped_mm_segments: a_alt's rows must stand for rows of a, got alt_row0 ", alt_row0, " and ",
                a_alt->size(0), " rows for ", a.size(0));
    if (a_alt->numel() > 0) args.a_alt = a_alt->data_ptr();
    args.alt_row0 = alt_row0;
  }
  int run_op = static_cast<int>(op);
  if (comm_job.has_value()) {
    TORCH_CHECK(fwd && ready.has_value(), "grouped_mm_segments: the interleaved dispatch runs beside a forward "
                "that waits for its rows (ready)");
    TORCH_CHECK(!comm_job->is_cuda() && comm_job->scalar_type() == torch::kUInt8 && comm_job->is_contiguous() &&
                    comm_job->numel() == static_cast<int64_t>(sizeof(InterleavedDispatch)),
                "grouped_mm_segments: comm_job must be interleaved_job's bytes");
    std::memcpy(&args.comm, comm_job->data_ptr(), sizeof(InterleavedDispatch));
    run_op = gemm::kFwdInterleaved;
  }
  // No rows here: nothing to compute, but an interleaved dispatch still has rows to send.
  TORCH_CHECK(a.size(0) > 0 || !comm_job.has_value(), "grouped_mm_segments: the interleaved dispatch needs rows "
              "to compute beside (run the dispatch alone when none were received)");
  if (a.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  args.a = a.data_ptr();
  args.b = w.data_ptr();
  args.d = seg_out.has_value() ? nullptr : out.data_ptr();
  args.seg_out = seg_out.has_value() ? seg_out->data_ptr<int64_t>() : nullptr;
  args.segs = segs.data_ptr<int32_t>();
  args.weights = static_cast<int>(w.size(0));
  args.groups = static_cast<int>(segs.size(0));
  args.n = static_cast<int>(w.size(1));
  args.k = static_cast<int>(w.size(2));
  args.sm_count = static_cast<int>(sm_count);
  args.device = a.get_device();
  args.raster_n = static_cast<int>(raster_n);
  args.swizzle = static_cast<int>(swizzle);
  int status = 0;
  const cudaError_t err = gemm::grouped_gemm(run_op, static_cast<int>(config), args,
                                             c10::cuda::getCurrentCUDAStream(), &status);
  TORCH_CHECK(err == cudaSuccess, "grouped_mm_segments (", fwd ? "fwd" : "dgrad", ", config ",
              gemm::config_name(static_cast<int>(config)), ", G=", segs.size(0), " N=", w.size(1), " K=", w.size(2),
              ") failed: ", cudaGetErrorString(err), " (CUTLASS status ", status, ")");
}

std::string grouped_mm_config_name(int64_t config) { return gemm::config_name(static_cast<int>(config)); }

}  // namespace uniep
