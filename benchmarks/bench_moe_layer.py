"""One MoE layer, side by side: stock DeepSpeed MoE, ds_uniep's reference and megakernel backends, and bounds.

    torchrun --nproc_per_node 4 benchmarks/bench_moe_layer.py --shapes mixtral-like dsv2lite-like dsv3-like small-like

Every rank runs the same layer on its own tokens; a layer's time is the slowest
rank's median over the runs (ranks are lined up by a barrier before each run; gradients are set to
None before each run, untimed, as after a training step's ``zero_grad``).
fwd+bwd includes the input's gradient, as in a model whose earlier layers train.
With ``--streamed-steps N`` every layer is also timed as a training loop runs it:
N steps back to back (gradients set to None and a fresh input inside each step,
no barrier or host wait between steps but the layer's own), per-step time from
CUDA events around the N steps, the median of ``--streamed-rounds`` bursts, the
slowest rank's; a second table gives those times and their ratios.
Baselines and bounds are measured in the same run:

- stock: ``deepspeed.moe.layer.MoE`` (dropless, so it pads every expert to the largest count);
- reference: ``UniEPMoE`` with ``"backend": "reference"`` (sort + ``all_to_all_single`` + grouped GEMM);
- megakernel: ``UniEPMoE`` with ``"backend": "megakernel"`` where it can run (else the row says why not),
  its experts on ds_uniep's grouped GEMM (``"expert_gemm": "uniep"``);
- megakernel-torch-gemm: the same with ``"expert_gemm": "torch"`` (the default; what the GEMM alone changes);
- megakernel-pipelined: megakernel-torch-gemm under the pipelined schedule (``--pipeline-chunks`` chunks of
  local experts, each chunk's rows copied back by the copy engines while the next computes); timed again
  alternately with megakernel-torch-gemm (``--schedule-rounds``, medians) for the schedule's gain;
- megakernel-fused: megakernel under the fused schedule (``--fused-comm-sms`` SMs move the rows one
  destination at a time while the first expert GEMM runs on the others, each source's rows as they land);
  timed again alternately with megakernel (``--schedule-rounds``, medians) for the schedule's gain;
- megakernel-fused-push: megakernel-fused with the second expert GEMM writing its outputs on the expert's
  rank and the combine kernel pushing them back, and the first GEMM's dgrad rows pushed back by the
  dispatch's backward (``"epilogue_combine": false``), instead of those GEMMs' epilogues storing each
  row straight into its source's combine buffer (the default); the same bits;
- megakernel-fused-epilogue: megakernel-fused with the sequential schedule's dispatch (``"fused_dispatch":
  false``): of the fused schedule only the epilogue combines (the second GEMM's forward, the first
  GEMM's dgrad); timed again alternately with megakernel (``--schedule-rounds``): what they gain over
  the sequential schedule;
- megakernel-fused-interleaved: megakernel-fused in interleaved roles (``"roles": "interleaved"``): its
  dispatch runs in a spare warp of each of the first expert GEMM's CTAs, so that GEMM has every SM; timed
  again alternately with megakernel (``--schedule-rounds``): what it gains over the sequential schedule;
- megakernel-rank-partials: megakernel with ``"compression": {"combine": "rank_partials"}``: each expert
  rank sums its rows of a token before they travel back (one row per token and rank, one more rounding:
  not the slot-order bits, within bf16 tolerance); timed again alternately with megakernel
  (``--schedule-rounds``): what the fewer bytes gain;
- megakernel-sync-free: megakernel-torch-gemm with ``"sync_free": true`` (no host read of counts; expert rows
  sized by ``max_tokens_per_rank``), run eagerly;
- megakernel-graph: megakernel-sync-free's step (forward, or forward and backward) captured once in a CUDA
  graph and replayed, the input and output gradient copied into the graph's tensors first (timed with it);
  its outputs and gradients are the eager layer's bits (``tests/test_cuda_graph.py``);
- megakernel-pipelined-nodes (with ``--node-size`` below the expert-parallel size only): megakernel under
  the pipelined schedule across nodes (the rows of a rank's own node start the first expert GEMM while
  the other nodes' rows cross; ``ds_uniep/schedules/across_nodes.py``); timed again alternately with
  megakernel (``--schedule-rounds``): what that overlap gains, the same bits;
- megakernel-late-route: megakernel-torch-gemm with its dispatch queued after the whole gate and the
  experts' stacking (``UniEPMoE.route_early = False``) instead of right after the gate's routes (the
  default); timed again alternately with megakernel-torch-gemm (``--schedule-rounds``, medians): what
  queueing the dispatch early gains, the same bits;
- deepep: DeepEP's intranode dispatch and combine (``deep_ep.Buffer``, its V1 line) around torch's grouped
  GEMM experts, as Megatron-Core's flex dispatcher runs them (``deepep_layer.py``; DeepEP is built from its
  source, benchmarks/README.md; where it is not importable the row says why);
- autoep-deepep: AutoEP on its DeepEP transport (``comm_backend: "deepep"``, DeepEP's V2 line with its
  ``ElasticBuffer``; the row says why where that is not built);
- autoep: DeepSpeed's own AutoEP layer (``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer``: router,
  sort, NCCL ``all_to_all_single`` both ways, ``torch._grouped_mm`` experts) built from the same gate and
  experts (see ``build_autoep``; where it cannot be built or run, the row says why);
- practical bound: max(expert GEMMs alone through ``torch._grouped_mm`` on the same rows (2 GEMMs
  forward, 6 forward+backward, nothing else: see ``gemm_alone``), dispatch+combine bytes at the peer
  copy bandwidth); the whole expert MLP outside the layer (``experts_alone``: stacking, activation,
  gradients into the parameters) is reported beside it;
- physical bound: max(expert FLOPs / dense bf16 GEMM rate, the same bytes / peer copy bandwidth).

All layers use the same DeepSpeed gate weights and SwiGLU experts, bf16, fp32 gate (AutoEP too: its
router's gate is kept fp32 and fed fp32 input; see ``AUTOEP_NOTE`` for how its routing compares).
A short table is printed last; everything goes to ``--out/bench_moe_layer.json``.

``--settle-s S`` (default 1) runs each layer untimed for S seconds before its
first timing of a shape. ``--profile-steps N`` also runs every layer N steps
back to back under ``torch.profiler`` and reports where rank 0's GPU time goes
per step: kernels by kind (grouped GEMMs, dense GEMMs, dispatch, combine, ...),
the time the GPU sat idle and the time two streams ran at once, with every
rank's busy time and kinds beside it (``profile_steps.py``; JSON key
``<backend>_profile`` of each row). ``--breakdown`` (profiling 5 steps unless
``--profile-steps`` says otherwise) also draws it per shape and mode, every layer a
stacked bar against both bounds, as ``OUT/breakdown_<shape>_<mode>.png``.

``--autotune`` adds, per shape, the megakernel layer tuned by its own autotune
path (``"autotune": {"enabled": true}``, fwd+bwd, ``--autotune-budget-s`` per
shape) and timed under its plan, and every single fixed plan a user could set
for all shapes without tuning: the config default and every plan of the layer's
space (with ``--autotune-fixed-s S``, those that fit in S seconds per shape, in
the order the tuner's search ranked them, the config default first; the others
are listed under ``"fixed_not_timed"``). The best single fixed plan is the one
with the smallest geometric mean time over the shapes run, among the plans
timed at every shape; the table gives tuned ms, its ms and their ratio per
shape (JSON key ``"autotune"``)::

    torchrun --nproc_per_node 4 benchmarks/bench_moe_layer.py --autotune --out bench_out
    torchrun --nproc_per_node 4 benchmarks/bench_moe_layer.py --shapes dsv3-like --autotune --autotune-fixed-s 120
"""

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rows import (AUTOEP_NOTE, GraphedLayer, build_autoep, fixed_plan_order, fixed_plans,  # noqa: E402,F401
                        print_autotune, summarize_autotune)
from bench_tables import _PEERS, plot_breakdown, print_profiles, print_table  # noqa: E402,F401
from timing import bench, rotating  # noqa: E402

BACKENDS = ["stock", "reference", "megakernel", "megakernel-torch-gemm", "megakernel-pipelined",
            "megakernel-pipelined-sm", "megakernel-fused", "megakernel-fused-push", "megakernel-fused-epilogue",
            "megakernel-fused-interleaved", "megakernel-rank-partials", "megakernel-late-route",
            "megakernel-sync-free", "megakernel-graph", "megakernel-pipelined-nodes", "autoep", "autoep-deepep",
            "deepep"]
MEGAKERNEL_CONFIGS = {
    "megakernel": {"backend": "megakernel", "expert_gemm": "uniep"},
    "megakernel-torch-gemm": {"backend": "megakernel", "expert_gemm": "torch"},
    "megakernel-pipelined": {"backend": "megakernel", "expert_gemm": "torch",
                             "overlap": {"schedule": "pipelined", "num_chunks": 4}},
    # ds_uniep's GEMM on the SMs num_comm_sms leaves, chunk rows copied back by SM stores
    "megakernel-pipelined-sm": {"backend": "megakernel", "expert_gemm": "uniep",
                                "overlap": {"schedule": "pipelined", "num_chunks": 4, "num_comm_sms": 20}},
    "megakernel-fused": {"backend": "megakernel", "expert_gemm": "uniep",
                         "overlap": {"schedule": "fused", "num_comm_sms": 20, "roles": "partitioned"}},
    # megakernel-fused with the second GEMM's outputs kept on the expert rank and pushed back by the combine
    # kernel, and the first GEMM's dgrad rows by the dispatch's backward (overlap.epilogue_combine false)
    "megakernel-fused-push": {"backend": "megakernel", "expert_gemm": "uniep",
                              "overlap": {"schedule": "fused", "num_comm_sms": 20, "roles": "partitioned",
                                          "epilogue_combine": False}},
    # megakernel-fused with the sequential schedule's dispatch (overlap.fused_dispatch false): only the
    # epilogue combines (the second GEMM's forward, the first GEMM's dgrad)
    "megakernel-fused-epilogue": {"backend": "megakernel", "expert_gemm": "uniep",
                                  "overlap": {"schedule": "fused", "num_comm_sms": 20, "fused_dispatch": False}},
    # megakernel-fused with its dispatch inside the first GEMM's CTAs (overlap.roles interleaved)
    "megakernel-fused-interleaved": {"backend": "megakernel", "expert_gemm": "uniep",
                                     "overlap": {"schedule": "fused", "roles": "interleaved"}},
    # megakernel with compression.combine "rank_partials": each rank sums its rows of a token before they
    # travel back (one row per token and rank; one more rounding, not the slot-order bits)
    "megakernel-rank-partials": {"backend": "megakernel", "expert_gemm": "uniep",
                                 "compression": {"combine": "rank_partials"}},
    # megakernel-torch-gemm with its dispatch queued after the whole gate and the experts' stacking
    # (UniEPMoE.route_early = False), as before the dispatch was queued between them
    "megakernel-late-route": {"backend": "megakernel", "expert_gemm": "torch"},
    # megakernel-torch-gemm with no host read of counts ("sync_free": true), run eagerly
    "megakernel-sync-free": {"backend": "megakernel", "expert_gemm": "torch", "sync_free": True},
    # the same layer's step captured in a CUDA graph and replayed (GraphedLayer)
    "megakernel-graph": {"backend": "megakernel", "expert_gemm": "torch", "sync_free": True},
    # megakernel across emulated nodes (--node-size) under the pipelined schedule: this node's rows start
    # the first GEMM while the other nodes' rows cross
    "megakernel-pipelined-nodes": {"backend": "megakernel", "expert_gemm": "uniep",
                                   "overlap": {"schedule": "pipelined"}},
}

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["mixtral-like", "dsv2lite-like", "dsv3-like", "small-like"])
    p.add_argument("--experts", type=int, default=None, help="override E (default: the shape's; dsv3-like: "
                   "32 up to ep 4, 256 from ep 8)")
    p.add_argument("--tokens", type=int, default=None, help="override T tokens per rank")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKENDS,
                   help="the rows to time (default: every one; megakernel-pipelined-nodes only with --node-size "
                   "below the expert-parallel size)")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--deepep-sms", type=int, default=None,
                   help="SMs of the deepep row's dispatch and combine (even; default: DeepEP's own, 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--pipeline-chunks", type=int, default=4,
                   help="num_chunks of megakernel-pipelined and megakernel-pipelined-sm (default 4)")
    p.add_argument("--pipeline-comm-sms", type=int, default=None,
                   help="num_comm_sms of megakernel-pipelined-sm: its copy blocks; its GEMM gets the other SMs "
                        "(default 20)")
    p.add_argument("--fused-comm-sms", type=int, default=None,
                   help="num_comm_sms of megakernel-fused: its dispatch blocks; its first GEMM gets the other SMs "
                        "(default 20)")
    p.add_argument("--schedule-rounds", type=int, default=3,
                   help="alternating timings of each schedule comparison: megakernel-torch-gemm (sequential) "
                   "against megakernel-pipelined and megakernel-late-route, megakernel against megakernel-fused, "
                   "megakernel-fused-epilogue, megakernel-fused-interleaved and megakernel-pipelined-sm, "
                   "megakernel-fused-push against "
                   "megakernel-fused (medians; default 3)")
    p.add_argument("--streamed-steps", type=int, default=0,
                   help="also time every layer over this many back-to-back steps, as a training loop runs "
                   "them (per-step ms; 0: off, the default)")
    p.add_argument("--streamed-rounds", type=int, default=3,
                   help="bursts of --streamed-steps steps per layer; the median burst counts (default 3)")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="untimed steps of each layer for at least this many seconds (the slowest rank's) before "
                   "its first timing per shape, after --warmup's (once seen: the layer timed first after "
                   "building ran slower for several runs than later; default 1; 0: off)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after its timings, run every layer this many steps back to back under torch.profiler "
                   "and report where rank 0's GPU time goes per step: kernels by kind, idle and concurrent time "
                   "(see profile_steps.py; 0: off, the default)")
    p.add_argument("--breakdown", action="store_true",
                   help="profile every layer (--profile-steps, 5 if not given) and write, per shape and mode, a "
                   "PNG of its GPU time by kind of kernel and idle, against both bounds (OUT/breakdown_*.png)")
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks per node for ds_uniep's rows (\"uniep\": {\"topology\": {\"node_size\": N}}): below the "
                   "expert-parallel size it emulates nodes, and the rows run the two-level dispatch (the megakernel "
                   "inside each node); the bytes each sends across nodes are printed beside a flat all-to-all's")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--autotune", action="store_true", help="add the self-tuned megakernel layer and every single "
                   "fixed plan (the config default and every plan of the layer's space) per shape")
    p.add_argument("--autotune-budget-s", type=float, default=40.0, help="tuning budget per shape (default 40)")
    p.add_argument("--autotune-fixed-s", type=float, default=0.0, help="seconds per shape for timing the fixed "
                   "plans, in the order the tuner's search ranked them (the config default first); the rest are "
                   "listed as not timed (default 0: every plan)")
    p.add_argument("--autotune-cache", default=None, help="plan cache directory (default OUT/plan_cache; a cached "
                   "plan is used without tuning)")
    args = p.parse_args(argv)
    if args.backends is None:
        args.backends = [b for b in BACKENDS if b != "megakernel-pipelined-nodes" or args.node_size]
    if args.breakdown and args.profile_steps <= 0:
        args.profile_steps = 5
    return args


def experts_for(shape, ep, override):
    from ds_uniep.tuning.presets import num_experts_at
    return override or num_experts_at(shape.name, ep)


def peer_copy_gbps(nbytes=256 << 20):
    """One-direction copy-engine bandwidth from this GPU to the next one (GB/s), or None with one GPU."""
    n = torch.cuda.device_count()
    if n < 2:
        return None
    src_dev = torch.cuda.current_device()
    dst_dev = (src_dev + 1) % n
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=src_dev)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dst_dev)
    r = bench(lambda: dst.copy_(src, non_blocking=True), warmup=3, repeats=10)
    torch.cuda.synchronize(dst_dev)
    return nbytes / (r["median_ms"] * 1e-3) / 1e9


def dense_gemm_tflops(n=8192):
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    r = bench(lambda: a @ b, warmup=3, repeats=10)
    return 2 * n**3 / (r["median_ms"] * 1e-3) / 1e12


def slowest(ms, dist):
    t = torch.tensor([ms], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def build_layers(shape, E, ep, backends, status, why_not=None, deepep_sms=None, node_size=None):
    """The layers named in ``backends``; a layer that cannot be built is left out with its reason in
    ``why_not`` (megakernel rows that cannot run are left out silently: ``status`` says why)."""
    from deepspeed.moe.layer import MoE

    from ds_uniep import SwiGLUExpert, UniEPMoE
    torch.manual_seed(0)
    proto = MoE(shape.hidden, SwiGLUExpert(shape.hidden, shape.ffn), num_experts=E, ep_size=ep, k=shape.top_k,
                min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    # Every rank's experts differ, as in a real model.
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1 + rank)
    with torch.no_grad():
        for p in proto.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1]**-0.5)
    layers = {}
    for name in backends:
        if name in _PEERS:
            try:
                device = torch.device("cuda", torch.cuda.current_device())
                if name == "deepep":
                    from deepep_layer import DeepEPLayer
                    layers[name] = DeepEPLayer(proto, device, torch.bfloat16, deepep_sms)
                else:  # AutoEP on NCCL, or on its DeepEP transport (DeepEP's V2 line, ElasticBuffer)
                    layers[name] = build_autoep(proto, ep, device, torch.bfloat16,
                                                comm_backend="deepep" if name == "autoep-deepep" else "comm")
            except Exception as e:  # noqa: BLE001 - the row reports it
                if why_not is not None:
                    why_not[name] = f"{type(e).__name__}: {e}"
            continue
        if name == "stock":
            layer = copy.deepcopy(proto)
        else:
            if name.startswith("megakernel") and not status[0]:
                continue
            config = copy.deepcopy(MEGAKERNEL_CONFIGS.get(name, {"backend": name}))
            if name == "megakernel-pipelined-nodes" and not (node_size and node_size < ep):
                if why_not is not None:
                    why_not[name] = "runs across nodes only (--node-size below the expert-parallel size)"
                continue
            if node_size:
                if node_size < ep and config.get("sync_free"):
                    if why_not is not None:
                        why_not[name] = ("sync_free runs on one node (across nodes the dispatch reads counts on "
                                         "the host)")
                    continue
                config["topology"] = {"node_size": node_size}
            layer = UniEPMoE(shape.hidden, SwiGLUExpert(shape.hidden, shape.ffn), num_experts=E, ep_size=ep,
                             k=shape.top_k, min_capacity=0, drop_tokens=False, use_rts=False,
                             top2_2nd_expert_sampling=False, config=config)
            layer.load_state_dict(proto.state_dict())
        if name == "megakernel-late-route":
            layer.route_early = False
        layer = layer.cuda().to(torch.bfloat16)
        layer.deepspeed_moe.gate.wg.float()  # DeepSpeed computes the gate in fp32 either way
        layer.set_deepspeed_parallelism()
        layers[name] = GraphedLayer(layer) if name == "megakernel-graph" else layer
    return layers


def cross_node_bytes(layer):
    """``{"two_level": bytes, "flat": bytes}`` the group sent across nodes in ``layer``'s last step
    (forward and backward, all ranks), and what a flat all-to-all sends; None on one node."""
    for d in getattr(layer, "_dispatchers", {}).values():
        b = getattr(d, "cross_node_bytes", None)
        if b is not None:
            return {"two_level": b["two_level"], "flat": b["flat"]}
    return None


def _step_fns(layer, inputs, mode):
    """``(fwd(x, g), setup(run) -> (x, g))``: one step of ``layer`` and its inputs for run ``run``."""
    def fwd(x, g):
        if isinstance(layer, GraphedLayer):
            layer.step(x, g, mode)
            return
        out, l_aux, _ = layer(x)
        if mode == "fwdbwd":
            if l_aux is None:  # AutoEP: no auxiliary loss
                out.backward(g)
            else:
                torch.autograd.backward([out, l_aux], [g, torch.ones_like(l_aux)])
    def setup(run):
        # Gradients start empty in every run, as in a training step after zero_grad(set_to_none=True):
        # no layer spends the run adding into old gradients.
        layer.zero_grad(set_to_none=True)
        x, g = inputs(run)
        # fwd+bwd computes the input's gradient too, as in a model whose earlier layers train: the
        # first expert GEMM's dgrad and the backward of dispatch are part of every layer's run.
        return x.detach().requires_grad_(mode == "fwdbwd"), g
    return fwd, setup


def time_layer(layer, inputs, mode, args, dist):
    """Median ms of one step, each run started from a barrier (setup untimed); the slowest rank's."""
    fwd, setup = _step_fns(layer, inputs, mode)
    with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
        r = bench(fwd, warmup=args.warmup, repeats=args.repeats, setup=setup, sync=dist.barrier)
    return slowest(r["median_ms"], dist)


def settle(layer, inputs, mode, args, dist):
    """Untimed steps, two at a time, until ``args.settle_s`` seconds have passed on the slowest rank (all
    ranks stop together); returns how many ran."""
    fwd, setup = _step_fns(layer, inputs, mode)
    t0, n = time.perf_counter(), 0
    with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
        while True:
            for _ in range(2):
                fwd(*setup(n))
                n += 1
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if slowest(time.perf_counter() - t0, dist) >= args.settle_s:
                return n


def profile_layer(layer, inputs, mode, args, dist):
    """:func:`profile_steps.profile_steps` of ``args.profile_steps`` back-to-back steps of the layer (after
    ``args.warmup`` untimed ones, ranks lined up by a barrier): rank 0's summary, with every rank's busy,
    idle and per-kind times under ``"ranks"`` (a kind that waits for peers, such as the combine, takes
    longer on the ranks that wait)."""
    import torch.distributed as tdist
    from profile_steps import profile_steps
    fwd, setup = _step_fns(layer, inputs, mode)
    with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
        mine = profile_steps(lambda i: fwd(*setup(i)), steps=args.profile_steps, warmup=args.warmup,
                             sync=dist.barrier)
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, {k: mine[k] for k in ("window_ms", "busy_ms", "idle_ms", "categories",
                                                         "top_gaps")})
    return dict(mine, ranks=every)


def time_layer_streamed(layer, inputs, mode, args, dist):
    """Per-step ms of ``args.streamed_steps`` steps back to back, as a training loop runs them: the
    setup (gradients set to None, the next input) inside the timed region, no barrier or host wait
    between steps but the layer's own; CUDA events around the burst, after one barrier. The median
    of ``args.streamed_rounds`` bursts (after ``args.warmup`` untimed steps); the slowest rank's."""
    fwd, setup = _step_fns(layer, inputs, mode)
    cuda = torch.cuda.is_available()
    bursts = []
    with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
        for i in range(args.warmup):
            fwd(*setup(i))
        for _ in range(max(1, args.streamed_rounds)):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for i in range(args.streamed_steps):
                fwd(*setup(i))
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            bursts.append(ms / args.streamed_steps)
    return slowest(sorted(bursts)[len(bursts) // 2], dist)


def _layer_rows(layer, x):
    """The rows ``layer`` sends to this rank's experts for input ``x`` (reference dispatch) and their
    per-expert counts."""
    from ds_uniep.reference import ReferenceDispatcher
    moe = layer.deepspeed_moe
    with torch.no_grad():
        _, _, _, idx, _, _, _ = moe.gate(x, None, True)
        d = ReferenceDispatcher(layer.num_experts, layer.ep_size, moe.ep_group)
        recv, counts, _ = d.dispatch(x, idx.t())
    return recv.detach(), counts, list(moe.experts.deepspeed_experts)


def gemm_alone(layer, x, mode, args, dist):
    """The expert GEMMs alone on the layer's rows: ``torch._grouped_mm`` on weights stacked
    beforehand and nothing else (no gate, communication, activation, weight stacking or gradient
    accumulation). fwd: the two GEMMs (the second on a random input of the activation's shape);
    fwd+bwd: also the four GEMMs of their backward (input and weight gradients of each, as torch's
    autograd of ``_grouped_mm`` runs them). Returns the slowest rank's median ms and the most rows
    any rank received (the rank the physical bound's FLOPs are counted for)."""
    from ds_uniep.experts import stack_experts
    recv, counts, experts = _layer_rows(layer, x)
    with torch.no_grad():
        stacked = stack_experts(experts, recv.dtype, recv.device)
    first, second = (stacked.weights[k].detach().clone() for k in stacked.weights)  # [L, N, K] each
    offs = torch.cumsum(counts.to(recv.device), 0).to(torch.int32)
    bwd = mode == "fwdbwd"
    a = torch.randn(recv.shape[0], second.shape[2], dtype=recv.dtype, device=recv.device)
    leaves = [t.requires_grad_(bwd) for t in (recv, first, a, second)]
    dh = torch.randn(recv.shape[0], first.shape[1], dtype=recv.dtype, device=recv.device)
    dy = torch.randn_like(recv)

    def run():
        h = torch._grouped_mm(recv, first.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(a, second.transpose(-2, -1), offs=offs)
        if bwd:
            torch.autograd.grad([h, y], leaves, [dh, dy])
    with (torch.enable_grad() if bwd else torch.no_grad()):
        r = bench(run, warmup=args.warmup, repeats=args.repeats, sync=dist.barrier)
    return slowest(r["median_ms"], dist), int(slowest(float(counts.sum()), dist))


def experts_alone(layer, x, mode, args, dist):
    """The whole expert MLP on the layer's rows as ``run_grouped`` runs it outside the layer: weight
    stacking, both grouped GEMMs, the activation and (fwd+bwd) the backward into the experts'
    parameters. More than the GEMMs: reported beside the bounds, not as one."""
    from ds_uniep.experts import run_grouped
    recv, counts, experts = _layer_rows(layer, x)
    recv = recv.requires_grad_(mode == "fwdbwd")
    grad = torch.randn_like(recv)

    def run():
        for e in experts:
            e.zero_grad(set_to_none=True)
        y = run_grouped(experts, recv, counts)
        if mode == "fwdbwd":
            y.backward(grad)
    with (torch.enable_grad() if mode == "fwdbwd" else torch.no_grad()):
        r = bench(run, warmup=args.warmup, repeats=args.repeats, sync=dist.barrier)
    return slowest(r["median_ms"], dist)


def autotune_shape(name, shape, E, ep, T, inputs, layers, status, args, dist):
    """Tune the megakernel layer through its own autotune path, then time it and every fixed plan."""
    from ds_uniep.config import AutotuneConfig
    from ds_uniep.tuning import GPUInfo, Shape, Space
    if not status[0]:
        return {"shape": name, "skipped": f"megakernel cannot run here: {status[1]}"}
    if "megakernel" in layers:
        layer = layers["megakernel"]
    else:  # same seed, same weights as the other rows
        layer = build_layers(shape, E, ep, ["megakernel"], status)["megakernel"]
    cache_dir = args.autotune_cache or os.path.join(args.out, "plan_cache")
    on = AutotuneConfig(enabled=True, cache_dir=cache_dir, budget_s=args.autotune_budget_s, warmup=args.warmup,
                        repeats=args.repeats)
    layer.uniep_config = layer.uniep_config.model_copy(update={"autotune": on})
    dist.barrier()
    t0 = time.perf_counter()
    with torch.enable_grad():
        layer(inputs(0)[0])  # the first forward of this shape tunes (or reads the cache)
    torch.cuda.synchronize()
    dist.barrier()
    wall_s = time.perf_counter() - t0
    result = next(r for key, r in layer.autotune_results.items() if key[0] == T)
    row = {"shape": name, "T": T, "E": E, "tuned_plan": result.winner.to_dict(), "tuned_label": result.winner.label(),
           "from_cache": result.from_cache, "tune_wall_s": wall_s,
           "tuned_plans_measured": len(result.by_status("measured")), "tune_records": result.to_dict()["records"],
           "modes": {}}
    for mode in args.modes:  # autotune still on: the layer runs its tuned plan by itself
        row["modes"][mode] = {"tuned_ms": time_layer(layer, inputs, mode, args, dist), "fixed_ms": {}}
        if args.streamed_steps > 0:
            row["modes"][mode].update(tuned_streamed_ms=time_layer_streamed(layer, inputs, mode, args, dist),
                                      fixed_streamed_ms={})
    layer.uniep_config = layer.uniep_config.model_copy(update={"autotune": AutotuneConfig()})
    # the layer's own space as configured (its grouped GEMM decides whether the fused schedule is in it;
    # the tuned plan may have switched the GEMM the layer now runs)
    space = Space.from_config(layer.configured_config, Shape(T=T, M=shape.hidden, F=shape.ffn, E=E, k=shape.top_k,
                                                        dtype="bf16", ep=ep), GPUInfo.detect(), backend="megakernel")
    plans = fixed_plans(space)
    row["fixed_plans"] = {n: p.to_dict() for n, p in plans.items()}
    order, t0 = fixed_plan_order(plans, result.records), time.perf_counter()
    for i, pname in enumerate(order):
        # every rank stops at the same plan: the slowest rank's elapsed time decides
        if args.autotune_fixed_s > 0 and i > 0 and slowest(time.perf_counter() - t0, dist) > args.autotune_fixed_s:
            row["fixed_not_timed"] = order[i:]
            break
        plan = plans[pname]
        layer.set_plan(plan)
        for mode in args.modes:
            row["modes"][mode]["fixed_ms"][pname] = time_layer(layer, inputs, mode, args, dist)
            if args.streamed_steps > 0:
                row["modes"][mode]["fixed_streamed_ms"][pname] = time_layer_streamed(layer, inputs, mode, args, dist)
    return row


def init_ranks():
    """Join the job's NCCL process group (DeepSpeed's launcher, torchrun or mpirun) on this rank's
    GPU: ``(deepspeed.comm, ep = world size, rank, megakernel_status of the GPU)``."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import deepspeed
    import deepspeed.comm as dist

    from ds_uniep.backend import megakernel_status
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    return dist, dist.get_world_size(), dist.get_rank(), megakernel_status(torch.device("cuda", local_rank))


def main(argv=None):
    args = parse_args(argv)
    for name in ("megakernel-pipelined", "megakernel-pipelined-sm"):
        MEGAKERNEL_CONFIGS[name]["overlap"]["num_chunks"] = args.pipeline_chunks
    if args.fused_comm_sms:
        for name in ("megakernel-fused", "megakernel-fused-push"):
            MEGAKERNEL_CONFIGS[name]["overlap"]["num_comm_sms"] = args.fused_comm_sms
    if args.pipeline_comm_sms:
        MEGAKERNEL_CONFIGS["megakernel-pipelined-sm"]["overlap"]["num_comm_sms"] = args.pipeline_comm_sms
    from ds_uniep.hybrid.presets import PRESETS

    dist, ep, rank, status = init_ranks()
    peer = peer_copy_gbps() if rank == 0 else None
    tflops = dense_gemm_tflops()
    rates = [None, None]
    if rank == 0:
        rates = [peer, tflops]
    obj = [rates]
    dist.broadcast_object_list(obj, src=0)
    peer, tflops = obj[0]
    results = {"ep": ep, "peer_copy_GBps": peer, "dense_bf16_TFLOPs": tflops, "megakernel": list(status), "rows": []}
    if args.streamed_steps > 0:
        results["streamed"] = {"steps": args.streamed_steps, "rounds": max(1, args.streamed_rounds)}
    if "autoep" in args.backends:
        results["autoep_note"] = AUTOEP_NOTE

    for name in args.shapes:
        shape = PRESETS[name]
        T = args.tokens or shape.tokens_per_rank
        E = experts_for(shape, ep, args.experts)
        why_not = {}
        layers = build_layers(shape, E, ep, args.backends, status, why_not, args.deepep_sms, args.node_size)
        inputs = rotating(lambda i: (torch.randn(T, shape.hidden, dtype=torch.bfloat16, device="cuda",
                                                 generator=torch.Generator("cuda").manual_seed(100 * rank + i)),
                                     torch.randn(T, shape.hidden, dtype=torch.bfloat16, device="cuda")), 3)
        for mi, mode in enumerate(args.modes):
            passes = 1 if mode == "fwd" else 2
            row = {"shape": name, "mode": mode, "T": T, "M": shape.hidden, "F": shape.ffn, "E": E, "k": shape.top_k}
            for bname, reason in why_not.items():
                row[bname + "_why_not"] = reason
            for bname, layer in layers.items():
                if bname + "_why_not" in row:  # it failed in an earlier mode
                    continue
                try:
                    if mi == 0 and args.settle_s > 0:
                        row[bname + "_settle_steps"] = settle(layer, inputs, mode, args, dist)
                    row[bname + "_ms"] = time_layer(layer, inputs, mode, args, dist)
                    if args.streamed_steps > 0:
                        row[bname + "_streamed_ms"] = time_layer_streamed(layer, inputs, mode, args, dist)
                    if args.profile_steps > 0:
                        row[bname + "_profile"] = profile_layer(layer, inputs, mode, args, dist)
                except Exception as e:  # noqa: BLE001 - the row reports it; only the peers' are not ours
                    if bname not in _PEERS:
                        raise
                    row[bname + "_why_not"] = why_not[bname] = f"{type(e).__name__} while running: {e}"
                    row.pop(bname + "_ms", None)
                if rank == 0:  # progress, one line per timed layer
                    print(f"[{name} {mode}] {bname}: "
                          + (f"{row[bname + '_ms']:.2f} ms" if bname + "_ms" in row else "n/a")
                          + (f", streamed {row[bname + '_streamed_ms']:.2f} ms/step"
                             if bname + "_streamed_ms" in row else ""), flush=True)
            for base, other, key, rounds in (
                    ("megakernel-torch-gemm", "megakernel-pipelined", "schedule", args.schedule_rounds),
                    ("megakernel", "megakernel-pipelined-sm", "schedule_sm", args.schedule_rounds),
                    ("megakernel", "megakernel-fused", "schedule_fused", args.schedule_rounds),
                    ("megakernel-fused-push", "megakernel-fused", "epilogue_combine", args.schedule_rounds),
                    ("megakernel", "megakernel-fused-epilogue", "epilogue_only", args.schedule_rounds),
                    ("megakernel", "megakernel-fused-interleaved", "schedule_interleaved", args.schedule_rounds),
                    ("megakernel", "megakernel-rank-partials", "rank_partials", args.schedule_rounds),
                    ("megakernel-late-route", "megakernel-torch-gemm", "route_early", args.schedule_rounds),
                    ("megakernel-torch-gemm", "megakernel-graph", "graph", args.schedule_rounds),
                    ("megakernel", "megakernel-pipelined-nodes", "schedule_nodes", args.schedule_rounds)):
                pair = (base, other)
                if all(b + "_ms" in row for b in pair) and rounds > 0:
                    times = {b: [] for b in pair}
                    for _ in range(rounds):
                        for b in pair:
                            times[b].append(time_layer(layers[b], inputs, mode, args, dist))
                    med = {b: sorted(v)[len(v) // 2] for b, v in times.items()}
                    row[key] = {"sequential_ms": times[pair[0]], "speedup": med[pair[0]] / med[pair[1]]}
                    if key in ("schedule_fused", "epilogue_combine", "epilogue_only", "schedule_interleaved",
                               "rank_partials"):
                        row[key]["fused_ms"] = times[pair[1]]
                    elif key == "route_early":
                        row[key]["early_ms"] = times[pair[1]]
                    elif key == "graph":
                        row[key]["graph_ms"] = times[pair[1]]
                    elif key == "schedule_nodes":
                        row[key]["pipelined_ms"] = times[pair[1]]
                    else:
                        row[key].update(pipelined_ms=times[pair[1]], num_chunks=args.pipeline_chunks)
            for bname, layer in layers.items():
                crossed = cross_node_bytes(layer)
                if crossed is not None:
                    row[bname + "_cross_node_bytes"] = crossed
            ds_style = [lay for lay in layers.values() if hasattr(lay, "deepspeed_moe")]
            any_uni = layers.get("reference") or (ds_style[0] if ds_style else
                                                  build_layers(shape, E, ep, ["stock"], status)["stock"])
            gemm_ms, rows = gemm_alone(any_uni, inputs(0)[0], mode, args, dist)
            flops = 2 * 3 * shape.hidden * shape.ffn * rows * (3 if mode == "fwdbwd" else 1)
            # Bytes leaving a rank: dispatch + combine, each pass; (ep-1)/ep of the rows are remote.
            nbytes = 2 * passes * T * shape.top_k * shape.hidden * 2 * (ep - 1) / ep
            comm_ms = nbytes / (peer * 1e9) * 1e3 if peer else 0.0
            row["gemm_alone_ms"] = gemm_ms
            row["experts_alone_ms"] = experts_alone(any_uni, inputs(0)[0], mode, args, dist)
            row["comm_at_peer_bw_ms"] = comm_ms
            row["practical_bound_ms"] = max(gemm_ms, comm_ms)
            row["physical_bound_ms"] = max(flops / (tflops * 1e12) * 1e3, comm_ms)
            results["rows"].append(row)
        if args.autotune:
            results.setdefault("autotune", {"budget_s": args.autotune_budget_s, "rows": []})
            results["autotune"]["rows"].append(autotune_shape(name, shape, E, ep, T, inputs, layers, status, args,
                                                              dist))
        del layers
        torch.cuda.empty_cache()

    if args.autotune:
        summarize_autotune(results["autotune"], args.modes)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_moe_layer.json"), "w") as f:
            json.dump(results, f, indent=2)
        print_table(results)
        print_profiles(results)
        if args.breakdown:
            for path in plot_breakdown(results, args.out):
                print(f"breakdown: {path}")
        if args.autotune:
            print_autotune(results["autotune"])
    dist.barrier()



if __name__ == "__main__":
    main()
