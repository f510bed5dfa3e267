"""Does the planner pick right? Run many plans for real and compare with what it predicted.

    python scripts/validate_planner.py [--steps 6] [--warmup 1] [--out F] [--workdir D]
        [--profile hw.yaml] [--search-budget 60] [--quick] [--measured] [--plans a,b] [--dry-run] [key=value ...]

On the config's devices (default 8 simulated CPU devices) with a model big
enough that each call takes a few tenths of a second (a 4-layer, 512-wide
LLaMA, vocabulary 4096, PPO with a critic and a reference on the bundled
arithmetic prompts, 32 rows x (16 prompt + 32 generated) tokens), it builds
every plan the runtime can execute from these families:

- the strategy presets (colocated, interleaved, disaggregated, reallocated,
  Megatron-style heuristic, verl-style hybrid engine);
- colocated variants: tensor parallel everywhere (data 4 x tensor 2), FSDP for
  the train calls, pipeline stages for train and inference (2 stages x data 4),
  and the colocated plan with micro-batches (`algorithm.micro_batch_size`);
- the planner's own pick (`plan.strategy=auto`, the search `train` runs).

Each plan runs `--warmup + --steps` PPO steps through `jaxrlhf.train.run`
(the real executor, `plan.file` pointing at the plan); the warm-up steps
(compilation) are dropped and the measured step time is the median
`time/step_s` of the rest. The prediction is the simulator's steady-state
step time for the same plan, workload and offloaded roles, with a hardware
profile calibrated on this machine (`jaxrlhf.placement.calibrate`), or with
`--measured` one whose call tables `jaxrlhf.profile` measured first for this
very config (calls on placements outside its grid keep the formulas), or
`--profile` to reuse either. Prints predicted vs measured per plan, the
Spearman rank correlation, the median |predicted / measured - 1|, and where
the planner's pick (and the plan it predicts fastest among the candidates)
ranks among the measured plans. `--out F` writes JSON with `spearman`,
`median_abs_error`, `pick_vs_best` (measured step of the pick / of the
measured best) and one row per plan.

Timings only mean something on a quiet machine: other processes on the same
cores change every plan's time differently. `--quick` is a smoke test (tiny
model, 3 plans, 1 measured step) that checks the pipeline works, not the
planner. Trailing `key=value` arguments override the run config.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_estimator import spearman  # noqa: E402

# The run: PPO on the bundled arithmetic prompts with random-init models (no SFT), so every step
# generates the full response length (an untrained 4096-token vocabulary rarely samples EOS).
BASE = [
    "algorithm.name=ppo", "algorithm.minibatches=2", "algorithm.epochs=1",
    "model.actor.preset=small", "model.critic.init_from=actor", "model.ref.init_from=actor",
    "model.tokenizer=byte", "data.source=arithmetic", "data.split=train", "data.max_prompt_len=16",
    "data.pad_multiple=16", "generation.temperature=1.0", "rewards.rules=[{name: exact_match, weight: 1.0}]",
    "run.platform=cpu", "run.devices=8", "run.log_every=1",
]
FULL = [
    "model.actor.overrides={hidden_size: 512, intermediate_size: 1408, vocab_size: 4096, num_layers: 4, "
    "num_heads: 8, num_kv_heads: 8}",
    "data.batch_size=32", "generation.max_new_tokens=32",
]
QUICK = ["model.actor.preset=tiny", "data.batch_size=16", "generation.max_new_tokens=4"]
QUICK_PLANS = ("colocated", "disaggregated", "planner-pick")
RUN = ["sft.steps=0", "run.checkpoint_every=0", "run.export_hf=false", "run.tensorboard=false",
       "run.resume=false", "run.eval_every=0"]


@dataclasses.dataclass
class Candidate:
    """One plan to run: its name, the plan, and the config overrides it runs with (micro-batching)."""

    name: str
    plan: object  # ExecutionPlan
    overrides: tuple[str, ...] = ()


def with_layouts(base, name: str, layout_of) -> object:
    """`base` (a plan) renamed, with each call's layout replaced by `layout_of(call name, layout)`."""
    from jaxrlhf.planner.plan import Placement

    calls = {c: Placement(p.group, layout_of(c, p.layout)) for c, p in base.calls.items()}
    return dataclasses.replace(base, strategy=name, calls=calls, notes=f"{base.strategy} variant: {name}")


PRESETS = ("colocated", "interleaved", "disaggregated", "reallocated", "heuristic", "verl")
VARIANTS = ("colocated-tensor2", "colocated-fsdp-train", "colocated-2-stages", "colocated-micro2")
PLANS = PRESETS + VARIANTS + ("planner-pick",)


def candidates(cfg, algorithm, models, n: int, hw, names, search_budget: float) -> list[Candidate]:
    """The plans `names` (of PLANS): presets, colocated variants and the planner's pick, deduplicated
    and each checked by the runtime's own plan validation (those that cannot run are skipped, saying why)."""
    from jaxrlhf.planner.plan import Layout, PlanError, validate
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.run import planning

    graph = algorithm.graph()
    batch = algorithm.batch_rows
    minibatch = batch // algorithm.minibatches
    trains = {c.name for c in graph.calls if c.kind == "train"}
    gens = {c.name for c in graph.calls if c.kind == "generate"}
    out: list[Candidate] = []

    def preset(name: str):
        return build_plan(name, n, models, graph, batch_size=batch, workload=algorithm.workload(), hardware=hw)

    def variant(name: str) -> Candidate:
        co = preset("colocated")
        if name == "colocated-tensor2":
            return Candidate(name, with_layouts(co, name, lambda c, lay: Layout(data=n // 2, tensor=2)))
        if name == "colocated-fsdp-train":
            return Candidate(name, with_layouts(co, name, lambda c, lay: Layout(fsdp=n) if c in trains else Layout(data=n)))
        if name == "colocated-2-stages":
            return Candidate(name, with_layouts(co, name, lambda c, lay: lay if c in gens else Layout(data=n // 2, stage=2)),
                             (f"algorithm.micro_batch_size={max(minibatch // 4, 1)}",))
        return Candidate(name, co, (f"algorithm.micro_batch_size={max(minibatch // 2, 1)}",))

    for name in names:
        if name == "planner-pick":
            continue
        try:
            out.append(Candidate(name, preset(name)) if name in PRESETS else variant(name))
        except PlanError as e:
            print(f"skip {name}: {e}")
    result = planning.search_plan(cfg, algorithm, models, n, hw, time_budget_s=search_budget)
    print(f"planner: searched {result.evaluations} plans in {result.seconds:.1f} s", flush=True)
    out.append(Candidate("planner-pick", result.best.plan))

    seen, kept = {}, []
    for c in out:
        key = (json.dumps({k: v for k, v in c.plan.to_dict().items() if k not in ("strategy", "notes")},
                          sort_keys=True), c.overrides)
        if key in seen:
            print(f"skip {c.name}: the same plan as {seen[key]}")
            if c.name == "planner-pick":  # keep the pick's name on the row it shares
                kept = [dataclasses.replace(k, name=f"{k.name}=planner-pick") if k.name == seen[key] else k
                        for k in kept]
            continue
        try:
            validate(c.plan, graph, models, devices=n, batch_size=batch)
        except PlanError as e:
            print(f"skip {c.name}: {e}")
            continue
        seen[key] = c.name
        kept.append(c)
    return kept


def predict(cfg, models, plan, hw):
    """The simulator's estimate of `plan` under `cfg` (its micro-batching, offloaded roles): the plan
    as `train` would run it (`planning.plan_for`), then `estimate_plan`."""
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.run.assembly import Machine, setup
    from jaxrlhf.run.planning import Chip

    run_setup = setup(cfg, machine=Machine(plan.num_devices, chip=Chip("cpu")))
    with contextlib.redirect_stdout(sys.stderr):
        placed = run_setup.choose_plan()
    algorithm = run_setup.algorithm
    return placed, estimate_plan(placed, algorithm.graph(), models, algorithm.workload(), hw)


def one_step(plan, graph, est, hw) -> float:
    """The simulated makespan of a single step alone: what a step costs when nothing of the next step
    overlaps it. The steady state lets a step's calls overlap the next step's where the graph allows;
    the gap between the two says how much of a prediction rests on that overlap."""
    from jaxrlhf.planner.simulator import build_ops, schedule

    call_s = {n: c.seconds + est.reloads.get(n, 0.0) for n, c in est.calls.items()}
    return schedule(build_ops(graph, plan, call_s, est.moves, 1), plan.num_devices, hw.shared_host).makespan


def measure(cfg, out_dir: Path, warmup: int) -> dict:
    """Run `cfg` with the real executor (its output in `<out_dir>.log`); median step time and per-call
    times after the warm-up."""
    from jaxrlhf import train

    with open(f"{out_dir}.log", "w") as log, contextlib.redirect_stdout(log):
        train.run(cfg)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kept = [r for r in rows if r["step"] > warmup]
    calls = sorted({k[5:-2] for r in kept for k in r if k.startswith("time/") and k.endswith("_s")
                    and k.count("/") == 1 and k not in ("time/step_s", "time/realloc_s", "time/transfer_s",
                                                         "time/reload_s")})
    return {
        "step_s": statistics.median(r["time/step_s"] for r in kept),
        "steps_s": [r["time/step_s"] for r in kept],
        "first_step_s": rows[0]["time/step_s"],
        "calls_s": {c: statistics.median(r[f"time/{c}_s"] for r in kept) for c in calls},
        "response_length": statistics.median(r.get("response/length_mean", float("nan")) for r in kept),
    }


def hardware_profile(cfg, path: str | None, measured: bool):
    """The profile predictions use: the file at `path` when it exists; else measured call tables of `cfg`
    (`measured`) or the calibration of this machine, written to `path` when given."""
    from jaxrlhf.placement.calibrate import calibrate
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.profile import profile as measured_profile

    if path and Path(path).exists():
        return get_profile(path)
    hw = measured_profile(cfg, repeats=2) if measured else calibrate("cpu")
    if path:
        hw.save(path)
    return hw


def rank_of(name: str, rows: list[dict]) -> int:
    """1-based rank of the row `name` by measured step time (1 = fastest)."""
    order = sorted(rows, key=lambda r: r["measured_s"])
    return next(i for i, r in enumerate(order, 1) if r["name"] == name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps per plan (default 6: a median of 3 moved a plan by 20 %% between runs; quick 1)")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped per plan (compilation)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 3 plans, 1 measured step")
    ap.add_argument("--plans", help=f"comma-separated plans to run (default: all, or {','.join(QUICK_PLANS)} "
                                    f"with --quick); known: {','.join(PLANS)}. The planner's pick always runs")
    ap.add_argument("--profile", help="hardware profile file to use (calibrated here and written there if missing)")
    ap.add_argument("--measured", action="store_true",
                    help="measure this run's calls first (python -m jaxrlhf.profile) and predict from those tables")
    ap.add_argument("--search-budget", type=float, default=60.0, help="seconds for the planner's search")
    ap.add_argument("--workdir", help="run folders go here (default: a temporary folder, removed after)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="list the plans and their predictions, run nothing")
    ap.add_argument("overrides", nargs="*", help="key=value run config overrides")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (1 if args.quick else 6)
    names = [p.strip() for p in args.plans.split(",") if p.strip()] if args.plans else \
        list(QUICK_PLANS if args.quick else PLANS)
    unknown = sorted(set(names) - set(PLANS))
    if unknown:
        ap.error(f"--plans: unknown {unknown}; known: {','.join(PLANS)}")
    if steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.out and Path(args.out).exists():
        ap.error(f"--out {args.out} exists; choose another file (results are never overwritten)")

    from jaxrlhf import config as cfglib
    from jaxrlhf.train import setup_devices

    base = BASE + (QUICK if args.quick else FULL) + RUN + [f"run.steps={args.warmup + steps}"] + args.overrides
    try:
        cfg = cfglib.load_config(None, base)
    except cfglib.ConfigError as e:
        ap.error(str(e))
    setup_devices(cfg.run)

    import jax

    from jaxrlhf.run.assembly import setup

    n = jax.device_count()
    hw = hardware_profile(cfg, args.profile, args.measured)
    temp = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="validate_planner_") if temp else args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hw_file = work / "hardware.yaml"
    hw.save(str(hw_file))
    cfg = cfglib.with_overrides(cfg, [f"plan.hardware={hw_file}"])

    run_setup = setup(cfg)
    algorithm, models = run_setup.algorithm, run_setup.models
    plans = candidates(cfg, algorithm, models, n, hw, names, args.search_budget)
    print(f"{len(plans)} plans on {n} devices; {args.warmup} warm-up + {steps} measured steps each", flush=True)

    runs = []
    for c in plans:
        plan_file = work / f"{c.name}.plan.yaml"
        out_dir = work / c.name
        if out_dir.exists():
            sys.exit(f"error: {out_dir} exists; pass an empty --workdir (earlier runs are never overwritten)")
        c.plan.save(str(plan_file))
        run_cfg = cfglib.with_overrides(cfg, [f"plan.file={plan_file}", f"run.output_dir={out_dir}", *c.overrides])
        placed, est = predict(run_cfg, models, c.plan, hw)
        if not est.feasible:
            print(f"skip {c.name}: the planner finds it infeasible ({est.reason})", flush=True)
            continue
        print(f"{c.name:28s} predicted {est.step_s:7.3f} s  " + " ".join(
            f"{k}={p.layout}@{placed.groups[p.group].start}-{placed.groups[p.group].stop - 1}"
            for k, p in placed.calls.items()) + (f"  {' '.join(c.overrides)}" if c.overrides else ""), flush=True)
        runs.append((c, run_cfg, placed, est, out_dir))
    if args.dry_run:
        return 0

    rows = []
    for c, run_cfg, placed, est, out_dir in runs:
        t0 = time.perf_counter()
        got = measure(run_cfg, out_dir, args.warmup)
        row = {"name": c.name, "overrides": list(c.overrides), "plan": placed.to_dict(),
               "predicted_s": est.step_s, "measured_s": got["step_s"], "ratio": est.step_s / got["step_s"],
               "predicted_one_step_s": one_step(est.plan, algorithm.graph(), est, hw),
               "predicted_calls_s": {k: v.seconds for k, v in est.calls.items()},
               "predicted_sources": {k: v.source for k, v in est.calls.items()},
               "predicted_moves_s": {k: v for k, v in est.moves.items() if v},
               "measured_calls_s": got["calls_s"], "measured_steps_s": got["steps_s"],
               "first_step_s": got["first_step_s"], "response_length": got["response_length"],
               "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{c.name:28s} predicted {est.step_s:7.3f} s  measured {got['step_s']:7.3f} s  "
              f"ratio {row['ratio']:5.2f}  ({row['wall_s']:.0f} s wall)", flush=True)

    pred, meas = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    rho = spearman(pred, meas) if len(rows) > 1 else float("nan")
    one = [r["predicted_one_step_s"] for r in rows]
    rho_one = spearman(one, meas) if len(rows) > 1 else float("nan")
    mae = statistics.median(abs(r["ratio"] - 1) for r in rows)
    best = min(meas)
    pick = next(r for r in rows if r["name"].endswith("planner-pick"))
    predicted_best = min(rows, key=lambda r: r["predicted_s"])
    summary = {
        "spearman": rho, "median_abs_error": mae, "pick": pick["name"],
        "spearman_one_step": rho_one,
        "median_abs_error_one_step": statistics.median(abs(p / m - 1) for p, m in zip(one, meas)),
        "pick_vs_best": pick["measured_s"] / best, "pick_rank": rank_of(pick["name"], rows),
        "predicted_best": predicted_best["name"],
        "predicted_best_vs_best": predicted_best["measured_s"] / best,
        "predicted_best_rank": rank_of(predicted_best["name"], rows),
        "measured_best": min(rows, key=lambda r: r["measured_s"])["name"], "plans": len(rows),
    }
    print(f"\nSpearman {rho:+.2f} over {len(rows)} plans; median |predicted/measured - 1| {mae:.2f}")
    print(f"one isolated step instead of the steady state: Spearman {rho_one:+.2f}, median error "
          f"{summary['median_abs_error_one_step']:.2f}")
    print(f"planner's pick {pick['name']}: rank {summary['pick_rank']} of {len(rows)}, "
          f"{summary['pick_vs_best']:.2f}x the measured best ({summary['measured_best']})")
    print(f"fastest predicted candidate {predicted_best['name']}: rank {summary['predicted_best_rank']}, "
          f"{summary['predicted_best_vs_best']:.2f}x the measured best")
    if args.out:
        result = {**summary, "devices": n, "warmup": args.warmup, "steps": steps, "quick": args.quick,
                  "config": base, "hardware": hw.to_dict(), "workload": dataclasses.asdict(algorithm.workload()),
                  "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    if temp:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
