"""Rows of ``bench_moe_layer.py`` that stand apart from its timing loop: DeepSpeed's AutoEP layer built
from the benchmark's stock layer (``build_autoep``), the sync-free layer replayed from a CUDA graph
(``GraphedLayer``), and the fixed plans and summary of ``--autotune``."""

import copy
import math

import torch

AUTOEP_NOTE = (
    "AutoEPMoELayer (DeepSpeed's AutoEP) built standalone from a Mixtral-style block (gate + ModuleList of "
    "w1/w2/w3 experts, spec from AutoEP's 'mixtral' preset: softmax scores, weights applied after the experts) "
    "with the stock layer's gate weight and this rank's experts; AutoEPConfig defaults otherwise "
    "(comm_backend 'comm': NCCL all_to_all_single for dispatch and combine, split sizes from one count "
    "all-to-all and a host sync; use_grouped_mm: torch._grouped_mm, or DeepSpeed's Triton grouped GEMM where "
    "its accelerator prefers it (below sm90); async_split_plan off; load_balance_coeff None). Routing as "
    "stock: fp32 gate logits (its router's gate is kept fp32 and fed fp32 input; in a bf16 model AutoEP "
    "would compute them in bf16), fp32 softmax, top-k, weights renormalised over the k (route_norm on for "
    "k > 1, off for k = 1, as stock's top-1 gate does not renormalise; AutoEP adds 1e-20 to the sum where "
    "stock clamps it at eps). Differences: no auxiliary loss (the row's backward has no l_aux term; stock's "
    "and ds_uniep's add one), expert-output weighting and top-k sum in fp32 then one rounding to bf16.")


class _MixtralStyleBlock(torch.nn.Module):
    """What AutoEP's spec below reads: ``gate`` (nn.Linear [E, M]) and ``experts`` (one module per global expert
    with ``w1``/``w3`` [F, M] and ``w2`` [M, F] nn.Linear, as legacy Hugging Face Mixtral)."""

    def __init__(self, gate, experts):
        super().__init__()
        self.gate = gate
        self.experts = experts


def _meta_swiglu(M, F):
    """A SwiGLU expert's ``w1``/``w3``/``w2`` with no storage (shapes only)."""
    expert = torch.nn.Module()
    with torch.device("meta"):
        expert.w1 = torch.nn.Linear(M, F, bias=False)
        expert.w3 = torch.nn.Linear(M, F, bias=False)
        expert.w2 = torch.nn.Linear(F, M, bias=False)
    return expert


class AutoEPRow(torch.nn.Module):
    """AutoEP's layer behind the benchmark's calling convention: ``[T, M] -> (out [T, M], None, None)``
    (AutoEP takes ``[B, S, M]`` and has no auxiliary loss)."""

    def __init__(self, layer):
        super().__init__()
        self.autoep = layer

    def forward(self, x):
        return self.autoep(x.unsqueeze(0)).squeeze(0), None, None


def build_autoep(proto, ep, device, dtype, use_grouped_mm=True, comm_backend="comm"):
    """DeepSpeed's ``AutoEPMoELayer`` with ``proto``'s gate weight and experts (``proto``: a stock
    ``deepspeed.moe.layer.MoE`` with SwiGLU experts ``w1``/``w3``/``w2``, this rank's experts local).

    The experts are ``dtype`` on ``device``, the gate stays fp32 and sees fp32 input (as DeepSpeed's TopKGate
    computes it). Every rank must call this (it binds DeepSpeed's ``ep_size_{ep}`` group, the one the stock
    layer uses). Raises if this DeepSpeed has no AutoEP or the layer cannot be built here."""
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig, MoELayerSpec
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    moe = proto.deepspeed_moe
    wg = moe.gate.wg.weight  # [E, M]
    E, M = wg.shape
    k = moe.gate.k
    local = list(moe.experts.deepspeed_experts)
    L = len(local)
    if E != L * ep:
        raise ValueError(f"build_autoep: {E} experts is not {L} local experts x ep {ep}")
    if not all(isinstance(getattr(x, w, None), torch.nn.Linear) and getattr(x, w).bias is None
               for x in local for w in ("w1", "w2", "w3")):
        raise TypeError("build_autoep: the experts must be SwiGLU experts with bias-free nn.Linear w1, w3 [F, M], "
                        "w2 [M, F]")
    F = local[0].w1.weight.shape[0]
    # DeepSpeed's expert groups are runs of ep consecutive ranks; AutoEP owns experts [r*L, (r+1)*L) on ep
    # rank r, as stock DeepSpeed does.
    ep_rank = torch.distributed.get_rank() % ep
    preset = PRESET_MODELS["mixtral"]
    spec = MoELayerSpec(
        moe_module_name="bench_moe_layer", model_family="mixtral", router_name=preset.router_pattern,
        experts_name=preset.experts_pattern, expert_storage="module_list", expert_w1_name="w1", expert_w2_name="w2",
        expert_w3_name="w3", num_experts=E, top_k=k, hidden_size=M, ffn_hidden_size=F, score_func=preset.score_func,
        score_apply=preset.score_apply, route_norm=preset.route_norm, gate_bias=False, return_router_logits=False,
        router_logits_capture_target="none", router_logits_capture_index=None, router_logits_capture_layer_name=None,
        has_shared_experts=False, shared_experts_name="", expert_activation="swiglu")
    if spec.score_func != "softmax" or spec.score_apply != "post":
        raise RuntimeError(f"AutoEP's mixtral preset changed (score_func {spec.score_func!r}, score_apply "
                           f"{spec.score_apply!r}): its routing would no longer match stock DeepSpeed's")
    config = AutoEPConfig(enabled=True, autoep_size=ep, preset_model="mixtral", use_grouped_mm=use_grouped_mm,
                          route_norm=k > 1, load_balance_coeff=None, comm_backend=comm_backend)
    gate = torch.nn.Linear(M, E, bias=False, device=device, dtype=torch.float32)
    experts = torch.nn.ModuleList()
    with torch.no_grad():
        gate.weight.copy_(wg)
        for e in range(E):
            r, j = divmod(e, L)
            if r == ep_rank:
                experts.append(copy.deepcopy(local[j]).to(device=device, dtype=dtype))
            else:  # another rank's expert: AutoEP reads only this rank's, so it takes no memory
                experts.append(_meta_swiglu(M, F))
    layer = AutoEPMoELayer(spec, _MixtralStyleBlock(gate, experts), ep_size=ep, ep_rank=ep_rank, config=config)
    layer.set_deepspeed_parallelism()
    got = torch.distributed.get_rank(group=layer.ep_group)
    if got != ep_rank:
        raise RuntimeError(f"AutoEP's ep group puts this rank at {got}, not {ep_rank}: its experts would differ")
    if layer.router.gate.weight.dtype != torch.float32:
        raise RuntimeError(f"AutoEP's router gate came out {layer.router.gate.weight.dtype}, not fp32")
    if dtype != torch.float32:
        layer.router.gate.register_forward_pre_hook(lambda _, args: (args[0].float(), ))
    return AutoEPRow(layer)


def fixed_plans(space):
    """Every single fixed plan a user can set without tuning: the config default and every plan of the
    megakernel's space (each knob it acts on: schedule, chunks, SMs, the combine's chunks and queue, ...),
    named by their labels. The config default leaves num_comm_sms unset, which runs the copy kernels on
    every SM: its plan says so (it is also timed under its own label, a measure of the noise)."""
    from ds_uniep.config import UniEPConfig
    default = space.layer_default(UniEPConfig())
    plans = {f"config default ({default.label()})": default}
    for plan in space.enumerate():
        plans[plan.label()] = plan
    return plans


def fixed_plan_order(plans, records):
    """The names of ``plans`` (:func:`fixed_plans`) in the order to time them: the config default first,
    then the plans the tuner's search timed, fastest first by its time (confirmed where confirmed,
    else its median; a pruned plan's probe median), then the others in their order in ``plans``."""
    ms = {r.plan: r.ms for r in records if r.status in ("measured", "pruned") and r.ms is not None}
    names = list(plans)
    default, rest = names[0], names[1:]
    timed = sorted((n for n in rest if plans[n] in ms), key=lambda n: ms[plans[n]])  # stable: ties keep order
    return [default] + timed + [n for n in rest if plans[n] not in ms]


def summarize_autotune(auto, modes):
    """Per mode and timing (launched: ``*_ms``; streamed, with ``--streamed-steps``: ``*_streamed_ms``),
    the single fixed plan with the smallest geometric mean time over the shapes, and per shape the
    tuned time against it (speedup = best single fixed ms / tuned ms; >= 1 means tuning paid), and
    against the config default's."""
    rows = [r for r in auto["rows"] if "modes" in r]
    auto["best_single_fixed"] = {}
    for mode in modes:
        for t in ("", "_streamed"):
            if not rows or any(f"fixed{t}_ms" not in r["modes"][mode] for r in rows):
                continue
            fixed = [r["modes"][mode][f"fixed{t}_ms"] for r in rows]
            names = sorted(set.intersection(*(set(f) for f in fixed)))
            geo = {n: math.exp(sum(math.log(f[n]) for f in fixed) / len(rows)) for n in names}
            best = min(names, key=lambda n: geo[n])
            auto["best_single_fixed"][mode + t] = {"plan": best, "geomean_ms": geo}
            for r, f in zip(rows, fixed):
                m, tuned = r["modes"][mode], r["modes"][mode][f"tuned{t}_ms"]
                default = next(n for n in f if n.startswith("config default"))
                m.update({f"best_single_fixed{t}": best, f"best_single_fixed{t}_ms": f[best],
                          f"speedup{t}_vs_best_single_fixed": f[best] / tuned,
                          f"fastest_fixed{t}_here": min(f, key=f.get), f"config_default{t}_ms": f[default],
                          f"speedup{t}_vs_config_default": f[default] / tuned})


def print_autotune(auto):
    print(f"\nautotune (megakernel, tuned on fwd+bwd, budget {auto['budget_s']:g} s per shape); speedup = best "
          "single fixed plan ms / tuned ms")
    head = ["shape", "mode", "tuned plan", "tuned", "best single fixed", "its ms", "speedup", "config default ms",
            "vs default", "fastest fixed here", "tuning s"]
    print(" | ".join(head))
    for r in auto["rows"]:
        if "modes" not in r:
            print(f"{r['shape']} | {r['skipped']}")
            continue
        for mode, m in r["modes"].items():
            for t in ("", "_streamed"):
                if f"speedup{t}_vs_config_default" not in m:
                    continue
                here = m[f"fastest_fixed{t}_here"]
                print(" | ".join([r["shape"], mode + (" streamed" if t else ""),
                                  r["tuned_label"] + (" (cache)" if r["from_cache"] else ""),
                                  f"{m[f'tuned{t}_ms']:.2f}", m[f"best_single_fixed{t}"],
                                  f"{m[f'best_single_fixed{t}_ms']:.2f}",
                                  f"{m[f'speedup{t}_vs_best_single_fixed']:.3f}x", f"{m[f'config_default{t}_ms']:.2f}",
                                  f"{m[f'speedup{t}_vs_config_default']:.3f}x", f"{here} {m[f'fixed{t}_ms'][here]:.2f}"
                                  + (f" (of {len(m[f'fixed{t}_ms'])} timed)" if r.get("fixed_not_timed") else ""),
                                  f"{r['tune_wall_s']:.1f}"]))


class GraphedLayer:
    """A sync-free layer's step captured in a CUDA graph per (input shape, mode) and replayed: the input
    and the output gradient are copied into the graph's own tensors first. The captured backward writes
    fresh gradients at each replay, as a step after ``zero_grad(set_to_none=True)``."""

    def __init__(self, layer):
        self.layer, self.graphs = layer, {}

    def zero_grad(self, set_to_none=True):
        pass

    def step(self, x, g, mode):
        key = (tuple(x.shape), mode)
        if key not in self.graphs:
            self.graphs[key] = self._capture(x, g, mode)
        static_x, static_g, graph = self.graphs[key]
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()

    def _capture(self, x, g, mode):
        static_x, static_g = x.detach().clone().requires_grad_(mode == "fwdbwd"), g.clone()

        def run():
            out, l_aux, _ = self.layer(static_x)
            if mode == "fwdbwd":
                torch.autograd.backward([out, l_aux], [static_g, torch.ones_like(l_aux)])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: caches and workspaces made outside the graph
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        self.layer.zero_grad(set_to_none=True)
        static_x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # where the warm-up made the gate's gradient accumulator
            run()
        return static_x, static_g, graph
