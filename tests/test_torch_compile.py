"""``torch.compile`` over a UniEPMoE layer.

CPU: the reference backend under ``torch.compile(layer, backend="aot_eager")`` (Dynamo's graphs and
AOTAutograd's forward and backward, run by torch's own kernels) gives the eager bits, forward and
backward, on 1 and 2 gloo ranks, also on later calls with new tokens and other token counts.
(Inductor generates its own fused kernels, whose rounding differs from eager's.)

GPU: the default and the sync-free megakernel layer under ``backend="aot_eager"`` give the eager
bits of the default layer on new tokens and routing.

CommFuse's modules (the TP-SP linears, ``ShardedLinear``, ``UlyssesAttention``) and a converted
Hugging Face model on 2 CPU ranks: the eager bits under ``backend="aot_eager"`` too.
"""
import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from moe_models import assert_bitwise, tiny_swiglu_moe

M = 16


def _layer(world_size, backend="reference", extra=None, device="cpu", dtype=torch.float32):
    return tiny_swiglu_moe(world_size, {"backend": backend, **(extra or {})}, device, dtype, hidden=M, use_rts=False,
                           top2_2nd_expert_sampling=False)


def _step(fn, layer, x, gy):
    """[output, l_aux, exp_counts, x.grad, every parameter's grad] of one step from cleared gradients."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, l_aux, counts = fn(x)
    torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
    return [out.detach().clone(), l_aux.detach().clone(), counts.clone(), x.grad.clone()] + \
        [p.grad.clone() for p in layer.parameters()]


def _reference_body(rank, world_size, extra=None):
    layer = _layer(world_size, extra=extra)
    compiled = torch.compile(layer, backend="aot_eager")
    for case, T in enumerate((12, 12, 5 + 3 * rank) if world_size > 1 else (12, 12)):  # then another T per rank
        g = torch.Generator().manual_seed(100 * case + rank)
        x, gy = torch.randn(T, M, generator=g), torch.randn(T, M, generator=g)
        want = _step(layer, layer, x, gy)
        assert_bitwise(_step(compiled, layer, x, gy), want, f"rank {rank} case {case} (T={T})")


@pytest.mark.parametrize("world_size, extra", [(1, None), (2, None), (2, {"topology": {"node_size": 1}}),
                                               (2, {"hybrid": {"enabled": True, "domain_size": 2}})],
                         ids=["1", "2", "2-nodes", "2-hybrid"])
def test_reference_backend_under_torch_compile_gives_the_eager_bits(world_size, extra):
    """Flat, two-level (2 emulated nodes of 1) and HybridEP."""
    run_distributed(_reference_body, world_size, extra)


def _commfuse_body(rank, world_size):
    import torch.nn.functional as F
    from ds_uniep.commfuse import ColumnParallelLinear, RowParallelLinear, ShardedLinear, UlyssesAttention

    def attention(q, k, v, *args, **kwargs):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.manual_seed(0)
    modules = {"ColumnParallelLinear": (ColumnParallelLinear(M, 2 * M), (4, 2, M), ()),
               "RowParallelLinear": (RowParallelLinear(2 * M, M), (8, 2, M), ()),
               "ShardedLinear": (ShardedLinear(M, 3 * M), (6, M), ()),
               "UlyssesAttention": (UlyssesAttention(attention, None, M, 4), (2, 4, M), (0, ))}
    for name, (module, shape, args) in modules.items():
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        compiled = torch.compile(module, backend="aot_eager")
        outs = []
        for fn in (module, compiled):
            for p in module.parameters():
                p.grad = None
            xx = x.clone().requires_grad_(True)
            y = fn(xx, *args)
            y.sum().backward()
            outs.append([y.detach(), xx.grad.clone()] + [p.grad.clone() for p in module.parameters()])
        assert_bitwise(outs[1], outs[0], f"rank {rank} {name}")


def test_commfuse_modules_under_torch_compile_give_the_eager_bits():
    """The TP-SP linears, the data-parallel linear and Ulysses attention on 2 gloo ranks."""
    run_distributed(_commfuse_body, 2)


def _hf_body(rank, world_size):
    import ds_uniep
    from hf_moe_models import VOCAB, tiny_model
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model = tiny_model("deepseek_v3")
    ds_uniep.convert_hf_model(model, {"uniep": {"backend": "reference"}}, ep_size=world_size)
    model.train()
    outs = []
    for fn in (model, torch.compile(model, backend="aot_eager")):
        for p in model.parameters():
            p.grad = None
        logits = fn(ids).logits
        logits.float().square().mean().backward()
        outs.append([logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(outs[1]) == len(outs[0])
    assert_bitwise(outs[1], outs[0], f"rank {rank} deepseek_v3")


def test_converted_hugging_face_model_under_torch_compile_gives_the_eager_bits():
    """A converted DeepSeek-V3 (group-limited routing, expert bias, shared experts) on 2 gloo ranks."""
    run_distributed(_hf_body, 2)


def _megakernel_body(rank, world_size):
    device = rank_gpu(rank)
    base = _layer(world_size, "megakernel", {"max_tokens_per_rank": 256}, device, torch.bfloat16)
    free = _layer(world_size, "megakernel", {"max_tokens_per_rank": 256, "sync_free": True}, device, torch.bfloat16)
    compiled = {"default": torch.compile(base, backend="aot_eager"), "sync-free": torch.compile(free, backend="aot_eager")}
    T = 100 + 20 * rank
    for case in range(4):
        g = torch.Generator(device=device).manual_seed(100 * case + rank)
        x = torch.randn(T, M, device=device, generator=g).to(torch.bfloat16)
        gy = torch.randn(T, M, device=device, generator=g).to(torch.bfloat16)
        wg = torch.randn(base.deepspeed_moe.gate.wg.weight.shape, device=device,
                         generator=torch.Generator(device=device).manual_seed(case)) * M**-0.5
        if case == 2:  # every token's first choice on the last expert
            wg[-1] += 50.0
        with torch.no_grad():
            base.deepspeed_moe.gate.wg.weight.copy_(wg)
            free.deepspeed_moe.gate.wg.weight.copy_(wg)
        want = _step(base, base, x, gy)
        for name, fn in compiled.items():
            assert_bitwise(_step(fn, base if name == "default" else free, x, gy), want, f"rank {rank} case {case} {name}")
    torch.cuda.synchronize()
    if rank == 0:
        print(f"torch.compile ep {world_size}: 4 cases of the default and the sync-free layer (aot_eager) "
              "bitwise the eager default layer", flush=True)


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2)])
def test_megakernel_layers_under_torch_compile_give_the_eager_bits(world_size):
    run_distributed(_megakernel_body, world_size, backend="nccl")
