"""Cluster-scale planner benchmark: searched plans vs two expert baselines over ReaLHF's grid.

ReaLHF's setups: LLaMA-2 7B/13B/34B/70B, 2^17 tokens per batch, prompt 128,
generation 128 / 384 / 896 (batch 512 / 256 / 128), on H100-class nodes of 8;
three scenarios: four same-size models, a scaled actor (the actor at the size,
the critic, reference and reward 7B) and a scaled critic (likewise). Every
plan (searched and preset alike) is estimated in steady state (the simulator
runs until the step gaps repeat) with each call's micro-batch count and each
trained role's remat chosen for its placement (`planner.knobs`). For each setup:
the searched plan's step time, every preset's (with the knobs it needs to fit,
chosen the same way), and searched vs the better of
the two expert baselines: `heuristic` (the Megatron-style plan ReaLHF compares
with) and `verl` (a verl-style hybrid engine). These are the planner's model
only (no plan is run), so they do not depend on the machine's load; the search
times printed do (they are noisy on a shared machine). No absolute throughput
is reported here: scripts/validate_published.py holds the cost model to peers' published times.

    python scripts/bench_planner.py [--seeds 0] [--json docs/results/bench_planner.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxrlhf.models.config import preset
from jaxrlhf.planner import search as search_module
from jaxrlhf.planner.hardware import GB, get_profile
from jaxrlhf.planner.search import DEFAULT_ITERATIONS, search
from jaxrlhf.planner.workload import Workload
from jaxrlhf.testing.graphs import ppo_graph

GRAPH = ppo_graph()  # PPO with a reward model: the four models of ReaLHF's setups
ROLES = GRAPH.roles
TOKENS = 2**17
GEN_LENS = (128, 384, 896)
SCENARIOS = {  # scenario -> role -> size ("{}" = the setup's size)
    "same": {r: "{}" for r in ROLES},
    "scaled-actor": {"actor": "{}", "critic": "7b", "ref": "{}", "reward": "7b"},  # ref shares the actor's model
    "scaled-critic": {"actor": "7b", "critic": "{}", "ref": "7b", "reward": "{}"},  # reward shares the critic's
}
GRID = {
    "same": [("7b", 8), ("7b", 16), ("13b", 16), ("13b", 32), ("34b", 32), ("34b", 64), ("70b", 64), ("70b", 128)],
    "scaled-actor": [("13b", 16), ("34b", 32), ("70b", 64)],
    "scaled-critic": [("13b", 16), ("34b", 32), ("70b", 64)],
}
BASELINES = ("heuristic", "verl")


def workload(gen: int) -> Workload:
    """ReaLHF's token budget; each call's micro-batch count chosen per placement."""
    return Workload.from_tokens(TOKENS, 128, gen, micro_batch="auto", remat="auto")


def step(res, name: str) -> float | None:
    p = res.presets.get(name)
    return p.step_s if p is not None and not isinstance(p, str) and p.feasible else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--inter-node-gbps", type=float, help="override the profile's per-node NIC bandwidth")
    ap.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS)
    ap.add_argument("--seeds", default="0", help="the first seed's plan is reported; all give the spread")
    ap.add_argument("--spread-gens", default="128", help="generation lengths searched with every seed (others: "
                    "the first seed only, to keep the run short); 'all' for every row")
    ap.add_argument("--time-budget", type=float, default=600.0)
    ap.add_argument("--timing-devices", default="128,512", help="fresh-search timing at these device counts")
    ap.add_argument("--scenarios", default=",".join(GRID), help="comma-separated scenarios to run")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no search: join the rows of these --json files "
                    "(runs of different --scenarios, in order) and summarise them into --json")
    args = ap.parse_args()
    hw = get_profile(args.hardware)
    if args.inter_node_gbps:
        hw = hw.with_inter_host_bandwidth(args.inter_node_gbps * GB / 8)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.merge:
        parts = [json.load(open(path)) for path in args.merge]
        rows = [r for part in parts for r in part["rows"]]
        timing = {k: v for part in parts for k, v in ((part.get("summary") or {}).get("fresh_search_s") or {}).items()}
        _write(args, hw, rows, summarize(rows, {int(k): {"search_s": v} for k, v in timing.items()}, seeds))
        return
    rows = []
    header = (f"{'scenario':>13} {'model':>5} {'dev':>4} {'gen':>4} | {'colocated':>9} {'heuristic':>9} "
              f"{'verl':>9} | {'searched':>8} {'x best':>6} {'x heur':>6} {'x verl':>6} {'spread':>6} {'search':>7}")
    print(header)
    print("-" * len(header))
    for scenario, setups in GRID.items():
        if scenario not in args.scenarios.split(","):
            continue
        for size, n in setups:
            for gen in GEN_LENS:
                models = {r: preset(f"llama2-{s.format(size)}") for r, s in SCENARIOS[scenario].items()}
                wl = workload(gen)
                runs = []
                every = args.spread_gens == "all" or str(gen) in args.spread_gens.split(",")
                for seed in seeds if every else seeds[:1]:
                    t0 = time.perf_counter()
                    res = search(models, wl, hw, n, GRAPH, seed=seed, iterations=args.iterations,
                                 time_budget_s=args.time_budget)
                    runs.append((res, time.perf_counter() - t0))
                res, took = runs[0]
                steps = [r.best.step_s for r, _ in runs]
                s = res.best.step_s
                presets = {k: step(res, k) for k in res.presets}
                base = {k: presets.get(k) for k in BASELINES}
                best_base = min((v for v in base.values() if v), default=None)
                row = {
                    "scenario": scenario, "model": f"llama2-{size}", "devices": n, "gen_len": gen,
                    "batch": wl.batch_size, "presets": presets,
                    "reasons": {k: (v if isinstance(v, str) else v.reason) for k, v in res.presets.items()
                                if presets[k] is None},
                    "searched": s, "searched_by_seed": dict(zip(seeds, steps)),  # seeds searched for this row
                    "seed_spread": max(steps) / min(steps) - 1,
                    "x_best_baseline": best_base / s if best_base else None,
                    "x_heuristic": base["heuristic"] / s if base["heuristic"] else None,
                    "x_verl": base["verl"] / s if base["verl"] else None,
                    "x_colocated": presets["colocated"] / s if presets.get("colocated") else None,
                    "search_s": took, "search_s_by_seed": [t for _, t in runs], "evaluations": res.evaluations,
                    "budget_hit": res.budget_hit, "plan": res.best.plan.to_dict(), "knobs": {c: str(k) for c, k in res.best.knobs.items()},
                    "call_s": {k: v.seconds for k, v in res.best.calls.items()},
                    "baseline_plans": {k: res.presets[k].plan.to_dict() for k in BASELINES if base[k]},
                }
                rows.append(row)
                cell = lambda v, w=9: f"{v:{w}.2f}" if v is not None else f"{'n.a.':>{w}}"  # noqa: E731
                spread = f"{row['seed_spread'] * 100:5.1f}%" if len(steps) > 1 else "     -"
                print(f"{scenario:>13} {size:>5} {n:>4} {gen:>4} | {cell(presets.get('colocated'))} "
                      f"{cell(base['heuristic'])} {cell(base['verl'])} | {s:8.2f} {cell(row['x_best_baseline'], 6)} "
                      f"{cell(row['x_heuristic'], 6)} {cell(row['x_verl'], 6)} {spread} {took:6.1f}s", flush=True)
                if args.json:
                    _write(args, hw, rows, None)

    timing = {}
    for n in [int(x) for x in args.timing_devices.split(",") if x]:
        search_module._RESULTS.clear()
        models = {r: preset("llama2-70b") for r in ROLES}
        t0 = time.perf_counter()
        res = search(models, workload(128), hw, n, GRAPH, seed=0, iterations=args.iterations,
                     time_budget_s=args.time_budget)
        timing[n] = {"search_s": time.perf_counter() - t0, "step_s": res.best.step_s,
                     "budget_hit": res.budget_hit}
        print(f"fresh search, 4 x 70B on {n} devices: {timing[n]['search_s']:.1f} s "
              f"(step {res.best.step_s:.2f} s)", flush=True)

    summary = summarize(rows, timing, seeds)
    if args.json:
        _write(args, hw, rows, summary)


def summarize(rows: list[dict], timing: dict, seeds: list[int]) -> dict:
    """Median, worst and best of searched vs each baseline over the rows; printed and returned."""
    def stats(key: str) -> dict:
        xs = [r[key] for r in rows if r[key]]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rows": len(xs)} if xs else {}

    spread_rows = [r for r in rows if len(r["searched_by_seed"]) > 1] or rows
    summary = {
        "x_best_baseline": stats("x_best_baseline"), "x_heuristic": stats("x_heuristic"),
        "x_verl": stats("x_verl"), "x_colocated": stats("x_colocated"),
        "no_baseline": sum(1 for r in rows if not r["x_best_baseline"]),
        "max_seed_spread": max(r["seed_spread"] for r in spread_rows),
        "median_seed_spread": statistics.median(r["seed_spread"] for r in spread_rows),
        "rows_with_spread": len(spread_rows),
        "fresh_search_s": {str(k): v["search_s"] for k, v in timing.items()},
    }
    print()
    for key, what in (("x_best_baseline", "the better baseline"), ("x_heuristic", "heuristic (Megatron-style)"),
                      ("x_verl", "verl-style"), ("x_colocated", "colocated")):
        st = summary[key]
        if st:
            print(f"searched vs {what}: median {st['median']:.2f}x, worst {st['min']:.2f}x, best {st['max']:.2f}x "
                  f"over {st['rows']} rows")
    print(f"seed spread (max/min - 1 over seeds {seeds}): median {summary['median_seed_spread'] * 100:.1f}%, "
          f"max {summary['max_seed_spread'] * 100:.1f}% over {len(spread_rows)} rows")
    return summary


def _write(args, hw, rows, summary) -> None:
    with open(args.json, "w") as f:
        json.dump({"hardware": hw.to_dict(), "iterations": args.iterations, "seeds": args.seeds,
                   "micro_batches": "per call (planner.knobs)", "steady_state": True, "rows": rows,
                   "summary": summary}, f,
                  indent=1)


if __name__ == "__main__":
    main()
