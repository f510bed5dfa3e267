"""Running a stage: the step loop every algorithm and stage goes through, and the actor's SFT warm-up.

A stage is an `Algorithm` (its graph, call functions, data and metrics), an
executor running its graph on a plan, and a data stream. `run_steps` is the
one loop that feeds it: the main run (`jaxrlhf.train`) wraps it with logging,
evaluation and checkpoints; the SFT warm-up (`sft.steps > 0`) is the SFT
stage run by the same loop on the actor's training placement of the RL plan.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any, Callable, ContextManager, Iterator

from jaxrlhf import config as cfglib

WARMUP_SEED_OFFSET = 7919  # the warm-up's random stream is not the RL run's


def run_steps(algorithm, executor, data, rng, start: int, stop: int, *, staleness: int = 0,
              around: Callable[[int], ContextManager] = lambda step: contextlib.nullcontext(),
              after: Callable[[int, dict[str, Any], Any], Any] | None = None,
              ) -> Iterator[tuple[int, dict[str, Any], dict]]:
    """Run steps `start + 1 .. stop`: yields (step, metrics, data position after the step's batch,
    where a run resumed from that step continues).

    Step `s` draws from `fold_in(rng, s)`. The algorithm's rollout (`algorithm.rollout`, `jaxrlhf.rollouts`)
    hands over each step's batch (its feed, with the generate call's outputs when the rollout produced them)
    and the feeds of later steps whose rollouts start while this one trains; `staleness` eta > 0 (an
    off-policy plan) lets a trained rollout's policy lag the trainer by up to eta updates, and each step then
    reports `rollout/staleness` and `rollout/policy_version`. A resumed run starts again from its own step:
    the rollouts in flight at the checkpoint are generated again, from the same batches with the same keys,
    never trained twice. `around(step)` wraps the executor's step (a profiler trace). `after(step, metrics,
    executor)`, when given, runs after each step (it may add metrics) and returns the executor for the next
    steps: the same one, or one on another plan (`Replanner`: a live switch, the rollout drained first; the
    data stream and random keys go on unchanged)."""
    import jax

    from jaxrlhf.transfer.host import HostValues

    def draw(step: int) -> dict:
        batch = data.next_batch()
        return {"step": step, "feed": algorithm.feed(batch, jax.random.fold_in(rng, step)),
                "data_state": data.state_dict()}

    rollout = algorithm.rollout
    rollout.begin(executor, draw=draw, start=start, stop=stop, staleness=staleness)
    if isinstance(after, Replanner):  # a re-plan leaves nothing of the rollout in flight before the weights move
        after.before_switch = rollout.before_move
    for step in range(start + 1, stop + 1):
        batch = rollout.step(step)
        with around(step):
            result = executor.step(batch.feed, batch.ahead, read=algorithm.metric_values(), overlap=batch.overlap)
        rollout.trained()
        result.values = HostValues(result.values)  # other values read on first use, alike on every process
        metrics = algorithm.metrics(result)
        metrics.update(result.metrics())
        metrics.update(batch.metrics)
        metrics.update(data.metrics())
        if batch.seconds:  # the rollout's time outside the executor's step (episodes, waiting on a stream)
            metrics["time/step_s"] = metrics.get("time/step_s", 0.0) + batch.seconds
        if after is not None:
            moved = after(step, metrics, executor)
            if moved is not executor:  # a re-plan switched: the rollout goes on on the new plan
                rollout.moved_to(moved)
                executor = moved
        yield step, metrics, batch.data_state


class Replanner:
    """Re-planning while the run goes (`plan.replan_every: K` with `plan.strategy: auto`).

    After every step it keeps the step's time and each call's run time (`time/<call>_s`), leaving
    out the first step on each plan (first runs of freshly compiled functions). Every K steps, the
    median time of each call becomes a `planner.measured.Run` in the run's hardware profile, the
    planner searches again on that profile (`planning.replan`, the path `plan_for` takes) and, when
    another plan is predicted faster by more than `plan.replan_threshold`, the executor moves the
    roles' parameters, optimizer states and carried values onto the new plan device to device
    (`Executor.moved_to`) and the run goes on there: no restart, the same math. Each check adds
    `replan/*` metrics and a console line; the first check after a switch reports the gain then
    measured (median step time on the old plan / on the new one - 1). No switch at the last step. A
    streamed run's generator is drained first (`before_switch`). The plans switched to and the
    corrected profile are written to `<output_dir>/replan/`. The decision is made from process 0's
    times, so every process switches alike.
    """

    def __init__(self, run_setup, plan, make_cache: Callable[[Any], Any], write: bool):
        cfg = run_setup.cfg
        self.setup, self.cfg, self.algorithm, self.plan = run_setup, cfg, run_setup.algorithm, plan
        self.hw = run_setup.hardware
        self.models = run_setup.planned_models
        self.make_cache = make_cache
        self.folder = os.path.join(cfg.run.output_dir, "replan") if write else None
        self.calls = [c.name for c in self.algorithm.graph().calls]
        self.samples: list[tuple[float, list[float]]] = []  # (step seconds, call seconds) on the running plan
        self.fresh = True  # the next step is the first on this plan
        self.before: float | None = None  # median step time on the plan switched away from
        self.switches = 0
        self.executor = None  # the executor the run is on after the latest step
        # called just before the weights move to the plan switched to (a streaming generator's `drain`:
        # nothing in flight may be left on the old placement); returns metrics
        self.before_switch: Callable[[], dict[str, float]] | None = None

    def __call__(self, step: int, metrics: dict[str, Any], executor):
        """After `step`: keep its times; every K steps, the check. Returns (and keeps, as `executor`)
        the executor the next steps run on."""
        if not self.fresh:
            self.samples.append((float(metrics["time/step_s"]), [self._call_s(metrics, c) for c in self.calls]))
        self.fresh = False
        self.executor = executor
        if step % self.cfg.plan.replan_every == 0 and self.samples:
            self.executor = self.check(step, metrics, executor)
        return self.executor

    @staticmethod
    def _call_s(metrics: dict[str, Any], call: str) -> float:
        """A call's seconds in the step; a streamed generate call (no `time/actor.generate_s`: the stream
        supplies its outputs) by the stream's decoding for the step, waited for or beside the update."""
        if f"time/{call}_s" not in metrics and call.endswith(".generate") and "time/generate_wait_s" in metrics:
            return float(metrics["time/generate_wait_s"] + metrics.get("time/generate_overlap_s", 0.0))
        return float(metrics.get(f"time/{call}_s", 0.0))

    def check(self, step: int, metrics: dict[str, Any], executor):
        """Feed the medians of the samples into the profile, search again, switch if worth it."""
        from jaxrlhf.planner.replan import timed_runs, with_runs
        from jaxrlhf.transfer.processes import main_values

        graph, wl = self.algorithm.graph(), self.algorithm.workload()
        medians = main_values([statistics.median(s[0] for s in self.samples)]
                              + [statistics.median(s[1][i] for s in self.samples) for i in range(len(self.calls))])
        step_s, call_s = medians[0], dict(zip(self.calls, medians[1:]))
        if self.before is not None:  # the first check on the plan switched to: what the switch bought
            gain = self.before / step_s - 1.0
            metrics["replan/measured_gain"] = gain
            print(f"step {step}: re-plan: the plan switched to runs {step_s:.4g} s per step against "
                  f"{self.before:.4g} s before ({100 * gain:+.1f} % measured)", flush=True)
            self.before = None
        self.samples = []
        self.hw = with_runs(self.hw, timed_runs(self.plan, graph, self.models, wl, self.hw, call_s))
        t0 = time.perf_counter()
        decision, _ = self.setup.replan(self.plan, self.hw)
        metrics.update({"replan/search_s": time.perf_counter() - t0, "replan/switched": float(decision.switch),
                        "replan/predicted_gain": decision.gain, "replan/measured_step_s": step_s})
        if decision.current_s is not None:
            metrics["replan/predicted_step_s"] = decision.current_s
        if decision.best_s is not None:
            metrics["replan/best_step_s"] = decision.best_s
        agreed = self._agreed(decision.plan)  # on every process at every check: its collectives must match
        if decision.switch and step >= self.cfg.run.steps:
            print(f"step {step}: re-plan: another plan is predicted {100 * decision.gain:+.1f} % faster, but this "
                  "was the last step", flush=True)
            metrics["replan/switched"] = 0.0
            return executor
        if decision.switch and not agreed:
            print(f"step {step}: re-plan: the processes' searches picked different plans (a search time budget "
                  "hit on some); keeping the plan", flush=True)
            metrics["replan/switched"] = 0.0
            return executor
        print(decision.line(step), flush=True)
        if not decision.switch:
            return executor
        if self.before_switch is not None:
            metrics.update(self.before_switch())
        t0 = time.perf_counter()
        plan = decision.plan
        new = executor.moved_to(plan, self.make_cache(plan))
        self.switches += 1
        metrics.update({"replan/switch_s": time.perf_counter() - t0, "replan/switches": float(self.switches)})
        self.plan, self.before, self.fresh = plan, step_s, True
        print(plan.table(), flush=True)
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)
            plan.save(os.path.join(self.folder, f"plan_step{step}.yaml"))
            self.hw.save(os.path.join(self.folder, f"profile_step{step}.yaml"))
        return new

    @staticmethod
    def _agreed(plan) -> bool:
        """Whether every process decided for the same `plan` (the one to run next: each searched on
        its own; the times they searched with are process 0's, but a search that hits its time
        budget may stop elsewhere). With one process, always."""
        import zlib

        from jaxrlhf.planner.replan import placements
        from jaxrlhf.transfer.processes import any_process, main_values

        mine = zlib.crc32(repr(placements(plan)).encode()) % (1 << 20)  # exact in the float32 main_values sends
        return not any_process(int(main_values([float(mine)])[0]) != mine)


def warmup_plan(plan):
    """The actor's SFT warm-up runs where the plan trains the actor, so its weights never move."""
    from jaxrlhf.planner.plan import ExecutionPlan

    placement = plan.calls["actor.train"]
    group = plan.groups[placement.group]
    return ExecutionPlan("warm-up", plan.num_devices, {group.name: group}, {"actor.train": placement},
                         offload_optimizer=tuple(r for r in plan.offload_optimizer if r == "actor"),
                         notes="SFT warm-up on the actor's training placement")


def warm_up_actor(run_setup, actor, plan, cache, tokenizer) -> dict[str, float]:
    """The SFT stage on the actor's training placement of `plan` for `sft.steps` steps, assembled like
    any run (`assembly.setup`) on the run's machine and devices; updates `actor.params`."""
    import jax

    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.algorithms.optim import build_optimizer
    from jaxrlhf.models import lora
    from jaxrlhf.placement.executor import Role
    from jaxrlhf.run.assembly import setup
    from jaxrlhf.run.roles import init_opt_state

    cfg = run_setup.cfg
    steps = cfg.sft.steps
    stage = setup(cfg, algorithm=build_algorithm(cfg, "sft", warmup=True), machine=run_setup.machine)
    wplan = warmup_plan(plan)
    wcache = stage.cache(wplan, like=cache)
    optimizer = build_optimizer(lr=cfg.sft.lr, total_updates=steps, warmup_steps=min(10, steps),
                                trainable=lora.trainable if cfg.model.actor.lora else None)
    role = Role("actor", actor.graphdef, actor.params, optimizer)
    role.opt_state = init_opt_state(role, wcache.placed("actor.train"))
    executor = stage.build(wplan, tokenizer, cache=wcache, roles={"actor": role}).executor
    rng = jax.random.key(cfg.run.seed + WARMUP_SEED_OFFSET)
    t0, loss, every = time.perf_counter(), float("nan"), max(steps // 5, 1)
    algorithm = stage.algorithm
    for step, metrics, _ in run_steps(algorithm, executor, algorithm.dataset(tokenizer), rng, 0, steps):
        loss = metrics["loss/sft"]
        if step % every == 0 or step == steps:
            print(f"sft warm-up step {step}/{steps}: loss={loss:.4f}", flush=True)
    actor.params = role.params
    return {"sft/final_loss": loss, "sft/seconds": time.perf_counter() - t0}


def open_checked_data(cfg: cfglib.Config, algorithm, tokenizer):
    """The run's training stream, after every stream the run will read (training, held-out split,
    SFT warm-up) was opened and one batch of each encoded: a data error of a later stage stops the
    run before an earlier stage (the warm-up, model building) has spent any time."""
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.data.sources import DataError

    streams = [("data", lambda: algorithm.dataset(tokenizer))]
    if cfg.run.eval_every and cfg.data.eval_split:
        streams.append((f"data.eval_split={cfg.data.eval_split}",
                        lambda: algorithm.dataset(tokenizer, split=cfg.data.eval_split)))
    if cfg.sft.steps and not cfg.run.resume:
        streams.append(("sft warm-up data", lambda: build_algorithm(cfg, "sft", warmup=True).dataset(tokenizer)))
    opened = []
    for label, build in streams:
        try:
            stream = build()
            stream.check()
        except DataError as e:
            raise DataError(f"{label}: {e}") from None
        opened.append(stream)
    return opened[0]
