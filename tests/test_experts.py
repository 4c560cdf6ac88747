"""The grouped-GEMM expert runner computes what the per-expert loop computes."""
import pytest
import torch

from ds_uniep.experts import GeLUExpert, SwiGLUExpert, _grouped_ok, run_experts
from moe_models import expert_layouts


@pytest.mark.parametrize("kind", [SwiGLUExpert, GeLUExpert])
def test_grouped_matches_loop_forward_and_backward(kind):
    torch.manual_seed(0)
    M, F = 32, 48
    experts = [kind(M, F).to(torch.bfloat16) for _ in range(4)]
    counts = torch.tensor([5, 0, 19, 1])  # an expert with no rows, one with a single row
    x = torch.randn(int(counts.sum()), M, dtype=torch.bfloat16)
    assert _grouped_ok(experts, x)
    results = []
    for grouped in (True, False):
        for e in experts:
            e.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = run_experts(experts, xi, counts, grouped=grouped)
        (y.float() * torch.linspace(-1, 1, M)).sum().backward()
        results.append([y.detach().float(), xi.grad.float()] + [p.grad.float() for e in experts
                                                                 for p in e.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert results[0][0].abs().sum() > 0


def test_unrecognised_or_fp32_experts_take_the_loop():
    assert not _grouped_ok([torch.nn.Linear(8, 8)], torch.randn(2, 8, dtype=torch.bfloat16))
    assert not _grouped_ok([SwiGLUExpert(8, 8)], torch.randn(2, 8))


def test_a_dropped_expert_bias_is_announced():
    from moe_models import BiasTupleMLP
    experts = [BiasTupleMLP(8, 8)]
    with pytest.warns(UserWarning, match=r"returned \(out, bias\): the bias is not added"):
        y = run_experts(experts, torch.randn(3, 8), torch.tensor([3]))
    assert y.shape == (3, 8)


@pytest.mark.parametrize("kind", [SwiGLUExpert, GeLUExpert])
def test_stacked_weights_are_views_of_packed_or_flattened_parameters(kind):
    from ds_uniep.experts import stack_experts
    M, F, L = 16, 24, 3
    layouts = expert_layouts(kind, M, F, L)
    for layout, experts in layouts.items():
        st = stack_experts(experts, torch.bfloat16, torch.device("cpu"))
        first = {n: p for n, p in experts[0].named_parameters()}
        assert ("w13" in st.weights) == (kind is SwiGLUExpert)
        for gemm, w in st.weights.items():
            proj = {"w13": "w1"}.get(gemm, gemm)
            shares = w.untyped_storage().data_ptr() == first[f"{proj}.weight"].untyped_storage().data_ptr()
            assert shares == (layout != "separate"), f"{layout} {gemm}: view {shares}"
            # group l of the stacked weight is expert l's projection(s), rows in order
            for l, e in enumerate(experts):
                want = torch.cat([e.w1.weight, e.w3.weight]) if gemm == "w13" else getattr(e, gemm).weight
                assert torch.equal(w[l], want), f"{layout} {gemm} group {l}"


@pytest.mark.parametrize("kind", [SwiGLUExpert, GeLUExpert])
def test_grouped_experts_give_the_same_bits_in_every_parameter_layout(kind):
    M, F, L = 16, 24, 3
    counts = torch.tensor([4, 0, 9])
    x = torch.randn(int(counts.sum()), M, dtype=torch.bfloat16)
    g = torch.randn(int(counts.sum()), M, dtype=torch.bfloat16)
    results = {}
    layouts = list(expert_layouts(kind, M, F, L).items())
    for layout, experts in layouts:
        for step in range(2):  # the second step accumulates into the first step's gradients
            xi = x.clone().requires_grad_(True)
            y = run_experts(experts, xi, counts)
            y.backward(g)
        results[layout] = [y, xi.grad] + [p.grad for e in experts for p in e.parameters()]
        assert all(t is not None for t in results[layout])
    for layout, _ in layouts[1:]:
        for i, (a, b) in enumerate(zip(results["packed"], results[layout])):
            assert torch.equal(a, b), f"{layout}: tensor {i} differs from the packed layout"
    # and the loop over the modules agrees to bf16 tolerance
    experts = expert_layouts(kind, M, F, L)["separate"]
    xi = x.clone().requires_grad_(True)
    y = run_experts(experts, xi, counts, grouped=False)
    torch.testing.assert_close(y.float(), results["packed"][0].float(), rtol=2e-2, atol=2e-2)


def test_the_layer_packs_its_experts_after_to():
    from ds_uniep import UniEPMoE
    from ds_uniep.experts import stack_experts
    layer = UniEPMoE(16, SwiGLUExpert(16, 24), num_experts=4, ep_size=1, k=2, config={"backend": "reference"})
    layer = layer.to(torch.bfloat16)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    st = stack_experts(experts, torch.bfloat16, torch.device("cpu"))
    assert st.weights["w13"].untyped_storage().data_ptr() == experts[0].w1.weight.untyped_storage().data_ptr()
    assert st.weights["w13"].is_contiguous() and st.weights["w2"].is_contiguous()
    names = [n for n, _ in layer.named_parameters()]
    assert len(names) == len(set(names)) and any("deepspeed_experts.3.w2.weight" in n for n in names)


def test_the_stacking_cache_follows_the_parameters():
    from ds_uniep.experts import pack_experts, stack_experts
    experts = expert_layouts(SwiGLUExpert, 16, 24, 3)["packed"]
    cache, cpu = {}, torch.device("cpu")

    def check(view):
        st = stack_experts(experts, torch.bfloat16, cpu, cache=cache)
        for l, e in enumerate(experts):
            assert torch.equal(st.weights["w13"][l], torch.cat([e.w1.weight, e.w3.weight]))
            assert torch.equal(st.weights["w2"][l], e.w2.weight)
        shares = st.weights["w13"].untyped_storage().data_ptr() == experts[0].w1.weight.untyped_storage().data_ptr()
        assert shares == view
    check(True)
    check(True)  # from the cache
    assert len(cache) == 1
    pack_experts(experts)  # new storage
    check(True)
    assert len(cache) == 2
    experts[1].w3.weight.data = experts[1].w3.weight.detach().clone()  # one parameter moved out
    check(False)
    with torch.no_grad():
        experts[2].w2.weight.add_(1.0)  # values change in place: the same plan, the new values
    check(False)
    assert len(cache) == 3
    assert stack_experts([torch.nn.Linear(8, 8)], torch.bfloat16, cpu, cache=cache) is None


def test_parameters_zero3_partitions_are_not_packed():
    from ds_uniep.experts import pack_experts
    experts = [SwiGLUExpert(16, 24) for _ in range(2)]
    experts[1].w2.weight.ds_id = 7  # as deepspeed.zero.Init marks the parameters it partitions
    before = [p.data_ptr() for e in experts for p in e.parameters()]
    assert not pack_experts(experts)
    assert [p.data_ptr() for e in experts for p in e.parameters()] == before
    assert pack_experts([SwiGLUExpert(16, 24) for _ in range(2)])


@pytest.mark.parametrize("kind", [SwiGLUExpert, GeLUExpert])
def test_parameters_get_their_gradients_right_after_their_gemm(kind):
    """Stacked before the rows exist (as the layer stacks them), the experts' parameters still get
    their gradients as soon as their GEMM's backward has run: the stacking's autograd node is made
    where the GEMM reads the weights, so the backward reaches it before the work that made the rows
    (here a multiplication after the stacking; in the layer the dispatch's backward and the gate's),
    not after. Checked by the order in which gradients land, and the values against eager stacks."""
    from ds_uniep.experts import pack_experts, run_grouped, stack_experts
    torch.manual_seed(1)
    M, F = 16, 32
    experts = [kind(M, F).to(torch.bfloat16) for _ in range(3)]
    assert pack_experts(experts)
    counts = torch.tensor([4, 0, 7])
    x0 = torch.randn(int(counts.sum()), M, dtype=torch.bfloat16, requires_grad=True)
    landed = []
    names = {p: f"expert {i} {n}" for i, e in enumerate(experts) for n, p in e.named_parameters()}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: landed.append(names[p])) for p in names]
    hooks.append(x0.register_post_accumulate_grad_hook(lambda t: landed.append("rows")))
    try:
        stacked = stack_experts(experts, torch.bfloat16, torch.device("cpu"))
        rows = x0 * 2  # made after the stacking, as the layer's dispatch is
        y = run_grouped(experts, rows, counts, stacked=stacked)
        (y.float() * torch.linspace(-1, 1, M)).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert sorted(landed[:-1]) == sorted(names.values()) and landed[-1] == "rows", landed
    # the last projection's parameters first (its GEMM's backward runs first), then the first one's
    last = {"w2"} if kind is SwiGLUExpert else {"fc2"}
    order = [n.split()[-1].split(".")[0] in last for n in landed[:-1]]
    assert order == sorted(order, reverse=True), landed
    got = [x0.grad.clone()] + [p.grad.clone() for p in names]
    # the same values as with every stack built (and its node made) before the rows
    x0.grad = None
    for p in names:
        p.grad = None
    stacked = stack_experts(experts, torch.bfloat16, torch.device("cpu"))
    eager = {g: stacked.weights[g] for g in stacked.weights}
    assert all(stacked.weights[g] is eager[g] for g in eager)
    y = run_grouped(experts, x0 * 2, counts, stacked=stacked)
    (y.float() * torch.linspace(-1, 1, M)).sum().backward()
    for a, b in zip(got, [x0.grad] + [p.grad for p in names]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [SwiGLUExpert, GeLUExpert])
def test_a_detached_operand_is_a_view_without_a_node_or_the_one_copy(kind):
    """``weights.detached``: where the parameters lie as one view, that view without an autograd node
    (the GEMM makes the node later); where the stack is a copy, that copy is made once, node and all,
    and the GEMM reads the same one. Values equal to the stacked weight's either way."""
    from ds_uniep.experts import stack_experts
    first = "w13" if kind is SwiGLUExpert else "fc1"
    for layout, experts in expert_layouts(kind, 16, 24, 3).items():
        st = stack_experts(experts, torch.bfloat16, torch.device("cpu"))
        d = st.weights.detached(first)
        assert d.grad_fn is None and not d.requires_grad, layout
        w = st.weights[first]
        assert w.grad_fn is not None and torch.equal(d, w), layout
        copied = layout == "separate"
        assert d.untyped_storage().data_ptr() == w.untyped_storage().data_ptr(), f"{layout}: two copies"
        proj = getattr(experts[0], "w1" if kind is SwiGLUExpert else "fc1")
        shares = d.untyped_storage().data_ptr() == proj.weight.untyped_storage().data_ptr()
        assert shares != copied, f"{layout}: the detached operand shares the parameters' storage: {shares}"
