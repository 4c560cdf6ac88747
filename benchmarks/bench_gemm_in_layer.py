"""ds_uniep's grouped GEMM inside the megakernel layer, per tile configuration, against torch's.

    torchrun --nproc_per_node 4 benchmarks/bench_gemm_in_layer.py --out bench_out/gemm_in_layer

Per shape of docs/performance.md (built as ``bench_moe_layer.py`` builds them), in one run:

1. the layer forward and forward+backward on ``torch._grouped_mm`` (``megakernel-torch-gemm``), on
   ds_uniep's GEMM with its default configurations (``ds_uniep.gemm.DEFAULT_CONFIGS``), with the
   automatic choice for all three operations (``"auto"``: each rank times every configuration on
   the first call of each operation and shape and keeps its fastest) and with one configuration
   forced for all three operations (``--configs``), every variant timed in turns
   (``timing.bench_interleaved``), the slowest rank's median;
2. the two forward GEMMs alone (``up`` and ``down``) on the rows the layer gives this rank, torch's
   and each forced configuration, also in turns: once with the rows in an ordinary allocation and
   once in a symmetric one (``A symmetric``: where the layer's dispatch leaves them for ``up``);
3. the configurations each rank's automatic choice kept (``ds_uniep.gemm.chosen_configs``).

The values never depend on the configuration (no split-K), so this only measures where the choice
of tiles costs time inside the layer. Prints a table last and writes ``--out/gemm_in_layer.json``.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing.py, bench_moe_layer.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ds_uniep from a checkout

import bench_moe_layer as layer_bench  # noqa: E402
from timing import bench_interleaved  # noqa: E402

DEFAULT_FORCED = ("coop128x256", "coop128x256:n4", "coop256x128", "pingpong128x128", "pingpong128x128:n1")


def symmetric_copy(t, group):
    """A copy of ``t`` in a symmetric allocation over ``group`` (collective), as the layer's receive rows."""
    from torch.distributed import _symmetric_memory as symm_mem

    from ds_uniep.symm import rendezvous
    size = torch.tensor([t.numel() * t.element_size()], device=t.device)
    torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=group)  # one size on every rank
    buf = symm_mem.empty(int(size), dtype=torch.uint8, device=t.device)
    rendezvous(buf, group)
    out = buf[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def parse_args(argv=None):
    from ds_uniep.gemm import candidates
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["dsv2lite-like", "dsv3-like"])
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_FORCED), choices=candidates(),
                   help="configurations forced for fwd, dgrad and wgrad, one variant each")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--out", default="bench_out/gemm_in_layer")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from ds_uniep import gemm
    from ds_uniep.experts import stack_experts
    from ds_uniep.hybrid.presets import PRESETS

    dist, ep, rank, status = layer_bench.init_ranks()
    if not status[0]:
        raise SystemExit(f"the megakernel cannot run here: {status[1]}")
    defaults = dict(gemm.DEFAULT_CONFIGS)

    results = {"ep": ep, "configs": args.configs, "default_configs": defaults, "shapes": {}}
    for name in args.shapes:
        shape = PRESETS[name]
        E = layer_bench.experts_for(shape, ep, None)
        layers = layer_bench.build_layers(shape, E, ep, ["megakernel-torch-gemm", "megakernel"], status)
        gen = torch.Generator("cuda").manual_seed(rank)
        xs = [torch.randn(shape.tokens_per_rank, shape.hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
              for _ in range(2)]
        grads = [torch.randn_like(x) for x in xs]
        res = results["shapes"][name] = {"layer": {}, "gemms_alone_fwd": {}}

        for mode in args.modes:
            def variant(layer, config):
                def setup(run):
                    for op in gemm.DEFAULT_CONFIGS:  # read by every grouped GEMM call of the run
                        gemm.DEFAULT_CONFIGS[op] = config[op] if isinstance(config, dict) else config
                    layer.zero_grad(set_to_none=True)
                    return xs[run % 2].detach().requires_grad_(mode == "fwdbwd"), grads[run % 2]

                def fn(x, g):
                    out, l_aux, _ = layer(x)
                    if mode == "fwdbwd":
                        torch.autograd.backward([out, l_aux], [g, torch.ones_like(l_aux)])
                return fn, setup

            variants = {"torch": variant(layers["megakernel-torch-gemm"], defaults),
                        "uniep default": variant(layers["megakernel"], defaults),
                        "uniep auto": variant(layers["megakernel"], "auto")}
            variants.update({f"uniep {c}": variant(layers["megakernel"], c) for c in args.configs})
            with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
                r = bench_interleaved(variants, warmup=args.warmup, repeats=args.repeats, sync=dist.barrier)
            gemm.DEFAULT_CONFIGS.update(defaults)
            res["layer"][mode] = {k: layer_bench.slowest(v["median_ms"], dist) if "median_ms" in v else v
                                  for k, v in r.items()}

        # The forward GEMMs alone on this rank's rows of the layer (a reference dispatch of xs[0]).
        recv, counts, experts = layer_bench._layer_rows(layers["megakernel"], xs[0])
        with torch.no_grad():
            stacked = stack_experts(experts, recv.dtype, recv.device)
            up, down = (stacked.weights[k].detach().contiguous() for k in stacked.weights)
            offs = torch.cumsum(counts.to(recv.device), 0).to(torch.int32)
            act = torch.randn(recv.shape[0], down.shape[2], dtype=recv.dtype, device=recv.device)
            # The same rows in a symmetric allocation, where the layer's first GEMM reads them (its
            # dispatch stores them there).
            symm = symmetric_copy(recv, torch.distributed.group.WORLD)
            alone = {}
            for where, rows, act_rows in (("", recv, act), (" symm", symm, act)):
                alone[f"torch{where}"] = (lambda rows=rows, act_rows=act_rows: (
                    gemm.torch_grouped_mm("fwd", rows, up, offs), gemm.torch_grouped_mm("fwd", act_rows, down, offs)),
                    None)
                alone.update({f"uniep {c}{where}": (lambda c=c, rows=rows, act_rows=act_rows: (
                    gemm.grouped_mm(rows, up, offs, "fwd", c), gemm.grouped_mm(act_rows, down, offs, "fwd", c)), None)
                    for c in args.configs})
            r = bench_interleaved(alone, warmup=args.warmup, repeats=args.repeats, sync=dist.barrier)
        res["gemms_alone_fwd"] = {k: layer_bench.slowest(v["median_ms"], dist) for k, v in r.items()}
        chosen = [None] * ep
        torch.distributed.all_gather_object(
            chosen, {f"{k[0]} G={k[2]} N={k[3]} K={k[4]} rows<={k[5]}": v for k, v in gemm.chosen_configs().items()
                     if k[2] == E // ep})
        res["auto_choice_per_rank"] = chosen
        layers = recv = symm = stacked = alone = None  # frees them; the closures above ran already
        torch.cuda.empty_cache()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemm_in_layer.json"), "w") as f:
            json.dump(results, f, indent=1)
        print(f"ep={ep}; ms, slowest rank's median; x: torch's time over this one")
        for name, res in results["shapes"].items():
            names = ["torch", "uniep default", "uniep auto"] + [f"uniep {c}" for c in args.configs]
            print(f"\n{name}: {'variant':26s} " + " ".join(f"{m + ' layer':>16s}" for m in args.modes) +
                  f" {'fwd GEMMs alone':>16s} {'A symmetric':>16s}")
            for v in names:
                cells = []
                for m in args.modes:
                    t, base = res["layer"][m].get(v), res["layer"][m]["torch"]
                    cells.append(f"{t:8.3f} ({base / t:4.2f}x)" if isinstance(t, float) else f"{'error':>16s}")
                for where in ("", " symm"):
                    a = res["gemms_alone_fwd"].get(v + where)
                    base = res["gemms_alone_fwd"]["torch" + where]
                    cells.append(f"{a:8.3f} ({base / a:4.2f}x)" if a else f"{'-':>16s}")
                print(f"{'':{len(name) + 2}s}{v:26s} " + " ".join(cells))
            for r, c in enumerate(res["auto_choice_per_rank"]):
                print(f"  rank {r} auto choice: {c}")
    dist.barrier()


if __name__ == "__main__":
    main()
