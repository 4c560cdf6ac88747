"""The fused schedule's epilogue combines (megakernel backend): the second expert GEMM's forward
and the first expert GEMM's dgrad store their rows straight into the sources' combine buffers.

Under the sequential schedule the second expert GEMM writes the expert outputs on the expert's
rank and combine then moves every row back to its source. Here that GEMM runs over the (local
expert, source) runs of rows (``fused_segments`` with 1-row alignment: one run per pair, this
rank's own rows first) and its epilogue stores each run straight into its source's combine
buffer (``ds_uniep.gemm.grouped_mm_segments`` with ``out_ptrs``; peers' symmetric memory), so
the rows cross NVLink while the GEMM computes the next tiles. A source keeps its pairs in expert
order, as the pipelined schedule's copies leave them (``ds_uniep.pipelined``): its pairs of
expert e from row ``prefix_s(e)`` on (its pairs of every lower expert before), in the layout's
token order. Once its GEMM is done every rank raises the combine signal, and each source sums its
tokens' k rows in slot order in fp32 (``combine_mirror``): the sequential combine's bits, since a
row's GEMM result does not depend on the run it is computed in.

Backward. The expert outputs now live only in the sources' combine buffers, so each source forms
its gate gradients ``<grad_out[t], y row of (t, j)>`` from those rows, in the sum the expert side
uses under the sequential schedule (the same bits); ``grad_out``'s rows travel to the experts
unweighted with the gates, as there, and the experts form ``grad_y = gate * row``; then the dgrad
and wgrad GEMMs. The rows have to survive in the combine buffer until that backward: before any
later op of a layer sharing the buffers lets peers store there (a counts exchange or a barrier),
they are copied out for a backward still to come (``BufferSet.keep_landed``: another layer's
forward, two forwards before a backward, or a graph kept). One backward per forward: a second one through the same
graph (``retain_graph``) after the rows were overwritten raises.

The dispatch's backward is a combine without weights of the first expert GEMM's dgrad rows, so
:class:`DgradCombine` runs that dgrad over the same runs with the same output addresses and each
source sums its tokens' k rows unweighted, in slot order: the sequential dispatch backward's bits.
"""

import weakref
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

_PHASE_DISPATCH, _PHASE_COMBINE = 1, 2


class _Landed:
    """The rows one epilogue combine left in this rank's combine buffer (its ``pairs`` first rows),
    and, once the dispatcher had to reuse the buffer before the backward, a copy of them."""

    def __init__(self, pairs: int, dispatcher):
        self.pairs, self.dispatcher = pairs, dispatcher
        self.rows: Optional[Tensor] = None
        self.read = False  # a backward formed the gate gradients from them

    def keep(self) -> None:
        if self.rows is None and not self.read:
            self.rows = self.dispatcher.comb_rows(self.pairs).clone()


def landing_tables(dispatcher, counts_all: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(segs [G*L, 4] int32, out_ptrs [G*L] int64, mirror_off [E] int32)`` on the device, from
    every rank's counts per expert (``[G, E]``): the second GEMM's runs of rows (first row, rows,
    local expert, source), the address in the source's combine buffer where each run goes, and
    where this rank, as a source, finds its pairs (row ``dest_row[t, j] + mirror_off[e]``)."""
    from .pipelined import source_layout
    d = dispatcher
    G, E = counts_all.shape
    L, rank = E // G, d.rank
    segs = d.ext.fused_segments(counts_all, rank, 1)
    prefix, mirror_off = source_layout(counts_all, rank)
    src, local = segs[:, 3].long(), segs[:, 2].long()
    out_ptrs = d.comb_bases_device()[src] + prefix[src, rank * L + local] * d.bufs.comb_row_bytes
    return segs, out_ptrs, mirror_off


def segment_config(configs: Optional[Mapping[str, str]], op: str = "fwd",
                   auto: Optional[Callable[[], str]] = None) -> str:
    """The tile configuration of a GEMM over runs (``op``: "fwd" or "dgrad"): the tile of
    ``configs[op]`` when explicit, else of the plain op's default (``ds_uniep.gemm.DEFAULT_CONFIGS``),
    else of ``auto()`` (the plain op's automatic choice for these operands), else ``coop128x256``;
    the scheduler's default tile order (band 1: a run's tiles are its own)."""
    from .gemm import DEFAULT_CONFIGS
    for config in ((configs or {}).get(op), DEFAULT_CONFIGS[op], auto):
        if callable(config):  # the automatic choice only when no explicit one is there
            config = config()
        if config and config != "auto":
            return config.partition(":")[0]
    return "coop128x256"


class _GemmCombineFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, a, w, gates, offs, dispatcher, handle, configs):
        from .gemm import grouped_mm_segments
        d = dispatcher
        d._join_fused()
        d.check()
        idx = handle.expert_idx
        segs, out_ptrs, mirror_off = landing_tables(d, handle.counts_all)
        e = d._next_epoch(_PHASE_COMBINE)
        grouped_mm_segments(a, w, segs, segment_config(configs), out_ptrs=out_ptrs)
        # After this rank's GEMM (stream order), its rows are in every source's buffer.
        d.ext.signal_raise(d.bufs.descriptor, _PHASE_COMBINE, e, d.device.index)
        out = a.new_empty(idx.shape[0], d.hidden_size)
        d.ext.combine_mirror(idx, handle.dest_row, mirror_off, gates, d.num_experts, out, d.bufs.descriptor, e,
                             *d._wait_args(), d.num_blocks)
        d.combine_stats["landed"] += 1
        ctx.landed = None
        if any(ctx.needs_input_grad[:3]):
            ctx.landed = _Landed(idx.numel(), d)
            d._set.landed = weakref.ref(ctx.landed)
        ctx.dispatcher, ctx.configs = d, configs
        ctx.save_for_backward(a, w, gates, offs, mirror_off, idx, handle.dest_row, handle.num_recv)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .gemm import grouped_mm
        a, w, gates, offs, mirror_off, idx, dest_row, num_recv = ctx.saved_tensors
        d, landed = ctx.dispatcher, ctx.landed
        if landed.read and landed.rows is None:
            raise RuntimeError(f"{d.layer_name}: a second backward through the fused schedule's combine: its expert "
                               "outputs were only in the combine buffers, which later ops reuse (retain_graph is "
                               "not supported here; use the sequential schedule)")
        d.check()
        grad_out = grad_out.to(a.dtype).contiguous()
        T, k = idx.shape
        # Gate gradients here, from the rows in this rank's buffer (or their copy), on a side stream
        # beside the rest of this backward (which stores into peers' receive buffers, never into a
        # combine buffer); joined before returning, so before the next op's barrier lets peers
        # store into this rank's combine buffer again.
        grad_gates = torch.empty(T, k, dtype=torch.float32, device=a.device)
        compute, side = torch.cuda.current_stream(a.device), d._fused_side_stream()
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            d.ext.gate_grad_mirror(idx, dest_row, mirror_off, grad_out, landed.rows, d.num_experts, grad_gates,
                                   d.bufs.descriptor, min(d.num_blocks, max(1, -(-T // 16))))
        for t in (idx, dest_row, mirror_off, grad_out, grad_gates) + ((landed.rows, ) if landed.rows is not None
                                                                       else ()):
            t.record_stream(side)
        landed.read = True
        if d._set.landed is not None and d._set.landed() is landed:
            d._set.landed = None
        # grad_y = gate * grad_out row, on the experts' ranks (the sequential backward's bits).
        d._barrier()
        d.bufs.gates[:gates.numel()].copy_(gates.reshape(-1))
        e_disp = d._next_epoch(_PHASE_DISPATCH)
        d.ext.dispatch_rows(grad_out, idx, dest_row, None, False, d.num_experts, d.bufs.descriptor,
                            d.direct_descriptor(False, 0), e_disp, d.num_blocks, d.dedup, False)
        grad_y = a.new_empty(a.shape[0], d.hidden_size)
        d.ext.combine_bwd_rows(None, num_recv, grad_y, d.bufs.descriptor, e_disp, 0, *d._wait_args(), d.num_blocks,
                               d.dedup, 0, False)
        configs = ctx.configs
        da = grouped_mm(grad_y, w, offs, "dgrad", configs["dgrad"]) if ctx.needs_input_grad[0] else None
        dw = grouped_mm(grad_y, a, offs, "wgrad", configs["wgrad"]) if ctx.needs_input_grad[1] else None
        compute.wait_stream(side)
        return da, dw, grad_gates, None, None, None, None


def gemm_combine(dispatcher, a: Tensor, w: Tensor, offs: Tensor, gates: Tensor, handle,
                 configs: Optional[Mapping[str, str]] = None) -> Tensor:
    """``combine(a @ w[l]^T per local expert l, gates)`` with the GEMM's epilogue storing into the
    sources' combine buffers (see the module doc): ``a [R, K]`` bf16 (the received rows' last
    activation, layout order), ``w [L, M, K]`` bf16, ``offs [L]`` int32 row ends, ``gates [T, k]``,
    ``handle``: the dispatch's :class:`ds_uniep.megakernel.NVLinkHandle`. ``configs``: ds_uniep's
    GEMM configuration per op (as :func:`ds_uniep.gemm.grouped_linear`). Returns ``[T, M]``, the
    bits of ``dispatcher.combine(grouped_linear(a, w, offs, configs), gates, handle)``."""
    from .gemm import DEFAULT_CONFIGS
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"{dispatcher.layer_name}: the epilogue combine takes bf16 rows and weights, got {a.dtype} "
                        f"and {w.dtype}")
    if a.dim() != 2 or w.dim() != 3 or w.shape[2] != a.shape[1] or w.shape[1] != dispatcher.hidden_size:
        raise ValueError(f"{dispatcher.layer_name}: the epilogue combine needs a [R, K] and w [L, "
                         f"{dispatcher.hidden_size}, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    merged: Dict[str, str] = dict(DEFAULT_CONFIGS)
    merged.update(configs or {})
    return _GemmCombineFn.apply(a.contiguous(), w.contiguous(), gates.float().contiguous(), offs.to(torch.int32),
                                dispatcher, handle, merged)


class DgradCombine:
    """The backward of the fused schedule's dispatch and first expert GEMM in one step: the first
    GEMM's dgrad runs over the (local expert, source) runs of rows and its epilogue stores each run
    of input-gradient rows straight into its source's combine buffer (the layout of the forward's
    epilogue combine); each source then sums its tokens' k rows in slot order in fp32, unweighted,
    cast once: the sequential dispatch backward's bits (a row's dgrad does not depend on its run).
    Given to ``ds_uniep.gemm.grouped_linear`` as ``into`` (the dispatched rows go in detached, so
    the dispatch's own backward never runs; the gradient goes to ``source``, the tokens the
    dispatch read). :meth:`start` launches the stores and raises the combine signal; the wgrad GEMM
    runs before :meth:`finish` waits for every rank's rows, so a late peer hides behind it."""

    def __init__(self, dispatcher, handle, source: Tensor):
        self.dispatcher, self.handle, self.source = dispatcher, handle, source
        self._pending = None

    def start(self, grad: Tensor, w: Tensor, offs: Tensor, configs: Mapping[str, str]) -> None:
        from .gemm import _choose, grouped_mm_segments
        d = self.dispatcher
        d.check()
        segs, out_ptrs, mirror_off = landing_tables(d, self.handle.counts_all)
        config = segment_config(configs, "dgrad", lambda: _choose(grad, w, offs, "dgrad", 0))
        # Every peer has read what the previous op left in its combine buffer (and a forward's
        # landed rows a backward still needs are copied out) before anyone stores there.
        d._barrier()
        e = d._next_epoch(_PHASE_COMBINE)
        grouped_mm_segments(grad, w, segs, config, out_ptrs=out_ptrs, op="dgrad")
        d.ext.signal_raise(d.bufs.descriptor, _PHASE_COMBINE, e, d.device.index)
        self._pending = (e, mirror_off)

    def finish(self) -> Tensor:
        d, h = self.dispatcher, self.handle
        e, mirror_off = self._pending
        self._pending = None
        out = self.source.new_empty(h.expert_idx.shape[0], d.hidden_size)
        d.ext.combine_mirror(h.expert_idx, h.dest_row, mirror_off, None, d.num_experts, out, d.bufs.descriptor, e,
                             *d._wait_args(), d.num_blocks)
        d.combine_stats["landed_dgrad"] += 1
        return out
