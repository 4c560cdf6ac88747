"""convert_hf_model at expert-parallel size 2: the converted model computes what the model does
(tests/test_hf_convert_ep4.py: DeepSeek-V3 at 4).

For tiny Mixtral, Qwen3-MoE and DeepSeek-V3 models (gloo, reference backend), every rank runs its
own tokens through the converted model (its share of the experts, the others' tokens arriving
through the dispatch) and through an unconverted copy:

- fp32: logits within fp32 rounding, every layer's router choices identical, the gradient of every
  parameter (summed over the ranks, the experts gathered in the model's own layout) within fp32
  rounding; DeepSeek-V3's expert bias updated identically on every rank, from the counts of both;
  after an SGD step, saved in the model's layout, loaded with plain transformers: the same logits.
- bf16: logits and gradients within bf16 tolerance, the first layer's choices identical. The
  reference's routers run in fp32 (as ds_uniep's always do; Mixtral's and Qwen's own compute their
  logits in the model's dtype, which can pick another expert at a near tie).
"""
import copy
import os

import pytest

pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
RATE = 1e-3


def _fp32_routers(model):
    """The reference's routers in fp32: weights cast, inputs cast on the way in."""
    import torch
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.float()
        gate.register_forward_pre_hook(lambda m, args: (args[0].float(), ) + tuple(args[1:]))
    return torch


def _grads_in_hf_layout(model):
    """The converted model's gradients as ``hf_state_dict`` lays out its values (experts gathered)."""
    import torch
    import ds_uniep
    saved = {}
    for p in model.parameters():
        saved[p] = p.data
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        return ds_uniep.hf_state_dict(model)
    finally:
        for p, d in saved.items():
            p.data = d


def _close(a, b, dtype, what):
    import torch
    if dtype == torch.float32:  # an error of sums in another order: relative to the tensor's scale
        scale = max(b.abs().max().item(), 1e-6)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")
    else:
        err = (a.float() - b.float()).norm() / max(b.float().norm(), 1e-6)
        assert err < 3e-2, f"{what}: relative error {err:.3g}"


def _parity(rank, world, families, dtypes, tmp):
    import torch
    import torch.distributed as dist
    import ds_uniep
    from hf_moe_models import VOCAB, tiny_model
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    probe = torch.randn(2, 16, VOCAB, generator=torch.Generator().manual_seed(7 + rank))
    for family in families:
        for dtype in (getattr(torch, d) for d in dtypes):
            what = f"{family} {dtype} rank {rank}"
            ref = tiny_model(family, dtype=dtype)
            model = copy.deepcopy(ref)
            if dtype == torch.bfloat16:
                _fp32_routers(ref)
            has_bias = family == "deepseek_v3"
            ds_uniep.convert_hf_model(model, {"uniep": {"backend": "reference"}}, ep_size=world,
                                      router={"bias_update_rate": RATE} if has_bias else None)
            ref.train()
            model.train()
            hf_choices = []
            for layer in ref.model.layers:
                layer.mlp.gate.register_forward_hook(lambda m, a, out: hf_choices.append(out[2]))
            routers = [layer.mlp.router for layer in model.model.layers]
            for r in routers:
                r.record_choices = True
            bias0 = [r.e_score_correction_bias.clone() for r in routers] if has_bias else None

            want = ref(ids).logits
            got = model(ids).logits
            _close(got.float(), want.float(), dtype, f"{what} logits")
            for i, (r, hf_idx) in enumerate(zip(routers, hf_choices)):
                if dtype == torch.float32 or i == 0:
                    assert torch.equal(r.last_choices[0], hf_idx), f"{what}: layer {i} choices differ"

            (want.float() * probe).sum().backward()
            (got.float() * probe).sum().backward()
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            for g in ref_grads.values():
                dist.all_reduce(g)
            for p in model.parameters():  # expert parameters (allreduce False) hold their whole gradient
                if getattr(p, "allreduce", True) and p.grad is not None:
                    dist.all_reduce(p.grad)
            grads = _grads_in_hf_layout(model)
            assert set(ref_grads) <= set(grads), set(ref_grads) - set(grads)
            for name, g in ref_grads.items():
                _close(grads[name], g.to(grads[name].dtype), dtype, f"{what} grad {name}")

            if has_bias:  # every rank's counts, summed: the same bias everywhere, moved by both ranks' choices
                counts = [torch.bincount(r.last_choices[0].reshape(-1), minlength=r.num_experts) for r in routers]
                assert ds_uniep.update_expert_biases(model) == len(routers)
                for r, c, b0 in zip(routers, counts, bias0):
                    dist.all_reduce(c)
                    c = c.double()
                    delta = torch.sign(c.mean() - c).float() * RATE
                    assert torch.equal(r.e_score_correction_bias, b0 + (delta - delta.mean())), what
                    everyone = [torch.empty_like(b0) for _ in range(world)]
                    dist.all_gather(everyone, r.e_score_correction_bias)
                    assert all(torch.equal(b, everyone[0]) for b in everyone), what

            if dtype == torch.float32 and tmp is not None:
                from transformers import AutoModelForCausalLM
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p -= 0.5 * p.grad
                model.eval()
                path = os.path.join(tmp, family)
                ds_uniep.save_hf_pretrained(model, path)
                loaded = AutoModelForCausalLM.from_pretrained(path).eval()
                with torch.no_grad():
                    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
                    assert not torch.allclose(loaded(ids).logits, want.detach(), atol=1e-3)  # the step was saved


def test_converted_models_match_at_ep2(tmp_path):
    run_distributed(_parity, 2, FAMILIES, ("float32", "bfloat16"), str(tmp_path), timeout=300)


def _generate(rank, world):
    import torch
    import ds_uniep
    from hf_moe_models import FAMILIES, VOCAB, tiny_model
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))
    for family in FAMILIES:
        ref = tiny_model(family).eval()
        model = tiny_model(family)
        ds_uniep.convert_hf_model(model, {"uniep": {"backend": "reference"}}, ep_size=world)
        model.eval()
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)  # every rank runs as many steps
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw)), f"{family} rank {rank}"


def test_generate_gives_the_hf_models_tokens_at_ep2():
    """Greedy generation with the KV cache (2 tokens per rank and step) on a converted model."""
    run_distributed(_generate, 2)
