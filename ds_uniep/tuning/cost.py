"""A cheap analytical estimate of a plan's forward+backward time.

It only orders candidates (the likely-fast ones are measured first, so early
stopping has a good bar early); it never picks the winner and its numbers are
never reported as measurements. Its constants are rough H200 ceilings, scaled by
the SM count of the GPU at hand.
"""

import math

from ..knobs import DEFAULT_TILE
from .space import Plan, Space

DENSE_TFLOPS_PER_SM = 795.0 / 132
"""bf16 dense GEMM rate per SM."""
STORE_GBPS_PER_SM = 353.0 / 8
"""Peer-store bandwidth one communicating SM sustains."""
LINK_GBPS = 370.0
"""Peer-store ceiling from all SMs."""
COPY_SEGMENT_MS = 0.0106
"""One copy-engine copy of an (expert, source) segment of the pipelined schedule; copies to different
ranks overlap."""
LAUNCH_MS = 0.01
SIGNAL_MS = 0.0005
"""Cost of one arrival signal wait/raise pair, spread over the GEMM blocks."""

_TILE_EFFICIENCY = {64: 0.70, 128: 0.90, 256: 1.0}


def estimate_ms(plan: Plan, space: Space) -> float:
    """Estimated ms of one layer forward+backward under ``plan`` (lower is better)."""
    s, g = space.shape, space.gpu
    L = s.num_local_experts
    rows = s.rows_per_expert
    # Expert GEMMs (SwiGLU: three [M, F] matrices), forward + dgrad + wgrad = 3x the forward FLOPs.
    tile_m, tile_n = plan.gemm_tiles() or (DEFAULT_TILE, DEFAULT_TILE)
    padded_rows = math.ceil(rows / tile_m) * tile_m
    flops = 3 * 2 * 3 * L * padded_rows * s.M * s.F
    gemm_sms = g.num_sms
    comm_sms = plan.num_comm_sms if plan.num_comm_sms is not None else g.num_sms
    if space.comm_shares_sms(plan):
        gemm_sms -= comm_sms
    tiles = L * math.ceil(rows / tile_m) * math.ceil(2 * s.F / tile_n)
    waves = math.ceil(tiles / max(1, gemm_sms))
    wave_eff = tiles / (waves * max(1, gemm_sms))
    eff = (_TILE_EFFICIENCY[tile_m] * _TILE_EFFICIENCY[tile_n]) ** 0.5 * wave_eff
    if plan.roles == "interleaved":
        eff *= 0.92  # communication warps take issue slots and registers from the GEMM warpgroups
    gemm_ms = flops / (gemm_sms * DENSE_TFLOPS_PER_SM * 1e12 * max(eff, 1e-3)) * 1e3

    # Dispatch + combine, forward and backward: four transfers of T*k rows, (ep-1)/ep of them off-rank.
    row_bytes = s.M * s.elem_bytes
    dispatch_row_bytes = s.M + 4 * math.ceil(s.M / 128) if plan.dispatch_dtype == "fp8_e4m3" else row_bytes
    off = (s.ep - 1) / s.ep
    nbytes = s.T * s.k * off * (dispatch_row_bytes + 3 * row_bytes)
    bw = min(LINK_GBPS, comm_sms * STORE_GBPS_PER_SM) * 1e9
    comm_ms = nbytes / bw * 1e3

    if plan.schedule == "sequential":
        return gemm_ms + comm_ms + 4 * LAUNCH_MS
    if plan.schedule == "pipelined":
        # The forward combine and the backward's gradient of dispatch (two of the four transfers) go
        # back chunk by chunk beside the GEMMs; the last chunk's share stays exposed.
        # The two dispatches run alone, as in the sequential schedule.
        # On ds_uniep's GEMM with SM stores (comm_shares_sms), num_comm_sms SMs store every segment
        # of a chunk in one launch beside the GEMM on the other SMs (gemm_ms counts those only).
        c = plan.num_chunks
        push_bytes = s.T * s.k * off * 2 * row_bytes
        if space.comm_shares_sms(plan):
            push_ms = push_bytes / bw * 1e3
        else:
            segments = L * s.ep  # per push: one copy per (local expert, source), spread over ep - 1 streams
            push_ms = max(push_bytes / (LINK_GBPS * 1e9) * 1e3, 2 * segments * COPY_SEGMENT_MS / max(1, s.ep - 1))
        return (max(gemm_ms, push_ms) + push_ms / c + (nbytes - push_bytes) / bw * 1e3 + 4 * c * LAUNCH_MS)
    # fused: with both overlaps every transfer counts as hidden behind the GEMMs, the first GEMM
    # starting when the first signal's rows have arrived; without the fused dispatch half the bytes
    # (the forward dispatch, and the backward's gradient of combine in the same layout) run alone,
    # without the epilogue combines the other half (the forward combine's rows after the second
    # GEMM, the backward's input-gradient rows after the first GEMM's dgrad).
    per_signal = {"tile": L * math.ceil(rows / tile_m), "expert": L, "rank": max(1, s.ep)}
    num_signals = s.ep * per_signal[plan.signal_granularity] if plan.fused_dispatch else 0
    first_wait = comm_ms / max(1, num_signals) if plan.fused_dispatch else 0.0
    alone = (0.0 if plan.fused_dispatch else comm_ms / 2) + (0.0 if plan.epilogue_combine else comm_ms / 2)
    return (max(gemm_ms, comm_ms - alone) + alone + first_wait + num_signals * SIGNAL_MS / max(1, gemm_sms)
            + 2 * LAUNCH_MS)
