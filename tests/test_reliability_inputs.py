"""Odd inputs never give a silent wrong row: a NaN or Inf in one token's activations leaves every
other token's output bitwise as it was; a token count, dtype, device or shape the layer cannot take
is an error naming the expected and the given; DeepSpeed's capacity-padded exchange (drop_tokens)
with different token counts per rank is a Python error on every rank, not a gloo abort."""
import types

import pytest
import torch

from dist_utils import run_distributed
from ds_uniep import UniEPMoE
from moe_models import MLP

M, F = 8, 16


def _layer(E, ep_size, k, drop_tokens=False, **kwargs):
    torch.manual_seed(0)
    layer = UniEPMoE(M, MLP(M, F), num_experts=E, ep_size=ep_size, k=k, drop_tokens=drop_tokens,
                     config={"backend": "reference"}, **kwargs)
    return layer


def _forward(layer, x, pin=None):
    """The layer's output for ``x``; ``pin = (t, experts)``: token t's gate logits replaced by ones that
    route it to ``experts`` in that slot order (its value is not changed). The gate's logits are
    caught where they are formed, ``F.linear`` on the gate's weight (DeepSpeed's gate calls it
    directly, not through the ``wg`` module)."""
    import unittest.mock

    linear = torch.nn.functional.linear
    wg = layer.deepspeed_moe.gate.wg.weight

    def pinned(inp, weight, bias=None):
        logits = linear(inp, weight, bias)
        if pin is None or weight.data_ptr() != wg.data_ptr():
            return logits
        t, experts = pin
        logits = logits.clone()
        logits[t] = 0.0
        for j, e in enumerate(experts):
            logits[t, e] = 100.0 - 50.0 * j
        return logits

    torch.manual_seed(3)  # the top-2 gate's sampling of the second expert draws the same noise each time
    with torch.no_grad(), unittest.mock.patch.object(torch.nn.functional, "linear", pinned):
        return layer(x)[0]


def _route_of(layer, x, t):
    """The experts DeepSpeed's gate sends token t of ``x`` to, in slot order (a collective on the
    expert-parallel group for the top-1 gate: every rank calls it)."""
    from ds_uniep import gating
    torch.manual_seed(3)
    with torch.no_grad():
        return gating.route(layer.deepspeed_moe.gate, x)[2][:, t].tolist()


# The run without the poison keeps the poisoned token's route (only its value is clean): a token
# routed elsewhere changes how many rows an expert's GEMM holds, and a GEMM may round a row
# differently with another row count; that is not the poison reaching other tokens.
def _poisoned_token_stays_alone(rank, world_size, t=5):
    E, T = 2 * world_size, 12
    for k in (1, 2):
        layer = _layer(E, world_size, k)
        if world_size > 1:
            layer.set_deepspeed_parallelism()
        x = torch.randn(T, M, generator=torch.Generator().manual_seed(10 + rank))
        for bad in (float("nan"), float("inf"), float("-inf")):
            for poisoned_rank in range(world_size):
                mine = rank == poisoned_rank
                xp = x.clone()
                if mine:
                    xp[t, 3] = bad
                route = _route_of(layer, xp, t)
                out = _forward(layer, xp)
                clean = _forward(layer, x, (t, route) if mine else None)
                assert torch.isfinite(clean).all()
                others = [i for i in range(T) if not mine or i != t]
                changed = [i for i in others if not torch.equal(out[i], clean[i])]
                assert not changed, (f"k={k}: {bad} in token {t} of rank {poisoned_rank} (routed to {route}) "
                                     f"changed rank {rank}'s tokens {changed}")


def test_nan_or_inf_in_one_token_leaves_every_other_token_bitwise():
    run_distributed(_poisoned_token_stays_alone, 2, timeout=120)


def test_nan_or_inf_in_one_token_on_a_single_rank():
    _poisoned_token_stays_alone(0, 1, t=0)


def _ragged_tokens_with_drop_tokens(rank, world_size):
    layer = _layer(4, world_size, 1, drop_tokens=True, min_capacity=1)
    layer.set_deepspeed_parallelism()
    T = 16 if rank == 0 else 32  # capacities 4 and 8
    with pytest.raises(ValueError) as err:
        layer(torch.randn(T, M))
    msg = str(err.value)
    assert "with drop_tokens=True the reference backend exchanges capacity-padded buffers" in msg, msg
    assert "needs the same token count on every rank" in msg and "[16, 32] tokens (capacities [4, 8])" in msg, msg
    # Every rank raised alike, after one all-gather: the group is in step, the next forward works.
    out, _, _ = layer(torch.randn(16, M))
    assert out.shape == (16, M)


def test_drop_tokens_with_different_token_counts_is_a_python_error_on_every_rank():
    run_distributed(_ragged_tokens_with_drop_tokens, 2, timeout=120)


def test_input_dtype_must_match_the_experts_outside_autocast():
    layer = _layer(4, 1, 2)
    with pytest.raises(ValueError, match=r"input dtype torch.bfloat16 does not match the experts' parameters' "
                       r"torch.float32; cast one to the other \(or run under torch.autocast\)"):
        layer(torch.randn(5, M, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _, _ = layer(torch.randn(5, M, dtype=torch.bfloat16))
    assert out.shape == (5, M)


def test_input_device_must_match_the_experts():
    layer = _layer(4, 1, 2)
    with pytest.raises(ValueError, match=r"input on meta, the experts' parameters on cpu; move one to the other's"):
        layer(torch.empty(5, M, device="meta"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"input on cuda:0, the experts' parameters on cpu"):
            layer(torch.randn(5, M, device="cuda"))


def test_wrong_hidden_size_names_both():
    with pytest.raises(ValueError, match=r"input hidden size 6 does not match hidden_size=8 "
                       r"\(input shape \(2, 3, 6\)\)"):
        _layer(4, 1, 2)(torch.randn(2, 3, 6))


def test_tokens_over_max_tokens_per_rank():
    # The reference backend has no buffers to size: it runs any token count.
    layer = UniEPMoE(M, MLP(M, F), num_experts=4, k=2, config={"backend": "reference", "max_tokens_per_rank": 4})
    assert layer(torch.randn(9, M))[0].shape == (9, M)
    # The megakernel's check (its buffers are sized for max_tokens_per_rank) says what to set.
    from ds_uniep.megakernel import NVLinkDispatcher, UniEPCapacityError
    d = types.SimpleNamespace(layer_name="UniEPMoE[7]", rank=1, max_tokens=4, k=2)
    with pytest.raises(UniEPCapacityError, match=r'UniEPMoE\[7\]: rank 1 got 9 tokens but its symmetric buffers were '
                       r'sized for max_tokens_per_rank = 4; set "uniep": \{"max_tokens_per_rank": 9\} or more'):
        NVLinkDispatcher._check_tokens(d, 9, 2)
    NVLinkDispatcher._check_tokens(d, 4, 2)
