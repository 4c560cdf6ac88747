"""Shared timing helper for the benchmarks: warm-up, CUDA events, median, rotated inputs.

    from timing import bench, rotating
    setup = rotating(lambda i: (torch.randn(n, n, device="cuda"),), 3)  # fresh inputs, cycled
    r = bench(lambda a: a @ a, warmup=5, repeats=20, setup=setup)
    r["median_ms"], r["p10_ms"], r["p90_ms"], r["all_ms"]

Each timed run is bracketed by CUDA events on the current stream (host
``perf_counter`` on CPU) after the device has drained, so runs do not overlap
and a run's time is its own. ``setup`` and ``sync`` run outside the timed
region. Across ranks, ``queued_start`` lines up the GPUs themselves instead of
the hosts: each run first spins on the GPU and passes a GPU-side barrier, so
the timed work starts on every GPU at once with all its launches queued.
"""
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["bench", "bench_interleaved", "device_barrier", "queued_start", "rotating", "spin_cycles_per_ms"]


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


_SPIN_CYCLES_PER_MS: List[float] = []
_DEVICE_BARRIERS: Dict[Any, Any] = {}


def spin_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current GPU (measured once)."""
    if not _SPIN_CYCLES_PER_MS:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # warm-up
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        _SPIN_CYCLES_PER_MS.append(cycles / s.elapsed_time(e))
    return _SPIN_CYCLES_PER_MS[0]


def device_barrier(group=None) -> None:
    """A barrier between the GPUs of ``group`` (default: the world), queued on the current stream
    (torch symmetric memory's, on a small buffer of its own): every GPU leaves it within a
    signal's latency of the others."""
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    from ds_uniep.symm import rendezvous
    group = group or dist.group.WORLD
    key = (group.group_name, torch.cuda.current_device())
    if key not in _DEVICE_BARRIERS:
        buf = symm_mem.empty(64, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        _DEVICE_BARRIERS[key] = (buf, rendezvous(buf, group))
    _DEVICE_BARRIERS[key][1].barrier(0)


def queued_start(spin_ms: float, group=None) -> Callable[[], None]:
    """A ``before`` for :func:`bench_interleaved`: a GPU spin of ``spin_ms`` (longer than a run takes
    to launch), then :func:`device_barrier`, queued ahead of each timed run."""
    def before():
        torch.cuda._sleep(int(spin_ms * spin_cycles_per_ms()))
        device_barrier(group)
    return before


def _time_once(fn: Callable, setup, run: int, sync, cuda: bool, before=None, late=None) -> float:
    args = setup(run) if setup is not None else ()
    if not isinstance(args, tuple):
        args = (args, )
    if cuda:
        torch.cuda.synchronize()
    if sync is not None:
        sync()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        start.record()
        fn(*args)
        if before is not None and late is not None and start.query():
            late.append(run)  # the GPU reached the start before the last launch: launches were timed
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
                      on_error: Optional[Callable[[str, BaseException], None]] = None,
                      before: Optional[Callable[[], None]] = None) -> Dict[str, Dict[str, Any]]:
    """:func:`bench` for several variants at once, taking turns: round ``r`` runs every variant once
    (the order rotated by one each round), so a drift of the device's clocks over the run (heat,
    power) weighs on every variant alike instead of on whichever ran last.

    ``variants``: ``{name: (fn, setup)}``. Returns ``{name: bench-like dict}``; a variant that
    raises is dropped from later rounds and reported as ``{"error": "Type: message"}`` (and to
    ``on_error(name, exc)``). ``before`` (CUDA, e.g. :func:`queued_start`) is queued after ``sync``
    and ahead of each run's start event; each result then also counts its ``late_runs``: timed runs
    whose start the GPU reached before the run had been launched."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    names = list(variants)
    times: Dict[str, List[float]] = {n: [] for n in names}
    late: Dict[str, List[int]] = {n: [] for n in names}
    errors: Dict[str, str] = {}
    for run in range(warmup + repeats):
        k = run % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if name in errors:
                continue
            fn, setup = variants[name]
            try:
                ms = _time_once(fn, setup, run, sync, cuda, before, late[name] if run >= warmup else None)
            except Exception as e:  # noqa: BLE001 - reported per variant
                errors[name] = f"{type(e).__name__}: {e}"
                if on_error is not None:
                    on_error(name, e)
                continue
            if run >= warmup:
                times[name].append(ms)
    out = {n: ({"error": errors[n]} if n in errors else _summary(times[n])) for n in names}
    if before is not None:
        for n in names:
            if n not in errors:
                out[n]["late_runs"] = len(late[n])
    return out
