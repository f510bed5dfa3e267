"""Does the tiny model learn to use the calculator? The bundled calculator task with tools against its no-tools twin.

    python scripts/learning_calculator.py --out docs/results/learning_calculator.json
    python scripts/learning_calculator.py --seeds 0,1,2 --steps 40 --plot docs/calculator_curve.png

Each run is `configs/calculator-tools.yaml` (SFT warm-up on the bundled demonstrations, then GRPO on multi-turn
episodes with the calculator, env.name=tools), one per seed; the twin is the same config, budget and
demonstrations with the tools turned off (`env.args.tools=[] sft.tools=[] data.messages_key=direct
env.max_turns=1`: the demonstrations answer directly, the model answers in one turn). A run's reward is the
environment's (exact match of the final answer, `env/reward`) of the episodes it sampled; its start and end are
the means over the first and last `--window` RL steps, the rise is end - start. The table prints each seed;
the JSON holds every run's curve; the PNG plots the reward per step (each seed, both variants).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = os.path.join(ROOT, "configs", "calculator-tools.yaml")
# The no-tools twin: the same run without the tool (documented in the config's header and docs/agentic.md).
VARIANTS = {
    "tools": [],
    "no_tools": ["env.args.tools=[]", "sft.tools=[]", "data.messages_key=direct", "env.max_turns=1"],
}


def run_one(work: str, variant: str, seed: int, steps: int, extra: list[str], reuse: bool = False) -> list[dict]:
    """One training run (a subprocess, as a user runs it); returns its metrics records. `reuse`: read the
    records a run in `work` already wrote (the steps it got to) instead."""
    from jaxrlhf.metrics import read_metrics

    out = os.path.join(work, f"{variant}-seed{seed}")
    if reuse:
        return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "env/reward" in r]
    cmd = [sys.executable, "-m", "jaxrlhf.train", "--config", CONFIG, f"run.output_dir={out}", f"run.steps={steps}",
           f"run.seed={seed}", "run.tensorboard=false", "run.export_hf=false", "run.save_checkpoints=false",
           *VARIANTS[variant], *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if proc.returncode != 0:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "env/reward" in r]


def summary(records: list[dict], window: int) -> dict:
    reward = [r["env/reward"] for r in records]
    start, end = statistics.fmean(reward[:window]), statistics.fmean(reward[-window:])
    last = records[-window:]
    return {"start": start, "end": end, "rise": end - start, "reward": reward,
            "tool_calls_end": statistics.fmean(r.get("env/tool_calls", 0.0) for r in last),
            "malformed_end": statistics.fmean(r.get("env/malformed_tool_call", 0.0) for r in last),
            "turns_end": statistics.fmean(r["env/turns"] for r in last)}


def plot(runs: dict[str, dict], path: str, steps: int) -> None:
    """The reward per RL step, a line per run (scripts/plot_metrics.py's matplotlib setup)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"tools": "tab:blue", "no_tools": "tab:red"}
    for key, run in runs.items():
        label = f"{'with' if run['variant'] == 'tools' else 'without'} the calculator" if run["seed"] == 0 else None
        ax.plot(range(1, len(run["reward"]) + 1), run["reward"], color=colors[run["variant"]], alpha=0.8,
                linewidth=1.2, label=label)
    ax.set_xlabel("GRPO step (after the SFT warm-up)")
    ax.set_ylabel("reward (exact final answer)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"Calculator task, tiny byte-level model: {len({r['seed'] for r in runs.values()})} seeds, "
                 f"{steps} steps")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window", type=int, default=5, help="RL steps averaged for the start and the end")
    p.add_argument("--variants", default="tools,no_tools")
    p.add_argument("--out", help="write the JSON here (a new file)")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "calculator_curve.png"), help="the curve's PNG")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (each a process on its own devices)")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true", help="summarise the runs already in --workdir, run nothing")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    if args.out and os.path.exists(args.out):
        sys.exit(f"error: {args.out} exists; name a new file")
    seeds = [int(x) for x in args.seeds.split(",")]
    variants = args.variants.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="learning_calculator_")
    runs: dict[str, dict] = {}
    t0 = time.time()
    jobs = [(seed, variant) for seed in seeds for variant in variants]

    def one(job: tuple[int, str]) -> tuple[str, dict]:
        seed, variant = job
        key = f"{variant} seed={seed}"
        records = run_one(work, variant, seed, args.steps, args.overrides, args.reuse)
        run = {"variant": variant, "seed": seed, "steps": len(records), **summary(records, args.window)}
        print(f"{key}: reward {run['start']:.3f} -> {run['end']:.3f} ({time.time() - t0:.0f} s)", flush=True)
        return key, run

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:  # each run is its own process
        runs.update(sorted(pool.map(one, jobs), key=lambda kv: (kv[1]["seed"], kv[1]["variant"] != "tools")))
    print(f"\nCalculator task, {args.steps} GRPO steps; reward = mean of the first / last {args.window} steps")
    print(f"{'seed':>4s} {'variant':9s} {'steps':>5s} {'start':>6s} {'end':>6s} {'rise':>7s} {'calls/ep':>8s} "
          f"{'malformed':>9s}")
    for run in runs.values():
        print(f"{run['seed']:4d} {run['variant']:9s} {run['steps']:5d} {run['start']:6.3f} {run['end']:6.3f} "
              f"{run['rise']:+7.3f} {run['tool_calls_end']:8.2f} {run['malformed_end']:9.2f}")
    table = {"rise_with_tools": {s: runs[f"tools seed={s}"]["rise"] for s in seeds if f"tools seed={s}" in runs},
             "final_with_tools": {s: runs[f"tools seed={s}"]["end"] for s in seeds if f"tools seed={s}" in runs},
             "final_without_tools": {s: runs[f"no_tools seed={s}"]["end"] for s in seeds
                                     if f"no_tools seed={s}" in runs}}
    with_tools, without = table["final_with_tools"], table["final_without_tools"]
    table["rises_by_0.2_on_every_seed"] = bool(with_tools) and min(table["rise_with_tools"].values()) >= 0.2
    table["beats_no_tools_on_every_seed"] = bool(with_tools) and bool(without) and all(
        with_tools[s] > without[s] for s in with_tools if s in without)
    print(json.dumps(table))
    result = {"steps": args.steps, "window": args.window, "seeds": seeds, "table": table, "runs": runs,
              "overrides": args.overrides, "seconds": time.time() - t0}
    if args.plot:
        plot(runs, args.plot, args.steps)
        print(f"curve: {args.plot}")
    if args.out:
        with open(args.out, "x") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
