"""Converted Hugging Face MoE models on the megakernel backend, over NCCL on GPUs.

For tiny Mixtral, Qwen3-MoE and DeepSeek-V3 models in bf16, every rank runs its own tokens through
the model converted twice, with the megakernel backend and with the reference backend, and through
the unconverted model: the megakernel's logits equal the reference backend's bit for bit and every
layer's router choices are the same (the same routing, rows and slot-order sums); the gradients of
every parameter agree to bf16 tolerance (the gate gradient is reduced in another fixed order by
each backend); the first layer's choices are the unconverted model's (its routers run in fp32
there, as ds_uniep's always do; later layers can meet near ties in bf16: tests/test_hf_convert.py
checks the logits against the model's own in fp32 and bf16).
"""
import copy

import pytest

pytest.importorskip("transformers")

from conftest import needs_gpus  # noqa: E402
from dist_utils import rank_gpu, run_distributed  # noqa: E402
from test_hf_convert import _fp32_routers  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def _parity(rank, world):
    import torch
    import ds_uniep
    from hf_moe_models import VOCAB, tiny_model
    device = rank_gpu(rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 + rank)).to(device)
    probe = torch.randn(2, 16, VOCAB, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    for family in FAMILIES:
        hf = tiny_model(family, dtype=torch.bfloat16)
        models = {}
        for backend in ("megakernel", "reference"):
            m = copy.deepcopy(hf)
            ds_uniep.convert_hf_model(m, {"uniep": {"backend": backend, "max_tokens_per_rank": 64}}, ep_size=world)
            models[backend] = m.to(device).train()
            for layer in m.model.layers:
                layer.mlp.router.record_choices = True
        out = {}
        for backend, m in models.items():
            logits = m(ids).logits
            (logits.float() * probe).sum().backward()
            choices = [layer.mlp.router.last_choices[0] for layer in m.model.layers]
            grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
            out[backend] = (logits, choices, grads)
        (mk, mk_choices, mk_grads), (ref, ref_choices, ref_grads) = out["megakernel"], out["reference"]
        what = f"{family} rank {rank} of {world}"
        assert torch.equal(mk, ref), f"{what}: megakernel logits differ from the reference backend's"
        for i, (a, b) in enumerate(zip(mk_choices, ref_choices)):
            assert torch.equal(a, b), f"{what}: layer {i} router choices differ"
        assert set(mk_grads) == set(ref_grads), what
        for name, g in ref_grads.items():
            err = _rel(mk_grads[name], g)
            assert err < 3e-2, f"{what}: grad {name} relative error {err:.3g}"
        _fp32_routers(hf)
        hf_choices = []
        hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: hf_choices.append(out[2]))
        with torch.no_grad():
            hf.to(device)(ids)
        assert torch.equal(mk_choices[0], hf_choices[0]), f"{what}: first layer's choices differ from the model's"
        if rank == 0:
            print(f"hf megakernel ep {world} {family}: logits bitwise the reference backend's, "
                  f"{len(mk_grads)} gradients within bf16 tolerance", flush=True)


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=needs_gpus(n)) for n in (1, 2, 4)])
def test_converted_models_on_the_megakernel(world_size):
    run_distributed(_parity, world_size, backend="nccl", timeout=300)
