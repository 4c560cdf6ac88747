"""The megakernel layer timed under settings of its NVLink dispatcher, in one run, taking turns.

    torchrun --nproc_per_node 4 benchmarks/bench_dispatcher_settings.py --shapes dsv2lite-like dsv3-like \\
        --setting no_dedup:dedup=False --setting chunks32:combine_chunks=32,combine_min_chunk_tokens=1

Every setting changes the layer's ``NVLinkDispatcher``: its knobs in KNOBS (through ``set_knobs``)
and its attributes in HOOKS (read at each call); each must leave the layer's forward output
bitwise as it is with the defaults: the script exits
non-zero after its table when one does not. Per shape (the stock layer's experts, as in
``bench_moe_layer.py``), forward and forward+backward are timed streamed: ``--steps`` steps back
to back (zero_grad and the next input inside each step) between two CUDA events, ms per step,
the slowest rank's; settings take turns within each of ``--rounds`` rounds and the median of the
rounds is reported, with each setting's time over the default's.
"""
import argparse
import ast
import dataclasses
import json
import os
import statistics
import sys

# What a setting may change: knobs of the dispatcher (ds_uniep.knobs.Knobs, given to set_knobs), and
# attributes NVLinkDispatcher reads at each call.
KNOBS = ("combine_chunks", "combine_queue")
HOOKS = ("combine_min_chunk_tokens", "combine_push_blocks", "combine_reduce_blocks", "combine_queue_gpu_fence",
         "dedup", "gate_grad_on_experts")
SETTABLE = KNOBS + HOOKS


def parse_setting(text):
    """``"name:attr=value,attr=value"`` -> (name, {attr: value}); values are Python literals."""
    name, sep, body = text.partition(":")
    if not sep or not name or not body or name == "default":
        raise SystemExit(f"--setting {text!r}: expected NAME:attr=value[,attr=value] (NAME not 'default')")
    attrs = {}
    for item in body.split(","):
        attr, eq, value = item.partition("=")
        if not eq or attr not in SETTABLE:
            raise SystemExit(f"--setting {text!r}: {item!r} is not attr=value with attr one of {', '.join(SETTABLE)}")
        try:
            attrs[attr] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--setting {text!r}: {value!r} is not a Python literal (e.g. 16, False, None)") from None
    return name, attrs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["dsv2lite-like", "dsv3-like"])
    p.add_argument("--setting", action="append", default=[], metavar="NAME:attr=value,...",
                   help=f"a dispatcher setting to time beside the defaults; attrs: {', '.join(SETTABLE)}")
    p.add_argument("--steps", type=int, default=8, help="steps per streamed burst")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench_dispatcher_settings.json")
    a = p.parse_args()
    if a.steps < 1 or a.rounds < 1:
        raise SystemExit("--steps and --rounds must be at least 1")
    settings = {"default": {}}
    for text in a.setting:
        name, attrs = parse_setting(text)
        if name in settings:
            raise SystemExit(f"--setting: {name!r} given twice")
        settings[name] = attrs

    import torch
    import deepspeed
    import deepspeed.comm as dist
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_moe_layer.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ds_uniep from a checkout
    import bench_moe_layer as B
    from ds_uniep.backend import megakernel_status
    from ds_uniep.hybrid.presets import PRESETS
    from ds_uniep.megakernel.autograd import _REGISTRY

    deepspeed.init_distributed(dist_backend="nccl")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    ep, rank = dist.get_world_size(), dist.get_rank()
    status = megakernel_status(torch.device("cuda", local))
    if not status[0]:
        raise SystemExit(f"the megakernel backend cannot run here: {status[1]}")
    results, failed = {"world_size": ep, "settings": settings, "shapes": {}}, []
    for shape_name in a.shapes:
        shape = PRESETS[shape_name]
        T = shape.tokens_per_rank
        layer = B.build_layers(shape, B.experts_for(shape, ep, None), ep, ["megakernel"], status)["megakernel"]
        gen = torch.Generator("cuda").manual_seed(100 * rank)
        xs = [torch.randn(T, shape.hidden, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2)]
        grad = torch.randn(T, shape.hidden, dtype=torch.bfloat16, device="cuda", generator=gen)

        def step(i, backward):
            layer.zero_grad(set_to_none=True)
            x = xs[i % 2].detach().requires_grad_(backward)
            if not backward:
                with torch.no_grad():
                    return layer(x)[0]
            out, l_aux, _ = layer(x)
            torch.autograd.backward([out, l_aux], [grad, torch.ones_like(l_aux)])
            return out

        step(0, False)  # builds the layer's dispatcher
        dispatchers = [d for d in _REGISTRY.values() if d.layer_name == layer.layer_name]
        if not dispatchers:
            raise SystemExit(f"{shape_name}: the layer built no NVLink dispatcher (backend "
                             f"{layer.backend_name(xs[0].device)})")
        default_knobs = dispatchers[0].knobs
        defaults = {attr: getattr(dispatchers[0], attr) for attr in HOOKS}

        def apply(name):
            knobs = {attr: v for attr, v in settings[name].items() if attr in KNOBS}
            for d in dispatchers:
                d.set_knobs(dataclasses.replace(default_knobs, **knobs))
                for attr in HOOKS:
                    setattr(d, attr, settings[name].get(attr, defaults[attr]))

        times, outs = {}, {}
        for rnd in range(a.rounds):
            names = list(settings)
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                apply(name)
                for mode, backward in (("fwd", False), ("fwdbwd", True)):
                    for i in range(2):
                        step(i, backward)
                    torch.cuda.synchronize()
                    dist.barrier()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for i in range(a.steps):
                        step(i, backward)
                    end.record()
                    end.synchronize()
                    ms = torch.tensor([start.elapsed_time(end) / a.steps], device="cuda")
                    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                    times.setdefault(f"{name} {mode}", []).append(float(ms))
                if name not in outs:
                    outs[name] = step(0, False).clone()
        apply("default")
        same = {name: bool(torch.equal(outs["default"], o)) for name, o in outs.items()}
        failed += [f"{shape_name} {name}" for name, ok in same.items() if not ok]
        results["shapes"][shape_name] = {"tokens_per_rank": T, "ms": times, "bitwise_equal": same,
                                         "direct_stats": dict(dispatchers[0].direct_stats)}
        if rank == 0:
            print(f"{shape_name} ep {ep}, {T} tokens per rank: forward outputs bitwise equal to the default's: {same}")
            for mode in ("fwd", "fwdbwd"):
                base = statistics.median(times[f"default {mode}"])
                cells = [f"{name} {statistics.median(times[f'{name} {mode}']):.3f} ms "
                         f"({statistics.median(times[f'{name} {mode}']) / base:.3f}x)" for name in settings]
                print(f"  {mode:6s} " + " | ".join(cells))
        layer = dispatchers = None  # frees them; the closures above ran already
        torch.cuda.empty_cache()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"ms per step (median of {a.rounds} rounds of {a.steps} streamed steps, slowest rank); "
              "(x): over the default's; details in", a.out)
    dist.barrier()
    if failed:
        raise SystemExit(f"bench_dispatcher_settings rank {rank}: not bitwise the defaults: {', '.join(failed)}")


if __name__ == "__main__":
    main()
