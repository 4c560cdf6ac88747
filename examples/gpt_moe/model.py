"""A small GPT with an MoE MLP in every other block, written as upstream DeepSpeed-MoE code is.

Shape letters: B batch, S sequence, M hidden, V vocabulary (256 bytes).

The MoE layer is built exactly as Megatron-DeepSpeed builds it
(``megatron/model/transformer.py``): ``MoE(hidden_size, expert, num_experts=...,
ep_size=..., k=..., use_residual=..., capacity_factor=..., ...)``. ``MoE`` is the
stock ``deepspeed.moe.layer.MoE``; ``train.py --backend reference|megakernel``
passes ``moe_class=UniEPMoE`` (with its ``"uniep"`` config bound) instead, and that
is the only difference between the backends.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import Tensor, nn


class MLP(nn.Module):
    """The dense FFN, and the expert of an MoE block: ``[..., M] -> [..., M]``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class SelfAttention(nn.Module):

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads}")
        self.num_heads = num_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        B, S, M = x.shape
        q, k, v = self.query_key_value(x).view(B, S, 3, self.num_heads, M // self.num_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(B, S, M))


def expert_module(args) -> nn.Module:
    """The expert of an MoE block: Megatron's GeLU MLP with biases (``--expert-type mlp``), or
    ``ds_uniep.SwiGLUExpert`` (``swiglu``: gate and up projections, no biases), which ds_uniep's
    megakernel runs as grouped GEMMs (its pipelined and fused schedules need grouped experts)."""
    if getattr(args, "expert_type", "mlp") == "swiglu":
        from ds_uniep import SwiGLUExpert
        return SwiGLUExpert(args.hidden_size, args.ffn_hidden_size)
    return MLP(args.hidden_size, args.ffn_hidden_size)


class TransformerLayer(nn.Module):
    """Pre-LN block; ``num_experts > 1`` makes its MLP an MoE layer (returns ``(x, l_aux)``)."""

    def __init__(self, args, num_experts: int, moe_class=MoE):
        super().__init__()
        M = args.hidden_size
        self.input_layernorm = nn.LayerNorm(M)
        self.self_attention = SelfAttention(M, args.num_attention_heads)
        self.post_attention_layernorm = nn.LayerNorm(M)
        self.num_experts = num_experts
        if num_experts <= 1:
            self.mlp = MLP(M, args.ffn_hidden_size)
        else:
            self.mlp = moe_class(M,
                                 expert_module(args),
                                 num_experts=num_experts,
                                 ep_size=args.moe_expert_parallel_size,
                                 k=args.topk,
                                 use_residual=(args.mlp_type == "residual"),
                                 capacity_factor=args.moe_train_capacity_factor,
                                 eval_capacity_factor=args.moe_eval_capacity_factor,
                                 min_capacity=args.moe_min_capacity,
                                 drop_tokens=args.moe_token_dropping)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        x = x + self.self_attention(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        if self.num_experts <= 1:
            return x + self.mlp(h), torch.zeros((), device=x.device, dtype=torch.float32)
        out, l_aux, _ = self.mlp(h)
        return x + out, l_aux


def num_experts_per_layer(num_layers: int, num_experts: List[int], expert_interval: int = 2) -> List[int]:
    """Megatron-DeepSpeed's placement: an MoE MLP in every ``expert_interval``-th block (2, 4, ... counted
    from 1). ``num_experts`` is one value for all MoE blocks, or one per MoE block (PR-MoE pyramid)."""
    moe_layers = [i for i in range(num_layers) if (i + 1) % expert_interval == 0]
    if len(num_experts) == 1:
        per_moe = num_experts * len(moe_layers)
    elif len(num_experts) == len(moe_layers):
        per_moe = list(num_experts)
    else:
        raise ValueError(f"--num-experts has {len(num_experts)} values; give one, or one per MoE block "
                         f"({len(moe_layers)} of {num_layers} blocks with expert interval {expert_interval})")
    out = [1] * num_layers
    for i, e in zip(moe_layers, per_moe):
        out[i] = e
    return out


class GPTModel(nn.Module):
    """``forward(tokens [B, S] int64) -> (logits [B, S, V] fp32, moe_losses [num MoE blocks] fp32)``."""

    def __init__(self, args, vocab_size: int = 256, moe_class=MoE, ep_rank: int = 0):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.seq_length, args.hidden_size)
        experts = num_experts_per_layer(args.num_layers, args.num_experts, args.expert_interval)
        self.layers = nn.ModuleList(TransformerLayer(args, e, moe_class) for e in experts)
        self.final_layernorm = nn.LayerNorm(args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, vocab_size, bias=False)
        self._init_weights(args.seed, ep_rank)

    @torch.no_grad()
    def _init_weights(self, seed: int, ep_rank: int) -> None:
        # MoE deep-copies one expert into every local slot, so all experts would start equal.
        # Each expert instead gets weights seeded by its global index, the same on every
        # data-parallel replica of it; everything else is seeded identically on all ranks.
        std = 0.02
        for name, p in self.named_parameters():
            key = name
            if ".deepspeed_experts." in name:
                prefix, rest = name.split(".deepspeed_experts.")
                local_idx, suffix = rest.split(".", 1)
                num_local = len(self.get_submodule(prefix + ".deepspeed_experts"))
                key = f"{prefix}.expert{ep_rank * num_local + int(local_idx)}.{suffix}"
            g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(key))
            if p.dim() == 1:
                p.copy_(torch.ones_like(p) if "layernorm" in name else torch.zeros_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
                if name.endswith("dense.weight") or name.endswith("dense_4h_to_h.weight"):
                    p.mul_(1.0 / math.sqrt(2.0 * len(self.layers)))

    def forward(self, tokens: Tensor) -> Tuple[Tensor, Tensor]:
        S = tokens.shape[1]
        pos = torch.arange(S, device=tokens.device)
        x = self.embedding(tokens) + self.position_embeddings(pos)[None]
        moe_losses = []
        for layer in self.layers:
            x, l_aux = layer(x)
            if layer.num_experts > 1:
                moe_losses.append(l_aux.float())
        logits = self.lm_head(self.final_layernorm(x)).float()
        if not moe_losses:
            return logits, torch.zeros(0, device=x.device)
        return logits, torch.stack(moe_losses)


def _stable_hash(s: str) -> int:
    h = 0
    for c in s.encode():
        h = (h * 131 + c) % 1_000_000_007
    return h


def count_parameters(model: nn.Module, expert_only: Optional[bool] = None) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if expert_only is None or ((".deepspeed_experts." in n) == expert_only))
