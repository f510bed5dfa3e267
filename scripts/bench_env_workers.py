"""Multi-turn generation with a Python-heavy environment: its steps on the trainer's threads (holding the
GIL against the host loop) against the same steps in `env.workers` processes (`environments/pool.py`).

    PYTHONPATH=. python scripts/bench_env_workers.py --workers 2 --step-ms 50

Prints one JSON line: `decode_only_s` (the same episodes with steps that do no work: the generation's own
time), `in_process_s` and `workers_s` (steps that each run the pure-Python work that takes `--step-ms` alone,
calibrated first), `env_work_s` (that work, summed over the steps), and `hidden_fraction_*` = 1 - (time - decode_only) / env_work: the share of
the environments' work hidden behind decoding (1 = all of it; with threads the GIL serialises it with the
host loop, with workers it runs on other cores). Needs free cores to mean anything: run it on a quiet
machine with at least workers + 1 cores. Trajectories are checked equal between the two runs.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxrlhf.environments import ENVIRONMENTS, Observation, StepResult, register_environment


def spin(rounds: int) -> int:
    """Pure Python bytecode (holds the GIL): a fixed amount of work, not of wall time (threads sharing the GIL
    would each see their wall-clock deadline pass while doing less)."""
    x = 0
    for i in range(rounds):
        x = (x * 31 + i) % 1000003
    return x


def rounds_per_ms() -> float:
    start = time.perf_counter()
    spin(200_000)
    return 200_000 / ((time.perf_counter() - start) * 1000)


class Busy:
    """Spins `rounds` of pure Python per step, then shows "<k>"; done after `turns` turns."""

    def __init__(self, context, rounds: int = 0, turns: int = 4):
        self.rounds, self.turns, self.k = rounds, turns, 0

    def reset(self, row):
        return Observation(row["prompt"])

    def step(self, action_text):
        spin(self.rounds)
        self.k += 1
        if self.k >= self.turns:
            return StepResult(None, float(len(action_text)), True, {"steps": 1.0})
        return StepResult(Observation(f"<{self.k}>"), 0.0, False, {"steps": 1.0})


if "bench_busy" not in ENVIRONMENTS:
    register_environment("bench_busy")(Busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from jaxrlhf.environments import EnvironmentContext, make_environment
    from jaxrlhf.environments.pool import EnvPool
    from jaxrlhf.models import multiturn as mt
    from jaxrlhf.models.config import preset
    from jaxrlhf.models.sampling import SamplingParams
    from jaxrlhf.models.tokenizer import ByteTokenizer
    from jaxrlhf.testing.models import random_model

    tok = ByteTokenizer()
    graphdef, params = nnx.split(random_model(preset("tiny"), seed=0))
    spec = mt.MultiTurnSpec(rows=args.rows, prompt_bucket=16, max_tokens=96, max_turn_tokens=12,
                            sampling=SamplingParams(), eos_ids=tuple(range(3, 51)), pad_id=0, max_observation_tokens=7)
    rows = [{"prompt": f"task {i}"} for i in range(args.rows)]
    context = EnvironmentContext()

    def run(envs):
        start = time.perf_counter()
        out = mt.generate_multiturn(graphdef, params, envs=envs, rows=rows, encode=tok.encode, decode_text=tok.decode,
                                    rng=jax.random.key(0), spec=spec, max_turns=args.turns, chunk=4,
                                    threads=max(4, args.workers), prompt_ids=[tok.encode(r["prompt"]) for r in rows])
        return time.perf_counter() - start, out

    rounds = int(args.step_ms * rounds_per_ms())  # the work of --step-ms, measured alone

    def local(rounds):
        envs = [make_environment("bench_busy", context, {"rounds": rounds, "turns": args.turns}) for _ in rows]
        for env, row in zip(envs, rows):
            env.reset(row)
        return envs

    run(local(0))  # compiles
    decode_only, _ = run(local(0))
    in_process, a = run(local(rounds))
    pool = EnvPool("bench_busy", context, {"rounds": rounds, "turns": args.turns}, workers=args.workers,
                   imports=["bench_env_workers"])
    try:
        pool.reset(rows[:args.workers])  # the workers started and imported (not timed)
        episodes, _ = pool.reset(rows)
        workers, b = run(episodes)
    finally:
        pool.close()
    assert np.array_equal(a.response_tokens, b.response_tokens) and np.array_equal(a.env_reward, b.env_reward)
    steps = int(sum(c.get("steps", 0.0) for c in a.counters))  # the steps taken (a turn the budget cut has none)
    env_work = steps * args.step_ms / 1000
    hidden = lambda t: 1 - max(t - decode_only, 0.0) / env_work if env_work else 1.0  # noqa: E731
    print(json.dumps({"rows": args.rows, "workers": args.workers, "step_ms": args.step_ms,
                      "steps": steps, "decode_only_s": round(decode_only, 3),
                      "in_process_s": round(in_process, 3), "workers_s": round(workers, 3),
                      "env_work_s": round(env_work, 3), "hidden_fraction_in_process": round(hidden(in_process), 3),
                      "hidden_fraction_workers": round(hidden(workers), 3)}))


if __name__ == "__main__":
    main()
