"""ds_uniep's grouped GEMM of the experts (Hopper, CUTLASS wgmma + TMA) and its autograd.

Letters: R rows, G groups (local experts), N and K the two sides of a group's weight
``w[g]: [N, K]`` (an ``nn.Linear`` weight), ``offs: [G]`` int32 row ends on the device.

Three operations, each one grouped-GEMM launch after a small prepare kernel that reads the
problem shapes from ``offs`` on the device (the host never waits for the routing counts):

- ``fwd``: ``y[R, N] = x[R, K] @ w[g]^T`` for the rows of group g;
- ``dgrad``: ``dx[R, K] = dy[R, N] @ w[g]``;
- ``wgrad``: ``dw[g] = dy_g^T @ x_g`` (zero for a group without rows).

bf16 operands, fp32 accumulation, one rounding to bf16. No split-K: every output element is a
single CTA's k-ordered sum, so results are bitwise the same for every tile configuration, tile
order and SM count (tests check it) and from run to run. :data:`CONFIGS` are the tile
configurations built; :data:`DEFAULT_CONFIGS` says which each operation runs (a fixed one, or
``"auto"``: the first call of each shape picks the fastest; ``bench_grouped_gemm.py`` measures
them all alone, ``bench_gemm_in_layer.py`` inside the MoE layer).
"""

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

OPS = {"fwd": 0, "dgrad": 1, "wgrad": 2}
CONFIGS = ("coop128x256", "coop256x128", "pingpong128x128")
"""Tile configurations, in the kernels' index order: cooperative 128x256x64, cooperative
256x128x64, ping-pong 128x128x64; all with 2x1 clusters. A configuration may carry the
persistent scheduler's tile order after a colon: ``"coop128x256:n4"`` walks tiles along N in
bands of 4 (``m``: along M, the default; band 1, 2, 4 or 8). Neither changes the values."""

TILE_CONFIGS = {(128, 256): "coop128x256", (256, 128): "coop256x128", (128, 128): "pingpong128x128"}
"""``(tile_m, tile_n)`` of the ``uniep.overlap`` block -> the tile configuration with those tiles."""


def configs_for_tiles(tile_m: int, tile_n: int) -> Dict[str, str]:
    """Every operation's configuration for a ``tile_m`` x ``tile_n`` tile (:data:`TILE_CONFIGS`, the
    scheduler's default tile order); a ValueError naming the tiles built for any other pair."""
    config = TILE_CONFIGS.get((int(tile_m), int(tile_n)))
    if config is None:
        built = ", ".join(f"{m}x{n}" for m, n in TILE_CONFIGS)
        raise ValueError(f"ds_uniep's grouped GEMM is built with tiles (tile_m x tile_n) {built}, not "
                         f"{tile_m}x{tile_n}")
    return {op: config for op in OPS}


ORDERS = ("", ":n1", ":m4", ":n4")
"""Scheduler tile orders the automatic choice tries with every tile configuration."""

DEFAULT_CONFIGS = {"fwd": "coop128x256", "dgrad": "auto", "wgrad": "auto"}
"""The configuration each operation runs with unless told otherwise. ``"auto"``: the first call
of an (op, G, N, K, rows rounded up to a power of two) on a device times every tile
configuration with every order of :data:`ORDERS` on that call's operands, under sustained load
(:func:`time_sustained`), and keeps the fastest for the process. The values cannot change with
the choice (see above), so choosing is safe on every rank independently. The forward runs
``coop128x256``, not the automatic choice: a configuration timed fastest alone on the layer's rows
need not be the fastest inside the layer, beside the dispatch and the other GEMMs
(``benchmarks/bench_gemm_in_layer.py`` compares them there)."""

_TUNED: Dict[Tuple, str] = {}

TILE_RUNS: Counter = Counter()
"""Calls of ds_uniep's grouped GEMM in this process by ``(op, tile configuration)`` (the plain and
the segment forms; the automatic choice's timing runs are not counted): which tile the layer's
GEMMs ran, which their bits cannot show."""

BURST_MS = 8.0
"""Length of each timed burst (and of the untimed one before it) in the automatic choice."""


def available(device) -> Tuple[bool, str]:
    """(usable, reason) for the grouped GEMM on ``device``: a Hopper GPU, nvcc and the CUTLASS
    headers; checks, never builds."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA device"
    from ._ops import ops_package
    return ops_package().build_requirements(device)


def _ops():
    from ._ops import ext
    return ext()


def parse_config(config: str) -> Tuple[int, int, int]:
    """``"tile[:<m|n><band>]"`` -> (tile index, raster along N?, swizzle band). (Not ``"auto"``.)"""
    tile, sep, order = str(config).partition(":")
    if tile not in CONFIGS:
        raise ValueError(f"grouped GEMM config {config!r}: tile {tile!r} is not one of {CONFIGS}")
    if not sep:
        return CONFIGS.index(tile), 0, 1
    if len(order) < 2 or order[0] not in "mn" or order[1:] not in ("1", "2", "4", "8"):
        raise ValueError(f"grouped GEMM config {config!r}: the order after ':' must be m or n and a band of "
                         "1, 2, 4 or 8 (e.g. 'n4')")
    return CONFIGS.index(tile), int(order[0] == "n"), int(order[1:])


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, op: str, config: Optional[str] = None,
               sm_count: int = 0) -> Tensor:
    """One grouped GEMM (see the module docstring for ``op``); ``config`` defaults to
    :data:`DEFAULT_CONFIGS`; ``sm_count`` caps the SMs the persistent kernel uses (0: all)."""
    if op not in OPS:
        raise ValueError(f"grouped GEMM op {op!r} is not one of {tuple(OPS)}")
    _check(a, b, offs, op, sm_count)
    config = DEFAULT_CONFIGS[op] if config is None else config
    if config == "auto":
        config = _choose(a, b, offs, op, sm_count)
    tile, raster_n, swizzle = parse_config(config)
    TILE_RUNS[(op, CONFIGS[tile])] += 1
    return _ops().grouped_mm(a, b, offs, OPS[op], tile, int(sm_count), raster_n, swizzle)


def _check(a: Tensor, b: Tensor, offs: Optional[Tensor], op: str, sm_count: int) -> None:
    """Every input rule of the kernels, raised here as Python errors naming the tensor. ``offs``
    None: a forward over segments, whose groups are ``b``'s weights."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor) or t.dtype != torch.bfloat16:
            raise TypeError(f"grouped GEMM {op}: {name} must be a bf16 tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"grouped GEMM {op}: {name} must be a contiguous CUDA tensor")
    if offs is not None and (offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() < 1
                             or offs.device != a.device):
        raise ValueError(f"grouped GEMM {op}: offs must be a non-empty [G] int32 tensor on {a.device}, got "
                         f"{offs.dtype} {tuple(offs.shape)} on {offs.device}")
    if b.device != a.device or a.dim() != 2:
        raise ValueError(f"grouped GEMM {op}: a must be [R, *] and on b's device")
    groups = offs.numel() if offs is not None else b.shape[0] if b.dim() == 3 else -1
    if op == "wgrad":
        if b.dim() != 2 or b.shape[0] != a.shape[0]:
            raise ValueError(f"grouped GEMM wgrad: x must be [R, K] with the R of dy ({a.shape[0]}), got "
                             f"{tuple(b.shape)}")
        n, k = a.shape[1], b.shape[1]
    else:
        if b.dim() != 3 or b.shape[0] != groups:
            raise ValueError(f"grouped GEMM {op}: w must be [G, N, K] with G = {groups}, got {tuple(b.shape)}")
        n, k = b.shape[1], b.shape[2]
        want = k if op == "fwd" else n
        if a.shape[1] != want:
            raise ValueError(f"grouped GEMM {op}: a must have {want} columns, got {tuple(a.shape)}")
    if n % 8 or k % 8:
        raise ValueError(f"grouped GEMM {op}: N and K must be multiples of 8 (16-byte rows), got N={n} K={k}")
    if sm_count and (sm_count < 2 or sm_count % 2):
        raise ValueError(f"grouped GEMM {op}: sm_count must be 0 (all SMs) or an even number (the kernels run "
                         f"2-CTA clusters), got {sm_count}")


def candidates():
    """Every explicit configuration: each tile configuration with each order of :data:`ORDERS`."""
    return [tile + order for tile in CONFIGS for order in ORDERS]


def _tuning_key(op: str, a_shape, b: Tensor, groups: int, sm_count: int) -> Tuple:
    """The cache key of a choice: op, device, G, N, K, rows rounded up to a power of two, SMs.
    ``a_shape``: the first operand's shape."""
    n, k = (b.shape[1], b.shape[2]) if op != "wgrad" else (a_shape[1], b.shape[1])
    rows = max(1, a_shape[0])
    return (op, b.device, groups, n, k, 1 << (rows - 1).bit_length(), int(sm_count))


def time_sustained(fns: Mapping[str, Callable[[], object]], burst_ms: float = BURST_MS,
                   rounds: int = 3) -> Dict[str, float]:
    """Median ms per call of each of ``fns`` under sustained load: per round, each runs an untimed
    burst of back-to-back calls of about ``burst_ms`` and then a timed burst as long, in turns,
    and the host waits only at the end of a round, so the GPU never idles between them (one call
    of each first: the warm-up, and how many calls make a burst). Timed one call at a time, with
    idle gaps, a GPU runs at clocks it cannot hold under a training step's load; near the power
    limit the ranking of GEMM configurations differs (see :data:`DEFAULT_CONFIGS`)."""
    def timed(fn, calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        return start, end

    marks = {name: timed(fn, 1) for name, fn in fns.items()}
    list(marks.values())[-1][1].synchronize()
    calls = {name: max(2, math.ceil(burst_ms / max(s.elapsed_time(e), 1e-3))) for name, (s, e) in marks.items()}
    samples: Dict[str, list] = {name: [] for name in fns}
    for _ in range(rounds):  # in turns, so clock drift falls on every one alike
        for name, fn in fns.items():
            for _ in range(calls[name]):
                fn()
            marks[name] = timed(fn, calls[name])
        list(marks.values())[-1][1].synchronize()
        for name, (start, end) in marks.items():
            samples[name].append(start.elapsed_time(end) / calls[name])
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def _choose(a: Tensor, b: Tensor, offs: Tensor, op: str, sm_count: int, burst_ms: float = BURST_MS,
            rounds: int = 3) -> str:
    """The fastest of :func:`candidates` for this call's shape (cached per shape; see
    :data:`DEFAULT_CONFIGS`), timed under sustained load (:func:`time_sustained`)."""
    key = _tuning_key(op, a.shape, b, offs.shape[0], sm_count)
    chosen = _TUNED.get(key)
    if chosen is not None:
        return chosen
    ext = _ops()

    def runner(config):
        tile, raster_n, swizzle = parse_config(config)
        return lambda: ext.grouped_mm(a, b, offs, OPS[op], tile, int(sm_count), raster_n, swizzle)

    timings = time_sustained({c: runner(c) for c in candidates()}, burst_ms, rounds)
    chosen = min(timings, key=timings.get)
    _TUNED[key] = chosen
    return chosen


def chosen_configs() -> Dict[Tuple, str]:
    """The automatic choices made so far: {(op, device, G, N, K, rows bucket, sm_count): config}."""
    return dict(_TUNED)


def reference(op: str, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """fp32 result of ``op`` computed group by group with plain matmuls (the ground truth the
    benchmark and the tests measure both grouped GEMMs against)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    a32, b32 = a.float(), b.float()
    if op == "fwd":
        return torch.cat([a32[s:e] @ b32[g].t() for g, (s, e) in enumerate(zip(starts, ends))])
    if op == "dgrad":
        return torch.cat([a32[s:e] @ b32[g] for g, (s, e) in enumerate(zip(starts, ends))])
    if op == "wgrad":
        return torch.stack([a32[s:e].t() @ b32[s:e] for s, e in zip(starts, ends)])
    raise ValueError(f"grouped GEMM op {op!r} is not one of {tuple(OPS)}")


def torch_grouped_mm(op: str, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """The same operation through ``torch._grouped_mm``, in the layouts torch's autograd of it uses."""
    if op == "fwd":
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    if op == "dgrad":
        return torch._grouped_mm(a, b, offs=offs)
    if op == "wgrad":
        return torch._grouped_mm(a.t(), b, offs=offs)
    raise ValueError(f"grouped GEMM op {op!r} is not one of {tuple(OPS)}")


@dataclass
class ArrivalWaits:
    """How a forward grouped GEMM runs while its rows are still arriving (the fused schedule).

    The GEMM runs over ``segs`` (``[S, 4]`` int32 rows: first row, rows, weight, word): segment s
    is a run of rows of one weight, and none of its tiles loads an operand before
    ``ready[segs[s, 3]]`` reaches ``epoch``. The segments cover the same rows with the same
    weights as the per-group offsets, so the bits are those of the plain forward (a row's result
    never depends on its tile). ``sm_count``: SMs of the waiting GEMM (the rest move the rows);
    ``done``: recorded when every row has arrived, joined into the current stream once the GEMM is
    queued. ``comm_job`` (interleaved roles): the dispatch job (``interleaved_job``'s bytes) that
    a spare warp of each of the GEMM's CTAs runs beside its tiles; ``sm_count`` is then every SM.
    ``result``: the GEMM's output, queued by the fused dispatch itself (see
    ``NVLinkDispatcher.request_fused``); :func:`grouped_linear` adopts it. A wait past ``timeout_ns`` fills ``error_record`` (as the NVLink kernels' waits
    do) and sets ``poison``; the caller's check raises it."""
    segs: Tensor
    ready: Tensor
    epoch: int
    timeout_ns: int
    error_record: Tensor
    poison: Tensor
    layer_id: int
    rank: int
    phase: int
    sm_count: int
    done: Optional[torch.cuda.Event] = None
    result: Optional[Tensor] = None
    comm_job: Optional[Tensor] = None


@dataclass
class ComputedRows:
    """A forward grouped GEMM computed beforehand over segments as its rows arrived (the two-level
    dispatch's phases, ``ds_uniep.schedules.across_nodes``): :func:`grouped_linear` given it as
    ``waits`` adopts ``result``, the same bits as its own forward (a row's result never depends on
    its tile); the backward is the usual one, over every row."""
    result: Optional[Tensor] = None
    done: Optional[torch.cuda.Event] = None


FUSED_DEFAULT = "coop128x256"
"""The fused schedule's waiting GEMM's configuration unless the block's tiles name one (band 1:
the scheduler rounds every group's tiles up to a whole band, and that GEMM's groups are runs of
rows). Not chosen by timing per shape: the configuration fastest alone on scratch rows is not
the fastest while the dispatch shares the GPU with it."""


def run_alignment(config: str) -> int:
    """Rows per tile of ``config`` as the persistent scheduler counts them for a group: the tile's
    M times the cluster's 2 times the band. Runs of rows cut at multiples of it from an expert's
    first row take the tiles the whole expert takes (``ds_uniep.layout.fused_runs``)."""
    tile, _, band = parse_config(config)
    return (256 if CONFIGS[tile] == "coop256x128" else 128) * 2 * band


def fused_config(configs: Optional[Mapping[str, str]]) -> str:
    """The forward configuration of the fused schedule's waiting GEMM: ``configs["fwd"]`` when the
    block's tiles set it, else :data:`FUSED_DEFAULT`."""
    config = (configs or {}).get("fwd", "auto")
    return FUSED_DEFAULT if config == "auto" else config


SEG_ALT_ROWS = 1 << 30
"""Flag in a segment's weight index (``segs[:, 2]``): the segment's rows come from ``a_alt``."""


def grouped_mm_segments(a: Tensor, w: Tensor, segs: Tensor, config: str, waits: Optional[ArrivalWaits] = None,
                        sm_count: int = 0, out: Optional[Tensor] = None, a_alt: Optional[Tensor] = None,
                        alt_row0: int = 0, out_ptrs: Optional[Tensor] = None, op: str = "fwd") -> Optional[Tensor]:
    """Forward over segments (``segs [S, 4]``: first row, rows, weight index, word index): the
    rows of each segment of ``a [R, K]`` times ``w[weight]^T`` (``w [W, N, K]``) into the same rows
    of ``out [R, N]`` (new when None; rows in no segment are left as they are). ``op="dgrad"``:
    ``a`` is ``dy [R, N]`` and each segment's rows times ``w[weight]`` go to ``out [R, K]`` (the
    plain dgrad's bits, as the forward's are the plain forward's). ``waits``: each
    segment first waits for its word (see :class:`ArrivalWaits`); its ``sm_count`` then applies.
    ``config``: an explicit tile configuration (not ``"auto"``). ``a_alt`` (``[R', K]``, standing
    for rows ``alt_row0 ..`` of ``a``): segments whose weight index carries :data:`SEG_ALT_ROWS`
    read their rows there instead (the caller keeps such segments inside those rows).
    ``out_ptrs`` (``[S]`` int64 on ``a``'s device): segment s's output rows go to address
    ``out_ptrs[s]`` instead (rows of N back to back; a peer's symmetric memory allowed: the fused
    schedule's second GEMM stores into its sources' combine buffers); then nothing is returned."""
    if segs.dtype != torch.int32 or segs.dim() != 2 or segs.shape[1] != 4 or segs.device != a.device:
        raise ValueError(f"grouped GEMM segments: segs must be [S, 4] int32 on {a.device}, got {segs.dtype} "
                         f"{tuple(segs.shape)} on {segs.device}")
    if op not in ("fwd", "dgrad"):
        raise ValueError(f"grouped GEMM segments: op must be 'fwd' or 'dgrad', got {op!r}")
    sms = waits.sm_count if waits is not None else sm_count
    _check(a, w, None, op, sms)
    tile, raster_n, swizzle = parse_config(config)
    out_cols = w.shape[1] if op == "fwd" else w.shape[2]
    if out_ptrs is not None:
        if out is not None:
            raise ValueError("grouped GEMM segments: give out or out_ptrs, not both")
        if out_ptrs.dtype != torch.int64 or out_ptrs.shape != (segs.shape[0], ) or out_ptrs.device != a.device:
            raise ValueError(f"grouped GEMM segments: out_ptrs must be [{segs.shape[0]}] int64 on {a.device}, got "
                             f"{out_ptrs.dtype} {tuple(out_ptrs.shape)} on {out_ptrs.device}")
        out = a.new_empty(0)
    elif out is None:
        out = a.new_empty(a.shape[0], out_cols)
    wait_args = (None, 0, 1, None, None, 0, 0, 0) if waits is None else (
        waits.ready, int(waits.epoch), int(waits.timeout_ns), waits.error_record, waits.poison, int(waits.layer_id),
        int(waits.rank), int(waits.phase))
    if a_alt is not None and (a_alt.dtype != a.dtype or a_alt.dim() != 2 or a_alt.shape[1] != a.shape[1]
                              or not 0 <= alt_row0 <= a.shape[0] - a_alt.shape[0]):
        raise ValueError(f"grouped GEMM segments: a_alt must be [R', {a.shape[1]}] {a.dtype} standing for rows "
                         f"{alt_row0}.. of a's {a.shape[0]}, got {a_alt.dtype} {tuple(a_alt.shape)}")
    TILE_RUNS[(op, CONFIGS[tile])] += 1
    _ops().grouped_mm_segments(a, w, segs, out, tile, int(sms), raster_n, swizzle, *wait_args,
                               None if a_alt is None else a_alt.contiguous(), int(alt_row0), out_ptrs, OPS[op],
                               None if waits is None else waits.comm_job)
    return None if out_ptrs is not None else out


class _GroupedLinear(torch.autograd.Function):
    """``y = x @ w[g]^T`` per group; backward is a dgrad and a wgrad grouped GEMM. With ``waits``
    the forward is the one the fused dispatch queued (:class:`ArrivalWaits`), the same bits. With
    ``into`` the dgrad is ``into``'s (``x`` comes detached; the gradient goes to ``source``)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, configs: Mapping[str, str], sm_count: int,
                waits: Optional[ArrivalWaits] = None, into=None, source: Optional[Tensor] = None) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.configs, ctx.sm_count, ctx.into = configs, sm_count, into
        if waits is None:
            return grouped_mm(x, w, offs, "fwd", configs["fwd"], sm_count)
        # The fused dispatch queued this GEMM (over its segments, on the same rows and weights).
        y = waits.result
        if y is None or y.shape != (x.shape[0], w.shape[1]):
            raise ValueError(f"grouped_linear with waits adopts the fused dispatch's first GEMM of shape "
                             f"{(x.shape[0], w.shape[1])}, got {None if y is None else tuple(y.shape)}")
        if waits.done is not None:
            torch.cuda.current_stream(x.device).wait_event(waits.done)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        sm = ctx.sm_count
        if ctx.into is not None:  # the dgrad's rows go to the sources; the wgrad runs while they travel
            to_source = ctx.needs_input_grad[7]
            if to_source:
                ctx.into.start(grad, w, offs, ctx.configs)
            dw = grouped_mm(grad, x, offs, "wgrad", ctx.configs["wgrad"], sm) if ctx.needs_input_grad[1] else None
            return None, dw, None, None, None, None, None, ctx.into.finish() if to_source else None
        dx = grouped_mm(grad, w, offs, "dgrad", ctx.configs["dgrad"], sm) if ctx.needs_input_grad[0] else None
        dw = grouped_mm(grad, x, offs, "wgrad", ctx.configs["wgrad"], sm) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None, None


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor, configs: Optional[Mapping[str, str]] = None,
                   sm_count: int = 0, waits: Optional[ArrivalWaits] = None, into=None) -> Tensor:
    """Rows of group g of ``x [R, K]`` times ``w[g]^T`` (``w: [G, N, K]``), with autograd.

    ``offs``: ``[G]`` int32 cumulative row counts on ``x``'s device, ``offs[-1] == R``.
    ``configs``: tile configuration per op (missing ops take :data:`DEFAULT_CONFIGS`).
    ``sm_count``: SMs the forward and backward GEMMs use (0: all; else even), the same bits.
    ``waits``: the forward is the GEMM the fused dispatch queued over segments while the rows
    arrive (:class:`ArrivalWaits`, its ``result``), or one computed over them beforehand
    (:class:`ComputedRows`); the backward is the usual one.
    ``into``: ``x`` is the output of a dispatch and ``into`` runs the dgrad together with that
    dispatch's backward (:class:`ds_uniep.epilogue_combine.DgradCombine`: ``start(grad, w, offs,
    configs)``, then the wgrad, then ``finish()`` gives the gradient of ``into.source``, the
    dispatch's input); no gradient flows to ``x`` itself.
    """
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"grouped_linear takes bf16 x and w, got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or offs.shape != (w.shape[0], ):
        raise ValueError(f"grouped_linear: x must be [R, K], w [G, N, K] and offs [G]; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, offs {tuple(offs.shape)}")
    merged = dict(DEFAULT_CONFIGS)
    merged.update(configs or {})
    for op, config in merged.items():
        if op not in OPS:
            raise ValueError(f"grouped_linear: configs names unknown op {op!r} (ops: {tuple(OPS)})")
        if config != "auto":
            parse_config(config)
    if into is not None:
        return _GroupedLinear.apply(x.detach().contiguous(), w.contiguous(), offs.to(torch.int32), merged,
                                    int(sm_count), waits, into, into.source)
    return _GroupedLinear.apply(x.contiguous(), w.contiguous(), offs.to(torch.int32), merged, int(sm_count), waits)
