"""HybridEP against plain EP over slow links between sites, and both against the cost model.

    torchrun --nproc_per_node 4 benchmarks/bench_hybrid.py --inter-bw 2GB/s --out bench_out/hybrid
    torchrun --nproc_per_node 4 benchmarks/bench_hybrid.py --device cpu --quick --out /tmp/bh   # gloo, tiny

Sites: the G ranks form sites of ``--site-size`` consecutive ranks (default 2; on 4 GPUs, two
sites of two GPUs). Ranks of one site talk over the fast backend (NVLink through NCCL). Every
byte between sites goes through :class:`ds_uniep.hybrid.pacing.InterSitePacing` at
``--inter-bw``: NCCL still moves it, and the rank's link is busy for (bytes to or from other
sites) / bandwidth (``--hold host``: the host waits for the collective, then sleeps; ``--hold
stream``: a spin queued on a stream). The layers send through it themselves
(``UniEPMoE.set_inter_site_pacing``): plain EP's and HybridEP's token all-to-alls hold the rank
after the collective; HybridEP's expert gather (issued before the router) and gradient return
(issued after the expert backward) occupy the link in the background, and the rank waits for
what is left of them only when the experts need the replicas and at the end of the backward.
Every option pays the same time per inter-site byte.

Sweep: T tokens per rank x expert size M x F (``--experts MxF ...``), SwiGLU experts, E
experts, top-k, dropless, bf16 on GPU (fp32 on CPU). Options at each point, each timed
forward+backward (input gradient included; CUDA events, or wall clock on CPU; warm-up, median,
slowest rank):

- ``EP``: ``UniEPMoE`` on the reference backend, no HybridEP;
- ``S=<n>``: HybridEP at every domain size n > 1 the runtime accepts (whole domains migrated);
- ``S=<n> m=<j>`` (with ``--fractions``): the same with j of each rank's experts migrated (its
  first j), and ``S=<n> m=<j> hot`` (with ``--hottest`` too) the j that keep the most tokens local
  (``"migrated_experts": "hottest"``; chosen from the forwards before, so their checked run
  follows one forward+backward that chooses);
- ``S=<n> c=<r>`` (with ``--compressions``): every expert migrated, compressed at ratio r;
- the planner: ``choose_domain_size``, the function ``"domain_size": "auto"`` runs, fed with the
  bandwidths measured here. Where it keeps plain EP a layer built with ``"domain_size": "auto"``
  is timed as well, in alternation with plain EP (what choosing costs); elsewhere its time is
  that of the chosen S;
- with ``--replan``: a layer with ``"domain_size"`` and ``"migrated_fraction"`` auto and
  ``"replan_after_steps": 1``, timed after one forward+backward, an optimizer step and the
  forward+backward that plans again for the routing it saw (checked against plain EP): what the
  runtime chooses by itself (``replanned``: its start-up and new plans, ms, against the best option).

Cost model inputs (:mod:`ds_uniep.hybrid.model`), all measured in this run, at every point:

- B_f, B_s: ``measure_bandwidths`` (ring exchanges inside a site and between sites, through the
  same pacing);
- t_exp: the experts' forward alone (``run_experts`` over the point's rows, all E experts);
- t_pre: the rest of the layer's forward compute: the same layer at ep 1 (all experts local, no
  communication) minus t_exp; c_b: that layer's backward over its forward;
- D = T * k * M * bytes, P = one expert's bytes, E_r = E / G, ``--microbatches`` micro-batches
  per step (default 1: the runtime gathers replicas at every forward; more: every option is timed
  over whole steps, HybridEP with ``"reuse_replicas"`` and the step's last micro-batch marked by
  ``UniEPMoE.set_accumulation_boundary``, so one gather and one gradient return per step, and
  times are per micro-batch);
- the routing: the ``[G, E]`` token copies every rank's gate sends every expert (``load``, the
  mean over the two timed inputs). The prediction checked is
  :func:`~ds_uniep.hybrid.model.predict_routed` with that load and each option's migrated
  experts (the busiest rank's link bytes and rows); ``predicted_uniform_ms`` is
  :func:`~ds_uniep.hybrid.model.predict`'s, which assumes every rank sends every expert alike.
  The model's inter-site bytes are those of the checked run's input and migrated experts.
  The model's planner is fed with the same load and chooses among whole domains and, with
  ``--hottest``, the timed hottest partial migrations.

Reported per point: measured and predicted ms per option (ratio, within 15%?), inter-site
bytes per forward+backward as paced against the model's, the paced collectives per
forward+backward (``inter_transfers_measured``), the planner's choice against the
best measured option (within 5%?), the best HybridEP's speedup over EP, the overhead of the
``"auto"`` layer where the planner keeps EP, and HybridEP's output and input-gradient error
against EP. A short table is printed last; everything goes to ``--out/bench_hybrid.json`` and
the plot to ``--out/bench_hybrid.png``.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing.py, hybrid_report.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ds_uniep from a checkout

from hybrid_report import print_table, summarize, write  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}
"""Largest relative error (norm) of HybridEP's output and input gradient against plain EP's."""

# Sized for 4 GPUs of one host at 2 GB/s between sites.
DEFAULTS = {
    "cuda": {"tokens": [1024, 2048, 4096, 8192, 16384], "experts": ["2048x768", "2048x1408", "4096x2048"],
             "inter_bw": "2GB/s", "dtype": "bf16", "warmup": 2, "repeats": 8, "probe_bytes": 32 << 20},
    "cpu": {"tokens": [64, 256, 1024], "experts": ["32x32", "32x128"], "inter_bw": "5MB/s", "dtype": "fp32",
            "warmup": 1, "repeats": 3, "probe_bytes": 256 << 10},
}
QUICK = {"cuda": {"tokens": [1024, 8192], "experts": ["2048x768"], "warmup": 1, "repeats": 3},
         "cpu": {"tokens": [64, 1024], "experts": ["32x32", "32x128"], "warmup": 1, "repeats": 2}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (NCCL) where available, else cpu (gloo)")
    p.add_argument("--site-size", type=int, default=2, help="L: consecutive ranks joined by the fast links")
    p.add_argument("--inter-bw", default=None, help="bandwidth between sites per rank and direction, e.g. 2GB/s, "
                   "16Gbps (GPU default 2GB/s, CPU 5MB/s)")
    p.add_argument("--hold", choices=["host", "stream"], default="host",
                   help="how a GPU rank is held for the inter-site bytes (see InterSitePacing)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T tokens per rank")
    p.add_argument("--experts", nargs="+", default=None, help="expert sizes MxF (hidden x FFN width)")
    p.add_argument("--num-experts", type=int, default=8, help="E")
    p.add_argument("--top-k", type=int, default=2, help="k")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bf16 on GPU, fp32 on CPU by default")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--probe-bytes", type=int, default=None, help="bytes of each bandwidth probe exchange")
    p.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches per optimizer step: every option is timed over whole steps of this many "
                   "forward+backward passes (per micro-batch reported), HybridEP with \"reuse_replicas\" (one gather "
                   "and one gradient return per step), against the model at this M")
    p.add_argument("--fractions", type=float, nargs="+", default=[],
                   help="migrated fractions in (0, 1) timed besides whole-domain migration at every domain size "
                   "(\"migrated_fraction\": each rank migrates its first round(f L) experts, "
                   "\"migrated_experts\": \"first\"); options S=n m=j")
    p.add_argument("--compressions", type=float, nargs="+", default=[],
                   help="compression ratios in (0, 1] timed besides dense migration at every domain size (every "
                   "expert migrated, \"compression\": {\"ratio\": r}: a shared base plus each expert's top-r "
                   "residual positions; lossy below 1, so their errors are reported, not checked); options S=n c=r")
    p.add_argument("--hottest", action="store_true",
                   help="with --fractions: also time each partial option migrating the experts that keep the most "
                   "tokens local (\"migrated_experts\": \"hottest\"); options S=n m=j hot")
    p.add_argument("--skew", type=float, default=0.0,
                   help="routing skew a >= 0: every token gets a constant first feature and expert e's gate weight on "
                   "it is a * z_e (z standard normal, the same on every rank), so some experts draw more tokens "
                   "(default 0: none)")
    p.add_argument("--replan", action="store_true",
                   help="also time a layer built with domain_size and migrated_fraction auto and "
                   "\"replan_after_steps\": 1, after one forward+backward and an optimizer step (so it has planned "
                   "again for the routing it saw): what the runtime chooses by itself")
    p.add_argument("--replan-compute", choices=("measure", "estimate"), default="measure",
                   help="with --replan: the compute times the layer plans again with (its \"replan_compute\"; "
                   "default measure: its experts' forward timed at the replan)")
    p.add_argument("--quick", action="store_true", help="a short sweep (GPU: 2 points; CPU: 4 tiny points)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default="bench_out/hybrid", help="directory for bench_hybrid.json and .png")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    fill = dict(DEFAULTS[args.device])
    if args.quick:
        fill.update(QUICK[args.device])
    for key, value in fill.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.microbatches < 1:
        p.error(f"--microbatches: must be a positive integer, got {args.microbatches}")
    if any(not 0 < f < 1 for f in args.fractions):
        p.error(f"--fractions: every fraction must be in (0, 1) (1, whole domains, is always timed), "
                f"got {args.fractions}")
    if args.hottest and not args.fractions:
        p.error("--hottest: needs --fractions (it chooses which of a rank's experts migrate when only some do)")
    if args.replan and args.microbatches > 1:
        p.error("--replan: times the replanned layer one micro-batch per step; use --microbatches 1")
    if args.hottest and args.microbatches > 1:
        p.error("--hottest: the choice is made again only after an optimizer step with reused replicas, and the "
                "timed steps take none; use --microbatches 1")
    if not args.skew >= 0:
        p.error(f"--skew: must be >= 0, got {args.skew}")
    if any(not 0 < r <= 1 for r in args.compressions):
        p.error(f"--compressions: every ratio must be in (0, 1], got {args.compressions}")
    args.expert_sizes = [parse_expert(s) for s in args.experts]
    return args


def parse_expert(text):
    """``"2048x1408"`` -> (M, F)."""
    m, sep, f = text.lower().partition("x")
    if not sep or not m.isdigit() or not f.isdigit() or int(m) < 1 or int(f) < 1:
        raise SystemExit(f"--experts {text!r}: expected MxF, e.g. 2048x1408")
    return int(m), int(f)


# --------------------------------------------------------------------------- helpers
def slowest(value, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fwd_bwd(layer):
    def run(x, gy):
        out, l_aux, _ = layer(x)
        torch.autograd.backward([out, l_aux], [gy, torch.ones_like(l_aux)])
        return out
    return run


LAST_MICROBATCH = [True]
"""Whether the micro-batch running now is its step's last (the layers' accumulation boundary)."""


def step(layer, micro):
    """One optimizer step's ``micro`` forward+backward passes (the weights do not change, but the kept
    replicas are dropped first, as a step's update would; the last pass returns the replica
    gradients). ``micro`` 1: one pass."""
    run = fwd_bwd(layer)
    if micro == 1:
        return run

    def fn(x, gy):
        layer.refresh_replicas()
        for i in range(micro):
            LAST_MICROBATCH[0] = i == micro - 1
            out = run(x, gy)
        return out
    return fn


class Timer:
    """Median of ``repeats`` runs after ``warmup``, the slowest rank's, in ms; grads cleared between runs."""

    def __init__(self, args, device):
        self.args, self.device = args, device

    @staticmethod
    def _sync(pool, modules):
        """Between runs: no gradient left on the modules or the pooled inputs, all ranks together."""
        def sync():
            for m in modules:
                m.zero_grad(set_to_none=True)
            for i in range(2):
                pool(i)[0].grad = None
            dist.barrier()
        return sync

    def __call__(self, fn, pool, modules=()):
        from timing import bench

        sync = self._sync(pool, modules)
        r = bench(fn, warmup=self.args.warmup, repeats=self.args.repeats, setup=pool, sync=sync,
                  cuda=self.device.type == "cuda")
        return slowest(r["median_ms"], self.device)

    def paired(self, fns, pool, modules=(), min_rounds=10):
        """``{name: ms}`` for functions timed in alternation, one run each per round, so that a slow
        drift of the machine falls on all of them alike (for differences of a few percent)."""
        import statistics

        from timing import bench

        sync = self._sync(pool, modules)
        cuda = self.device.type == "cuda"
        for fn in fns.values():
            bench(fn, warmup=self.args.warmup, repeats=1, setup=pool, sync=sync, cuda=cuda)
        times = {name: [] for name in fns}
        for r in range(max(self.args.repeats, min_rounds)):
            for name, fn in fns.items():
                times[name].append(bench(fn, warmup=0, repeats=1, setup=lambda i, r=r: pool(r), sync=sync,
                                         cuda=cuda)["median_ms"])
        return {name: slowest(statistics.median(t), self.device) for name, t in times.items()}


def make_layer(M, F, args, ep, hybrid=None, max_tokens=None):
    from ds_uniep import SwiGLUExpert, UniEPMoE
    torch.manual_seed(0)  # the gate is replicated: the same initial weights on every rank
    cfg = {"backend": "reference", "max_tokens_per_rank": max_tokens or max(args.tokens)}
    if hybrid is not None:
        cfg["hybrid"] = dict(hybrid, reuse_replicas=args.microbatches > 1)
    layer = UniEPMoE(M, SwiGLUExpert(M, F), num_experts=args.num_experts, ep_size=ep, k=args.top_k, min_capacity=0,
                     drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False, config=cfg)
    if args.microbatches > 1:
        layer.set_accumulation_boundary(lambda: LAST_MICROBATCH[0])
    return layer


def finish(layer, state, device, dtype, pacing):
    if state is not None:
        layer.load_state_dict(state)
    layer = layer.to(device=device, dtype=dtype)
    layer.deepspeed_moe.gate.wg.float()  # DeepSpeed's gate runs in fp32 either way
    layer.set_inter_site_pacing(pacing)  # before set_deepspeed_parallelism, as the layer asks
    layer.set_deepspeed_parallelism()
    return layer


def option_specs(sizes, fractions, compressions, local_experts, hottest=False):
    """``{name: (S, m, ratio, choice)}``: ``EP`` (1, 0, None, "first"), then per domain size ``S=n``
    (every expert migrated, dense), ``S=n m=j`` (the first j of the L local experts migrated, one
    per distinct rounding of ``fractions``; with ``hottest`` also ``S=n m=j hot``, the j hottest)
    and ``S=n c=r`` (every expert migrated, compressed at ratio r)."""
    from ds_uniep.hybrid.planning import migrated_experts
    specs = {"EP": (1, 0, None, "first")}
    for S in sizes:
        specs[f"S={S}"] = (S, local_experts, None, "first")
        for m in sorted({migrated_experts(f, local_experts) for f in fractions} - {local_experts}):
            specs[f"S={S} m={m}"] = (S, m, None, "first")
            if hottest:
                specs[f"S={S} m={m} hot"] = (S, m, None, "hottest")
        for r in sorted(set(compressions)):
            specs[f"S={S} c={r:g}"] = (S, local_experts, r, "first")
    return specs


def build_layers(M, F, args, specs, device, dtype, pacing):
    """``{"EP": plain, "S=n": HybridEP, "S=n m=j": partial, "S=n c=r": compressed ...}`` (``specs``, see
    :func:`option_specs`) with the same weights, the ep-1 compute layer, and the state."""
    G, rank = dist.get_world_size(), dist.get_rank()
    proto = make_layer(M, F, args, G)
    g = torch.Generator().manual_seed(1 + rank)  # every rank's experts differ
    with torch.no_grad():
        for p in proto.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
        if args.skew:  # the inputs' first feature is 1 (see measure_point): expert e's logit gains a * z_e
            z = torch.randn(args.num_experts, generator=torch.Generator().manual_seed(7))
            proto.deepspeed_moe.gate.wg.weight[:, 0] = args.skew * z
    state = proto.state_dict()
    layers = {"EP": finish(make_layer(M, F, args, G), state, device, dtype, pacing)}
    L = args.num_experts // G
    for name, (S, m, ratio, choice) in specs.items():
        if S == 1:
            continue
        hybrid = {"enabled": True, "domain_size": S, "site_size": args.site_size, "migrated_fraction": m / L,
                  "migrated_experts": choice}
        if ratio is not None:
            hybrid["compression"] = {"enabled": True, "ratio": ratio}
        layers[name] = finish(make_layer(M, F, args, G, hybrid), state, device, dtype, pacing)
        assert layers[name].hybrid_migrated_experts == m, (name, layers[name].hybrid_migrated_experts)
    ep1 = make_layer(M, F, args, 1)
    ep1.deepspeed_moe.gate.load_state_dict(proto.deepspeed_moe.gate.state_dict())
    ep1 = finish(ep1, None, device, dtype, None)
    return layers, ep1, state


def routed_load(layer, pool, num_experts, inputs=(0, 1)):
    """``[G, E]`` token copies each rank's gate routes to each expert, averaged over ``inputs`` (by
    default the two the options are timed on; the same on every rank)."""
    from ds_uniep.layout import expert_counts
    from ds_uniep.reference import gather_counts
    counts = sum(expert_counts(layer.deepspeed_moe.gate(pool(i)[0].detach(), None, True)[3], num_experts)
                 for i in inputs)
    return (gather_counts(counts, dist.group.WORLD, dist.get_world_size()).double() / len(inputs)).tolist()


# --------------------------------------------------------------------------- one point
def measure_point(M, F, T, layers, specs, ep1, state, args, device, dtype, pacing, timer):
    from timing import rotating

    from ds_uniep.config import UniEPConfig
    from ds_uniep.experts import run_experts
    from ds_uniep.hybrid.model import Cluster, Workload, plan, predict, predict_routed
    from ds_uniep.hybrid.planning import choose_domain_size, measure_bandwidths
    from ds_uniep.reference import ReferenceDispatcher

    G, rank, L = dist.get_world_size(), dist.get_rank(), args.site_size
    E, k = args.num_experts, args.top_k
    elsize = torch.finfo(dtype).bits // 8

    def inputs(i):
        gen = torch.Generator(device=device).manual_seed(1000 * rank + i)
        x = torch.randn(T, M, dtype=dtype, device=device, generator=gen)
        if args.skew:
            x[:, 0] = 1.0  # the gate's skewed column (build_layers)
        return x.requires_grad_(True), torch.randn(T, M, dtype=dtype, device=device, generator=gen)
    pool = rotating(inputs, 2)

    # 1. One checked run per option: outputs and input gradients against plain EP (the reference:
    #    its own errors are None, not a check), and the inter-site bytes this rank was held for
    #    (forward + backward).
    checks = {}
    ref = None
    LAST_MICROBATCH[0] = True  # a step of one micro-batch: one gather, one gradient return
    for name, layer in layers.items():
        if specs[name][3] == "hottest":  # a forward+backward whose tokens choose the experts
            fwd_bwd(layer)(pool(1)[0].detach().clone().requires_grad_(True), pool(1)[1])
            layer.zero_grad(set_to_none=True)
        layer.refresh_replicas()
        x = pool(0)[0].detach().clone().requires_grad_(True)
        before, transfers = pacing.paced_bytes, pacing.paced_transfers
        out = fwd_bwd(layer)(x, pool(0)[1])
        h = layer._hybrid  # the experts it migrated (a hottest choice is made at its forward's gather)
        chosen = h.migrated_by_rank if h is not None else None
        nbytes = pacing.paced_bytes - before
        transfers = pacing.paced_transfers - transfers
        layer.zero_grad(set_to_none=True)
        is_ref = ref is None
        if is_ref:
            ref = (out.detach(), x.grad)
        checks[name] = {"inter_bytes_measured": slowest(nbytes, device), "chosen_checked": chosen,
                        "inter_transfers_measured": int(slowest(transfers, device)),
                        "rel_err_out": None if is_ref else slowest(rel_err(out.detach(), ref[0]), device),
                        "rel_err_dx": None if is_ref else slowest(rel_err(x.grad, ref[1]), device)}
        if args.microbatches > 1:  # one whole step: its inter-site bytes, gathers and gradient returns
            h = layer._hybrid
            counts = dict(h.counter) if h is not None else {}
            before = pacing.paced_bytes
            step(layer, args.microbatches)(x.detach().requires_grad_(True), pool(0)[1])
            layer.zero_grad(set_to_none=True)
            checks[name]["step_inter_bytes_measured"] = slowest(pacing.paced_bytes - before, device)
            if h is not None:
                checks[name]["gathers_per_step"] = h.counter.get("gathers", 0) - counts.get("gathers", 0)
                checks[name]["returns_per_step"] = (h.counter.get("owner_reductions", 0)
                                                    - counts.get("owner_reductions", 0))

    # 2. Compute: the layer at ep 1 (no communication), forward and forward+backward, and the
    #    experts' forward alone over the same rows.
    ep1_fwd = timer(lambda x, gy: ep1(x), pool, [ep1])
    ep1_fwdbwd = timer(fwd_bwd(ep1), pool, [ep1])
    with torch.no_grad():
        x0 = pool(0)[0].detach()
        _, _, _, idx, _, _, _ = ep1.deepspeed_moe.gate(x0, None, True)
        recv, counts, _ = ReferenceDispatcher(E, 1).dispatch(x0, idx.t())
        load = routed_load(ep1, pool, E)
        load_checked = routed_load(ep1, pool, E, inputs=(0, ))  # the checked runs' routing
    recv = recv.detach().requires_grad_(True)
    experts = list(ep1.deepspeed_moe.experts.deepspeed_experts)
    exp_fwd = timer(lambda x, gy: run_experts(experts, recv, counts), pool, [ep1])
    t_exp = exp_fwd * 1e-3
    t_pre = max(ep1_fwd - exp_fwd, 1e-3) * 1e-3
    c_b = max((ep1_fwdbwd - ep1_fwd) / ep1_fwd, 1.0)

    # 3. Bandwidths, through the same pacing as the layers' traffic.
    b_f, b_s = measure_bandwidths(dist.group.WORLD, L, nbytes=args.probe_bytes, repeats=3, pacing=pacing)

    # 4. Every option, forward+backward, per micro-batch over whole steps.
    mb = args.microbatches
    measured = {name: timer(step(layer, mb), pool, [layer]) / mb for name, layer in layers.items()}

    # 5. The model at the measured inputs, and the two planners.
    expert0 = layers["EP"].deepspeed_moe.experts.deepspeed_experts[0]
    P = float(sum(p.numel() * p.element_size() for p in expert0.parameters()))
    D = float(T * k * M * elsize)
    wl = Workload(token_bytes=D, expert_bytes=P, experts_per_rank=E / G, pre_expert_compute_s=t_pre,
                  expert_compute_s=t_exp, backward_compute_factor=c_b, num_microbatches=mb)
    cl = Cluster(num_ranks=G, site_size=L, intra_site_bandwidth_bytes_per_s=b_f, inter_site_bandwidth_bytes_per_s=b_s)
    options = {}
    for name in layers:
        S, m, comp, _ = specs[name]
        h = layers[name]._hybrid
        chosen = h.migrated_by_rank if h is not None else None
        # The model fed with this point's routing (load): the prediction checked; the uniform
        # routing's beside it.
        lt = predict_routed(wl, cl, load, S, chosen, compression_ratio=comp, bytes_per_value=elsize)
        uniform_ms = predict(wl, cl, S, m / (E // G), compression_ratio=comp, bytes_per_value=elsize).total_s * 1e3
        pred_ms = lt.total_s * 1e3
        # The inter-site bytes of the checked run, for its input's routing and its migrated experts.
        lt0 = predict_routed(wl, cl, load_checked, S, checks[name]["chosen_checked"], compression_ratio=comp,
                             bytes_per_value=elsize)
        model_bytes = 4 * lt0.token_bytes_inter + lt0.gather_bytes_inter + lt0.grad_return_bytes_inter
        if mb > 1:  # a whole step: 4 token all-to-alls per micro-batch, one gather, one return
            checks[name]["step_inter_bytes_model"] = (4 * mb * lt0.token_bytes_inter + lt0.gather_bytes_inter
                                                      + lt0.grad_return_bytes_inter)
        ratio = measured[name] / pred_ms
        # Compression is lossy below ratio 1: its errors against plain EP are reported, not checked.
        lossy = comp is not None and comp < 1
        options[name] = {"S": S, "migrated_experts": m, "migration_choice": specs[name][3],
                         "chosen_experts": chosen, "compression_ratio": comp,
                         "measured_ms": measured[name], "predicted_ms": pred_ms,
                         "predicted_uniform_ms": uniform_ms,
                         "ratio": ratio,
                         "within_15pct": abs(ratio - 1) <= 0.15, "inter_bytes_model": model_bytes, **checks[name],
                         "outputs_match": None if checks[name]["rel_err_out"] is None or lossy else
                         checks[name]["rel_err_out"] <= TOLERANCE[args.dtype]
                         and checks[name]["rel_err_dx"] <= TOLERANCE[args.dtype]}
    # Whole domains migrated (migrated_fraction 1), as the timed options are: the planner picks one of them.
    auto_cfg = {"enabled": True, "domain_size": "auto", "site_size": L, "intra_site_bandwidth": float(b_f),
                "inter_site_bandwidth": float(b_s), "migrated_fraction": 1.0}
    hyb = UniEPConfig.from_dict({"hybrid": auto_cfg}).hybrid
    s_rt, rt_plan = choose_domain_size(hyb, G, expert0, M, k, T, E // G, L, dist.group.WORLD, num_microbatches=mb)
    # The model's planner, fed with this point's routing: among whole domains, and with --hottest
    # the timed partial migrations too (the hottest experts, as the planner assumes).
    fractions = (0.0, 1.0) + (tuple(args.fractions) if args.hottest else ())

    def name_of(S, m=None, L=None):
        return "EP" if S == 1 else f"S={S}" if m is None or m == L else f"S={S} m={m} hot"

    mp = plan(wl, cl, "auto", fractions=fractions, load=load)
    model_name = name_of(mp.domain_size, round(mp.migrated_fraction * (E // G)), E // G)

    # 6. Where the planner keeps plain EP: a layer built with "domain_size": "auto", timed in
    #    alternation with plain EP (its overhead is a difference of a few percent at most).
    auto_ms, overhead = measured[name_of(s_rt)], None
    if s_rt == 1:
        auto = finish(make_layer(M, F, args, G, auto_cfg, T), state, device, dtype, pacing)
        assert auto.hybrid_domain_size == 1 and auto._hybrid is None, auto.hybrid_domain_size
        pair = timer.paired({"EP": step(layers["EP"], mb), "auto": step(auto, mb)}, pool, [layers["EP"], auto])
        pair = {name: ms / mb for name, ms in pair.items()}
        auto_ms = pair["auto"]
        overhead = pair["auto"] / pair["EP"] - 1
        del auto

    best = min(measured, key=measured.get)
    hybrid_names = [n for n in measured if n != "EP"]
    best_hybrid = min(hybrid_names, key=measured.get)
    replanned = None
    if args.replan:
        # 7. The runtime planning by itself: planned at construction for uniform routing, then,
        #    after one forward+backward and one optimizer step (lr 0: the weights stay), again for
        #    the routing it saw. Its checked forward+backward (the one that plans again) against EP.
        cfg = dict(auto_cfg, migrated_fraction="auto", replan_after_steps=1, replan_compute=args.replan_compute)
        layer = finish(make_layer(M, F, args, G, cfg, T), state, device, dtype, pacing)
        start = (layer.hybrid_domain_size, layer.hybrid_migrated_experts)
        fwd_bwd(layer)(pool(1)[0].detach().clone().requires_grad_(True), pool(1)[1])
        layer.zero_grad(set_to_none=True)
        torch.optim.SGD(layer.parameters(), lr=0.0).step()
        x = pool(0)[0].detach().clone().requires_grad_(True)
        out = fwd_bwd(layer)(x, pool(0)[1])
        err = (slowest(rel_err(out.detach(), ref[0]), device), slowest(rel_err(x.grad, ref[1]), device))
        layer.zero_grad(set_to_none=True)
        ms = timer(step(layer, 1), pool, [layer])
        rp, h = layer.hybrid_replanned, layer._hybrid
        replanned = {"start": list(start), "planned": list(rp["plan"][:2]), "predicted_speedup": rp["speedup"],
                     "predicted_gain": rp["gain"], "switched": rp["switched"], "compute": rp["compute"],
                     "expert_compute_ms": rp["expert_compute_s"] * 1e3,
                     "pre_expert_compute_ms": rp["pre_expert_compute_s"] * 1e3,
                     "domain_size": layer.hybrid_domain_size, "migrated_experts": layer.hybrid_migrated_experts,
                     "chosen_experts": h.migrated_by_rank if h is not None else None,
                     "ms": ms, "vs_best": ms / measured[best],
                     "within_5pct": ms <= 1.05 * measured[best], "speedup_vs_ep": measured["EP"] / ms,
                     "rel_err_out": err[0], "rel_err_dx": err[1],
                     "outputs_match": err[0] <= TOLERANCE[args.dtype] and err[1] <= TOLERANCE[args.dtype]}
        del layer
    return {
        "M": M, "F": F, "T": T, "E": E, "k": k, "G": G, "site_size": L, "dtype": args.dtype, "microbatches": mb,
        "token_bytes": D, "expert_bytes": P, "load": load,
        "bandwidth_bytes_per_s": {"intra_site": b_f, "inter_site": b_s},
        "compute": {"ep1_fwd_ms": ep1_fwd, "ep1_fwdbwd_ms": ep1_fwdbwd, "experts_fwd_ms": exp_fwd,
                    "t_pre_ms": t_pre * 1e3, "t_exp_ms": t_exp * 1e3, "c_b": c_b},
        "options": options,
        "best": best, "best_ms": measured[best],
        "planner": {"runtime_choice": name_of(s_rt), "runtime_ms": auto_ms,
                    "runtime_predicted_speedup": rt_plan.speedup,
                    "within_5pct": auto_ms <= 1.05 * measured[best],
                    "model_choice": model_name, "model_ms": measured[model_name],
                    "model_within_5pct": measured[model_name] <= 1.05 * measured[best],
                    "auto_overhead": overhead},
        "best_hybrid": best_hybrid,
        "speedup_best_hybrid": measured["EP"] / measured[best_hybrid],
        "speedup_planner": measured["EP"] / auto_ms,
        "replanned": replanned,
    }


# --------------------------------------------------------------------------- sweep
def run(args, log=print):
    """The sweep on the current process group; every rank returns the same results."""
    from ds_uniep.hybrid.model import Cluster
    from ds_uniep.hybrid.presets import parse_bandwidth
    from ds_uniep.hybrid.pacing import InterSitePacing
    from ds_uniep.hybrid.planning import measure_bandwidths

    G, rank, L = dist.get_world_size(), dist.get_rank(), args.site_size
    if L < 1 or G % L or G // L < 2:
        raise SystemExit(f"--site-size {L}: must divide the {G} ranks into at least 2 sites")
    if args.num_experts % G:
        raise SystemExit(f"--num-experts {args.num_experts} must be a multiple of the {G} ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    bw = parse_bandwidth(args.inter_bw)
    pacing = InterSitePacing(L, bw, hold=args.hold)
    sizes = [S for S in Cluster(G, L, 1.0, 1.0).valid_domain_sizes() if S > 1]
    specs = option_specs(sizes, args.fractions, args.compressions, args.num_experts // G, args.hottest)
    names = list(specs)
    say = log if rank == 0 else (lambda *a, **k: None)

    fast_f, fast_s = measure_bandwidths(dist.group.WORLD, L, nbytes=args.probe_bytes, repeats=3)
    _, paced_s = measure_bandwidths(dist.group.WORLD, L, nbytes=args.probe_bytes, repeats=3, pacing=pacing)
    say(f"{G} ranks in sites of {L}, {args.device}, {args.dtype}; inter-site pacing {bw / 1e9:g} GB/s "
        f"(hold: {args.hold}). Measured per rank: intra-site {fast_f / 1e9:.3g} GB/s, inter-site unpaced "
        f"{fast_s / 1e9:.3g} GB/s, paced {paced_s / 1e9:.3g} GB/s", flush=True)
    results = {"config": {k: v for k, v in vars(args).items() if k != "expert_sizes"}, "G": G,
               "domain_sizes": [1] + sizes, "option_names": names, "inter_bw_set_bytes_per_s": bw,
               "bandwidth_at_start_bytes_per_s": {"intra_site": fast_f, "inter_site_unpaced": fast_s,
                                                  "inter_site_paced": paced_s},
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "points": []}
    n = len(args.expert_sizes) * len(args.tokens)
    t_start = time.perf_counter()
    timer = Timer(args, device)
    for M, F in args.expert_sizes:
        layers, ep1, state = build_layers(M, F, args, specs, device, dtype, pacing)
        for T in args.tokens:
            t0 = time.perf_counter()
            pt = measure_point(M, F, T, layers, specs, ep1, state, args, device, dtype, pacing, timer)
            results["points"].append(pt)
            opts = ", ".join(f"{name} {o['measured_ms']:.2f} ms (model {o['predicted_ms']:.2f})"
                             for name, o in pt["options"].items())
            say(f"[{len(results['points'])}/{n}] M={M} F={F} T={T}: {opts}; planner {pt['planner']['runtime_choice']}"
                f", best {pt['best']} ({time.perf_counter() - t0:.1f} s)", flush=True)
        del layers, ep1
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["elapsed_s"] = time.perf_counter() - t_start
    results["summary"] = summarize(results["points"])
    return results


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import deepspeed
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo", verbose=False)
    results = run(args)
    if dist.get_rank() == 0:
        write(results, args.out, not args.no_plot)
        print_table(results)
        print(f"(sweep {results['elapsed_s']:.0f} s; {os.path.join(args.out, 'bench_hybrid.json')})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
