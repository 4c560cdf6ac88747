"""The tables ``bench_moe_layer.py`` prints: the layer times with the bounds and the ratios, the
profiles, the alternating A/B timings."""

# Every timed row and its column label, in table order.
_LABELS = {"stock": "stock", "autoep": "autoep", "autoep-deepep": "autoep deepep", "deepep": "deepep",
           "reference": "reference", "megakernel": "megakernel", "megakernel-torch-gemm": "mk torch gemm",
           "megakernel-pipelined": "mk pipelined", "megakernel-pipelined-sm": "mk pipelined sm",
           "megakernel-fused": "mk fused", "megakernel-fused-push": "mk fused push",
           "megakernel-fused-epilogue": "mk fused epilogue", "megakernel-fused-interleaved": "mk fused interleaved",
           "megakernel-rank-partials": "mk rank partials", "megakernel-sync-free": "mk sync free",
           "megakernel-graph": "mk graph", "megakernel-pipelined-nodes": "mk pipelined nodes"}
_TIMED = tuple(_LABELS)
_PEERS = ("autoep", "autoep-deepep", "deepep")  # the other stacks' layers (stock aside)
_OURS = tuple(b for b in _TIMED if b not in _PEERS + ("stock", ))  # the ds_uniep layers


def print_times(results, suffix="_ms"):
    """The table of one timing (``suffix`` "_ms": runs started from a barrier; "_streamed_ms": per step of
    back-to-back steps) with the bounds and the best ds_uniep layer's ratios."""
    shown = [b for b in _TIMED if any(b + suffix in r or b + "_why_not" in r for r in results["rows"])]
    head = (["shape", "mode"] + [_LABELS[b] for b in shown] +
            ["gemm alone", "experts alone", "practical", "physical", "vs stock", "vs fastest peer", "best/practical"])
    print(" | ".join(head))
    notes = {}
    for r in results["rows"]:
        cells = [r["shape"], r["mode"]]
        for b in shown:
            cells.append(f"{r[b + suffix]:.2f}" if b + suffix in r else "n/a*" if b + "_why_not" in r else "-")
            if b + "_why_not" in r:
                notes.setdefault((b, r[b + "_why_not"]), []).append(f"{r['shape']} {r['mode']}")
        for k in ("gemm_alone_ms", "experts_alone_ms", "practical_bound_ms", "physical_bound_ms"):
            cells.append(f"{r[k]:.2f}" if k in r else "-")
        ours = [r[b + suffix] for b in _OURS if b + suffix in r]
        peers = [r[b + suffix] for b in _PEERS if b + suffix in r]
        best = min(ours) if ours else None
        cells.append(f"{r['stock' + suffix] / best:.2f}x" if best and "stock" + suffix in r else "-")
        cells.append(f"{min(peers) / best:.2f}x" if best and peers else "-")
        cells.append(f"{best / r['practical_bound_ms']:.2f}" if best else "-")
        print(" | ".join(cells))
    return notes


def print_profiles(results):
    """Per layer profiled (``--profile-steps``): rank 0's GPU time per step by kind of kernel."""
    lines = []
    for r in results["rows"]:
        for b in _TIMED:
            p = r.get(b + "_profile")
            if p is None:
                continue
            cats = ", ".join(f"{c} {v:.2f}" for c, v in p["categories"].items())
            lines.append(f"{r['shape']} {r['mode']} {b}: {p['window_ms']:.2f} ms from the first kernel to the "
                         f"last, busy {p['busy_ms']:.2f}, idle {p['idle_ms']:.2f}, concurrent "
                         f"{p['concurrent_ms']:.2f}; {cats}")
            ranks = p.get("ranks") or []
            if len(ranks) > 1:
                spread = {c: [q["categories"].get(c, 0.0) for q in ranks] for c in list(p["categories"])[:4]}
                lines.append("  over the ranks (min-max): " + ", ".join(
                    [f"busy {min(q['busy_ms'] for q in ranks):.2f}-{max(q['busy_ms'] for q in ranks):.2f}"]
                    + [f"{c} {min(v):.2f}-{max(v):.2f}" for c, v in spread.items()]))
            idlest = max(range(len(ranks)), key=lambda i: ranks[i]["idle_ms"]) if len(ranks) > 1 else 0
            for who, q in [("", p)] + ([(f"rank {idlest}, the most idle: ", ranks[idlest])] if idlest else []):
                for g in q.get("top_gaps", [])[:4]:
                    if g["ms"] >= 0.01:
                        lines.append(f"  {who}idle {g['ms']:.2f} ({g['count']:g} per step, longest "
                                     f"{g['longest_us']:.0f} us) after {g['after']} | before {g['before']}")
    if lines:
        print("\nwhere the GPU time goes, ms per step (profiled, rank 0; kernels by kind, summed over streams)")
        print("\n".join(lines))


# The alternating timings of two layers: row key -> (what is compared, the first layer's name, the second's
# name and its times' key); the first layer's times are under "sequential_ms".
_ALTERNATING = {
    "schedule": ("pipelined ({chunks} chunks; torch's GEMM, copy engines) vs sequential", "sequential", "pipelined",
                 "pipelined_ms"),
    "schedule_sm": ("pipelined ({chunks} chunks; ds_uniep's GEMM, SM copies) vs sequential", "sequential",
                    "pipelined", "pipelined_ms"),
    "schedule_fused": ("fused vs sequential (ds_uniep's GEMM)", "sequential", "fused", "fused_ms"),
    "epilogue_combine": ("fused: epilogue combines vs rows pushed by the combine kernels", "pushed", "epilogue",
                         "fused_ms"),
    "epilogue_only": ("sequential dispatch + epilogue combines vs sequential (ds_uniep's GEMM)", "sequential",
                      "epilogue", "fused_ms"),
    "schedule_interleaved": ("fused (interleaved roles) vs sequential (ds_uniep's GEMM)", "sequential", "fused",
                             "fused_ms"),
    "rank_partials": ("combine of rank partials vs slot rows (ds_uniep's GEMM, sequential)", "slots", "rank partials",
                      "fused_ms"),
    "route_early": ("dispatch queued after the routes vs after the whole gate (torch's GEMM)", "late", "early",
                    "early_ms"),
    "graph": ("CUDA graph replay (sync_free) vs eager (torch's GEMM)", "eager", "graph", "graph_ms"),
    "schedule_nodes": ("pipelined across nodes (this node's rows' GEMM while the others cross) vs sequential "
                       "(ds_uniep's GEMM)", "sequential", "pipelined", "pipelined_ms"),
}


def print_table(results):
    print(f"\nep={results['ep']}  peer copy {results['peer_copy_GBps'] or 0:.0f} GB/s  "
          f"dense bf16 {results['dense_bf16_TFLOPs']:.0f} TFLOP/s  megakernel: {results['megakernel']}")
    notes = print_times(results)
    if "streamed" in results:
        print(f"\nstreamed: ms per step of {results['streamed']['steps']} back-to-back steps (median of "
              f"{results['streamed']['rounds']} bursts, slowest rank); bounds as above")
        print_times(results, "_streamed_ms")
    def times(v):
        return "/".join(f"{x:.2f}" for x in v)
    for key, (what, first, second, second_key) in _ALTERNATING.items():
        for r in results["rows"]:
            d = r.get(key)
            if d is not None:
                print(f"{what.format(chunks=d.get('num_chunks'))}, {r['shape']} {r['mode']}: {d['speedup']:.3f}x "
                      f"({first} {times(d['sequential_ms'])} ms, {second} {times(d[second_key])} ms; medians, "
                      "alternating)")
    for r in results["rows"]:
        for name in _TIMED:
            b = r.get(name + "_cross_node_bytes")
            if b:
                print(f"bytes across nodes, {name}, {r['shape']} {r['mode']} (one step, all ranks, forward and "
                      f"backward): two-level {b['two_level'] / 2**20:.1f} MiB, a flat all-to-all "
                      f"{b['flat'] / 2**20:.1f} MiB ({b['two_level'] / b['flat']:.3f}x)")
    for (name, reason), where in notes.items():
        print(f"* {name} could not run ({', '.join(where)}): {reason}")
    if "autoep_note" in results:
        print(f"autoep: {results['autoep_note']}")


def plot_breakdown(results, out_dir):
    """``--breakdown``: per (shape, mode), one PNG of where rank 0's GPU time goes per step for every
    profiled layer: a stacked bar of the kinds of kernels (summed over streams, so with overlap the
    bar is longer than the step) and the GPU's idle time, with the step's window and both bounds as
    lines. Returns the files written."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for r in results["rows"]:
        profiled = [b for b in _TIMED if b + "_profile" in r]
        if not profiled:
            continue
        kinds = []
        for b in profiled:
            kinds += [c for c in r[b + "_profile"]["categories"] if c not in kinds]
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * len(profiled)))
        colors = plt.get_cmap("tab20").colors
        for y, b in enumerate(profiled):
            p, left = r[b + "_profile"], 0.0
            for i, c in enumerate(kinds + ["idle"]):
                width = p["idle_ms"] if c == "idle" else p["categories"].get(c, 0.0)
                ax.barh(y, width, left=left, color="lightgrey" if c == "idle" else colors[i % len(colors)],
                        edgecolor="white", label=c if y == 0 else None)  # every kind has a bar in each row
                left += width
            ax.plot([p["window_ms"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        for key, style, label in (("practical_bound_ms", "--", "practical bound"),
                                  ("physical_bound_ms", ":", "physical bound")):
            if key in r:
                ax.axvline(r[key], color="red", linestyle=style, label=label)
        ax.set_yticks(range(len(profiled)), [_LABELS[b] for b in profiled])
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (rank 0; black tick: first kernel to last)")
        ax.set_title(f"{r['shape']} {r['mode']}, ep {results.get('ep', '?')}: GPU time by kind of kernel")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, f"breakdown_{r['shape']}_{r['mode']}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
