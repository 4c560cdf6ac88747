"""Routers of Hugging Face MoE families, as modules that stand where DeepSpeed's gate stands.

:class:`Router` routes one token to ``k`` of ``E`` experts as Mixtral, Qwen2/Qwen3-MoE and
DeepSeek-V2/V3 do (:class:`RouterOptions` says how): softmax or sigmoid scores of an fp32 linear
map (fp32 whatever the model's dtype), top-k over the scores, optionally only inside the best
``topk_group`` of ``n_group`` expert groups, the chosen scores optionally renormalised to sum to
one and multiplied by a routed scaling factor. The aux-loss-free expert bias (DeepSeek-V3's
``e_score_correction_bias``) is added to the scores for the choice only; the weights are the
unbiased scores. Auxiliary losses: ``"none"``, ``"aux_loss"`` (over the batch) or
``"seq_aux_loss"`` (per sequence, averaged), times ``aux_loss_coef``.

A ``UniEPMoE`` whose ``deepspeed_moe.gate`` is a Router routes through it: :meth:`Router.route_split`
is the hook ``ds_uniep.gating`` calls (the routes first, the rest of the gate when the combine
needs it), so every schedule and backend runs it as it runs DeepSpeed's gate. DeepSpeed's
``TopKGate`` stays the gate ``UniEPMoE`` builds.

Expert bias updates: during training every forward adds its expert counts to ``step_counts``;
:func:`update_expert_biases` (call it after each optimizer step) sums them over the ranks that
train the layer on different data (one all-reduce per layer, so the bias is identical on every
rank) and moves the bias by ``bias_update_rate`` towards balance.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
AUX_LOSSES = ("none", "aux_loss", "seq_aux_loss")


@dataclass(frozen=True)
class RouterOptions:
    """How a :class:`Router` routes (checked on construction)."""

    score_func: str = "softmax"  #: "softmax" or "sigmoid"
    norm_topk_prob: bool = True  #: renormalise the k chosen scores to sum to one
    routed_scaling_factor: float = 1.0  #: the k weights are multiplied by this
    n_group: Optional[int] = None  #: expert groups for group-limited top-k (None: no groups)
    topk_group: Optional[int] = None  #: groups a token may choose its experts from
    group_score: str = "top2_sum"  #: a group's score: sum of its best two ("top2_sum", DeepSeek-V3) or "max" (V2)
    expert_bias: bool = False  #: the aux-loss-free expert bias, added to the scores for the choice only
    bias_update_rate: float = 0.0  #: how far update_expert_biases moves the bias per step (0: kept as it is)
    aux_loss: str = "none"  #: "none", "aux_loss" or "seq_aux_loss"
    aux_loss_coef: float = 0.0  #: the auxiliary loss is multiplied by this

    def __post_init__(self):
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"router score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"router group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.aux_loss not in AUX_LOSSES:
            raise ValueError(f"router aux_loss must be one of {AUX_LOSSES}, got {self.aux_loss!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError(f"router n_group and topk_group go together (got n_group={self.n_group}, "
                             f"topk_group={self.topk_group})")
        if self.n_group is not None and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"router topk_group={self.topk_group} must be within 1..n_group={self.n_group}")
        if self.bias_update_rate < 0 or self.aux_loss_coef < 0:
            raise ValueError(f"router bias_update_rate ({self.bias_update_rate}) and aux_loss_coef "
                             f"({self.aux_loss_coef}) must be >= 0")
        if self.bias_update_rate > 0 and not self.expert_bias:
            raise ValueError(f"router bias_update_rate={self.bias_update_rate} needs expert_bias true")


class Router(nn.Module):
    """``weight [E, M]`` (a bias-free linear map, as the Hugging Face routers keep it) and, with
    ``options.expert_bias``, the buffer ``e_score_correction_bias [E]`` (fp32, kept fp32 when the
    module is cast). ``k``: experts per token."""

    drop_tokens = False  # (read by the reference backend: a router never drops tokens)
    wall_clock_breakdown = False

    def __init__(self, hidden_size: int, num_experts: int, k: int, options: RouterOptions = RouterOptions()):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"router k={k} must be within 1..num_experts={num_experts}")
        if options.n_group is not None:
            if num_experts % options.n_group:
                raise ValueError(f"router n_group={options.n_group} does not divide num_experts={num_experts}")
            per = num_experts // options.n_group
            if options.group_score == "top2_sum" and per < 2:
                raise ValueError(f"router group_score 'top2_sum' needs 2 or more experts per group, got {per}")
            if k > options.topk_group * per:
                raise ValueError(f"router k={k} exceeds the {options.topk_group * per} experts of its "
                                 f"topk_group={options.topk_group} groups")
        self.hidden_size, self.num_experts, self.k, self.options = hidden_size, num_experts, k, options
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        if options.expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("step_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        else:
            self.e_score_correction_bias = None
        #: tokens per sequence of the next forward (set by the block that calls it; seq_aux_loss needs it)
        self.seq_len: Optional[int] = None
        #: the last forward's (expert_idx [T, k], weights [T, k]) where record_choices is set (tests, tools)
        self.record_choices = False
        self.last_choices: Optional[Tuple[Tensor, Tensor]] = None
        self.ep_group = None

    def _apply(self, fn, *args, **kwargs):
        # The bias is an accumulated sum of small steps: it stays fp32 when the module is cast.
        bias = self._buffers.get("e_score_correction_bias")
        out = super()._apply(fn, *args, **kwargs)
        if bias is not None and self._buffers["e_score_correction_bias"].dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.to(self._buffers["e_score_correction_bias"].device)
        return out

    def _set_ep_group(self, ep_group) -> None:
        """DeepSpeed's MOELayer hands its gate the expert-parallel group; a router does not use it."""
        self.ep_group = ep_group

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, k={self.k}, {self.options}"

    # ------------------------------------------------------------------ routing
    def choose(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(scores [T, E] fp32, expert_idx [T, k] int64, weights [T, k] fp32)`` for tokens ``x [T, M]``,
        with the operations of the Hugging Face routers in their order (DeepSeek-V3's where there are
        groups or an expert bias, Mixtral's and Qwen's otherwise)."""
        o = self.options
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if o.score_func == "softmax" else logits.sigmoid()
        bias = self.e_score_correction_bias
        if o.n_group is None and bias is None:
            weights, idx = torch.topk(scores, self.k, dim=-1)
        else:
            choice = scores + bias if bias is not None else scores
            if o.n_group is not None:
                T, E, G = scores.shape[0], self.num_experts, o.n_group
                grouped = choice.view(T, G, E // G)
                group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if o.group_score == "top2_sum" else
                                grouped.max(dim=-1).values)
                group_idx = torch.topk(group_scores, k=o.topk_group, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
                score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
                choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
            idx = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
        if o.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * o.routed_scaling_factor
        return scores, idx, weights

    def route_split(self, x: Tensor, used_token: Optional[Tensor] = None
                    ) -> Tuple[Tensor, Callable[[], Tuple[Tensor, Tensor, Tensor]]]:
        """The hook ``ds_uniep.gating`` calls: ``(expert_idx [T, k] int32, rest)``, ``rest() -> (l_aux,
        weights [T, k] fp32, exp_counts [E])``. ``used_token`` is not read (as DeepSpeed's top-k gate)."""
        scores, idx, weights = self.choose(x)
        if self.record_choices:
            self.last_choices = (idx.detach(), weights.detach())

        def rest():
            counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
            if self.training and self.e_score_correction_bias is not None:
                self.step_counts += counts
            return self._aux_loss(scores, idx, counts), weights, counts.detach()

        return idx.to(torch.int32), rest

    def forward(self, x: Tensor, used_token: Optional[Tensor] = None, sparse_routes: bool = True):
        """DeepSpeed's gate contract with ``sparse_routes=True``: ``(l_aux, None, E, route_idx [k, T] int32,
        None, route_gates [k, T] fp32, exp_counts [E])``."""
        if not sparse_routes:
            raise NotImplementedError("a ds_uniep Router returns sparse routes only; DeepSpeed's own MOELayer "
                                      '("uniep": {"enabled": false}) cannot run it')
        idx, rest = self.route_split(x, used_token)
        l_aux, weights, counts = rest()
        return l_aux, None, self.num_experts, idx.t().contiguous(), None, weights.t().contiguous(), counts

    def _aux_loss(self, scores: Tensor, idx: Tensor, counts: Tensor) -> Tensor:
        """``aux_loss_coef`` times DeepSeek's balance loss: ``sum_e f_e * P_e`` with ``f_e`` the share of
        the ``T * k`` choices that went to expert ``e``, times ``E``, and ``P_e`` the mean score of
        ``e`` (sigmoid scores normalised per token to sum to one); ``seq_aux_loss`` takes both per
        sequence of ``seq_len`` tokens and averages the sequences' losses."""
        o = self.options
        if o.aux_loss == "none" or o.aux_loss_coef == 0 or not self.training:
            return scores.new_zeros(())
        E, k = self.num_experts, self.k
        probs = scores if o.score_func == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        if o.aux_loss == "aux_loss":
            f = counts.to(probs.dtype) * (E / (idx.shape[0] * k))
            return (f * probs.mean(dim=0)).sum() * o.aux_loss_coef
        S = self.seq_len or idx.shape[0]
        if idx.shape[0] % S:
            raise ValueError(f"seq_aux_loss: {idx.shape[0]} tokens are not whole sequences of {S}")
        B = idx.shape[0] // S
        f = torch.zeros(B, E, dtype=probs.dtype, device=probs.device)
        f.scatter_add_(1, idx.reshape(B, S * k), torch.ones(B, S * k, dtype=probs.dtype, device=probs.device))
        f = f * (E / (S * k))
        return (f * probs.view(B, S, E).mean(dim=1)).sum(dim=1).mean() * o.aux_loss_coef

    # ------------------------------------------------------------------ expert bias
    @torch.no_grad()
    def update_bias(self, group=None) -> None:
        """Move the expert bias by ``bias_update_rate`` towards balance from the counts since the last
        update, summed over ``group`` (``torch.distributed``'s default group when None and it runs),
        then start counting again. Experts chosen more than the mean go down, fewer go up
        (``rate * sign(mean - count)``, centred to keep the bias's mean); the same sums and the
        same fp32 steps on every rank, so the bias stays identical on every rank."""
        if self.e_score_correction_bias is None:
            return
        counts = self.step_counts
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=group)
        rate = self.options.bias_update_rate
        if rate > 0:
            c = counts.double()
            delta = torch.sign(c.mean() - c).float() * rate
            self.e_score_correction_bias += delta - delta.mean()
        counts.zero_()


def update_expert_biases(model: nn.Module, group=None) -> int:
    """:meth:`Router.update_bias` for every Router in ``model`` that keeps an expert bias (call it on
    every rank after each optimizer step, ``group``: the ranks that train the model on different data,
    default every rank); returns how many were updated."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.e_score_correction_bias is not None]
    for r in routers:
        r.update_bias(group)
    return len(routers)


class AddAuxLoss(torch.autograd.Function):
    """``x`` unchanged; the backward also hands ``loss`` a gradient of one, so a block's auxiliary
    loss trains without the caller adding it to its loss (DeepSeek's ``AddAuxiliaryLoss``)."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_meta = (loss.dtype, loss.device)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        dtype, device = ctx.loss_meta
        return grad, torch.ones((), dtype=dtype, device=device)
