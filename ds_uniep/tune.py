"""``python -m ds_uniep.tune``: search the tuning space of one MoE layer shape.

Examples::

    python -m ds_uniep.tune --ds-config ds_config.json --preset mixtral-like --ep 4 --out tune_out
    python -m ds_uniep.tune --shape 8192,2048,1408,64,6 --ep 4 --backend none --out tune_out
    python -m ds_uniep.tune --shape 256,128,256,8,2 --backend reference --out tune_out

With the megakernel backend (CUDA, Hopper, launched on ``ep`` ranks) the
plans of the knobs it acts on (``ds_uniep.tuning.space.ACTING_KNOBS``: schedule,
num_chunks, num_comm_sms, roles, fused_dispatch, epilogue_combine, combine_chunks,
combine_queue, and dispatch_dtype when numerics may change) are timed with CUDA events; the tile
sizes and signal granularity are kept as configured (``KEPT_KNOBS``). Without it the tool
enumerates and validates the whole design space (``--backend none``), or times the reference
backend's layer (``--backend reference``), whose plans differ only in dispatch_dtype.
"""

import argparse
import json
import os
import sys
from typing import List, Optional

import torch

from .config import UniEPConfig, UniEPConfigError
from .tuning import GPUInfo, Space, estimate_ms, tune
from .tuning.plot import plot_space, reason_counts
from .tuning.presets import PRESET_NAMES, parse_shape, preset_shape
from .argtypes import positive_float
from .tuning.runner import TORCH_DTYPES
from .tuning.space import DTYPES, KEPT_KNOBS, Shape


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ds_uniep.tune", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--ds-config", default=None, help="ds_config.json whose \"uniep\" block gives the default "
                    "plan, max_tokens_per_rank and the autotune settings (default: built-in defaults)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--shape", default=None, help="T,M,F,E,k: tokens per rank, hidden, expert FFN, experts, top-k")
    g.add_argument("--preset", choices=PRESET_NAMES, default=None, help="a shape of docs/performance.md")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="activation dtype (default bf16)")
    ap.add_argument("--backend", choices=["auto", "megakernel", "reference", "none"], default="auto",
                    help="what to time: auto = megakernel where available, else only enumerate the space; "
                    "none = only enumerate and validate")
    ap.add_argument("--gpu", choices=["auto", "h100", "h200"], default="auto",
                    help="GPU limits for the space: auto = this machine's GPU, or an H100-sized stand-in without one")
    ap.add_argument("--allow-numerics-change", action="store_true", default=None,
                    help="explore FP8 dispatch (default: the config's autotune.allow_numerics_change)")
    ap.add_argument("--budget-s", type=positive_float, default=None,
                    help="seconds of measuring after the configured and baseline plans (default: the config's)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per plan (default: the config's)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per plan (default: the config's)")
    ap.add_argument("--cache", action="store_true", help="read and write the plan cache in autotune.cache_dir")
    ap.add_argument("--top", type=int, default=10, help="rows of the best-plans table")
    ap.add_argument("--full-table", action="store_true", help="print every candidate with its reason")
    ap.add_argument("--out", default="tune_out", help="directory for the PNG and JSON (default tune_out)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, UniEPConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    cfg = UniEPConfig.from_ds_config(args.ds_config)
    if args.allow_numerics_change:
        cfg = cfg.model_copy(update={"autotune": cfg.autotune.model_copy(update={"allow_numerics_change": True})})
    shape = parse_shape(args.shape, args.ep, args.dtype) if args.shape else preset_shape(args.preset, args.ep,
                                                                                          args.dtype)
    name = args.preset or "shape-" + args.shape.replace(",", "x")
    if args.gpu != "auto":
        gpu, gpu_note = GPUInfo.preset(args.gpu), "stand-in limits"
    elif torch.cuda.is_available():
        gpu, gpu_note = GPUInfo.detect(), "detected"
    else:
        gpu, gpu_note = GPUInfo.cpu(), "no GPU here: H100-sized stand-in limits"
    space = Space.from_config(cfg, shape, gpu)
    # Launched ranks know their rank from the environment before distributed is initialised.
    rank0 = (torch.distributed.get_rank() == 0 if torch.distributed.is_initialized()
             else int(os.environ.get("RANK", "0")) == 0)
    say = print if rank0 else (lambda *a, **k: None)
    say(f"shape {name}: {shape}")
    say(f"GPU {gpu.name}: {gpu.num_sms} SMs, {gpu.smem_per_block} B shared memory per block ({gpu_note})")

    from .tuning.runner import megakernel_status
    from .tuning.space import ACTING_KNOBS
    mk_ok, mk_reason = megakernel_status()
    mode = args.backend
    if mode == "auto":
        mode = "megakernel" if mk_ok else "none"
    if mode == "megakernel" and not mk_ok:
        raise ValueError(f"the megakernel backend cannot run here ({mk_reason}); use --backend none to enumerate "
                         "the space or --backend reference to time the reference layer")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"tune-{name}-ep{shape.ep}")
    if mode == "none":
        if args.backend == "auto":
            say(f"the megakernel backend is not available ({mk_reason}): only enumerating and validating the "
                "space; no plan is timed (--backend reference times the reference layer)")
        mk = space.for_backend("megakernel")
        say(f"design space of every knob; the megakernel backend acts on {', '.join(ACTING_KNOBS['megakernel'])} "
            f"(tiles and signal granularity kept as configured), so it would time "
            f"{len(mk.enumerate())} plans")
        return _space_only(args, space, cfg, stem, say)
    return _measure(args, space, cfg, mode, stem, say, rank0)


def _space_only(args, space: Space, cfg: UniEPConfig, stem: str, say) -> int:
    table = space.table()
    valid = [p for p, r in table if r is None]
    say(f"space: {len(table)} candidates, {len(valid)} valid, {len(table) - len(valid)} rejected")
    say(f"{'rejected':>8}  reason (example plan)")
    examples = {}
    for p, r in table:
        for part in (r or "").split("; "):
            if part:
                examples.setdefault(part.split(":")[0].split(" (")[0], (p, part))
    for reason, n in reason_counts(table).most_common():
        p, text = examples[reason]
        say(f"{n:>8}  {text}  [{p.label()}]")
    default, base = space.layer_default(cfg), space.baseline()
    for what, p in (("default plan", default), ("sequential baseline", base)):
        r = space.check(p)
        say(f"{what} {p.label()}: {'valid' if r is None else 'rejected: ' + r}")
    est = {p: estimate_ms(p, space) for p in valid}
    ranked = sorted(valid, key=lambda p: (est[p], valid.index(p)))
    say(f"first {min(args.top, len(ranked))} plans of the design space by the analytical estimate (NOT measured):")
    say(f"{'#':>3} {'plan':<44} {'estimate ms':>11}")
    for i, p in enumerate(ranked[:args.top]):
        say(f"{i + 1:>3} {p.label():<44} {est[p]:>11.3f}")
    if args.full_table:
        for p, r in table:
            say(f"{p.label():<44} {'valid' if r is None else r}")
    png = plot_space(stem + "-space.png", space, est, measured=False,
                     title=f"{space.shape}: space only (megakernel not timed)")
    with open(stem + "-space.json", "w") as f:
        json.dump({"shape": space.shape.to_dict(), "gpu": space.gpu.__dict__, "measured": False,
                   "default_plan": default.to_dict(), "baseline_plan": base.to_dict(),
                   "plans": [{"plan": p.to_dict(), "label": p.label(), "valid": r is None, "reason": r,
                              "estimate_ms": est.get(p)} for p, r in table]}, f, indent=1)
    say(f"plot {png}\njson {stem}-space.json")
    return 0


def _measure(args, space: Space, cfg: UniEPConfig, mode: str, stem: str, say, rank0: bool) -> int:
    from .tuning.runner import layer_runner, reference_paths
    at = cfg.autotune
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per launched rank
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layer, x = build_layer(space.shape, cfg, mode, device)
    if mode == "reference":
        say("reference backend: only dispatch_dtype changes its path (schedule, chunks, SMs, tiles and "
            "signals are megakernel settings), so one plan per dispatch dtype is timed; the default plan and "
            "the sequential baseline run the same reference path (one timing when their dispatch dtypes match)")
        space = reference_paths(space)
    else:
        from .tuning.runner import runnable_gemms
        # The layer's SwiGLU experts run as grouped GEMMs: both GEMMs are walked where ds_uniep's runs.
        group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        space = space.for_backend(mode, runnable_gemms(cfg.expert_gemm, device, space.shape.dtype, group))
        fixed = ", ".join(f"{k}={v}" for k, v in space.fixed_knobs().items() if k not in KEPT_KNOBS)
        kept = ", ".join(f"{k}={getattr(cfg.overlap, k)}" if k in cfg.overlap.model_fields_set else f"{k} unset"
                         for k in KEPT_KNOBS)
        say(f"{mode} backend: timing {', '.join(space.acting_knobs())}; kept as configured: {kept}"
            + (f"; fixed: {fixed}" if fixed else ""))
    default = space.layer_default(cfg)
    result = tune(space, layer_runner(layer, x), budget_s=at.budget_s if args.budget_s is None else args.budget_s,
                  warmup=at.warmup if args.warmup is None else args.warmup,
                  repeats=at.repeats if args.repeats is None else args.repeats,
                  progress=not args.no_progress, default_plan=default,
                  cache_dir=at.cache_dir if args.cache else None, backend=mode, confirm_top=at.confirm_top,
                  confirm_rounds=at.confirm_rounds)
    if not rank0:
        return 0
    say(f"backend {mode}, forward+backward, timer {result.timer}")
    say(result.table(args.top))
    say(result.summary())
    measured = {r.plan: r.median_ms for r in result.records if r.status == "measured"}
    pruned = {r.plan: r.median_ms for r in result.records if r.status == "pruned"}
    suffix = "" if mode == "megakernel" else f"-{mode}"
    png = plot_space(stem + suffix + ".png", space, measured, measured=True, pruned=pruned,
                     marks={"default": result.default_ms, "sequential": result.baseline_ms}, winner=result.winner,
                     title=f"{space.shape}: {mode} backend, fwd+bwd")
    with open(stem + suffix + ".json", "w") as f:
        json.dump({"shape": space.shape.to_dict(), "gpu": space.gpu.__dict__, "backend": mode, "measured": True,
                   **result.to_dict()}, f, indent=1)
    say(f"plot {png}\njson {stem}{suffix}.json")
    return 0


def build_layer(shape: Shape, config, backend: str, device: torch.device, seed: int = 0):
    """A UniEPMoE with SwiGLU experts at ``shape`` and an input ``[T, M]`` for it, on ``device``.

    With ``shape.ep > 1`` the process must be one of ``ep`` launched ranks
    (``deepspeed`` or ``torchrun``); distributed is initialised here if needed."""
    from .experts import SwiGLUExpert
    from .layer import UniEPMoE
    cfg = UniEPConfig.coerce(config).model_copy(update={"backend": backend})
    if shape.ep > 1:
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(f"--ep {shape.ep} needs {shape.ep} ranks: launch with "
                             f"`deepspeed --num_gpus {shape.ep} -m ds_uniep.tune ...` or torchrun")
        import deepspeed
        deepspeed.init_distributed(verbose=False)
        if torch.distributed.get_world_size() != shape.ep:
            raise ValueError(f"--ep {shape.ep} but the job has {torch.distributed.get_world_size()} ranks")
    torch.manual_seed(seed + (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0))
    layer = UniEPMoE(shape.M, SwiGLUExpert(shape.M, shape.F), num_experts=shape.E, ep_size=shape.ep, k=shape.k,
                     min_capacity=0, drop_tokens=False, config=cfg)
    if shape.ep > 1:
        layer.set_deepspeed_parallelism()
    dtype = TORCH_DTYPES[shape.dtype]
    layer = layer.to(device=device, dtype=dtype)
    layer.deepspeed_moe.gate.wg.float()  # an fp32 gate
    x = torch.randn(shape.T, shape.M, device=device, dtype=dtype, requires_grad=True)
    return layer, x


if __name__ == "__main__":
    sys.exit(main())
