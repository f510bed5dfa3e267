"""Step time of a 2-process run (2 x 4 CPU devices, gloo) next to the 1-process run (8 CPU devices).

    python scripts/bench_multihost.py [--steps 6] [--warmup 2] [--strategies colocated,interleaved,...]
        [--out docs/results/bench_multihost.json] [key=value ...]

Strategies: the presets plus `offpolicy` (disaggregated with `plan.offpolicy=true`).
`--out` JSON: `{"rows": [{"strategy", "ratio", "outside_calls_fraction", ...}], "results": {...}}`
where ratio = 2-process s/step over 1-process s/step and outside_calls_fraction is the share of the
2-process step that is not device compute (moves, host work, waiting: 1 - time/step/compute_s /
time/step_s), the two numbers issue-style targets are stated in.

The tiny-model PPO run of the multi-process tests, per placement strategy,
once in one process and once in two local processes. The first `warmup`
steps (compilation) are dropped; the median `time/step_s` of the rest is
reported with where the extra time of the 2-process run goes: time spent in
`host_get` (gathering device values to every host: metrics, rule rewards),
waiting at barriers (after cross-process copies), and the existing
`time/realloc_s` / `time/transfer_s` metrics. CPU only: collectives run over
gloo on loopback TCP, so this measures the runtime's overhead, not a network.
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
BASE = [
    "model.actor.preset=tiny", "run.checkpoint_every=0", "run.tensorboard=false", "run.export_hf=false",
    "data.batch_size=8", "data.max_prompt_len=16", "generation.max_new_tokens=4", "algorithm.minibatches=2",
    "sft.steps=0", "rewards.eos_only=false", 'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
    "run.compile_cache=null", "run.platform=cpu",
]


def worker(spec: dict) -> None:
    """One process: train, timing host_get and barriers per step; process 0 writes the timings."""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.placement import executor
    from jaxrlhf.run.backend import setup_devices
    from jaxrlhf.transfer import host, processes, realloc

    run = cfglib.RunConfig(platform="cpu", devices=spec["devices"], distributed=spec["processes"] > 1,
                           compile_cache=None)
    dist = cfglib.DistributedConfig(coordinator_address=f"127.0.0.1:{spec['port']}",
                                    num_processes=spec["processes"], process_id=spec["process_id"],
                                    transfer_port_base=spec["port"] + 1)
    setup_devices(run, dist)
    spent = {"host_get_s": [], "barrier_s": []}
    current = {"host_get_s": 0.0, "barrier_s": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[key] += time.perf_counter() - t0
        return wrapper

    executor.host_get = timed(host.host_get, "host_get_s")
    host.HostValues.__getitem__ = timed(host.HostValues.__getitem__, "host_get_s")
    realloc.barrier = timed(processes.barrier, "barrier_s")
    step = executor.Executor.step

    def step_and_record(self, *args, **kwargs):
        for k in current:
            current[k] = 0.0
        out = step(self, *args, **kwargs)
        for k in current:
            spent[k].append(current[k])
        return out

    executor.Executor.step = step_and_record
    cfg = cfglib.load_config(None, spec["overrides"])
    train.run(cfg)
    if spec["process_id"] == 0:
        with open(os.path.join(spec["out"], "spent.json"), "w") as f:
            json.dump(spent, f)


def measure(strategy: str, processes: int, args, extra: list[str]) -> dict:
    from jaxrlhf.metrics import read_metrics

    with tempfile.TemporaryDirectory() as out:
        plan = ["plan.strategy=disaggregated", "plan.offpolicy=true"] if strategy == "offpolicy" \
            else [f"plan.strategy={strategy}"]
        overrides = [*BASE, *extra, *plan, f"run.steps={args.warmup + args.steps}",
                     f"run.output_dir={out}/run"]
        port = 30000 + (os.getpid() * 7 + processes) % 20000
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(dict(
            out=out, port=port, processes=processes, process_id=i, devices=8 // processes, overrides=overrides))],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(processes)]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{strategy} on {processes} process(es) failed:\n" + "\n".join(e[-2000:] for e in errors))
        records = read_metrics(f"{out}/run/metrics.jsonl")[args.warmup:]
        spent = json.load(open(f"{out}/spent.json"))
    keep = slice(args.warmup, None)
    median = lambda key: statistics.median(r.get(key, 0.0) for r in records)  # noqa: E731
    return {
        "step_s": median("time/step_s"),
        "compute_s": median("time/step/compute_s"),
        "realloc_s": median("time/realloc_s"),
        "transfer_s": median("time/transfer_s"),
        "host_get_s": statistics.median(spent["host_get_s"][keep]),
        "barrier_s": statistics.median(spent["barrier_s"][keep]),
        "calls_s": {k[5:-2]: median(k) for k in records[0] if k.startswith("time/") and "." in k},
    }


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--strategies", default="colocated,interleaved,disaggregated,offpolicy,reallocated")
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args()
    results, rows = {}, []
    print(f"{'plan':14s} {'1 proc s':>9s} {'2 proc s':>9s} {'ratio':>6s} {'outside':>8s} {'host_get':>9s} "
          f"{'barriers':>9s}", flush=True)
    for strategy in args.strategies.split(","):
        results[strategy] = {f"{n}_process": measure(strategy, n, args, extra) for n in (1, 2)}
        one, two = results[strategy]["1_process"], results[strategy]["2_process"]
        row = {"strategy": strategy, "one_process_s": one["step_s"], "two_process_s": two["step_s"],
               "ratio": two["step_s"] / one["step_s"],
               "outside_calls_fraction": max(0.0, 1.0 - two["compute_s"] / two["step_s"])}
        rows.append(row)
        print(f"{strategy:14s} {one['step_s']:9.3f} {two['step_s']:9.3f} {row['ratio']:6.2f} "
              f"{row['outside_calls_fraction']:8.1%} {two['host_get_s']:9.3f} {two['barrier_s']:9.3f}", flush=True)
    print(json.dumps({"rows": rows}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": args.steps, "warmup": args.warmup, "rows": rows, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
