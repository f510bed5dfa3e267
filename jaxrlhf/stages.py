"""Running a stage: the step loop every algorithm and stage goes through, and the actor's SFT warm-up.

A stage is an `Algorithm` (its graph, call functions, data and metrics), an
executor running its graph on a plan, and a data stream. `run_steps` is the
one loop that feeds it: the main run (`jaxrlhf.train`) wraps it with logging,
evaluation and checkpoints; the SFT warm-up (`sft.steps > 0`) is the SFT
stage run by the same loop on the actor's training placement of the RL plan.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator

from jaxrlhf import config as cfglib

WARMUP_SEED_OFFSET = 7919  # the warm-up's random stream is not the RL run's


def run_steps(algorithm, executor, data, rng, start: int, stop: int, *, offpolicy: bool = False,
              around: Callable[[int], ContextManager] = lambda step: contextlib.nullcontext(),
              ) -> Iterator[tuple[int, dict[str, Any], dict]]:
    """Run steps `start + 1 .. stop`: yields (step, metrics, data position before the step's batch).

    Step `s` draws from `fold_in(rng, s)`. With `offpolicy` the next step's batch is fed with this
    one, so the executor can start its generation while this step trains. `around(step)` wraps the
    executor's step (a profiler trace)."""
    import jax

    from jaxrlhf.transfer.host import HostValues

    batch = None
    for step in range(start + 1, stop + 1):
        batch = batch if (offpolicy and batch is not None) else data.next_batch()
        data_state = data.state_dict()
        nxt = data.next_batch() if offpolicy and step < stop else None
        feed = algorithm.feed(batch, jax.random.fold_in(rng, step))
        next_feed = algorithm.feed(nxt, jax.random.fold_in(rng, step + 1)) if nxt is not None else None
        with around(step):
            result = executor.step(feed, next_feed, read=algorithm.metric_values())
        result.values = HostValues(result.values)  # other values read on first use, alike on every process
        metrics = algorithm.metrics(result)
        metrics.update(result.metrics())
        metrics.update(data.metrics())
        batch = nxt
        yield step, metrics, data_state


def warmup_plan(plan):
    """The actor's SFT warm-up runs where the plan trains the actor, so its weights never move."""
    from jaxrlhf.planner.plan import ExecutionPlan

    placement = plan.calls["actor.train"]
    group = plan.groups[placement.group]
    return ExecutionPlan("warm-up", plan.num_devices, {group.name: group}, {"actor.train": placement},
                         notes="SFT warm-up on the actor's training placement")


def warm_up_actor(cfg: cfglib.Config, actor, plan, cache, tokenizer) -> dict[str, float]:
    """The SFT stage on the actor's training placement for `sft.steps` steps; updates `actor.params`."""
    import jax

    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.algorithms.optim import build_optimizer
    from jaxrlhf.models import lora
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role
    from jaxrlhf.roles import init_opt_state

    steps = cfg.sft.steps
    stage = build_algorithm(cfg, "sft", warmup=True)
    wplan = warmup_plan(plan)
    wcache = CallCache(wplan, devices=cache.devices, rules=cache.rules)
    optimizer = build_optimizer(lr=cfg.sft.lr, total_updates=steps, warmup_steps=min(10, steps),
                                trainable=lora.trainable if cfg.model.actor.lora else None)
    role = Role("actor", actor.graphdef, actor.params, optimizer)
    role.opt_state = init_opt_state(role, wcache.placed("actor.train"))
    stage.bind(tokenizer, {"actor": role})
    executor = Executor(wplan, stage.graph(), {"actor": role}, cache=wcache, functions=stage.functions())
    rng = jax.random.key(cfg.run.seed + WARMUP_SEED_OFFSET)
    t0, loss, every = time.perf_counter(), float("nan"), max(steps // 5, 1)
    for step, metrics, _ in run_steps(stage, executor, stage.dataset(tokenizer), rng, 0, steps):
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
