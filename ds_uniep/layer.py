"""``UniEPMoE``: a drop-in for ``deepspeed.moe.layer.MoE``.

The module tree is DeepSpeed's own (``deepspeed_moe.gate.wg``,
``deepspeed_moe.experts.deepspeed_experts.<i>``, ``mlp`` and ``coefficient``
with ``use_residual``), so checkpoints load both ways, the engine finds the
layer by ``isinstance`` and builds MoE parameter groups as usual. Only the
forward differs: DeepSpeed's gate decides the routing, then a ds_uniep
dispatcher moves rows in the deterministic layout (``layout.py``), the local
experts run, and the combine adds each token's slots in slot order in fp32.

With ``"autotune": {"enabled": true}`` a layer tunes itself on its first
forward with a new (tokens per rank, dtype, device): see :meth:`UniEPMoE.forward`.
"""

import inspect
import itertools
import numbers
import os
import sys
import weakref
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from deepspeed.moe.layer import MoE
from torch import Tensor, nn
from torch.nn import functional as F

from . import backend as backend_mod
from . import gating
from .config import UniEPConfig
from .env import logger
from .experts import pack_experts, row_ends, run_experts, run_grouped, stack_experts
from .pipelined import pipeline_partition, run_pipelined
from .reference import ReferenceDispatcher
from .tensor_parallel import even_sizes, run_tp_sharded_experts, tp_context, tp_gather, tp_slice

_layer_ids = itertools.count()


class UniEPMoE(MoE):
    """Mixture-of-Experts layer with DeepSpeed's constructor and forward contract.

    Arguments are those of ``deepspeed.moe.layer.MoE`` (any ``k`` >= 1, as DeepSpeed's
    ``TopKGate``), plus ``config``: a :class:`UniEPConfig`, a ds_config path or dict
    holding a ``"uniep"`` block, or the block itself. Without ``config`` the layer
    takes the ``"uniep"`` block of the ds_config that ``deepspeed.initialize`` gets. ``forward(hidden_states
    [..., hidden_size], used_token=None)`` returns ``(output, l_aux, exp_counts)``.
    """

    def __init__(self,
                 hidden_size: int,
                 expert: nn.Module,
                 num_experts: int = 1,
                 ep_size: int = 1,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4,
                 use_residual: bool = False,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True,
                 *,
                 config: Union[UniEPConfig, str, os.PathLike, Mapping[str, Any], None] = None) -> None:
        hidden_size, num_experts, ep_size, k = _check_args(hidden_size, expert, num_experts, ep_size, k,
                                                           noisy_gate_policy)
        # Without config=, the ds_config's "uniep" block is read when deepspeed.initialize sets up
        # the layer (set_deepspeed_parallelism), so swapping the class is the only change a model needs.
        self._config_from_engine = config is None
        self.uniep_config = UniEPConfig.coerce(config)
        #: the block as configured; ``uniep_config`` is it with the applied plan's knobs (set_plan),
        #: and tuning a new shape starts from this one, not from the last shape's winner
        self.configured_config = self.uniep_config
        backend_mod.check_requested(self.uniep_config.backend)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        self.hidden_size = hidden_size
        self.k = k
        self.layer_name = f"UniEPMoE[{next(_layer_ids)}]"
        if self.uniep_config.expert_gemm == "uniep":
            self._gemm_configs()  # tile sizes ds_uniep's GEMM is not built with: said now
        self._dispatchers = {}
        self._backend_by_device = {}
        self._hybrid = None
        self._replan = None  # "replan_after_steps" pending (set_deepspeed_parallelism)
        self.hybrid_replanned = None
        self._hybrid_boundary = None
        self._said_used_token = False  # the k >= 2 used_token warning, once
        self._pacing = None  # emulated slow inter-site links (set_inter_site_pacing); None: off
        self._accumulation_boundary = None  # set_accumulation_boundary; None: the engine's, if any
        self._uniep_gemm_ok = set()  # devices where expert_gemm "uniep" was found usable
        self._stack_cache = {}  # how this layer's expert parameters stack (ds_uniep.experts.stack_experts)
        #: the megakernel's sequential and fused schedules queue their dispatch between the gate's routes
        #: and the rest of the gate (see _forward_dispatch_early); False: after the whole gate
        self.route_early = True
        # Autotune: the plan chosen per (T, dtype, device), and what tuning found (TuneResult).
        self._tuned_plans: Dict[Tuple[int, torch.dtype, torch.device], Any] = {}
        self.autotune_results: Dict[Tuple[int, torch.dtype, torch.device], Any] = {}
        self._autotuning = False
        self._applied_plan = None
        if use_tutel:
            logger.info(f"{self.layer_name}: use_tutel is accepted; ds_uniep's dispatch replaces Tutel's")
        pack_experts(self.deepspeed_moe.experts.deepspeed_experts)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .bfloat16() give every parameter new storage: pack the experts again, so
        # their grouped GEMMs read the weights in place (see ds_uniep.experts.pack_experts).
        out = super()._apply(fn, *args, **kwargs)
        pack_experts(self.deepspeed_moe.experts.deepspeed_experts)
        return out

    # ------------------------------------------------------------------ groups
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if torch.distributed.is_initialized() and self.ep_size > torch.distributed.get_world_size():
            raise ValueError(f"{self.layer_name}: ep_size={self.ep_size} is larger than the world size "
                             f"{torch.distributed.get_world_size()}")
        if self._config_from_engine:
            engine = _calling_engine()
            if engine is not None:
                self.uniep_config = self.configured_config = UniEPConfig.from_engine(engine)
                backend_mod.check_requested(self.uniep_config.backend)
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_)
        self._dispatchers.clear()
        self._tuned_plans.clear()  # tuned for another group (or config): tune again
        self._applied_plan = None
        hyb = self.uniep_config.hybrid
        self._hybrid = None
        self._replan = None
        if not hyb.enabled:
            return
        from .hybrid.runtime import migrated_experts, optimizer_steps, plan_domains, planner_inputs
        if tp_context()[1] > 1 and self.enable_expert_tensor_parallelism:
            # HybridEP moves whole experts between the ranks of a domain; a TP shard is not one.
            raise ValueError(f'{self.layer_name}: "uniep": {{"hybrid": {{"enabled": true}}}} needs whole experts '
                             "on every rank: it cannot run with enable_expert_tensor_parallelism=True beside a "
                             "tensor-parallel mpu (replicated experts work: each TP rank runs HybridEP on its "
                             "slice of the tokens)")
        # Under a DeepSpeed engine, kept replicas serve a step's micro-batches: one gather and one
        # gradient return per gradient_accumulation_steps forwards (at the engine's boundary).
        engine = _calling_engine() if hyb.reuse_replicas else None
        micro, boundary = 1, self._accumulation_boundary
        if engine is not None:
            micro = engine.gradient_accumulation_steps()
            if boundary is None:
                engine_ref = weakref.ref(engine)

                def boundary():
                    e = engine_ref()
                    return e is None or e.is_gradient_accumulation_boundary()
        S, L = hyb.domain_size, self.num_local_experts
        if S == "auto":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))
            inputs = planner_inputs(hyb, self.ep_size, self.deepspeed_moe.experts.deepspeed_experts[0],
                                    self.hidden_size, self.k, self.uniep_config.max_tokens_per_rank, L, local_world,
                                    self.ep_group, pacing=self._pacing, num_microbatches=micro)
            S, m, plan = plan_domains(inputs, L)
            logger.info(f"{self.layer_name}: HybridEP planner chose domain size {S}, {m} of {L} experts per rank "
                        f"migrated (predicted speedup {plan.speedup:.2f}x over plain EP)")
            if hyb.replan_after_steps:
                #: planning again for the routing seen (``"replan_after_steps"``): the planner's inputs,
                #: the optimizer step to plan at, the tokens per expert counted until then
                self._replan = {"inputs": inputs, "at": optimizer_steps() + hyb.replan_after_steps, "counts": None}
        else:
            m = L if hyb.migrated_fraction == "auto" else migrated_experts(hyb.migrated_fraction, L)
            if S > 1 and m == 0:
                logger.info(f"{self.layer_name}: HybridEP migrated_fraction 0 migrates no expert: plain EP")
        self._hybrid_boundary = boundary
        self._build_hybrid(S, m)

    def _build_hybrid(self, S: int, m: int, chosen=None) -> None:
        """HybridEP with domains of S ranks and m of each rank's experts migrated (``chosen``: which,
        per EP rank; else the configured choice's start), or plain EP where S or m is 1 or 0. Collective
        over the world (the domain groups are created)."""
        from .hybrid.runtime import HybridExperts, HybridGroups
        hyb, L = self.uniep_config.hybrid, self.num_local_experts
        S = S if m > 0 else 1
        self.hybrid_domain_size, self.hybrid_migrated_experts = S, (m if S > 1 else 0)
        self._hybrid = None
        if S > 1:
            if self.uniep_config.compression.combine == "rank_partials":
                raise ValueError(f"{self.layer_name}: compression.combine 'rank_partials' is not built for HybridEP, "
                                 "whose domains combine in slot order; use 'slots'")
            boundary = self._accumulation_boundary if self._accumulation_boundary is not None else \
                self._hybrid_boundary
            ratio = hyb.compression.ratio if hyb.compression.enabled else None
            groups = HybridGroups(self.ep_group, S, votes=hyb.reuse_replicas)
            self._hybrid = HybridExperts(self.deepspeed_moe.experts.deepspeed_experts, groups, self.num_experts, ratio,
                                         pacing=self._pacing, reuse_replicas=hyb.reuse_replicas,
                                         boundary=boundary, name=self.layer_name, migrated=m,
                                         choice=hyb.migrated_experts)
            if chosen is not None and m < L:
                self._hybrid.dispatcher.set_migrated(chosen)
            reuse = ""
            if hyb.reuse_replicas:
                reuse = (", replicas gathered and their gradients returned once per optimizer step" if boundary
                         else ", replicas kept while the weights are unchanged (gradients returned every backward: "
                         "no DeepSpeed engine tells the accumulation boundary)")
            part = f", {m} of {L} experts per rank migrated ({hyb.migrated_experts})" if m < L else ""
            logger.info(f"{self.layer_name}: HybridEP with domains of {S} ranks "
                        f"(reference transport{part}{', compressed migration' if ratio else ''}{reuse})")
            if self.uniep_config.autotune.enabled:  # nothing in HybridEP's path is a tuning knob
                logger.warning(f"{self.layer_name}: uniep.autotune is not run under HybridEP (its reference "
                               "transport has no overlap or kernel knobs); the configured plan runs")

    def _count_routes(self, expert_idx: torch.Tensor) -> None:
        """Add this forward's tokens per expert to what ``"replan_after_steps"`` plans with (on the
        device, no host synchronisation)."""
        from .layout import expert_counts
        c = expert_counts(expert_idx, self.num_experts)
        r = self._replan
        r["counts"] = c if r["counts"] is None else r["counts"] + c

    def _replan_if_due(self) -> None:
        """``"replan_after_steps"``: once that many optimizer steps have run, plan again for the routing
        counted so far and switch to the plan where it predicts at least ``replan_min_gain`` less time
        than the current plan for that routing. The counts are all-gathered over the world and summed
        per EP rank over its EP groups, and (``"replan_compute": "measure"``) every rank's timing of its
        experts' forward is gathered with them and averaged, so every rank plans alike (and creates the
        same groups)."""
        from .hybrid.model import predict_routed
        from .hybrid.runtime import measure_expert_compute, optimizer_steps, plan_domains, with_compute
        from .reference import gather_counts
        r = self._replan
        if optimizer_steps() < r["at"]:
            return
        self._replan = None
        E, G, L = self.num_experts, self.ep_size, self.num_local_experts
        hyb = self.uniep_config.hybrid
        param = next(self.deepspeed_moe.experts.parameters())
        device = param.device
        measure = hyb.replan_compute == "measure"
        # Per rank: tokens per expert, its EP rank, its experts' measured forward seconds (or 0).
        mine = torch.zeros(E + 2, dtype=torch.float64, device=device)
        if r["counts"] is not None:
            mine[:E] = r["counts"].to(device, torch.float64)
        mine[E] = torch.distributed.get_rank(self.ep_group)
        if measure:
            mine[E + 1] = measure_expert_compute(self.deepspeed_moe.experts.deepspeed_experts,
                                                 self.uniep_config.max_tokens_per_rank * self.k, self.hidden_size,
                                                 param.dtype, device, self._expert_gemm(device))
        load = torch.zeros(G, E, dtype=torch.float64)
        world = gather_counts(mine, None, torch.distributed.get_world_size()).cpu()  # every rank of the world
        for t in world:
            load[int(t[E])] += t[:E]
        before = (self.hybrid_domain_size, self.hybrid_migrated_experts)
        if not load.sum() > 0:
            logger.warning(f"{self.layer_name}: HybridEP replan_after_steps: no token was routed before step "
                           f"{r['at']}; the start-up plan stays (domain size {before[0]})")
            return
        # The same sum in the same order on every rank: every rank plans with the same numbers.
        inputs = with_compute(r["inputs"], float(world[:, E + 1].sum()) / len(world)) if measure else r["inputs"]
        wl, cl, _, ratio, elsize = inputs
        load = load.tolist()
        S, m, p = plan_domains(inputs, L, load=load, migrated_experts=hyb.migrated_experts)
        new_s = (p.hybrid if S > 1 else p.ep).total_s
        # The current plan, for the same routing (its migrated experts as they route now).
        current = None if self._hybrid is None else self._hybrid.migrated_by_rank
        now_s = predict_routed(wl, cl, load, before[0], current, ratio if before[0] > 1 else None, elsize).total_s
        gain = 1 - new_s / now_s
        switch = (S, m) != before and gain >= hyb.replan_min_gain
        #: what the last replan found: the plan for the routing seen ``(S, m, migrated or None)``, its
        #: predicted speedup over plain EP, its predicted gain over the current plan, whether the
        #: layer switched to it (a plan of the same S and m only updates which experts migrate), and
        #: the compute seconds it planned with (``replan_compute``: measured or estimated)
        self.hybrid_replanned = {"plan": (S, m, p.migrated), "speedup": p.speedup, "gain": gain, "switched": switch,
                                 "compute": hyb.replan_compute, "expert_compute_s": wl.expert_compute_s,
                                 "pre_expert_compute_s": wl.pre_expert_compute_s}
        if (S, m) == before and self._hybrid is not None and p.migrated is not None:
            self._hybrid.dispatcher.set_migrated(p.migrated)
        elif switch:
            self._build_hybrid(S, m, p.migrated)
        if torch.distributed.get_rank() == 0:
            planned = (f"domain size {S}, {m} of {L} experts per rank migrated"
                       + (f" (local indices per EP rank {p.migrated})" if p.migrated is not None else "")
                       + f", predicted speedup {p.speedup:.2f}x over plain EP and {100 * gain:.1f}% less time than "
                       f"the current plan (domain size {before[0]}, {before[1]} migrated), with the experts' forward "
                       f"{'measured' if measure else 'estimated'} at {wl.expert_compute_s * 1e3:.3f} ms")
            what = "switched" if switch else "kept the current plan" if (S, m) != before else "the same plan"
            logger.info(f"{self.layer_name}: HybridEP planned again for the routing of the first "
                        f"{hyb.replan_after_steps} steps: {planned}; {what}"
                        + (f" (gain under replan_min_gain {hyb.replan_min_gain})" if what.startswith("kept") else ""))

    def set_accumulation_boundary(self, boundary) -> None:
        """With ``"hybrid": {"reuse_replicas": true}`` in a training loop without a DeepSpeed engine:
        ``boundary()`` says whether the backward running now is the last micro-batch of the optimizer
        step, so that the replica gradients are summed over the step and returned once, there (None:
        returned at every backward). Under a DeepSpeed engine its accumulation boundary is used
        unless this was set. ``domain_size: "auto"`` plans with one micro-batch per step here (no
        engine tells how many)."""
        if boundary is not None and not callable(boundary):
            raise TypeError(f"{self.layer_name}: set_accumulation_boundary takes a function returning bool "
                            f"or None, got {boundary!r}")
        self._accumulation_boundary = boundary
        h = self._hybrid
        if h is not None and h.reuse_replicas:
            h.set_boundary(boundary)
        elif boundary is not None and self.uniep_config.hybrid.enabled and not self.uniep_config.hybrid.reuse_replicas:
            logger.warning(f'{self.layer_name}: set_accumulation_boundary does nothing without "uniep": {{"hybrid": '
                           '{"reuse_replicas": true}}: replica gradients return at every backward')

    def refresh_replicas(self) -> None:
        """With ``"hybrid": {"reuse_replicas": true}``: gather the domain's experts again at the next
        forward, on every rank of this rank's domain (calling it on one rank is enough). Call it after
        changing expert weights without an optimizer step and without an in-place operation on the
        parameters themselves (through ``.data``, or a buffer they view), which the reuse check does
        not see. Nothing to do otherwise."""
        if self._hybrid is not None:
            self._hybrid.refresh_replicas()

    def set_inter_site_pacing(self, pacing) -> None:
        """Send this layer's traffic between sites through ``pacing`` (a
        :class:`ds_uniep.hybrid.runtime.InterSitePacing`), or stop with None.

        For measuring plain EP and HybridEP over slow links on one host: the token all-to-alls
        (plain EP and HybridEP alike), HybridEP's expert gather and gradient return, and the
        bandwidth measurement of ``domain_size: "auto"`` then hold each rank for the bytes it
        exchanged with other sites over the pacing's bandwidth (the gather and the gradient
        return as background transfers: see ``InterSitePacing``). Numbers do not change. Reference
        backend only. Call it before ``set_deepspeed_parallelism`` (``deepspeed.initialize``) so that
        a measured inter-site bandwidth goes through it too."""
        self._pacing = pacing
        self._dispatchers.clear()
        if self._hybrid is not None:
            self._hybrid.set_pacing(pacing)

    def set_plan(self, plan) -> None:
        """Run the next forward under ``plan`` (a :class:`ds_uniep.tuning.Plan`): its overlap knobs and
        dispatch dtype replace the config's. A megakernel dispatcher takes a new ``num_comm_sms`` as
        it is (the block count of its copy kernels; under the fused schedule its fused dispatch's,
        the other copy kernels taking every SM), the plan's roles and its combine chunks and queue; a
        new dispatch dtype rebuilds the dispatchers."""
        self._applied_plan = plan
        cfg = plan.apply(self.uniep_config)
        for name in set(self._backend_by_device.values()):
            self._check_combine_mode(cfg, name)
        if cfg == self.uniep_config and _comm_blocks(cfg) == _comm_blocks(self.uniep_config):
            return
        rebuild = cfg.compression != self.uniep_config.compression
        self.uniep_config = cfg
        if rebuild:
            self._dispatchers.clear()
            return
        for d in self._dispatchers.values():
            if hasattr(d, "set_comm_sms"):
                d.set_comm_sms(cfg.overlap.num_comm_sms, fused=cfg.overlap.schedule == "fused")
                d.interleaved = cfg.overlap.roles == "interleaved"
                d.signal_granularity = cfg.overlap.signal_granularity
                d.combine_chunks, d.combine_push_queue = cfg.overlap.combine_chunks, cfg.overlap.combine_queue

    @property
    def ep_group(self):
        return self.deepspeed_moe.ep_group

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """``hidden_states``: ``[..., M]``; returns ``(output [..., M], l_aux [], exp_counts [E])``.

        With ``autotune.enabled``, the first forward with a new (T tokens this rank moves, dtype,
        device) first looks the plan up in the cache (GPU, ep, T, M, F, E, k, dtype, backend,
        version); on a miss every rank of the expert-parallel group times the plans the backend acts
        on (``ds_uniep.tuning``) on a copy of this input, within ``autotune.budget_s``, and they agree
        on one, which is cached. The layer then runs under that plan. Tuning leaves the parameters,
        their ``.grad``, the RNG states and the caller's autograd graph as they were, and never
        changes the numbers (every plan it may choose gives bitwise the same results; FP8 dispatch
        only with ``allow_numerics_change``). Every rank of the group must see the same T on that
        forward, as with a fixed micro-batch."""
        if not self.uniep_config.enabled:
            return super().forward(hidden_states, used_token)
        if used_token is not None:
            self._check_used_token(hidden_states, used_token)
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"{self.layer_name}: input hidden size {hidden_states.shape[-1]} does not match "
                             f"hidden_size={self.hidden_size} (input shape {tuple(hidden_states.shape)})")
        if self.uniep_config.autotune.enabled and not self._autotuning and self._hybrid is None:
            self._autotune(hidden_states)
        moe = self.deepspeed_moe
        x = hidden_states.reshape(-1, self.hidden_size)
        if self._replan is not None:  # "replan_after_steps": plan again once its steps have run
            self._replan_if_due()
        if self._hybrid is not None:  # HybridEP: the domain's replicas travel while the gate and dispatch run
            self._hybrid.prefetch()
        elif self.route_early and self._replan is None:  # (a replan counts the routes below)
            early = self._forward_dispatch_early(hidden_states, x, used_token)
            if early is not None:
                return early
        # 1. DeepSpeed's gate: routes [k, T] (-1 = dropped), gates [k, T] fp32, l_aux, exp_counts (the
        # dropless top-2/top-k paths skip the locations and capacity they do not use: ds_uniep.gating).
        l_aux, capacity, route_idx, route_gates, exp_counts = gating.route(moe.gate, x, used_token)
        moe.l_aux, moe.exp_counts = l_aux, exp_counts
        expert_idx, gates = route_idx.t(), route_gates.t()
        if self._replan is not None:
            self._count_routes(expert_idx)
        tp_group, tp, tp_rank = tp_context()
        if tp > 1:  # this TP rank moves only its slice of the (replicated) tokens
            sizes = even_sizes(x.shape[0], tp)
            x = tp_slice(x, sizes, tp_rank, tp_group)
            gates = tp_slice(gates, sizes, tp_rank, tp_group)
            off = sum(sizes[:tp_rank])
            expert_idx = expert_idx[off:off + sizes[tp_rank]]
        # 2-4. Dispatch, local experts, combine.
        dispatcher = self._hybrid.dispatcher if self._hybrid is not None else self._dispatcher(x)
        stacked = None
        if self._hybrid is None and not (tp > 1 and self.enable_expert_tensor_parallelism):
            # Stacked now, so that this host work is done by the time the dispatch's row count arrives.
            stacked = stack_experts(moe.experts.deepspeed_experts, x.dtype, x.device, cache=self._stack_cache)
        if self._pipelines(dispatcher, stacked is not None):
            # The pipelined schedule: the experts in chunks, each chunk's rows copied back while the
            # next computes (ds_uniep.pipelined); the same bits as the sequential schedule.
            experts, gemm = moe.experts.deepspeed_experts, self._expert_gemm(x.device)
            # With ds_uniep's GEMM and num_comm_sms set (in the block or by a tuning plan), the GEMMs
            # leave that many SMs to SM-store copies; else the chunks' rows travel on the copy engines
            # and the GEMMs take every SM (torch's always do).
            copy_blocks, sm_count = pipeline_partition(gemm, _comm_blocks(self.uniep_config) or 0, x.device)

            configs = self._gemm_configs() if gemm == "uniep" else None

            def run_chunk(rows, counts, offs, a, b):
                part = experts[a:b]
                return run_grouped(part, rows, counts, gemm, offs=offs, sm_count=sm_count, configs=configs,
                                   stacked=stack_experts(part, x.dtype, x.device, cache=self._stack_cache))
            output = run_pipelined(dispatcher, x, expert_idx, gates, self.uniep_config.overlap.num_chunks, run_chunk,
                                   copy_blocks)
            return self._finish(output, hidden_states, sizes if tp > 1 else None, tp_rank, tp_group, l_aux,
                                exp_counts)
        if self._fuses(dispatcher, stacked is not None):
            # The fused schedule: the rows travel one destination at a time from a few SMs while the
            # first expert GEMM runs on the others, each run of its tiles as soon as the latest source
            # among the run's rows has arrived; then the sequential rest. The same bits as sequential.
            if self.uniep_config.overlap.fused_dispatch:
                self._request_fused(dispatcher, stacked)
            recv, local_counts, handle = dispatcher.dispatch(x, expert_idx, gates)
            output = self._experts_and_combine(dispatcher, x, recv, local_counts, stacked, True, gates, handle)
            return self._finish(output, hidden_states, sizes if tp > 1 else None, tp_rank, tp_group, l_aux,
                                exp_counts)
        if isinstance(dispatcher, ReferenceDispatcher):
            # With drop_tokens the reference exchanges capacity-padded buffers, as DeepSpeed does.
            cap = int(capacity) if moe.gate.drop_tokens else None
            recv, local_counts, handle = dispatcher.dispatch(x, expert_idx, cap)
        else:  # the megakernel's NVLinkDispatcher: it stages the gates only under arrival ordering
            recv, local_counts, handle = dispatcher.dispatch(x, expert_idx, gates)
        if self._hybrid is not None:
            y = self._hybrid.run(recv, local_counts, gemm=self._expert_gemm(recv.device))
        elif tp > 1 and self.enable_expert_tensor_parallelism:
            cf = self.uniep_config.commfuse
            y = run_tp_sharded_experts(moe.experts.deepspeed_experts, recv, local_counts, tp_group, tp_rank, tp,
                                       cf.schedule, cf.transport, cf.num_chunks)
        else:
            y = self._local_experts(dispatcher, recv, local_counts, stacked, False)
        output = dispatcher.combine(y, gates, handle)
        return self._finish(output, hidden_states, sizes if tp > 1 else None, tp_rank, tp_group, l_aux, exp_counts)

    def _check_used_token(self, hidden_states: Tensor, used_token: Tensor) -> None:
        """``used_token`` must hold one value per token; only the top-1 gate reads it (as in DeepSpeed):
        said once at k >= 2."""
        T = hidden_states.numel() // max(hidden_states.shape[-1], 1)
        if used_token.numel() != T:
            raise ValueError(f"{self.layer_name}: used_token has {used_token.numel()} values (shape "
                             f"{tuple(used_token.shape)}) for {T} tokens; it needs one per token")
        if self.k > 1 and not self._said_used_token:
            self._said_used_token = True
            logger.warning(f"{self.layer_name}: used_token is read only by DeepSpeed's top-1 gate; with k = "
                           f"{self.k} it has no effect (as in deepspeed.moe.layer.MoE)")

    def _forward_dispatch_early(self, hidden_states: Tensor, x: Tensor, used_token: Optional[Tensor]):
        """The megakernel's sequential and fused schedules with the dispatch queued as soon as the
        gate's routes exist (``NVLinkDispatcher.dispatch_begin``): the counts exchange, the layout and
        the rows' stores run on the device while the host stacks the experts' weights and reads the
        row count. Then the sequential schedule's experts, or the fused schedule's first expert GEMM
        (with ``overlap.fused_dispatch``), are queued before the rest of the gate (gates, auxiliary
        loss, counts: ``gating.route_split``), whose kernels run behind them: issued first, that
        host work left the device idle. With rank partials (the dispatch stages the gates) and in the
        fused schedule without the fused dispatch, the rest of the gate comes before the dispatch.
        The fused schedule stacks before the routes (its dispatch needs the stacked first projection
        when it is queued). The same operations on the same tensors, so the same bits. None where
        this does not apply (the pipelined schedule, the reference backend, tensor parallelism,
        arrival ordering, a gate other than DeepSpeed's dropless top-2/top-k): the general path
        runs."""
        schedule = self.uniep_config.overlap.schedule
        if schedule not in ("sequential", "fused") or tp_context()[1] > 1:
            return None
        dispatcher = self._dispatcher(x)
        if isinstance(dispatcher, ReferenceDispatcher) or dispatcher.ordering != "layout":
            return None
        moe = self.deepspeed_moe
        if not gating.splits(moe.gate):
            return None
        x = x.contiguous()  # the very tensor the dispatch's kernels read, checked again by dispatch()
        experts = moe.experts.deepspeed_experts
        stacked = fused = None
        if schedule == "fused":
            # Before the routes: this host work then overlaps the work queued before this layer, not
            # the gap between the routes and the dispatch (the fused dispatch needs the stacked first
            # projection when it is queued).
            stacked = stack_experts(experts, x.dtype, x.device, cache=self._stack_cache)
            fused = self._fuses(dispatcher, stacked is not None)
        expert_idx, finish = gating.route_split(moe.gate, x, used_token)
        fused_dispatch = bool(fused) and self.uniep_config.overlap.fused_dispatch
        if fused_dispatch:
            self._request_fused(dispatcher, stacked)
        dispatcher.dispatch_begin(x, expert_idx)
        # The fused dispatch moves most rows inside the first expert GEMM, so little device work is
        # queued ahead of it: that GEMM is queued (once the row count is read) before the rest of the
        # gate, whose kernels then run after it. Issued first, the gate's host work left the device
        # idle before the GEMM. The sequential schedule's experts need no gates either (only its
        # combine does), so there the dispatch and the experts come before the rest of the gate. The
        # dispatch needs no gates then (they are staged at dispatch only for rank partials), and the
        # same operations on the same tensors give the same bits in either order.
        gemm_first = not dispatcher.rank_partials and (fused_dispatch or schedule == "sequential")
        experts_first = gemm_first and schedule == "sequential"
        if experts_first:
            stacked = stack_experts(experts, x.dtype, x.device, cache=self._stack_cache)
            # The grouped GEMMs' row ends, queued before dispatch() waits for the row count (where
            # the host waits for the peers anyway), not after it.
            offs = row_ends(dispatcher.pending_local_counts()) if stacked is not None else None
        if gemm_first:
            recv, local_counts, handle = dispatcher.dispatch(x, expert_idx, None)
        if experts_first:
            y = self._local_experts(dispatcher, recv, local_counts, stacked, False, offs=offs)
        l_aux, gates, exp_counts = finish()
        moe.l_aux, moe.exp_counts = l_aux, exp_counts
        if not gemm_first:
            if schedule != "fused":
                stacked = stack_experts(experts, x.dtype, x.device, cache=self._stack_cache)
            recv, local_counts, handle = dispatcher.dispatch(x, expert_idx, gates)
        if experts_first:
            output = dispatcher.combine(y, gates, handle)
        else:
            output = self._experts_and_combine(dispatcher, x, recv, local_counts, stacked, fused, gates, handle)
        return self._finish(output, hidden_states, None, 0, None, l_aux, exp_counts)

    def _experts_and_combine(self, dispatcher, x: Tensor, recv: Tensor, local_counts: Tensor, stacked, fused: bool,
                             gates: Tensor, handle) -> Tensor:
        """This rank's experts, then the combine (``x``: the tokens the dispatch read). Under the
        fused schedule with ``overlap.epilogue_combine`` on, the expert GEMMs' epilogues store into
        the sources' combine buffers (``ds_uniep.epilogue_combine``): the second GEMM's output rows
        in the forward (a last projection without bias), the first GEMM's input-gradient rows in
        the backward. The same bits as the sequential schedule."""
        into = None
        if fused and self.uniep_config.overlap.epilogue_combine:
            from .epilogue_combine import DgradCombine, gemm_combine
            into = DgradCombine(dispatcher, handle, x)
            if stacked.biases["w2" if "w2" in stacked.weights else "fc2"] is None:
                return self._local_experts(dispatcher, recv, local_counts, stacked, True, into=into,
                                           last=lambda h, w, offs: gemm_combine(dispatcher, h, w, offs, gates, handle,
                                                                                self._gemm_configs()))
        y = self._local_experts(dispatcher, recv, local_counts, stacked, fused, into=into)
        return dispatcher.combine(y, gates, handle)

    def _local_experts(self, dispatcher, recv: Tensor, local_counts: Tensor, stacked, fused: bool,
                       last=None, into=None, offs: Optional[Tensor] = None) -> Tensor:
        """This rank's experts over the received rows: the fused schedule's grouped GEMMs (the first
        one's tiles waiting for their rows, ``take_fused_waits``; ``last``: runs the last projection,
        ``into``: the first one's dgrad, see ``run_grouped``), else ``run_experts`` (``offs``: the
        grouped GEMMs' int32 row ends, the cumulative ``local_counts``, where the caller has them)."""
        experts = self.deepspeed_moe.experts.deepspeed_experts
        if fused:
            return run_grouped(experts, recv, local_counts, "uniep", stacked=stacked,
                               waits=dispatcher.take_fused_waits(), configs=self._gemm_configs(), last=last,
                               into=into)
        gemm = self._expert_gemm(recv.device)
        return run_experts(experts, recv, local_counts, grouped=stacked is not None, gemm=gemm, stacked=stacked,
                           configs=self._gemm_configs() if gemm == "uniep" else None, offs=offs)

    def _gemm_configs(self) -> Optional[Dict[str, str]]:
        """ds_uniep's GEMM configuration for every operation when the ``uniep.overlap`` block sets
        ``tile_m`` or ``tile_n`` (:func:`ds_uniep.gemm.configs_for_tiles`), else None (its defaults)."""
        overlap = self.uniep_config.overlap
        if not {"tile_m", "tile_n"} & overlap.model_fields_set:
            return None
        from .gemm import configs_for_tiles
        try:
            return configs_for_tiles(overlap.tile_m, overlap.tile_n)
        except ValueError as e:
            raise ValueError(f"{self.layer_name}: uniep.overlap tile_m={overlap.tile_m}, tile_n={overlap.tile_n}: "
                             f"{e}") from None

    def _request_fused(self, dispatcher, stacked) -> None:
        """Ask the next dispatch to queue the first expert GEMM (``w13`` of SwiGLU experts, ``fc1`` of
        GeLU ones) over the rows as they arrive; the weight contiguous, as grouped_linear makes it (a
        copy only for the strided stacks of flattened experts)."""
        first = "w13" if "w13" in stacked.weights else "fc1"
        # Read without an autograd node where it is a view: the GEMM that computes with it makes that
        # node when it runs.
        dispatcher.request_fused(stacked.weights.detached(first).contiguous(), self._gemm_configs())

    def _finish(self, output: Tensor, hidden_states: Tensor, tp_sizes, tp_rank, tp_group, l_aux, exp_counts):
        """The combined tokens back in the input's shape (gathered over TP ranks), plus PR-MoE's residual."""
        if tp_sizes is not None:
            output = tp_gather(output, tp_sizes, tp_rank, tp_group)
        output = output.reshape(hidden_states.shape)

        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]  # the bias is ignored, as DeepSpeed's MoE does
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, exp_counts

    def _expert_gemm(self, device: torch.device) -> str:
        """``"torch"`` or ``"uniep"`` from ``uniep.expert_gemm``; ``"uniep"`` is checked once per device."""
        if self.uniep_config.expert_gemm == "torch":
            return "torch"
        if device not in self._uniep_gemm_ok:
            from . import gemm
            ok, why = gemm.available(device)
            if not ok:
                raise RuntimeError(f'{self.layer_name}: "expert_gemm": "uniep" cannot run on {device}: {why}')
            self._uniep_gemm_ok.add(device)
        return "uniep"

    def _pipelines(self, dispatcher, grouped: bool) -> bool:
        """Whether this forward runs the pipelined schedule: asked for, on the megakernel, with
        experts that run as grouped GEMMs (``grouped``); said once where it cannot."""
        if self.uniep_config.overlap.schedule != "pipelined":
            return False
        if isinstance(dispatcher, ReferenceDispatcher):
            if self._hybrid is None:
                return False  # the reference backend: said once by _say_overlap_knobs_wait
            why = "HybridEP moves tokens on the reference transport"
        elif not grouped:
            why = _NOT_GROUPED
        else:
            why = dispatcher.pipelines()
        return self._runs_schedule("pipelined", why)

    def _runs_schedule(self, schedule: str, why: str) -> bool:
        """True when nothing stops ``schedule`` (``why`` empty); else says why, once per layer and
        schedule, and the sequential schedule runs."""
        if why and (self.layer_name, schedule) not in _SAID_CANNOT:
            _SAID_CANNOT.add((self.layer_name, schedule))
            logger.warning(f"{self.layer_name}: the {schedule} schedule cannot run here ({why}); running the "
                           "sequential one (the same results)")
        return not why

    def _fuses(self, dispatcher, grouped: bool) -> bool:
        """Whether this forward runs the fused schedule: asked for, on the megakernel, with experts
        that run as grouped GEMMs through ds_uniep's GEMM; said once where it cannot."""
        if self.uniep_config.overlap.schedule != "fused" or isinstance(dispatcher, ReferenceDispatcher):
            return False  # the reference backend: said once by _say_overlap_knobs_wait
        if not grouped:
            why = _NOT_GROUPED
        elif self._expert_gemm(dispatcher.device) != "uniep":
            why = 'its first GEMM waits for rows inside ds_uniep\'s grouped GEMM ("expert_gemm": "uniep")'
        else:
            why = dispatcher.fuses()
        return self._runs_schedule("fused", why)

    def _dispatcher(self, x: Tensor):
        key = x.device
        d = self._dispatchers.get(key)
        if d is not None:
            return d
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"{self.layer_name}: ep_size={self.ep_size} needs the expert-parallel group; "
                               "pass the model through deepspeed.initialize or call set_deepspeed_parallelism()")
        name = backend_mod.resolve(self.uniep_config.backend, x.device, self.layer_name)
        _say_overlap_knobs_wait(self.uniep_config.overlap, name, self.layer_name,
                                self.uniep_config.expert_gemm == "uniep" and self._hybrid is None,
                                self.uniep_config.compression.combine == "rank_partials")
        if name == "megakernel" and self._pacing is not None:
            raise ValueError(f"{self.layer_name}: inter-site pacing (set_inter_site_pacing) runs on the reference "
                             'backend; set "uniep": {"backend": "reference"}')
        self._check_combine_mode(self.uniep_config, name)
        if name == "megakernel":
            from .megakernel import NVLinkDispatcher
            # The fused schedule gives num_comm_sms to its dispatch only (its first GEMM takes the other
            # SMs); its other copy kernels run alone, on every SM, as in the sequential schedule.
            fused = self.uniep_config.overlap.schedule == "fused"
            d = NVLinkDispatcher(self.layer_name, self.num_experts, self.ep_size, self.hidden_size, self.k, x.dtype,
                                 self.uniep_config, self.ep_group,
                                 num_blocks=None if fused else _comm_blocks(self.uniep_config),
                                 ordering="layout" if self.uniep_config.deterministic else "arrival")
        else:
            if not self.uniep_config.deterministic:
                logger.info(f'{self.layer_name}: "deterministic": false changes nothing on the {name} backend, '
                            "whose sums always run in the fixed order")
            d = ReferenceDispatcher(self.num_experts, self.ep_size, self.ep_group,
                                    dispatch_dtype=self.uniep_config.compression.dispatch_dtype, pacing=self._pacing,
                                    combine=self.uniep_config.compression.combine)
        self._backend_by_device[key] = name
        self._dispatchers[key] = d
        return d

    def _check_combine_mode(self, cfg: UniEPConfig, backend: str) -> None:
        """``compression.combine`` "rank_partials" runs where something builds it: the reference
        backend, and the megakernel's combine kernels (the sequential schedule, the fused one without
        epilogue_combine) in layout order; elsewhere it raises rather than run the slots' sums
        (HybridEP raises when it is built)."""
        if cfg.compression.combine != "rank_partials" or backend != "megakernel":
            return
        where = f"{self.layer_name}: compression.combine 'rank_partials'"
        from .tuning.space import Plan
        o = cfg.overlap
        if not Plan(schedule=o.schedule, epilogue_combine=o.epilogue_combine).runs_combine_kernels():
            raise ValueError(f"{where} runs in the megakernel's combine kernels: the sequential schedule, or the "
                             f"fused one with epilogue_combine false (got schedule {o.schedule!r}, epilogue_combine "
                             f"{o.epilogue_combine})")
        if not cfg.deterministic:
            raise ValueError(f'{where} sums in a fixed order; "deterministic": false adds rows as they arrive')

    # ------------------------------------------------------------------ autotune
    def _autotune(self, hidden_states: Tensor) -> None:
        """Run under the tuned plan for this input's (T, dtype, device), tuning first if none is known."""
        T = hidden_states.numel() // self.hidden_size
        _, tp, tp_rank = tp_context()
        if tp > 1:
            T = even_sizes(T, tp)[tp_rank]
        key = (T, hidden_states.dtype, hidden_states.device)
        plan = self._tuned_plans.get(key)
        if plan is None:
            plan = self._tune(hidden_states, T)
            self._tuned_plans[key] = plan
        if plan is not False and plan != self._applied_plan:
            self.set_plan(plan)

    def _tune(self, hidden_states: Tensor, T: int):
        """The plan for this shape: from the cache, else measured on every rank of the EP group.
        False when there is nothing to tune (the plan stays the configured one)."""
        from .tuning import GPUInfo, Shape
        from .tuning.runner import live_runner, runnable_gemms
        from .tuning.tuner import tune_from_config
        device = hidden_states.device
        dtype = _DTYPE_NAMES.get(hidden_states.dtype)
        if dtype is None or T < 1:
            logger.info(f"{self.layer_name}: autotune skipped for {T} tokens of {hidden_states.dtype} (tunes "
                        "bf16, fp16 and fp32 inputs with at least one token)")
            return False
        x = hidden_states.reshape(-1, self.hidden_size)
        self._dispatcher(x)  # resolves (and logs) the backend once, as an untuned forward would
        backend = self._backend_by_device[device]
        shape = Shape(T=T, M=self.hidden_size, F=_expert_ffn(self.deepspeed_moe.experts.deepspeed_experts[0],
                                                            self.hidden_size),
                      E=self.num_experts, k=self.k, dtype=dtype, ep=self.ep_size)
        group = self.ep_group
        local = self.ep_size == 1 or group is None
        if not local:
            _check_same_shape(shape, group, self.layer_name)
        gpu = GPUInfo.detect(device) if device.type == "cuda" else GPUInfo.cpu()
        # The experts' GEMM is a knob where they run as grouped GEMMs on a device with ds_uniep's.
        gemms = None
        if backend == "megakernel":
            grouped = stack_experts(self.deepspeed_moe.experts.deepspeed_experts, hidden_states.dtype, device,
                                    cache=self._stack_cache) is not None
            gemms = runnable_gemms(self.configured_config.expert_gemm, device, dtype if grouped else "",
                                   None if local else group)
        rank0 = local or torch.distributed.get_rank(group) == 0
        backward = not torch.is_inference_mode_enabled()
        cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        if rank0:  # the progress bar shows only on a terminal: say that tuning runs, and for how long at most
            logger.info(f"{self.layer_name}: autotune {shape} on the {backend} backend: measuring plans "
                        f"(budget {self.uniep_config.autotune.budget_s:g} s after the configured and baseline plans, "
                        "unless the plan cache has this shape)")
        self._autotuning = True
        try:
            # The gate (noisy policies, random token selection) and experts (dropout) may draw
            # random numbers: the caller's RNG streams continue as if tuning never ran.
            with torch.random.fork_rng(devices=cuda_devices):
                # From the configured plan (not the last shape's winner), with the autotune settings in force.
                start = self.configured_config.model_copy(update={"autotune": self.uniep_config.autotune})
                result = tune_from_config(start, shape, live_runner(self, hidden_states, backward=backward),
                                          gpu=gpu, group=group, backend=backend, local=local,
                                          progress=rank0 and sys.stderr.isatty(), gemms=gemms)
        finally:
            self._autotuning = False
        key = (T, hidden_states.dtype, device)
        self.autotune_results[key] = result
        if rank0:
            how = (f"from the cache {result.cache_file}" if result.from_cache else
                   f"{_ms(result.best_ms)} ms fwd{'+bwd' if backward else ''} against {_ms(result.default_ms)} ms "
                   f"for the configured plan, {len(result.by_status('measured'))} plans measured in "
                   f"{result.elapsed_s:.1f} s")
            logger.info(f"{self.layer_name}: autotune {shape} on the {backend} backend: plan "
                        f"{result.winner.label()} ({how})")
        return result.winner

    def backend_name(self, device: Union[str, torch.device, None] = None) -> Optional[str]:
        """The backend chosen for ``device`` (after the first forward there), else None."""
        if device is None:
            return next(iter(self._backend_by_device.values()), None)
        return self._backend_by_device.get(torch.device(device))


def _calling_engine():
    """The DeepSpeedEngine whose initialisation is calling us, if any (its config holds "uniep")."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, DeepSpeedEngine):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _expert_ffn(expert: nn.Module, hidden_size: int) -> int:
    """F of the cache key: the FFN width of a SwiGLU/GeLU expert (or any expert with an ``ffn_size``,
    ``intermediate_size`` or ``w1``/``fc1`` linear), else its parameter count over the hidden size."""
    for name in ("ffn_size", "intermediate_size"):
        v = getattr(expert, name, None)
        if isinstance(v, int) and v > 0:
            return v
    for name in ("w1", "fc1"):
        lin = getattr(expert, name, None)
        if isinstance(lin, nn.Linear):
            return lin.out_features
    return max(1, sum(p.numel() for p in expert.parameters()) // hidden_size)


def _check_same_shape(shape, group, layer_name: str) -> None:
    """Every rank of the group must tune the same shape (they run the same plans together)."""
    mine = (shape.T, shape.M, shape.F, shape.E, shape.k, shape.dtype)
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    if any(s != mine for s in everyone):
        raise ValueError(f"{layer_name}: autotune needs the same layer shape on every expert-parallel rank, got "
                         f"(T, M, F, E, k, dtype) = {everyone} per rank; feed every rank the same number of tokens "
                         'on the first forward of a shape, or set "uniep": {"autotune": {"enabled": false}}')


def _check_args(hidden_size, expert, num_experts, ep_size, k, noisy_gate_policy) -> Tuple[int, int, int, int]:
    """The sizes as Python ints (any integral type is accepted, numpy's included, as the stock layer
    accepts them), after checking every argument."""
    if not isinstance(expert, nn.Module):
        raise TypeError(f"expert must be an nn.Module, got {type(expert).__name__}")
    sizes = []
    for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
        sizes.append(int(v))
    hidden_size, num_experts, ep_size, k = sizes
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each expert-parallel "
                         "rank must hold the same number of experts")
    if k > num_experts:
        raise ValueError(f"k={k} is larger than num_experts={num_experts}")
    if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
        raise ValueError(f"noisy_gate_policy must be None, 'None', 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
    if torch.distributed.is_initialized() and ep_size > torch.distributed.get_world_size():
        raise ValueError(f"ep_size={ep_size} is larger than the world size {torch.distributed.get_world_size()}")
    return hidden_size, num_experts, ep_size, k


_FUSED_KNOBS = ("roles", "tile_m", "tile_n", "stages", "signal_granularity")
"""``uniep.overlap`` knobs meant for the fused schedule: ``roles`` and ``signal_granularity`` are read
by its dispatch (``fused_dispatch``) only; ``stages`` is read by nothing yet; ``tile_m`` and ``tile_n``
are read by ds_uniep's GEMM (``expert_gemm: "uniep"``) wherever it runs the experts, on any schedule."""
_SAID_WAITING = set()
_SAID_CANNOT = set()
_NOT_GROUPED = ("the experts do not run as grouped GEMMs (bf16 SwiGLUExpert or GeLUExpert experts, without HybridEP or "
                "expert tensor parallelism)")


def _say_overlap_knobs_wait(overlap, backend: str, layer_name: str, tiles_read: bool = False,
                            rank_partials: bool = False) -> None:
    """Warn when the ``uniep`` block sets overlap knobs that nothing acts on: :data:`_FUSED_KNOBS`,
    ``schedule`` (pipelined or fused) on a backend other than the megakernel, ``num_chunks``
    outside the megakernel's pipelined schedule, ``fused_dispatch`` and ``epilogue_combine``
    outside its fused one, and ``combine_chunks`` and ``combine_queue`` where its combine kernels
    do not move the rows (``combine_queue`` also with ``combine_chunks`` 0); once per process for
    each setting and backend,
    naming the first layer that met it. ``tiles_read``: ds_uniep's GEMM runs the experts and reads
    ``tile_m`` and ``tile_n``. ``rank_partials``: ``compression.combine`` is "rank_partials", whose
    combine pushes then sums (``combine_chunks`` and ``combine_queue`` are not read)."""
    pipelined_here = overlap.schedule == "pipelined" and backend == "megakernel"
    fused_here = overlap.schedule == "fused" and backend == "megakernel"
    schedule_here = overlap.schedule == "sequential" or backend == "megakernel"
    knobs = [k for k in ("schedule", "num_chunks") if k in overlap.model_fields_set
             and not (k == "schedule" and schedule_here) and not (k == "num_chunks" and pipelined_here)]
    knobs += [k for k in ("fused_dispatch", "epilogue_combine") if k in overlap.model_fields_set and not fused_here]
    from .tuning.space import Plan  # where the combine kernels move the rows: the plans' own rule
    combine_here = backend == "megakernel" and not rank_partials and Plan(
        schedule=overlap.schedule, epilogue_combine=overlap.epilogue_combine).runs_combine_kernels()
    knobs += [k for k in ("combine_chunks", "combine_queue") if k in overlap.model_fields_set and not (
        combine_here and (k == "combine_chunks" or overlap.combine_chunks > 0))]
    knobs += [k for k in _FUSED_KNOBS if k in overlap.model_fields_set and not (tiles_read and k.startswith("tile_"))
              and not (k in ("roles", "signal_granularity") and fused_here and overlap.fused_dispatch)]
    said = ", ".join(f"{k}={getattr(overlap, k)!r}" for k in knobs)
    if knobs and (said, backend) not in _SAID_WAITING:
        _SAID_WAITING.add((said, backend))
        logger.warning(f"{layer_name}: uniep.overlap {said} accepted but not acted on: the {backend} backend runs "
                       + ("the sequential, pipelined or fused schedule, none of which reads stages yet, roles "
                          "and signal granularity only reach the fused schedule's dispatch (fused_dispatch) and "
                          "tile sizes only ds_uniep's GEMM (expert_gemm 'uniep'), combine_chunks and "
                          "combine_queue only the combine kernels (the sequential schedule, the fused one "
                          "without epilogue_combine; combine_queue with combine_chunks > 0; neither under "
                          "compression.combine 'rank_partials')"
                          if backend == "megakernel" else
                          "the sequential schedule") + "; results are the same under every value. Said once for "
                       "every layer.")


def _comm_blocks(cfg: UniEPConfig) -> Optional[int]:
    """Blocks of the megakernel's copy kernels: ``overlap.num_comm_sms`` when the config or a tuning
    plan sets it; otherwise None, one block per SM, since the sequential schedule runs them alone."""
    return cfg.overlap.num_comm_sms if "num_comm_sms" in cfg.overlap.model_fields_set else None
