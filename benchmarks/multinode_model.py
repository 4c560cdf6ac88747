"""Cost model of expert parallelism across nodes: ds_uniep's two-level dispatch against a flat all-to-all.

    python benchmarks/multinode_model.py --nodes 2 8 --gpus-per-node 8 --network-gbps 50 --out DIR

A model, not a measurement. An expert-parallel group of G = N * P ranks (N nodes of P GPUs), the
shapes of docs/performance.md (``ds_uniep.hybrid.presets.PRESETS``: M hidden, E experts, k
experts per token, T tokens per rank, bf16 rows), uniform random routing (each token picks k
distinct experts uniformly), E / G experts per rank on consecutive ranks.

Bytes per GPU per layer step (forward and backward), with the definitions of
``TwoLevelDispatcher._count_bytes`` (:mod:`ds_uniep.twolevel`):

- two-level, across nodes: each token once per remote node holding one of its experts, with its
  k int64 expert indices; the counts gathered across nodes; one row per (token, slot) on a remote
  node for the combine; for the backward, the dispatch's gradient one row per such (token, slot)
  and the combine's gradient grad_out's row once per (token, remote node) with 4-byte gates out and
  gate gradients back per (token, slot) (the megakernel across nodes, the GPUs' default); with
  ``--reference-path`` (the reference backend's two-level path) a second row per (token, slot);
- flat, across nodes: one row per remote (token, slot) each way, forward and backward (4 rows),
  and the counts all-gather;
- inside a node (NVLink): two-level, every row a relay forwards to another rank of its node, in
  each of the four movements, and the counts gathered inside the node; flat, the (token, slot) rows
  for other ranks of the source's own node, four times, and the counts.

:func:`expected_bytes` gives the exact expectation: a token has at least one of its k experts on
a given remote node (E / N experts there) with probability ``1 - C(E - E/N, k) / C(E, k)``, and a
(token, slot) row lands on a remote node with probability ``(N - 1) / N``.
:func:`sampled_bytes` samples the routing with torch and counts through
``TwoLevelDispatcher._count_bytes`` itself, without a process group, as a check of the formula.

Time per layer step: ``compute_ms`` (the layer's fwd+bwd time inside one node, an input), the
bytes across nodes at ``--network-gbps`` per GPU and the NVLink bytes at ``--nvlink-gbps`` per GPU
and direction. Two bounds per scheme: no overlap (compute + network + NVLink, one after the other)
and perfect overlap (the largest of the three: compute, network and NVLink are separate resources,
each busy all the time). ``compute_ms`` is measured on one node and so already holds that node's
own NVLink dispatch and combine; the no-overlap bound counts that traffic again. Prints a table
and writes ``multinode_model.json`` and ``multinode_model.png`` under ``--out``.
"""

import argparse
import json
import math
import os
import sys
import types
from typing import Dict, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ds_uniep from a checkout

from ds_uniep.hybrid.presets import PRESETS  # noqa: E402

#: Default compute time per shape (ms, one layer fwd+bwd on one node): the ep 4 MoE layer table of
#: docs/performance.md, fwd+bwd streamed, the faster megakernel row (dsv3-like ran E=32 there; a
#: rank receives T * k rows under uniform routing whatever E and G, so its GEMM work is the same).
#: Inputs of the model, overridable with ``--compute-ms SHAPE=MS``.
DEFAULT_COMPUTE_MS = {"mixtral-like": 30.83, "dsv2lite-like": 6.57, "dsv3-like": 17.14}

#: Network bandwidth per GPU and direction (GB/s): one 400 Gb/s NIC per GPU.
DEFAULT_NETWORK_GBPS = 50.0
#: NVLink bandwidth per GPU and direction (GB/s): H100/H200 NVLink 4 has 450 GB/s per direction;
#: docs/performance.md measured 353-370 GB/s for SM stores and 395 GB/s for copy-engine peer copies
#: between H200s, so 350 is what a dispatch kernel can expect to sustain.
DEFAULT_NVLINK_GBPS = 350.0

INDEX_BYTES = 8  # expert indices and counts travel as int64


def _check(E: int, k: int, N: int, P: int) -> None:
    if E % (N * P):
        raise ValueError(f"{E} experts cannot be spread evenly over {N * P} ranks")
    if not 1 <= k <= E:
        raise ValueError(f"top-k {k} outside 1..{E}")


def p_token_on_node(E: int, k: int, N: int) -> float:
    """Probability that a token's k distinct uniform experts include one of a given node's E / N."""
    return 1.0 - math.comb(E - E // N, k) / math.comb(E, k)


def expected_bytes(M: int, E: int, k: int, T: int, N: int, P: int, elem_bytes: int = 2,
                   grad_tokens_once: bool = True) -> Dict[str, float]:
    """Expected bytes one GPU sends per layer step (forward and backward) under uniform routing:
    across nodes (the parts of ``_count_bytes``, ``two_level`` and ``flat``) and over NVLink inside
    its node (``nvlink_two_level``, ``nvlink_flat``). Sent and received are equal in expectation.
    ``grad_tokens_once``: the megakernel's backward (False: the reference two-level path's)."""
    _check(E, k, N, P)
    G, row = N * P, M * elem_bytes
    tokens = T * (N - 1) * p_token_on_node(E, k, N)  # (token, remote node) pairs with a slot there
    pairs = T * k * (N - 1) / N  # (token, slot) rows whose expert is on another node
    b = {"dispatch_rows": tokens * row, "routing": tokens * k * INDEX_BYTES + (N - 1) * P * (E + N) * INDEX_BYTES,
         "combine_rows": pairs * row,
         "backward_rows": (tokens + pairs) * row + 8 * pairs if grad_tokens_once else 2 * pairs * row}
    b["two_level"] = sum(b.values())
    b["flat"] = 4 * pairs * row + (G - P) * E * INDEX_BYTES
    # A relay receives T * k / N rows for its node from each of the N ranks with its local rank
    # (itself included) and forwards the (P - 1) / P of them meant for another rank of its node.
    b["nvlink_two_level"] = 4 * T * k * (P - 1) / P * row + (P - 1) * (E + N) * INDEX_BYTES
    b["nvlink_flat"] = 4 * T * k * (P - 1) / G * row + (P - 1) * E * INDEX_BYTES
    return b


def _sample_routing(T: int, k: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, k]`` distinct uniform experts per token."""
    return torch.rand(T, E, generator=gen).topk(k, dim=1).indices


def sampled_bytes(M: int, E: int, k: int, T: int, N: int, P: int, elem_bytes: int = 2, seed: int = 0,
                  steps: int = 1, grad_tokens_once: bool = True) -> Dict[str, float]:
    """:func:`expected_bytes` by sampling: every rank's routing drawn ``steps`` times, the bytes
    across nodes counted by ``TwoLevelDispatcher._count_bytes`` (called on a stand-in holding the
    group's sizes, no process group needed), the NVLink rows counted row by row; per GPU, averaged."""
    from ds_uniep.twolevel import TwoLevelDispatcher
    _check(E, k, N, P)
    G, L = N * P, E // (N * P)
    gen = torch.Generator().manual_seed(seed)
    node_of = torch.arange(G) // P  # nodes of P consecutive ranks
    local_of = torch.arange(G) % P
    rank_of_expert = torch.arange(E) // L
    stand_in = types.SimpleNamespace(ep_size=G, num_experts=E, num_nodes=N, ranks_per_node=P, _node_of=node_of,
                                     num_local_experts=L, rank=0, _said_bytes=True,
                                     grad_tokens_once=grad_tokens_once)
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[elem_bytes]
    x = torch.empty(0, M, dtype=dtype)  # _count_bytes reads only the row size
    total: Dict[str, float] = {}
    for _ in range(steps):
        counts_all, tok_all = torch.zeros(G, E, dtype=torch.long), torch.zeros(G, N, dtype=torch.long)
        nvl_two, nvl_flat = 0, 0
        for g in range(G):
            idx = _sample_routing(T, k, E, gen)
            counts_all[g] = torch.bincount(idx.reshape(-1), minlength=E)
            dest = rank_of_expert[idx]  # [T, k]
            tok_all[g] = (node_of[dest].unsqueeze(-1) == torch.arange(N)).any(1).sum(0)
            nvl_two += int((local_of[dest] != local_of[g]).sum())  # the relay (node_of[dest], local g) forwards
            nvl_flat += int(((node_of[dest] == node_of[g]) & (dest != g)).sum())
        TwoLevelDispatcher._count_bytes(stand_in, counts_all, tok_all, x, k, 0)
        got = dict(stand_in.cross_node_bytes)
        row = M * elem_bytes
        got["nvlink_two_level"] = 4 * nvl_two * row + G * (P - 1) * (E + N) * INDEX_BYTES
        got["nvlink_flat"] = 4 * nvl_flat * row + G * (P - 1) * E * INDEX_BYTES
        for key, v in got.items():
            total[key] = total.get(key, 0.0) + v / (G * steps)
    return total


def layer_times(b: Dict[str, float], compute_ms: float, network_gbps: float, nvlink_gbps: float) -> Dict[str, dict]:
    """Per scheme: network and NVLink ms, and the layer's ms with no overlap (the sum) and with
    perfect overlap (the largest of compute, network and NVLink)."""
    out = {}
    for scheme in ("two_level", "flat"):
        net = b[scheme] / (network_gbps * 1e9) * 1e3
        nvl = b[f"nvlink_{scheme}"] / (nvlink_gbps * 1e9) * 1e3
        out[scheme] = {"network_ms": net, "nvlink_ms": nvl, "no_overlap_ms": compute_ms + net + nvl,
                       "overlap_ms": max(compute_ms, net, nvl)}
    return out


def _pairs(items, what: str, cast) -> Dict[str, float]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or name not in PRESETS:
            raise SystemExit(f"--{what} {item!r}: expected SHAPE=VALUE with SHAPE one of {', '.join(PRESETS)}")
        out[name] = cast(value)
    return out


def run_model(shapes, nodes, gpus_per_node: int, network_gbps: float, nvlink_gbps: float,
              compute_ms: Dict[str, float], experts: Dict[str, int], grad_tokens_once: bool = True):
    """The model's points (dicts) and the reasons for the skipped (shape, nodes)."""
    points, skipped = [], []
    for name in shapes:
        s = PRESETS[name]
        E = experts.get(name, s.num_experts)
        if name not in compute_ms:
            skipped.append(f"{name}: no compute time for it (give --compute-ms {name}=MS); skipped")
            continue
        for N in nodes:
            G = N * gpus_per_node
            if E < G or E % G:
                skipped.append(f"{name} at {N} x {gpus_per_node}: {E} experts cannot be spread evenly over {G} "
                               f"ranks (the expert count must be a multiple of the rank count; --experts "
                               f"{name}=E models another); skipped")
                continue
            b = expected_bytes(s.hidden, E, s.top_k, s.tokens_per_rank, N, gpus_per_node, s.bytes_per_value,
                               grad_tokens_once)
            t = layer_times(b, compute_ms[name], network_gbps, nvlink_gbps)
            points.append({"shape": name, "hidden": s.hidden, "experts": E, "top_k": s.top_k,
                           "tokens_per_rank": s.tokens_per_rank, "nodes": N, "gpus_per_node": gpus_per_node,
                           "ranks": G, "p_token_on_remote_node": p_token_on_node(E, s.top_k, N),
                           "bytes_per_gpu": b, "compute_ms": compute_ms[name],
                           "ratio_two_level_over_flat": b["two_level"] / b["flat"] if b["flat"] else None, **t})
    return points, skipped


def table(points) -> str:
    head = ("| shape | E | nodes x GPUs | GB across nodes / GPU two-level | flat | ratio | NVLink GB / GPU two-level "
            "| flat | compute ms | two-level ms no overlap / overlapped | flat ms no overlap / overlapped |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for p in points:
        b = p["bytes_per_gpu"]
        ratio = f"{p['ratio_two_level_over_flat']:.3f}" if p["ratio_two_level_over_flat"] is not None else "-"
        tl, fl = p["two_level"], p["flat"]
        lines.append(f"| {p['shape']} | {p['experts']} | {p['nodes']} x {p['gpus_per_node']} | "
                     f"{b['two_level'] / 1e9:.3f} | {b['flat'] / 1e9:.3f} | {ratio} | "
                     f"{b['nvlink_two_level'] / 1e9:.3f} | {b['nvlink_flat'] / 1e9:.3f} | {p['compute_ms']:.2f} | "
                     f"{tl['no_overlap_ms']:.2f} / {tl['overlap_ms']:.2f} | "
                     f"{fl['no_overlap_ms']:.2f} / {fl['overlap_ms']:.2f} |")
    return "\n".join(lines)


def plot(points, path: str, network_gbps: float) -> None:
    """Per (shape, nodes) two stacked bars, two-level and flat: compute, network, NVLink (the
    no-overlap time); a black tick at the perfect-overlap time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(points) + 2), 4.5))
    width = 0.38
    colors = {"compute": "#8c8c8c", "network": "#d62728", "nvlink": "#1f77b4"}
    for i, p in enumerate(points):
        for j, (scheme, hatch) in enumerate((("two_level", ""), ("flat", "//"))):
            x = i + (j - 0.5) * width
            t = p[scheme]
            bottom = 0.0
            for part, value in (("compute", p["compute_ms"]), ("network", t["network_ms"]),
                                ("nvlink", t["nvlink_ms"])):
                label = part if i == 0 and j == 0 else None
                ax.bar(x, value, width, bottom=bottom, color=colors[part], hatch=hatch, edgecolor="white",
                       label=label)
                bottom += value
            ax.plot([x - width / 2, x + width / 2], [t["overlap_ms"]] * 2, color="black", lw=2,
                    label="perfect overlap" if i == 0 and j == 0 else None)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([f"{p['shape']}\nE={p['experts']}, {p['nodes']}x{p['gpus_per_node']}" for p in points],
                       fontsize=8)
    ax.set_ylabel("ms per layer, fwd+bwd (model)")
    ax.set_title(f"Two-level (plain) vs flat (hatched), {network_gbps:g} GB/s network per GPU; "
                 "bar: no overlap", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_COMPUTE_MS), choices=list(PRESETS))
    p.add_argument("--nodes", nargs="+", type=int, default=[2, 8])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--network-gbps", type=float, default=DEFAULT_NETWORK_GBPS,
                   help="network GB/s per GPU and direction (default 50: a 400 Gb/s NIC per GPU)")
    p.add_argument("--nvlink-gbps", type=float, default=DEFAULT_NVLINK_GBPS,
                   help="NVLink GB/s per GPU and direction (default 350)")
    p.add_argument("--compute-ms", nargs="*", metavar="SHAPE=MS",
                   help="the layer's fwd+bwd ms inside one node (default: docs/performance.md's ep 4 rows)")
    p.add_argument("--experts", nargs="*", metavar="SHAPE=E", help="experts of a shape (default: the preset's)")
    p.add_argument("--reference-path", action="store_true",
                   help="model the reference backend's two-level path (a row per (token, slot) for the combine's "
                   "gradient) instead of the megakernel across nodes")
    p.add_argument("--check", action="store_true",
                   help="also sample the routing (Monte Carlo, --check-tokens per rank) and compare")
    p.add_argument("--check-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="folder for multinode_model.json and .png")
    args = p.parse_args(argv)
    if min(args.nodes) < 1 or args.gpus_per_node < 1 or args.network_gbps <= 0 or args.nvlink_gbps <= 0:
        raise SystemExit("--nodes, --gpus-per-node, --network-gbps and --nvlink-gbps must be positive")
    compute = dict(DEFAULT_COMPUTE_MS, **_pairs(args.compute_ms, "compute-ms", float))
    experts = _pairs(args.experts, "experts", int)
    once = not args.reference_path
    points, skipped = run_model(args.shapes, args.nodes, args.gpus_per_node, args.network_gbps, args.nvlink_gbps,
                                compute, experts, once)
    print(f"Model (not a measurement): uniform routing, network {args.network_gbps:g} GB/s and NVLink "
          f"{args.nvlink_gbps:g} GB/s per GPU and direction; compute ms are inputs (one node, fwd+bwd); "
          "bytes sent per GPU per layer step, forward and backward; two-level: "
          + ("the reference backend's path." if args.reference_path else "the megakernel across nodes."))
    for reason in skipped:
        print(reason)
    if args.check:
        for pt in points:
            s = PRESETS[pt["shape"]]
            T = min(args.check_tokens, s.tokens_per_rank)
            args_ = (s.hidden, pt["experts"], s.top_k, T, pt["nodes"], pt["gpus_per_node"], s.bytes_per_value)
            exp, got = expected_bytes(*args_, grad_tokens_once=once), sampled_bytes(*args_, grad_tokens_once=once)
            dev = max(abs(got[key] / exp[key] - 1) for key in exp if exp[key])
            pt["check"] = {"tokens_per_rank": T, "max_rel_deviation": dev}
            print(f"check {pt['shape']} {pt['nodes']} x {pt['gpus_per_node']} at T={T}: sampled bytes within "
                  f"{100 * dev:.2f}% of the formula")
    print(table(points))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multinode_model.json"), "w") as f:
            json.dump({"model": "uniform routing; compute_ms an input; not a measurement",
                       "two_level_path": "reference" if args.reference_path else "megakernel",
                       "network_gbps": args.network_gbps, "nvlink_gbps": args.nvlink_gbps,
                       "points": points, "skipped": skipped}, f, indent=1)
        if points:
            plot(points, os.path.join(args.out, "multinode_model.png"), args.network_gbps)
        print(f"wrote {args.out}/multinode_model.json" + (" and multinode_model.png" if points else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
