"""A Hugging Face MoE model trained on ds_uniep against the same model on DeepSpeed's AutoEP.

    torchrun --nproc_per_node 4 benchmarks/bench_hf_model.py --families mixtral qwen3_moe deepseek_v3

Per family a model is built from a config in code (``examples/hf_moe/train.py``'s, sized by the flags;
random weights, nothing downloaded), twice from one seed, so both engines start from the same weights:

- autoep: ``deepspeed.initialize`` with ``"expert_parallel": {"enabled": true, "autoep_size": ep}``:
  DeepSpeed's AutoEP converts the MoE blocks (its router, NCCL all-to-all, ``torch._grouped_mm``);
- ds_uniep: ``ds_uniep.convert_hf_model`` with ``"uniep": {"backend": --backend}``, then
  ``deepspeed.initialize``.

Both under ZeRO ``--zero-stage`` in bf16 with DeepSpeed's AdamW. A step is a whole training step (forward, the
byte-level cross-entropy, ``engine.backward``, ``engine.step``) on the same batch for both. Each round
times ``--steps`` steps of each engine in turn (CUDA events around them, after a barrier; the slowest
rank's), ``--rounds`` rounds, the medians printed last with their ratio. ``--cpu`` runs it on gloo
ranks with the reference backend in fp32 (a check that the script runs; its times mean nothing).
"""
import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "hf_moe"))

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
VARIANTS = ("autoep", "ds_uniep")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--expert-ffn", type=int, default=1408)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2])
    p.add_argument("--backend", default="megakernel", choices=["megakernel", "reference", "auto"])
    p.add_argument("--steps", type=int, default=5, help="steps per engine and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo, fp32, the reference backend: the script runs")
    p.add_argument("--out", default="bench_hf_model.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    return args


def ds_config(args, ep, variant):
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.zero_stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1_000_000, "uniep": {"backend": "reference" if args.cpu else args.backend},
              # DeepSpeed makes the optimizer, after AutoEP has converted the model (its MoE groups then exist);
              # torch's AdamW, as DeepSpeed's fused one is a JIT build that fails where TORCH_CUDA_ARCH_LIST
              # names an arch-specific target such as 9.0a
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    if not args.cpu:
        config["bf16"] = {"enabled": True}
    if variant == "autoep":
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return config


def build_engine(args, family, variant, ep, device):
    """(engine, what went wrong or None): the family's model on ``variant``."""
    import deepspeed
    from train import model_config
    from transformers import AutoModelForCausalLM

    import ds_uniep
    cfg = SimpleNamespace(model_type=family, hidden_size=args.hidden, num_layers=args.layers,
                          num_attention_heads=args.heads, num_experts=args.experts, topk=args.topk,
                          expert_ffn_size=args.expert_ffn, seq_length=args.seq)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(model_config(cfg))
    config = ds_config(args, ep, variant)
    if variant == "ds_uniep":
        ds_uniep.convert_hf_model(model, config, ep_size=ep)
    model.to(device)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def make_step(engine, batch, device):
    x, y = (t.to(device) for t in batch)

    def step():
        logits = engine(x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss
    return step


def timed(step, steps, device, dist):
    """ms per step of ``steps`` back-to-back steps after a barrier, the slowest rank's."""
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / steps
    else:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ms = (time.perf_counter() - t0) * 1e3 / steps
    worst = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def main(argv=None):
    args = parse_args(argv)
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo" if args.cpu else "nccl", verbose=False)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    if not args.cpu:
        torch.cuda.set_device(local)
    rank, ep = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    results = {"ep": ep, "args": vars(args), "rows": []}
    for family in args.families:
        row = {"family": family, "tokens_per_step": args.micro_batch * args.seq * ep}
        steps = {}
        for variant in VARIANTS:
            try:
                engine = build_engine(args, family, variant, ep, device)
                steps[variant] = make_step(engine, batch, device)
                for _ in range(args.warmup):
                    steps[variant]()
            except Exception as e:  # noqa: BLE001 - the row says why (AutoEP is not ours)
                if variant != "autoep":
                    raise
                row["autoep_why_not"] = f"{type(e).__name__}: {e}"
        times = {v: [] for v in steps}
        for _ in range(args.rounds):  # in turns, so drift falls on both alike
            for v, step in steps.items():
                times[v].append(timed(step, args.steps, device, dist))
        for v, ts in times.items():
            row[f"{v}_ms"] = statistics.median(ts)
            row[f"{v}_all_ms"] = ts
        if "autoep_ms" in row:
            row["speedup"] = row["autoep_ms"] / row["ds_uniep_ms"]
        results["rows"].append(row)
        if rank == 0:
            print(f"[{family}] " + ", ".join(f"{v} {row[v + '_ms']:.2f} ms/step" for v in times), flush=True)
        del steps
        if not args.cpu:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nep={ep} hidden={args.hidden} layers={args.layers} experts={args.experts} top-{args.topk} "
              f"expert ffn={args.expert_ffn} seq={args.seq} x {args.micro_batch} per rank, ZeRO-{args.zero_stage}; "
              f"ms per training step, median of {args.rounds} rounds of {args.steps} steps")
        print("family | autoep | ds_uniep | speedup | ds_uniep tokens/s")
        for r in results["rows"]:
            auto = f"{r['autoep_ms']:.2f}" if "autoep_ms" in r else "n/a*"
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
            print(f"{r['family']} | {auto} | {r['ds_uniep_ms']:.2f} | {speed} | "
                  f"{r['tokens_per_step'] / r['ds_uniep_ms'] * 1e3:,.0f}")
            if "autoep_why_not" in r:
                print(f"* autoep could not run for {r['family']}: {r['autoep_why_not']}")
    dist.barrier()


if __name__ == "__main__":
    main()
