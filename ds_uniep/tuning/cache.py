"""The JSON plan cache: one file per (GPU, ep, layer shape, backend), checked before it is trusted.

A file is used only when it parses, has this schema, names exactly the key
being looked up (package version included) and its plan is still valid in
the current space; anything else is ignored with a :class:`PlanCacheWarning`
naming the file and the reason, and the caller re-tunes. The file name leaves
the version out on purpose, so an upgrade finds the old file, reports it stale
and overwrites it rather than piling up files no version will read again.
"""

import dataclasses
import hashlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..version import __version__
from .space import GPUInfo, Plan, Shape, Space

SCHEMA = 2
_ENTRY_FIELDS = {"schema", "key", "plan", "median_ms", "default_ms", "space_digest", "created"}


class PlanCacheWarning(UserWarning):
    """A cache file exists but is not used (stale or corrupt); the message names the file and why."""


def cache_key(shape: Shape, gpu: GPUInfo, backend: str = "megakernel", version: str = __version__,
              combine: str = "slots") -> Dict[str, Any]:
    """The fields a cached plan is valid for: GPU name, ep, T, M, F, E, k, dtype, backend, package version
    and ``compression.combine`` (which changes what the combine moves)."""
    return {"gpu": gpu.name, "ep": shape.ep, "T": shape.T, "M": shape.M, "F": shape.F, "E": shape.E,
            "k": shape.k, "dtype": shape.dtype, "backend": backend, "version": version, "combine": combine}


def cache_path(cache_dir: str, key: Dict[str, Any]) -> str:
    unversioned = {k: v for k, v in key.items() if k != "version"}
    digest = hashlib.sha256(json.dumps(unversioned, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(cache_dir), f"plan-{digest}.json")


@dataclass(frozen=True)
class CacheEntry:
    plan: Plan
    median_ms: Optional[float]
    default_ms: Optional[float]
    path: str


def load(cache_dir: str, key: Dict[str, Any], space: Space) -> Optional[CacheEntry]:
    """The cached plan for ``key`` if it can be trusted, else None (with a warning when a file was there)."""
    path = cache_path(cache_dir, key)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return _ignore(path, f"corrupt: not readable JSON ({e})")
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS or entry.get("schema") != SCHEMA:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        return _ignore(path, f"corrupt: wrong schema (expected schema {SCHEMA} with keys {sorted(_ENTRY_FIELDS)}, "
                             f"got {got})")
    if entry["key"] != key:
        old = entry["key"] if isinstance(entry["key"], dict) else {}
        diff = [f"{k}: {old.get(k)!r} (cache) vs {key.get(k)!r} (now)"
                for k in sorted(set(key) | set(old)) if old.get(k) != key.get(k)]
        return _ignore(path, "stale: written for another key (" + "; ".join(diff) + ")")
    knobs = {f.name for f in dataclasses.fields(Plan)}
    if isinstance(entry["plan"], dict) and set(entry["plan"]) != knobs:
        missing, extra = sorted(knobs - set(entry["plan"])), sorted(set(entry["plan"]) - knobs)
        return _ignore(path, "stale: its plan has another version's knobs (" + "; ".join(
            f"{what}: {', '.join(names)}" for what, names in (("missing", missing), ("unknown", extra)) if names)
            + ")")
    try:
        plan = Plan.from_dict(entry["plan"])
        median_ms = None if entry["median_ms"] is None else float(entry["median_ms"])
        default_ms = None if entry["default_ms"] is None else float(entry["default_ms"])
    except (TypeError, ValueError) as e:
        return _ignore(path, f"corrupt: wrong schema (bad plan or times: {e})")
    reason = space.check(plan)
    if reason is not None:
        return _ignore(path, f"stale: the cached plan {plan.label()} is no longer valid here ({reason})")
    if entry["space_digest"] != space.digest():
        return _ignore(path, "stale: the tuning space changed since it was tuned (other knob values, limits or "
                             "allow_numerics_change)")
    return CacheEntry(plan, median_ms, default_ms, path)


def store(cache_dir: str, key: Dict[str, Any], space: Space, plan: Plan, median_ms: Optional[float],
          default_ms: Optional[float]) -> str:
    """Write the entry atomically (temp file in the same directory, then ``os.replace``); returns the path.

    Readers see the old file or the new one, never a partial write, even with
    several jobs sharing ``cache_dir``."""
    path = cache_path(cache_dir, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    entry = {"schema": SCHEMA, "key": key, "plan": plan.to_dict(), "median_ms": median_ms,
             "default_ms": default_ms, "space_digest": space.digest(),
             "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _ignore(path: str, why: str) -> None:
    warnings.warn(f"ignoring plan cache file {path}: {why}; re-tuning", PlanCacheWarning, stacklevel=3)
    return None
