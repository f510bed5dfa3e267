"""The planner's price of a multi-turn episode batch against the batch as a run measured it.

    python scripts/check_episode_pricing.py [--delays-ms 0,50,200] [--steps 4] [--out F]

For each environment delay: a GRPO run (tiny actor, byte tokenizer, 4 prompts x 4 episodes, one device,
colocated) whose episodes are three turns against a test environment that sleeps `delay` per step
(`env.threads: 4`, in the trainer's process). After one warm-up step, the run's medians: the episode
batch's seconds (`time/episodes_s`) and the engine's work (`env/decode_steps`, `env/extends`,
`env/wait_s`). The planner prices the generate call (`planner.episodes`) from those measured fields on a
profile whose generate tables `python -m jaxrlhf.profile` measured for this config on this machine, and
from the same tables as single-turn generation (what it priced before episodes were measured). Prints a
table and JSON (`--out`, never overwritten): per delay, measured, predicted, predicted / measured, and the
single-turn price. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrlhf.environments import ENVIRONMENTS, Observation, StepResult, register_environment  # noqa: E402

TURNS = 3
BASE = [
    "algorithm.name=grpo", "model.actor.preset=tiny", "model.tokenizer=byte", "run.devices=1", "run.platform=cpu",
    "run.checkpoint_every=0", "run.tensorboard=false", "run.export_hf=false", "run.save_checkpoints=false",
    "sft.steps=0", "data.batch_size=4", "algorithm.group_size=4", "algorithm.minibatches=1",
    "data.max_prompt_len=16", "generation.max_new_tokens=96", "generation.engine=continuous",
    "plan.strategy=colocated", "env.name=bench_sleep", f"env.max_turns={TURNS}", "env.max_turn_tokens=24",
    "env.max_observation_tokens=15", "env.threads=4", "rewards.rules=[]", "rewards.eos_only=false",
]


class SleepyEcho:
    """Sleeps `delay_s` a step; shows "ok <k>" after turn k, done after `turns` turns (reward: turns)."""

    def __init__(self, context, delay_s: float = 0.0, turns: int = TURNS):
        self.delay_s, self.turns, self.k = delay_s, turns, 0

    def reset(self, row):
        return Observation(row["prompt"])

    def step(self, action_text):
        time.sleep(self.delay_s)
        self.k += 1
        if self.k >= self.turns:
            return StepResult(None, float(self.k), True)
        return StepResult(Observation(f" ok {self.k} "), 0.0, False)


if "bench_sleep" not in ENVIRONMENTS:
    register_environment("bench_sleep")(SleepyEcho)


def run(overrides: list[str], out: Path, warmup: int) -> dict:
    """A run's medians after `warmup` steps: the episode batch's seconds and the engine's measured work."""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    with open(f"{out}.log", "w") as log, contextlib.redirect_stdout(log):
        train.run(cfglib.load_config(None, [*BASE, *overrides, f"run.output_dir={out}"]))
    rows = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["step"] > warmup and "env/turns" in r]
    keys = {"episodes_s": "time/episodes_s", "decode_steps": "env/decode_steps", "extends": "env/extends",
            "wait_s": "env/wait_s", "turns": "env/turns"}
    return {name: statistics.median(r[key] for r in rows) for name, key in keys.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delays-ms", default="0,50,200", help="comma-separated environment step delays")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run (after 1 warm-up)")
    ap.add_argument("--out", help="write the results as JSON here (never overwritten)")
    args = ap.parse_args(argv)
    if args.out and Path(args.out).exists():
        print(f"--out {args.out} exists; choose another path (results are never overwritten)", file=sys.stderr)
        return 2
    from jaxrlhf import config as cfglib
    from jaxrlhf.planner.cost import profile_call_cost
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.profile import profile
    from jaxrlhf.run.assembly import setup

    delays = [float(d) / 1000 for d in args.delays_ms.split(",") if d.strip()]
    cfg = cfglib.load_config(None, [*BASE, f"run.steps={args.steps + 1}"])
    print("profiling the generate call (python -m jaxrlhf.profile, 1 device) ...", flush=True)
    with contextlib.redirect_stdout(sys.stderr):
        hw = profile(cfg, repeats=2, sizes=[1], calls=["actor.generate"], search_budget_s=0)
    run_setup = setup(cfg)
    gen = next(c for c in run_setup.graph.calls if c.kind == "generate")
    actor = run_setup.models["actor"]
    single = dataclasses.replace(run_setup.algorithm.workload(), multi_turn=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for delay in delays:
            got = run([f"run.steps={args.steps + 1}", f"env.args={{delay_s: {delay}}}"],
                      Path(tmp) / f"delay{int(delay * 1000)}", warmup=1)
            wl = dataclasses.replace(run_setup.algorithm.workload(), env_decode_steps=got["decode_steps"],
                                     env_extends=got["extends"], env_wait_s=got["wait_s"])
            priced = profile_call_cost(gen, actor, DeviceGroup("one", 0, 1), Layout(), wl, hw)
            one_turn = profile_call_cost(gen, actor, DeviceGroup("one", 0, 1), Layout(), single, hw)
            rows.append({"delay_ms": delay * 1000, **got, "predicted_s": priced.seconds,
                         "ratio": priced.seconds / got["episodes_s"], "parts": priced.parts,
                         "single_turn_s": one_turn.seconds, "source": priced.source})
            print(f"delay {delay * 1000:5.0f} ms: measured {got['episodes_s']:.3f} s, predicted {priced.seconds:.3f} s "
                  f"(x{priced.seconds / got['episodes_s']:.2f}), single-turn price {one_turn.seconds:.3f} s", flush=True)
    print(f"\n{'delay ms':>8} {'turns':>5} {'steps':>5} {'extends':>7} {'wait s':>7} {'measured s':>10} "
          f"{'predicted s':>11} {'ratio':>5} {'1-turn s':>8}")
    for r in rows:
        print(f"{r['delay_ms']:8.0f} {r['turns']:5.2f} {r['decode_steps']:5.0f} {r['extends']:7.0f} {r['wait_s']:7.3f} "
              f"{r['episodes_s']:10.3f} {r['predicted_s']:11.3f} {r['ratio']:5.2f} {r['single_turn_s']:8.3f}")
    result = {"config": BASE, "steps": args.steps, "rows": rows,
              "median_abs_error": statistics.median(abs(r["ratio"] - 1) for r in rows)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
