"""Where a layer's step spends its GPU time: kernels by kind, and the GPU's idle time.

    from profile_steps import profile_steps
    summary = profile_steps(lambda i: step(i), steps=5, warmup=2)
    summary["busy_ms"], summary["idle_ms"], summary["categories"], summary["top_kernels"]

``steps`` steps run back to back under ``torch.profiler`` (CUDA activity) after
``warmup`` untimed ones and one the profiler runs but does not record; the trace's kernels, copies and memsets are read from
its Chrome trace. All times are per step (totals over the steps divided by
``steps``):

- ``window_ms``: from the first device event's start to the last one's end;
- ``busy_ms``: the union of the device events' intervals (time with at least one
  of them running); ``idle_ms`` = window - busy (the GPU waiting for the host or
  for nothing at all);
- ``concurrent_ms``: the sum of the events' durations minus ``busy_ms`` (time
  during which two or more ran at once: overlap between streams);
- ``categories``: summed durations per kind of kernel (:data:`CATEGORIES`, first
  match of the kernel's name; the rest under "other"), so with concurrency they
  add up to more than ``busy_ms``;
- ``top_kernels``: the kernels with the most time, by name (shortened), with
  their calls per step;
- ``top_gaps``: where the idle time falls: the idle intervals summed by the
  pair of kernels around them (``after``: the one whose end began the interval,
  ``before``: the one that ended it; names shortened), most idle first, with
  their count per step and the longest one in microseconds. A gap after a
  kernel that the host waits for (a host sync) and before the next launch is
  the host's time between the two.

One rank's view (the caller's); the layer's step time is set by the slowest
rank, which :mod:`bench_moe_layer` times separately. The profiler slows the
host's launches a little, so ``idle_ms`` is, if anything, an overestimate.
"""
import json
import os
import re
import tempfile
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["CATEGORIES", "classify_kernel", "summarize_events", "profile_steps"]

CATEGORIES: Sequence[Tuple[str, str]] = (
    ("NCCL", r"nccl"),
    ("grouped GEMMs (CUTLASS)", r"grouped|GemmUniversal|prepare_groups|zero_empty_groups|device_kernel<"),
    ("dense GEMMs (cuBLAS)", r"gemm|nvjet|xmma|sgemm|cublas"),
    ("dispatch + layout", r"dispatch_|layout_|recv_copyout|fused_segments"),
    ("combine", r"combine_|acc_cast|copy_segments_sm"),
    ("gate kernels", r"gate_collect|gate_grad|topk|softmax"),
    ("signals + waits", r"barrier_kernel|raise_kernel|wait_words|spin|sleep"),
    ("SwiGLU", r"swiglu"),
    ("sort + scan", r"cub::|radix|sort|scan"),
    ("copies + memsets", r"^memcpy|^memset"),
)
"""(category, regular expression) pairs, tried in order on a kernel's name (case-insensitive)."""
_COMPILED = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in CATEGORIES]


def classify_kernel(name: str) -> str:
    """The category of a kernel (or copy, memset) by its name: the first of :data:`CATEGORIES` whose
    expression it contains, else ``"other"``."""
    for cat, rx in _COMPILED:
        if rx.search(name):
            return cat
    return "other"


def short_name(name: str, width: int = 100) -> str:
    """A kernel's name without ``void`` and its argument list, cut to ``width`` characters."""
    if not name.startswith(("Memcpy", "Memset")):
        name = (name[5:] if name.startswith("void ") else name).split("(")[0]
    return name if len(name) <= width else name[:width - 3] + "..."


def summarize_events(events: Iterable[Tuple[str, float, float]], steps: int, top: int = 12) -> Dict:
    """Per-step summary of device events ``(name, start_us, duration_us)`` (see the module's doc)."""
    if steps < 1:
        raise ValueError(f"summarize_events: steps must be >= 1, got {steps}")
    evs = sorted((float(s), float(s) + max(0.0, float(d)), n) for n, s, d in events)
    if not evs:
        raise ValueError("summarize_events: the trace holds no device event (did the steps run on the GPU?)")
    busy, cur_s, cur_e, last = 0.0, evs[0][0], evs[0][1], evs[0][2]
    gaps: Dict[Tuple[str, str], List[float]] = {}
    for s, e, n in evs[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            g = gaps.setdefault((short_name(last, 60), short_name(n, 60)), [0.0, 0, 0.0])
            g[0] += s - cur_e
            g[1] += 1
            g[2] = max(g[2], s - cur_e)
            cur_s, cur_e, last = s, e, n
        elif e > cur_e:
            cur_e, last = e, n
    busy += cur_e - cur_s
    window = max(e for _, e, _ in evs) - evs[0][0]
    total = sum(e - s for s, e, _ in evs)
    cats: Dict[str, float] = {}
    kernels: Dict[str, List[float]] = {}
    for s, e, n in evs:
        cat = classify_kernel(n)
        cats[cat] = cats.get(cat, 0.0) + (e - s)
        k = kernels.setdefault(short_name(n), [0.0, 0, cat])
        k[0] += e - s
        k[1] += 1
    per = 1e3 * steps  # us over all steps -> ms per step
    return {
        "steps": steps,
        "window_ms": window / per, "busy_ms": busy / per, "idle_ms": (window - busy) / per,
        "concurrent_ms": (total - busy) / per,
        "categories": {c: v / per for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": v[0] / per, "calls": v[1] / steps, "category": v[2]}
                        for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
        "top_gaps": [{"after": a, "before": b, "ms": v[0] / per, "count": v[1] / steps, "longest_us": v[2]}
                     for (a, b), v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def _trace_events(path: str) -> List[Tuple[str, float, float]]:
    with open(path) as f:
        trace = json.load(f)
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((ev.get("name", "?"), ev["ts"], ev.get("dur", 0.0)))
    return out


def profile_steps(step: Callable[[int], None], steps: int = 5, warmup: int = 2,
                  sync: Optional[Callable[[], None]] = None, top: int = 12) -> Dict:
    """Run ``step(i)`` ``warmup`` times untimed, then under the profiler once more unrecorded (the
    profiler's own start-up: on ranks that start it at different speeds the first collective would
    wait for the slowest), then ``sync()`` and ``steps`` recorded steps back to back; return
    :func:`summarize_events` of their device events (CUDA only)."""
    if not torch.cuda.is_available():
        raise RuntimeError("profile_steps: needs a CUDA device (it reads the GPU's kernels)")
    if steps < 1:
        raise ValueError(f"profile_steps: steps must be >= 1, got {steps}")
    for i in range(warmup):
        step(i)
    from torch.profiler import ProfilerActivity, profile, schedule
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CUDA],  # device activity only: less host overhead
                     schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            step(warmup)  # profiled, not recorded
            torch.cuda.synchronize()
            if sync is not None:
                sync()
            prof.step()  # the recorded part starts
            for i in range(steps):
                step(warmup + 1 + i)
            torch.cuda.synchronize()
            prof.step()  # and ends: the trace is written
        if not os.path.exists(path):
            raise RuntimeError("profile_steps: the profiler wrote no trace")
        return summarize_events(_trace_events(path), steps, top)
