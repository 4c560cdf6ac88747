"""The layer's schedules, and the one place that picks which runs.

A schedule is how one forward goes from the gate to the combined tokens: :class:`Sequential` (any
backend, HybridEP, tensor parallelism) and :class:`EarlySequential` (the megakernel's, with the
dispatch queued between the gate's routes and the rest of the gate) in ``sequential.py``,
:class:`Pipelined` (``pipelined.py``), :class:`Fused` (``fused.py``) and :class:`NodePipelined`
(``across_nodes.py``: the pipelined schedule of the megakernel across nodes). Each has ``run(layer,
step) -> output`` over one :class:`~ds_uniep.schedules.common.Step`.

:func:`resolve` picks the schedule for a layer's config, dispatcher and input dtype once (the layer
keeps it until one of those changes) and says, once per layer and schedule, why an asked-for
schedule cannot run where it cannot (the sequential one then runs, with the same results).
:func:`say_unread_knobs` says which ``uniep.overlap`` knobs nothing acts on;
:func:`check_combine_mode` refuses ``compression.combine`` "rank_partials" where nothing builds it.
"""

import torch
from torch import Tensor

from .. import gating
from ..env import logger
from ..reference import ReferenceDispatcher
from ..tensor_parallel import tp_context
from ..twolevel import TwoLevelDispatcher, TwoLevelNVLinkDispatcher
from .across_nodes import NodePipelined
from .common import Step, comm_blocks, gemm_configs, stack
from .fused import Fused
from .pipelined import Pipelined
from .sequential import EarlySequential, Sequential

__all__ = ["Step", "Sequential", "EarlySequential", "Pipelined", "Fused", "NodePipelined", "resolve",
           "check_sync_free", "say_unread_knobs", "check_combine_mode", "comm_blocks", "gemm_configs"]

NOT_GROUPED = ("the experts do not run as grouped GEMMs (bf16 SwiGLUExpert or GeLUExpert experts, without HybridEP or "
               "expert tensor parallelism)")
_SAID_CANNOT = set()


def resolve(layer, x: Tensor, d):
    """The schedule ``layer`` runs on tokens like ``x`` (``[T, M]``) moved by dispatcher ``d``: the
    configured ``overlap.schedule`` where it can run, else the sequential one (said once per layer
    and schedule, naming why)."""
    cfg, hybrid = layer.uniep_config, layer._hybrid
    schedule = cfg.overlap.schedule
    tp = tp_context()[1]
    if cfg.sync_free:
        check_sync_free(layer, x, d, tp)
    tp_sharded = tp > 1 and layer.enable_expert_tensor_parallelism
    megakernel = not isinstance(d, ReferenceDispatcher)
    grouped = schedule != "sequential" and hybrid is None and not tp_sharded and stack(layer, x) is not None
    # The dispatch is queued between the gate's routes and the rest of the gate where the megakernel
    # moves one rank's tokens routed by DeepSpeed's dropless top-2/top-k gate (see EarlySequential);
    # a pending "replan_after_steps" counts the routes of the whole gate. Not sync-free: no host wait
    # to hide there, and its dispatch is then one custom op, which torch.compile does not trace into.
    early = (megakernel and hybrid is None and tp == 1 and layer.route_early and layer.hybrid.replan is None
             and gating.splits(layer.deepspeed_moe.gate) and not cfg.sync_free)
    if schedule == "pipelined" and isinstance(d, TwoLevelNVLinkDispatcher):
        why = (NOT_GROUPED if not grouped else
               'across nodes its phases\' first GEMM runs on ds_uniep\'s grouped GEMM ("expert_gemm": "uniep")'
               if layer._expert_gemm(x.device) != "uniep" else
               f"ds_uniep's grouped GEMM takes bf16 rows, not {x.dtype}" if x.dtype != torch.bfloat16 else "")
        if _runs(layer.layer_name, schedule, why):
            return NodePipelined(layer._gemm_configs())
    elif schedule == "pipelined" and (megakernel or hybrid is not None):  # (the reference backend: say_unread_knobs)
        why = ("HybridEP moves tokens on the reference transport" if hybrid is not None else
               NOT_GROUPED if not grouped else d.pipelines())
        if _runs(layer.layer_name, schedule, why):
            gemm = layer._expert_gemm(x.device)
            from ..pipelined import pipeline_partition
            # With ds_uniep's GEMM and num_comm_sms set (in the block or by a tuning plan), the GEMMs
            # leave that many SMs to SM-store copies; else the chunks' rows travel on the copy engines
            # and the GEMMs take every SM (torch's always do).
            copy_blocks, sm_count = pipeline_partition(gemm, comm_blocks(cfg) or 0, x.device)
            return Pipelined(cfg.overlap.num_chunks, gemm, copy_blocks, sm_count,
                             layer._gemm_configs() if gemm == "uniep" else None)
    elif schedule == "fused" and megakernel:
        why = (NOT_GROUPED if not grouped else
               'its first GEMM waits for rows inside ds_uniep\'s grouped GEMM ("expert_gemm": "uniep")'
               if layer._expert_gemm(d.device) != "uniep" else d.fuses())
        if _runs(layer.layer_name, schedule, why):
            o = cfg.overlap
            return Fused(early, o.fused_dispatch, o.epilogue_combine, layer._gemm_configs())
    return EarlySequential() if early else Sequential(tp_sharded)


def check_sync_free(layer, x: Tensor, d, tp: int) -> None:
    """``"sync_free": true`` runs where no step reads counts on the host: the megakernel's sequential
    schedule with grouped bias-free experts and a gate that routes on the device (DeepSpeed's dropless
    top-2/top-k gate, a ds_uniep router), without HybridEP or tensor parallelism; anything else raises,
    naming what reads the counts. (A pipelined or fused schedule runs sequential, said once.)"""
    gate = layer.deepspeed_moe.gate
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    why = ("across nodes the two-level dispatch exchanges row counts on the host" if isinstance(d, TwoLevelDispatcher)
           else "the reference backend exchanges row counts on the host" if isinstance(d, ReferenceDispatcher) else
           "HybridEP plans on the host" if layer._hybrid is not None else
           "tensor parallelism cuts the tokens on the host" if tp > 1 else
           "the gate reads counts on the host (DeepSpeed's top-1 gate, token dropping, or a gate of its own "
           "without route_split)" if not gating.splits(gate) else
           NOT_GROUPED if stack(layer, x) is None else
           "the experts have biases (their gradient sums each expert's rows by a count read on the host)"
           if any(getattr(m, "bias", None) is not None for e in experts for m in e.modules()
                  if isinstance(m, torch.nn.Linear)) else "")
    if why:
        raise ValueError(f'{layer.layer_name}: "uniep": {{"sync_free": true}} cannot run here: {why}')


def _runs(layer_name: str, schedule: str, why: str) -> bool:
    """True when nothing stops ``schedule`` (``why`` empty); else says why, once per layer and
    schedule, and the sequential schedule runs."""
    if why and (layer_name, schedule) not in _SAID_CANNOT:
        _SAID_CANNOT.add((layer_name, schedule))
        logger.warning(f"{layer_name}: the {schedule} schedule cannot run here ({why}); running the "
                       "sequential one (the same results)")
    return not why


def check_combine_mode(cfg, backend: str, layer_name: str) -> None:
    """``compression.combine`` "rank_partials" runs where something builds it: the reference
    backend, and the megakernel's combine kernels (the sequential schedule, the fused one without
    epilogue_combine); elsewhere it raises rather than run the slots' sums (HybridEP raises when
    it is built)."""
    if cfg.compression.combine != "rank_partials" or backend != "megakernel":
        return
    o = cfg.overlap
    if not _runs_combine_kernels(o.schedule, o.epilogue_combine):
        raise ValueError(f"{layer_name}: compression.combine 'rank_partials' runs in the megakernel's combine "
                         "kernels: the sequential schedule, or the fused one with epilogue_combine false (got "
                         f"schedule {o.schedule!r}, epilogue_combine {o.epilogue_combine})")


def _runs_combine_kernels(schedule: str, epilogue_combine: bool) -> bool:
    from ..knobs import Knobs  # where the combine kernels move the rows: the knobs' own rule
    return Knobs(schedule=schedule, epilogue_combine=epilogue_combine).runs_combine_kernels()


_FUSED_KNOBS = ("roles", "tile_m", "tile_n", "signal_granularity")
"""``uniep.overlap`` knobs meant for the fused schedule: ``roles`` and ``signal_granularity`` are read
by its dispatch (``fused_dispatch``) only; ``tile_m`` and ``tile_n`` are read by ds_uniep's GEMM
(``expert_gemm: "uniep"``) wherever it runs the experts, on any schedule."""
_SAID_WAITING = set()


def say_unread_knobs(overlap, backend: str, layer_name: str, tiles_read: bool = False,
                     rank_partials: bool = False) -> None:
    """Warn when the ``uniep.overlap`` block sets knobs that nothing acts on: :data:`_FUSED_KNOBS`,
    ``schedule`` (pipelined or fused) on a backend other than the megakernel, ``num_chunks``
    outside the megakernel's pipelined schedule, ``fused_dispatch`` and ``epilogue_combine``
    outside its fused one, and ``combine_chunks`` and ``combine_queue`` where its combine kernels
    do not move the rows (``combine_queue`` also with ``combine_chunks`` 0); once per process for
    each setting and backend, naming the first layer that met it. ``tiles_read``: ds_uniep's GEMM
    runs the experts and reads ``tile_m`` and ``tile_n``. ``rank_partials``: ``compression.combine``
    is "rank_partials", whose combine pushes then sums (``combine_chunks`` and ``combine_queue`` are
    not read)."""
    pipelined_here = overlap.schedule == "pipelined" and backend == "megakernel"
    fused_here = overlap.schedule == "fused" and backend == "megakernel"
    schedule_here = overlap.schedule == "sequential" or backend == "megakernel" or (
        backend == "megakernel across nodes" and overlap.schedule == "pipelined")
    knobs = [k for k in ("schedule", "num_chunks") if k in overlap.model_fields_set
             and not (k == "schedule" and schedule_here) and not (k == "num_chunks" and pipelined_here)]
    knobs += [k for k in ("fused_dispatch", "epilogue_combine") if k in overlap.model_fields_set and not fused_here]
    combine_here = backend.startswith("megakernel") and not rank_partials and _runs_combine_kernels(
        overlap.schedule, overlap.epilogue_combine)
    knobs += [k for k in ("combine_chunks", "combine_queue") if k in overlap.model_fields_set and not (
        combine_here and (k == "combine_chunks" or overlap.combine_chunks > 0))]
    knobs += [k for k in _FUSED_KNOBS if k in overlap.model_fields_set and not (tiles_read and k.startswith("tile_"))
              and not (k in ("roles", "signal_granularity") and fused_here and overlap.fused_dispatch)]
    said = ", ".join(f"{k}={getattr(overlap, k)!r}" for k in knobs)
    if knobs and (said, backend) not in _SAID_WAITING:
        _SAID_WAITING.add((said, backend))
        logger.warning(f"{layer_name}: uniep.overlap {said} accepted but not acted on: the {backend} backend runs "
                       + ("the sequential, pipelined or fused schedule; roles and signal granularity only reach "
                          "the fused schedule's dispatch (fused_dispatch) and tile sizes only ds_uniep's GEMM "
                          "(expert_gemm 'uniep'), combine_chunks and combine_queue only the combine kernels (the "
                          "sequential schedule, the fused one without epilogue_combine; combine_queue with "
                          "combine_chunks > 0; neither under compression.combine 'rank_partials')"
                          if backend == "megakernel" else
                          "the sequential schedule, or the pipelined one in two phases (this node's rows, then the "
                          "other nodes'; num_chunks is not read)" if backend == "megakernel across nodes" else
                          "the sequential schedule") + "; results are the same under every value. Said once for "
                       "every layer.")


