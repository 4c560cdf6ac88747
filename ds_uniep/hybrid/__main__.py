"""``python -m ds_uniep.hybrid plan|simulate``: the HybridEP plan for a model and cluster, or the sweep plot.

Examples::

    python -m ds_uniep.hybrid plan --model dsv2lite-like --gpus 16 --site-size 8 \\
        --domain-size auto --inter-bw 10Gbps --intra-bw 400GB/s --microbatches 8
    python -m ds_uniep.hybrid plan --model hidden=2048,ffn=768,experts=16,topk=2,tokens=8192 --gpus 2 \\
        --site-size 1 --inter-bw 2GB/s --load load.json     # a measured [G, E] routing
    python -m ds_uniep.hybrid simulate --max-sites 1000 --out hybrid_sweep.png
"""

import argparse
import json
import sys
import time
from typing import List, Optional

import numpy as np

from ..argtypes import positive_float, positive_int
from .model import GBPS, Cluster, LayerTime, plan
from .presets import DEFAULT_TFLOPS, PRESETS, format_bandwidth, parse_bandwidth, parse_shape
from .simulate import DEFAULT_SITES_PER_DOMAIN, default_site_counts, plot, sweep

MIB = float(2**20)


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _domain_size(text: str):
    if text == "auto":
        return "auto"
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"domain size must be a positive integer or auto, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"domain size must be a positive integer or auto, got {text!r}")
    return v


def _shape(text: str):
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ratio(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"compression ratio must be in (0, 1], got {text!r}")
    return v


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_shape, default=PRESETS["mixtral-like"],
                   help=f"preset ({', '.join(PRESETS)}) or hidden=..,ffn=..,experts=..,topk=..,tokens=..")
    p.add_argument("--intra-bw", type=_bandwidth, default=parse_bandwidth("400GB/s"),
                   help="per-rank bandwidth inside a site, with a unit (default 400GB/s)")
    p.add_argument("--microbatches", type=positive_int, default=1,
                   help="micro-batches per optimizer step, over which the model spreads one gather of the replicas "
                   "(ds_uniep's runtime gathers at every forward, what 1 models, unless \"reuse_replicas\" is on)")
    p.add_argument("--returns-every-microbatch", action="store_true",
                   help="replica gradients return to their owners after every micro-batch (as ds_uniep's runtime "
                   "does without a DeepSpeed engine), not once per step")
    p.add_argument("--tflops", type=positive_float, default=DEFAULT_TFLOPS, help="compute rate for estimated times")
    p.add_argument("--compression-ratio", type=_ratio, default=None,
                   help="model experts sent as base + top-k residual keeping this fraction (as ds_uniep's runtime "
                   "moves them with \"compression\" on)")


def _row(name: str, t: LayerTime) -> str:
    return f"{name:<10} {t.forward_s * 1e3:>12.3f} {t.backward_s * 1e3:>12.3f} {t.total_s * 1e3:>12.3f}"


def cmd_plan(args) -> int:
    shape = args.model
    site = args.site_size if args.site_size is not None else min(8, args.gpus)
    cluster = Cluster(args.gpus, site, args.intra_bw, args.inter_bw)
    wl = shape.workload(args.gpus, args.tflops, args.microbatches,
                        None if args.pre_expert_ms is None else args.pre_expert_ms / 1e3,
                        None if args.expert_ms is None else args.expert_ms / 1e3, args.experts_per_rank,
                        returns_every_microbatch=args.returns_every_microbatch)
    load = None if args.load is None else read_load(args.load)
    p = plan(wl, cluster, args.domain_size, args.compression_ratio, bytes_per_value=shape.bytes_per_value,
             load=load)
    print(f"model {shape.name}: M={shape.hidden} F={shape.ffn} E={shape.num_experts} k={shape.top_k} "
          f"T={shape.tokens_per_rank}")
    print(f"  token bytes/rank D = {wl.token_bytes / MIB:.1f} MiB, expert bytes P_E = {wl.expert_bytes / MIB:.1f} MiB, "
          f"experts/rank = {wl.experts_per_rank:g}, pre-expert {wl.pre_expert_compute_s * 1e3:.3f} ms, "
          f"expert {wl.expert_compute_s * 1e3:.3f} ms, micro-batches {wl.num_microbatches}"
          + (", replica gradients returned every micro-batch" if wl.returns_every_microbatch else ""))
    print(f"cluster: {args.gpus} ranks in sites of {site}; intra-site {format_bandwidth(args.intra_bw)}, "
          f"inter-site {format_bandwidth(args.inter_bw)}")
    if load is not None:
        per_rank = np.asarray(load, dtype=np.float64).sum(0)
        print(f"routing: measured load from {args.load} (busiest expert {per_rank.max() / per_rank.mean():.2f}x "
              "the mean); partial migration moves the hottest experts")
    kind = "plain EP kept" if p.domain_size == 1 or p.migrated_fraction == 0 else "HybridEP"
    kept = "the hottest experts" if p.migrated is not None else \
        f"token all-to-all keeps {p.token_fraction:.2f} of domain peers' expert work"
    print(f"plan: {kind}; domain size {p.domain_size}, migrated fraction {p.migrated_fraction:.2f} ({kept})"
          + (f", compression ratio {p.compression_ratio:g}" if p.compression_ratio is not None else ""))
    if p.migrated is not None:
        print("migrated experts (local indices per rank): " + json.dumps(p.migrated))
    print(f"{'':<10} {'forward ms':>12} {'backward ms':>12} {'total ms':>12}")
    print(_row("EP", p.ep))
    print(_row("HybridEP", p.hybrid))
    print(f"speedup {p.speedup:.3f}x")
    return 0


def read_load(path: str):
    """``[G, E]`` token copies from a JSON file: a list of G lists of E numbers, or an object with a
    ``"load"`` of that form (one point of ``bench_hybrid.py``'s output, or what
    ``PartialMigrationDispatcher.take_load()`` returns, dumped as JSON)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--load {path}: cannot read a JSON load ({e})") from None
    if isinstance(data, dict):
        if "load" not in data:
            hint = " (bench_hybrid.py's output holds one per point: points[i][\"load\"])" if "points" in data else ""
            raise ValueError(f"--load {path}: expected a [G, E] list or an object with a \"load\" key, got keys "
                             f"{sorted(data)}{hint}")
        data = data["load"]
    if not isinstance(data, list) or not data or not all(isinstance(r, list) for r in data):
        raise ValueError(f"--load {path}: expected a [G, E] list of lists of token counts")
    return data


def cmd_simulate(args) -> int:
    shape = args.model
    wl = shape.workload(8, args.tflops, args.microbatches,
                        experts_per_rank=args.experts_per_rank if args.experts_per_rank is not None else 1.0,
                        returns_every_microbatch=args.returns_every_microbatch)
    sites = default_site_counts(args.max_sites)
    t0 = time.perf_counter()
    r = sweep(wl, args.site_size, args.intra_bw, num_sites=sites, sites_per_domain=args.sites_per_domain,
              compression_ratio=args.compression_ratio, bytes_per_value=shape.bytes_per_value,
              num_experts=None if args.experts_per_rank is not None else shape.num_experts,
              progress=not args.no_progress)
    elapsed = time.perf_counter() - t0
    plot(r, args.out, title=f"{shape.name}, {args.site_size} ranks/site, {args.microbatches} micro-batches")
    print(f"{shape.name}: {len(r.inter_bandwidths_bytes_per_s)} bandwidths x {len(r.num_sites)} site counts "
          f"(up to {r.num_sites.max()}) x {len(r.sites_per_domain)} domain sizes in {elapsed:.2f} s; plot {args.out}")
    print(f"{'inter Gbps':>10} {'sites':>6} {'EP ms':>10} {'Hybrid ms':>10} {'S sites':>8} {'fraction':>9} "
          f"{'speedup':>8}")
    for gbps in (1.0, 10.0, 100.0):
        b = int(np.argmin(np.abs(r.inter_bandwidths_bytes_per_s - gbps * GBPS)))
        for n in sorted({int(sites[min(2, len(sites) - 1)]), int(sites[len(sites) // 8]), int(sites[-1])}):
            i = int(np.searchsorted(r.num_sites, n))
            print(f"{gbps:>10g} {n:>6d} {r.ep_s[b, i] * 1e3:>10.2f} {r.best_s[b, i] * 1e3:>10.2f} "
                  f"{int(r.best_sites_per_domain[b, i]):>8d} {r.best_fraction[b, i]:>9.2f} "
                  f"{r.best_speedup[b, i]:>7.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inter_bandwidth_bytes_per_s": r.inter_bandwidths_bytes_per_s.tolist(),
                       "num_sites": r.num_sites.tolist(), "sites_per_domain": r.sites_per_domain.tolist(),
                       "site_size": r.site_size, "ep_s": r.ep_s.tolist(),
                       "hybrid_s": np.where(np.isnan(r.hybrid_s), None, r.hybrid_s).tolist(),
                       "best_s": r.best_s.tolist(), "best_sites_per_domain": r.best_sites_per_domain.tolist(),
                       "best_fraction": r.best_fraction.tolist()}, f)
        print(f"full numbers: {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ds_uniep.hybrid", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print the HybridEP plan for one model and cluster")
    _common(p)
    p.add_argument("--gpus", type=int, required=True, help="ranks G in the EP group")
    p.add_argument("--site-size", type=int, default=None,
                   help="ranks joined by the intra-site links (default: min(8, gpus))")
    p.add_argument("--domain-size", type=_domain_size, default="auto", help="HybridEP domain size S, or auto")
    p.add_argument("--inter-bw", type=_bandwidth, required=True, help="per-rank bandwidth between sites, e.g. 10Gbps")
    p.add_argument("--pre-expert-ms", type=float, default=None, help="measured pre-expert forward time")
    p.add_argument("--expert-ms", type=float, default=None, help="measured expert forward time")
    p.add_argument("--experts-per-rank", type=float, default=None, help="default: experts / gpus")
    p.add_argument("--load", default=None, metavar="JSON",
                   help="plan for a measured routing: a JSON [G, E] list of the token copies each rank routes to "
                   "each expert (or an object with a \"load\" key, as each point of bench_hybrid.py's output has); "
                   "partial migration then moves the hottest experts")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="sweep sites, bandwidth and domain size; write the plot")
    _common(s)
    s.add_argument("--max-sites", "--max-domains", dest="max_sites", type=positive_int, default=1000,
                   help="largest number of sites (fast-link domains of --site-size ranks, joined by the slow "
                   "links) swept; HybridEP's migration domains are groups of --sites-per-domain of them")
    s.add_argument("--site-size", type=int, default=8, help="ranks per site")
    s.add_argument("--sites-per-domain", type=lambda t: [int(x) for x in t.split(",")],
                   default=list(DEFAULT_SITES_PER_DOMAIN), help="HybridEP domain sizes in sites, e.g. 2,4,8")
    s.add_argument("--experts-per-rank", type=float, default=None,
                   help="fix experts per rank (the model grows with the cluster); default: the model's experts over G")
    s.add_argument("--out", default="hybrid_sweep.png", help="PNG path")
    s.add_argument("--json", default=None, help="also write every number here")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_simulate)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
