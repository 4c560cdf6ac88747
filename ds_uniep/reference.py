"""The reference backend: torch ops and ``all_to_all_single``; the sequential semantics.

Every kernel backend is checked against this one. Letters as in ``layout.py``:
T tokens, k slots, M hidden, E experts, G ranks, L local experts, R received rows.

Forward of one layer on a rank (the dispatcher protocol, shared by all backends):

1. ``dispatch(x [T, M], expert_idx [T, k])``: exchange every rank's expert counts,
   build the layout, send each kept (token, slot) row to its expert's rank and
   return ``recv [R, M]`` in expert-major layout order with ``[L]`` row counts.
2. The layer runs each local expert over its rows.
3. ``combine(y [R, M], gates [T, k], handle)``: return rows to their source and
   sum the k contributions of a token in slot order, in fp32, weighted by the
   gate, cast once to the activation dtype.

``pacing`` (off unless given; :class:`ds_uniep.hybrid.runtime.InterSitePacing`) is
called after each row all-to-all, forward and backward, with the bytes sent to and
received from every rank, to emulate slow links between sites; it changes no numbers.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from .faults import Deadline, stop_point
from .layout import Layout, build_layout, expert_counts


class _AllToAllV(torch.autograd.Function):
    """``all_to_all_single`` with explicit split sizes; its gradient is the reverse exchange. With a
    ``deadline`` (:class:`ds_uniep.faults.Deadline`) it waits at most its timeout; ``step`` names it
    in errors."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: List[int], in_splits: List[int], group, pacing=None, deadline=None,
                step: str = "exchange") -> Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.pacing = group, out_splits, in_splits, pacing
        ctx.deadline, ctx.step = deadline, step
        out = x.new_empty((sum(out_splits), ) + tuple(x.shape[1:]))
        if deadline is None:
            torch_dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        else:
            deadline.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group, step)
        if pacing is not None:
            row_bytes = math.prod(x.shape[1:]) * x.element_size()
            pacing.pace(group, [n * row_bytes for n in in_splits], [n * row_bytes for n in out_splits], x.device)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        stop_point("backward")  # fault-injection tests only (UNIEP_TEST_STOP_AT)
        step = ctx.step if ctx.step.startswith("backward") else f"backward of the {ctx.step}"
        back = _AllToAllV.apply(grad, ctx.in_splits, ctx.out_splits, ctx.group, ctx.pacing, ctx.deadline, step)
        return back, None, None, None, None, None, None


def all_to_all(x: Tensor, out_splits: List[int], in_splits: List[int], group, pacing=None, deadline=None,
               step: str = "exchange") -> Tensor:
    """Rows of ``x`` to the ranks of ``group`` (``in_splits`` rows each); ``out_splits`` rows come back.
    ``deadline``: a :class:`ds_uniep.faults.Deadline` bounding the wait (None: the group's timeout)."""
    if group is None or torch_dist.get_world_size(group) == 1:
        return x
    return _AllToAllV.apply(x, out_splits, in_splits, group, pacing, deadline, step)


def gather_counts(counts: Tensor, group, ep_size: int, deadline=None, step: str = "counts exchange") -> Tensor:
    """``[G, E]`` every rank's ``[E]`` counts; rank order is the group's. ``deadline`` as in :func:`all_to_all`."""
    if ep_size == 1:
        return counts.unsqueeze(0)
    parts = [torch.empty_like(counts) for _ in range(ep_size)]
    if deadline is None:
        torch_dist.all_gather(parts, counts.contiguous(), group=group)
    else:
        deadline.all_gather(parts, counts.contiguous(), group, step)
    return torch.stack(parts)


FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0


def fp8_roundtrip(x: Tensor) -> Tensor:
    """What FP8 e4m3 dispatch delivers: ``[N, M]`` rows quantised per 128 elements and restored.

    ``scale = max(amax(block), 1e-12) / 448`` in fp32, ``q = e4m3(x / scale)``, the receiver
    computes ``q * scale`` and casts to the activation dtype. Deterministic; not exact.
    """
    N, M = x.shape
    pad = (-M) % FP8_BLOCK
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(N, (M + pad) // FP8_BLOCK, FP8_BLOCK)
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_E4M3_MAX
    q = (xf / scale).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(N, M + pad)[:, :M].to(x.dtype)


class _FP8Dispatch(torch.autograd.Function):
    """FP8 on the wire forward; the gradient travels in full precision (straight through)."""

    @staticmethod
    def forward(ctx, x):
        return fp8_roundtrip(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherPairs(torch.autograd.Function):
    """``x [T, M] -> rows [N, M]``, row i a copy of token ``pairs[i] // k``.

    Its gradient adds each token's (up to k) row gradients in slot order in fp32,
    the combine's order, instead of ``index_select``'s backward, whose scatter-add
    on GPUs orders duplicate indices by arrival."""

    @staticmethod
    def forward(ctx, x: Tensor, pairs: Tensor, k: int, slot_rank: Optional[Tensor] = None) -> Tensor:
        ctx.save_for_backward(pairs, slot_rank)
        ctx.k, ctx.T = k, x.shape[0]
        return x.index_select(0, pairs // k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pairs, slot_rank = ctx.saved_tensors
        per_pair = grad.new_zeros(ctx.T * ctx.k, grad.shape[1]).index_copy(0, pairs, grad)
        per_pair = per_pair.view(ctx.T, ctx.k, grad.shape[1])
        if slot_rank is not None:
            return rank_partial_sum(per_pair, None, slot_rank, grad.dtype), None, None, None
        ones = grad.new_ones(ctx.T, ctx.k, dtype=torch.float32)
        return weighted_slot_sum(per_pair, ones, grad.dtype), None, None, None


class DispatchHandle:
    """What combine needs from dispatch: the layout, the split sizes and the capacity."""

    def __init__(self, layout: Layout, expert_idx: Tensor, capacity: Optional[int]):
        self.layout = layout
        self.expert_idx = expert_idx
        #: ``[N]`` expert of each sent row (send order); names the padded slot with capacity.
        self.send_expert = expert_idx.reshape(-1).long()[layout.send_pairs]
        self.capacity = capacity
        self.send_splits = layout.send_counts.tolist()
        self.recv_splits = layout.recv_counts.tolist()


def weighted_slot_sum(pair_rows: Tensor, gates: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out[t] = cast(sum_j gates[t, j] * float(pair_rows[t, j]))``, slots added in order 0..k-1.

    ``pair_rows``: ``[T, k, M]``; ``gates``: ``[T, k]`` fp32. The explicit loop fixes the
    order of the fp32 additions, which is what every backend reproduces bit for bit.
    """
    acc = pair_rows.new_zeros(pair_rows.shape[0], pair_rows.shape[2], dtype=torch.float32)
    for j in range(pair_rows.shape[1]):
        acc = acc + gates[:, j:j + 1].float() * pair_rows[:, j].float()
    return acc.to(out_dtype)


def warp_order_dot(a: Tensor, b: Tensor) -> Tensor:
    """fp32 ``<a, b>`` over the last dimension (``a`` broadcast against ``b``), summed in the
    megakernel's gate-gradient order: lane ``l`` of a warp adds the products of the 16-byte vectors
    ``l, l + 32, l + 64, ...`` element by element, then the 32 lanes' partials are added pairwise
    (lane ``l`` with ``l ^ 16``, ``^ 8``, ... ``^ 1``). So the gate gradients formed here are the
    kernels' bits, not torch's reduction's. Transient memory: one round's products (32 vectors) per dot product."""
    M = b.shape[-1]
    elems = 16 // b.element_size()
    rounds = -(-(M // elems) // 32)
    pad = 32 * rounds * elems - M  # lanes past the row add nothing

    def lanes_view(t):
        t = torch.nn.functional.pad(t, (0, pad)) if pad else t
        return t.reshape(*t.shape[:-1], rounds, 32, elems)

    av, bv = lanes_view(a), lanes_view(b)
    partial = None
    for r in range(rounds):  # one round's products at once, then added element by element
        prod = av[..., r, :, :].float() * bv[..., r, :, :].float()
        for i in range(elems):
            partial = prod[..., i] + 0.0 if partial is None else partial + prod[..., i]
    lanes = torch.arange(32, device=b.device)
    for off in (16, 8, 4, 2, 1):
        partial = partial + partial[..., lanes ^ off]
    return partial[..., 0]


class _KernelOrderSlotSum(torch.autograd.Function):
    """:func:`weighted_slot_sum` whose gate gradients are :func:`warp_order_dot`'s (the megakernel's
    bits); the rows' gradients are autograd's (``cast(gate * float(grad_out))``, as the kernels)."""

    @staticmethod
    def forward(ctx, pair_rows: Tensor, gates: Tensor, out_dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(pair_rows, gates)
        return weighted_slot_sum(pair_rows, gates, out_dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        pair_rows, gates = ctx.saved_tensors
        g = grad_out.to(pair_rows.dtype)
        gf = g.float()
        grad_rows = torch.empty_like(pair_rows)
        for j in range(pair_rows.shape[1]):
            grad_rows[:, j] = (gates[:, j:j + 1].float() * gf).to(pair_rows.dtype)
        grad_gates = warp_order_dot(g.unsqueeze(1), pair_rows)
        return grad_rows, grad_gates.to(gates.dtype), None


def kernel_order_slot_sum(pair_rows: Tensor, gates: Tensor, out_dtype: torch.dtype) -> Tensor:
    """:func:`weighted_slot_sum` with the megakernel's gate-gradient bits (:func:`warp_order_dot`)."""
    return _KernelOrderSlotSum.apply(pair_rows, gates, out_dtype)


def slot_ranks(expert_idx: Tensor, experts_per_rank: int) -> Tensor:
    """``[T, k]`` rank of each slot's expert (experts split evenly, ``experts_per_rank`` each), -1 for
    a dropped slot; ``expert_idx``'s dtype."""
    return torch.where(expert_idx >= 0, expert_idx // experts_per_rank, -1)


def first_slots_of_ranks(slot_rank: Tensor) -> Tensor:
    """``[T, k]`` bool: slot j is kept (``slot_rank[t, j] >= 0``) and no earlier slot of token t goes
    to the same rank."""
    k = slot_rank.shape[1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=slot_rank.device).tril(-1)  # [j, j'] j' < j
    repeated = ((slot_rank.unsqueeze(2) == slot_rank.unsqueeze(1)) & earlier).any(2)
    return ~repeated & (slot_rank >= 0)


def rank_partial_sum(pair_rows: Tensor, gates: Optional[Tensor], slot_rank: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The ``"rank_partials"`` combine (``compression.combine``): for each token and rank, the token's
    slots on that rank summed in slot order in fp32 (times ``gates`` when given), cast to
    ``out_dtype``; then those partials added in fp32 in the order of each rank's first slot, cast
    once. ``pair_rows [T, k, M]``; ``slot_rank [T, k]`` the rank of each slot's expert, -1 dropped.
    The megakernel's ``combine_partials_push`` and ``combine_reduce`` give the same bits."""
    T, k, M = pair_rows.shape
    firsts = first_slots_of_ranks(slot_rank)
    out = pair_rows.new_zeros(T, M, dtype=torch.float32)
    for j in range(k):
        part = pair_rows.new_zeros(T, M, dtype=torch.float32)
        for jj in range(j, k):
            term = pair_rows[:, jj].float()
            if gates is not None:
                term = gates[:, jj:jj + 1].float() * term
            same = (firsts[:, j] & (slot_rank[:, jj] == slot_rank[:, j])).unsqueeze(1)
            part = torch.where(same, part + term, part)
        out = torch.where(firsts[:, j:j + 1], out + part.to(out_dtype).float(), out)
    return out.to(out_dtype)


class ReferenceDispatcher:
    """Dispatch/combine with ``all_to_all_single``.

    Dropless (``capacity=None``): variable split sizes, only kept rows travel.
    With a capacity ``C``: every rank sends a zero-padded ``[E, C, M]`` buffer (the
    exchange DeepSpeed's MOELayer does), and the receiver compacts the rows into
    the same expert-major layout, so experts see identical inputs either way.

    With ``timeout_s`` every collective on CPU tensors (gloo) waits at most that long and a failure
    raises :class:`ds_uniep.errors.UniEPTimeoutError` naming ``layer_name``, the rank and the step
    (:class:`ds_uniep.faults.Deadline`); None: the process group's own timeout.
    """

    def __init__(self, num_experts: int, ep_size: int, group=None, rank: Optional[int] = None,
                 dispatch_dtype: str = "activation", pacing=None, combine: str = "slots",
                 timeout_s: Optional[float] = None, layer_name: str = "ReferenceDispatcher"):
        if combine not in ("slots", "rank_partials"):
            raise ValueError(f"combine must be 'slots' or 'rank_partials', got {combine!r}")
        #: compression.combine: "rank_partials" sums each rank's rows of a token first (rank_partial_sum)
        self.combine_mode = combine
        self.num_experts = num_experts
        self.pacing = pacing
        self.fp8 = dispatch_dtype == "fp8_e4m3"
        self.ep_size = ep_size
        self.group = group
        if ep_size > 1 and group is None:
            raise RuntimeError("an expert-parallel group is needed for ep_size > 1")
        self.rank = rank if rank is not None else (torch_dist.get_rank(group) if ep_size > 1 else 0)
        self.num_local_experts = num_experts // ep_size
        self.layer_name = layer_name
        self.deadline = Deadline(layer_name, timeout_s) if timeout_s is not None else None

    # ------------------------------------------------------------------ dispatch
    @torch.compiler.disable  # collectives and host reads of counts: eager under torch.compile
    def dispatch(self, x: Tensor, expert_idx: Tensor, capacity: Optional[int] = None
                 ) -> Tuple[Tensor, Tensor, DispatchHandle]:
        stop_point("dispatch")  # fault-injection tests only (UNIEP_TEST_STOP_AT)
        T, k = expert_idx.shape
        counts = expert_counts(expert_idx, self.num_experts)
        if capacity is None:
            counts_all = gather_counts(counts, self.group, self.ep_size, self.deadline, "dispatch (counts all-gather)")
        else:
            # Every rank's T and capacity travel with the counts, so that every rank raises alike.
            rows = gather_counts(torch.cat([counts, counts.new_tensor([T, capacity])]), self.group, self.ep_size,
                                 self.deadline, "dispatch (counts all-gather)")
            counts_all = rows[:, :-2]
            self._check_capacity(counts_all, rows[:, -2].tolist(), rows[:, -1].tolist())
        layout = build_layout(expert_idx, counts_all, self.rank)
        handle = DispatchHandle(layout, expert_idx, capacity)
        slot_rank = slot_ranks(expert_idx, self.num_local_experts) if self.combine_mode == "rank_partials" else None
        send = _GatherPairs.apply(x, layout.send_pairs, k, slot_rank)  # [N, M], (destination rank, row) order
        if self.fp8:
            send = _FP8Dispatch.apply(send)
        if capacity is None:
            arrived = all_to_all(send, handle.recv_splits, handle.send_splits, self.group, self.pacing, self.deadline,
                                 "dispatch (rows all-to-all)")
        else:
            arrived = self._padded_exchange(send, handle, capacity)
        # Arrival order is source-major; the layout wants expert-major rows.
        recv = arrived.index_select(0, torch.argsort(layout.recv_rows))
        return recv, layout.local_expert_counts, handle

    def _check_capacity(self, counts_all: Tensor, tokens: List[int], capacities: List[int]) -> None:
        """DeepSpeed's capacity-padded exchange (drop_tokens) sends ``[E, C, M]`` from every rank: every
        rank must have the same C, and no expert more than C rows. Raised on every rank alike."""
        if len(set(capacities)) > 1:
            raise ValueError(
                f"{self.layer_name}: rank {self.rank}: with drop_tokens=True the reference backend exchanges "
                "capacity-padded buffers, as DeepSpeed's MOELayer does, which needs the same token count on every "
                f"rank of the expert-parallel group; the ranks have {tokens} tokens (capacities {capacities}). "
                "Give every rank the same number of tokens, or use drop_tokens=False (dropless).")
        over = counts_all.max(dim=1).values.tolist() if counts_all.numel() else []
        for r, most in enumerate(over):
            if most > capacities[r]:
                raise RuntimeError(f"{self.layer_name}: rank {r} routed {most} rows to one expert, over the "
                                   f"capacity {capacities[r]}")

    @staticmethod
    def _send_slots(handle: DispatchHandle, C: int) -> Tensor:
        """``[N]`` slot of each sent row in the sender's padded ``[E * C]`` buffer."""
        return handle.send_expert * C + handle.layout.block_pos.reshape(-1)[handle.layout.send_pairs]

    def _recv_slots(self, layout: Layout, C: int) -> Tensor:
        """``[R]`` slot of each received row (arrival order) in the padded ``[G * L * C]`` buffer."""
        return (layout.recv_src * self.num_local_experts + layout.recv_local_expert) * C + layout.recv_block_pos

    def _padded_exchange(self, send: Tensor, handle: DispatchHandle, C: int) -> Tensor:
        E, G, L = self.num_experts, self.ep_size, self.num_local_experts
        padded = send.new_zeros(E * C, send.shape[1]).index_copy(0, self._send_slots(handle, C), send)
        arrived = all_to_all(padded, [L * C] * G, [L * C] * G, self.group, self.pacing, self.deadline,
                             "dispatch (rows all-to-all)")  # [G * L * C, M], source-major
        return arrived.index_select(0, self._recv_slots(handle.layout, C))

    # ------------------------------------------------------------------ combine
    @torch.compiler.disable
    def combine(self, y: Tensor, gates: Tensor, handle: DispatchHandle) -> Tensor:
        stop_point("combine")  # fault-injection tests only (UNIEP_TEST_STOP_AT)
        layout = handle.layout
        T, k = layout.dest_row.shape
        back = y.index_select(0, layout.recv_rows)  # expert-major -> arrival order
        if handle.capacity is None:
            returned = all_to_all(back, handle.send_splits, handle.recv_splits, self.group, self.pacing, self.deadline,
                                  "combine (rows all-to-all)")
        else:
            returned = self._padded_return(back, handle, handle.capacity)
        pair_rows = y.new_zeros(T * k, y.shape[1]).index_copy(0, layout.send_pairs, returned).view(T, k, y.shape[1])
        if self.combine_mode == "rank_partials":
            return rank_partial_sum(pair_rows, gates, slot_ranks(handle.expert_idx, self.num_local_experts), y.dtype)
        return weighted_slot_sum(pair_rows, gates, y.dtype)

    def _padded_return(self, back: Tensor, handle: DispatchHandle, C: int) -> Tensor:
        G, L = self.ep_size, self.num_local_experts
        padded = back.new_zeros(G * L * C, back.shape[1]).index_copy(0, self._recv_slots(handle.layout, C), back)
        returned = all_to_all(padded, [L * C] * G, [L * C] * G, self.group, self.pacing, self.deadline,
                              "combine (rows all-to-all)")  # [E * C, M]
        return returned.index_select(0, self._send_slots(handle, C))
