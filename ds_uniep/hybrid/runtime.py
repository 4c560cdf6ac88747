"""HybridEP inside ``UniEPMoE``: experts gathered inside a domain, tokens sent only across domains.

Letters: G expert-parallel ranks, S ranks per domain, D = G / S domains, L local
experts per rank, E = G * L experts. EP rank ``r`` is offset ``r % S`` of domain
``r // S``; domains are contiguous runs of EP ranks, so domain ``d`` owns the
experts ``[d * S * L, (d + 1) * S * L)``.

One layer on rank r:

1. Gather, issued first, before the router: every rank of the domain receives the
   weights of all S * L experts of its domain (its own included, through the same
   path), in one all-gather of its experts' parameters laid end to end (one per
   dtype), asynchronous, so it runs beside the router and the dispatch layout and
   is waited for only when the experts need it.
2. Dispatch over the *offset group* (the D ranks with r's offset, one per
   domain): a token routed to expert e goes to the rank of e's domain with r's
   offset, which holds a replica of e. A token whose expert lives in r's own
   domain stays on r. This is the reference dispatcher with D "ranks" of S * L
   experts each, so the deterministic layout carries over unchanged.
3. The replicas run over their rows: recognised bf16 MLP experts as one grouped
   GEMM per projection over all ``S * L`` replicas (as plain EP's local experts),
   other experts one by one (``torch.func.functional_call`` with the gathered
   weights).
4. Combine over the offset group, in slot order in fp32.

Backward: the gradient of a replica comes back to its owner through the
gather's backward, one all-to-all (again of all parameters end to end) that
hands each owner the S gradients of its own tensors (the gather's bytes,
mirrored), added in domain-rank order (fp32), so each owner parameter receives
exactly one gradient per backward, before DeepSpeed's expert-data-parallel
reduction. The all-to-all is issued as soon as the expert backward has produced
the replica gradients; the sum waits for it only at the end of the layer's
backward (after the dispatch-gradient all-to-all and the router's backward), so
the return runs beside them, as the cost model's streams assume. Each replica is
its own tensor in the graph, so its gradient goes into the all-to-all's send
buffer without an ``[S, ...]`` zero-filled intermediate.
With S = 1 the layer takes the plain EP path, so it is bitwise plain EP.

Partial migration (``migrated_fraction``, ``m < L`` experts per rank): step 1 gathers only m of
each rank's experts (its first m, or the hottest: :meth:`HybridExperts._choose`); the dispatch
runs over the whole EP group (:class:`PartialMigrationDispatcher`): a token for a migrated expert
goes where step 2 sends it, a token for any other expert to its owner, which runs those experts
with its own weights.

Once per optimizer step (``reuse_replicas``): a gather is kept while the weights it copied are
unchanged (:meth:`HybridExperts.prefetch`), so the micro-batches of a step share one; under a
DeepSpeed engine each backward before the step's last adds its replica gradients to fp32 sums
(:class:`HeldGradients`) and hands the owners zeros, and the last one returns the sums in one
all-to-all, as the cost model's M micro-batches assume.

Compressed migration (``compression.enabled``, :class:`CompressedGather`) replaces step 1's
all-gather: an asynchronous all-reduce of the domain's fp32 expert sums (the shared base), issued
where the dense gather is, then the encoding of each owner's experts against it (:mod:`.compress`),
the all-gather of the encoded experts and the decoding. On a GPU all of it is queued there on a
side stream, with no host synchronisation, and runs beside the router and the dispatch; on the CPU
the encoding and what follows run when the experts need the replicas. The backward is the dense
one (straight through the compression).

Modules beside this one: :mod:`.gather` (the dense and compressed gathers of step 1),
:mod:`.pacing` (emulated slow links between sites), :mod:`.planning` (the planner's inputs for a
layer, ``domain_size: "auto"``) and :mod:`.layer_state` (HybridEP's part of ``UniEPMoE``).
"""

import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn
from torch.func import functional_call

from ..env import logger
from ..experts import run_grouped, stack_experts
from ..layout import expert_counts
from ..reference import ReferenceDispatcher, gather_counts
from .gather import CompressedGather, DomainGather
from .pacing import InterSitePacing, PacedTransfer
from .planning import (choose_domain_size, measure_bandwidths, measure_expert_compute, migrated_experts, plan_domains,
                       planner_inputs, with_compute)

# Names of .gather, .pacing and .planning stay importable from here.
__all__ = [
    "CompressedGather", "DomainGather", "HeldGradients", "HybridExperts", "HybridGroups", "InterSitePacing",
    "MIGRATION_CHOICES", "PacedTransfer", "PartialMigrationDispatcher", "choose_domain_size", "hottest_experts",
    "measure_bandwidths", "measure_expert_compute", "migrated_experts", "optimizer_steps", "plan_domains",
    "planner_inputs", "with_compute"
]

MIGRATION_CHOICES = ("first", "hottest")


class HybridGroups:
    """The domain and offset process groups of one expert-parallel group.

    Creating it is collective over the whole world: every rank builds every
    group, in the same order, as ``torch.distributed.new_group`` requires.
    """

    def __init__(self, ep_group, domain_size: int, votes: bool = False):
        G = torch_dist.get_world_size(ep_group)
        if domain_size < 1 or G % domain_size != 0:
            raise ValueError(f'"uniep": {{"hybrid": {{"domain_size": {domain_size}}}}} must divide the '
                             f"expert-parallel size {G}")
        S = domain_size
        self.domain_size, self.ep_size, self.ep_group = S, G, ep_group
        self.ep_rank = torch_dist.get_rank(ep_group)
        self.domain, self.offset = divmod(self.ep_rank, S)
        # Every EP group of the world, in a fixed order, so all ranks create the same groups.
        mine = torch_dist.get_process_group_ranks(ep_group)
        everyone: List[Optional[List[int]]] = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(everyone, mine)
        ep_groups = sorted({tuple(g) for g in everyone})
        self.domain_group = self.offset_group = None
        #: With ``votes``: a gloo group of the domain for :meth:`any_in_domain` (host values, so no
        #: GPU synchronisation), the domain group itself where that is gloo already.
        self.vote_group = None
        gloo_domains = votes and S > 1 and torch_dist.get_backend(ep_group) != "gloo"
        for ranks in ep_groups:
            for d in range(G // S):
                g = torch_dist.new_group(list(ranks[d * S:(d + 1) * S]))
                v = torch_dist.new_group(list(ranks[d * S:(d + 1) * S]), backend="gloo") if gloo_domains else g
                if list(ranks) == mine and d == self.domain:
                    self.domain_group = g
                    self.vote_group = v if votes else None
            for o in range(S):
                g = torch_dist.new_group(list(ranks[o::S]))
                if list(ranks) == mine and o == self.offset:
                    self.offset_group = g

    def any_in_domain(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of this rank's domain (collective over the domain,
        built with ``votes``): decisions that choose whether the domain's ranks run a collective
        together are made with it, so no rank waits alone in a collective the others skipped."""
        if self.domain_size == 1:
            return flag
        if self.vote_group is None:
            raise RuntimeError("HybridGroups: any_in_domain needs the groups built with votes=True")
        t = torch.tensor([int(flag)], dtype=torch.int32)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=self.vote_group)
        return bool(t.item())


class HeldGradients:
    """Replica gradients held for the step's last micro-batch (``reuse_replicas`` under a DeepSpeed
    engine): ``boundary()`` says whether the backward running now is the last of the step (the
    engine's ``is_gradient_accumulation_boundary``); before it, each backward adds its replica
    gradients to ``sums`` (fp32, ``[S, n]`` per dtype, in micro-batch order) and sends nothing."""

    __slots__ = ("boundary", "sums", "count")

    def __init__(self, boundary: Callable[[], bool]):
        self.boundary, self.sums, self.count = boundary, None, 0


class _GatherUse:
    """One forward's use of a gather (:class:`DomainGather` or :class:`CompressedGather`): a reused
    gather serves several forwards, and each forward's backward exchanges its own replica gradients
    (``grad_works``, set by :class:`_ReplicaViews`, read by :class:`_OwnerSum`; None when they were
    held for a later backward, see :class:`HeldGradients`)."""

    __slots__ = ("gathered", "grad_works", "held")

    def __init__(self, gathered, held: Optional[HeldGradients] = None):
        self.gathered, self.grad_works, self.held = gathered, None, held


_OPTIMIZER_STEPS = [0]
_STEP_HOOK = None


def optimizer_steps() -> int:
    """Optimizer steps taken in this process since the first call (``torch.optim`` step post-hooks,
    which every ``torch.optim.Optimizer`` runs, DeepSpeed's included: its ZeRO and bf16 optimizers
    step a torch optimizer inside)."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def count(*_):
            _OPTIMIZER_STEPS[0] += 1
        _STEP_HOOK = register_optimizer_step_post_hook(count)
    return _OPTIMIZER_STEPS[0]


class _OwnerSum(torch.autograd.Function):
    """First half of the gather's autograd, applied when the gather is issued (before the router).

    Forward: the in-flight ``[S, n]`` buffers, one per dtype (not waited for; only
    :class:`_ReplicaViews` reads them, after :meth:`DomainGather.wait`). Backward: each owner
    tensor's gradient, the S gradients of it that :class:`_ReplicaViews` exchanged, added in
    domain-rank order in fp32. Autograd runs a node after every node created later, so this sum
    runs at the end of the layer's backward (after the dispatch-gradient all-to-all and the router's
    backward), while the exchange, issued right after the expert backward, has been on the links
    meanwhile."""

    @staticmethod
    def forward(ctx, use: _GatherUse, counter: Optional[Dict[str, int]], *local: Tensor):
        ctx.use, ctx.counter = use, counter
        return tuple(out.detach() for out in use.gathered.outs)  # not views: the collective writes them

    @staticmethod
    def backward(ctx, *parts: Tensor):
        use = ctx.use
        gathered = use.gathered
        local = gathered.local
        result: List[Optional[Tensor]] = [None] * len(local)
        if use.grad_works is None:
            # Held for the step's last micro-batch: nothing arrived. Zeros, not None: autograd calls
            # the parameters' gradient hooks either way, and DeepSpeed's ZeRO-2 hook reduces the
            # gradient it finds (as it does every expert gradient at every micro-batch in plain EP).
            return (None, None) + tuple(torch.zeros_like(t) for t in local)
        for idx, part, w in zip(gathered.buckets, parts, use.grad_works):
            w.wait()
            # fp32, in domain-rank order: the same sums as 0 + part[0] + part[1] + ... (an fp32 part
            # is summed in place: the buffer is this rank's and read by nobody else).
            acc = part[0].float()
            for j in range(1, part.shape[0]):
                acc.add_(part[j])
            off = 0
            for i in idx:
                n = local[i].numel()
                piece = acc[off:off + n].view(local[i].shape)
                result[i] = piece.to(local[i].dtype) if local[i].dtype != torch.float32 else piece.clone()
                off += n
        use.grad_works = None
        if ctx.counter is not None:
            ctx.counter["owner_reductions"] = ctx.counter.get("owner_reductions", 0) + 1
        return (None, None) + tuple(result)


class _ReplicaViews(torch.autograd.Function):
    """Second half, applied when the experts need the replicas: waits for the gather and returns one
    tensor per replica and local tensor (``[s * n + i]``: domain rank s's copy of tensor i), views of
    the gathered buffers. Backward: the replica gradients, laid end to end per dtype, go back to
    their owners in one asynchronous all-to-all per dtype, issued at once (with pacing, its
    inter-site bytes are a background transfer that the rank waits for at the end of the backward
    pass); the gradients handed to :class:`_OwnerSum` are the all-to-all's output buffers, which it
    reads only after waiting for the all-to-all."""

    @staticmethod
    def forward(ctx, use: _GatherUse, *buffers: Tensor):
        ctx.use = use
        gathered = use.gathered
        gathered.wait()
        local, out = gathered.local, [None] * len(gathered.local)
        for idx, buf in zip(gathered.buckets, buffers):
            off = 0
            for i in idx:
                n = local[i].numel()
                out[i] = buf[:, off:off + n].view(gathered.S, *local[i].shape)
                off += n
        return tuple(out[i][s] for s in range(gathered.S) for i in range(len(local)))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        use = ctx.use
        gathered, held = use.gathered, use.held
        S, local = gathered.S, gathered.local
        n = len(local)
        # send[s]: this rank's gradients of domain rank s's tensors, one [S, n] per dtype.
        sends = [torch.cat([(grads[s * n + i] if grads[s * n + i] is not None
                             else local[i].new_zeros(local[i].shape)).reshape(-1)
                            for s in range(S) for i in idx]).view(S, -1) for idx in gathered.buckets]
        if held is not None:
            if not held.boundary():  # not the step's last micro-batch: keep them, send nothing
                if held.sums is None:
                    held.sums = [x.to(torch.float32, copy=True) for x in sends]
                else:
                    for acc, x in zip(held.sums, sends):
                        acc.add_(x)
                held.count += 1
                use.grad_works = None
                return (None, ) * (1 + len(sends))
            if held.sums is not None:  # the last one: the step's sums go, in the gradients' dtype
                sends = [acc.add_(x).to(x.dtype) for acc, x in zip(held.sums, sends)]
                held.sums, held.count = None, 0
        parts, works = [], []
        nbytes = 0
        for send in sends:
            # After the all-to-all, part[j] = rank j's gradients of this rank's tensors.
            part = torch.empty_like(send)
            works.append(torch_dist.all_to_all_single(part, send, group=gathered.group, async_op=True))
            parts.append(part)
            nbytes += send[0].numel() * send.element_size()
        use.grad_works = works
        pacing = gathered.pacing
        if pacing is not None:
            device = local[0].device
            transfer = pacing.start(gathered.group, [nbytes] * S, [nbytes] * S, device)
            if transfer is not None:  # the gradients are the owner's once the bytes have crossed
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: pacing.finish(transfer, device))
        return (None, ) + tuple(parts)


class PartialMigrationDispatcher(ReferenceDispatcher):
    """The reference dispatcher over the whole EP group when each rank migrates only ``m`` of its
    ``L`` experts inside its domain (``0 < m < L``): its first m, or those :meth:`set_migrated` names.

    A token routed to a migrated expert goes to the rank of that expert's domain with the sender's
    offset, which holds a replica; a token routed to any other expert goes to its owner. So rank r
    hosts ``V = S * m + (L - m)`` virtual experts: the replicas of its domain's migrated experts
    (domain offset, then the owner's migrated experts in index order; its own among them) and its
    own experts that stay, in index order. Each expert index is mapped to its virtual expert on the
    sender (``route [E]``, which depends on the sender's offset) and the reference dispatch runs
    unchanged on ``G * V`` virtual experts: rows land expert-major, sources in rank order, and the
    combine sums each token's slots in slot order, as before.

    With ``track_load`` each dispatch also adds the tokens every EP rank routed to every expert
    (``[G, E]``, one all-gather of ``[E]`` counts, no host synchronisation) to :attr:`load`."""

    def __init__(self, num_experts: int, groups: "HybridGroups", local_experts: int, migrated: int):
        G, S, L, m = groups.ep_size, groups.domain_size, local_experts, migrated
        self.virtual_per_rank = V = S * m + (L - m)
        super().__init__(G * V, G, groups.ep_group, rank=groups.ep_rank)
        self.groups, self.real_experts, self.local_experts, self.migrated = groups, num_experts, L, m
        self.track_load = False
        #: ``[G, E]`` int64 tokens each EP rank routed to each expert since :meth:`take_load` (with track_load)
        self.load: Optional[Tensor] = None
        self._load_host = self._load_event = None
        self.set_migrated([list(range(m))] * G)

    def set_migrated(self, chosen: Sequence[Sequence[int]]) -> None:
        """Route to the replicas of ``chosen[o]`` (EP rank o's migrated local experts, m of them,
        ascending) from now on; every rank of the EP group must set the same ``chosen``."""
        G, S, L, m, V = (self.groups.ep_size, self.groups.domain_size, self.local_experts, self.migrated,
                         self.virtual_per_rank)
        if len(chosen) != G or any(list(c) != sorted(set(c)) or len(c) != m or not all(0 <= j < L for j in c)
                                   for c in chosen):
            raise ValueError(f"HybridEP: expected, for each of {G} ranks, {m} distinct ascending local experts "
                             f"in 0..{L - 1}, got {chosen!r}")
        self.chosen = [list(c) for c in chosen]
        moved = torch.zeros(G, L, dtype=torch.bool)
        for o, c in enumerate(self.chosen):
            moved[o, c] = True
        rank_moved = (moved.long().cumsum(1) - 1).reshape(-1)  # place among its owner's migrated experts
        rank_kept = ((~moved).long().cumsum(1) - 1).reshape(-1)  # ... among those that stay
        moved = moved.reshape(-1)
        owner = torch.arange(self.real_experts) // L
        dest = torch.where(moved, (owner // S) * S + self.groups.offset, owner)
        local = torch.where(moved, (owner % S) * m + rank_moved, S * m + rank_kept)
        self.route = dest * V + local  # [E]: this rank's virtual expert for each expert

    def _note_load(self, expert_idx: Tensor) -> None:
        E, G = self.real_experts, self.groups.ep_size
        rows = gather_counts(expert_counts(expert_idx, E), self.groups.ep_group, G)  # [G, E]
        self.load = rows if self.load is None else self.load + rows
        if self.load.is_cuda:  # a host copy that :meth:`take_load` reads without stalling the stream
            if self._load_host is None:
                self._load_host = torch.empty(G, E, dtype=torch.long, pin_memory=True)
            self._load_host.copy_(self.load, non_blocking=True)
            self._load_event = torch.cuda.Event()
            self._load_event.record()

    def take_load(self) -> Optional[List[List[int]]]:
        """The ``[G, E]`` tokens routed since the last call (None if none), and start counting anew."""
        if self.load is None:
            return None
        if self.load.is_cuda:
            self._load_event.synchronize()
            load = self._load_host.tolist()
        else:
            load = self.load.tolist()
        self.load = None
        return load

    @torch.compiler.disable  # as ReferenceDispatcher's
    def dispatch(self, x: Tensor, expert_idx: Tensor, capacity: Optional[int] = None):
        if self.track_load:
            self._note_load(expert_idx)
        route = self.route.to(expert_idx.device)
        virtual = torch.where(expert_idx >= 0, route[expert_idx.clamp_min(0).long()], expert_idx.long())
        return super().dispatch(x, virtual, capacity)


def hottest_experts(load: Sequence[Sequence[int]], groups: "HybridGroups", local_experts: int,
                    migrated: int) -> List[List[int]]:
    """For each EP rank (owner), the ``migrated`` of its ``local_experts`` experts whose migration
    keeps the most tokens from crossing to it: those the other ranks of its domain routed to them
    (``load [G, E]``, :attr:`PartialMigrationDispatcher.load`; a token from a domain peer to a
    migrated expert stays on that peer), ties to the smaller index; ascending. The same on every
    rank given the same ``load`` (:func:`ds_uniep.hybrid.model.hottest_choice`, which the cost model
    plans with)."""
    from .model import hottest_choice
    return hottest_choice(load, groups.ep_size, groups.domain_size, local_experts, migrated)


class HybridExperts:
    """Runs the domain's S * L experts on this rank from gathered weights (or, migrating ``m < L``
    experts per rank, the domain's S * m replicas and this rank's L - m other experts)."""

    def __init__(self, experts: Sequence[nn.Module], groups: HybridGroups, num_experts: int,
                 compression_ratio: Optional[float] = None, pacing: Optional[InterSitePacing] = None,
                 reuse_replicas: bool = False, boundary: Optional[Callable[[], bool]] = None,
                 name: str = "HybridEP", migrated: Optional[int] = None, choice: str = "hottest"):
        self.experts = list(experts)
        self.groups = groups
        L = len(self.experts)
        #: m: experts per rank migrated inside the domain (which: ``choice``); the others take tokens
        self.migrated = L if migrated is None else migrated
        if isinstance(self.migrated, bool) or not isinstance(self.migrated, int) or not 1 <= self.migrated <= L:
            raise ValueError(f"{name}: migrated experts per rank must be an integer in 1..{L}, got {migrated!r}")
        if choice not in MIGRATION_CHOICES:
            raise ValueError(f"{name}: migrated_experts must be one of {', '.join(MIGRATION_CHOICES)}, got {choice!r}")
        #: which m experts each rank migrates: "first" (its first m) or "hottest" (see :meth:`prefetch`)
        self.choice = choice if self.migrated < L else "first"
        self._chosen_at_step = None  # optimizer_steps() when the choice was last made ("hottest")
        self.compression_ratio = compression_ratio
        self.name = name
        #: Keep a gather for later forwards while the weights it copied are unchanged (see :meth:`prefetch`).
        self.reuse_replicas = reuse_replicas
        self._kept: Optional[tuple] = None  # (key, gather) with reuse_replicas
        #: With reuse_replicas and ``boundary`` (the engine's accumulation boundary), replica gradients
        #: are held until the step's last micro-batch and returned once (see :class:`HeldGradients`).
        self.held: Optional[HeldGradients] = None
        if reuse_replicas:
            if groups.domain_size > 1 and groups.vote_group is None:
                raise ValueError(f"{name}: reuse_replicas needs HybridGroups built with votes=True (the domain's "
                                 "ranks agree at each forward whether to gather)")
            self.set_boundary(boundary)
            optimizer_steps()  # counts steps from here on
        self.names = [n for n, _ in self.experts[0].named_parameters()]
        if self.migrated == L:  # every expert migrated: tokens cross domains only (the offset group)
            self.dispatcher = ReferenceDispatcher(num_experts, groups.ep_size // groups.domain_size,
                                                  groups.offset_group, rank=groups.domain)
        else:
            self.dispatcher = PartialMigrationDispatcher(num_experts, groups, L, self.migrated)
            self.dispatcher.track_load = self.choice == "hottest"
        self.pacing = None
        self.set_pacing(pacing)
        self._inflight: Optional[tuple] = None  # (DomainGather or CompressedGather, its _OwnerSum outputs)
        #: bytes this rank put on the links for the last gather it issued (``wire_bytes``)
        self.last_wire_bytes = 0
        #: that gather, weakly (alive while a forward's graph holds it; its buffers are not kept here)
        self.last_gather = lambda: None
        #: Backward passes that reduced replica gradients to their owners (``owner_reductions``), gathers
        #: issued (``gathers``) and forwards that reused a kept one (``reuses``); tests count them.
        self.counter: Dict[str, int] = {}

    def set_pacing(self, pacing: Optional[InterSitePacing]) -> None:
        """Send the gather, the gradient return and the token all-to-alls through ``pacing`` (None: off)."""
        self.pacing = pacing
        self.dispatcher.pacing = pacing

    def prefetch(self) -> None:
        """Issue the gather of the domain's expert weights now (asynchronous); :meth:`gather` waits
        for it. The layer calls this first in its forward, before the router. The autograd node that
        sums the returned replica gradients is made here too, so that it runs at the end of the
        layer's backward (see :class:`_OwnerSum`).

        With ``reuse_replicas`` the gather is kept, and a later forward whose weights are unchanged
        (:meth:`_weights_key`: no optimizer step, no in-place change of an expert parameter since)
        reuses it instead of gathering: gradient-accumulation micro-batches gather once per step.
        Each forward's backward returns its replica gradients to their owners, or, with a boundary
        (:class:`HeldGradients`), adds them to the step's sums until the step's last backward."""
        g = self.groups
        if self._inflight is not None:  # issued and never used (a forward that stopped early)
            self._inflight[0].gathered.wait()
        key = self._weights_key([p for e in self.experts for p in e.parameters()]) if self.reuse_replicas else None
        # The domain's ranks reuse or gather together: one rank whose weights changed (or that called
        # refresh_replicas) makes every rank of its domain gather, instead of gathering alone.
        if self.reuse_replicas and g.any_in_domain(self._kept is None or self._kept[0] != key):
            self._kept = None
        if self._kept is not None:
            gathered, self.last_wire_bytes = self._kept[1], 0
            self.counter["reuses"] = self.counter.get("reuses", 0) + 1
        else:
            if self.held is not None and self.held.sums is not None:
                raise RuntimeError(
                    f"{self.name}: the expert weights changed (an optimizer step, an in-place change or "
                    f"refresh_replicas()) while the replica gradients of {self.held.count} micro-batch(es) were "
                    "held for the step's last one, whose backward never came: under a DeepSpeed engine call "
                    "engine.step() after every engine.backward(); with UniEPMoE.set_accumulation_boundary, "
                    "its function must return True in the step's last backward")
            self._kept = None  # its buffers go before the new gather's are allocated
            self._choose()
            local = self._migrated_params()
            if self.compression_ratio is None:
                gathered = DomainGather(local, g.domain_group, g.domain_size, self.pacing)
            else:
                gathered = CompressedGather(local, g.domain_group, g.domain_size, self.pacing, len(self.names),
                                            g.offset, self.compression_ratio)
            self.last_wire_bytes = gathered.wire_bytes
            self.counter["gathers"] = self.counter.get("gathers", 0) + 1
            if self.reuse_replicas:
                self._kept = (key, gathered)
        self.last_gather = weakref.ref(gathered)
        use = _GatherUse(gathered, self.held)
        self._inflight = (use, _OwnerSum.apply(use, self.counter, *self._migrated_params()))

    @property
    def migrated_by_rank(self) -> Optional[List[List[int]]]:
        """Per EP rank, the local experts its domain peers hold replicas of now (the dispatcher's
        routes); None where every expert migrates."""
        return self.dispatcher.chosen if self.migrated < len(self.experts) else None

    @property
    def chosen(self) -> List[int]:
        """This rank's migrated experts (local indices, ascending), as the dispatcher routes now
        (``dispatcher.set_migrated`` changes them)."""
        by_rank = self.migrated_by_rank
        return list(range(self.migrated)) if by_rank is None else by_rank[self.groups.ep_rank]

    def _migrated_params(self) -> List[Tensor]:
        return [p for l in self.chosen for p in self.experts[l].parameters()]

    def _choose(self) -> None:
        """With ``choice`` "hottest", at a gather: migrate, on every rank, the experts that keep the
        most tokens local (:func:`hottest_experts`) by the tokens routed since the last choice, and
        route to them from now on. Without ``reuse_replicas`` every forward chooses (from the tokens
        of the forwards since the last); with it, the first gather after each optimizer step does
        (a domain that gathers again for another reason keeps the step's choice, so every rank of
        the EP group routes alike). No tokens seen yet: the first m stay."""
        if self.choice != "hottest":
            return
        step = optimizer_steps()
        if self.reuse_replicas and step == self._chosen_at_step:
            return
        load = self.dispatcher.take_load()
        self._chosen_at_step = step
        if load is None:
            return
        g = self.groups
        chosen = hottest_experts(load, g, len(self.experts), self.migrated)
        if chosen != self.dispatcher.chosen:
            self.dispatcher.set_migrated(chosen)
            self.counter["choices_changed"] = self.counter.get("choices_changed", 0) + 1
            if self.counter["choices_changed"] == 1 and g.ep_rank == 0:  # once: the choice follows the tokens
                logger.info(f"{self.name}: HybridEP migrates the hottest experts now (local indices per EP rank "
                            f"{chosen}); later changes are counted in counter['choices_changed']")

    def _weights_key(self, local: Sequence[Tensor]) -> tuple:
        """What a kept gather must match to be reused: the optimizer steps taken in this process, and
        each expert parameter's identity, storage, version counter (in-place changes), shape, dtype and
        device. The domain's ranks agree before using it (:meth:`HybridGroups.any_in_domain`): if
        any rank's key changed, every rank of the domain gathers."""
        return (optimizer_steps(), self.compression_ratio,
                tuple((id(p), p.data_ptr(), p._version, tuple(p.shape), p.dtype, p.device) for p in local))

    def set_boundary(self, boundary: Optional[Callable[[], bool]]) -> None:
        """Hold replica gradients until ``boundary()`` is true (None: return them at every backward)."""
        if self.held is not None and self.held.sums is not None:
            raise RuntimeError(f"{self.name}: the accumulation boundary changed while the replica gradients of "
                               f"{self.held.count} micro-batch(es) were held")
        self.held = HeldGradients(boundary) if boundary is not None else None

    def refresh_replicas(self) -> None:
        """Drop the kept gather: the next forward gathers again, on every rank of the domain (one
        rank's call is enough). Call it after changing expert weights in a way the reuse check does
        not see (through ``.data``, or a buffer the parameters view, without an optimizer step)."""
        self._kept = None

    def gather(self) -> List[Dict[str, Tensor]]:
        """``[S * m]`` parameter dicts of the migrated experts' replicas, domain expert order (owner
        offset, then local index)."""
        g = self.groups
        if self._inflight is None:
            self.prefetch()
        (use, buffers), self._inflight = self._inflight, None
        replicas = _ReplicaViews.apply(use, *buffers)  # [s * n + t]: rank s's copy of local tensor t
        P, m, S = len(self.names), self.migrated, g.domain_size
        n = P * m
        return [{name: replicas[s * n + l * P + i] for i, name in enumerate(self.names)}
                for s in range(S) for l in range(m)]

    def run(self, recv: Tensor, counts: Tensor, gemm: str = "torch") -> Tensor:
        """This rank's experts over their rows of ``recv``: the ``S * m`` replicas, then (migrating
        ``m < L``) its own ``L - m`` experts that stay, ``counts`` rows each. Recognised bf16 MLP
        experts run as one grouped GEMM per projection over all of them (on ``gemm``, as the plain
        EP path); other experts are called one by one with their weights."""
        params = self.gather()
        stay = [self.experts[j] for j in range(len(self.experts)) if j not in self.chosen]
        modules = [self.experts[l] for _ in range(self.groups.domain_size) for l in self.chosen] + stay
        params = params + [dict(e.named_parameters()) for e in stay]
        stacked = stack_experts(modules, recv.dtype, recv.device, params)
        if stacked is not None:
            return run_grouped(modules, recv, counts, gemm, stacked=stacked)
        outs = []
        for j, rows in enumerate(recv.split(counts.tolist())):
            out = functional_call(modules[j], params[j], (rows, ))
            if isinstance(out, tuple):
                out = out[0]
            outs.append(out)
        return torch.cat(outs) if outs else recv
