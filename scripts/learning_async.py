"""Does GRPO still learn when its rollouts are stale? The bundled task at several staleness budgets.

    python scripts/learning_async.py --out docs/results/learning_async.json
    python scripts/learning_async.py --etas 0,1,2,4 --seeds 0,1,2 --corrections none,tis --steps 200

Each variant is `configs/quickstart-grpo.yaml` on its 2 simulated devices with the generator on a
device of its own (`plan.strategy=disaggregated`, so eta = 0 is the same placement run on-policy),
`algorithm.max_staleness=eta` and `algorithm.rollout_correction=C`, one run per seed. A run's score
is its sampled reward (`reward/mean`) over the last `--window` steps: the reward of the rollouts it
trained on, so a stale policy's samples count as the run saw them. The table prints, per variant,
the mean and standard deviation over seeds, the gap to eta = 0 with the same correction, and
whether that gap is within noise (|gap| <= 2 x the larger of the two standard errors); the JSON
holds every run's curve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_one(work: str, eta: int, correction: str, seed: int, steps: int, extra: list[str]) -> list[dict]:
    """One training run; returns its metrics records."""
    from jaxrlhf.metrics import read_metrics

    out = os.path.join(work, f"eta{eta}-{correction}-seed{seed}")
    cmd = [sys.executable, "-m", "jaxrlhf.train", "--config", os.path.join(ROOT, "configs", "quickstart-grpo.yaml"),
           f"run.output_dir={out}", f"run.steps={steps}", f"run.seed={seed}", "run.checkpoint_every=0",
           "run.tensorboard=false", "run.export_hf=false", "plan.strategy=disaggregated",
           f"algorithm.max_staleness={eta}", f"algorithm.rollout_correction={correction}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def score(records: list[dict], window: int) -> float:
    return statistics.fmean(r["reward/mean"] for r in records[-window:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--etas", default="0,1,2,4")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--corrections", default="none,tis")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=20, help="last steps whose sampled reward is the score")
    p.add_argument("--out", help="write the JSON here (a new file)")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    if args.out and os.path.exists(args.out):
        sys.exit(f"error: {args.out} exists; name a new file")
    etas = [int(x) for x in args.etas.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    corrections = args.corrections.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="learning_async_")
    runs: dict[str, dict] = {}
    t0 = time.time()
    for correction in corrections:
        for eta in etas:
            for seed in seeds:
                records = run_one(work, eta, correction, seed, args.steps, args.overrides)
                key = f"eta={eta} correction={correction} seed={seed}"
                runs[key] = {"eta": eta, "correction": correction, "seed": seed,
                             "score": score(records, args.window),
                             "first10": statistics.fmean(r["reward/mean"] for r in records[:10]),
                             "staleness_mean": statistics.fmean(r.get("rollout/staleness", 0.0) for r in records),
                             "reward": [r["reward/mean"] for r in records]}
                print(f"{key}: reward over the last {args.window} steps {runs[key]['score']:.3f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
    table = []
    for correction in corrections:
        base = [runs[k]["score"] for k in runs if runs[k]["correction"] == correction and runs[k]["eta"] == 0]
        for eta in etas:
            scores = [r["score"] for r in runs.values() if r["correction"] == correction and r["eta"] == eta]
            mean, sd = statistics.fmean(scores), statistics.stdev(scores) if len(scores) > 1 else 0.0
            row = {"eta": eta, "correction": correction, "mean": mean, "sd": sd, "seeds": len(scores)}
            if base:
                b_mean = statistics.fmean(base)
                b_se = statistics.stdev(base) / len(base) ** 0.5 if len(base) > 1 else 0.0
                se = sd / len(scores) ** 0.5
                row["gap_to_eta0"] = mean - b_mean
                row["within_noise"] = abs(mean - b_mean) <= 2 * max(se, b_se)
            table.append(row)
    print(f"\nGRPO on the bundled task, {args.steps} steps, sampled reward over the last {args.window} "
          f"(mean +- sd over {len(seeds)} seeds)")
    print(f"{'correction':10s} {'eta':>3s} {'reward':>14s} {'vs eta=0':>9s}  within noise")
    for row in table:
        gap = row.get("gap_to_eta0")
        print(f"{row['correction']:10s} {row['eta']:3d} {row['mean']:7.3f} +- {row['sd']:.3f} "
              f"{'' if gap is None else f'{gap:+9.3f}'}  {row.get('within_noise', '')}")
    result = {"steps": args.steps, "window": args.window, "seeds": seeds, "table": table, "runs": runs,
              "overrides": args.overrides, "seconds": time.time() - t0}
    print(json.dumps({"table": table}))
    if args.out:
        with open(args.out, "x") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
