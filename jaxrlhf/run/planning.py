"""Plan choice for a training config: the one path `train` and `plan` both take.

`python -m jaxrlhf.train` and `python -m jaxrlhf.plan` must agree about the same
config, so everything that decides a plan lives here with one set of defaults:
the role model configs, the hardware profile, the machine (devices and devices
per host, over every process), and the plan itself (a plan file, a strategy
preset, or the planner's search with its budget of evaluated plans, the run's seed
and the run's staleness budget). Only model dimensions are read: no weights, no JAX.
A run that re-plans (`plan.replan_every`) searches again through `replan`,
with the same defaults, on the profile its own call times corrected.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

from jaxrlhf import config as cfglib

# The platform JAX runs on -> the planner's hardware profile for it, where the chip is not one of
# CHIP_HARDWARE's.
PLATFORM_HARDWARE = {"cpu": "cpu", "gpu": "h100", "cuda": "h100", "tpu": "tpu-v5e"}
# A chip by the name JAX gives it (`Device.device_kind`: "NVIDIA H200", "TPU v5 lite") -> its profile;
# the first entry whose text the name contains wins.
CHIP_HARDWARE = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80g"), ("TPU v4", "tpu-v4"),
                 ("TPU v5 lite", "tpu-v5e"), ("TPU v5e", "tpu-v5e"), ("TPU v5", "tpu-v5p"))
# Hardware when neither plan.hardware nor a platform says (the `plan` CLI plans clusters it does not run on).
DEFAULT_HARDWARE = "h100"
DEFAULT_DEVICES = 8  # devices when neither the config nor the caller says
# The planner search's wall-clock safety net for plan.strategy=auto: its work is counted in plans evaluated
# (`planner.search.DEFAULT_EVALUATIONS`), the same on any machine; the clock only stops a search gone wrong.
SEARCH_TIME_BUDGET_S = 600.0


def role_configs(cfg: cfglib.Config, roles: Sequence[str], platform: str | None = None):
    """ModelConfig of every role (and of the roles they initialise from); no weights touched. The layer
    loop (`ModelConfig.unroll_layers`) is decided for `platform`, else for `run.platform`."""
    from jaxrlhf.models.config import LoraConfig, preset

    out = {}
    for role in roles:
        chain = cfg.model.init_chain(role)  # role, its source, ..., the role with its own weights
        base = None
        for link in reversed(chain):  # from the weights down to `role`, each link's changes on top
            if link in out:
                base = out[link]
                continue
            rc = getattr(cfg.model, link)
            if base is None:
                if rc.path:
                    from jaxrlhf.models.hf_io import config_from_hf, read_hf_config

                    base = config_from_hf(read_hf_config(rc.path), source=os.path.join(rc.path, "config.json"))
                elif rc.preset:
                    base = preset(rc.preset)
                else:
                    raise cfglib.ConfigError(f"model.{link}: set one of preset, path or init_from")
            changes = dict(rc.overrides)
            if rc.dtype:
                changes["dtype"] = rc.dtype
            if rc.param_dtype:
                changes["param_dtype"] = rc.param_dtype
            if rc.unroll_layers is not None:
                changes["unroll_layers"] = rc.unroll_layers
            if rc.lora or base.lora:  # a role's adapters are its own: a reference copied from a LoRA actor has none
                changes["lora"] = LoraConfig(**dataclasses.asdict(rc.lora)) if rc.lora else None
            out[link] = base = base.replace(**changes) if changes else base
    platform = platform or (cfg.run.platform if cfg.run.platform != "auto" else None)
    return {role: mc.on_platform(platform) for role, mc in out.items()} if platform else out


@dataclasses.dataclass(frozen=True)
class Chip:
    """The chip a run's JAX runs on, as plan choice needs it: its platform ("cpu", "gpu", "tpu"), the
    name JAX gives it, and the bytes its allocator may hand out (None where JAX does not say)."""

    platform: str
    kind: str = ""
    memory: int | None = None

    @classmethod
    def of(cls, device) -> "Chip":
        """The chip of a JAX device (the first of the run's: they are alike)."""
        stats = device.memory_stats() or {}  # None on XLA:CPU
        return cls(device.platform, device.device_kind, stats.get("bytes_limit"))


def hardware_name(cfg: cfglib.Config, chip: Chip | None = None) -> str:
    """`plan.hardware`, else the profile of the chip the run is on (`CHIP_HARDWARE`), else of
    `run.platform` (or of the chip's platform when run.platform=auto), else DEFAULT_HARDWARE."""
    if cfg.plan.hardware:
        return cfg.plan.hardware
    named = cfg.run.platform if cfg.run.platform != "auto" else chip and chip.platform
    if chip and chip.platform == named:
        for text, profile in CHIP_HARDWARE:
            if text in chip.kind:
                return profile
    return PLATFORM_HARDWARE.get(named or "", DEFAULT_HARDWARE)


def hardware_profile(cfg: cfglib.Config, devices_per_host: int | None = None, chip: Chip | None = None):
    """The planner's profile of the machine: the measured `plan.profile` when set (its call tables
    then price the calls they cover), else `hardware_name`; with `devices_per_host` when given. On a
    chip whose allocator states its memory, that is the memory the plan may fill (on a GPU, JAX
    preallocates a fraction of the card: `XLA_PYTHON_CLIENT_MEM_FRACTION`)."""
    from jaxrlhf.planner.hardware import get_profile

    name = os.path.expanduser(cfg.plan.profile) if cfg.plan.profile else hardware_name(cfg, chip)
    try:
        hw = get_profile(name)
    except (KeyError, OSError, ValueError) as e:
        key = "plan.profile" if cfg.plan.profile else "plan.hardware"
        raise cfglib.ConfigError(f"{key}={name!r}: {e.args[0] if e.args else e}") from None
    if chip and chip.memory and chip.platform != "cpu":
        hw = dataclasses.replace(hw, hbm_capacity=float(chip.memory))
    return dataclasses.replace(hw, devices_per_host=devices_per_host) if devices_per_host else hw


def machine(cfg: cfglib.Config) -> tuple[int, int | None]:
    """(devices, devices per host) the config describes without asking JAX: `run.devices` per process
    (DEFAULT_DEVICES when unset) times `distributed.num_processes` for a multi-process run, each process
    a host. `train` asks JAX instead, which counts the same devices."""
    per_process = cfg.run.devices or DEFAULT_DEVICES
    processes = cfg.distributed.num_processes if cfg.run.distributed else None
    if processes and processes > 1:
        return per_process * processes, per_process
    return per_process, None


def plan_for(cfg: cfglib.Config, algorithm, model_configs: Mapping[str, Any], num_devices: int,
             devices_per_host: int | None = None, chip: Chip | None = None, *, graph=None, hardware=None):
    """The execution plan of a run: a plan file, a preset, or the planner's search (`auto`), for the
    calls of `graph` (default the algorithm's), priced on `hardware` (default `hardware_profile`).

    Presets get the workload and the hardware, as the search's seeds do, so a preset is the same plan
    here as in `python -m jaxrlhf.plan`. The plan is validated once, before the memory model reads it.
    Needs only model dimensions, so realistic configs can be planned without weights or devices.
    """
    from jaxrlhf.planner.plan import ExecutionPlan, PlanError, seconds_text
    from jaxrlhf.planner.plan import validate as validate_plan
    from jaxrlhf.planner.presets import build_plan

    graph = graph or algorithm.graph()
    models = {r: model_configs[r] for r in graph.roles}
    batch, workload = algorithm.batch_rows, algorithm.workload()
    hw = hardware or hardware_profile(cfg, devices_per_host, chip)
    if cfg.plan.file:
        plan = ExecutionPlan.load(cfg.plan.file)
    elif cfg.plan.strategy == "auto":
        result = search_plan(cfg, algorithm, models, num_devices, hw, cache_dir=plan_cache_dir(cfg))
        how = (f"the search kept in {result.kept_in} ({result.evaluations} plans, {result.seconds:.1f} s when it ran)"
               if result.kept_in else f"searched {result.evaluations} plans in {result.seconds:.1f} s")
        print(f"plan.strategy=auto: {how} (estimated step {seconds_text(result.best.step_s)} s on {num_devices} x {hw.name})"
              + (" (the wall-clock safety net stopped it)" if result.budget_hit else ""), flush=True)
        plan = result.best.plan
    else:
        plan = build_plan(cfg.plan.strategy, num_devices, models, graph, batch_size=batch,
                          minibatch_size=workload.minibatch_size, devices_per_host=devices_per_host,
                          offpolicy=cfg.staleness_budget > 0 and cfg.plan.strategy == "disaggregated",
                          workload=workload, hardware=hw, check=False)
    try:  # once, before the memory model reads its groups (offloading changes no placement)
        validate_plan(plan, graph, models, devices=num_devices, batch_size=batch, devices_per_host=devices_per_host,
                      seq_len=workload.seq_len)
    except PlanError as e:
        raise PlanError(f"plan.file={cfg.plan.file}: {e}" if cfg.plan.file else str(e)) from None
    plan = with_knobs(cfg, algorithm, plan, models, hw, graph)
    plan = with_offload(cfg, algorithm, plan, models, hw, graph)
    for warning in uneven_minibatches(plan, graph, workload):
        print(f"warning: {warning}", flush=True)
    return plan


def uneven_minibatches(plan, graph, workload) -> list[str]:
    """Train calls whose layout splits one minibatch (the rows an update feeds) unevenly: it runs, but
    devices compute padding and XLA moves shards between devices (a plan file may ask for it; the
    presets and the search never do)."""
    from jaxrlhf.planner.plan import layout_misfit

    out = []
    for call in graph.calls:
        if call.kind != "train":
            continue
        layout = plan.calls[call.name].layout
        reason = layout_misfit(layout, batch_size=workload.minibatch_size)
        if reason:
            out.append(f"{call.name}: its minibatches of {workload.minibatch_size} rows split unevenly, so devices "
                       f"compute padding: {reason}")
    return out


def with_offload(cfg: cfglib.Config, algorithm, plan, models: Mapping[str, Any], hw, graph=None):
    """The plan with what the runtime keeps in host memory between calls: frozen roles (`plan.offload`)
    and trained roles' optimizer state (`plan.offload_optimizer`). Each is the config key when set, else
    the plan file's own list, else what the memory model needs for the plan to fit under its knobs
    (`with_knobs`)."""
    from jaxrlhf.planner.simulator import plan_fit

    if cfg.plan.offload is not None:
        plan = dataclasses.replace(plan, offload_roles=tuple(cfg.plan.offload))
    if cfg.plan.offload_optimizer is not None:
        plan = dataclasses.replace(plan, offload_optimizer=tuple(cfg.plan.offload_optimizer))
    chosen = (cfg.plan.offload is not None or bool(plan.offload_roles),
              cfg.plan.offload_optimizer is not None or bool(plan.offload_optimizer))
    if all(chosen) or plan.strategy == "searched":
        return plan
    report = plan_fit(plan, graph or algorithm.graph(), models, knob_workload(algorithm, plan), hw)[1]
    if not report.feasible:
        print(f"warning: the memory model expects this plan not to fit: {report.reason}", flush=True)
    return dataclasses.replace(
        plan,
        offload_roles=plan.offload_roles if chosen[0] else report.offloaded,
        offload_optimizer=plan.offload_optimizer if chosen[1] else report.offloaded_optimizers,
    )


def knob_workload(algorithm, plan):
    """The algorithm's workload with the memory knobs `plan` carries fixed (`ExecutionPlan.micro_batch_size`,
    `.remat`, `.token_budget`), a key the config sets winning: what the run executes. A plan without
    knobs leaves the config's unset keys to the planner (`workload.AUTO`)."""
    wl = algorithm.workload()
    if not plan.micro_batch_size and not plan.remat and plan.token_budget is None:
        return wl
    cfg = algorithm.cfg
    micro = wl.micro_batch if cfg.algorithm.micro_batch_size is not None else dict(plan.micro_batch_size)
    remat = {r: p if getattr(cfg.model, r).remat else plan.remat.get(r, "none")
             for r, p in dict(wl.remat).items()}
    budget = wl.token_budget if wl.token_budget is not None else plan.token_budget
    return dataclasses.replace(wl, micro_batch=micro, remat=remat, token_budget=budget)


def with_knobs(cfg: cfglib.Config, algorithm, plan, models: Mapping[str, Any], hw, graph=None):
    """The plan with the memory knobs the run executes (`ExecutionPlan.execution`): those it carries (a
    searched plan's, a plan file's), a key the config sets winning, and for a plan without any (a
    preset's, a plan file without them) the planner's choice for the keys the config leaves unset: the
    fewest micro-batches and least remat that fit (`planner.knobs`), so a preset runs at its best."""
    from jaxrlhf.planner import knobs
    from jaxrlhf.planner.simulator import plan_fit

    graph = graph or algorithm.graph()
    wl = knob_workload(algorithm, plan)
    chosen, _ = plan_fit(plan, graph, models, wl, hw)
    return knobs.with_knobs(plan, graph, wl, chosen)


def search_plan(cfg: cfglib.Config, algorithm, models: Mapping[str, Any], num_devices: int, hw, *,
                time_budget_s: float = SEARCH_TIME_BUDGET_S, iterations: int | None = None,
                evaluations: int | None = None, cache_dir: str | None = None, workload=None):
    """`plan.strategy=auto`: the planner's search (a SearchResult) for these devices, models and
    workload, seeded by `run.seed`, off-policy plans (the generator ahead of the trainer) only with a
    staleness budget (`Config.staleness_budget`); answered from `cache_dir` when the same search was
    kept there. Packed calls without `algorithm.max_tokens_per_micro_batch`: the search once per
    candidate budget, the evaluations shared (`planner.budget.choose_token_budget`). `workload`: the
    algorithm's own unless given (a re-plan's, with the running plan's knobs fixed)."""
    from jaxrlhf.planner.budget import budget_candidates, choose_token_budget
    from jaxrlhf.planner.search import DEFAULT_EVALUATIONS, DEFAULT_ITERATIONS, NoPlanFits, search

    wl, graph = workload or algorithm.workload(), algorithm.graph()
    iterations, evaluations = iterations or DEFAULT_ITERATIONS, evaluations or DEFAULT_EVALUATIONS

    def run(workload, share=1):
        return search(models, workload, hw, num_devices, graph, seed=cfg.run.seed, iterations=iterations // share,
                      evaluations=evaluations // share, time_budget_s=time_budget_s / share,
                      allow_offpolicy=cfg.staleness_budget > 0, cache_dir=cache_dir)

    def searched(workload):
        if not workload.packed or workload.token_budget is not None:
            return run(workload)
        group = max(c.seqs_per_row for c in graph.calls)  # a packed pair's two sequences share a micro-batch
        share = len(budget_candidates(workload, group))
        return choose_token_budget(lambda w: run(w, share), workload, group)

    try:
        return searched(wl)
    except NoPlanFits as e:
        hint = continuous_engine_hint(cfg, wl, graph, e, searched)
        if hint is None:
            raise
        raise NoPlanFits(f"{e}; {hint}", e.largest_call) from None


def continuous_engine_hint(cfg: cfglib.Config, wl: Any, graph: Any, error: Any,
                           searched: Callable[[Any], Any]) -> str | None:
    """Where no plan fits because the static engine's generate call holds every row's KV cache at once (the
    largest call of the plan closest to fitting), the same search with `generation.engine=continuous`, whose
    pool of rows decoding at once is the planner's to size (`planner.knobs`): the setting to name and the plan
    it gives, or None (not that case, or nothing fits that way either). The engine stays the config's: the run
    executes the engine its config names, so the planner names the key rather than pricing what would not run."""
    from jaxrlhf.planner.plan import PlanError, seconds_text
    from jaxrlhf.planner.workload import AUTO

    if wl.gen_engine != "static" or wl.multi_turn or error.largest_call not in graph.names \
            or graph[error.largest_call].kind != "generate":
        return None
    gen = cfg.generation
    try:
        res = searched(dataclasses.replace(wl, gen_engine="continuous",
                                           gen_slots=AUTO if gen.slots is None else gen.slots,
                                           gen_pages=AUTO if gen.kv_pages is None else gen.kv_pages))
    except PlanError:
        return None
    plan = res.best.plan
    return (f"generation is what overflows: the static engine holds every row's KV cache at once, and with "
            f"generation.engine=continuous (a pool of {plan.gen_slots} rows decoding at once, the planner's choice) "
            f"a plan fits at {seconds_text(res.best.step_s)} s/step: set generation.engine=continuous")


def plan_cache_dir(cfg: cfglib.Config) -> str | None:
    """Where a run keeps its finished plan searches: beside its compiled programs (`run.compile_cache`,
    in `plans/`), so a second run of the same config (a resume, a re-run) starts without searching
    again; None when that cache is off."""
    if cfg.run.compile_cache is None:
        return None
    return os.path.join(os.path.expanduser(cfg.run.compile_cache), "plans")


def replan(cfg: cfglib.Config, algorithm, models: Mapping[str, Any], current, hw, num_devices: int,
           devices_per_host: int | None = None):
    """The re-planner's question, asked the way `plan_for` asks at the start: search again on `hw` (the
    run's profile with its own call times, `planner.replan.with_runs`) and compare the best plan with
    the running `current` one (`planner.replan.decide`, `plan.replan_threshold`). The running plan's memory
    knobs stay (`knobs.fixed_by`): the run's functions and models were built with them. Returns the Decision
    and the search's result; a plan to switch to is validated like any other plan."""
    from jaxrlhf.planner import knobs
    from jaxrlhf.planner.plan import validate as validate_plan
    from jaxrlhf.planner.replan import decide

    graph, wl = algorithm.graph(), knobs.fixed_by(current, algorithm.workload())
    result = search_plan(cfg, algorithm, models, num_devices, hw, workload=wl)
    decision = decide(current, result.best, graph, models, wl, hw, cfg.plan.replan_threshold)
    if decision.switch:
        validate_plan(decision.plan, graph, models, devices=num_devices, batch_size=algorithm.batch_rows,
                      devices_per_host=devices_per_host)
    return decision, result
