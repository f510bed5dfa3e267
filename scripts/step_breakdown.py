"""Where a run's steps went: the step breakdown of `metrics.jsonl` as a table plus JSON.

    python scripts/step_breakdown.py runs/quickstart/metrics.jsonl [--skip 1] [--out breakdown.json]

Reads the timing metrics every step writes (`jaxrlhf.placement.timeline`): the step split into
compute, move, host and other (they add up to the step), and per call its run time (device busy
with it), wait (dispatched but queued behind its inputs or other work on its devices) and the time
its inputs and parameters took to move there. Means over the steps after `--skip` (default 1: the
first step compiles), so that the parts still add up to the step.
"""

from __future__ import annotations

import argparse
import json
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


def table(b: dict) -> str:
    step = b["step_s"] or float("nan")
    lines = [f"step {b['step_s']:.3f} s (mean of {b['steps']} steps)", ""]
    lines.append(f"{'part':<10}{'seconds':>10}{'share':>8}")
    for c, s in b["split"].items():
        lines.append(f"{c:<10}{s:>10.3f}{100 * s / step:>7.1f}%")
    lines += ["", f"{'call':<22}{'run s':>9}{'wait s':>9}{'move s':>9}"]
    for c, t in b["calls"].items():
        lines.append(f"{c:<22}{t['run_s']:>9.3f}{t['wait_s']:>9.3f}{t['move_s']:>9.3f}")
    lines += ["", "moves (may overlap compute): " + ", ".join(f"{k} {v:.3f} s" for k, v in b["moves"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--skip", type=int, default=1, help="leading steps to leave out (compilation)")
    p.add_argument("--out", help="write the breakdown as JSON here")
    args = p.parse_args(argv)
    try:
        with open(args.metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        print(f"step_breakdown: cannot read {args.metrics}: {e.strerror}", file=sys.stderr)
        return 2
    records = [r for r in records if "time/step_s" in r][args.skip:]
    if not records:
        print(f"step_breakdown: {args.metrics} has no timed steps after the first {args.skip}", file=sys.stderr)
        return 2
    b = breakdown(records)
    print(table(b))
    print(json.dumps(b))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(b, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
