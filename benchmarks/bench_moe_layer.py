"""One MoE layer, side by side: stock DeepSpeed MoE, ds_uniep's reference and megakernel backends, and bounds.

    torchrun --nproc_per_node 4 benchmarks/bench_moe_layer.py --shapes mixtral-like dsv2lite-like dsv3-like

Every rank runs the same layer on its own tokens; a run's time is the slowest
rank's (ranks are lined up by a barrier before each run). Baselines and bounds
are measured in the same run:

- stock: ``deepspeed.moe.layer.MoE`` (dropless, so it pads every expert to the largest count);
- reference: ``UniEPMoE`` with ``"backend": "reference"`` (sort + ``all_to_all_single`` + grouped GEMM);
- megakernel: ``UniEPMoE`` with ``"backend": "megakernel"`` where it can run (else the row says why not),
  its experts on ds_uniep's grouped GEMM (``"expert_gemm": "uniep"``);
- megakernel-torch-gemm: the same with ``"expert_gemm": "torch"`` (the default; what the GEMM alone changes);
- practical bound: max(expert GEMMs alone through ``torch._grouped_mm`` on the same rows,
  dispatch+combine bytes at the peer copy bandwidth);
- physical bound: max(expert FLOPs / dense bf16 GEMM rate, the same bytes / peer copy bandwidth).

All layers use the same DeepSpeed gate weights and SwiGLU experts, bf16, fp32 gate.
A short table is printed last; everything goes to ``--out/bench_moe_layer.json``.

``--autotune`` adds, per shape, the megakernel layer tuned by its own autotune
path (``"autotune": {"enabled": true}``, fwd+bwd, ``--autotune-budget-s`` per
shape) and timed under its plan, and every single fixed plan a user could set
for all shapes without tuning: the config default and each ``num_comm_sms``
value the tuner walks. The best single fixed plan is the one with the smallest
geometric mean time over the shapes run; the table gives tuned ms, its ms and
their ratio per shape (JSON key ``"autotune"``)::

    torchrun --nproc_per_node 4 benchmarks/bench_moe_layer.py --autotune --out bench_out
"""

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import bench, rotating  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["mixtral-like", "dsv2lite-like", "dsv3-like"])
    p.add_argument("--experts", type=int, default=None, help="override E (default: the shape's; dsv3-like: "
                   "32 up to ep 4, 256 from ep 8)")
    p.add_argument("--tokens", type=int, default=None, help="override T tokens per rank")
    p.add_argument("--backends", nargs="+", default=["stock", "reference", "megakernel", "megakernel-torch-gemm"],
                   choices=["stock", "reference", "megakernel", "megakernel-torch-gemm"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--autotune", action="store_true", help="add the self-tuned megakernel layer and every single "
                   "fixed plan (config default, each num_comm_sms value) per shape")
    p.add_argument("--autotune-budget-s", type=float, default=40.0, help="tuning budget per shape (default 40)")
    p.add_argument("--autotune-cache", default=None, help="plan cache directory (default OUT/plan_cache; a cached "
                   "plan is used without tuning)")
    return p.parse_args(argv)


def experts_for(shape, ep, override):
    from ds_uniep.tuning.presets import num_experts_at
    return override or num_experts_at(shape.name, ep)


def peer_copy_gbps(nbytes=256 << 20):
    """One-direction copy-engine bandwidth from this GPU to the next one (GB/s), or None with one GPU."""
    n = torch.cuda.device_count()
    if n < 2:
        return None
    src_dev = torch.cuda.current_device()
    dst_dev = (src_dev + 1) % n
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=src_dev)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dst_dev)
    r = bench(lambda: dst.copy_(src, non_blocking=True), warmup=3, repeats=10)
    torch.cuda.synchronize(dst_dev)
    return nbytes / (r["median_ms"] * 1e-3) / 1e9


def dense_gemm_tflops(n=8192):
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    r = bench(lambda: a @ b, warmup=3, repeats=10)
    return 2 * n**3 / (r["median_ms"] * 1e-3) / 1e12


def slowest(ms, dist):
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def build_layers(shape, E, ep, backends, status):
    from deepspeed.moe.layer import MoE

    from ds_uniep import SwiGLUExpert, UniEPMoE
    torch.manual_seed(0)
    proto = MoE(shape.hidden, SwiGLUExpert(shape.hidden, shape.ffn), num_experts=E, ep_size=ep, k=shape.top_k,
                min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    # Every rank's experts differ, as in a real model.
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1 + rank)
    with torch.no_grad():
        for p in proto.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
    layers = {}
    for name in backends:
        if name == "stock":
            layer = copy.deepcopy(proto)
        else:
            if name.startswith("megakernel") and not status[0]:
                continue
            config = {"backend": "megakernel", "expert_gemm": "torch"} if name == "megakernel-torch-gemm" \
                else {"backend": "megakernel", "expert_gemm": "uniep"} if name == "megakernel" else {"backend": name}
            layer = UniEPMoE(shape.hidden, SwiGLUExpert(shape.hidden, shape.ffn), num_experts=E, ep_size=ep,
                             k=shape.top_k, min_capacity=0, drop_tokens=False, use_rts=False,
                             top2_2nd_expert_sampling=False, config=config)
            layer.load_state_dict(proto.state_dict())
        layer = layer.cuda().to(torch.bfloat16)
        layer.deepspeed_moe.gate.wg.float()  # DeepSpeed computes the gate in fp32 either way
        layer.set_deepspeed_parallelism()
        layers[name] = layer
    return layers


def time_layer(layer, inputs, mode, args, dist):
    def fwd(x, g):
        out, l_aux, _ = layer(x)
        if mode == "fwdbwd":
            torch.autograd.backward([out, l_aux], [g, torch.ones_like(l_aux)])
    ctx = torch.enable_grad() if mode == "fwdbwd" else torch.no_grad()
    with ctx:
        r = bench(fwd, warmup=args.warmup, repeats=args.repeats, setup=inputs, sync=dist.barrier)
    return slowest(r["median_ms"], dist)


def gemm_alone(layer, x, mode, args, dist):
    """The same rows through the grouped GEMMs alone (no gate, no communication)."""
    from ds_uniep.experts import run_grouped
    from ds_uniep.reference import ReferenceDispatcher
    moe = layer.deepspeed_moe
    with torch.no_grad():
        _, _, _, idx, _, _, _ = moe.gate(x, None, True)
        d = ReferenceDispatcher(layer.num_experts, layer.ep_size, moe.ep_group)
        recv, counts, _ = d.dispatch(x, idx.t())
    experts = list(moe.experts.deepspeed_experts)
    recv = recv.detach().requires_grad_(mode == "fwdbwd")
    grad = torch.randn_like(recv)

    def run():
        y = run_grouped(experts, recv, counts)
        if mode == "fwdbwd":
            y.backward(grad)
    ctx = torch.enable_grad() if mode == "fwdbwd" else torch.no_grad()
    with ctx:
        r = bench(run, warmup=args.warmup, repeats=args.repeats, sync=dist.barrier)
    return slowest(r["median_ms"], dist), int(counts.sum())


def fixed_plans(space):
    """Every single fixed plan a user can set for all shapes without tuning: the config default and each
    num_comm_sms value the tuner walks (the megakernel acts on no other exact knob yet)."""
    from ds_uniep.config import UniEPConfig
    from ds_uniep.tuning import Plan
    default = space.project(Plan.from_config(UniEPConfig()))
    plans = {f"config default (sm{default.num_comm_sms})": default}
    for plan in space.enumerate():
        plans[f"sm{plan.num_comm_sms}"] = plan
    return plans


def autotune_shape(name, shape, E, ep, T, inputs, layers, status, args, dist):
    """Tune the megakernel layer through its own autotune path, then time it and every fixed plan."""
    from ds_uniep.config import AutotuneConfig
    from ds_uniep.tuning import GPUInfo, Shape, Space
    if not status[0]:
        return {"shape": name, "skipped": f"megakernel cannot run here: {status[1]}"}
    if "megakernel" in layers:
        layer = layers["megakernel"]
    else:  # same seed, same weights as the other rows
        layer = build_layers(shape, E, ep, ["megakernel"], status)["megakernel"]
    cache_dir = args.autotune_cache or os.path.join(args.out, "plan_cache")
    on = AutotuneConfig(enabled=True, cache_dir=cache_dir, budget_s=args.autotune_budget_s, warmup=args.warmup,
                        repeats=args.repeats)
    layer.uniep_config = layer.uniep_config.model_copy(update={"autotune": on})
    dist.barrier()
    t0 = time.perf_counter()
    with torch.enable_grad():
        layer(inputs(0)[0])  # the first forward of this shape tunes (or reads the cache)
    torch.cuda.synchronize()
    dist.barrier()
    wall_s = time.perf_counter() - t0
    result = next(r for key, r in layer.autotune_results.items() if key[0] == T)
    row = {"shape": name, "T": T, "E": E, "tuned_plan": result.winner.to_dict(), "tuned_label": result.winner.label(),
           "from_cache": result.from_cache, "tune_wall_s": wall_s,
           "tuned_plans_measured": len(result.by_status("measured")), "tune_records": result.to_dict()["records"],
           "modes": {}}
    for mode in args.modes:  # autotune still on: the layer runs its tuned plan by itself
        row["modes"][mode] = {"tuned_ms": time_layer(layer, inputs, mode, args, dist), "fixed_ms": {}}
    layer.uniep_config = layer.uniep_config.model_copy(update={"autotune": AutotuneConfig()})
    space = Space(Shape(T=T, M=shape.hidden, F=shape.ffn, E=E, k=shape.top_k, dtype="bf16", ep=ep),
                  GPUInfo.detect(), ep, layer.uniep_config.max_tokens_per_rank, False, backend="megakernel")
    plans = fixed_plans(space)
    row["fixed_plans"] = {n: p.to_dict() for n, p in plans.items()}
    for pname, plan in plans.items():
        layer.set_plan(plan)
        for mode in args.modes:
            row["modes"][mode]["fixed_ms"][pname] = time_layer(layer, inputs, mode, args, dist)
    return row


def summarize_autotune(auto, modes):
    """Per mode, the single fixed plan with the smallest geometric mean time over the shapes, and per shape
    the tuned time against it (speedup = best single fixed ms / tuned ms; >= 1 means tuning paid)."""
    rows = [r for r in auto["rows"] if "modes" in r]
    auto["best_single_fixed"] = {}
    for mode in modes:
        if not rows:
            break
        names = sorted(set.intersection(*(set(r["modes"][mode]["fixed_ms"]) for r in rows)))
        geo = {n: math.exp(sum(math.log(r["modes"][mode]["fixed_ms"][n]) for r in rows) / len(rows)) for n in names}
        best = min(names, key=lambda n: geo[n])
        auto["best_single_fixed"][mode] = {"plan": best, "geomean_ms": geo}
        for r in rows:
            m = r["modes"][mode]
            m["best_single_fixed"] = best
            m["best_single_fixed_ms"] = m["fixed_ms"][best]
            m["speedup_vs_best_single_fixed"] = m["fixed_ms"][best] / m["tuned_ms"]
            m["fastest_fixed_here"] = min(m["fixed_ms"], key=m["fixed_ms"].get)


def print_autotune(auto):
    print(f"\nautotune (megakernel, tuned on fwd+bwd, budget {auto['budget_s']:g} s per shape); speedup = best "
          "single fixed plan ms / tuned ms")
    head = ["shape", "mode", "tuned plan", "tuned", "best single fixed", "its ms", "speedup", "fastest fixed here",
            "tuning s"]
    print(" | ".join(head))
    for r in auto["rows"]:
        if "modes" not in r:
            print(f"{r['shape']} | {r['skipped']}")
            continue
        for mode, m in r["modes"].items():
            here = m["fastest_fixed_here"]
            print(" | ".join([r["shape"], mode, r["tuned_label"] + (" (cache)" if r["from_cache"] else ""),
                              f"{m['tuned_ms']:.2f}", m["best_single_fixed"], f"{m['best_single_fixed_ms']:.2f}",
                              f"{m['speedup_vs_best_single_fixed']:.3f}x", f"{here} {m['fixed_ms'][here]:.2f}",
                              f"{r['tune_wall_s']:.1f}"]))


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import deepspeed
    import deepspeed.comm as dist

    from ds_uniep.backend import megakernel_status
    from ds_uniep.hybrid.presets import PRESETS

    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    ep = dist.get_world_size()
    rank = dist.get_rank()
    status = megakernel_status(torch.device("cuda", local_rank))
    peer = peer_copy_gbps() if rank == 0 else None
    tflops = dense_gemm_tflops()
    rates = [None, None]
    if rank == 0:
        rates = [peer, tflops]
    obj = [rates]
    dist.broadcast_object_list(obj, src=0)
    peer, tflops = obj[0]
    results = {"ep": ep, "peer_copy_GBps": peer, "dense_bf16_TFLOPs": tflops, "megakernel": list(status), "rows": []}

    for name in args.shapes:
        shape = PRESETS[name]
        T = args.tokens or shape.tokens_per_rank
        E = experts_for(shape, ep, args.experts)
        layers = build_layers(shape, E, ep, args.backends, status)
        inputs = rotating(lambda i: (torch.randn(T, shape.hidden, dtype=torch.bfloat16, device="cuda",
                                                 generator=torch.Generator("cuda").manual_seed(100 * rank + i)),
                                     torch.randn(T, shape.hidden, dtype=torch.bfloat16, device="cuda")), 3)
        for mode in args.modes:
            passes = 1 if mode == "fwd" else 2
            row = {"shape": name, "mode": mode, "T": T, "M": shape.hidden, "F": shape.ffn, "E": E, "k": shape.top_k}
            for bname, layer in layers.items():
                row[bname + "_ms"] = time_layer(layer, inputs, mode, args, dist)
            any_uni = layers.get("reference") or next(iter(layers.values()))
            gemm_ms, rows = gemm_alone(any_uni, inputs(0)[0], mode, args, dist)
            flops = 2 * 3 * shape.hidden * shape.ffn * rows * (3 if mode == "fwdbwd" else 1)
            # Bytes leaving a rank: dispatch + combine, each pass; (ep-1)/ep of the rows are remote.
            nbytes = 2 * passes * T * shape.top_k * shape.hidden * 2 * (ep - 1) / ep
            comm_ms = nbytes / (peer * 1e9) * 1e3 if peer else 0.0
            row["gemm_alone_ms"] = gemm_ms
            row["comm_at_peer_bw_ms"] = comm_ms
            row["practical_bound_ms"] = max(gemm_ms, comm_ms)
            row["physical_bound_ms"] = max(flops / (tflops * 1e12) * 1e3, comm_ms)
            results["rows"].append(row)
        if args.autotune:
            results.setdefault("autotune", {"budget_s": args.autotune_budget_s, "rows": []})
            results["autotune"]["rows"].append(autotune_shape(name, shape, E, ep, T, inputs, layers, status, args,
                                                              dist))
        del layers
        torch.cuda.empty_cache()

    if args.autotune:
        summarize_autotune(results["autotune"], args.modes)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_moe_layer.json"), "w") as f:
            json.dump(results, f, indent=2)
        print_table(results)
        if args.autotune:
            print_autotune(results["autotune"])
    dist.barrier()


def print_table(results):
    print(f"\nep={results['ep']}  peer copy {results['peer_copy_GBps'] or 0:.0f} GB/s  "
          f"dense bf16 {results['dense_bf16_TFLOPs']:.0f} TFLOP/s  megakernel: {results['megakernel']}")
    head = ["shape", "mode", "stock", "reference", "megakernel", "mk torch gemm", "gemm alone", "practical",
            "physical", "best/stock", "best/practical"]
    print(" | ".join(head))
    for r in results["rows"]:
        cells = [r["shape"], r["mode"]]
        for k in ("stock_ms", "reference_ms", "megakernel_ms", "megakernel-torch-gemm_ms", "gemm_alone_ms",
                  "practical_bound_ms", "physical_bound_ms"):
            cells.append(f"{r[k]:.2f}" if k in r else "-")
        ours = [r[k] for k in ("reference_ms", "megakernel_ms", "megakernel-torch-gemm_ms") if k in r]
        best = min(ours) if ours else None
        cells.append(f"{r['stock_ms'] / best:.2f}x" if best and "stock_ms" in r else "-")
        cells.append(f"{best / r['practical_bound_ms']:.2f}" if best else "-")
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
