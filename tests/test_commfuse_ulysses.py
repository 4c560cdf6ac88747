"""CommFuse Ulysses attention: bitwise equal to DeepSpeed's DistributedAttention with the same projections.

The reference is what a model runs without CommFuse: ``nn.Linear`` QKV, DeepSpeed's
``DistributedAttention`` around torch SDPA, ``nn.Linear`` output projection. Every rank builds the
same weights from one seed and its own sequence block of the same batch. Checked bitwise, forward
and backward (input and parameter gradients), for both layouts, GQA, each schedule and chunk count,
fp32 and bf16, on 2 and 4 gloo ranks (and on 2 and 4 GPUs over NCCL, both transports); then 50
ZeRO-1 training steps of a tiny GPT with each attention, losses equal bit for bit.
"""
import pytest
import torch

from conftest import assert_matches, cpu_gemm_blocks_exact, needs_gpus, report_bitwise
from dist_utils import run_distributed


def _sdpa(bdim):
    import torch.nn.functional as F

    def attn(q, k, v):
        # DistributedAttention's local layout: [b, S, h, d] (bdim 0) or [S, b, h, d] (bdim 1).
        perm = (0, 2, 1, 3) if bdim == 0 else (1, 2, 0, 3)
        qh, kh, vh = (t.permute(*perm) for t in (q, k, v))
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:
            kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return o.permute(*perm).contiguous() if bdim == 0 else o.permute(2, 0, 1, 3).contiguous()

    return attn


class _Unfused(torch.nn.Module):
    def __init__(self, H, heads, kv, bdim, group):
        from deepspeed.sequence.layer import DistributedAttention
        super().__init__()
        d = H // heads
        self.heads, self.kv, self.d = heads, kv, d
        self.qkv = torch.nn.Linear(H, (heads + 2 * kv) * d)
        self.out = torch.nn.Linear(heads * d, H)
        self.attn = DistributedAttention(_sdpa(bdim), group, scatter_idx=2, gather_idx=1 if bdim == 0 else 0)

    def forward(self, x, bdim):
        qkv = self.qkv(x)
        hd, kd = self.heads * self.d, self.kv * self.d
        q = qkv[..., :hd].reshape(*x.shape[:2], self.heads, self.d)
        k = qkv[..., hd:hd + kd].reshape(*x.shape[:2], self.kv, self.d)
        v = qkv[..., hd + kd:].reshape(*x.shape[:2], self.kv, self.d)
        ctx = self.attn(q, k, v, bdim)
        return self.out(ctx.reshape(*x.shape[:2], -1))


def _pair(me, G, H, heads, kv, bdim, dtype, schedule, chunks, seed=0, device="cpu", transport="p2p"):
    import torch.distributed as dist

    from ds_uniep.commfuse import UlyssesAttention
    from ds_uniep.config import CommFuseConfig
    torch.manual_seed(seed)
    ref = _Unfused(H, heads, kv, bdim, dist.group.WORLD).to(dtype=dtype, device=device)
    cfg = CommFuseConfig(schedule=schedule, num_chunks=chunks, transport=transport)
    fused = UlyssesAttention.from_linears(_sdpa(bdim), None, ref.qkv, ref.out, heads, kv, config=cfg)
    return ref, fused


def _check(me, G, H, heads, kv, bdim, dtype, schedule, chunks, b=2, s=6, device="cpu", transport="p2p",
           exact=True):
    """Bit for bit (``exact``), else within rounding; returns whether every tensor had the reference's bits."""
    ref, fused = _pair(me, G, H, heads, kv, bdim, dtype, schedule, chunks, device=device, transport=transport)
    g = torch.Generator().manual_seed(100)
    # the whole batch, the same on every rank
    full = torch.randn(b, G * s, H, generator=g).to(dtype=dtype, device=device)
    dout_full = torch.randn(b, G * s, H, generator=g).to(dtype=dtype, device=device)
    x, dout = (t[:, me * s:(me + 1) * s] for t in (full, dout_full))
    if bdim == 1:
        x, dout = x.transpose(0, 1), dout.transpose(0, 1)
    x = x.contiguous()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y_ref = ref(xs[0], bdim)
    y = fused(xs[1], bdim)
    tag = f"[G={G} {device} {transport} bdim={bdim} {dtype} heads={heads}/{kv} {schedule} chunks={chunks}]"
    same = [assert_matches(y, y_ref, f"{tag} forward", exact)]
    y_ref.backward(dout)
    y.backward(dout)
    same.append(assert_matches(xs[1].grad, xs[0].grad, f"{tag} dx", exact))
    pairs = [(fused.qkv_weight, ref.qkv.weight), (fused.qkv_bias, ref.qkv.bias), (fused.out_weight, ref.out.weight),
             (fused.out_bias, ref.out.bias)]
    for i, (a, r) in enumerate(pairs):
        same.append(assert_matches(a.grad, r.grad, f"{tag} grad {i}", exact))
    return all(same)


def _body(me, G):
    cases = [(32, 4, 4, 0, torch.float32, "ring", 1), (32, 4, 4, 1, torch.float32, "bidirectional_ring", 2),
             (32, 4, 4, 0, torch.bfloat16, "local_first", 3), (48, 4 * G // 2, G, 1, torch.bfloat16, "ring", 2),
             (64, 8, 2 * G // 2, 0, torch.float32, "bidirectional_ring", 4)]
    exact = cpu_gemm_blocks_exact()  # else within rounding: this CPU's GEMM rounds a block of rows otherwise
    for H, heads, kv, bdim, dtype, schedule, chunks in cases:
        if heads % G or kv % G:
            continue
        _check(me, G, H, heads, kv, bdim, dtype, schedule, chunks, exact=exact)
    from ds_uniep.commfuse import UlyssesAttention
    from ds_uniep.config import CommFuseConfig
    with pytest.raises(ValueError, match="no all-to-all counterpart"):
        UlyssesAttention(_sdpa(0), None, 32, 4, config=CommFuseConfig(schedule="relay"))
    with pytest.raises(ValueError, match="divisible"):
        UlyssesAttention(_sdpa(0), None, 30, 3 if G != 3 else 5)


def _gpu_body(me, G):
    """The same cases on GPUs over NCCL, on both transports, at GPU-sized GEMMs: within rounding, and
    bit for bit where cuBLAS runs each block as it runs the whole (UlyssesAttention's docstring); the
    count of bitwise cases is printed."""
    device = torch.device("cuda", torch.cuda.current_device())
    bitwise = []
    for transport in ("p2p", "copy_engine"):
        for H, heads, kv, bdim, dtype, schedule, chunks in [
                (256, 8, 8, 0, torch.float32, "ring", 1), (256, 8, 4, 1, torch.bfloat16, "bidirectional_ring", 2),
                (512, 8, 8, 0, torch.bfloat16, "local_first", 3)]:
            bitwise.append(_check(me, G, H, heads, kv, bdim, dtype, schedule, chunks, b=2, s=128, device=device,
                                  transport=transport, exact=False))
    report_bitwise(me, f"ulysses over NCCL, {G} GPUs", bitwise)


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (2, 4)])
def test_ulysses_equals_distributed_attention_over_nccl(world_size):
    run_distributed(_gpu_body, world_size, backend="nccl", timeout=300)


def test_ulysses_equals_distributed_attention_2_ranks():
    run_distributed(_body, 2, timeout=120)


def test_ulysses_equals_distributed_attention_4_ranks():
    run_distributed(_body, 4, timeout=120)


# --------------------------------------------------------------------------- training
class _Block(torch.nn.Module):
    def __init__(self, attn, H):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(H), torch.nn.LayerNorm(H)
        self.attn = attn
        self.mlp = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H))

    def forward(self, x):
        x = x + self.attn(self.ln1(x), 0)
        return x + self.mlp(self.ln2(x))


class _TinyGPT(torch.nn.Module):
    def __init__(self, attns, H, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, H)
        self.blocks = torch.nn.ModuleList(_Block(a, H) for a in attns)
        self.head = torch.nn.Linear(H, vocab)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _train(me, G, fused, steps, H=32, heads=4, vocab=64, s=8, b=2):
    import deepspeed
    import torch.distributed as dist

    from ds_uniep.commfuse import UlyssesAttention
    torch.manual_seed(1)
    model = _TinyGPT([_Unfused(H, heads, heads, 0, dist.group.WORLD) for _ in range(2)], H, vocab)
    if fused:  # the same weights (built first, so every other parameter draws the same numbers)
        for blk in model.blocks:
            blk.attn = UlyssesAttention.from_linears(_sdpa(0), None, blk.attn.qkv, blk.attn.out, heads)
    # DP group == Ulysses group: each rank holds a sequence block of the same batch, and DeepSpeed's
    # gradient average over it is the gradient of the mean of the blocks' losses.
    cfg = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, vocab, (b, G * s + 1), generator=g) for _ in range(2)]
    losses = []
    for step in range(steps):
        data = batches[step % 2]
        tok, tgt = data[:, :-1], data[:, 1:]
        loss = engine(tok[:, me * s:(me + 1) * s], tgt[:, me * s:(me + 1) * s])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train_body(me, G, steps):
    unfused = _train(me, G, False, steps)
    fused = _train(me, G, True, steps)
    assert unfused[-1] < unfused[0], unfused
    assert [v.hex() for v in fused] == [v.hex() for v in unfused], (fused, unfused)


def test_ulysses_trains_like_distributed_attention_bitwise():
    run_distributed(_train_body, 2, 50, timeout=240)
