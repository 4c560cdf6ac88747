"""Step 1 of HybridEP (:mod:`.runtime`): the domain's copies of this rank's expert parameters, in flight.

:class:`DomainGather` all-gathers them dense; :class:`CompressedGather` moves each owner's experts
as the domain's shared base plus top-k residuals (:mod:`.compress`).
"""

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import Tensor

from ..commfuse.common import side_stream
from .pacing import InterSitePacing


def _all_gather_flat(out: Tensor, flat: Tensor, group):
    """Asynchronous all-gather of ``flat`` into ``out`` (``[S * n]``, rank-major)."""
    fn = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
    return fn(out, flat, group=group, async_op=True)


class DomainGather:
    """The domain's copies of this rank's expert parameters, in flight (issued on construction).

    The parameters are laid end to end, one buffer per dtype, and all-gathered asynchronously over
    the domain group: one collective per dtype instead of one per tensor, and the layer computes
    while it runs. With ``pacing`` its inter-site bytes are a background transfer (one copy of every
    tensor to and from every peer). After :meth:`wait`, ``outs`` hold the ``[S, n]`` copies per
    dtype; :class:`.runtime._ReplicaViews` hands out views of them, no copy."""

    def __init__(self, local: Sequence[Tensor], group, S: int, pacing: Optional[InterSitePacing]):
        self.local, self.group, self.S, self.pacing = list(local), group, S, pacing
        self.buckets = _buckets(self.local)
        self.outs, self.works = [], []
        nbytes = 0
        for idx in self.buckets:
            flat = torch.cat([self.local[i].detach().reshape(-1) for i in idx])
            out = flat.new_empty(S, flat.numel())
            self.works.append(_all_gather_flat(out.view(-1), flat, group))
            self.outs.append(out)
            nbytes += flat.numel() * flat.element_size()
        self.device = self.local[0].device
        self.wire_bytes = (S - 1) * nbytes  # this rank's tensors, to each of S - 1 peers
        self.transfer = pacing.start(group, [nbytes] * S, [nbytes] * S, self.device) if pacing is not None \
            else None
        self._done = False

    def wait(self) -> None:
        """Until the gathered buffers (``outs``, ``[S, n]`` per dtype) hold the domain's copies."""
        if self._done:
            return
        for w in self.works:
            w.wait()
        if self.pacing is not None:
            self.pacing.finish(self.transfer, self.device)
        self._done = True


class CompressedGather:
    """Compressed migration in flight: what :class:`DomainGather` delivers, with each other owner's
    tensors as the domain's shared base plus that owner's top-``ratio`` residual positions
    (:mod:`.compress`), and only those bytes on the links.

    Issued on construction: the fp32 sum of this rank's experts, per parameter (local experts in
    order), all-reduced over the domain group asynchronously; the base is that sum over the S * L
    experts divided by S * L, cast to the parameter's dtype, the same bits on every rank. Then
    (:meth:`_exchange`) each of this rank's tensors is encoded against its parameter's base (the
    values at the kept positions, in the tensor's dtype, and their int32 indices), those are
    all-gathered (one collective per dtype and one for the indices), and every other owner's
    tensors are decoded into ``outs`` (``[S, n]`` per dtype, as :class:`DomainGather`'s); this
    rank's own copies are its exact tensors. On a GPU all of that is queued at construction on a
    side stream that waits for the base all-reduce (the encoding synchronises nothing with the
    host), so it runs beside the router and the token dispatch; :meth:`wait` makes the current
    stream wait for it. On the CPU it runs in :meth:`wait`. ``ratio`` 1 keeps every position: the
    replicas are then the dense ones, bit for bit. Gradients go back to the owners as with the
    dense gather (straight through the compression, dense bytes). ``wire_bytes``: what one rank
    puts on the links for it (the base all-reduce counted as a ring's ``2 (S - 1) / S`` of the fp32
    sums, then the encoded tensors to each of S - 1 peers); with ``pacing`` the whole ring counts on
    the slow link where the domain spans sites."""

    def __init__(self, local: Sequence[Tensor], group, S: int, pacing: Optional[InterSitePacing],
                 num_params: int, offset: int, ratio: float):
        from .compress import num_kept
        self.local, self.group, self.S, self.pacing = list(local), group, S, pacing
        self.num_params, self.offset, self.ratio = num_params, offset, ratio
        self.buckets = _buckets(self.local)
        self.device = self.local[0].device
        self.local_experts = len(self.local) // num_params  # L
        sums = []
        for i in range(num_params):
            acc = self.local[i].detach().to(torch.float32).clone()
            for l in range(1, self.local_experts):
                acc += self.local[l * num_params + i].detach().to(torch.float32)
            sums.append(acc.reshape(-1))
        self.base_sum = torch.cat(sums)
        self.base_work = torch_dist.all_reduce(self.base_sum, group=group, async_op=True)
        self.outs = [torch.empty(S, sum(self.local[i].numel() for i in idx), dtype=self.local[idx[0]].dtype,
                                 device=self.device) for idx in self.buckets]
        self.kept = [num_kept(t.numel(), ratio) for t in self.local]
        encoded = sum(k * (t.element_size() + 4) for k, t in zip(self.kept, self.local))
        ring = 2 * (S - 1) * self.base_sum.numel() * 4 // S  # what a ring all-reduce moves per rank
        self.wire_bytes = (S - 1) * encoded + ring
        self.transfer = None
        if pacing is not None:
            # Every step of a ring waits for its slowest hop: where the domain spans sites, the whole
            # ring crosses the slow link (as the cost model charges it), spread over the remote peers.
            per_peer = [encoded] * S
            far = [i for i, f in enumerate(pacing.remote(group)) if f]
            for j, i in enumerate(far):
                per_peer[i] += ring // len(far) + (j < ring % len(far))
            self.transfer = pacing.start(group, per_peer, per_peer, self.device)
        self._done = False
        self._stream = self._event = None
        if self.device.type == "cuda":
            compute = torch.cuda.current_stream(self.device)
            self._stream = side_stream(self.device, compute, "migration")
            self._stream.wait_stream(compute)  # the experts' weights and the sums as they are now
            with torch.cuda.stream(self._stream):
                self._exchange()
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
            for out in self.outs:  # made on the compute stream, written on the side one
                out.record_stream(self._stream)

    def _exchange(self) -> None:
        """Encode this rank's tensors against the base, all-gather them, decode the others' into ``outs``."""
        from .compress import decode_rows, encode
        self.base_work.wait()
        P, S, n_exp = self.num_params, self.S, self.local_experts * self.S
        bases, off = [], 0
        for i in range(P):
            t = self.local[i]
            bases.append((self.base_sum[off:off + t.numel()] / n_exp).to(t.dtype).view(t.shape))
            off += t.numel()
        self.bases = bases  # per parameter of an expert, the domain's shared base
        encs = [encode(t.detach(), bases[j % P], self.ratio) for j, t in enumerate(self.local)]
        indices = torch.cat([e.indices for e in encs])
        all_indices = indices.new_empty(S, indices.numel())
        works = [_all_gather_flat(all_indices.view(-1), indices, self.group)]
        all_values = []
        for idx in self.buckets:
            values = torch.cat([encs[i].values for i in idx])
            all_values.append(values.new_empty(S, values.numel()))
            works.append(_all_gather_flat(all_values[-1].view(-1), values, self.group))
        for w in works:
            w.wait()
        starts, at = [], 0  # where tensor i's indices start in a rank's row of all_indices
        for k in self.kept:
            starts.append(at)
            at += k
        for idx, out, vals in zip(self.buckets, self.outs, all_values):
            # Every owner's row at once: the bucket's tensors side by side are one flat row per owner,
            # each tensor's kept positions offset by its column (the columns do not overlap), so one
            # decode_rows places them all; this rank's row is then its exact tensors.
            cols, col = [], 0
            for i in idx:
                cols.append(col)
                col += self.local[i].numel()
            pos = torch.cat([all_indices[:, starts[i]:starts[i] + self.kept[i]].long() + c
                             for i, c in zip(idx, cols)], dim=1)
            decode_rows(out, torch.cat([bases[i % P].reshape(-1) for i in idx]), pos, vals)
            out[self.offset] = torch.cat([self.local[i].detach().reshape(-1) for i in idx])

    def wait(self) -> None:
        """Until ``outs`` hold the domain's copies (this rank's exact, the others' decoded)."""
        if self._done:
            return
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        else:
            self._exchange()
        if self.pacing is not None:
            self.pacing.finish(self.transfer, self.device)
        self._done = True


def _buckets(tensors: Sequence[Tensor]) -> List[List[int]]:
    """Indices of ``tensors`` grouped by dtype, in first-seen order (one flat buffer each)."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return list(by_dtype.values())
