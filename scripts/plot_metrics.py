"""Render the curves of a run's metrics.jsonl to a PNG.

    python scripts/plot_metrics.py runs/quickstart/metrics.jsonl --out curves.png \
        [--keys reward/mean kl/mean ...] [--smooth 5]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="path to metrics.jsonl")
    p.add_argument("--out", default="metrics.png")
    p.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    p.add_argument("--smooth", type=int, default=1, help="moving-average window (steps)")
    args = p.parse_args(argv)

    try:
        with open(args.metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        print(f"plot_metrics: cannot read {args.metrics}: {e}", file=sys.stderr)
        return 2
    keys = [k for k in args.keys if any(isinstance(r.get(k), (int, float)) for r in records)]
    if not keys:
        print(f"plot_metrics: none of {args.keys} found in {args.metrics}", file=sys.stderr)
        return 2

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(keys))
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        steps, vals = zip(*pts)
        ax.plot(steps, vals, color="tab:blue", alpha=0.35 if args.smooth > 1 else 1.0, lw=1)
        if args.smooth > 1:
            ax.plot(steps, moving_average(list(vals), args.smooth), color="tab:blue", lw=2)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
