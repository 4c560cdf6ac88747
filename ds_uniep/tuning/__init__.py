"""One tuning space for every expert-parallel knob, and the tuner that searches it.

- :class:`Plan`: one point, the layer's :class:`~ds_uniep.knobs.Knobs` (the same class).
- :class:`Shape`, :class:`GPUInfo`: what validity and speed depend on.
- :class:`Space`: enumerates valid plans; :meth:`Space.check` says why a plan cannot run.
  ``Space(..., backend=...)`` walks only the knobs that backend acts on (:data:`ACTING_KNOBS`).
- :func:`tune`: measures plans through a ``run_plan(plan)`` callable (:mod:`.runner` builds it from
  what the layer hands in), agrees on one winner across ranks, caches it (:mod:`ds_uniep.tuning.cache`).
"""
from ..knobs import Knobs
from .cache import PlanCacheWarning, cache_key, cache_path
from .cost import estimate_ms
from .space import ACTING_KNOBS, DEFAULT_VALUES, GPU_PRESETS, GPUInfo, Plan, Shape, Space, comm_sms_values
from .tuner import PlanRecord, TuneResult, tune, tune_from_config

__all__ = ["Knobs", "Plan", "Shape", "GPUInfo", "Space", "tune", "tune_from_config", "TuneResult", "PlanRecord",
           "PlanCacheWarning", "cache_key", "cache_path", "estimate_ms", "DEFAULT_VALUES", "GPU_PRESETS",
           "ACTING_KNOBS", "comm_sms_values"]
