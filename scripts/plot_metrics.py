"""Render the curves of one or more runs' metrics.jsonl to a PNG.

    python scripts/plot_metrics.py runs/quickstart/metrics.jsonl [runs/other/metrics.jsonl ...] \
        --out curves.png [--keys reward/mean kl/mean ...] [--smooth 5]

Several files overlay one line per run (labelled by the run folder), which is how
seed-to-seed spread is shown honestly.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_KEYS = ("reward/mean", "kl/mean", "loss/policy", "loss/value", "entropy", "time/step_s")


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (the first points average what exists)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def run_label(path: str) -> str:
    """The run folder's name (metrics.jsonl sits in it), or the file name."""
    parts = path.rstrip("/").split("/")
    return parts[-2] if len(parts) > 1 and parts[-1] == "metrics.jsonl" else parts[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="path(s) to metrics.jsonl")
    p.add_argument("--out", default="metrics.png")
    p.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    p.add_argument("--smooth", type=int, default=1, help="moving-average window (steps)")
    args = p.parse_args(argv)

    runs = {}
    for path in args.metrics:
        try:
            with open(path) as f:
                runs[run_label(path)] = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            print(f"plot_metrics: cannot read {path}: {e}", file=sys.stderr)
            return 2
    keys = [k for k in args.keys if any(isinstance(r.get(k), (int, float)) for rs in runs.values() for r in rs)]
    if not keys:
        print(f"plot_metrics: none of {args.keys} found in {', '.join(args.metrics)}", file=sys.stderr)
        return 2

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(keys))
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, keys):
        for (label, records), color in zip(runs.items(), colors * len(runs)):
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            steps, vals = zip(*pts)
            if args.smooth == 1:
                ax.plot(steps, vals, color=color, lw=1, label=label)
            else:  # raw points faintly under the smoothed line; with several runs the smoothed lines only
                if len(runs) == 1:
                    ax.plot(steps, vals, color=color, alpha=0.35, lw=1)
                ax.plot(steps, moving_average(list(vals), args.smooth), color=color, lw=2, label=label)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
