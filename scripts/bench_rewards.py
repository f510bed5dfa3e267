"""Reward work beside generation: how much of a slow reward's time `rewards.workers` hides.

    python scripts/bench_rewards.py --out F [--steps 3] [--delay-ms 500] [--workers 2] [--concurrency 8] [--quick]

The workload: GRPO with partial rollouts (`generation.partial_rollout`, eta = 1, the continuous engine)
on the bundled arithmetic task, the `small` actor on 2 simulated CPU devices (colocated), 8 prompts x
G = 8, responses of log-normal lengths (median 48, sigma 1, cap 256: `generation.simulated_lengths`).
The reward is the `remote` rule against a scoring service on localhost (a threaded HTTP server in this
process) that answers each row after `--delay-ms` of waiting, as an LLM judge or a test runner would:
a reward whose time per step is about the step's generation time (the table says both). The same run
goes twice, side by side:

- in the step: `rewards.workers=0`, the batch scored by the `score_rules` host step after generation;
- beside it: `rewards.workers=N`, each sample scored by N worker processes as soon as it ends (not when
  its group does), the pool working on the oldest step's samples first, and the stream decoding the
  next step while a batch waits for its last scores (docs/agentic.md).

Per run, after one warm-up step: the median `time/step_s`, the median generation time (the trainer's
wait for its batch, `time/generate_wait_s`, which beside it includes `time/reward_decode_s`: decoding
the next step while the last scores come in), the reward time (in the step: the step's host work,
`time/step/host_s`, nearly all of it scoring; beside it: the workers' `time/reward_work_s`) and, for
the workers, `reward/hidden_frac` (1 - the trainer's idle wait for the last samples' scores / the
workers' time): the JSON key `hidden_fraction` is its mean over the measured steps. The workers' time
grows with the number of tasks (small tasks use less of the rule's concurrency), which flatters that
ratio, so `hidden_of_step_reward` measures against the other run instead: 1 - the trainer's median wait
beside it / the median reward time in the step. `speedup` is the step time in the step over beside it.
Scores are the same in both runs (the `remote` service scores the text). Run it alone on a quiet
machine; `--quick` (tiny model, 2 steps) is a smoke test.
"""

from __future__ import annotations

import argparse
import http.server
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = [
    "algorithm.name=grpo", "algorithm.group_size=8", "algorithm.minibatches=2", "algorithm.kl_coef=0",
    "algorithm.max_staleness=1", "model.actor.preset=small", "model.tokenizer=byte", "data.source=arithmetic",
    "data.split=train", "data.max_prompt_len=16", "data.batch_size=8", "generation.engine=continuous",
    "generation.partial_rollout=true", "generation.ignore_eos=true", "generation.simulated_lengths=true",
    "generation.max_new_tokens=256", "plan.response_length_median=48", "plan.response_length_sigma=1.0",
    "rewards.eos_only=false", "plan.strategy=colocated", "run.devices=2", "run.platform=cpu", "sft.steps=0",
    "run.checkpoint_every=0", "run.save_checkpoints=false", "run.tensorboard=false", "run.export_hf=false",
    "run.log_every=1",
]


def scoring_service(delay_s: float) -> http.server.ThreadingHTTPServer:
    """A localhost service that scores a row after `delay_s`: 1 when the response holds a digit, else 0."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay_s)
            body = json.dumps({"score": float(any(c.isdigit() for c in row["response"]))}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(overrides: list[str], out: Path) -> list[dict]:
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    train.run(cfglib.load_config(None, [*BASE, *overrides, f"run.output_dir={out}"]))
    return read_metrics(str(out / "metrics.jsonl"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (after 1 warm-up)")
    ap.add_argument("--delay-ms", type=float, default=500.0, help="the service's time per row")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="the remote rule's requests in flight per process")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, short responses, 1 measured step")
    ap.add_argument("--out", help="write the results as JSON here (never overwritten)")
    args = ap.parse_args(argv)
    if args.out and Path(args.out).exists():
        print(f"--out {args.out} exists; choose another path (results are never overwritten)", file=sys.stderr)
        return 2
    extra = []
    if args.quick:
        args.steps = 1
        extra = ["model.actor.preset=tiny", "generation.max_new_tokens=32", "plan.response_length_median=8"]
    server = scoring_service(args.delay_ms / 1000)
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    rule = (f'rewards.rules=[{{name: remote, weight: 1.0, args: {{url: "{url}", timeout: 30, retries: 0, '
            f'concurrency: {args.concurrency}}}}}]')
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for name, workers in (("in the step", 0), ("beside it", args.workers)):
            records = run([*extra, rule, f"run.steps={args.steps + 1}", f"rewards.workers={workers}"],
                          Path(work) / f"w{workers}")[1:]
            med = lambda key: statistics.median(r.get(key, 0.0) for r in records)  # noqa: E731
            # in the step the reward is the step's host work (scoring is nearly all of it); beside it, the workers'
            reward_s = med("time/reward_work_s") if workers else med("time/step/host_s")
            rows[name] = {"workers": workers, "step_s": med("time/step_s"), "generate_s": med("time/generate_wait_s"),
                          "reward_s": reward_s, "reward_wait_s": med("time/reward_wait_s") if workers else reward_s,
                          "reward_decode_s": med("time/reward_decode_s") if workers else 0.0,
                          "hidden_fraction": statistics.mean(r["reward/hidden_frac"] for r in records) if workers
                          else 0.0, "reward_mean": statistics.mean(r["reward/mean"] for r in records)}
    server.shutdown()
    step, beside = rows["in the step"], rows["beside it"]
    summary = {"hidden_fraction": beside["hidden_fraction"],
               "hidden_of_step_reward": max(0.0, 1.0 - beside["reward_wait_s"] / step["reward_s"]),
               "speedup": step["step_s"] / beside["step_s"],
               "delay_ms": args.delay_ms, "workers": args.workers, "concurrency": args.concurrency,
               "steps": args.steps, "runs": rows}
    print(f"{'rewards':<12} {'workers':>7} {'step s':>8} {'generate s':>11} {'reward s':>9} {'reward wait s':>14} "
          f"{'hidden':>7}")
    for name, r in rows.items():
        print(f"{name:<12} {r['workers']:>7} {r['step_s']:8.2f} {r['generate_s']:11.2f} {r['reward_s']:9.2f} "
              f"{r['reward_wait_s']:14.2f} {r['hidden_fraction']:7.2f}")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
