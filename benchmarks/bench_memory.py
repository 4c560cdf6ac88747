"""Device memory of a many-layer MoE model: stock DeepSpeed MoE, and ds_uniep's megakernel with one
shared set of symmetric buffers or a set per layer. One variant per process (the memory a process
holds is what is measured)::

    for v in stock megakernel megakernel-per-layer; do
      torchrun --nproc_per_node 4 benchmarks/bench_memory.py --layers 26 --variant $v
    done

The model: ``--layers`` blocks of ``x + moe(norm(x))`` then ``x + linear(x)`` (small dense parts),
dsv2lite-like MoE layers (hidden 2048, F 1408, 64 experts, top-6, bf16, fp32 gate) and
``--tokens`` tokens per rank. ``--steps`` SGD steps (dense and gate gradients averaged over the
ranks). Rank 0 prints one line per variant (the largest value over the ranks): the device memory
in use after the steps (free memory before the model and after, as the driver reports it), what
torch's caching allocator holds and its peak allocation, the symmetric buffer bytes, and a digest of the losses and of every gradient of the last step (equal digests:
bitwise equal training), and appends it to ``bench_memory.json``.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

VARIANTS = ("stock", "megakernel", "megakernel-per-layer")


class Block(nn.Module):
    def __init__(self, moe, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = moe
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):
        out, l_aux, _ = self.moe(self.norm(x))
        x = x + out
        return x + self.dense(x), l_aux


def build(args, ep, rank, device):
    from deepspeed.moe.layer import MoE

    from ds_uniep import SwiGLUExpert, UniEPMoE
    from ds_uniep.megakernel import buffers
    buffers.SHARED = args.variant != "megakernel-per-layer"
    blocks = []
    for i in range(args.layers):
        torch.manual_seed(i)
        kw = dict(num_experts=args.experts, ep_size=ep, k=args.top_k, min_capacity=0, drop_tokens=False,
                  use_rts=False, top2_2nd_expert_sampling=False)
        with torch.device(device):  # built on the device: a CPU copy of every expert would not fit
            expert = SwiGLUExpert(args.hidden, args.ffn)
            if args.variant == "stock":
                moe = MoE(args.hidden, expert, **kw)
            else:
                moe = UniEPMoE(args.hidden, expert, config={"backend": "megakernel",
                                                              "max_tokens_per_rank": args.tokens}, **kw)
            g = torch.Generator(device=device).manual_seed(1000 * i + 1 + rank)  # every rank's experts differ
            with torch.no_grad():
                for p in moe.deepspeed_moe.experts.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, device=device) * p.shape[-1]**-0.5)
            blocks.append(Block(moe, args.hidden).to(device=device, dtype=torch.bfloat16))
    model = nn.ModuleList(blocks)
    for b in model:
        b.moe.deepspeed_moe.gate.wg.float()
        b.moe.set_deepspeed_parallelism()
    return model


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench_memory.json")
    args = p.parse_args()

    import deepspeed
    deepspeed.init_distributed()
    rank, ep = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(device)[0]
    t0 = time.time()
    model = build(args, ep, rank, device)
    params = list(model.parameters())
    shared = [p for b in model for n, p in b.named_parameters() if not n.startswith("moe.deepspeed_moe.experts")]
    opt = torch.optim.SGD(params, lr=1e-3)
    g = torch.Generator(device=device).manual_seed(7 + rank)
    losses = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(torch.bfloat16)
        aux = 0.0
        for block in model:
            x, l_aux = block(x)
            aux = aux + l_aux
        loss = x.float().pow(2).mean() + 0.01 * aux
        loss.backward()
        for q in shared:  # data parallel over the expert-parallel ranks for the dense parts and gates
            dist.all_reduce(q.grad)
            q.grad.div_(ep)
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(device)[0]
    sym = 0
    if args.variant != "stock":
        sets = {id(d._set): d._set for b in model for d in b.moe._dispatchers.values()}
        sym = sum(s.sym.total_bytes + s.direct_bytes for s in sets.values())
    used = torch.tensor([free_before - free_after, torch.cuda.max_memory_allocated(device), sym,
                         torch.cuda.memory_reserved(device)],
                        dtype=torch.float64, device=device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    row = {"variant": args.variant, "ep": ep, "layers": args.layers, "tokens": args.tokens,
           "in_use_gib": used[0].item() / 2**30, "peak_allocated_gib": used[1].item() / 2**30,
           "symmetric_gib": used[2].item() / 2**30, "reserved_gib": used[3].item() / 2**30, "losses": [float(v) for v in losses],
           "digest": digest(losses + [q.grad for q in params if q.grad is not None]),
           "seconds": round(time.time() - t0, 1)}
    digests = [None] * ep
    dist.all_gather_object(digests, row["digest"])
    row["digest"] = "/".join(digests)
    if rank == 0:
        print(f"{args.variant:22s} ep {ep} layers {args.layers} tokens {args.tokens}: in use "
              f"{row['in_use_gib']:.2f} GiB, torch reserved {row['reserved_gib']:.2f} GiB, peak allocated "
              f"{row['peak_allocated_gib']:.2f} GiB, symmetric "
              f"{row['symmetric_gib']:.2f} GiB, losses {row['losses']}, digest {row['digest']}, "
              f"{row['seconds']} s to build and train", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
