"""Cluster-scale planner benchmark: the ReaLHF setups of DESIGN.md §5, simulated.

Four same-size LLaMA-2 roles (actor, critic, ref, reward), 2^17 tokens per
batch, prompt 128, generation 128 / 384 / 896 (batch 512 / 256 / 128), on
H100-class devices. For each setup: the searched plan's step time next to
every preset's, the speed-up over colocated and over the best preset, the
search time, and the effective throughput (model FLOPs per step / step time).

    python scripts/bench_planner.py [--iterations 4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxrlhf.planner.cost import Workload, matmul_params
from jaxrlhf.testing.graphs import ppo_graph
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.search import search
from jaxrlhf.models.config import preset

SETUPS = [("7b", 8), ("7b", 16), ("13b", 16), ("13b", 32), ("34b", 32), ("34b", 64), ("70b", 64), ("70b", 128)]
GEN_LENS = (128, 384, 896)
TOKENS = 2**17
GRAPH = ppo_graph()  # PPO with a reward model: the four models of ReaLHF's setups
ROLES = GRAPH.roles


def model_flops(models, wl: Workload) -> float:
    """Standard accounting: 2 N per token forward, 6 N per token train (generation counted as a forward)."""
    tokens = wl.batch_size * wl.seq_len
    fwd = {r: 2 * matmul_params(models[r], "lm" if r in ("actor", "ref") else "value") * tokens for r in models}
    return fwd["actor"] + fwd["reward"] + fwd["ref"] + fwd["critic"] + 3 * fwd["actor"] + 3 * fwd["critic"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--iterations", type=int, default=4000)
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    hw = get_profile(args.hardware)
    rows = []
    header = (f"{'model':>5} {'dev':>4} {'gen':>4} | {'colocated':>10} {'interleav':>10} {'disaggr':>10} "
              f"{'realloc':>10} | {'searched':>9} {'x coloc':>8} {'x best':>7} {'PFLOP/s':>8} {'search':>7}")
    print(header)
    print("-" * len(header))
    for size, n in SETUPS:
        for gen in GEN_LENS:
            models = {r: preset(f"llama2-{size}") for r in ROLES}
            wl = Workload.from_tokens(TOKENS, 128, gen)
            t0 = time.perf_counter()
            res = search(models, wl, hw, n, GRAPH, seed=args.seed, iterations=args.iterations, time_budget_s=args.time_budget)
            took = time.perf_counter() - t0
            presets = {k: (v.step_s if not isinstance(v, str) and v.feasible else None) for k, v in res.presets.items()}
            reasons = {k: (v if isinstance(v, str) else v.reason) for k, v in res.presets.items() if presets[k] is None}
            feasible = [v for v in presets.values() if v is not None]
            best_preset = min(feasible) if feasible else None
            s = res.best.step_s
            row = {
                "model": f"llama2-{size}", "devices": n, "gen_len": gen, "batch": wl.batch_size,
                "presets": presets, "reasons": reasons, "searched": s,
                "x_colocated": presets.get("colocated") / s if presets.get("colocated") else None,
                "x_best_preset": best_preset / s if best_preset else None,
                "pflops": model_flops(models, wl) / s / 1e15, "search_s": took, "evaluations": res.evaluations,
                "budget_hit": res.budget_hit, "plan": res.best.plan.to_dict(),
            }
            rows.append(row)
            cell = lambda v: f"{v:10.1f}" if v is not None else f"{'OOM/n.a.':>10}"  # noqa: E731
            print(f"{size:>5} {n:>4} {gen:>4} | {cell(presets.get('colocated'))} {cell(presets.get('interleaved'))} "
                  f"{cell(presets.get('disaggregated'))} {cell(presets.get('reallocated'))} | {s:9.1f} "
                  f"{(row['x_colocated'] or float('nan')):8.1f} {(row['x_best_preset'] or float('nan')):7.2f} "
                  f"{row['pflops']:8.2f} {took:6.1f}s", flush=True)
    xc = [r["x_colocated"] for r in rows if r["x_colocated"]]
    xb = [r["x_best_preset"] for r in rows if r["x_best_preset"]]
    summary = {
        "median_x_colocated": statistics.median(xc) if xc else None,
        "min_x_best_preset": min(xb) if xb else None,
        "median_x_best_preset": statistics.median(xb) if xb else None,
        "max_search_s": max(r["search_s"] for r in rows),
        "max_search_s_128": max((r["search_s"] for r in rows if r["devices"] == 128), default=None),
    }
    print()
    print(f"median speed-up over colocated: {summary['median_x_colocated']:.1f}x (goal >= 2x); "
          f"over the best preset: min {summary['min_x_best_preset']:.2f}x, median {summary['median_x_best_preset']:.2f}x "
          f"(goal >= 1); slowest search {summary['max_search_s']:.1f} s, at 128 devices "
          f"{summary['max_search_s_128']:.1f} s (goal < 60 s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hw.to_dict(), "iterations": args.iterations, "rows": rows, "summary": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
