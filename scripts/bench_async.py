"""Asynchronous vs synchronous RL on a long-tailed workload, and the planner's estimates of both.

    python scripts/bench_async.py --out F [--steps 4] [--warmup 1] [--prompts 8] [--max-eta 2]
        [--profile hw.yaml] [--measured] [--search-budget 30] [--workdir D] [--quick] [key=value ...]

The workload: GRPO on the bundled arithmetic prompts with the `small` actor (and its reference: KL in the
loss), G = 8 samples per prompt, `--prompts` prompts per step, on 8 simulated CPU devices; responses end
at lengths drawn log-normal (median 64, sigma 1, cap 512: `generation.simulated_lengths`, the same draw
for every plan since the keys are the same), the continuous engine and `generation.trim_responses` on
both sides. Plans run through `jaxrlhf.train.run` (the real executor):

- synchronous: the colocated preset, the disaggregated preset on-policy, and the planner's pick with no
  staleness budget (`algorithm.max_staleness=0`);
- asynchronous (`generation.partial_rollout=true`: the streaming generator, admission paced by eta): the
  colocated preset (the stream refills its pool ahead, decoding between updates) and the disaggregated
  preset (its generator decoding during training) at eta = 1 .. --max-eta, a 2-device generator at
  eta = 1, and the planner's pick with `algorithm.max_staleness=--max-eta`.

Each plan runs `--warmup` + `--steps` steps; its time is the median `time/step_s` of the measured steps
(for a streamed run it includes the trainer's wait for its batch). Trained samples/s = prompts x G / that.

The ceiling: on 2 shared cores the generator and the trainer cannot both run at full speed, so an
asynchronous plan gains from keeping decode batches full, not from overlap. The best synchronous plan is
run once more with every response at the same length (sigma 0, the mean length measured): the same tokens
decoded at full occupancy. ceiling_ratio = T_sync / (T_sync - T_generate + T_generate_full), the gain a
generator that never drains could give with no overlap at all.

The planner's estimate of each plan (the simulator's steady state, the hardware profile calibrated here,
or `--measured` call tables of this config) is printed beside the measurement, with the median
|predicted / measured - 1| and where the planner's picks rank. The JSON (`--out`, never overwritten)
holds `sync_samples_per_s`, `async_samples_per_s`, `ratio`, `ceiling_ratio`, `eta` (of the best
asynchronous plan), `median_abs_error`, `pick_vs_best` and one row per plan. Run it on a quiet machine.
`--repredict JSON` runs no plan: it prices the plans of an earlier result again under this run's profile
and runs the two searches again under it; `pick_vs_best` then holds each pick's placement, the earlier
row that ran that placement (`measured_as`, null when none did: run the bench with that profile to
measure it) and its measured time / the best measured (`vs_best`).
`--quick` is a smoke test (tiny model, short responses, 1 measured step), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_planner import hardware_profile, measure, predict  # noqa: E402

G = 8
BASE = [
    "algorithm.name=grpo", f"algorithm.group_size={G}", "algorithm.minibatches=2", "algorithm.epochs=1",
    "algorithm.kl_coef=0.02", "model.actor.preset=small", "model.ref.init_from=actor", "model.tokenizer=byte",
    "data.source=arithmetic", "data.split=train", "data.max_prompt_len=16", "data.pad_multiple=16",
    "generation.engine=continuous", "generation.ignore_eos=true", "generation.simulated_lengths=true",
    "rewards.eos_only=false", "rewards.rules=[{name: exact_match, weight: 1.0}]",
    "run.platform=cpu", "run.devices=8", "run.log_every=1", "sft.steps=0", "run.checkpoint_every=0",
    "run.save_checkpoints=false", "run.export_hf=false", "run.tensorboard=false", "run.eval_every=0",
]
FULL = ["generation.max_new_tokens=512", "plan.response_length_median=64", "plan.response_length_sigma=1.0"]
QUICK = ["model.actor.preset=tiny", "generation.max_new_tokens=32", "plan.response_length_median=4",
         "plan.response_length_sigma=1.0"]
SYNC = ["algorithm.max_staleness=0", "generation.partial_rollout=false"]


def streamed(eta: int) -> list[str]:
    return [f"algorithm.max_staleness={eta}", "generation.partial_rollout=true"]


@dataclasses.dataclass
class Candidate:
    name: str
    plan: object  # ExecutionPlan
    overrides: list[str]
    eta: int  # 0: synchronous


def disaggregated(base, n: int, gen_devices: int, eta: int, models, batch: int):
    """The disaggregated preset with the generator on `gen_devices` devices (the rest train, each group
    laid out as the preset lays it out), run `eta` steps ahead (0: on-policy)."""
    from jaxrlhf.planner.plan import DeviceGroup, Placement
    from jaxrlhf.planner.presets import generation_layout, sharded_layout

    groups = {"gen": DeviceGroup("gen", 0, gen_devices), "train": DeviceGroup("train", gen_devices, n - gen_devices)}
    actor = models["actor"]
    gen_layout, train_layout = generation_layout(actor, gen_devices, batch, None), sharded_layout(actor, n - gen_devices, batch)
    if gen_layout is None or train_layout is None:
        return None  # the model's dimensions do not split over these groups
    calls = {c: Placement("gen", gen_layout) if p.group == "gen" else Placement("train", train_layout)
             for c, p in base.calls.items()}
    return dataclasses.replace(base, strategy=f"disaggregated-{gen_devices}", groups=groups, calls=calls,
                               offpolicy=eta > 0, staleness=eta or None,
                               notes=f"generation on {gen_devices} devices" + (f", {eta} ahead" if eta else ""))


def candidates(cfg, n: int, hw, max_eta: int, search_budget: float) -> list[Candidate]:
    from jaxrlhf import config as cfglib
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.run.assembly import setup

    sync_cfg = cfglib.with_overrides(cfg, SYNC)
    run_setup = setup(sync_cfg)
    algorithm, models = run_setup.algorithm, run_setup.models
    graph, batch = algorithm.graph(), algorithm.batch_rows
    preset = lambda name, **kw: build_plan(name, n, models, graph, batch_size=batch,  # noqa: E731
                                           workload=algorithm.workload(), hardware=hw, **kw)
    disagg = preset("disaggregated")
    gen = disagg.groups["gen"].stop - disagg.groups["gen"].start
    out = [Candidate("sync colocated", preset("colocated"), SYNC, 0),
           Candidate(f"sync disaggregated {gen}:{n - gen}", disaggregated(disagg, n, gen, 0, models, batch), SYNC, 0)]
    sync_pick, async_pick = planner_picks(cfg, n, hw, max_eta, search_budget)
    out.append(sync_pick)
    colocated = preset("colocated")
    for eta in range(1, max_eta + 1):
        out.append(Candidate(f"async colocated eta={eta}", colocated, streamed(eta), eta))
        out.append(Candidate(f"async disaggregated {gen}:{n - gen} eta={eta}", disaggregated(disagg, n, gen, eta, models, batch),
                             streamed(eta), eta))
    two = disaggregated(disagg, n, 2, 1, models, batch) if gen != 2 and n > 2 else None
    if two is not None:
        out.append(Candidate(f"async disaggregated 2:{n - 2} eta=1", two, streamed(1), 1))
    out.append(async_pick)
    return out


def planner_picks(cfg, n: int, hw, max_eta: int, search_budget: float) -> tuple[Candidate, Candidate]:
    """The planner's search under `hw`: its synchronous pick (no staleness budget) and its asynchronous one
    (budget `max_eta`; a stream runs ahead on any plan: by the plan's own eta, else the budget)."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.run import planning
    from jaxrlhf.run.assembly import setup

    picks = []
    for name, overrides in (("sync planner pick", SYNC), ("async planner pick", [*streamed(max_eta), "plan.strategy=auto"])):
        run_cfg = cfglib.with_overrides(cfg, overrides)
        run_setup = setup(run_cfg)
        best = planning.search_plan(run_cfg, run_setup.algorithm, run_setup.models, n, hw,
                                    time_budget_s=search_budget).best.plan
        eta = 0 if overrides is SYNC else best.staleness or max_eta
        picks.append(Candidate(name, best, streamed(eta) if eta else SYNC, eta))
    return picks[0], picks[1]


def placement_of(plan) -> dict[str, tuple]:
    """Where each call of `plan` runs: (first device, devices, layout) per call, what two plans share when
    they would run alike."""
    return {c: (plan.groups[p.group].start, plan.groups[p.group].size, str(p.layout)) for c, p in plan.calls.items()}


def measured_match(pick: Candidate, rows: list[dict]) -> dict | None:
    """The bench row that ran `pick`'s placement at its eta (synchronous: eta 0; a stream: the row of the
    same eta, else the closest one), or None when the bench did not run that placement."""
    from jaxrlhf.planner.plan import ExecutionPlan

    where = placement_of(pick.plan)
    same = [r for r in rows if (r["eta"] > 0) == (pick.eta > 0) and placement_of(ExecutionPlan.from_dict(r["plan"])) == where]
    return min(same, key=lambda r: (abs(r["eta"] - pick.eta), r["measured_s"]), default=None)


def repredict(path: Path, cfg, hw, work: Path, out: str | None, max_eta: int, search_budget: float) -> int:
    """The planner's estimate of each plan of an earlier result under `hw`, beside the time measured there,
    and its searches run again under `hw`: each pick's measured time / the best measured one, where the
    earlier result ran the pick's placement (`measured_match`)."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.planner.plan import ExecutionPlan
    from jaxrlhf.run.assembly import setup

    earlier = json.loads(path.read_text())
    rows = []
    for r in earlier["rows"]:
        plan = ExecutionPlan.from_dict(r["plan"])
        plan_file = work / (r["name"].replace(" ", "_").replace(":", "-").replace("=", "") + ".plan.yaml")
        plan.save(str(plan_file))
        run_cfg = cfglib.with_overrides(cfg, [*(streamed(r["eta"]) if r["eta"] else SYNC), f"plan.file={plan_file}"])
        _, est = predict(run_cfg, setup(run_cfg).models, plan, hw)
        rows.append({"name": r["name"], "eta": r["eta"], "predicted_s": est.step_s, "measured_s": r["measured_s"]})
        print(f"{r['name']:34s} predicted {est.step_s:8.2f} s  measured {r['measured_s']:8.2f} s  "
              f"ratio {est.step_s / r['measured_s']:5.2f}", flush=True)
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]
    best = min(r["measured_s"] for r in rows)
    predicted_best = min(rows, key=lambda r: r["predicted_s"])
    picks = {}
    for pick in planner_picks(cfg, ExecutionPlan.from_dict(earlier["rows"][0]["plan"]).num_devices, hw,
                              max_eta, search_budget):
        match = measured_match(pick, earlier["rows"])
        picks[pick.name] = {"eta": pick.eta, "placement": {c: list(v) for c, v in placement_of(pick.plan).items()},
                            "measured_as": match and match["name"],
                            "vs_best": match and match["measured_s"] / best}
        print(f"{pick.name} (searched again under this profile): " + (
            f"runs as '{match['name']}', measured {match['measured_s'] / best:.2f}x the best" if match else
            "a placement the bench did not run: run it to know its time ("
            + ", ".join(f"{c} {v[2]} on {v[0]}+{v[1]}" for c, v in placement_of(pick.plan).items()) + ")"))
    summary = {"median_abs_error": statistics.median(errors), "predicted_best": predicted_best["name"],
               "predicted_best_vs_best": predicted_best["measured_s"] / best, "pick_vs_best": picks, "rows": rows}
    print(f"median |predicted/measured - 1| {summary['median_abs_error']:.2f} over {len(rows)} plans; the plan "
          f"predicted fastest ({predicted_best['name']}) measured {summary['predicted_best_vs_best']:.2f}x the best")
    if out:
        with open(out, "x") as f:
            json.dump(summary, f, indent=2)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="measured steps per plan (default 4; quick 1)")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped per plan (compilation)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x G = 8 samples)")
    ap.add_argument("--max-eta", type=int, default=2, help="the largest staleness budget tried")
    ap.add_argument("--profile", help="hardware profile file (calibrated here and written there if missing)")
    ap.add_argument("--measured", action="store_true", help="predict from call tables measured for this config")
    ap.add_argument("--search-budget", type=float, default=30.0, help="seconds for each planner search")
    ap.add_argument("--workdir", help="run folders go here (default: a temporary folder)")
    ap.add_argument("--out", help="write the results as JSON here (a new file)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, short responses, 1 step")
    ap.add_argument("--repredict", metavar="JSON",
                    help="run nothing: predict the plans of an earlier --out again with this run's profile "
                         "(e.g. --measured) and compare with the step times measured there")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (1 if args.quick else 4)
    if steps < 1 or args.warmup < 0 or args.max_eta < 1:
        ap.error("--steps must be >= 1, --warmup >= 0 and --max-eta >= 1")
    if args.out and Path(args.out).exists():
        ap.error(f"--out {args.out} exists; choose another file (results are never overwritten)")

    from jaxrlhf import config as cfglib
    from jaxrlhf.train import setup_devices

    base = BASE + (QUICK if args.quick else FULL) + [f"data.batch_size={args.prompts}",
                                                      f"run.steps={args.warmup + steps}", *args.overrides]
    try:
        cfg = cfglib.load_config(None, base)
    except cfglib.ConfigError as e:
        ap.error(str(e))
    setup_devices(cfg.run)

    import jax

    n = jax.device_count()
    hw = hardware_profile(cfglib.with_overrides(cfg, SYNC), args.profile, args.measured)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    hw_file = work / "hardware.yaml"
    hw.save(str(hw_file))
    cfg = cfglib.with_overrides(cfg, [f"plan.hardware={hw_file}"])

    if args.repredict:
        return repredict(Path(args.repredict), cfg, hw, work, args.out, args.max_eta, args.search_budget)
    plans = candidates(cfg, n, hw, args.max_eta, args.search_budget)
    rows = []
    for c in plans:
        out_dir = work / c.name.replace(" ", "_").replace(":", "-").replace("=", "")
        if out_dir.exists():
            sys.exit(f"error: {out_dir} exists; pass an empty --workdir (earlier runs are never overwritten)")
        plan_file = Path(f"{out_dir}.plan.yaml")
        c.plan.save(str(plan_file))
        run_cfg = cfglib.with_overrides(cfg, [*c.overrides, f"plan.file={plan_file}", f"run.output_dir={out_dir}"])
        from jaxrlhf.run.assembly import setup

        placed, est = predict(run_cfg, setup(run_cfg).models, c.plan, hw)
        t0 = time.perf_counter()
        got = measure(run_cfg, out_dir, args.warmup)
        samples = args.prompts * G / got["step_s"]
        rows.append({"name": c.name, "eta": c.eta, "plan": placed.to_dict(), "predicted_s": est.step_s,
                     "measured_s": got["step_s"], "samples_per_s": samples, "measured_steps_s": got["steps_s"],
                     "measured_calls_s": got["calls_s"], "response_length": got["response_length"],
                     "wall_s": time.perf_counter() - t0})
        print(f"{c.name:34s} predicted {est.step_s:8.2f} s  measured {got['step_s']:8.2f} s  "
              f"{samples:6.2f} samples/s  ({rows[-1]['wall_s']:.0f} s wall)", flush=True)

    sync = min((r for r in rows if r["eta"] == 0), key=lambda r: r["measured_s"])
    asyn = min((r for r in rows if r["eta"] > 0), key=lambda r: r["measured_s"])
    # the ceiling: the best synchronous plan once more, every response at the measured mean length
    mean_len = max(1, round(statistics.fmean(r["response_length"] for r in rows)))
    plan_file = work / "ceiling.plan.yaml"
    next(c for c in plans if c.name == sync["name"]).plan.save(str(plan_file))
    ceil_cfg = cfglib.with_overrides(cfg, [*SYNC, f"plan.file={plan_file}", f"run.output_dir={work / 'ceiling'}",
                                           f"plan.response_length_median={mean_len}", "plan.response_length_sigma=0"])
    full = measure(ceil_cfg, work / "ceiling", args.warmup)
    gen_call = "actor.generate"
    t_sync, t_gen = sync["measured_s"], sync["measured_calls_s"].get(gen_call, 0.0)
    t_full = full["calls_s"].get(gen_call, 0.0)
    ceiling = t_sync / (t_sync - t_gen + t_full)

    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]
    best = min(r["measured_s"] for r in rows)
    picks = {r["name"]: r["measured_s"] / best for r in rows if "planner pick" in r["name"]}
    summary = {
        "sync_samples_per_s": sync["samples_per_s"], "async_samples_per_s": asyn["samples_per_s"],
        "ratio": asyn["samples_per_s"] / sync["samples_per_s"], "ceiling_ratio": ceiling, "eta": asyn["eta"],
        "best_sync": sync["name"], "best_async": asyn["name"],
        "ceiling": {"mean_length": mean_len, "sync_step_s": t_sync, "sync_generate_s": t_gen,
                    "full_occupancy_generate_s": t_full},
        "median_abs_error": statistics.median(errors), "pick_vs_best": picks,
        "prompts": args.prompts, "group_size": G, "devices": n, "steps": steps, "warmup": args.warmup,
        "rows": rows,
    }
    print(f"\n{'plan':34s} {'eta':>3s} {'predicted s':>11s} {'measured s':>10s} {'samples/s':>9s}")
    for r in rows:
        print(f"{r['name']:34s} {r['eta']:3d} {r['predicted_s']:11.2f} {r['measured_s']:10.2f} {r['samples_per_s']:9.2f}")
    print(f"\nbest synchronous: {sync['name']} {sync['samples_per_s']:.2f} samples/s; best asynchronous: "
          f"{asyn['name']} {asyn['samples_per_s']:.2f} samples/s: {summary['ratio']:.2f}x")
    print(f"ceiling (full decode batches, no overlap): {ceiling:.2f}x (generate {t_gen:.2f} s -> {t_full:.2f} s "
          f"at full occupancy, step {t_sync:.2f} s)")
    print(f"planner: median |predicted/measured - 1| {summary['median_abs_error']:.2f} over {len(rows)} plans; "
          + ", ".join(f"{k} {v:.2f}x the best measured" for k, v in picks.items()))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out:
        with open(args.out, "x") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
