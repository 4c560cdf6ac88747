"""Activation checkpointing through UniEPMoE: the forward recomputed in the backward.

``torch.utils.checkpoint`` (reentrant and not) around a layer, and Hugging Face's
``gradient_checkpointing_enable()`` on converted models, give the bits of the run without it:
outputs, input and parameter gradients, and the expert bias that ``update_expert_biases`` moves
(a recomputed forward counts its routes again, and the bias moves by the sign of each count's
distance from the mean, which doubling every count leaves as it is). The recomputation runs the
layer's exchange again, on every rank alike; DeepSpeed's top-2 gate draws its noise again from
the RNG state the checkpoint restores. Reference backend on 1 and 2 CPU ranks; the default and
the sync-free megakernel layer on GPUs.
"""
import pytest
import torch

from conftest import needs_gpus
from dist_utils import rank_gpu, run_distributed
from moe_models import assert_bitwise, tiny_swiglu_moe

M = 16
MODES = ("plain", "reentrant", "non-reentrant")


def _layer(world_size, config, device="cpu", dtype=torch.float32):
    return tiny_swiglu_moe(world_size, config, device, dtype, hidden=M)  # DeepSpeed's top-2: 2nd expert sampled


def _count_forwards(layers):
    """A list that grows by one at each forward of one of ``layers`` (UniEPMoE), recomputations
    included (a module's forward hooks do not run again when a checkpoint recomputes it)."""
    calls = []
    for layer in layers:
        def forward_eager(*args, _forward=layer.forward_eager, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)
        layer.forward_eager = forward_eager
    return calls


def _run(layer, x0, mode):
    """[output, l_aux, x.grad, every parameter's grad] of one step with ``mode`` of checkpointing."""
    from torch.utils.checkpoint import checkpoint
    for p in layer.parameters():
        p.grad = None
    x = x0.clone().requires_grad_(True)
    torch.manual_seed(3)
    if mode == "plain":
        out, l_aux, _ = layer(x)
    else:
        out, l_aux, _ = checkpoint(layer, x, use_reentrant=mode == "reentrant")
    (out.float().square().sum() + l_aux).backward()
    return [out.detach(), l_aux.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _layer_body(rank, world_size):
    layer = _layer(world_size, {"backend": "reference"})
    calls = _count_forwards([layer])
    x0 = torch.randn(10 + 3 * rank, M, generator=torch.Generator().manual_seed(rank))
    want = _run(layer, x0, "plain")
    for mode in MODES[1:]:
        calls.clear()
        assert_bitwise(_run(layer, x0, mode), want, f"rank {rank} {mode}")
        assert len(calls) == 2, f"{mode}: {len(calls)} forwards, not the forward and its recomputation"


@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpointed_layer_gives_the_plain_bits(world_size):
    run_distributed(_layer_body, world_size)


def _hf_body(rank, world_size):
    import ds_uniep
    from hf_moe_models import VOCAB, tiny_model
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    for family in ("qwen3_moe", "deepseek_v3"):
        results = []
        for checkpointed in (False, True):
            model = tiny_model(family)  # the same weights each time
            ds_uniep.convert_hf_model(model, {"uniep": {"backend": "reference"}}, ep_size=world_size,
                                      router={"bias_update_rate": 1e-3} if family == "deepseek_v3" else None)
            if checkpointed:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            calls = _count_forwards([m for m in model.modules() if isinstance(m, ds_uniep.UniEPMoE)])
            logits = model(ids).logits
            logits.float().square().mean().backward()
            blocks = model.config.num_hidden_layers
            assert len(calls) == (2 if checkpointed else 1) * blocks, (family, checkpointed, len(calls))
            ds_uniep.update_expert_biases(model)
            results.append([logits.detach()] + [p.grad if p.grad is not None else torch.zeros(0)
                                                for p in model.parameters()] +
                           [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")])
        assert len(results[0]) == len(results[1])
        assert_bitwise(results[1], results[0], f"rank {rank} {family}")


def test_hugging_face_gradient_checkpointing_gives_the_plain_bits():
    run_distributed(_hf_body, 2, timeout=300)


def _megakernel_body(rank, world_size):
    device = rank_gpu(rank)
    for extra in ({}, {"sync_free": True}):
        layer = _layer(world_size, {"backend": "megakernel", "max_tokens_per_rank": 256, **extra}, device,
                       torch.bfloat16)
        x0 = torch.randn(100 + 20 * rank, M, device=device,
                         generator=torch.Generator(device=device).manual_seed(rank)).to(torch.bfloat16)
        calls = _count_forwards([layer])
        want = _run(layer, x0, "plain")
        for mode in MODES[1:]:
            calls.clear()
            assert_bitwise(_run(layer, x0, mode), want, f"rank {rank} {extra} {mode}")
            assert len(calls) == 2, f"{mode}: {len(calls)} forwards"
    torch.cuda.synchronize()
    if rank == 0:
        print(f"activation checkpointing ep {world_size}: the default and the sync-free layer, reentrant and not, "
              "bitwise the plain step", flush=True)


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2)])
def test_checkpointed_megakernel_layer_gives_the_plain_bits(world_size):
    run_distributed(_megakernel_body, world_size, backend="nccl")
