"""The planner's on-paper answers the docs quote, asked again: one command regenerates every number.

    python scripts/plan_questions.py [--only NAME,...] [--json docs/results/plan_questions.json]
    python scripts/plan_questions.py --every-preset [--json docs/results/plan_every_preset.json]

Each question is a `python -m jaxrlhf.plan` command (the docs print it); this runs them in order through
`jaxrlhf.plan.main` and prints a table of the searched plan's step time, the presets' (colocated, heuristic,
verl) and, for a streamed run, the best synchronous plan's and the predicted gain, plus the search's
evaluations. The search counts plans evaluated, not seconds, so a rerun prints the same numbers on any
machine; the search's own seconds (the last column) are the only thing that depends on the machine and its
load (docs/benchmarks.md gives them measured on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrlhf.plan import main as plan_main  # noqa: E402
from jaxrlhf.planner.plan import seconds_text  # noqa: E402

QUESTIONS: dict[str, list[str]] = {
    # the three questions that said "no plan fits" before the search chose the memory knobs
    "70b-ppo-64xh100": ["--model-preset", "llama2-70b", "--hardware", "h100", "--devices", "64", "--gen-len", "896",
                        "--prompt-len", "128", "--batch", "128"],
    "qwen2-7b-dapo-20k-streamed-64xh100": [
        "--model-preset", "qwen2-7b", "--devices", "64", "--hardware", "h100", "--algorithm", "dapo",
        "--gen-len", "20480", "--prompt-len", "1024", "--batch", "64", "algorithm.group_size=16",
        "algorithm.dynamic_sampling=false", "algorithm.max_staleness=4", "generation.engine=continuous",
        "generation.partial_rollout=true", "plan.response_length_median=4096", "plan.response_length_sigma=0.8",
        "algorithm.pack_sequences=true"],
    "qwen2-7b-ppo-32k-64xh100": ["--model-preset", "qwen2-7b", "--devices", "64", "--hardware", "h100",
                                 "--algorithm", "ppo", "--gen-len", "30720", "--prompt-len", "2048", "--batch", "64"],
    "qwen2-7b-ppo-32k-packed-64xh100": ["--model-preset", "qwen2-7b", "--devices", "64", "--hardware", "h100",
                                        "--algorithm", "ppo", "--gen-len", "30720", "--prompt-len", "2048",
                                        "--batch", "64", "algorithm.pack_sequences=true"],
    # the same 70B question on half the devices: it plans only with optimizer state in host memory
    "70b-ppo-32xh100": ["--model-preset", "llama2-70b", "--hardware", "h100", "--devices", "32", "--gen-len", "896",
                        "--prompt-len", "128", "--batch", "128"],
    # the search at its largest: 512 devices
    "4x70b-ppo-512xh100": ["--model-preset", "llama2-70b", "--hardware", "h100", "--devices", "512", "--gen-len", "128",
                           "--prompt-len", "128", "--batch", "512", "rewards.model=true"],
    "qwen3-30b-a3b-grpo-512xh100": ["--model-preset", "qwen3-30b-a3b", "--hardware", "h100", "--devices", "512",
                                    "--algorithm", "grpo", "--gen-len", "1024", "--prompt-len", "256", "--batch", "64"],
    # a TPU slice: "no plan fits" while tensor parallelism stayed on one host's 4 chips (70B on 32 GB chips)
    "70b-ppo-512xtpu-v4": ["--model-preset", "llama2-70b", "--hardware", "tpu-v4", "--devices", "512", "--algorithm",
                           "ppo", "--gen-len", "512", "--prompt-len", "512", "--batch", "512", "rewards.model=true"],
}


def every_preset() -> dict[str, list[str]]:
    """`--every-preset`: the search at its largest for each model preset but the test sizes: PPO with four models
    of the preset (actor, critic, reference, reward) on 512 H100, 512 prompts of 512 + 1,024 tokens."""
    from jaxrlhf.models.config import PRESETS as MODELS

    return {f"{name}-4x-ppo-512xh100": ["--model-preset", name, "--hardware", "h100", "--devices", "512", "--algorithm",
                                        "ppo", "--gen-len", "1024", "--prompt-len", "512", "--batch", "512",
                                        "rewards.model=true"]
            for name in MODELS if not name.startswith("tiny") and name not in ("small", "llama-100m")}
PRESETS = ("colocated", "heuristic", "verl")


def ask(argv: list[str]) -> tuple[dict, float]:
    """`python -m jaxrlhf.plan ARGV --json` in this process: its JSON answer and the wall seconds it took."""
    with tempfile.TemporaryDirectory() as out:
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            rc = plan_main([*argv, "--json", "--out", out])
        took = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"python -m jaxrlhf.plan {' '.join(argv)} exited {rc}")
    return json.loads(buf.getvalue().strip().splitlines()[-1]), took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated question names")
    ap.add_argument("--json", help="write the answers here")
    ap.add_argument("--every-preset", action="store_true",
                    help="instead: 4-model PPO on 512 H100 for every model preset (the search time at scale)")
    args = ap.parse_args()
    questions = every_preset() if args.every_preset else QUESTIONS
    names = args.only.split(",") if args.only else list(questions)
    rows = []
    print(f"{'question':40s} {'searched':>9} " + " ".join(f"{p:>10}" for p in PRESETS)
          + f" {'sync':>9} {'gain':>6} {'plans':>6} {'search s':>9}")
    for name in names:
        answer, took = ask(questions[name])
        step = answer["searched"]["step_s"]
        presets = {p: answer["presets"].get(p, {}).get("step_s") for p in PRESETS}
        gain = answer.get("async_gain")
        row = {"question": name, "command": "python -m jaxrlhf.plan " + " ".join(questions[name]), "step_s": step,
               "presets": presets, "sync_step_s": answer.get("sync_step_s"), "gain": gain,
               "evaluations": answer.get("evaluations"), "plan": answer["searched"]["plan"], "search_s": took}
        rows.append(row)
        cell = lambda v: f"{seconds_text(v):>10}" if v else f"{'n/a':>10}"  # noqa: E731
        print(f"{name:40s} {seconds_text(step):>9} " + " ".join(cell(presets[p]) for p in PRESETS)
              + f" {cell(row['sync_step_s'])[1:]} {gain or 1:6.2f} {row['evaluations'] or 0:6d} {took:9.1f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python scripts/plan_questions.py" + (" --every-preset" if args.every_preset else ""),
                       "rows": rows}, f, indent=1)
    print(json.dumps({"rows": [{k: r[k] for k in ("question", "step_s", "gain", "search_s")} for r in rows]}))


if __name__ == "__main__":
    main()
