// Python bindings of ds_uniep.ops: m.def only. Shapes and semantics are in adapters.h.
#include "adapters.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // layout: routing counts exchange and destination rows
  m.def("layout", &uniep::layout, "counts exchange + dest rows: (local_expert_counts, num_recv, counts_all, dest_row)");
  // dispatch: rows into the destinations' receive buffers, then copied out
  m.def("fused_segments", &uniep::fused_segments, "the fused schedule's runs of received rows: (source, expert) blocks, or whole tiles of align rows");
  m.def("dispatch_rows", &uniep::dispatch_rows, "store every kept row into its destination's receive buffer");
  m.def("dispatch_fused", &uniep::dispatch_fused,
        "the fused schedule's dispatch: rows one destination at a time, arrivals taken source by source");
  m.def("interleaved_job", &uniep::interleaved_job,
        "the fused dispatch's job for the waiting GEMM's spare warps (interleaved roles), as bytes");
  m.def("recv_copyout", &uniep::recv_copyout, "wait for all rows, copy them (and their source pairs) out");
  // combine: rows back to their sources, reduced in slot order
  m.def("combine_push", &uniep::combine_push, "store every received row back at its source pair");
  m.def("combine_partials_push", &uniep::combine_partials_push,
        "sum each source token's rows here in slot order and store one row at its first slot here");
  m.def("combine_reduce", &uniep::combine_reduce, "wait, then sum each token's k rows in slot order in fp32");
  m.def("combine_chunked", &uniep::combine_chunked,
        "push and reduce in one kernel, by chunks of source tokens (same bits as push then reduce)");
  m.def("combine_queue_size", &uniep::combine_queue_size, "int32 words of combine_chunked's queue workspace");
  m.def("combine_mirror", &uniep::combine_mirror,
        "wait, then sum each token's k rows in slot order, read where the copy-engine pushes left them");
  m.def("copy_segments", &uniep::copy_segments, "copy-engine copies of (source, destination, bytes) segments");
  m.def("copy_segments_sm", &uniep::copy_segments_sm, "SM-store copies of (source, destination, bytes) segments");
  m.def("gate_grad", &uniep::gate_grad, "wait, then grad_gates[t, j] = <grad_out[t], row of (t, j)>");
  m.def("gate_grad_mirror", &uniep::gate_grad_mirror,
        "grad_gates[t, j] = <grad_out[t], row of (t, j)>, rows in expert order (the fused schedule's)");
  m.def("combine_bwd_rows", &uniep::combine_bwd_rows,
        "backward of combine on the expert side: grad_y rows and each pair's gate gradient, sent to its source");
  m.def("gate_collect", &uniep::gate_collect, "wait, then grad_gates from the gates region (0 for dropped pairs)");
  // gemm: grouped GEMM of the experts (fwd, dgrad, wgrad), deterministic tiles
  m.def("grouped_mm", &uniep::grouped_mm, "grouped GEMM: op 0 fwd, 1 dgrad, 2 wgrad over groups of rows");
  m.def("grouped_mm_segments", &uniep::grouped_mm_segments,
        "grouped GEMM over row segments (op 0 fwd, 1 dgrad), each optionally waiting for its arrival word");
  m.def("grouped_mm_config_name", &uniep::grouped_mm_config_name, "name of a grouped GEMM tile configuration");
  // signal: entry barrier over the group
  m.def("barrier", &uniep::barrier, "signal every rank and wait for all of them");
  m.def("signal_raise", &uniep::signal_raise, "raise a phase signal on every rank, no wait");
  m.def("stream_wait_word", &uniep::stream_wait_word,
        "hold the current stream until a device word reaches a value (False: not offered by the driver)");
  m.def("stream_write_word", &uniep::stream_write_word,
        "write a device word (a peer's included) after the current stream's earlier work, no SM taken "
        "(False: not offered by the driver)");
  m.def("wait_words", &uniep::wait_words, "on the current stream, wait until the masked words reach an epoch");
}
