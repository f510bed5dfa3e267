"""The GPU profiles' efficiency factors, derived from jaxrlhf's own measurements on one H200.

    python scripts/calibrate_gpu_profiles.py [--estimator docs/results/h200_validate_estimator.json] [--json F]

The planner prices a call at a fraction of the datasheet peaks (`HardwareProfile.matmul_efficiency`,
`.memory_efficiency`). These factors come from measurements nobody fitted to the cases they are later
checked on (`scripts/validate_published.py`): `scripts/validate_estimator.py` on one H200 (gpu_checks.sh's
`estimator` step, docs/results/h200_validate_estimator.json) timed a generate, an inference and a train call
of a 2048-wide, 8-layer model in bf16 and priced them on a profile calibrated in the same session (its
measured matmul FLOP/s and copy bandwidth, efficiencies 1). So

- matmul_efficiency = measured matmul FLOP/s / datasheet bf16 peak x the geometric mean, over the inference
  and train calls, of estimated / measured seconds (how much of the measured matmul rate whole calls reach);
- memory_efficiency = measured copy bandwidth / datasheet HBM bandwidth x estimated / measured seconds of
  the decode steps of the generate call (the memory-bound phase).

The result is what jaxrlhf's runtime reached, applied to every GPU profile as a fraction of its datasheet:
`planner/hardware.py` holds the numbers this prints (tests/planner/test_hardware.py checks they agree).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H200_BF16_PEAK = 989e12  # NVIDIA H200 SXM datasheet, dense bf16 FLOP/s (as the h200 profile)
H200_HBM_PEAK = 4.8e12  # bytes/s


def efficiencies(estimator: dict) -> dict[str, float]:
    """matmul and memory efficiency from a `validate_estimator.py --json` run on an H200 (see the docstring)."""
    profile, rows = estimator["profile"], {r["call"]: r for r in estimator["rows"] if r["devices"] == 1}
    missing = [c for c in ("generate", "inference", "train") if c not in rows]
    if missing:
        raise ValueError(f"the estimator run has no single-device row for {missing}")
    compute = math.sqrt(rows["inference"]["ratio"] * rows["train"]["ratio"])
    decode = rows["generate"]["decode_est_s_per_token"] / rows["generate"]["decode_s_per_token"]
    return {
        "matmul_efficiency": profile["flops"]["bfloat16"] / H200_BF16_PEAK * compute,
        "memory_efficiency": profile["hbm_bandwidth"] / H200_HBM_PEAK * decode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--estimator", default=str(ROOT / "docs" / "results" / "h200_validate_estimator.json"))
    ap.add_argument("--json", help="write the factors here")
    args = ap.parse_args()
    with open(args.estimator) as f:
        factors = efficiencies(json.load(f))
    from jaxrlhf.planner.hardware import GPU_MATMUL_EFFICIENCY, GPU_MEMORY_EFFICIENCY

    print("| factor | from the H200 measurements | in planner/hardware.py |")
    print("|---|---|---|")
    print(f"| matmul_efficiency | {factors['matmul_efficiency']:.3f} | {GPU_MATMUL_EFFICIENCY} |")
    print(f"| memory_efficiency | {factors['memory_efficiency']:.3f} | {GPU_MEMORY_EFFICIENCY} |")
    print(json.dumps({k: round(v, 3) for k, v in factors.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.estimator, **factors}, f, indent=2)


if __name__ == "__main__":
    main()
