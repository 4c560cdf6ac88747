"""CommFuse ShardedLinear (weight sharded over the data-parallel group): exact against an unsharded linear.

Every rank builds the same full weights from one seed and its own batch. The reference is
``nn.Linear`` on every rank with its gradients summed over the group in rank order in fp32 (cast
once). Checked bitwise: output, input gradient, weight and bias gradient shards, for each schedule
and chunk count, fp32 and bf16, even and uneven shards, on 2 and 4 gloo ranks; state_dict gathers
and load_state_dict shards. Then a short ZeRO-1 training run with DeepSpeed's MoE handling on (a
MoE layer in the model), the sharded linear against ``nn.Linear``, losses equal bit for bit.
"""
import torch

from dist_utils import run_distributed


def _rank_order_sum(t):
    import torch.distributed as dist

    from ds_uniep.commfuse.common import ordered_sum
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return ordered_sum(parts)


def _check(me, G, K, N, dtype, schedule, chunks, T=10):
    from ds_uniep.commfuse import ShardedLinear
    from ds_uniep.commfuse.common import _offsets, even_split
    from ds_uniep.config import CommFuseConfig
    torch.manual_seed(0)
    ref = torch.nn.Linear(K, N).to(dtype)
    cfg = CommFuseConfig(schedule=schedule, num_chunks=chunks, transport="p2p")
    mod = ShardedLinear.from_linear(ref, config=cfg)
    g = torch.Generator().manual_seed(10 + me)
    x = torch.randn(2, T, K, generator=g).to(dtype)
    dy = torch.randn(2, T, N, generator=g).to(dtype)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y_ref, y = ref(xs[0]), mod(xs[1])
    tag = f"[G={G} K={K} N={N} {dtype} {schedule} chunks={chunks}]"
    assert torch.equal(y, y_ref), f"{tag} forward differs: {(y - y_ref).abs().max()}"
    y_ref.backward(dy)
    y.backward(dy)
    assert torch.equal(xs[1].grad, xs[0].grad), f"{tag} dx differs"
    o, n = _offsets(even_split(N, G))[me], even_split(N, G)[me]
    assert torch.equal(mod.weight.grad, _rank_order_sum(ref.weight.grad)[o:o + n]), f"{tag} dW differs"
    assert torch.equal(mod.bias.grad, _rank_order_sum(ref.bias.grad)[o:o + n]), f"{tag} db differs"
    return ref, mod


def _body(me, G):
    from ds_uniep.commfuse import ShardedLinear
    cases = [(16, 24, torch.float32, "ring", 1), (16, 23, torch.float32, "bidirectional_ring", 2),
             (24, 32, torch.bfloat16, "local_first", 1), (8, 2 * G + 1, torch.bfloat16, "ring", 3)]
    for K, N, dtype, schedule, chunks in cases:
        ref, mod = _check(me, G, K, N, dtype, schedule, chunks)
    # Checkpoints hold the full tensors; loading keeps this rank's rows.
    sd = mod.state_dict()
    assert torch.equal(sd["weight"], ref.weight) and torch.equal(sd["bias"], ref.bias)
    other = ShardedLinear(mod.in_features, mod.out_features, dtype=mod.weight.dtype)
    other.load_state_dict(sd)
    assert torch.equal(other.weight, mod.weight) and torch.equal(other.bias, mod.bias)
    assert all(getattr(p, "allreduce", True) is False for p in mod.parameters())


def test_sharded_linear_exact_4_ranks():
    run_distributed(_body, 4, timeout=120)


# --------------------------------------------------------------------------- training
class _Net(torch.nn.Module):
    def __init__(self, H, vocab):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, H)
        self.up = torch.nn.Linear(H, 4 * H)
        self.moe = MoE(H, torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU()), num_experts=2, ep_size=2,
                       k=1, capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=4)
        self.down = torch.nn.Linear(4 * H, H)
        self.head = torch.nn.Linear(H, vocab)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        x = x + self.moe(x)[0]
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _train(me, G, fused, steps, H=16, vocab=32, b=4, s=8):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from ds_uniep.commfuse import ShardedLinear
    torch.manual_seed(1)
    model = _Net(H, vocab)
    if fused:
        model.up, model.down = ShardedLinear.from_linear(model.up), ShardedLinear.from_linear(model.down)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    opt = torch.optim.Adam(groups, lr=1e-2, foreach=False)
    cfg = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
           "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(7 + me)
    batches = [torch.randint(0, vocab, (b, s + 1), generator=g) for _ in range(2)]
    losses = []
    for step in range(steps):
        data = batches[step % 2]
        loss = engine(data[:, :-1], data[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def _train_body(me, G, steps):
    _body(me, G)  # the 2-rank exactness checks share this group (a group costs seconds)
    unfused, _ = _train(me, G, False, steps)
    fused, engine = _train(me, G, True, steps)
    assert unfused[-1] < unfused[0] - 0.5, unfused
    assert [v.hex() for v in fused] == [v.hex() for v in unfused], (fused, unfused)


def test_sharded_linear_exact_and_trains_like_nn_linear_bitwise_2_ranks():
    run_distributed(_train_body, 2, 20, timeout=180)
