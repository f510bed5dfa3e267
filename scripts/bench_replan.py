"""Re-planning from a wrong profile, measured: what a live switch predicts, buys and costs.

    python scripts/bench_replan.py [--steps 24] [--every 6] [--workdir DIR] [--out results.json]

Runs the tiny GRPO of the re-planning test (jaxrlhf.testing.replan) on 8 simulated CPU devices with
`plan.strategy=auto`, a profile that claims generation on all 8 devices is nearly free, and
`plan.replan_every`; then runs the plan it started on and the plan it switched to, each from the
start as a plan file for the same steps, so the gain is also measured side by side. Prints and
(with --out, never over an existing file) writes: the predicted gain at the switch, the gain the
run measured (median step after / before), the side-by-side medians, and what the switch cost
(search, reshard, first step on the new plan). Timings depend on the machine being quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile


def median_step(records: list[dict], skip: set[int]) -> float:
    return statistics.median(r["time/step_s"] for r in records if r["step"] not in skip)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6, help="plan.replan_every")
    ap.add_argument("--workdir", help="run folders go here (default: a temporary folder)")
    ap.add_argument("--out", help="JSON results file (never replaced)")
    args = ap.parse_args(argv)
    if args.out and os.path.exists(args.out):
        print(f"error: {args.out} exists; choose another --out", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics
    from jaxrlhf.testing.replan import TINY_GRPO, write_wrong_profile

    work = args.workdir or tempfile.mkdtemp(prefix="bench_replan_")
    os.makedirs(work, exist_ok=True)
    base = [*TINY_GRPO, f"run.steps={args.steps}"]
    profile = write_wrong_profile(base, os.path.join(work, "wrong.yaml"))

    def run(name: str, extra: list[str]) -> list[dict]:
        out = os.path.join(work, name)
        train.run(cfglib.load_config(None, [*base, *extra, f"run.output_dir={out}"]))
        return read_metrics(os.path.join(out, "metrics.jsonl"))

    replanned = run("replanned", ["plan.strategy=auto", f"plan.profile={profile}", f"plan.replan_every={args.every}"])
    switches = [r for r in replanned if r.get("replan/switched") == 1.0]
    if not switches:
        print("the run did not switch plans", file=sys.stderr)
        return 1
    at = switches[0]["step"]
    first_plan = os.path.join(work, "first_plan.yaml")
    from jaxrlhf.run.assembly import Machine, setup

    cfg = cfglib.load_config(None, [*base, "plan.strategy=auto", f"plan.profile={profile}"])
    setup(cfg, machine=Machine.described(cfg, 8), runtime=False).choose_plan().save(first_plan)
    switched_plan = os.path.join(work, "replanned", "replan", f"plan_step{at}.yaml")
    before = run("first_plan", [f"plan.file={first_plan}"])
    after = run("switched_plan", [f"plan.file={switched_plan}"])
    later = [r for r in replanned if r["step"] > at and "replan/measured_gain" in r]
    result = {
        "steps": args.steps, "replan_every": args.every, "switch_step": at,
        "predicted_gain": switches[0]["replan/predicted_gain"],
        "predicted_step_s": {"before": switches[0]["replan/predicted_step_s"],
                             "after": switches[0]["replan/best_step_s"]},
        "measured_gain_in_run": later[0]["replan/measured_gain"] if later else None,
        "side_by_side_median_step_s": {"first_plan": median_step(before, {1}),
                                       "switched_plan": median_step(after, {1})},
        "switch_cost_s": {"search": switches[0]["replan/search_s"], "reshard": switches[0]["replan/switch_s"],
                          "first_step_on_new_plan": next(r["time/step_s"] for r in replanned if r["step"] == at + 1),
                          "median_step_on_new_plan": median_step([r for r in replanned if r["step"] > at + 1], set())},
    }
    side = result["side_by_side_median_step_s"]
    result["side_by_side_gain"] = side["first_plan"] / side["switched_plan"] - 1
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "x") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
