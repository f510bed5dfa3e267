"""`python -m jaxrlhf.train --config FILE [key=value ...]`: the main job, for every algorithm and stage.

Orchestration only: resolve the config, set up devices, ask the algorithm
(`algorithm.name`) for its roles and step graph, pick or load the execution
plan for that graph, build the models on their home placements, optionally
warm the actor up with the SFT stage, then run steps on the executor with
metrics, evaluation and checkpoints, and export the trained models as HF
checkpoints. What a step computes is the algorithm's business; where each
call runs is the plan's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Iterator, Mapping, Sequence

from jaxrlhf import config as cfglib
from jaxrlhf.errors import EXIT_INTERRUPTED, Interrupted, RunError, run_cli
from jaxrlhf.planning import plan_for, role_configs


def setup_devices(run: cfglib.RunConfig, dist: cfglib.DistributedConfig | None = None) -> None:
    """Must run before any JAX backend starts. `dist` says how the processes of a
    `run.distributed` run find each other (see `jaxrlhf.distributed`)."""
    import jax

    from jaxrlhf import distributed

    if run.platform == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_platforms", "cpu")
        if run.devices:
            jax.config.update("jax_num_cpu_devices", run.devices)
    elif run.platform in ("gpu", "tpu"):
        jax.config.update("jax_platforms", "cuda" if run.platform == "gpu" else "tpu")
    enable_compile_cache(run.compile_cache)
    if run.distributed:
        distributed.initialize(dist or cfglib.DistributedConfig(), run.platform)
    if run.platform in ("gpu", "tpu"):
        try:
            jax.devices()
        except Exception as e:  # RuntimeError, or an AssertionError from a backend that never initialised
            raise RunError(
                f"run.platform={run.platform}, but JAX has no {run.platform.upper()} backend here "
                f"({_first_line(e)}); set run.platform=cpu (or auto), or install jax with {run.platform} support"
            ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def enable_compile_cache(folder: str | None) -> None:
    """JAX's persistent compilation cache in `folder` (None: off), so a second run of the same config
    loads its executables instead of compiling them. Any executable that took over 0.5 s is kept."""
    import jax

    if folder is None:
        return
    path = os.path.expanduser(folder)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise cfglib.ConfigError(f"run.compile_cache={folder!r}: cannot create the folder ({e.strerror}); "
                                 "choose another folder or set run.compile_cache=null") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# --------------------------------------------------------------------------- plan
# Plan choice is shared with `python -m jaxrlhf.plan` (jaxrlhf.planning), so both pick the same plan.


def warmup_plan(plan):
    """The actor's SFT warm-up runs where the plan trains the actor, so its weights never move."""
    from jaxrlhf.planner.plan import ExecutionPlan

    placement = plan.calls["actor.train"]
    group = plan.groups[placement.group]
    return ExecutionPlan("warm-up", plan.num_devices, {group.name: group}, {"actor.train": placement},
                         notes="SFT warm-up on the actor's training placement")


# --------------------------------------------------------------------------- roles


@dataclasses.dataclass
class Built:
    """A role's model as built: structure, parameters (on device) and output head."""

    graphdef: Any
    params: Any
    head: str


class RoleBuilder:
    """Builds every role's parameters directly on its home placement.

    Roles with a preset are initialised on device (sharded as they will live);
    roles with a checkpoint path are loaded; roles with `init_from` copy the
    source role's current parameters (so after a warm-up the reference is the
    warmed-up actor): the whole model when the heads agree, the trunk under a
    fresh head otherwise (a critic or reward model from an actor); a source's
    LoRA adapters are merged into a copy whose role has other adapters or none
    (`lora.merge_adapters`), and the role's own start fresh. A source
    the algorithm does not use itself (the actor of a reward-model stage) is
    built where the role that copies it lives, and dropped after.
    """

    def __init__(self, cfg: cfglib.Config, specs: Mapping[str, Any], model_configs: Mapping[str, Any], cache, plan):
        self.cfg, self.specs, self.model_configs, self.cache, self.plan = cfg, specs, model_configs, cache, plan
        self.seed = cfg.run.seed

    def shardings(self, at: str, state: Any) -> Any:
        """Shardings of `state` on the home placement of role `at`."""
        return self.cache.placed(self.plan.home_call(at)).param_shardings(state)

    def head(self, role: str) -> str:
        return self.specs[role].head if role in self.specs else "lm"

    def direct(self, role: str, at: str) -> Built:
        """A role whose weights come from its own preset or checkpoint, on `at`'s home."""
        from flax import nnx

        from jaxrlhf.models.hf_io import load_hf_checkpoint

        rc, mc, head = getattr(self.cfg.model, role), self.model_configs[role], self.head(role)
        if rc.path:
            # each parameter placed as it is read: no process holds the whole model
            model, _ = load_hf_checkpoint(rc.path, head, param_dtype=mc.param_dtype, dtype=mc.dtype, seed=self.seed,
                                          remat=rc.remat, config_overrides={**rc.overrides, "lora": mc.lora},
                                          shardings=lambda state: self.shardings(at, state))
            graphdef, state = nnx.split(model)
            return Built(graphdef, state, head)
        return self.fresh(role, head, self.seed + list(cfglib.ROLES).index(role), at)

    def fresh(self, role: str, head: str, seed: int, at: str) -> Built:
        """A randomly initialised model, created on device already sharded as on `at`'s home."""
        import jax
        from flax import nnx

        from jaxrlhf.models.transformer import build_model

        mc, remat = self.model_configs[role], getattr(self.cfg.model, role).remat
        make = lambda: build_model(mc, head, seed=seed, remat=remat)  # noqa: E731
        graphdef, abstract = nnx.split(nnx.eval_shape(make))
        params = jax.jit(lambda: nnx.split(make())[1], out_shardings=self.shardings(at, abstract))()
        return Built(graphdef, params, head)

    def structure(self, role: str):
        """The role's model structure (graphdef) without building its weights."""
        from flax import nnx

        from jaxrlhf.models.transformer import build_model

        mc, remat = self.model_configs[role], getattr(self.cfg.model, role).remat
        return nnx.split(nnx.eval_shape(lambda: build_model(mc, self.head(role), remat=remat)))[0]

    def derived(self, role: str, source: Built) -> Built:
        """A copy of `source` laid out for `role`'s home: whole, or its trunk under a fresh head."""
        from jaxrlhf.models import lora
        from jaxrlhf.placement.realloc import reallocate

        head = self.head(role)
        source_lora = self.model_configs[getattr(self.cfg.model, role).init_from].lora
        mine = self.model_configs[role].lora
        if head == source.head and mine == source_lora:
            copy, _ = reallocate(source.params, self.shardings(role, source.params))  # always new buffers
            return Built(source.graphdef, copy, head)
        fresh = self.fresh(role, head, self.seed + 1, role)
        params = source.params
        if source_lora != mine:  # the source's adapters folded in; the role's own adapters start fresh
            params = lora.with_base(fresh.params, lora.merge_adapters(params, source_lora) if source_lora else params)
        if head == source.head:
            copy, _ = reallocate(params, self.shardings(role, fresh.params))
            return Built(fresh.graphdef, copy, head)
        trunk, _ = reallocate(params["model"], self.shardings(role, fresh.params)["model"])
        out = dict(fresh.params)
        out["model"] = trunk
        return Built(fresh.graphdef, type(fresh.params)(out), head)


def init_depth(cfg: cfglib.Config, role: str) -> int:
    """How many init_from links lead from `role` to a role with its own weights."""
    depth, rc, seen = 0, getattr(cfg.model, role), {role}
    while rc.init_from and rc.init_from not in seen:
        seen.add(rc.init_from)
        depth, rc = depth + 1, getattr(cfg.model, rc.init_from)
    return depth


def build_optimizer_for(cfg: cfglib.Config, role: str, total_updates: int, model_config):
    """The role's AdamW; fp32 master weights only where its parameters are low precision."""
    from jaxrlhf.algorithms.optim import build_optimizer
    from jaxrlhf.models import lora

    o = getattr(cfg.optimizer, role)
    trained_dtype = model_config.lora.dtype if model_config.lora else model_config.param_dtype
    return build_optimizer(
        lr=o.lr, total_updates=total_updates, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
        warmup_steps=o.warmup_steps, schedule=o.schedule, max_grad_norm=o.max_grad_norm,
        master_weights=o.master_weights and trained_dtype in ("bfloat16", "float16"),
        trainable=lora.trainable if model_config.lora else None,
    )


def init_opt_state(role, placed):
    """Optimizer state laid out like the params, counters replicated: checkpoints restore onto this."""
    import jax

    return jax.jit(role.optimizer.init, out_shardings=placed.opt_state_shardings(role.optimizer, role.params))(
        role.params
    )


# --------------------------------------------------------------------------- warm-up


def warm_up_actor(cfg: cfglib.Config, actor, plan, cache, tokenizer) -> dict[str, float]:
    """The SFT stage on the actor's training placement for `sft.steps` steps; updates `actor.params`."""
    import jax

    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.algorithms.optim import build_optimizer
    from jaxrlhf.distributed import host_get
    from jaxrlhf.models import lora
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role

    stage = build_algorithm(cfg, "sft", warmup=True)
    wplan = warmup_plan(plan)
    wcache = CallCache(wplan, devices=cache.devices, rules=cache.rules)
    optimizer = build_optimizer(lr=cfg.sft.lr, total_updates=cfg.sft.steps, warmup_steps=min(10, cfg.sft.steps),
                                trainable=lora.trainable if cfg.model.actor.lora else None)
    role = Role("actor", actor.graphdef, actor.params, optimizer)
    role.opt_state = init_opt_state(role, wcache.placed("actor.train"))
    stage.bind(tokenizer, {"actor": role})
    executor = Executor(wplan, stage.graph(), {"actor": role}, cache=wcache, functions=stage.functions())
    data = stage.dataset(tokenizer)
    rng = jax.random.key(cfg.run.seed + 7919)
    t0 = time.perf_counter()
    loss = float("nan")
    for i in range(cfg.sft.steps):
        result = executor.step(stage.feed(data.next_batch(), jax.random.fold_in(rng, i)))
        if (i + 1) % max(cfg.sft.steps // 5, 1) == 0 or i + 1 == cfg.sft.steps:
            loss = float(host_get(result.values["actor_stats"]["loss/sft"]))
            print(f"sft warm-up step {i + 1}/{cfg.sft.steps}: loss={loss:.4f}", flush=True)
    actor.params = role.params
    return {"sft/final_loss": loss, "sft/seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- data


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


# --------------------------------------------------------------------------- main


def run(cfg: cfglib.Config) -> dict[str, Any]:
    """Train according to `cfg`; returns the last step's metrics. One run at a time per output folder."""
    cfglib.validate(cfg)
    with output_dir_lock(cfg.run.output_dir):
        return _train(cfg)


@contextlib.contextmanager
def output_dir_lock(out: str) -> Iterator[None]:
    """Hold `<out>/.lock` for the run, so a second run started into the same folder (by mistake, or a
    launcher started twice) is refused before it touches a file. Process 0 takes the lock; every process
    agrees on the outcome. An OS lock (flock; NFS v4 shares it between hosts) dies with its process, so a
    killed run leaves no stale lock; the empty file stays."""
    import fcntl

    from jaxrlhf.distributed import any_process, is_main

    handle, busy = None, False
    if is_main() and not (os.path.exists(out) and not os.path.isdir(out)):  # a file: prepare_output_dir says so
        os.makedirs(out, exist_ok=True)
        handle = open(os.path.join(out, ".lock"), "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            handle, busy = None, True
    if any_process(busy):
        raise RunError(f"run.output_dir={out!r} is in use by another run that is still going (it holds "
                       f"{os.path.join(out, '.lock')}); nothing was changed. Wait for it to end, or choose "
                       "another run.output_dir")
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def _train(cfg: cfglib.Config) -> dict[str, Any]:
    import jax

    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.checkpoint import CheckpointManager
    from jaxrlhf.distributed import HostValues, any_process, barrier, is_main
    from jaxrlhf.metrics import MetricsWriter
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role, delete_tree
    from jaxrlhf.placement.devices import devices_per_host
    from jaxrlhf.placement.layout import AxisRules

    algorithm = build_algorithm(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    data = open_checked_data(cfg, algorithm, tokenizer)
    specs = algorithm.roles()
    model_configs = role_configs(cfg, list(specs))
    for role, mc in model_configs.items():
        if mc.vocab_size < tokenizer.vocab_size:
            raise cfglib.ConfigError(
                f"model.{role}: vocab_size {mc.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )
    graph = algorithm.graph()
    # With several processes the planner checks that device groups respect host boundaries.
    host_size = devices_per_host() if jax.process_count() > 1 else None
    plan = plan_for(cfg, algorithm, model_configs, jax.device_count(), devices_per_host=host_size,
                    platform=jax.devices()[0].platform)
    print(plan.table(), flush=True)
    cache = CallCache(plan, rules=AxisRules.from_config(cfg.plan.axis_rules))

    prepare_output_dir(cfg.run, write=is_main())
    barrier("output_dir")  # no process opens files in the folder before process 0 has cleared it
    ckpt = CheckpointManager(os.path.join(cfg.run.output_dir, "checkpoints"), max_to_keep=cfg.run.keep_checkpoints)
    resume_step = ckpt.latest_step() if cfg.run.resume else None
    if cfg.run.resume and resume_step is None and is_main():
        _set_aside_log(cfg.run.output_dir)

    # Models on their home placements: sources first, then the roles that copy them (after a warm-up).
    builder = RoleBuilder(cfg, specs, model_configs, cache, plan)
    built: dict[str, Built] = {}
    warm_metrics: dict[str, float] = {}
    views = algorithm.base_views()  # frozen roles that run on a LoRA role's base: no weights of their own
    for name in sorted(specs, key=lambda r: init_depth(cfg, r)):
        source = getattr(cfg.model, name).init_from
        if name in views:  # the LoRA actor's frozen base: structure only, its weights are the actor's
            built[name] = Built(builder.structure(name), None, builder.head(name))
        elif source is None:
            built[name] = builder.direct(name, at=name)
        else:
            if source not in built:  # a weight source the algorithm does not otherwise use
                built[source] = builder.direct(source, at=name)
            built[name] = builder.derived(name, built[source])
        if name == "actor" and cfg.sft.steps and resume_step is None:
            actor = Role("actor", built["actor"].graphdef, built["actor"].params)
            warm_metrics = warm_up_actor(cfg, actor, plan, cache, tokenizer)
            built["actor"].params = actor.params
    total_updates = cfg.run.steps * algorithm.updates_per_step
    roles: dict[str, Role] = {}
    for name, spec in specs.items():
        role = Role(name, built[name].graphdef, built[name].params, base_of=views.get(name))
        if spec.trained:
            role.optimizer = build_optimizer_for(cfg, name, total_updates, model_configs[name])
            role.opt_state = init_opt_state(role, cache.placed(plan.home_call(name)))
        roles[name] = role
    for name in [r for r in built if r not in specs]:
        delete_tree(built[name].params)

    algorithm.bind(tokenizer, roles)
    executor = Executor(plan, graph, roles, cache=cache, functions=algorithm.functions(),
                        host_steps=algorithm.host_steps(), state=algorithm.initial_state())
    executor.commit_state()
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

    steps = cfg.run.steps
    writer = MetricsWriter(cfg.run.output_dir, steps, resume_step=start, tensorboard=cfg.run.tensorboard,
                           enabled=is_main())
    base_rng = jax.random.key(cfg.run.seed)
    metrics: dict[str, Any] = {}
    offpolicy = plan.offpolicy
    batch = None
    stop = StopRequest()
    saved_step, dead = start, {}
    try:
        stop.install()
        for step in range(start + 1, steps + 1):
            batch = batch if (offpolicy and batch is not None) else data.next_batch()
            data_state = data.state_dict()
            nxt = data.next_batch() if offpolicy and step < steps else None
            feed = algorithm.feed(batch, jax.random.fold_in(base_rng, step))
            next_feed = algorithm.feed(nxt, jax.random.fold_in(base_rng, step + 1)) if nxt is not None else None
            with profiled(cfg.run, step):
                result = executor.step(feed, next_feed, read=algorithm.metric_values())
            result.values = HostValues(result.values)  # other values read on first use, alike on every process
            metrics = algorithm.metrics(result)
            metrics.update(result.metrics())
            metrics.update(data.metrics())
            if step == 1:
                metrics.update(warm_metrics)
            if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or step == steps):
                metrics.update(algorithm.evaluate(executor))
            batch = nxt
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
            if (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0) or step == steps or stopping:
                save(step, data_state)
                saved_step = step
            if stopping and step < steps:
                raise Interrupted(
                    f"stopped by {why} after step {step}; checkpoint saved in {ckpt.directory}. "
                    f"Resume with the same command and run.resume=true"
                )
    finally:
        stop.uninstall()
        writer.close()
        ckpt.close()

    if cfg.run.export_hf:  # every process gathers each tensor; process 0 writes
        for name in algorithm.export_roles():
            export_role(cfg, roles[name], model_configs[name], os.path.join(cfg.run.output_dir, f"{name}_hf"))
    return metrics


def export_role(cfg: cfglib.Config, role, model_config, out: str) -> None:
    """Write a role as an HF checkpoint (with the tokenizer, when it is a file); a LoRA actor also as its
    adapters alone in PEFT's layout (`<name>_lora/`, beside the merged `<name>_hf/`)."""
    import shutil

    from flax import nnx

    from jaxrlhf.models.hf_io import save_hf_checkpoint
    from jaxrlhf.models.lora import save_peft_adapter
    from jaxrlhf.models.transformer import CausalLM

    from jaxrlhf.distributed import is_main

    model = nnx.merge(role.graphdef, role.params)
    save_hf_checkpoint(model, model_config, out)
    if model_config.lora and isinstance(model, CausalLM):  # the adapters alone, in PEFT's layout
        save_peft_adapter(role.params, model_config.lora, out.removesuffix("_hf") + "_lora")
    if not is_main():
        return
    tok_path = cfg.model.tokenizer
    if tok_path != "byte" and os.path.exists(tok_path):
        src = tok_path if os.path.isfile(tok_path) else os.path.join(tok_path, "tokenizer.json")
        shutil.copy(src, os.path.join(out, "tokenizer.json"))
    print(f"{role.name} exported to {out}", flush=True)


@contextlib.contextmanager
def profiled(run_cfg: cfglib.RunConfig, step: int) -> Iterator[None]:
    """A JAX profiler trace of `step` when `run.profile_steps` names it: `<output_dir>/profile/step_<N>/`
    holds the XPlane trace (TensorBoard's profile plugin, xprof) and a Perfetto trace (ui.perfetto.dev)."""
    if step not in run_cfg.profile_steps:
        yield
        return
    import jax

    from jaxrlhf.distributed import is_main

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


def _set_aside_log(out: str) -> None:
    """run.resume=true with no checkpoint starts at step 0; the old log is kept beside the new one."""
    log = os.path.join(out, "metrics.jsonl")
    print(f"run.resume=true, but {out} has no checkpoint: starting from step 0", flush=True)
    if os.path.exists(log):
        kept = os.path.join(out, f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        os.replace(log, kept)
        print(f"the previous metrics.jsonl (no checkpoint) is kept as {kept}", flush=True)


def prepare_output_dir(run_cfg: cfglib.RunConfig, write: bool = True) -> None:
    """Refuse to start a new run over another run's files (nothing is changed), unless asked to resume
    it or to overwrite it. Every process checks (so all stop alike); only the one that `write`s removes."""
    import shutil

    out = run_cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunError(f"run.output_dir={out!r} is a file, not a folder; choose another run.output_dir")
    if run_cfg.resume or not os.path.isdir(out):
        return

    def holds(name: str) -> bool:  # empty leftovers of a run that failed at start-up do not count
        path = os.path.join(out, name)
        return bool(os.listdir(path)) if os.path.isdir(path) else os.path.exists(path) and os.path.getsize(path) > 0

    found = [n for n in ("checkpoints", "metrics.jsonl", "tensorboard") if holds(n)]
    if not found:
        return
    if not run_cfg.overwrite:
        raise RunError(
            f"run.output_dir={out!r} holds another run ({', '.join(found)}); nothing was changed. Continue it "
            "with run.resume=true, choose another run.output_dir, or replace it with run.overwrite=true"
        )
    if not write:
        return
    for name in found + [n for n in os.listdir(out) if n.endswith(("_hf", "_lora")) or n == "profile"]:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    print(f"run.overwrite=true: removed the previous run's {', '.join(found)} from {out}", flush=True)


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
