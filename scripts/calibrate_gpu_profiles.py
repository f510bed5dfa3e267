"""The GPU profiles' efficiency factors, derived from jaxrlhf's own measurements on one H200.

    python scripts/calibrate_gpu_profiles.py [--estimator docs/results/h200_validate_estimator.json] [--json F]

The planner prices a call at a fraction of the datasheet peaks (`HardwareProfile.matmul_efficiency`,
`.memory_efficiency`). These factors come from measurements nobody fitted to the cases they are later
checked on (`scripts/validate_published.py`): `scripts/validate_estimator.py` on one H200 (gpu_checks.sh's
`estimator` step, docs/results/h200_validate_estimator.json) timed a generate, an inference and a train call
of a 2048-wide, 8-layer model in bf16 on a profile calibrated in the same session (its measured matmul FLOP/s
and copy bandwidth, efficiencies 1), which this prices again with the cost model as it is now. So

- matmul_kernel = measured matmul FLOP/s / datasheet bf16 peak;
- call_overhead = 1 / (the geometric mean, over the inference and train calls, of estimated / measured
  seconds) - 1: the seconds of a whole call's memory-bound work per second of its matmuls at the kernels' rate;
- memory_efficiency = measured copy bandwidth / datasheet HBM bandwidth x estimated / measured seconds of
  the decode steps of the generate call (the memory-bound phase).

A GPU profile's matmul_efficiency is matmul_kernel / (1 + call_overhead x its FLOP/s per byte/s over the
H200's) (`planner.hardware.gpu_matmul_efficiency`: the same memory-bound bytes per FLOP on every chip), the
H200's own matmul_kernel / (1 + call_overhead). `planner/hardware.py` holds the numbers this prints
(tests/planner/test_hardware.py checks they agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrlhf.planner.hardware import H200_BF16_PEAK, H200_HBM_PEAK  # noqa: E402


def estimates(estimator: dict) -> dict[str, tuple[float, float]]:
    """The single-device calls of a `validate_estimator.py --json` run priced again by the cost model as it is
    now (the run's own profile, workload and model): per call (estimated seconds, estimated decode seconds per
    token), so the factors follow the formulas the planner prices with, not those of the day of the run."""
    from jaxrlhf.graph import CallSpec
    from jaxrlhf.models.config import ModelConfig
    from jaxrlhf.planner.cost import call_cost
    from jaxrlhf.planner.hardware import HardwareProfile
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.planner.workload import Workload

    known = {f.name for f in dataclasses.fields(Workload)}
    wl = Workload(**{k: v for k, v in estimator["workload"].items() if k in known})
    cfg, hw = ModelConfig(**estimator["model"]), HardwareProfile.from_dict(estimator["profile"])
    out = {}
    for call in ("generate", "inference", "train"):
        cost = call_cost(CallSpec(f"actor.{call}", "actor", call), cfg, DeviceGroup("g", 0, 1), Layout(), wl, hw)
        out[call] = (cost.seconds, cost.parts.get("decode", 0.0) / wl.gen_len)
    return out


def efficiencies(estimator: dict) -> dict[str, float]:
    """matmul and memory efficiency from a `validate_estimator.py --json` run on an H200 (see the docstring)."""
    profile, rows = estimator["profile"], {r["call"]: r for r in estimator["rows"] if r["devices"] == 1}
    missing = [c for c in ("generate", "inference", "train") if c not in rows]
    if missing:
        raise ValueError(f"the estimator run has no single-device row for {missing}")
    est = estimates(estimator)
    compute = math.sqrt(est["inference"][0] / rows["inference"]["measured_s"]
                        * est["train"][0] / rows["train"]["measured_s"])
    decode = est["generate"][1] / rows["generate"]["decode_s_per_token"]
    return {
        "matmul_kernel": profile["flops"]["bfloat16"] / H200_BF16_PEAK,
        "call_overhead": 1 / compute - 1,
        "memory_efficiency": profile["hbm_bandwidth"] / H200_HBM_PEAK * decode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--estimator", default=str(ROOT / "docs" / "results" / "h200_validate_estimator.json"))
    ap.add_argument("--json", help="write the factors here")
    args = ap.parse_args()
    with open(args.estimator) as f:
        factors = efficiencies(json.load(f))
    from jaxrlhf.planner import hardware as hwlib

    held = {"matmul_kernel": hwlib.GPU_MATMUL_KERNEL, "call_overhead": hwlib.GPU_CALL_OVERHEAD,
            "memory_efficiency": hwlib.GPU_MEMORY_EFFICIENCY}
    print("| factor | from the H200 measurements | in planner/hardware.py |")
    print("|---|---|---|")
    for key, value in factors.items():
        print(f"| {key} | {value:.3f} | {held[key]} |")
    print()
    print("| profile | FLOP/s per byte/s | matmul_efficiency |")
    print("|---|---|---|")
    for name, p in hwlib.PROFILES.items():
        if p.memory_efficiency == hwlib.GPU_MEMORY_EFFICIENCY:  # the GPU profiles
            print(f"| {name} | {p.flops['bfloat16'] / p.hbm_bandwidth:.0f} | {p.matmul_efficiency} |")
    print(json.dumps({k: round(v, 3) for k, v in factors.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.estimator, **factors}, f, indent=2)


if __name__ == "__main__":
    main()
