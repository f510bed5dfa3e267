"""Where a run's steps went: the step breakdown of `metrics.jsonl` as a table plus JSON.

    python scripts/step_breakdown.py runs/quickstart/metrics.jsonl [--skip 1] [--out breakdown.json]
        [--config FILE [--profile NAME_OR_FILE] [--devices N] [--set key=value ...]]

Reads the timing metrics every step writes (`jaxrlhf.placement.timeline`): the step split into
compute, move, host and other (they add up to the step), and per call its run time (device busy
with it), wait (dispatched but queued behind its inputs or other work on its devices) and the time
its inputs and parameters took to move there. Means over the steps after `--skip` (default 1: the
first step compiles), so that the parts still add up to the step.

With `--config` (the run's config and `--set` overrides), each call's run time is also set against its
math: the planner's FLOPs and HBM bytes per device for that call (`jaxrlhf.planner.cost`, under the plan
the run wrote beside its metrics, `plan.yaml`, else the plan the config picks on `--devices` devices)
over the matmul rate and memory bandwidth of `--profile` (e.g. one `jaxrlhf.placement.calibrate`
measured), else of the profile the run planned with (`hardware.yaml` beside the metrics), else of the
config's: `mfu` is the fraction of the FLOP bound a call reaches, `hbm` the fraction of the bandwidth
bound (the one that bounds a decode loop).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SPLIT = ("compute", "move", "host", "other")


def mean_of(records: list[dict], key: str) -> float:
    """Mean over the steps; a step without the key (a call that did not run) counts as 0."""
    return sum(r.get(key, 0.0) for r in records) / len(records)


def breakdown(records: list[dict]) -> dict:
    """Means of the step, its split, and each call's run / wait / move seconds."""
    calls = sorted({k[len("time/"):-len("/wait_s")] for r in records for k in r
                    if k.startswith("time/") and k.endswith("/wait_s")})
    step = mean_of(records, "time/step_s")
    return {
        "steps": len(records),
        "step_s": step,
        "split": {c: mean_of(records, f"time/step/{c}_s") for c in SPLIT},
        "calls": {c: {"run_s": mean_of(records, f"time/{c}_s"), "wait_s": mean_of(records, f"time/{c}/wait_s"),
                      "move_s": mean_of(records, f"time/{c}/move_s")} for c in calls},
        "moves": {k: mean_of(records, f"time/{k}_s") for k in ("realloc", "transfer", "reload")},
    }


def call_bounds(config: str, overrides: list[str], devices: int | None, profile: str | None,
                run_folder: str | None = None) -> dict:
    """Per call: FLOPs and HBM bytes per device by the planner's cost model, and the profile's rates."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import ExecutionPlan
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.run import planning
    from jaxrlhf.run.assembly import Machine, setup

    cfg = cfglib.load_config(config, overrides)
    run_setup = setup(cfg, machine=Machine.described(cfg, devices or cfg.run.devices or 1), runtime=False)
    algorithm, graph, models = run_setup.algorithm, run_setup.graph, run_setup.models
    ran = {name: os.path.join(run_folder or "", name) for name in ("plan.yaml", "hardware.yaml")}
    if run_folder and os.path.exists(ran["plan.yaml"]):  # the plan the run ran, whatever this machine is
        plan = ExecutionPlan.load(ran["plan.yaml"])
    else:
        plan = run_setup.choose_plan()
    if not profile and run_folder and os.path.exists(ran["hardware.yaml"]):
        profile = ran["hardware.yaml"]
    hw = get_profile(profile or planning.hardware_name(cfg))
    est = estimate_plan(plan, graph, models, algorithm.workload(), hw)
    return {call: {"flops": c.flops, "hbm_bytes": c.hbm_bytes, "hbm_rate": hw.memory_bandwidth(),
                   "flop_rate": hw.matmul_flops(models[graph[call].role].dtype)} for call, c in est.calls.items()}


def add_bounds(b: dict, bounds: dict) -> None:
    """Each call's `mfu` and `hbm`: its FLOPs and bytes over its run time, against the profile's rates."""
    for call, t in b["calls"].items():
        if call in bounds and t["run_s"] > 0:
            x = bounds[call]
            t.update(flops=x["flops"], hbm_bytes=x["hbm_bytes"], mfu=x["flops"] / t["run_s"] / x["flop_rate"],
                     hbm=x["hbm_bytes"] / t["run_s"] / x["hbm_rate"])


def table(b: dict) -> str:
    step = b["step_s"] or float("nan")
    lines = [f"step {b['step_s']:.3f} s (mean of {b['steps']} steps)", ""]
    lines.append(f"{'part':<10}{'seconds':>10}{'share':>8}")
    for c, s in b["split"].items():
        lines.append(f"{c:<10}{s:>10.3f}{100 * s / step:>7.1f}%")
    bounds = any("mfu" in t for t in b["calls"].values())
    lines += ["", f"{'call':<22}{'run s':>9}{'wait s':>9}{'move s':>9}"
              + (f"{'GFLOP':>11}{'MFU':>7}{'HBM':>7}" if bounds else "")]
    for c, t in b["calls"].items():
        lines.append(f"{c:<22}{t['run_s']:>9.3f}{t['wait_s']:>9.3f}{t['move_s']:>9.3f}" + (
            f"{t['flops'] / 1e9:>11.1f}{100 * t['mfu']:>6.1f}%{100 * t['hbm']:>6.1f}%" if "mfu" in t else ""))
    lines += ["", "moves (may overlap compute): " + ", ".join(f"{k} {v:.3f} s" for k, v in b["moves"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--skip", type=int, default=1, help="leading steps to leave out (compilation)")
    p.add_argument("--out", help="write the breakdown as JSON here")
    p.add_argument("--config", help="the run's config: set each call against its FLOP and bandwidth bounds")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="the run's config overrides (one --set with several, or several --set)")
    p.add_argument("--devices", type=int, help="the run's devices (default: run.devices, else 1)")
    p.add_argument("--profile", help="hardware profile name or file (default: the config's)")
    args = p.parse_args(argv)
    try:
        with open(args.metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        print(f"step_breakdown: cannot read {args.metrics}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"step_breakdown: {args.metrics} is not a metrics.jsonl (one JSON record per line): {e}", file=sys.stderr)
        return 2
    records = [r for r in records if "time/step_s" in r][args.skip:]
    if not records:
        print(f"step_breakdown: {args.metrics} has no timed steps after the first {args.skip}", file=sys.stderr)
        return 2
    b = breakdown(records)
    if args.config:
        try:  # a config or profile the planner refuses: ConfigError / PlanError are ValueErrors
            add_bounds(b, call_bounds(args.config, args.set, args.devices, args.profile,
                                      os.path.dirname(os.path.abspath(args.metrics))))
        except (KeyError, OSError, ValueError) as e:
            print(f"step_breakdown: {e}", file=sys.stderr)
            return 2
    print(table(b))
    print(json.dumps(b))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(b, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
