"""DeepSpeedExamples' training/cifar MoE example, on ds_uniep.

The network and flags follow ``cifar10_deepspeed.py`` (``--moe --ep-world-size
--num-experts --top-k --noisy-gate-policy --moe-param-group --mlp-type --dtype
--stage``); ``--backend`` picks the MoE class (``deepspeed``: stock
``deepspeed.moe.layer.MoE``; ``reference``/``megakernel``/``auto``: ``UniEPMoE`` with
that backend; not given: ``reference``, or with ``--deepspeed_config`` the file's
``"uniep"`` block as it is). The ``"uniep"`` block is validated before anything
starts: a bad block ends the job with one line from rank 0 and exit code 2.

Data: CIFAR-10 through torchvision when both are present locally
(``--data-dir``, nothing is downloaded). Otherwise the script trains on
scikit-learn's bundled ``load_digits`` (1,797 real 8x8 grey images of the
digits 0-9, shipped inside the package) and says so in the log.

    deepspeed --num_gpus 2 examples/cifar10_moe/train.py --moe --ep-world-size 2 --num-experts 2 --top-k 1 \\
        --moe-param-group --backend reference
"""
import argparse
import functools
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/: launch_utils
if importlib.util.find_spec("ds_uniep") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, REPO)

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402

from launch_utils import check_build_locks, run  # noqa: E402

FINAL_TAG = "[cifar10_moe] final:"


def add_argument(argv=None):
    p = argparse.ArgumentParser(description="CIFAR-10 (or sklearn digits) with DeepSpeed MoE")
    p.add_argument("-b", "--batch_size", default=None, type=int,
                   help="micro-batch size per rank (default 16; with --deepspeed_config: the file's)")
    p.add_argument("-e", "--epochs", default=2, type=int)
    p.add_argument("--steps", default=None, type=int, help="stop after this many optimizer steps")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--data-dir", default="./data", help="where a local CIFAR-10 copy would be")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on GPUs, fp32 on CPU (with --deepspeed_config: the file's)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO stage (default 0; with --deepspeed_config: the file's)")
    p.add_argument("--moe", action="store_true", help="use mixture of experts")
    p.add_argument("--ep-world-size", default=1, type=int, help="expert parallel world size")
    p.add_argument("--num-experts", type=int, nargs="+", default=[1],
                   help="experts per MoE layer; several values build several layers (PR-MoE pyramid)")
    p.add_argument("--mlp-type", choices=["standard", "residual"], default="standard",
                   help="residual: PR-MoE's shared MLP beside the experts")
    p.add_argument("--top-k", default=1, type=int, help="experts per token")
    p.add_argument("--min-capacity", default=0, type=int, help="minimum capacity of an expert")
    p.add_argument("--noisy-gate-policy", default=None, type=str, help="None, RSample or Jitter (top-1 only)")
    p.add_argument("--moe-param-group", action="store_true",
                   help="separate optimizer groups for expert parameters (needed with ZeRO)")
    p.add_argument("--backend", choices=["reference", "megakernel", "auto", "deepspeed"], default=None,
                   help="deepspeed: stock deepspeed.moe.layer.MoE; reference/megakernel/auto: UniEPMoE with that "
                   "backend (default reference; with --deepspeed_config: the file's \"uniep\" backend)")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.deepspeed_config:
        given = [f"--{n}" for n in ("batch_size", "stage", "dtype") if getattr(args, n) is not None]
        if given:  # the file says these; two sources would disagree silently
            p.error(f"{', '.join(given)} cannot be combined with --deepspeed_config: set them in "
                    f"{args.deepspeed_config} (train_micro_batch_size_per_gpu, zero_optimization.stage, bf16/fp16)")
        return args
    args.backend = "reference" if args.backend is None else args.backend
    args.batch_size = 16 if args.batch_size is None else args.batch_size
    args.stage = 0 if args.stage is None else args.stage
    if args.dtype is None:
        args.dtype = "fp32" if get_accelerator().device_name() == "cpu" else "bf16"
    return args


def get_ds_config(args):
    """The run's ds_config: ``--deepspeed_config`` when given, else built from the flags as upstream does."""
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            return json.load(f)
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 15},
        "zero_optimization": {"stage": args.stage, "contiguous_gradients": True, "overlap_comm": True,
                              "reduce_scatter": True},
        "zero_allow_untested_optimizer": True,
        "uniep": {"backend": "auto" if args.backend == "deepspeed" else args.backend},
    }


def load_data(args, rank):
    """``(train TensorDataset, test TensorDataset, in_channels, image_size, description)``."""
    cifar = os.path.join(args.data_dir, "cifar-10-batches-py")
    if importlib.util.find_spec("torchvision") is not None and os.path.isdir(cifar):
        import torchvision
        import torchvision.transforms as transforms
        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
        train = torchvision.datasets.CIFAR10(root=args.data_dir, train=True, download=False, transform=tf)
        test = torchvision.datasets.CIFAR10(root=args.data_dir, train=False, download=False, transform=tf)
        return train, test, 3, 32, f"CIFAR-10 from {cifar}"
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("cifar10_moe: no CIFAR-10 here and scikit-learn (its digits fallback) is not installed: "
                         'pip install -e ".[examples]", or put CIFAR-10 under --data-dir with torchvision') from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0  # [N, 1, 8, 8] in [-1, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    num_test = len(y) // 5
    why = "torchvision is not installed" if importlib.util.find_spec("torchvision") is None else \
        f"no CIFAR-10 at {cifar}"
    desc = (f"CIFAR-10 not available ({why}); training on scikit-learn's bundled digits instead "
            f"({len(y)} real 8x8 grey images, 10 classes)")
    return (torch.utils.data.TensorDataset(x[num_test:], y[num_test:]),
            torch.utils.data.TensorDataset(x[:num_test], y[:num_test]), 1, 8, desc)


class Net(nn.Module):
    """Upstream's LeNet with MoE layers on the 84-wide features; 3x3 padded convolutions for 8x8 images."""

    def __init__(self, args, in_channels=3, image_size=32, moe_class=MoE):
        super().__init__()
        kernel, pad = (5, 0) if image_size >= 32 else (3, 1)
        self.conv1 = nn.Conv2d(in_channels, 6, kernel, padding=pad)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, kernel, padding=pad)
        side = ((image_size - 2 * (kernel // 2 - pad)) // 2 - 2 * (kernel // 2 - pad)) // 2
        self.flat = 16 * side * side
        self.fc1 = nn.Linear(self.flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if args.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # create moe layers based on the number of experts
                self.moe_layer_list.append(
                    moe_class(hidden_size=84,
                              expert=fc3,
                              num_experts=n_e,
                              ep_size=args.ep_world_size,
                              use_residual=args.mlp_type == "residual",
                              k=args.top_k,
                              min_capacity=args.min_capacity,
                              noisy_gate_policy=args.noisy_gate_policy))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def uniep_config_for(args, ds_config):
    """The run's ``"uniep"`` block with ``--backend`` set over it when given, validated (``--backend
    deepspeed`` sets nothing; the block is still checked)."""
    from ds_uniep import UniEPConfig
    block = ds_config.get("uniep", {})
    if isinstance(block, dict):  # anything else is UniEPConfig's error to report
        block = dict(block)
        if args.backend not in (None, "deepspeed"):
            block["backend"] = args.backend
    return UniEPConfig.from_dict(block)


def moe_class_for(args, ds_config):
    """``(MoE class, backend name)`` the model is built with; the only thing ``--backend`` changes."""
    config = uniep_config_for(args, ds_config)
    if args.backend == "deepspeed":
        return MoE, args.backend
    from ds_uniep import UniEPMoE
    return functools.partial(UniEPMoE, config=config), config.backend


def main(argv=None):
    args = add_argument(argv)
    # Before any rank starts torch.distributed: these stop every rank alike, and none waits on another.
    check_build_locks()
    ds_config = get_ds_config(args)
    moe_class, args.backend = moe_class_for(args, ds_config)
    backend = "gloo" if get_accelerator().device_name() == "cpu" else None
    deepspeed.init_distributed(dist_backend=backend, distributed_port=int(os.environ.get("MASTER_PORT", 29500)),
                               verbose=False)
    args.local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    rank = torch.distributed.get_rank()
    torch.manual_seed(args.seed)
    trainset, testset, in_channels, image_size, desc = load_data(args, rank)
    if rank == 0:
        print(f"[cifar10_moe] data: {desc}", flush=True)

    net = Net(args, in_channels, image_size, moe_class if args.moe else MoE)
    parameters = {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"}
    if args.moe_param_group:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        groups = split_params_into_different_moe_groups_for_optimizer(parameters)
    else:
        groups = [parameters]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, foreach=False)
    args.deepspeed_config = None  # the dict below is the config; DeepSpeed refuses both
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, optimizer=optimizer,
                                                                   training_data=trainset, config=ds_config)
    device = get_accelerator().device_name(model_engine.local_rank)
    # What the engine runs (the flags, or the --deepspeed_config file)
    dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else torch.float16 if model_engine.fp16_enabled() \
        else None
    if rank == 0:
        dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[dtype]
        print(f"[cifar10_moe] backend={args.backend} moe={args.moe} experts={args.num_experts} "
              f"ep={args.ep_world_size} top_k={args.top_k} dtype={dtype_name} "
              f"zero={model_engine.zero_optimization_stage()} "
              f"batch={model_engine.train_micro_batch_size_per_gpu()} "
              f"ranks={torch.distributed.get_world_size()}", flush=True)

    criterion = nn.CrossEntropyLoss()
    step, running, t0, samples = 0, 0.0, time.perf_counter(), 0
    loss = torch.tensor(float("nan"))
    for epoch in range(args.epochs):
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(device), labels.to(device)
            if dtype is not None:
                inputs = inputs.to(dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            step += 1
            samples += inputs.shape[0]
            running += loss.item()
            if rank == 0 and args.log_interval and step % args.log_interval == 0:
                print(f"[cifar10_moe] [{epoch + 1}, {i + 1:5d}] loss: {running / args.log_interval:.3f}", flush=True)
                running = 0.0
            if args.steps and step >= args.steps:
                break
        if args.steps and step >= args.steps:
            break
    elapsed = time.perf_counter() - t0

    # Every rank evaluates the whole test set: expert-parallel forwards need all ranks.
    model_engine.eval()
    correct = total = 0
    loader = torch.utils.data.DataLoader(testset, batch_size=64, shuffle=False)
    with torch.no_grad():
        for images, labels in loader:
            images = images.to(device)
            if dtype is not None:
                images = images.to(dtype)
            predicted = model_engine(images).float().argmax(1).cpu()
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
    if rank == 0:
        world = torch.distributed.get_world_size()
        print(f"{FINAL_TAG} backend={args.backend} steps={step} last_loss={loss.item():.4f} "
              f"test_accuracy={100.0 * correct / total:.1f}% samples/s={samples * world / elapsed:,.0f}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(main)
