"""Shared timing helper for the benchmarks: warm-up, CUDA events, median, rotated inputs.

    from timing import bench, rotating
    setup = rotating(lambda i: (torch.randn(n, n, device="cuda"),), 3)  # fresh inputs, cycled
    r = bench(lambda a: a @ a, warmup=5, repeats=20, setup=setup)
    r["median_ms"], r["p10_ms"], r["p90_ms"], r["all_ms"]

Each timed run is bracketed by CUDA events on the current stream (host
``perf_counter`` on CPU) after the device has drained, so runs do not overlap
and a run's time is its own. ``setup`` and ``sync`` run outside the timed
region.
"""
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["bench", "bench_interleaved", "rotating"]


def rotating(make: Callable[[int], Any], n: int) -> Callable[[int], Any]:
    """Build ``n`` argument tuples with ``make(i)`` now; ``setup(run)`` returns set ``run % n``.

    Cycling through several freshly made inputs keeps one input from staying
    in cache between runs."""
    pool = [make(i) for i in range(n)]
    return lambda run: pool[run % n]


def _percentile(sorted_ms: List[float], q: float) -> float:
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    pos = q * (len(sorted_ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def bench(fn: Callable, warmup: int = 5, repeats: int = 20, setup: Optional[Callable[[int], Any]] = None,
          sync: Optional[Callable[[], None]] = None, cuda: Optional[bool] = None) -> Dict[str, Any]:
    """Time ``fn(*setup(run))`` (or ``fn()`` without setup).

    Args:
        fn: the work to time.
        warmup: untimed runs first.
        repeats: timed runs.
        setup: ``setup(run) -> tuple`` of arguments for run ``run`` (warm-up runs included), e.g. :func:`rotating`.
        sync: called before every run, outside the timed region (e.g. a barrier to line up ranks).
        cuda: time with CUDA events; default: whether CUDA is available.

    Returns:
        ``{"median_ms", "p10_ms", "p90_ms", "all_ms"}`` (``all_ms`` in run order).
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    times: List[float] = []
    for run in range(warmup + repeats):
        ms = _time_once(fn, setup, run, sync, cuda)
        if run >= warmup:
            times.append(ms)
    return _summary(times)


def _time_once(fn: Callable, setup, run: int, sync, cuda: bool) -> float:
    args = setup(run) if setup is not None else ()
    if not isinstance(args, tuple):
        args = (args, )
    if cuda:
        torch.cuda.synchronize()
    if sync is not None:
        sync()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def _summary(times: List[float]) -> Dict[str, Any]:
    s = sorted(times)
    return {"median_ms": statistics.median(s), "p10_ms": _percentile(s, 0.1), "p90_ms": _percentile(s, 0.9),
            "all_ms": times}


def bench_interleaved(variants: Dict[str, Tuple[Callable, Optional[Callable[[int], Any]]]], warmup: int = 5,
                      repeats: int = 20, sync: Optional[Callable[[], None]] = None, cuda: Optional[bool] = None,
                      on_error: Optional[Callable[[str, BaseException], None]] = None) -> Dict[str, Dict[str, Any]]:
    """:func:`bench` for several variants at once, taking turns: round ``r`` runs every variant once
    (the order rotated by one each round), so a drift of the device's clocks over the run (heat,
    power) weighs on every variant alike instead of on whichever ran last.

    ``variants``: ``{name: (fn, setup)}``. Returns ``{name: bench-like dict}``; a variant that
    raises is dropped from later rounds and reported as ``{"error": "Type: message"}`` (and to
    ``on_error(name, exc)``)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    names = list(variants)
    times: Dict[str, List[float]] = {n: [] for n in names}
    errors: Dict[str, str] = {}
    for run in range(warmup + repeats):
        k = run % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if name in errors:
                continue
            fn, setup = variants[name]
            try:
                ms = _time_once(fn, setup, run, sync, cuda)
            except Exception as e:  # noqa: BLE001 - reported per variant
                errors[name] = f"{type(e).__name__}: {e}"
                if on_error is not None:
                    on_error(name, e)
                continue
            if run >= warmup:
                times[name].append(ms)
    return {n: ({"error": errors[n]} if n in errors else _summary(times[n])) for n in names}
