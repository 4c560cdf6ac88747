"""Expert parallelism across nodes: the two-level dispatch and combine on the reference transport.

An expert-parallel group of N nodes of P ranks (:class:`ds_uniep.topology.GroupTopology`). Rank
``(n, l)`` is local rank ``l`` of node ``n``; the rows of source ``s = (n_s, l)`` for a rank on
node ``n_d`` go through the *relay* ``(n_d, l)``, the rank of that node with the same local rank.

Dispatch: a token travels at most once to each node that holds one of its experts (to the relay,
over the cross-node group of ranks with local rank ``l``), with its ``[k]`` expert indices; the
relay expands it into the (token, slot) rows of its node's experts and sends them to their ranks
over the node group. Combine: the rows go back to their relay inside the node, then across nodes
to their source, once per (token, slot) row on a remote node, and the source sums a token's
slots in slot order in fp32. Backward the same ways: the dispatch's gradient comes back as the
combine's rows are returned, the combine's gradient goes out as (token, slot) rows through the
relays. Nothing is summed on the way, so the layout (rows of a local expert ordered by source
rank, token, slot) and every sum are those of the flat reference backend: the same bits.

Every exchange is point-to-point (:mod:`ds_uniep.p2p`) on a node group or a cross-node group
(groups whose own timeout is ``uniep.overlap.timeout_s``), and each transfer is waited for at most
that long: a peer that stops answering makes :class:`NodeUnreachableError` name the layer, the
step, the exchange and the peer's node.

:class:`TwoLevelNVLinkDispatcher` runs the moves inside each node on the megakernel's NVLink
dispatch and combine instead (the backend "megakernel" on a group spanning nodes).

Phases. A relay hands on the rows of its own node's sources (itself) without waiting for the
network; ``dispatch(..., on_phase=...)`` moves those first, inside the node, while the other nodes'
token rows cross, and calls back after each phase, so that the first expert GEMM starts on the
local rows (``ds_uniep.schedules.across_nodes``). The way back returns the other nodes' rows first,
so they cross while the node's own rows move inside it. Each row lands where the one-phase move
puts it: the same bits.
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from .env import logger
from .errors import UniEPCommError
from .layout import build_layout, expert_counts
from .p2p import PendingExchange, start_exchange
from .reference import (DispatchHandle, ReferenceDispatcher, _FP8Dispatch, kernel_order_slot_sum, rank_partial_sum,
                        slot_ranks, weighted_slot_sum)
from .topology import GroupTopology, subgroup

#: Test hook, None in production: called with the step number as each dispatch starts (a test
#: makes a rank stop answering there).
STOP_FOR_TEST: Optional[Callable[[int], None]] = None


def across_nodes_unsupported(config) -> str:
    """What of a ``uniep`` block (a :class:`ds_uniep.config.UniEPConfig`) the megakernel across nodes
    (:class:`TwoLevelNVLinkDispatcher`) does not run, or "": it moves activation-dtype rows and sums
    slots at their source."""
    comp = config.compression
    return (f"compression.dispatch_dtype {comp.dispatch_dtype!r}" if comp.dispatch_dtype != "activation" else
            f"compression.combine {comp.combine!r}" if comp.combine != "slots" else "")


class NodeUnreachableError(UniEPCommError):
    """A peer did not answer an exchange of the two-level dispatch within ``uniep.overlap.timeout_s``
    (or its connection broke); the message names the layer, the step, the exchange and the peer's node."""


class _Phase:
    """The rows of one phase of a dispatch: those from the source nodes ``nodes`` (see
    :meth:`TwoLevelDispatcher.dispatch`). ``local``: only this rank's own node, whose rows never cross."""

    def __init__(self, nodes: List[int], local: bool):
        self.nodes, self.local = nodes, local
        self.relay_pairs: Optional[Tensor] = None  #: ``[H]`` the node's pairs this relay hands on, in that order
        self.relay_tok: Optional[Tensor] = None  #: ``[H]`` the received token of each
        self.intra_send: List[int] = []  #: rows this relay hands to each rank of its node
        self.intra_recv: List[int] = []  #: rows this rank receives from each relay of its node
        self.pos: Optional[Tensor] = None  #: ``[R_p]`` the layout row of each row received, in arrival order
        #: the layout's runs this phase fills: local expert, first row and rows of each (expert, source)
        self.run_expert: Optional[Tensor] = None
        self.run_start: Optional[Tensor] = None
        self.run_rows: Optional[Tensor] = None
        # TwoLevelNVLinkDispatcher's: the node dispatcher's expert of each row handed on ([H, 1] int32),
        # its dispatch's (expert_idx, dest_row, recv_pair, num_recv), and the combine's rows in its
        # order (forward to the combine's backward)
        self.nvl_idx: Optional[Tensor] = None
        self.nvl_handle: Optional[tuple] = None
        self.nvl_y: Optional[Tensor] = None

    def segments(self) -> Tensor:
        """``[S, 4]`` int32 (first row, rows, local expert, 0): the runs of layout rows this phase
        fills, adjacent runs of one expert merged (ds_uniep's grouped GEMM's segments)."""
        order = torch.argsort(self.run_start)
        runs = torch.stack([self.run_start[order], self.run_rows[order], self.run_expert[order]], 1).tolist()
        segs: List[List[int]] = []
        for start, rows, expert in runs:
            if rows == 0:
                continue
            if segs and segs[-1][2] == expert and segs[-1][0] + segs[-1][1] == start:
                segs[-1][1] += rows
            else:
                segs.append([start, rows, expert, 0])
        return torch.tensor(segs, dtype=torch.int32, device=self.pos.device).view(-1, 4)


class _Plan:
    """One dispatch's routes through the two levels (see :meth:`TwoLevelDispatcher.dispatch`)."""

    def __init__(self, step: int, T: int, k: int):
        self.step, self.T, self.k = step, T, k
        self.send_tok: List[Tensor] = []  #: per node: this rank's tokens with a slot there (token order)
        self.send_pairs: List[Tensor] = []  #: per node: this rank's (token, slot) pair ids there, in order
        self.recv_tok: List[int] = []  #: per source node: tokens its rank with this local rank sends here
        self.recv_pairs: List[int] = []  #: per source node: its (token, slot) rows for this node
        self.pair_tok: Optional[Tensor] = None  #: ``[P1]`` received token of each (token, slot) row of this node
        self.pair_expert: Optional[Tensor] = None  #: ``[P1]`` the expert of each of those rows
        self.pair_src: Optional[Tensor] = None  #: ``[P1]`` the source node of each
        self.pair_dest: Optional[Tensor] = None  #: ``[P1]`` the local rank of its expert
        self.fwd_order: Optional[Tensor] = None  #: ``[P1]`` the pairs by destination, source node, expert
        self.phases: List[_Phase] = []
        #: called as ``on_phase(recv, phase)`` once each phase's rows are in ``recv`` (the layout's rows)
        self.on_phase: Optional[Callable[[Tensor, _Phase], None]] = None

    @property
    def rows(self) -> int:
        return sum(sum(ph.intra_recv) for ph in self.phases)


def _runs_rows(start: Tensor, rows: Tensor, total: int) -> Tensor:
    """``[total]``: the rows of the runs ``(start[i], rows[i])`` one after another."""
    if total == 0:
        return start.new_zeros(0)
    shift = torch.repeat_interleave(start - (torch.cumsum(rows, 0) - rows), rows, output_size=total)
    return torch.arange(total, device=start.device) + shift


class _TokensToExperts(torch.autograd.Function):
    """Tokens to their experts' ranks through the relays; the gradient comes back as (token, slot)
    rows and is summed per token in slot order in fp32 (as ``reference._GatherPairs``)."""

    @staticmethod
    def forward(ctx, x: Tensor, d: "TwoLevelDispatcher", plan: _Plan, slot_rank: Optional[Tensor]) -> Tensor:
        ctx.d, ctx.plan, ctx.slot_rank = d, plan, slot_rank
        return d._tokens_to_experts(x, plan)

    @staticmethod
    def backward(ctx, grad: Tensor):
        plan = ctx.plan
        per_pair = ctx.d._rows_to_sources(grad, plan, "backward").view(plan.T, plan.k, grad.shape[1])
        if ctx.slot_rank is not None:
            return rank_partial_sum(per_pair, None, ctx.slot_rank, grad.dtype), None, None, None
        ones = grad.new_ones(plan.T, plan.k, dtype=torch.float32)
        return weighted_slot_sum(per_pair, ones, grad.dtype), None, None, None


class _RowsToSources(torch.autograd.Function):
    """Expert-major rows back to their sources as ``[T * k, M]`` (zeros for dropped slots); the
    gradient goes out as (token, slot) rows through the relays."""

    @staticmethod
    def forward(ctx, y: Tensor, d: "TwoLevelDispatcher", plan: _Plan) -> Tensor:
        ctx.d, ctx.plan = d, plan
        return d._rows_to_sources(y, plan, "forward")

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.d._pairs_to_experts(grad, ctx.plan), None, None


class _CombineAcrossNodes(torch.autograd.Function):
    """:meth:`TwoLevelNVLinkDispatcher.combine`: the rows back to their sources, summed there in slot
    order; backward through :meth:`TwoLevelNVLinkDispatcher._combine_backward`."""

    @staticmethod
    def forward(ctx, y: Tensor, gates: Tensor, d: "TwoLevelNVLinkDispatcher", plan: _Plan) -> Tensor:
        pair_rows = d._rows_to_sources(y, plan, "forward").view(plan.T, plan.k, y.shape[1])
        ctx.d, ctx.plan = d, plan
        ctx.save_for_backward(gates, *[ph.nvl_y for ph in plan.phases])
        for ph in plan.phases:
            ph.nvl_y = None
        return weighted_slot_sum(pair_rows, gates, y.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gates, *nvl_ys = ctx.saved_tensors
        grad_y, grad_gates = ctx.d._combine_backward(grad_out, gates, nvl_ys, ctx.plan)
        return grad_y, grad_gates, None, None


class TwoLevelDispatcher(ReferenceDispatcher):
    """The reference dispatcher's protocol and results over an expert-parallel group spanning nodes
    (see the module's docstring). With a capacity, the rows travel without the padding (the
    experts see the same rows). ``cross_node_bytes``: the group's bytes across nodes in the last
    step, and what a flat all-to-all would send."""

    #: the combine's sum of a token's slots at its source (and its backward)
    _slot_sum = staticmethod(weighted_slot_sum)

    def __init__(self, num_experts: int, ep_size: int, group, topology: GroupTopology, layer_name: str = "UniEPMoE",
                 dispatch_dtype: str = "activation", combine: str = "slots", timeout_s: float = 100.0):
        super().__init__(num_experts, ep_size, group, rank=topology.me, dispatch_dtype=dispatch_dtype,
                         combine=combine, layer_name=layer_name)
        if not topology.uniform or len(topology.ranks) != ep_size:
            raise ValueError(f"{layer_name}: the two-level dispatch needs the same number of the group's ranks on "
                             f"every node, got {topology.describe()}")
        self.topology, self.timeout_s = topology, timeout_s
        nodes = topology.nodes
        self.num_nodes, self.ranks_per_node = len(nodes), len(nodes[0])
        self.node, self.local = topology.node_of(self.rank), topology.local_of(self.rank)
        node_of, local_of = [0] * ep_size, [0] * ep_size
        for n, ranks in enumerate(nodes):
            for l, g in enumerate(ranks):
                node_of[g], local_of[g] = n, l
        self._node_of, self._local_of = torch.tensor(node_of), torch.tensor(local_of)
        self._nodes = nodes
        glob = topology.ranks
        intra = [glob[g] for g in nodes[self.node]]
        cross = [glob[n[self.local]] for n in nodes]
        self.intra_group, self.cross_group = subgroup(intra, timeout_s), subgroup(cross, timeout_s)
        self._intra_peer = [self._group_rank(self.intra_group, r) for r in intra]  # local rank -> group rank
        self._cross_peer = [self._group_rank(self.cross_group, r) for r in cross]  # node -> group rank
        self.step = 0
        #: whether the combine's gradient crosses as grad_out's token rows once per node (else as rows
        #: per (token, slot))
        self.grad_tokens_once = False
        self.cross_node_bytes = None
        self._said_bytes = False

    @staticmethod
    def _group_rank(group, global_rank: int) -> int:
        return 0 if group is None else torch_dist.get_group_rank(group, global_rank)

    # ------------------------------------------------------------------ exchanges
    def _exchange(self, level: str, sends, recvs, step, what: str, wait: bool = True) -> PendingExchange:
        """``sends[i]``/``recvs[i]`` for node ``i`` (``level`` "cross") or local rank ``i`` ("intra");
        waited for, unless ``wait`` is False (then the caller waits)."""
        cross = level == "cross"
        peer_of = self._cross_peer if cross else self._intra_peer
        n = len(peer_of)
        s, r = [None] * n, [None] * n
        for i in range(n):
            s[peer_of[i]], r[peer_of[i]] = sends[i], recvs[i]
        me = peer_of[self.node if cross else self.local]
        group = self.cross_group if cross else self.intra_group

        def fail(peer: int, err: BaseException) -> Exception:
            i = peer_of.index(peer)
            g = self._nodes[i][self.local] if cross else self._nodes[self.node][i]
            label = self.topology.node_label(self._node_of[g].item())
            who = f"node {label} (rank {self.topology.ranks[g]})" if cross else \
                f"rank {self.topology.ranks[g]} of this rank's node {label}"
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return NodeUnreachableError(f"{self.layer_name}: step {step}: no answer from {who} in the {what} "
                                        f"within {self.timeout_s:g} s ({first})")

        pending = start_exchange(s, r, group, me, self.timeout_s, fail)
        if wait:
            pending.wait()
        return pending

    def _gather_counts(self, vec: Tensor, step: int) -> Tensor:
        """``[G, V]``: every rank's ``[V]`` vector, gathered inside the node, then across nodes."""
        P, N = self.ranks_per_node, self.num_nodes
        got = [[torch.empty_like(vec)] for _ in range(P)]
        self._exchange("intra", [[vec]] * P, got, step, "counts exchange inside the node")
        block = torch.stack([g[0] for g in got])  # [P, V]
        blocks = [[torch.empty_like(block)] for _ in range(N)]
        self._exchange("cross", [[block]] * N, blocks, step, "counts exchange across nodes")
        order = torch.tensor([g for ranks in self._nodes for g in ranks], device=vec.device)
        full = vec.new_empty(self.ep_size, vec.shape[0])
        full[order] = torch.cat([b[0] for b in blocks])
        return full

    # ------------------------------------------------------------------ dispatch
    @torch.compiler.disable  # as ReferenceDispatcher's
    def dispatch(self, x: Tensor, expert_idx: Tensor, capacity: Optional[int] = None,
                 on_phase: Optional[Callable[[Tensor, _Phase], None]] = None):
        """The reference dispatcher's ``dispatch``. ``on_phase``: the rows move in two phases, those of
        this rank's own node (inside the node only), then those of the other nodes (once they have
        crossed), and ``on_phase(recv, phase)`` is called after each, with ``recv`` (the layout's
        rows) holding the rows of that phase and of those before; ``phase.segments()`` says which.
        The rows and results are the same either way."""
        self.step += 1
        step = self.step
        if STOP_FOR_TEST is not None:
            STOP_FOR_TEST(step)
        T, k = expert_idx.shape
        E, N, L = self.num_experts, self.num_nodes, self.num_local_experts
        dev = expert_idx.device
        counts = expert_counts(expert_idx, E)
        if capacity is not None and counts.numel() and int(counts.max()) > capacity:
            raise RuntimeError(f"{int(counts.max())} rows routed to one expert exceed the capacity {capacity}")
        node_of = self._node_of.to(dev)
        flat = expert_idx.reshape(-1).long()
        pair_node = torch.where(flat >= 0, node_of[flat.clamp_min(0) // L], -1)  # [T * k]
        on_node = (pair_node.view(T, k, 1) == torch.arange(N, device=dev)).any(1)  # [T, N]
        full = self._gather_counts(torch.cat([counts, on_node.sum(0)]), step)
        counts_all, tok_all = full[:, :E], full[:, E:]
        layout = build_layout(expert_idx, counts_all, self.rank)
        handle = DispatchHandle(layout, expert_idx, capacity)
        handle.plan = plan = self._plan(expert_idx, pair_node, on_node, counts_all, tok_all, step, on_phase is not None)
        plan.on_phase = on_phase
        self._count_bytes(counts_all, tok_all, x, k, step)
        slot_rank = slot_ranks(expert_idx, L) if self.combine_mode == "rank_partials" else None
        xs = _FP8Dispatch.apply(x) if self.fp8 else x
        recv = _TokensToExperts.apply(xs, self, plan, slot_rank)
        plan.on_phase = None
        return recv, layout.local_expert_counts, handle

    def _plan(self, expert_idx, pair_node, on_node, counts_all, tok_all, step, split: bool) -> _Plan:
        T, k = expert_idx.shape
        E, N, L = self.num_experts, self.num_nodes, self.num_local_experts
        dev = expert_idx.device
        plan = _Plan(step, T, k)
        plan.send_tok = [on_node[:, n].nonzero().view(-1) for n in range(N)]
        plan.send_pairs = [(pair_node == n).nonzero().view(-1) for n in range(N)]
        relays = [self._nodes[n][self.local] for n in range(N)]  # the rank with this local rank on each node
        plan.recv_tok = tok_all[relays, self.node].tolist()
        mine = self._node_of.to(dev).repeat_interleave(L) == self.node  # [E] experts on this node
        plan.recv_pairs = counts_all[relays][:, mine].sum(1).tolist()
        # Routing: the [k] experts of every token this relay receives.
        idx = expert_idx.long()
        got = [[idx.new_empty(n_tok, k)] for n_tok in plan.recv_tok]
        self._exchange("cross", [[idx.index_select(0, t)] for t in plan.send_tok], got, step, "routing exchange")
        ridx = torch.cat([g[0] for g in got]).reshape(-1)  # [R1 * k], (source node, token, slot) order
        node_of, local_of = self._node_of.to(dev), self._local_of.to(dev)
        here = (ridx >= 0) & (node_of[ridx.clamp_min(0) // L] == self.node)
        pairs = here.nonzero().view(-1)  # the received pairs for this node, in the pair buffers' order
        src_node = torch.repeat_interleave(torch.arange(N, device=dev), torch.tensor(plan.recv_tok, device=dev))
        plan.pair_tok, plan.pair_expert = pairs // k, ridx[pairs]
        plan.pair_src, plan.pair_dest = src_node[plan.pair_tok], local_of[plan.pair_expert // L]
        # Handed on by destination, then source node, expert and token: the layout's order.
        key = (plan.pair_dest * N + plan.pair_src) * E + plan.pair_expert
        plan.fwd_order = torch.sort(key, stable=True).indices
        # This rank's rows of local expert e from source g are rows start[e, g] .. + sizes[e, g] of the
        # layout (an expert's rows by source rank, then token and slot).
        sizes = counts_all[:, self.rank * L:(self.rank + 1) * L].t().contiguous()  # [L, G]
        flat = sizes.reshape(-1)
        start = (torch.cumsum(flat, 0) - flat).view(sizes.shape)
        from_rank = sizes.sum(0).tolist()
        groups = [[self.node], [n for n in range(N) if n != self.node]] if split else [list(range(N))]
        plan.phases = [self._phase(plan, nodes, sizes, start, from_rank) for nodes in groups]
        return plan

    def _phase(self, plan: _Plan, nodes: List[int], sizes: Tensor, start: Tensor, from_rank: List[int]) -> _Phase:
        """The routes of the rows of source nodes ``nodes`` (``sizes``, ``start``: the layout's runs,
        ``[L, G]``; ``from_rank``: this rank's rows from each source)."""
        P, N = self.ranks_per_node, self.num_nodes
        dev = sizes.device
        ph = _Phase(nodes, nodes == [self.node])
        member = torch.zeros(N, dtype=torch.bool, device=dev)
        member[nodes] = True
        ph.relay_pairs = self._handed_on(plan, member[plan.pair_src])
        ph.relay_tok = plan.pair_tok[ph.relay_pairs]
        ph.intra_send = torch.bincount(plan.pair_dest[ph.relay_pairs], minlength=P).tolist()
        ph.intra_recv = [sum(from_rank[self._nodes[n][q]] for n in nodes) for q in range(P)]
        e, g = self._arrival_runs(nodes, sizes.shape[0], dev)
        ph.run_expert, ph.run_start, ph.run_rows = e, start[e, g], sizes[e, g]
        ph.pos = _runs_rows(ph.run_start, ph.run_rows, sum(ph.intra_recv))
        return ph

    def _handed_on(self, plan: _Plan, in_phase: Tensor) -> Tensor:
        """The node's pairs (``in_phase``: of this phase) in the order this relay hands them on."""
        return plan.fwd_order[in_phase[plan.fwd_order]]

    def _arrival_runs(self, nodes: List[int], L: int, dev) -> Tuple[Tensor, Tensor]:
        """(local expert, source rank) of the runs of rows as they arrive from the relays of this
        node: by relay, then source node, then expert."""
        sources = torch.tensor([self._nodes[n][q] for q in range(self.ranks_per_node) for n in nodes], device=dev)
        return torch.arange(L, device=dev).repeat(len(sources)), sources.repeat_interleave(L)

    # ------------------------------------------------------------------ row movement
    def _cross(self, chunks: List[Tensor], sizes: List[int], like: Tensor, step, what: str,
               wait: bool = True):
        """``chunks[n]`` to node ``n``, ``sizes[n]`` rows from it (this node's not moved: None);
        the arrived rows, or (``wait`` False) the :class:`PendingExchange` whose wait gives them."""
        me = self.node
        got = [[like.new_empty((0 if n == me else s, ) + tuple(like.shape[1:]))] for n, s in enumerate(sizes)]
        sends = [[c if n != me else c[:0]] for n, c in enumerate(chunks)]
        pending = self._exchange("cross", sends, got, step, what, wait=False)
        if not wait:
            return pending
        return [None if n == me else g[0] for n, g in enumerate(pending.wait())]

    def _intra(self, rows: Tensor, send: List[int], recv: List[int], step, what: str) -> Tensor:
        got = [[rows.new_empty((n, ) + tuple(rows.shape[1:]))] for n in recv]
        self._exchange("intra", [[c] for c in rows.split(send)], got, step, what)
        return torch.cat([g[0] for g in got])

    def _to_experts(self, sends: List[Tensor], sizes: List[int], tokens: bool, plan: _Plan, step, what: str) -> Tensor:
        """This rank's rows for each node (``sends[n]``: token rows if ``tokens``, else (token, slot)
        rows; ``sizes[n]``: what the relay here gets from node ``n``) -> this rank's rows in the
        layout's order, phase by phase: a local phase's rows go inside the node while the other
        nodes' rows cross."""
        me = self.node
        pending = self._cross(sends, sizes, sends[me], step, f"{what} across nodes", wait=False)
        first = sum(sizes[:me])  # this node's rows in the arrival order
        out = sends[me].new_empty((plan.rows, ) + tuple(sends[me].shape[1:]))
        arrived = None
        for ph in plan.phases:
            pick = ph.relay_tok if tokens else ph.relay_pairs
            if ph.local:
                rows = sends[me].index_select(0, pick - first)
            else:
                if arrived is None:
                    got = [g[0] for g in pending.wait()]
                    got[me] = sends[me]
                    arrived = torch.cat(got)
                rows = arrived.index_select(0, pick)
            out.index_copy_(0, ph.pos, self._node_to_experts(rows, ph, step, f"{what} inside the node"))
            if plan.on_phase is not None:
                plan.on_phase(out, ph)
        return out

    def _to_sources(self, y: Tensor, plan: _Plan, step, what: str, forward: bool) -> Tensor:
        """This rank's rows ``y`` (layout order) -> ``[T * k, M]`` at their sources (zeros for dropped
        slots): the other nodes' rows first, which cross while this node's move inside it."""
        me = self.node
        buf = y.new_empty((sum(plan.recv_pairs), ) + tuple(y.shape[1:]))  # the node's pairs, as the relay holds them
        chunks = list(buf.split(plan.recv_pairs))

        def to_relays(ph: _Phase) -> None:
            back = self._node_to_relays(y.index_select(0, ph.pos), ph, step, f"{what} inside the node", forward)
            buf.index_copy_(0, ph.relay_pairs, back)
        for ph in plan.phases:
            if not ph.local:
                to_relays(ph)
        pending = self._cross(chunks, [len(p) for p in plan.send_pairs], y, step, f"{what} across nodes", wait=False)
        for ph in plan.phases:
            if ph.local:
                to_relays(ph)
        got = [g[0] for g in pending.wait()]
        got[me] = chunks[me]
        out = y.new_zeros(plan.T * plan.k, y.shape[1])
        return out.index_copy(0, torch.cat(plan.send_pairs), torch.cat(got))

    def _tokens_to_experts(self, x: Tensor, plan: _Plan) -> Tensor:
        return self._to_experts([x.index_select(0, t) for t in plan.send_tok], plan.recv_tok, True, plan, plan.step,
                                "dispatch")

    def _pairs_to_experts(self, per_pair: Tensor, plan: _Plan) -> Tensor:
        return self._to_experts([per_pair.index_select(0, p) for p in plan.send_pairs], plan.recv_pairs, False, plan,
                                f"{plan.step} (backward)", "combine gradient")

    def _node_to_experts(self, rows: Tensor, ph: _Phase, step, what: str) -> Tensor:
        """The in-node half of a move to the experts: the rows this relay hands on in phase ``ph``
        (in its order) -> the rows this rank receives in it, in arrival order."""
        return self._intra(rows, ph.intra_send, ph.intra_recv, step, what)

    def _node_to_relays(self, rows: Tensor, ph: _Phase, step, what: str, forward: bool) -> Tensor:
        """The in-node half of a move back to the sources: this rank's rows of phase ``ph`` in
        arrival order -> the rows this relay handed on in it, in its order (``forward``: the
        combine's; else the dispatch's gradient)."""
        return self._intra(rows, ph.intra_recv, ph.intra_send, step, what)

    def _rows_to_sources(self, y: Tensor, plan: _Plan, direction: str) -> Tensor:
        step = plan.step if direction == "forward" else f"{plan.step} (backward)"
        return self._to_sources(y, plan, step, "combine" if direction == "forward" else "dispatch gradient",
                                direction == "forward")

    # ------------------------------------------------------------------ combine
    @torch.compiler.disable
    def combine(self, y: Tensor, gates: Tensor, handle: DispatchHandle) -> Tensor:
        plan = handle.plan
        pair_rows = _RowsToSources.apply(y, self, plan).view(plan.T, plan.k, y.shape[1])
        if self.combine_mode == "rank_partials":
            return rank_partial_sum(pair_rows, gates, slot_ranks(handle.expert_idx, self.num_local_experts), y.dtype)
        return self._slot_sum(pair_rows, gates, y.dtype)

    # ------------------------------------------------------------------ accounting
    def _count_bytes(self, counts_all: Tensor, tok_all: Tensor, x: Tensor, k: int, step: int) -> None:
        """The group's bytes across nodes in this step (forward and backward), two-level and flat;
        logged once, by the group's first rank."""
        G, E, N, P = self.ep_size, self.num_experts, self.num_nodes, self.ranks_per_node
        node_of = self._node_of.to(counts_all.device)
        remote = node_of.unsqueeze(1) != node_of.repeat_interleave(self.num_local_experts).unsqueeze(0)  # [G, E]
        pairs = int(counts_all[remote].sum())
        tokens = int((tok_all * (node_of.unsqueeze(1) != torch.arange(N, device=node_of.device))).sum())
        row = x.shape[1] * x.element_size()
        counts = G * (N - 1) * P * (E + N) * 8
        # Backward: the dispatch's gradient one row per remote (token, slot); the combine's gradient the
        # same, or (grad_tokens_once) grad_out's rows once per node with the gates out and back.
        backward = (tokens + pairs) * row + 8 * pairs if self.grad_tokens_once else 2 * pairs * row
        b = {"dispatch_rows": tokens * row, "routing": tokens * k * 8 + counts, "combine_rows": pairs * row,
             "backward_rows": backward}
        two_level = sum(b.values())
        flat = 4 * pairs * row + G * (G - P) * E * 8  # rows both ways forward and backward, counts all-gather
        self.cross_node_bytes = dict(b, two_level=two_level, flat=flat)
        if self._said_bytes or self.rank != 0:
            return
        self._said_bytes = True
        mb = lambda n: f"{n / 2**20:.3g} MiB"  # noqa: E731
        logger.info(f"{self.layer_name}: two-level dispatch over {self.topology.describe()}; bytes across nodes in "
                    f"step {step} (all ranks, forward and backward): {mb(two_level)} (token rows once per node "
                    f"{mb(b['dispatch_rows'])}, routing and counts {mb(b['routing'])}, combine rows "
                    f"{mb(b['combine_rows'])}, backward rows {mb(b['backward_rows'])}); a flat all-to-all sends "
                    f"{mb(flat)}")


class TwoLevelNVLinkDispatcher(TwoLevelDispatcher):
    """:class:`TwoLevelDispatcher` with its moves inside each node on the megakernel's NVLink dispatch
    and combine (symmetric memory over the node's ranks of the group); across nodes, the same
    point-to-point exchanges (NCCL on GPUs). What ``uniep.backend`` "megakernel" (or "auto") runs on
    a group spanning nodes.

    Inside node ``n`` a relay hands its node's (token, slot) rows, in (source node, token, slot)
    order, to an :class:`~ds_uniep.megakernel.NVLinkDispatcher` of the node's ranks as one-slot
    tokens. A rank then holds each local expert's rows by relay, then source node; one gather puts
    them in the layout's order (by source rank). The way back is that dispatcher's combine with unit
    weights, which gives each row back bit for bit. So the rows and every sum are those of the flat
    reference backend and of the single-node megakernel. The combine's backward sends grad_out's rows
    once per node with the gates of the (token, slot) rows there; the node's dispatcher forms the
    experts' row gradients and the gate gradients where the rows are (the single-node megakernel's
    kernels and bits), and the gate gradients cross back. Activation-dtype rows and slot-order sums
    only (FP8 dispatch and rank partials run on the reference backend); the layer runs the
    sequential schedule on it, or the pipelined one across nodes (two phases, see the module).
    The node's dispatcher takes ``max_tokens_per_rank * nodes * k`` one-slot tokens per relay (its
    symmetric buffers are sized for them). With one rank per node nothing moves inside a node: the
    rows come back to their sources as on the reference, and the gate gradients are summed there in
    the kernels' order (:func:`~ds_uniep.reference.kernel_order_slot_sum`)."""

    _slot_sum = staticmethod(kernel_order_slot_sum)

    def __init__(self, num_experts: int, ep_size: int, group, topology: GroupTopology, config, hidden_size: int,
                 k: int, dtype: torch.dtype, layer_name: str = "UniEPMoE"):
        from .config import UniEPConfig
        cfg = UniEPConfig.coerce(config)
        unsupported = across_nodes_unsupported(cfg)
        if unsupported:
            raise ValueError(f"{layer_name}: the megakernel across nodes moves activation-dtype rows and sums slots "
                             f"at their source; {unsupported} runs on backend 'reference'")
        super().__init__(num_experts, ep_size, group, topology, layer_name, timeout_s=cfg.overlap.timeout_s)
        self.max_tokens = cfg.max_tokens_per_rank
        P, N, L = self.ranks_per_node, self.num_nodes, self.num_local_experts
        node_cfg = cfg.model_copy(update={
            "max_tokens_per_rank": N * cfg.max_tokens_per_rank * k, "sync_free": False,
            "overlap": cfg.overlap.model_copy(update={"schedule": "sequential"})})
        # one rank per node: nothing moves inside a node
        self.nvl = self._node_dispatcher(node_cfg, hidden_size, dtype) if P > 1 else None
        self.grad_tokens_once = self.nvl is not None
        # Each expert's index in the node's dispatcher (-1: on another node), and the source rank of
        # each block of a local expert's rows there (relays in the node group's order, then nodes).
        e = torch.arange(num_experts)
        peer = torch.tensor(self._intra_peer)
        self._node_expert = torch.where(self._node_of[e // L] == self.node, peer[self._local_of[e // L]] * L + e % L,
                                        -1)
        local_by_peer = {q: p for p, q in enumerate(self._intra_peer)}
        self._by_peer = [local_by_peer[q] for q in range(P)]  # the node group's ranks as local ranks

    def _node_dispatcher(self, config, hidden_size: int, dtype: torch.dtype):
        """The NVLink dispatcher of this rank's node: ``P * L`` experts, one slot per token."""
        from .megakernel import NVLinkDispatcher
        P, L = self.ranks_per_node, self.num_local_experts
        return NVLinkDispatcher(f"{self.layer_name} (inside node {self.topology.node_label(self.node)})", P * L, P,
                                hidden_size, 1, dtype, config, self.intra_group)

    def set_config(self, config) -> None:
        """A new ``uniep`` block's knobs (a tuning plan's, :meth:`UniEPMoE.set_plan`) for the node's
        dispatcher, which runs the sequential schedule's kernels whatever schedule the block names."""
        if self.nvl is not None:
            self.nvl.set_knobs(config.knobs(schedule="sequential"))

    @torch.compiler.disable
    def dispatch(self, x: Tensor, expert_idx: Tensor, capacity: Optional[int] = None,
                 on_phase: Optional[Callable[[Tensor, _Phase], None]] = None):
        if expert_idx.shape[0] > self.max_tokens:
            from .megakernel.dispatcher import UniEPCapacityError
            raise UniEPCapacityError(
                f"{self.layer_name}: rank {self.rank} got {expert_idx.shape[0]} tokens but the buffers were sized for "
                f"max_tokens_per_rank = {self.max_tokens}; set \"uniep\": {{\"max_tokens_per_rank\": "
                f"{expert_idx.shape[0]}}} or more")
        return super().dispatch(x, expert_idx, capacity, on_phase)

    def _phase(self, plan: _Plan, nodes: List[int], sizes: Tensor, start: Tensor, from_rank: List[int]) -> _Phase:
        ph = super()._phase(plan, nodes, sizes, start, from_rank)
        if self.nvl is not None:
            ph.nvl_idx = self._node_expert.to(sizes.device)[plan.pair_expert[ph.relay_pairs]].view(-1, 1).to(
                torch.int32).contiguous()
        return ph

    def _handed_on(self, plan: _Plan, in_phase: Tensor) -> Tensor:
        if self.nvl is None:
            return super()._handed_on(plan, in_phase)
        return in_phase.nonzero().view(-1)  # as received: the node's dispatcher orders them by expert

    def _arrival_runs(self, nodes: List[int], L: int, dev) -> Tuple[Tensor, Tensor]:
        if self.nvl is None:
            return super()._arrival_runs(nodes, L, dev)
        # The node's dispatcher delivers each local expert's rows by relay (in the node group's
        # order), then the relay's order: source node, token, slot.
        sources = torch.tensor([self._nodes[n][q] for q in self._by_peer for n in nodes], device=dev)
        return torch.arange(L, device=dev).repeat_interleave(len(sources)), sources.repeat(L)

    def _node_to_experts(self, rows: Tensor, ph: _Phase, step, what: str) -> Tensor:
        if self.nvl is None:
            return super()._node_to_experts(rows, ph, step, what)
        x, idx = self.nvl.checked_inputs(rows, ph.nvl_idx)
        recv, _, dest_row, recv_pair, num_recv, _ = self.nvl._dispatch_fwd(x, idx)
        if recv.shape[0] != ph.pos.shape[0]:
            raise RuntimeError(f"{self.layer_name}: step {step}: {what} brought {recv.shape[0]} rows, the counts say "
                               f"{ph.pos.shape[0]}")
        ph.nvl_handle = (idx, dest_row, recv_pair, num_recv)
        return recv  # copied out by the caller before the node's dispatcher moves rows again

    def _node_to_relays(self, rows: Tensor, ph: _Phase, step, what: str, forward: bool) -> Tensor:
        if self.nvl is None:
            return super()._node_to_relays(rows, ph, step, what, forward)
        idx, _, recv_pair, num_recv = ph.nvl_handle
        if forward:  # the combine's backward reads the rows where the node has them
            ph.nvl_y = rows
            ones = torch.ones(idx.shape, dtype=torch.float32, device=rows.device)
            return self.nvl._combine_fwd(rows, ones, idx, recv_pair, num_recv)
        return self.nvl._dispatch_bwd(rows, idx, recv_pair, num_recv)  # one slot: each row as it is

    @torch.compiler.disable
    def combine(self, y: Tensor, gates: Tensor, handle) -> Tensor:
        if self.nvl is None:
            return super().combine(y, gates, handle)
        return _CombineAcrossNodes.apply(y, gates, self, handle.plan)

    def _combine_backward(self, grad_out: Tensor, gates: Tensor, nvl_ys: List[Tensor], plan: _Plan):
        """(grad of y, grad of gates) of :meth:`combine`: grad_out's rows cross once per node, with the
        gates of the (token, slot) rows there; the node's NVLink dispatcher scales them into the
        experts' row gradients and forms the gate gradients where the rows are, as the single-node
        megakernel does (the same kernels, the same bits), phase by phase (``nvl_ys``: each phase's
        rows; a local phase while the other nodes' rows cross); those cross back to the sources."""
        step, me, N = f"{plan.step} (backward)", self.node, self.num_nodes
        g, flat_gates = grad_out.to(nvl_ys[0].dtype).contiguous(), gates.reshape(-1).float().contiguous()
        sends = [g.index_select(0, t) for t in plan.send_tok]
        gate_sends = [flat_gates.index_select(0, p) for p in plan.send_pairs]
        got = [[g.new_empty((0 if n == me else plan.recv_tok[n], g.shape[1])),
                flat_gates.new_empty(0 if n == me else plan.recv_pairs[n])] for n in range(N)]
        pending = self._exchange("cross", [[s[:0], gs[:0]] if n == me else [s, gs]
                                           for n, (s, gs) in enumerate(zip(sends, gate_sends))],
                                 got, step, "combine gradient and gates across nodes", wait=False)
        tok_first, pair_first = sum(plan.recv_tok[:me]), sum(plan.recv_pairs[:me])
        grad_y = g.new_empty(plan.rows, g.shape[1])
        pair_grads = flat_gates.new_empty(sum(plan.recv_pairs))
        toks = None
        for ph, nvl_y in zip(plan.phases, nvl_ys):
            if ph.local:
                rows = sends[me].index_select(0, ph.relay_tok - tok_first)
                node_gates = gate_sends[me].index_select(0, ph.relay_pairs - pair_first)
            else:
                if toks is None:
                    arrived = pending.wait()
                    arrived[me] = [sends[me], gate_sends[me]]
                    toks, all_gates = torch.cat([a[0] for a in arrived]), torch.cat([a[1] for a in arrived])
                rows, node_gates = toks.index_select(0, ph.relay_tok), all_gates.index_select(0, ph.relay_pairs)
            idx, dest_row, recv_pair, num_recv = ph.nvl_handle
            gy, pg = self.nvl._combine_bwd(rows, nvl_y, node_gates.view(-1, 1), idx, dest_row, recv_pair, num_recv)
            grad_y.index_copy_(0, ph.pos, gy)
            pair_grads.index_copy_(0, ph.relay_pairs, pg.reshape(-1))
        chunks = list(pair_grads.split(plan.recv_pairs))
        back = self._cross(chunks, [len(p) for p in plan.send_pairs], flat_gates, step, "gate gradients across nodes")
        back[me] = chunks[me]
        grad_gates = flat_gates.new_zeros(flat_gates.shape).index_copy(0, torch.cat(plan.send_pairs), torch.cat(back))
        return grad_y, grad_gates.view(gates.shape)


def reference_dispatcher(layer, topology: GroupTopology) -> ReferenceDispatcher:
    """The reference transport for ``layer`` (a ``UniEPMoE``) on its expert-parallel group: the
    two-level dispatcher where the group spans nodes with the same number of its ranks on each,
    else the flat one (said where the group spans nodes)."""
    cfg = layer.uniep_config
    kwargs = dict(dispatch_dtype=cfg.compression.dispatch_dtype, combine=cfg.compression.combine)
    if topology.spans_nodes:
        why = ("inter-site pacing emulates the slow links on the flat exchange" if layer._pacing is not None else
               "" if topology.uniform else "its nodes hold different numbers of its ranks")
        if not why:
            logger.info(f"{layer.layer_name}: reference transport across {topology.describe()}: two-level (each "
                        "token once per node across, then inside the node)")
            return TwoLevelDispatcher(layer.num_experts, layer.ep_size, layer.ep_group, topology, layer.layer_name,
                                      timeout_s=cfg.overlap.timeout_s, **kwargs)
        logger.warning(f"{layer.layer_name}: the expert-parallel group spans {topology.describe()}; the flat "
                       f"all-to-all runs ({why})")
    return ReferenceDispatcher(layer.num_experts, layer.ep_size, layer.ep_group, pacing=layer._pacing,
                               timeout_s=cfg.overlap.timeout_s, layer_name=layer.layer_name, **kwargs)
