"""`python -m jaxrlhf.train --config FILE [key=value ...]`: the main job, for every algorithm and stage.

The CLI and the run loop only. A run resolves its config, sets up the JAX
backend (`jaxrlhf.run.backend`) and is assembled as every entry point's run is
(`jaxrlhf.run.assembly.setup`): the algorithm (`algorithm.name`) with its roles
and step graph, the execution plan (`jaxrlhf.run.planning`, shared with
`python -m jaxrlhf.plan`), and, once the output folder is claimed
(`jaxrlhf.run.folder`), the models on their home placements, the actor warmed
up with the SFT stage first when `sft.steps > 0` (`jaxrlhf.run.stages`). It
then runs the algorithm's steps (`jaxrlhf.run.stages.run_steps`) with metrics,
evaluation, checkpoints and signals, and exports the trained models as HF
checkpoints. What a step computes is the algorithm's business; where each
call runs is the plan's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Mapping, Sequence

from jaxrlhf import config as cfglib
from jaxrlhf.errors import EXIT_INTERRUPTED, Interrupted, RunError, run_cli
from jaxrlhf.run.backend import setup_devices
from jaxrlhf.run.folder import RunFiles, output_dir_lock, prepare_output_dir, set_aside_log


def run(cfg: cfglib.Config) -> dict[str, Any]:
    """Train according to `cfg`; returns the last step's metrics. One run at a time per output folder."""
    from jaxrlhf.metrics import require_wandb

    cfglib.validate(cfg)
    require_wandb(cfg.run.wandb)  # the optional package, before the run spends any time
    with output_dir_lock(cfg.run.output_dir):
        return _train(cfg)


def _train(cfg: cfglib.Config) -> dict[str, Any]:
    import jax

    from jaxrlhf.checkpoint import CheckpointManager
    from jaxrlhf.metrics import MetricsWriter
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.run.assembly import setup
    from jaxrlhf.run.roles import export_role
    from jaxrlhf.run.stages import Replanner, open_checked_data, run_steps, warm_up_actor
    from jaxrlhf.transfer.processes import any_process, barrier, is_main

    run_setup = setup(cfg)
    algorithm, model_configs = run_setup.algorithm, run_setup.models
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    data = open_checked_data(cfg, algorithm, tokenizer)
    for role, mc in model_configs.items():
        if mc.vocab_size < tokenizer.vocab_size:
            raise cfglib.ConfigError(
                f"model.{role}: vocab_size {mc.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )
    plan = run_setup.choose_plan()
    print(plan.table(), flush=True)
    cache = run_setup.cache(plan)

    prepare_output_dir(cfg.run, write=is_main())
    barrier("output_dir")  # no process opens files in the folder before process 0 has cleared it
    files = RunFiles.of(cfg.run, algorithm.export_roles())
    if is_main():
        print(files.summary(cfg.run), flush=True)
        plan.save(files.plan)  # what ran, for scripts/step_breakdown.py and for plan.file
        run_setup.hardware.save(files.hardware)
    ckpt = CheckpointManager(files.checkpoints, max_to_keep=cfg.run.keep_checkpoints)
    resume_step = ckpt.latest_step() if cfg.run.resume else None
    if cfg.run.resume and resume_step is None and is_main():
        set_aside_log(cfg.run.output_dir)

    # Models on their home placements; the warm-up runs before any role copies the actor.
    warm_metrics: dict[str, float] = {}

    def warm_up(actor) -> None:
        warm_metrics.update(warm_up_actor(run_setup, actor, plan, cache, tokenizer))

    run = run_setup.build(plan, tokenizer, cache=cache,
                          warm_up=warm_up if cfg.sft.steps and resume_step is None else None)
    roles, executor, specs, views = run.roles, run.executor, algorithm.roles(), algorithm.base_views()
    derived_frozen = [r for r, s in specs.items()
                      if not s.trained and getattr(cfg.model, r).init_from and r not in views]

    def arrays() -> dict[str, Any]:
        out: dict[str, Any] = {"state": executor.commit_state()}
        for name, role in roles.items():
            if role.trainable:
                out[name] = {"params": role.params, "opt_state": role.opt_state}
            elif name in derived_frozen:  # e.g. the reference copied from the warmed-up actor
                out[name] = {"params": role.params}
        return out

    start = 0
    if resume_step is not None:
        resume_step, restored, meta = ckpt.restore_latest(arrays(), algorithm=cfg.algorithm.name)
        executor.state = dict(restored.pop("state"))
        for name, saved in restored.items():
            roles[name].params = saved["params"]
            if "opt_state" in saved:
                roles[name].opt_state = saved["opt_state"]
        executor.offload_idle()
        executor.sync_shadows()
        data.load_state_dict(meta["data"])
        start = int(meta["step"])
        print(f"resumed from step {start} ({ckpt.directory})", flush=True)

    def save(step: int, data_state: dict) -> None:
        ckpt.save(step, arrays(), {"step": step, "data": data_state, "algorithm": cfg.algorithm.name})

    replanner = None
    if cfg.plan.replan_every:
        replanner = Replanner(run_setup, plan, write=is_main(), make_cache=lambda p: run_setup.cache(p, like=cache))

    staleness = run_setup.staleness(plan)
    if cfg.staleness_budget and not staleness:
        print(f"algorithm.max_staleness={cfg.staleness_budget}: the plan is synchronous (no generator of its "
              "own to run ahead), so every rollout is on-policy", flush=True)
    steps = cfg.run.steps
    writer = MetricsWriter(cfg.run.output_dir, steps, resume_step=start, tensorboard=cfg.run.tensorboard,
                           enabled=is_main(), wandb=cfg.run.wandb, config=cfglib.to_dict(cfg))
    metrics: dict[str, Any] = {}
    stop = StopRequest()
    saved_step, dead = start, {}
    try:
        stop.install()
        for step, metrics, data_state in run_steps(algorithm, executor, data, jax.random.key(cfg.run.seed), start,
                                                   steps, staleness=staleness,
                                                   around=lambda s: profiled(cfg.run, s), after=replanner):
            if replanner is not None:  # a re-plan may have moved the run onto another plan
                executor = replanner.executor
            if step == 1:
                metrics.update(warm_metrics)
            if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or step == steps):
                metrics.update(algorithm.evaluate(executor))
            _check_finite(metrics, step)
            if step % cfg.run.log_every == 0 or step == steps:
                writer.write(step, metrics)
            dead = _dead_updates(metrics, algorithm.updates_per_step, dead)
            stuck = [k for k, n in dead.items() if n >= MAX_DEAD_STEPS]
            if stuck:
                raise RunError(
                    f"every update of the last {MAX_DEAD_STEPS} steps (to step {step}) had a non-finite loss or "
                    f"gradient and was skipped ({', '.join(stuck)}), so that model stopped changing; nothing was "
                    f"exported. Lower the learning rate (optimizer.<role>.lr) or check the data"
                    + (f"; the last checkpoint is step {saved_step} in {ckpt.directory}" if saved_step else "")
                )
            # Decided once per step, alike on every process: a signal that arrives during the save below
            # is acted on after the next step (a process that stopped on its own flag would leave the
            # others waiting in that step's collectives).
            stopping = any_process(bool(stop.requested))
            why = stop.requested or "a signal to another process"
            due = (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0) or step == steps or stopping
            if due and cfg.run.save_checkpoints:
                save(step, data_state)
                saved_step = step
            if stopping and step < steps:
                raise Interrupted(
                    f"stopped by {why} after step {step}; checkpoint saved in {ckpt.directory}. "
                    f"Resume with the same command and run.resume=true" if cfg.run.save_checkpoints else
                    f"stopped by {why} after step {step}; no checkpoint written (run.save_checkpoints=false)"
                )
    finally:
        stop.uninstall()
        writer.close()
        ckpt.close()

    for name, folder in files.exports.items():
        export_role(cfg, roles[name], model_configs[name], folder)
    if is_main():
        print(files.summary(cfg.run, last_checkpoint=saved_step, finished=True), flush=True)
    return metrics


@contextlib.contextmanager
def profiled(run_cfg: cfglib.RunConfig, step: int) -> Iterator[None]:
    """A JAX profiler trace of `step` when `run.profile_steps` names it: `<output_dir>/profile/step_<N>/`
    holds the XPlane trace (TensorBoard's profile plugin, xprof) and a Perfetto trace (ui.perfetto.dev)."""
    if step not in run_cfg.profile_steps:
        yield
        return
    import jax

    from jaxrlhf.transfer.processes import is_main

    folder = os.path.join(run_cfg.output_dir, "profile", f"step_{step}")
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    try:
        yield
    finally:
        jax.profiler.stop_trace()
        if is_main():
            print(f"step {step}: profiler trace written to {folder} (see docs/profiling.md)", flush=True)


MAX_DEAD_STEPS = 5  # consecutive steps whose every update was skipped before a run gives up


def _dead_updates(metrics: Mapping[str, Any], updates_per_step: int, dead: Mapping[str, int]) -> dict[str, int]:
    """Per skip counter (one per trained role): how many steps in a row every update was skipped. One
    role's dead updates stop the run as surely as all roles' (a critic that never learns again makes
    every later advantage wrong while the run looks alive)."""
    return {k: dead.get(k, 0) + 1 if v >= updates_per_step else 0
            for k, v in metrics.items() if k.endswith("skipped_nonfinite")}


class StopRequest:
    """SIGINT/SIGTERM during training: the first finishes the current step, saves a checkpoint and stops
    (the loop checks `requested`); a second one exits at once."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread; embedded callers keep their own handling
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.requested:  # the second signal: no more waiting
            print(f"\n{name} again: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        self.requested = name
        print(f"\n{name}: finishing the current step, then saving a checkpoint (send it again to exit now)",
              file=sys.stderr, flush=True)


def _check_finite(metrics: dict[str, Any], step: int) -> None:
    """Non-finite updates were skipped on device; say so on the console, keep going."""
    skipped = sum(v for k, v in metrics.items() if k.endswith("skipped_nonfinite"))
    if skipped:
        print(
            f"step {step}: {int(skipped)} update(s) had a non-finite loss or gradient and were skipped "
            "(parameters unchanged)",
            file=sys.stderr,
            flush=True,
        )


def _main(argv: Sequence[str]) -> int:
    args = cfglib.parse_cli(argv)
    if args.print_config:
        print(cfglib.format_config(args.config), end="")
        return 0
    setup_devices(args.config.run, args.config.distributed)
    import jax

    if jax.process_index() > 0:  # one process reports progress; the others' errors still reach stderr
        sys.stdout = open(os.devnull, "w")
    run(args.config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxrlhf.train`: exit 0 on success, 2 for a user's mistake (one line saying what to fix),
    130 when stopped by a signal (after saving a checkpoint)."""
    return run_cli("jaxrlhf.train", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
