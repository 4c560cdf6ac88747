"""How far ahead of the GPU the host runs: the host's time to issue a layer's steps against the GPU's.

    torchrun --nproc_per_node 2 benchmarks/bench_host.py --shapes dsv2lite-like dsv3-like --backends megakernel

The layers are those of ``bench_moe_layer.py`` (same shapes, weights and backends). Each round
runs ``--steps`` forward(+backward) steps back to back, with no synchronisation between them, as
a training loop does: gradients set to None, the forward, the backward. "host" is the time the
host takes to return from the last step's calls (time it waits inside the layer included);
"done" is the time until the GPU has finished them as well. Per step, median over rounds,
slowest rank. done - host is the queued work the host keeps ahead of the GPU. A layer without a
host sync lets the host run far ahead when the GPU limits (done well above host). The megakernel
backend reads the received row count on the host in each forward, so the host waits there every
step and done stays near host whichever side limits: the number then says how little work is
queued when the next layer starts, and only the GPU's busy time (from a profiler) tells whether
the host or the GPU sets the pace.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_moe_layer import BACKENDS, build_layers, experts_for, init_ranks  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["mixtral-like", "dsv2lite-like", "dsv3-like"])
    p.add_argument("--backends", nargs="+", default=["megakernel"], choices=BACKENDS)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--steps", type=int, default=20, help="steps issued back to back per round (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per layer and mode, medians (default 3)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    p.add_argument("--out", default="bench_host.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return args


def streamed(layer, xs, g, mode, steps):
    """Issue ``steps`` steps back to back; (host ms, done ms) per step."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def step(i):
        for p in params:
            p.grad = None
        x = xs[i % len(xs)].detach().requires_grad_(mode == "fwdbwd")
        with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
            out, l_aux, _ = layer(x)
            if mode == "fwdbwd":
                if l_aux is None:
                    out.backward(g)
                else:
                    torch.autograd.backward([out, l_aux], [g, torch.ones_like(l_aux)])

    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / steps * 1e3, (t2 - t0) / steps * 1e3


def main(argv=None):
    args = parse_args(argv)
    from ds_uniep.hybrid.presets import PRESETS

    dist, ep, rank, status = init_ranks()
    results = {"ep": ep, "megakernel": list(status), "steps": args.steps, "rounds": args.rounds, "rows": []}
    for name in args.shapes:
        shape = PRESETS[name]
        E = experts_for(shape, ep, None)
        why_not = {}
        layers = build_layers(shape, E, ep, args.backends, status, why_not)
        gen = torch.Generator("cuda").manual_seed(100 * rank)
        xs = [torch.randn(shape.tokens_per_rank, shape.hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
              for _ in range(2)]
        g = torch.randn(shape.tokens_per_rank, shape.hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
        for bname in args.backends:
            if bname not in layers:
                reason = why_not.get(bname, status[1])
                results["rows"].append({"shape": name, "backend": bname, "why_not": reason})
                if rank == 0:
                    print(f"[{name}] {bname}: not run ({reason})", flush=True)
                continue
            for mode in args.modes:
                streamed(layers[bname], xs, g, mode, max(args.warmup, 1))
                rounds = []
                for _ in range(args.rounds):
                    torch.cuda.synchronize()
                    dist.barrier()
                    rounds.append(streamed(layers[bname], xs, g, mode, args.steps))
                host = statistics.median(r[0] for r in rounds)
                done = statistics.median(r[1] for r in rounds)
                worst = torch.tensor([host, done], dtype=torch.float64, device="cuda")
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                host, done = worst.tolist()
                row = {"shape": name, "backend": bname, "mode": mode, "host_ms_per_step": host,
                       "done_ms_per_step": done, "rounds": rounds}
                results["rows"].append(row)
                if rank == 0:
                    print(f"[{name} {mode}] {bname}: host {host:.3f} ms/step, done {done:.3f} ms/step, "
                          f"done/host {done / host:.3f}", flush=True)
        del layers
        torch.cuda.empty_cache()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
