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
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from deepspeed.moe.layer import MoE
from torch import Tensor, nn
from torch.nn import functional as F

from . import backend as backend_mod
from . import autotune_layer, cuda_graphs, schedules
from .config import UniEPConfig
from .env import logger
from .hybrid.layer_state import HybridLayer
from .experts import pack_experts
from .topology import group_topology
from .twolevel import TwoLevelNVLinkDispatcher, across_nodes_unsupported, reference_dispatcher
from .schedules.common import Step
from .tensor_parallel import tp_gather

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
        #: HybridEP's part of the layer (its set-up, replan, replicas' boundary, pacing)
        self.hybrid = HybridLayer(self.layer_name, num_experts, hidden_size, k)
        self._said_used_token = False  # the k >= 2 used_token warning, once
        self._uniep_gemm_ok = set()  # devices where expert_gemm "uniep" was found usable
        self._stack_cache = {}  # how this layer's expert parameters stack (ds_uniep.experts.stack_experts)
        #: the megakernel's sequential and fused schedules queue their dispatch between the gate's routes
        #: and the rest of the gate (ds_uniep.schedules); False: after the whole gate
        self.route_early = True
        self._schedules = {}  # (device, dtype) -> (what it was resolved for, the schedule): see _schedule
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
        self._schedules = {}  # whether the experts run as grouped GEMMs may have changed
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
        self.hybrid.setup(self.uniep_config, self.deepspeed_moe.experts.deepspeed_experts, self.ep_group, self.ep_size,
                          _calling_engine, self.enable_expert_tensor_parallelism)

    def set_accumulation_boundary(self, boundary) -> None:
        """With ``"hybrid": {"reuse_replicas": true}`` in a training loop without a DeepSpeed engine:
        ``boundary()`` says whether the backward running now is the last micro-batch of the optimizer
        step, so that the replica gradients are summed over the step and returned once, there (None:
        returned at every backward). Under a DeepSpeed engine its accumulation boundary is used
        unless this was set. ``domain_size: "auto"`` plans with one micro-batch per step here (no
        engine tells how many)."""
        self.hybrid.set_accumulation_boundary(boundary, self.uniep_config)

    def refresh_replicas(self) -> None:
        """With ``"hybrid": {"reuse_replicas": true}``: gather the domain's experts again at the next
        forward, on every rank of this rank's domain (calling it on one rank is enough). Call it after
        changing expert weights without an optimizer step and without an in-place operation on the
        parameters themselves (through ``.data``, or a buffer they view), which the reuse check does
        not see. Nothing to do otherwise."""
        self.hybrid.refresh_replicas()

    def set_inter_site_pacing(self, pacing) -> None:
        """Send this layer's traffic between sites through ``pacing`` (a
        :class:`ds_uniep.hybrid.pacing.InterSitePacing`), or stop with None.

        For measuring plain EP and HybridEP over slow links on one host: the token all-to-alls
        (plain EP and HybridEP alike), HybridEP's expert gather and gradient return, and the
        bandwidth measurement of ``domain_size: "auto"`` then hold each rank for the bytes it
        exchanged with other sites over the pacing's bandwidth (the gather and the gradient
        return as background transfers: see ``InterSitePacing``). Numbers do not change. Reference
        backend only. Call it before ``set_deepspeed_parallelism`` (``deepspeed.initialize``) so that
        a measured inter-site bandwidth goes through it too."""
        self._dispatchers.clear()  # (they were built with the pacing they had)
        self.hybrid.set_pacing(pacing)

    def set_plan(self, plan) -> None:
        """Run the next forward under ``plan`` (a :class:`ds_uniep.tuning.Plan`): its overlap knobs and
        dispatch dtype replace the config's. A megakernel dispatcher takes a new ``num_comm_sms`` as
        it is (the block count of its copy kernels; under the fused schedule its fused dispatch's,
        the other copy kernels taking every SM), the plan's roles and its combine chunks and queue; a
        new dispatch dtype rebuilds the dispatchers."""
        self._applied_plan = plan
        cfg = plan.apply(self.uniep_config)
        for name in set(self._backend_by_device.values()):
            schedules.check_combine_mode(cfg, name, self.layer_name)
        if cfg == self.uniep_config and schedules.comm_blocks(cfg) == schedules.comm_blocks(self.uniep_config):
            return
        rebuild = cfg.compression != self.uniep_config.compression
        self.uniep_config = cfg
        if rebuild:
            self._dispatchers.clear()
            return
        for d in self._dispatchers.values():
            if hasattr(d, "set_config"):  # the megakernel's dispatchers, on one node or across nodes
                d.set_config(cfg)

    @property
    def ep_group(self):
        return self.deepspeed_moe.ep_group

    # HybridEP's state, kept in self.hybrid (ds_uniep.hybrid.layer_state.HybridLayer)
    _hybrid = property(lambda self: self.hybrid.experts, doc="HybridEP's experts; None: plain EP")
    _pacing = property(lambda self: self.hybrid.pacing, doc="set_inter_site_pacing's pacing; None: off")
    hybrid_replanned = property(lambda self: self.hybrid.replanned, doc="What the last replan found; None: none ran")
    hybrid_domain_size = property(lambda self: self.hybrid.domain_size, doc="HybridEP's domain size (1: plain EP)")
    hybrid_migrated_experts = property(lambda self: self.hybrid.migrated_experts,
                                       doc="Experts per rank HybridEP migrates (0: plain EP)")

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
        forward, as with a fixed micro-batch. After :func:`ds_uniep.graph_moe`, inputs like its sample
        replay the captured forward and backward."""
        replayed = cuda_graphs.replay(self, hidden_states, used_token)
        if replayed is not None:
            return replayed
        return self.forward_eager(hidden_states, used_token)

    def forward_eager(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """The forward without captured graphs (see :meth:`forward`)."""
        if not self.uniep_config.enabled:
            return super().forward(hidden_states, used_token)
        if used_token is not None:
            self._check_used_token(hidden_states, used_token)
        self._check_input(hidden_states)
        if self.uniep_config.autotune.enabled and not self._autotuning and self._hybrid is None:
            autotune_layer.autotune(self, hidden_states)
        if self.hybrid.replan is not None:  # "replan_after_steps": plan again once its steps have run
            self.hybrid.replan_if_due(self._expert_gemm)
        x = hidden_states.reshape(-1, self.hidden_size)
        schedule, dispatcher = self._schedule(x)
        step = Step(hidden_states, x, used_token, dispatcher)
        return self._finish(schedule.run(self, step), step)

    def _schedule(self, x: Tensor):
        """``(schedule, dispatcher)`` for tokens like ``x`` (``[T, M]``): the schedule resolved once per
        config, device and dtype (:func:`ds_uniep.schedules.resolve`), and again where the dispatcher,
        HybridEP, ``route_early`` or a pending replan changed."""
        d = self._hybrid.dispatcher if self._hybrid is not None else self._dispatcher(x)
        for_ = (self.uniep_config, d, self._hybrid, self.route_early, self.hybrid.replan is None)
        known = self._schedules.get((x.device, x.dtype))
        if known is None or any(a is not b for a, b in zip(known[0], for_)):
            known = self._schedules[x.device, x.dtype] = (for_, schedules.resolve(self, x, d))
        return known[1], d

    def _check_input(self, hidden_states: Tensor) -> None:
        """The input's hidden size, device and dtype against the layer's experts (outside autocast, which
        casts for them); each error names the expected and the given."""
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"{self.layer_name}: input hidden size {hidden_states.shape[-1]} does not match "
                             f"hidden_size={self.hidden_size} (input shape {tuple(hidden_states.shape)})")
        p = next(self.deepspeed_moe.experts.parameters(), None)
        if p is None:
            return
        if hidden_states.device != p.device:
            raise ValueError(f"{self.layer_name}: input on {hidden_states.device}, the experts' parameters on "
                             f"{p.device}; move one to the other's device")
        if (hidden_states.dtype != p.dtype and p.is_floating_point()
                and not torch.is_autocast_enabled(hidden_states.device.type)):
            raise ValueError(f"{self.layer_name}: input dtype {hidden_states.dtype} does not match the experts' "
                             f"parameters' {p.dtype}; cast one to the other (or run under torch.autocast)")

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

    def _gemm_configs(self) -> Optional[Dict[str, str]]:
        """ds_uniep's GEMM configuration when ``uniep.overlap`` sets a tile size, else None (its own)."""
        return schedules.gemm_configs(self.uniep_config, self.layer_name)

    def _finish(self, output: Tensor, step: Step) -> Tuple[Tensor, Tensor, Tensor]:
        """The combined tokens back in the input's shape (gathered over TP ranks), plus PR-MoE's residual."""
        if step.tp is not None:
            output = tp_gather(output, *step.tp)
        hidden_states = step.hidden_states
        output = output.reshape(hidden_states.shape)

        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]  # the bias is ignored, as DeepSpeed's MoE does
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, step.l_aux, step.exp_counts

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

    def _dispatcher(self, x: Tensor):
        d = self._dispatchers.get(x.device)
        return d if d is not None else self._make_dispatcher(x)

    @torch.compiler.disable  # collective buffer set-up, pinned records: never traced
    def _make_dispatcher(self, x: Tensor):
        key = x.device
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"{self.layer_name}: ep_size={self.ep_size} needs the expert-parallel group; "
                               "pass the model through deepspeed.initialize or call set_deepspeed_parallelism()")
        topo = group_topology(self.uniep_config.topology, self.ep_group, self.ep_size)
        name = backend_mod.resolve(self.uniep_config.backend, x.device, self.layer_name, topo,
                                   unsupported_across="inter-site pacing" if self._pacing is not None else
                                   across_nodes_unsupported(self.uniep_config))
        across = name == "megakernel" and topo.spans_nodes  # the megakernel inside each node, NCCL across
        schedules.say_unread_knobs(self.uniep_config.overlap, "megakernel across nodes" if across else name,
                                   self.layer_name,
                                   self.uniep_config.expert_gemm == "uniep" and self._hybrid is None,
                                   self.uniep_config.compression.combine == "rank_partials")
        if name == "megakernel" and self._pacing is not None:
            raise ValueError(f"{self.layer_name}: inter-site pacing (set_inter_site_pacing) runs on the reference "
                             'backend; set "uniep": {"backend": "reference"}')
        schedules.check_combine_mode(self.uniep_config, name, self.layer_name)
        if across:
            d = TwoLevelNVLinkDispatcher(self.num_experts, self.ep_size, self.ep_group, topo, self.uniep_config,
                                         self.hidden_size, self.k, x.dtype, self.layer_name)
        elif name == "megakernel":
            from .megakernel import NVLinkDispatcher
            d = NVLinkDispatcher.from_config(self.layer_name, self.num_experts, self.ep_size, self.hidden_size,
                                             self.k, x.dtype, self.uniep_config, self.ep_group)
        else:
            d = reference_dispatcher(self, topo)  # flat, or two-level where the group spans nodes
        self._backend_by_device[key] = name
        self._dispatchers[key] = d
        return d

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
