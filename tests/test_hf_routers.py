"""ds_uniep.routers against the models' own routing code, and convert_hf_model's errors (one process).

Each family's router, as convert_hf_model builds it from the model (DeepSpeed AutoEP's presets plus
the model config), is run beside the model's own router module from transformers on random tokens:
the same experts in the same slots, the same weights within fp32 rounding.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_uniep  # noqa: E402
from ds_uniep.hf import HFMoEBlock  # noqa: E402
from ds_uniep.routers import Router, RouterOptions, update_expert_biases  # noqa: E402
from hf_moe_models import tiny_model  # noqa: E402

CASES = [("mixtral", {}), ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False}), ("qwen2_moe", {}),
         ("deepseek_v3", {}), ("deepseek_v3", {"norm_topk_prob": False}),
         ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
         ("deepseek_v2", {}), ("deepseek_v2", {"topk_method": "greedy"})]


def _converted_router_pair(family, overrides, **kw):
    model = tiny_model(family, **overrides)
    hf_gate = model.model.layers[0].mlp.gate
    ds_uniep.convert_hf_model(model, {"uniep": {"backend": "reference"}}, **kw)
    block = model.model.layers[0].mlp
    assert isinstance(block, HFMoEBlock)
    return hf_gate, block.router


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}-{o}" if o else f for f, o in CASES])
def test_router_matches_the_models_own(family, overrides):
    hf_gate, router = _converted_router_pair(family, overrides)
    torch.manual_seed(1)
    x = torch.randn(257, 32)
    with torch.no_grad():
        _, hf_w, hf_idx = hf_gate(x)
        _, idx, w = router.choose(x)
    if family == "deepseek_v2":  # its group mask fills 0.0 where ours fills -inf: the same sets, order free
        hf_idx, order = hf_idx.sort(dim=-1)
        hf_w = hf_w.gather(1, order)
        idx, order = idx.sort(dim=-1)
        w = w.gather(1, order)
    assert torch.equal(idx, hf_idx)
    torch.testing.assert_close(w, hf_w.float(), rtol=2e-7, atol=1e-7)


def test_expert_bias_is_for_the_choice_only_and_stays_fp32():
    opts = RouterOptions(score_func="sigmoid", expert_bias=True, norm_topk_prob=False)
    r = Router(16, 8, 2, opts)
    with torch.no_grad():
        r.e_score_correction_bias[3] = 10.0
    x = torch.randn(64, 16)
    scores, idx, w = r.choose(x)
    assert (idx == 3).any(dim=1).all()
    torch.testing.assert_close(w, scores.gather(1, idx), rtol=0, atol=0)
    assert "e_score_correction_bias" in r.state_dict() and "step_counts" not in r.state_dict()
    r.bfloat16()
    assert r.weight.dtype == torch.bfloat16 and r.e_score_correction_bias.dtype == torch.float32
    assert r.e_score_correction_bias[3].item() == 10.0


def test_bias_update_moves_towards_balance():
    r = Router(16, 4, 1, RouterOptions(score_func="sigmoid", expert_bias=True, bias_update_rate=0.01))
    r.train()
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    idx, rest = r.route_split(torch.randn(32, 16))
    rest()
    counts = torch.bincount(idx.long().reshape(-1), minlength=4).double()
    assert torch.equal(r.step_counts, counts.long())
    before = r.e_score_correction_bias.clone()
    assert update_expert_biases(r) == 1
    delta = torch.sign(counts.mean() - counts).float() * 0.01
    assert torch.equal(r.e_score_correction_bias, before + (delta - delta.mean()))
    assert r.e_score_correction_bias[0] < before[0]  # the overloaded expert goes down
    assert r.step_counts.sum() == 0


def _deepseek_aux(scores, idx, E, k, alpha, seq_len=None):
    """DeepSeek-V2's reference auxiliary losses (MoEGate.forward of its modeling code)."""
    if seq_len is None:
        ce = torch.nn.functional.one_hot(idx.reshape(-1), num_classes=E).float().mean(0)
        return (scores.mean(0) * ce * E).sum() * alpha
    bsz = idx.shape[0] // seq_len
    ce = torch.zeros(bsz, E)
    ce.scatter_add_(1, idx.view(bsz, -1), torch.ones(bsz, seq_len * k)).div_(seq_len * k / E)
    return (ce * scores.view(bsz, seq_len, -1).mean(dim=1)).sum(dim=1).mean() * alpha


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_losses(kind, score_func):
    r = Router(16, 8, 2, RouterOptions(score_func=score_func, aux_loss=kind, aux_loss_coef=0.01)).train()
    r.seq_len = 8
    x = torch.randn(32, 16)
    idx, rest = r.route_split(x)
    l_aux, _, counts = rest()
    scores = r.choose(x)[0]
    if score_func == "sigmoid":
        scores = scores / scores.sum(-1, keepdim=True)
    want = _deepseek_aux(scores, idx.long(), 8, 2, 0.01, 8 if kind == "seq_aux_loss" else None)
    torch.testing.assert_close(l_aux, want, rtol=1e-6, atol=1e-8)
    l_aux.backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    r.eval()
    assert r.route_split(x)[1]()[0].item() == 0.0  # no loss outside training


def test_router_option_errors():
    with pytest.raises(ValueError, match="score_func"):
        RouterOptions(score_func="relu")
    with pytest.raises(ValueError, match="n_group and topk_group"):
        RouterOptions(n_group=4)
    with pytest.raises(ValueError, match="needs expert_bias"):
        RouterOptions(bias_update_rate=0.1)
    with pytest.raises(ValueError, match="does not divide num_experts"):
        Router(8, 6, 2, RouterOptions(n_group=4, topk_group=2))


def test_convert_errors():
    from transformers import AutoModelForCausalLM, LlamaConfig
    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported; supported: mixtral, .*deepseek_v3"):
        ds_uniep.convert_hf_model(llama)
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide its 8 experts"):
        ds_uniep.convert_hf_model(tiny_model("mixtral"), ep_size=3)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 cannot be honoured"):
        ds_uniep.convert_hf_model(tiny_model("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="output_router_logits=True cannot be honoured"):
        ds_uniep.convert_hf_model(tiny_model("qwen3_moe", output_router_logits=True))
    with pytest.raises(ValueError, match="score_apply 'pre'"):
        ds_uniep.convert_hf_model(tiny_model("qwen3_moe"), {"expert_parallel": {"score_apply": "pre"}})
    with pytest.raises(ValueError, match=r"unknown router option\(s\) \['coef'\]"):
        ds_uniep.convert_hf_model(tiny_model("mixtral"), router={"coef": 1})
    with pytest.raises(ValueError, match="makes DeepSpeed AutoEP convert"):
        ds_uniep.convert_hf_model(tiny_model("mixtral"), {"expert_parallel": {"enabled": True}})
    with pytest.raises(ValueError, match="bias_update_rate needs an aux-loss-free expert bias"):
        ds_uniep.convert_hf_model(tiny_model("mixtral"), router={"bias_update_rate": 0.001})
    model = tiny_model("mixtral")
    before = [type(layer.mlp).__name__ for layer in model.model.layers]
    with pytest.raises(ValueError):
        ds_uniep.convert_hf_model(model, ep_size=3)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == before  # nothing replaced


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_single_rank_shared_experts_logits_grads_and_hf_save(family, tmp_path):
    """Qwen2-MoE's gated shared expert and DeepSeek-V3's shared experts, at ep_size 1."""
    import copy
    from transformers import AutoModelForCausalLM
    from test_hf_convert import _close, _grads_in_hf_layout
    model = tiny_model(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    want = ref(ids).logits
    ds_uniep.convert_hf_model(model, {"uniep": {"backend": "reference"}})
    got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    grads = _grads_in_hf_layout(model)
    for name, p in ref.named_parameters():
        _close(grads[name], p.grad, torch.float32, name)
    ds_uniep.save_hf_pretrained(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
