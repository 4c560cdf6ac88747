"""Output of ``bench_hybrid.py``: the acceptance checks over a sweep, the table, the plot, the JSON."""

import json
import os


def summarize(points):
    """The acceptance checks over the sweep."""
    preds = [o for p in points for o in p["options"].values()]
    planner_ok = [p["planner"]["within_5pct"] for p in points]
    model_ok = [p["planner"]["model_within_5pct"] for p in points]
    grows, largest = {}, {}
    for key in sorted({(p["M"], p["F"]) for p in points}):
        row = sorted((p for p in points if (p["M"], p["F"]) == key), key=lambda p: p["token_bytes"])
        s = [p["speedup_best_hybrid"] for p in row]
        name = f"{key[0]}x{key[1]}"
        grows[name] = all(s[i + 1] >= 0.97 * s[i] for i in range(len(s) - 1))  # 3% for noise
        largest[name] = s[-1]
    overheads = [p["planner"]["auto_overhead"] for p in points if p["planner"]["auto_overhead"] is not None]
    errs = [abs(o["ratio"] - 1) for o in preds]
    uniform_errs = [abs(o["measured_ms"] / o["predicted_uniform_ms"] - 1) for o in preds]
    return {
        "model_within_15pct": sum(o["within_15pct"] for o in preds), "predictions": len(preds),
        "uniform_model_within_15pct": sum(e <= 0.15 for e in uniform_errs),
        "uniform_model_max_abs_error": max(uniform_errs),
        "model_max_abs_error": max(errs), "model_median_abs_error": sorted(errs)[len(errs) // 2],
        "planner_within_5pct": sum(planner_ok), "model_planner_within_5pct": sum(model_ok), "points": len(points),
        "speedup_grows_with_token_bytes": grows, "speedup_at_largest_tokens": largest,
        "max_auto_overhead_where_planner_keeps_ep": max(overheads) if overheads else None,
        "outputs_match": all(o["outputs_match"] for o in preds if o["outputs_match"] is not None),
        "checks": {
            "model_within_15pct_everywhere": all(o["within_15pct"] for o in preds),
            "planner_within_5pct_in_most": sum(planner_ok) > len(points) / 2,
            "speedup_grows_with_token_bytes": all(grows.values()),
            "speedup_at_least_2x_at_largest": max(largest.values()) >= 2.0,
            "overhead_at_most_2pct_where_planner_keeps_ep": all(o <= 0.02 for o in overheads) if overheads
            else None,
        },
    }


# --------------------------------------------------------------------------- output
def print_table(results):
    s = results["summary"]
    names = results["option_names"]
    print(f"\nHybridEP vs plain EP, {results['G']} ranks in sites of {results['config']['site_size']}, "
          f"inter-site {results['inter_bw_set_bytes_per_s'] / 1e9:g} GB/s set, "
          f"{results['bandwidth_at_start_bytes_per_s']['inter_site_paced'] / 1e9:.3g} GB/s measured; "
          f"fwd+bwd ms per micro-batch (steps of {results['config']['microbatches']}), slowest rank's median "
          "(model's prediction); x = measured/model")
    head = ["MxF", "T", "D MiB", "P MiB"] + names + ["planner", "plan/best", "speedup", "auto ovh", "max err"]
    print(" | ".join(head))
    for p in results["points"]:
        cells = [f"{p['M']}x{p['F']}", str(p["T"]), f"{p['token_bytes'] / 2**20:.1f}",
                 f"{p['expert_bytes'] / 2**20:.1f}"]
        for name in names:
            o = p["options"][name]
            cells.append(f"{o['measured_ms']:.2f} ({o['predicted_ms']:.2f}) x{o['ratio']:.2f}")
        pl = p["planner"]
        cells.append(f"{pl['runtime_choice']}/{pl['model_choice']}")
        cells.append(f"{pl['runtime_ms'] / p['best_ms']:.3f}")
        cells.append(f"{p['speedup_best_hybrid']:.2f}x")
        cells.append("-" if pl["auto_overhead"] is None else f"{100 * pl['auto_overhead']:+.1f}%")
        errs = [e for o in p["options"].values() for e in (o["rel_err_out"], o["rel_err_dx"]) if e is not None]
        cells.append(f"{max(errs):.1e}" if errs else "-")
        print(" | ".join(cells))
    c = s["checks"]
    ovh = s["max_auto_overhead_where_planner_keeps_ep"]
    print(f"model within 15%: {s['model_within_15pct']}/{s['predictions']} (median |err| "
          f"{100 * s['model_median_abs_error']:.1f}%, max {100 * s['model_max_abs_error']:.1f}%; the uniform "
          f"routing's: {s['uniform_model_within_15pct']}/{s['predictions']}, max "
          f"{100 * s['uniform_model_max_abs_error']:.1f}%); planner "
          f"(runtime/model inputs) within 5% of best: {s['planner_within_5pct']}/{s['points']} / "
          f"{s['model_planner_within_5pct']}/{s['points']}; speedup at largest T: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in s["speedup_at_largest_tokens"].items())
          + f"; grows with token bytes: {c['speedup_grows_with_token_bytes']}; auto overhead where EP is kept: "
          + ("-" if ovh is None else f"{100 * ovh:+.1f}%") + f"; outputs match EP: {s['outputs_match']}")
    for p in results["points"]:
        r = p.get("replanned")
        if r is not None:
            print(f"replanned at {p['M']}x{p['F']} T={p['T']}: started S={r['start'][0]} m={r['start'][1]}, planned "
                  f"S={r['planned'][0]} m={r['planned'][1]} ({100 * r['predicted_gain']:.1f}% predicted gain; "
                  f"experts' forward {'measured' if r['compute'] == 'measure' else 'estimated'} at "
                  f"{r['expert_compute_ms']:.3f} ms), "
                  f"{'switched' if r['switched'] else 'kept'}: runs S={r['domain_size']} m={r['migrated_experts']} "
                  f"{r['chosen_experts'] or ''}, {r['ms']:.2f} ms = "
                  f"{r['vs_best']:.3f}x the best option ({p['best']}), {r['speedup_vs_ep']:.2f}x EP, outputs match "
                  f"EP: {r['outputs_match']}")
    print("checks: " + ", ".join(f"{k}={v}" for k, v in c.items()))


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(p["M"], p["F"]) for p in results["points"]})
    names = results["option_names"]
    fig, axes = plt.subplots(2, len(keys), figsize=(5 * len(keys), 8), squeeze=False)
    for j, key in enumerate(keys):
        row = sorted((p for p in results["points"] if (p["M"], p["F"]) == key), key=lambda p: p["token_bytes"])
        x = [p["token_bytes"] / 2**20 for p in row]
        ax = axes[0][j]
        for i, name in enumerate(names):
            color = f"C{i}"
            ax.plot(x, [p["options"][name]["measured_ms"] for p in row], "o-", color=color, label=f"{name} measured")
            ax.plot(x, [p["options"][name]["predicted_ms"] for p in row], "--", color=color, label=f"{name} model")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"M={key[0]} F={key[1]}")
        ax.set_xlabel("token bytes per rank D (MiB)")
        ax.set_ylabel("forward+backward (ms)")
        ax.legend(fontsize=7)
        ax = axes[1][j]
        ax.plot(x, [p["speedup_best_hybrid"] for p in row], "o-", label="best HybridEP / EP")
        ax.plot(x, [p["speedup_planner"] for p in row], "s--", label="planner / EP")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_xscale("log")
        ax.set_xlabel("token bytes per rank D (MiB)")
        ax.set_ylabel("speedup over plain EP")
        ax.legend(fontsize=7)
    fig.suptitle(f"HybridEP, {results['G']} ranks in sites of {results['config']['site_size']}, inter-site "
                 f"{results['inter_bw_set_bytes_per_s'] / 1e9:g} GB/s (paced)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results, out, with_plot=True):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_hybrid.json"), "w") as f:
        json.dump(results, f, indent=2)
    if with_plot:
        plot(results, os.path.join(out, "bench_hybrid.png"))
