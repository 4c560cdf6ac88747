"""HybridEP's part of one ``UniEPMoE`` layer: its set-up from the ``"hybrid"`` block, the replan of
``"replan_after_steps"``, the replicas' accumulation boundary and the inter-site pacing.

The layer owns one :class:`HybridLayer` and delegates its hybrid methods to it. This module does
not import the layer: the layer hands over what it needs (its experts, EP group, config).
"""

import weakref
from typing import Callable, Optional

import torch
from torch import nn

from ..env import logger
from ..layout import expert_counts
from ..reference import gather_counts
from ..tensor_parallel import tp_context
from ..topology import node_size
from .model import predict_routed
from .planning import measure_expert_compute, migrated_experts, plan_domains, planner_inputs, with_compute
from .runtime import HybridExperts, HybridGroups, optimizer_steps


class HybridLayer:
    """HybridEP's state in one layer named ``name`` of ``num_experts`` experts, tokens of
    ``hidden_size``, top-``k`` routing. :attr:`experts` is None where the layer runs plain EP
    (HybridEP disabled, or domains of one rank)."""

    def __init__(self, name: str, num_experts: int, hidden_size: int, k: int) -> None:
        self.name, self.num_experts, self.hidden_size, self.k = name, num_experts, hidden_size, k
        #: the :class:`~ds_uniep.hybrid.runtime.HybridExperts` running the layer's experts; None: plain EP
        self.experts = None
        #: ``"replan_after_steps"`` pending: the planner's inputs, the optimizer step to plan at, the
        #: tokens per expert counted until then; None: none pending
        self.replan = None
        #: what the last replan found (see :meth:`replan_if_due`); None: none ran
        self.replanned = None
        #: the domain size and the migrated experts per rank running (set by :meth:`setup`)
        self.domain_size = self.migrated_experts = None
        #: emulated slow inter-site links (:meth:`set_pacing`); None: off
        self.pacing = None
        #: set_accumulation_boundary's function; None: the engine's, if any
        self.boundary = None
        self._engine_boundary = None
        self._config = self._modules = self._ep_group = None
        self._ep_size = 1

    def setup(self, config, experts: nn.ModuleList, ep_group, ep_size: int, find_engine: Callable[[], object],
              tensor_parallel_experts: bool) -> None:
        """Set up HybridEP from ``config`` (a UniEPConfig) for the layer's local ``experts`` over
        ``ep_group`` (the layer's ``set_deepspeed_parallelism``). ``find_engine()``: the DeepSpeed
        engine initialising the layer, or None; ``tensor_parallel_experts``: the layer's
        ``enable_expert_tensor_parallelism``. Collective over the world where HybridEP is enabled."""
        hyb = config.hybrid
        self.experts = None
        self.replan = None
        if not hyb.enabled:
            return
        self._config, self._modules, self._ep_group, self._ep_size = config, experts, ep_group, ep_size
        if tp_context()[1] > 1 and tensor_parallel_experts:
            # HybridEP moves whole experts between the ranks of a domain; a TP shard is not one.
            raise ValueError(f'{self.name}: "uniep": {{"hybrid": {{"enabled": true}}}} needs whole experts '
                             "on every rank: it cannot run with enable_expert_tensor_parallelism=True beside a "
                             "tensor-parallel mpu (replicated experts work: each TP rank runs HybridEP on its "
                             "slice of the tokens)")
        # Under a DeepSpeed engine, kept replicas serve a step's micro-batches: one gather and one
        # gradient return per gradient_accumulation_steps forwards (at the engine's boundary).
        engine = find_engine() if hyb.reuse_replicas else None
        micro, boundary = 1, self.boundary
        if engine is not None:
            micro = engine.gradient_accumulation_steps()
            if boundary is None:
                engine_ref = weakref.ref(engine)

                def boundary():
                    e = engine_ref()
                    return e is None or e.is_gradient_accumulation_boundary()
        S, L = hyb.domain_size, self._local_experts
        if S == "auto":
            local_world = node_size(config.topology)  # site_size auto: the ranks of one node (ds_uniep.topology)
            inputs = planner_inputs(hyb, ep_size, experts[0], self.hidden_size, self.k, config.max_tokens_per_rank, L,
                                    local_world, ep_group, pacing=self.pacing, num_microbatches=micro)
            S, m, plan = plan_domains(inputs, L)
            logger.info(f"{self.name}: HybridEP planner chose domain size {S}, {m} of {L} experts per rank "
                        f"migrated (predicted speedup {plan.speedup:.2f}x over plain EP)")
            if hyb.replan_after_steps:
                self.replan = {"inputs": inputs, "at": optimizer_steps() + hyb.replan_after_steps, "counts": None}
        else:
            m = L if hyb.migrated_fraction == "auto" else migrated_experts(hyb.migrated_fraction, L)
            if S > 1 and m == 0:
                logger.info(f"{self.name}: HybridEP migrated_fraction 0 migrates no expert: plain EP")
        self._engine_boundary = boundary
        self._build(S, m)

    @property
    def _local_experts(self) -> int:
        return self.num_experts // self._ep_size

    def _build(self, S: int, m: int, chosen=None) -> None:
        """HybridEP with domains of S ranks and m of each rank's experts migrated (``chosen``: which,
        per EP rank; else the configured choice's start), or plain EP where S or m is 1 or 0. Collective
        over the world (the domain groups are created)."""
        cfg = self._config
        hyb, L = cfg.hybrid, self._local_experts
        S = S if m > 0 else 1
        self.domain_size, self.migrated_experts = S, (m if S > 1 else 0)
        self.experts = None
        if S <= 1:
            return
        if cfg.compression.combine == "rank_partials":
            raise ValueError(f"{self.name}: compression.combine 'rank_partials' is not built for HybridEP, "
                             "whose domains combine in slot order; use 'slots'")
        boundary = self.boundary if self.boundary is not None else self._engine_boundary
        ratio = hyb.compression.ratio if hyb.compression.enabled else None
        groups = HybridGroups(self._ep_group, S, votes=hyb.reuse_replicas)
        self.experts = HybridExperts(self._modules, groups, self.num_experts, ratio, pacing=self.pacing,
                                     reuse_replicas=hyb.reuse_replicas, boundary=boundary, name=self.name,
                                     migrated=m, choice=hyb.migrated_experts)
        if chosen is not None and m < L:
            self.experts.dispatcher.set_migrated(chosen)
        reuse = ""
        if hyb.reuse_replicas:
            reuse = (", replicas gathered and their gradients returned once per optimizer step" if boundary
                     else ", replicas kept while the weights are unchanged (gradients returned every backward: "
                     "no DeepSpeed engine tells the accumulation boundary)")
        part = f", {m} of {L} experts per rank migrated ({hyb.migrated_experts})" if m < L else ""
        logger.info(f"{self.name}: HybridEP with domains of {S} ranks "
                    f"(reference transport{part}{', compressed migration' if ratio else ''}{reuse})")
        if cfg.autotune.enabled:  # nothing in HybridEP's path is a tuning knob
            logger.warning(f"{self.name}: uniep.autotune is not run under HybridEP (its reference "
                           "transport has no overlap or kernel knobs); the configured plan runs")

    def count_routes(self, expert_idx: torch.Tensor) -> None:
        """Add this forward's tokens per expert to what ``"replan_after_steps"`` plans with (on the
        device, no host synchronisation)."""
        c = expert_counts(expert_idx, self.num_experts)
        r = self.replan
        r["counts"] = c if r["counts"] is None else r["counts"] + c

    def replan_if_due(self, expert_gemm: Callable[[torch.device], str]) -> None:
        """``"replan_after_steps"``: once that many optimizer steps have run, plan again for the routing
        counted so far and switch to the plan where it predicts at least ``replan_min_gain`` less time
        than the current plan for that routing. The counts are all-gathered over the world and summed
        per EP rank over its EP groups, and (``"replan_compute": "measure"``) every rank's timing of its
        experts' forward (through ``expert_gemm(device)``'s GEMM) is gathered with them and averaged,
        so every rank plans alike (and creates the same groups)."""
        r = self.replan
        if optimizer_steps() < r["at"]:
            return
        self.replan = None
        E, G, L = self.num_experts, self._ep_size, self._local_experts
        cfg = self._config
        hyb = cfg.hybrid
        param = next(self._modules.parameters())
        device = param.device
        measure = hyb.replan_compute == "measure"
        # Per rank: tokens per expert, its EP rank, its experts' measured forward seconds (or 0).
        mine = torch.zeros(E + 2, dtype=torch.float64, device=device)
        if r["counts"] is not None:
            mine[:E] = r["counts"].to(device, torch.float64)
        mine[E] = torch.distributed.get_rank(self._ep_group)
        if measure:
            mine[E + 1] = measure_expert_compute(self._modules, cfg.max_tokens_per_rank * self.k, self.hidden_size,
                                                 param.dtype, device, expert_gemm(device))
        load = torch.zeros(G, E, dtype=torch.float64)
        world = gather_counts(mine, None, torch.distributed.get_world_size()).cpu()  # every rank of the world
        for t in world:
            load[int(t[E])] += t[:E]
        before = (self.domain_size, self.migrated_experts)
        if not load.sum() > 0:
            logger.warning(f"{self.name}: HybridEP replan_after_steps: no token was routed before step "
                           f"{r['at']}; the start-up plan stays (domain size {before[0]})")
            return
        # The same sum in the same order on every rank: every rank plans with the same numbers.
        inputs = with_compute(r["inputs"], float(world[:, E + 1].sum()) / len(world)) if measure else r["inputs"]
        wl, cl, _, ratio, elsize = inputs
        load = load.tolist()
        S, m, p = plan_domains(inputs, L, load=load, migrated_experts=hyb.migrated_experts)
        new_s = (p.hybrid if S > 1 else p.ep).total_s
        # The current plan, for the same routing (its migrated experts as they route now).
        current = None if self.experts is None else self.experts.migrated_by_rank
        now_s = predict_routed(wl, cl, load, before[0], current, ratio if before[0] > 1 else None, elsize).total_s
        gain = 1 - new_s / now_s
        switch = (S, m) != before and gain >= hyb.replan_min_gain
        #: what the last replan found: the plan for the routing seen ``(S, m, migrated or None)``, its
        #: predicted speedup over plain EP, its predicted gain over the current plan, whether the
        #: layer switched to it (a plan of the same S and m only updates which experts migrate), and
        #: the compute seconds it planned with (``replan_compute``: measured or estimated)
        self.replanned = {"plan": (S, m, p.migrated), "speedup": p.speedup, "gain": gain, "switched": switch,
                          "compute": hyb.replan_compute, "expert_compute_s": wl.expert_compute_s,
                          "pre_expert_compute_s": wl.pre_expert_compute_s}
        if (S, m) == before and self.experts is not None and p.migrated is not None:
            self.experts.dispatcher.set_migrated(p.migrated)
        elif switch:
            self._build(S, m, p.migrated)
        if torch.distributed.get_rank() == 0:
            planned = (f"domain size {S}, {m} of {L} experts per rank migrated"
                       + (f" (local indices per EP rank {p.migrated})" if p.migrated is not None else "")
                       + f", predicted speedup {p.speedup:.2f}x over plain EP and {100 * gain:.1f}% less time than "
                       f"the current plan (domain size {before[0]}, {before[1]} migrated), with the experts' forward "
                       f"{'measured' if measure else 'estimated'} at {wl.expert_compute_s * 1e3:.3f} ms")
            what = "switched" if switch else "kept the current plan" if (S, m) != before else "the same plan"
            logger.info(f"{self.name}: HybridEP planned again for the routing of the first "
                        f"{hyb.replan_after_steps} steps: {planned}; {what}"
                        + (f" (gain under replan_min_gain {hyb.replan_min_gain})" if what.startswith("kept") else ""))

    def set_accumulation_boundary(self, boundary: Optional[Callable[[], bool]], config) -> None:
        """``UniEPMoE.set_accumulation_boundary`` under the layer's ``config``."""
        if boundary is not None and not callable(boundary):
            raise TypeError(f"{self.name}: set_accumulation_boundary takes a function returning bool "
                            f"or None, got {boundary!r}")
        self.boundary = boundary
        h = self.experts
        if h is not None and h.reuse_replicas:
            h.set_boundary(boundary)
        elif boundary is not None and config.hybrid.enabled and not config.hybrid.reuse_replicas:
            logger.warning(f'{self.name}: set_accumulation_boundary does nothing without "uniep": {{"hybrid": '
                           '{"reuse_replicas": true}}: replica gradients return at every backward')

    def refresh_replicas(self) -> None:
        """``UniEPMoE.refresh_replicas``."""
        if self.experts is not None:
            self.experts.refresh_replicas()

    def set_pacing(self, pacing) -> None:
        """Run HybridEP's traffic between sites through ``pacing`` from now on (None: unpaced)."""
        self.pacing = pacing
        if self.experts is not None:
            self.experts.set_pacing(pacing)
