"""CommFuse ShardedLinear (weight sharded over the data-parallel group): exact against an unsharded linear.

Every rank builds the same full weights from one seed and its own batch. The reference is
``nn.Linear`` on every rank with its gradients summed over the group in rank order in fp32 (cast
once). Checked bitwise: output, input gradient, weight and bias gradient shards, for each schedule
and chunk count, fp32 and bf16, even and uneven shards, on 2 and 4 gloo ranks (and on 2 and 4 GPUs
over NCCL, both transports); state_dict gathers and load_state_dict shards. Then 50 training steps
under ``deepspeed.initialize`` of a small GPT-like model: with a MoE layer, under ZeRO-1 and 2, the
sharded linears against ``nn.Linear``, losses equal bit for bit; with none, under ZeRO-0, 1 and 2,
the loss goes down, and a run saved half way with ``engine.save_checkpoint`` and resumed in a new
engine with ``load_checkpoint`` gives the same losses and the same full weights.
"""
import pytest
import torch

from conftest import assert_matches, cpu_gemm_blocks_exact, needs_gpus, report_bitwise
from dist_utils import run_distributed


def _rank_order_sum(t):
    import torch.distributed as dist

    from ds_uniep.commfuse.common import ordered_sum
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return ordered_sum(parts)


def _check(me, G, K, N, dtype, schedule, chunks, T=10, device="cpu", transport="p2p", exact=True):
    from ds_uniep.commfuse import ShardedLinear
    from ds_uniep.commfuse.common import _offsets, even_split
    from ds_uniep.config import CommFuseConfig
    torch.manual_seed(0)
    ref = torch.nn.Linear(K, N).to(dtype=dtype, device=device)
    cfg = CommFuseConfig(schedule=schedule, num_chunks=chunks, transport=transport)
    mod = ShardedLinear.from_linear(ref, config=cfg)
    g = torch.Generator().manual_seed(10 + me)
    x = torch.randn(2, T, K, generator=g).to(dtype=dtype, device=device)
    dy = torch.randn(2, T, N, generator=g).to(dtype=dtype, device=device)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y_ref, y = ref(xs[0]), mod(xs[1])
    tag = f"[G={G} {device} {transport} K={K} N={N} {dtype} {schedule} chunks={chunks}]"
    same = [assert_matches(y, y_ref, f"{tag} forward", exact)]
    y_ref.backward(dy)
    y.backward(dy)
    same.append(assert_matches(xs[1].grad, xs[0].grad, f"{tag} dx", exact))
    o, n = _offsets(even_split(N, G))[me], even_split(N, G)[me]
    same.append(assert_matches(mod.weight.grad, _rank_order_sum(ref.weight.grad)[o:o + n], f"{tag} dW", exact))
    same.append(assert_matches(mod.bias.grad, _rank_order_sum(ref.bias.grad)[o:o + n], f"{tag} db", exact))
    return ref, mod, all(same)


def _body(me, G):
    from ds_uniep.commfuse import ShardedLinear
    cases = [(16, 24, torch.float32, "ring", 1), (16, 23, torch.float32, "bidirectional_ring", 2),
             (24, 32, torch.bfloat16, "local_first", 1), (8, 2 * G + 1, torch.bfloat16, "ring", 3)]
    exact = cpu_gemm_blocks_exact()  # else within rounding: this CPU's GEMM rounds a block of rows otherwise
    for K, N, dtype, schedule, chunks in cases:
        ref, mod, _ = _check(me, G, K, N, dtype, schedule, chunks, exact=exact)
    # Checkpoints hold the full tensors; loading keeps this rank's rows.
    sd = mod.state_dict()
    assert torch.equal(sd["weight"], ref.weight) and torch.equal(sd["bias"], ref.bias)
    other = ShardedLinear(mod.in_features, mod.out_features, dtype=mod.weight.dtype)
    other.load_state_dict(sd)
    assert torch.equal(other.weight, mod.weight) and torch.equal(other.bias, mod.bias)
    assert all(getattr(p, "allreduce", True) is False for p in mod.parameters())


def _gpu_body(me, G):
    """The same checks on GPUs over NCCL, on both transports, at GPU-sized GEMMs: within rounding, bit for
    bit where cuBLAS runs each block as it runs the whole; the count of bitwise cases is printed."""
    device = torch.device("cuda", torch.cuda.current_device())
    bitwise = []
    for transport in ("p2p", "copy_engine"):
        for K, N, dtype, schedule, chunks in [(512, 1024, torch.float32, "ring", 1),
                                              (1024, 1000, torch.bfloat16, "bidirectional_ring", 2),
                                              (768, 2048 + G, torch.bfloat16, "local_first", 3)]:
            bitwise.append(_check(me, G, K, N, dtype, schedule, chunks, T=256, device=device, transport=transport,
                                  exact=False)[2])
    report_bitwise(me, f"sharded linear over NCCL, {G} GPUs", bitwise)


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (2, 4)])
def test_sharded_linear_exact_over_nccl(world_size):
    run_distributed(_gpu_body, world_size, backend="nccl", timeout=300)


def test_sharded_linear_exact_4_ranks():
    run_distributed(_body, 4, timeout=120)


# --------------------------------------------------------------------------- training
class _Net(torch.nn.Module):
    """Embedding, an MLP block (the linears CommFuse shards), a MoE block or none, a head."""

    def __init__(self, H, vocab, moe):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, H)
        self.up = torch.nn.Linear(H, 4 * H)
        self.down = torch.nn.Linear(4 * H, H)
        self.moe = None
        if moe:
            from deepspeed.moe.layer import MoE
            self.moe = MoE(H, torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU()), num_experts=2,
                           ep_size=2, k=1, capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=4)
        self.head = torch.nn.Linear(H, vocab)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        if self.moe is not None:
            x = x + self.moe(x)[0]
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


STEPS = 50


def _engine(fused, zero, moe=True, H=16, vocab=32, b=4, clip=None):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from ds_uniep.commfuse import ShardedLinear
    torch.manual_seed(1)
    model = _Net(H, vocab, moe)
    if fused:
        model.up, model.down = ShardedLinear.from_linear(model.up), ShardedLinear.from_linear(model.down)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    opt = torch.optim.Adam(groups, lr=1e-2, foreach=False)
    torch.manual_seed(2)  # the same random state from here on, whatever the sharding drew
    cfg = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": zero}, "steps_per_print": 10 ** 9}
    if clip is not None:
        cfg["gradient_clipping"] = clip
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _steps(engine, me, first, last, vocab=32, b=4, s=8):
    """Losses of steps ``first`` .. ``last`` - 1: each step's tokens depend on the step and the rank,
    the targets are a fixed function of the tokens (something to learn)."""
    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + me)
        tokens = torch.randint(0, vocab, (b, s), generator=g)
        loss = engine(tokens, (3 * tokens + 1) % vocab)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train_body(me, G, ckpt):
    _body(me, G)  # the 2-rank exactness checks share this group (a group costs seconds)
    hexes = lambda losses: [v.hex() for v in losses]
    # In a model with a MoE layer (DeepSpeed's MoE handling on either way): bitwise nn.Linear's run.
    # (ZeRO-0 without clipping: its clipping averages the ranks' norms of what each holds, a shard here.)
    for zero, clip in ((1, None), (2, None), (0, 0.0)):
        unfused = _steps(_engine(False, zero, clip=clip), me, 0, STEPS)
        fused = _steps(_engine(True, zero, clip=clip), me, 0, STEPS)
        assert sum(unfused[-5:]) < sum(unfused[:5]) - 5.0, (zero, unfused)
        if cpu_gemm_blocks_exact():
            assert hexes(fused) == hexes(unfused), (zero, fused, unfused)
        else:  # this CPU's GEMM rounds a block of rows otherwise: the same training within rounding
            torch.testing.assert_close(fused, unfused, rtol=1e-3, atol=0.0)
    # With no MoE layer (the linears' mark turns DeepSpeed's MoE handling on): it trains, and under
    # ZeRO-2 a run saved half way through the engine and resumed in a new one gives the same losses
    # and the same full weights.
    for zero in (0, 1, 2):
        engine = _engine(True, zero, moe=False)
        fused = _steps(engine, me, 0, STEPS)
        assert sum(fused[-5:]) < sum(fused[:5]) - 5.0, (zero, fused)
    half = STEPS // 2
    first = _engine(True, 2, moe=False)
    _steps(first, me, 0, half)
    first.save_checkpoint(ckpt, tag="half")
    resumed = _engine(True, 2, moe=False)
    path, _ = resumed.load_checkpoint(ckpt, tag="half")
    assert path is not None
    assert hexes(_steps(resumed, me, half, STEPS)) == hexes(fused[half:])
    want, got = engine.module.state_dict(), resumed.module.state_dict()
    assert want["up.weight"].shape == (64, 16) and set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_sharded_linear_trains_like_nn_linear_bitwise_and_resumes_2_ranks(tmp_path):
    run_distributed(_train_body, 2, str(tmp_path / "ckpt"), timeout=300)
