"""Train a small MoE GPT on the Python standard library's sources with DeepSpeed.

Megatron-DeepSpeed's MoE flags; ``--backend`` picks the MoE class:

- ``deepspeed``: stock ``deepspeed.moe.layer.MoE``;
- ``reference`` / ``megakernel`` / ``auto``: ``ds_uniep.UniEPMoE`` with that ``"uniep"`` backend;
- not given: ``ds_uniep.UniEPMoE`` with the ds_config's ``"uniep"`` block as it is.

The ``"uniep"`` block is validated before anything starts, whichever class runs: a bad
block ends the job with one line from rank 0 and exit code 2.

Launch with any of (two ranks on one machine; see examples/README.md)::

    deepspeed --num_gpus 2 examples/gpt_moe/train.py --deepspeed_config configs/ds_config_cpu_zero0.json ...
    torchrun --nproc_per_node 2 examples/gpt_moe/train.py ...
    mpirun -np 2 python examples/gpt_moe/train.py ...

The last line printed by rank 0 starts with ``[gpt_moe] final:`` and holds tokens/s.
"""
import argparse
import functools
import importlib.util
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/: launch_utils
if importlib.util.find_spec("ds_uniep") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, REPO)

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402

from data import VOCAB_SIZE, TextSplits, load_corpus  # noqa: E402
from launch_utils import check_build_locks, run  # noqa: E402
from model import GPTModel, count_parameters  # noqa: E402

FINAL_TAG = "[gpt_moe] final:"


def get_args(argv=None):
    p = argparse.ArgumentParser(description="MoE GPT on the Python standard library's sources",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g = p.add_argument_group("MoE (Megatron-DeepSpeed's flags)")
    g.add_argument("--num-experts", type=int, nargs="+", default=[4],
                   help="experts per MoE block: one value, or one per MoE block (PR-MoE)")
    g.add_argument("--expert-interval", type=int, default=2, help="an MoE block every this many blocks")
    g.add_argument("--moe-expert-parallel-size", type=int, default=1)
    g.add_argument("--topk", type=int, default=1)
    g.add_argument("--moe-loss-coeff", type=float, default=0.1)
    g.add_argument("--moe-train-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-eval-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-min-capacity", type=int, default=4)
    g.add_argument("--disable-moe-token-dropping", action="store_false", dest="moe_token_dropping",
                   help="dropless MoE: every token reaches its experts")
    g.add_argument("--expert-type", choices=["mlp", "swiglu"], default="mlp",
                   help="mlp: Megatron's GeLU MLP with biases; swiglu: ds_uniep.SwiGLUExpert (grouped GEMM experts, "
                   "which the megakernel's pipelined and fused schedules need)")
    g.add_argument("--mlp-type", choices=["standard", "residual"], default="standard",
                   help="residual: PR-MoE's shared MLP beside the experts")
    g.add_argument("--create-moe-param-group", action="store_true",
                   help="separate optimizer groups for expert parameters (needed with ZeRO)")
    g.add_argument("--backend", choices=["reference", "megakernel", "auto", "deepspeed"], default=None,
                   help="deepspeed: stock deepspeed.moe.layer.MoE; reference/megakernel/auto: UniEPMoE with that "
                   'backend, set over the ds_config\'s "uniep" block (default: UniEPMoE with the block\'s backend)')
    g.add_argument("--expert-gemm", choices=["torch", "uniep"], default=None,
                   help='sets "uniep": {"expert_gemm": ...} over the ds_config (default: the config\'s)')
    g.add_argument("--cuda-graph", action="store_true",
                   help='GPUs: sets "uniep": {"sync_free": true} and replays each MoE layer\'s forward and backward '
                        "from CUDA graphs (ds_uniep.graph_moe; SwiGLU experts, dropless top-2/top-k)")
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--save", type=str, default=None, help="checkpoint directory (saved at the end)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None, help="resume from the latest checkpoint here")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit when the step is a multiple of this")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--corpus-max-bytes", type=int, default=None, help="read at most this many bytes of text")
    g.add_argument("--loss-log", type=str, default=None,
                   help="rank 0 writes {step: loss} (rank-averaged, as float.hex) to this JSON file")
    g.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.expert_gemm is not None and args.backend == "deepspeed":
        p.error("--expert-gemm picks ds_uniep's expert GEMM; --backend deepspeed runs stock DeepSpeed MoE, which "
                "has none")
    if args.cuda_graph and (args.backend == "deepspeed" or get_accelerator().device_name() == "cpu"):
        p.error("--cuda-graph replays ds_uniep's layers on GPUs (not --backend deepspeed, not on a CPU)")
    if args.save_interval is not None and not args.save:
        p.error("--save-interval needs --save (the checkpoint directory)")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.deepspeed_config is None:
        name = "ds_config_cpu_zero0.json" if get_accelerator().device_name() == "cpu" else \
            "ds_config_uniep_default.json"
        args.deepspeed_config = os.path.join(REPO, "configs", name)
    return args


def uniep_config_for(backend, ds_config_path: str, expert_gemm=None, sync_free=False):
    """The ds_config's ``"uniep"`` block with the flags that were given set over it, validated (a flag left
    out leaves the block's value; ``--backend deepspeed`` sets nothing, the block is still checked)."""
    from ds_uniep import UniEPConfig
    with open(ds_config_path) as f:
        block = json.load(f).get("uniep", {})
    if isinstance(block, dict):  # anything else is UniEPConfig's error to report
        block = dict(block)
        if backend not in (None, "deepspeed"):
            block["backend"] = backend
        if expert_gemm is not None:
            block["expert_gemm"] = expert_gemm
        if sync_free:
            block["sync_free"] = True
    return UniEPConfig.from_dict(block)


def moe_class_for(backend, ds_config_path: str, expert_gemm=None, sync_free=False):
    """``(MoE class, backend name)`` the model is built with, from ``--backend``, ``--expert-gemm``,
    ``--cuda-graph`` and the ds_config's ``"uniep"`` block (validated here, whichever class is returned)."""
    config = uniep_config_for(backend, ds_config_path, expert_gemm, sync_free)
    if backend == "deepspeed":
        return MoE, backend
    from ds_uniep import UniEPMoE
    return functools.partial(UniEPMoE, config=config), config.backend


def init_distributed() -> None:
    """``deepspeed``/``torchrun`` set RANK, WORLD_SIZE, ...; under ``mpirun`` DeepSpeed reads them from MPI."""
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, distributed_port=int(os.environ.get("MASTER_PORT", 29500)),
                               verbose=False)


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main(argv=None):
    args = get_args(argv)
    # Before any rank starts torch.distributed: these stop every rank alike, and none waits on another.
    check_build_locks()
    moe_class, args.backend = moe_class_for(args.backend, args.deepspeed_config, args.expert_gemm, args.cuda_graph)
    init_distributed()
    # Under mpirun, LOCAL_RANK exists only once init_distributed has read it from MPI.
    args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    import deepspeed.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.moe_expert_parallel_size:
        raise SystemExit(f"--moe-expert-parallel-size {args.moe_expert_parallel_size} must divide the "
                         f"world size {world}")
    device = torch.device(get_accelerator().device_name(args.local_rank))
    if device.type != "cpu":
        get_accelerator().set_device(args.local_rank)

    tokens, info = load_corpus(args.corpus_max_bytes)
    splits = TextSplits(tokens, args.seq_length)
    if rank == 0:
        print(f"[gpt_moe] corpus: {info['num_files']} files, {info['num_bytes']:,} bytes of {info['root']}/*.py "
              f"(train {len(splits.train):,} / held-out {len(splits.valid):,})", flush=True)

    torch.manual_seed(args.seed)
    model = GPTModel(args, VOCAB_SIZE, moe_class=moe_class, ep_rank=rank % args.moe_expert_parallel_size)

    params = {"params": [p for p in model.parameters() if p.requires_grad], "name": "params"}
    if args.create_moe_param_group:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        param_groups = split_params_into_different_moe_groups_for_optimizer(params)
    else:
        param_groups = [params]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                  foreach=False)
    warmup = max(args.lr_warmup_iters, 1)
    lr_fn = lambda it: min(1.0, (it + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(
        it, args.train_iters) / args.train_iters)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_fn)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    if rank == 0:
        print(f"[gpt_moe] backend={args.backend} ranks={world} ep={args.moe_expert_parallel_size} "
              f"experts/block={[layer.num_experts for layer in model.layers]} topk={args.topk} "
              f"params={count_parameters(model):,} (expert {count_parameters(model, True):,} on this rank) "
              f"dtype={'bf16' if engine.bfloat16_enabled() else 'fp32'} zero={engine.zero_optimization_stage()} "
              f"config={os.path.relpath(args.deepspeed_config)}", flush=True)

    start = 0
    if args.load:
        load_path, client = engine.load_checkpoint(args.load)
        if load_path is None:
            raise SystemExit(f"--load {args.load}: no checkpoint found (no 'latest' file)")
        start = int(client["iteration"])
        if rank == 0:
            print(f"[gpt_moe] resumed from {load_path} at step {start}", flush=True)
    if args.cuda_graph:  # after the engine gave the parameters their dtype (and a checkpoint its values)
        import ds_uniep
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        sample = torch.zeros(micro, args.seq_length, args.hidden_size, device=device, dtype=dtype, requires_grad=True)
        graphed = [ds_uniep.graph_moe(m, sample) for m in model.modules() if isinstance(m, ds_uniep.UniEPMoE)]
        if rank == 0:
            print(f"[gpt_moe] {len(graphed)} MoE layers replay CUDA graphs", flush=True)

    def save(step):
        engine.save_checkpoint(args.save, tag=f"global_step{step}", client_state={"iteration": step})
        if rank == 0:
            print(f"[gpt_moe] saved checkpoint {args.save}/global_step{step}", flush=True)

    def evaluate():
        engine.eval()
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for i in range(args.eval_iters):
                x, y = splits.eval_batch(i, rank, world, micro)
                logits, _ = engine(x.to(device))
                total += lm_loss(logits, y.to(device)).double().cpu()
        engine.train()
        total = total.to(device)
        dist.all_reduce(total)
        return (total / (args.eval_iters * world)).item()

    tokens_per_step = world * micro * gas * args.seq_length
    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=args.train_iters, initial=start, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stdout, mininterval=0.5)
    losses, train_time, timed_steps = {}, 0.0, 0
    eval_loss = float("nan")
    loss_avg = torch.zeros((), dtype=torch.float64, device=device)
    step = start
    for step in range(start + 1, args.train_iters + 1):
        t0 = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        for micro_step in range(gas):
            # Everything random in a step (the gate's random token selection, noisy gates) is
            # seeded from the step, so a resumed run draws what the uninterrupted run drew.
            torch.manual_seed(args.seed * 1_000_003 + step * 997 + micro_step * 31 + rank)
            x, y = splits.train_batch(args.seed, step, rank, world, micro, micro_step)
            logits, moe_losses = engine(x.to(device))
            loss = lm_loss(logits, y.to(device)) + args.moe_loss_coeff * moe_losses.sum()
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().double()
        loss_avg.copy_(step_loss / gas)
        dist.all_reduce(loss_avg)
        loss_value = loss_avg.item() / world
        dt = time.perf_counter() - t0
        if step > start + 1:  # the first step pays for lazy set-up; leave it out of the rate
            train_time += dt
            timed_steps += 1
        losses[step] = loss_value
        if args.eval_interval and step % args.eval_interval == 0:
            eval_loss = evaluate()
            if rank == 0:
                bar.write(f"[gpt_moe] step {step}: train loss {loss_value:.4f}, held-out loss {eval_loss:.4f}")
        if bar is not None:
            rate = tokens_per_step * timed_steps / train_time if timed_steps else float("nan")
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
            bar.update(1)
            evaluated = args.eval_interval and step % args.eval_interval == 0
            if args.log_interval and step % args.log_interval == 0 and not evaluated and not sys.stdout.isatty():
                bar.write(f"[gpt_moe] step {step}: loss {loss_value:.4f}")
        if args.save and args.save_interval and step % args.save_interval == 0:
            save(step)
        if args.exit_interval and step % args.exit_interval == 0 and step < args.train_iters:
            if args.save and not (args.save_interval and step % args.save_interval == 0):
                save(step)
            if rank == 0:
                bar.close()
                print(f"[gpt_moe] exiting at step {step} (--exit-interval {args.exit_interval})", flush=True)
            _write_losses(args, rank, losses)
            dist.barrier()
            torch.distributed.destroy_process_group()
            return
    if bar is not None:
        bar.close()
    if args.eval_interval == 0 or step % args.eval_interval:
        eval_loss = evaluate()
    if args.save and not (args.save_interval and step % args.save_interval == 0):
        save(step)
    _write_losses(args, rank, losses)
    rate = tokens_per_step * timed_steps / train_time if timed_steps else float("nan")
    if rank == 0:
        first = losses.get(start + 1, float("nan"))
        print(f"{FINAL_TAG} backend={args.backend} ranks={world} steps={start + 1}-{step} "
              f"first_loss={first:.4f} last_loss={losses.get(step, float('nan')):.4f} "
              f"eval_loss={eval_loss:.4f} tokens/s={rate:,.0f}", flush=True)
    dist.barrier()
    torch.distributed.destroy_process_group()


def _write_losses(args, rank, losses):
    if rank == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({str(k): v.hex() for k, v in losses.items()}, f, indent=0)


if __name__ == "__main__":
    run(main)
