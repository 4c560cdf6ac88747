"""Tiny Hugging Face MoE models (random weights, no download) for the ds_uniep.hf tests."""
import torch

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64)


def tiny_config(family: str, **overrides):
    """A 2-layer, hidden-32, 8-expert config of ``family`` (mixtral, qwen3_moe, qwen2_moe, deepseek_v3,
    deepseek_v2), every layer an MoE block."""
    import transformers as tf
    if family == "mixtral":
        kw = dict(COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
        cls = tf.MixtralConfig
    elif family == "qwen3_moe":
        kw = dict(COMMON, intermediate_size=64, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, head_dim=8)
        cls = tf.Qwen3MoeConfig
    elif family == "qwen2_moe":
        kw = dict(COMMON, intermediate_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=32,
                  num_experts=8, num_experts_per_tok=2)
        cls = tf.Qwen2MoeConfig
    elif family in ("deepseek_v3", "deepseek_v2"):
        kw = dict(COMMON, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                  n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)
        cls = tf.DeepseekV3Config
        if family == "deepseek_v2":
            kw.update(topk_method="group_limited_greedy", routed_scaling_factor=1.0)
            cls = tf.DeepseekV2Config
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """The model of :func:`tiny_config` with random weights (std 0.2, norms one) and, where the model
    keeps one, a random expert bias, in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model.to(dtype).eval()
