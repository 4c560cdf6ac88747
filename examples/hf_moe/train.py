"""Fine-tune a small Hugging Face MoE model on ds_uniep with DeepSpeed.

The model is built from a config in code (``--model-type`` qwen3_moe, mixtral or deepseek_v3; random
weights, nothing downloaded), converted with ``ds_uniep.convert_hf_model`` (its experts spread over
the expert-parallel group), and trained on the GPT example's text (the Python standard library's
sources, byte tokens: ``examples/gpt_moe/data.py``). ``--save``/``--load`` checkpoint and resume
through DeepSpeed; ``--save-hf`` writes the trained model in its own Hugging Face layout at the end
(``from_pretrained`` loads it with plain transformers).

Launch with (two ranks on one machine, CPU or GPUs; see examples/README.md)::

    deepspeed --num_gpus 2 examples/hf_moe/train.py --model-type qwen3_moe --train-iters 50
    torchrun --nproc_per_node 2 examples/hf_moe/train.py --deepspeed_config my_ds_config.json

Without ``--deepspeed_config`` the ds_config is built here (``--zero-stage``, a ``"uniep"`` block with
``--backend``). The last line printed by rank 0 starts with ``[hf_moe] final:``.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gpt_moe"))  # data.py: the GPT example's text
sys.path.insert(1, os.path.dirname(HERE))  # examples/: launch_utils
if importlib.util.find_spec("ds_uniep") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, REPO)

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from data import VOCAB_SIZE, TextSplits, load_corpus  # noqa: E402
from launch_utils import check_build_locks, fail, run  # noqa: E402

FINAL_TAG = "[hf_moe] final:"
MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Fine-tune a small Hugging Face MoE model on ds_uniep",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model (a config built here, random weights)")
    g.add_argument("--model-type", choices=MODEL_TYPES, default="qwen3_moe")
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-experts", type=int, default=8)
    g.add_argument("--topk", type=int, default=2)
    g.add_argument("--expert-ffn-size", type=int, default=64)
    g.add_argument("--seq-length", type=int, default=64)
    g = p.add_argument_group("ds_uniep")
    g.add_argument("--ep-size", type=int, default=None,
                   help="expert-parallel size (default: the ds_config's expert_parallel.autoep_size, else the world "
                   "size)")
    g.add_argument("--backend", choices=["reference", "megakernel", "auto"], default=None,
                   help='sets "uniep": {"backend": ...} (default: the ds_config\'s; reference on CPU, auto on GPUs)')
    g.add_argument("--aux-loss", choices=["none", "aux_loss", "seq_aux_loss"], default="none")
    g.add_argument("--aux-loss-coef", type=float, default=0.0)
    g.add_argument("--bias-update-rate", type=float, default=None,
                   help="expert-bias step per optimizer step (deepseek_v3; default 1e-3 there)")
    g = p.add_argument_group("training")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=1, help="without --deepspeed_config")
    g.add_argument("--micro-batch", type=int, default=4, help="without --deepspeed_config")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--corpus-max-bytes", type=int, default=None, help="read at most this many bytes of text")
    g.add_argument("--save", type=str, default=None, help="DeepSpeed checkpoint directory (saved at the end)")
    g.add_argument("--load", type=str, default=None, help="resume from the latest checkpoint here")
    g.add_argument("--exit-interval", type=int, default=None, help="save (with --save) and exit at this step")
    g.add_argument("--save-hf", type=str, default=None, help="write the model in its Hugging Face layout here")
    g.add_argument("--loss-log", type=str, default=None,
                   help="rank 0 writes {step: loss} (rank-averaged, as float.hex) to this JSON file")
    g.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def ds_config_for(args, cpu: bool) -> dict:
    """The ds_config file given, else one built from the flags; ``--backend`` set over its ``"uniep"`` block,
    which is validated here (a bad block: one line and exit code 2, from ``launch_utils.run``)."""
    from ds_uniep import UniEPConfig
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            config = json.load(f)
    else:
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "zero_optimization": {"stage": args.zero_stage},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 1_000_000,
                  "uniep": {"backend": "reference" if cpu else "auto"}}
    if args.backend is not None:
        config["uniep"] = dict(config.get("uniep") or {}, backend=args.backend)
    UniEPConfig.from_ds_config(config)
    args.deepspeed_config = None  # the dict goes to deepspeed.initialize
    return config


def model_config(args):
    """A small config of ``--model-type``: every layer an MoE block, byte vocabulary."""
    import transformers as tf
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                  num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_attention_heads,
                  max_position_embeddings=max(args.seq_length, 64), num_experts_per_tok=args.topk,
                  tie_word_embeddings=False)
    if args.model_type == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=args.expert_ffn_size, num_local_experts=args.num_experts)
    if args.model_type == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=4 * args.hidden_size, norm_topk_prob=True,
                                 moe_intermediate_size=args.expert_ffn_size, num_experts=args.num_experts,
                                 head_dim=args.hidden_size // args.num_attention_heads)
    head = args.hidden_size // args.num_attention_heads
    return tf.DeepseekV3Config(**common, intermediate_size=4 * args.hidden_size,
                               moe_intermediate_size=args.expert_ffn_size,
                               n_routed_experts=args.num_experts, n_group=min(4, args.num_experts // 2),
                               topk_group=min(2, args.num_experts // 2), n_shared_experts=1, first_k_dense_replace=0,
                               kv_lora_rank=2 * head, q_lora_rank=None, qk_rope_head_dim=head // 2,
                               qk_nope_head_dim=head // 2, v_head_dim=head, routed_scaling_factor=2.5)


def init_distributed() -> None:
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, distributed_port=int(os.environ.get("MASTER_PORT", 29500)),
                               verbose=False)


def main(argv=None):
    """Train as the command line says; returns the trained (converted) model."""
    args = get_args(argv)
    check_build_locks()
    cpu = get_accelerator().device_name() == "cpu"
    ds_config = ds_config_for(args, cpu)
    started_here = not torch.distributed.is_initialized()  # (a caller that started it keeps it)
    init_distributed()
    args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    import deepspeed.comm as dist
    import ds_uniep
    from transformers import AutoModelForCausalLM
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(get_accelerator().device_name(args.local_rank))
    if not cpu:
        get_accelerator().set_device(args.local_rank)

    splits = TextSplits(load_corpus(args.corpus_max_bytes)[0], args.seq_length)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(args))
    ep_size = args.ep_size or (ds_config.get("expert_parallel") or {}).get("autoep_size") or world
    router = {"aux_loss": args.aux_loss, "aux_loss_coef": args.aux_loss_coef}
    if args.model_type == "deepseek_v3":
        router["bias_update_rate"] = 1e-3 if args.bias_update_rate is None else args.bias_update_rate
    elif args.bias_update_rate:
        fail(f"--bias-update-rate: {args.model_type} keeps no expert bias (deepseek_v3 does)")
    try:
        ds_uniep.convert_hf_model(model, ds_config, ep_size=ep_size, router=router)
    except ValueError as err:
        fail(str(err))
    model.to(device)

    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "params"})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95), foreach=False)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, config=ds_config)
    micro = engine.train_micro_batch_size_per_gpu()
    if rank == 0:
        print(f"[hf_moe] {args.model_type} ranks={world} ep={ep_size} experts={args.num_experts} topk={args.topk} "
              f"zero={engine.zero_optimization_stage()} backend={ds_config['uniep'].get('backend', 'auto')}",
              flush=True)

    start = 0
    if args.load:
        load_path, client = engine.load_checkpoint(args.load)
        if load_path is None:
            fail(f"--load {args.load}: no checkpoint found (no 'latest' file)")
        start = int(client["iteration"])
        if rank == 0:
            print(f"[hf_moe] resumed from {load_path} at step {start}", flush=True)

    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=args.train_iters, initial=start, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stdout, mininterval=0.5)
    losses, t0 = {}, time.perf_counter()
    loss_avg = torch.zeros((), dtype=torch.float64, device=device)
    step = start
    for step in range(start + 1, args.train_iters + 1):
        x, y = splits.train_batch(args.seed, step, rank, world, micro)
        logits = engine(x.to(device)).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
        engine.backward(loss)
        engine.step()
        ds_uniep.update_expert_biases(engine.module)  # (DeepSeek-V3's expert bias; nothing for the others)
        loss_avg.copy_(loss.detach().double())
        dist.all_reduce(loss_avg)
        losses[step] = loss_avg.item() / world
        if bar is not None:
            bar.set_postfix(loss=f"{losses[step]:.4f}", refresh=False)
            bar.update(1)
        if args.exit_interval and step == args.exit_interval and step < args.train_iters:
            break
    if bar is not None:
        bar.close()
    if args.save:
        engine.save_checkpoint(args.save, tag=f"global_step{step}", client_state={"iteration": step})
    if args.save_hf:
        ds_uniep.save_hf_pretrained(engine.module, args.save_hf)
    if rank == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({str(k): v.hex() for k, v in losses.items()}, f, indent=0)
    if rank == 0:
        first = losses.get(start + 1, float("nan"))
        print(f"{FINAL_TAG} {args.model_type} steps={start + 1}-{step} first_loss={first:.4f} "
              f"last_loss={losses.get(step, float('nan')):.4f} seconds={time.perf_counter() - t0:.1f}", flush=True)
    dist.barrier()
    if started_here:
        torch.distributed.destroy_process_group()
    return engine.module


if __name__ == "__main__":
    run(main)
