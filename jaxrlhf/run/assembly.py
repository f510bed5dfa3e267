"""`setup`: the one door every entry point takes to a run.

A run is put together in the same order wherever it starts (`train`, `eval`,
the SFT warm-up, re-planning, `profile`, `plan`, the scripts): the algorithm
(declared, or with its runtime), the machine it plans for, every role's model
config for that machine's platform and the hardware profile. From that
`RunSetup` come the plan (`choose_plan`: a plan file, a preset sized by the
workload and the hardware, or the search, through `planning.plan_for`) and, for
a run on this JAX, the placed calls (`cache`) and the models on their home
placements bound to an executor (`build`). Entry points differ only in what
they ask of a setup, so a new run mode is one more question here, not one
more assembly by hand.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

from jaxrlhf.run import planning
from jaxrlhf.run.planning import SEARCH_TIME_BUDGET_S, Chip

if TYPE_CHECKING:
    from jaxrlhf.algorithms.base import Algorithm
    from jaxrlhf.config_schema import Config
    from jaxrlhf.graph import CallGraph
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role
    from jaxrlhf.planner.hardware import HardwareProfile
    from jaxrlhf.planner.plan import ExecutionPlan


@dataclasses.dataclass(frozen=True)
class Machine:
    """The devices a run plans for: how many (over every process), how many one host holds where
    hosts matter (several processes, or TPU hosts), and the chip (None when planning a machine the
    run is not on)."""

    devices: int
    per_host: int | None = None
    chip: Chip | None = None
    runs_here: bool = False  # the machine this JAX runs on: a plan chosen on it must agree over processes

    @classmethod
    def local(cls) -> "Machine":
        """This JAX's devices. With several processes the planner keeps device groups within hosts;
        on TPU the chips one process sees are its host's, which also caps tensor parallelism."""
        import jax

        from jaxrlhf.placement.devices import devices_per_host

        hosts_matter = jax.process_count() > 1 or jax.devices()[0].platform == "tpu"
        return cls(jax.device_count(), devices_per_host() if hosts_matter else None,
                   Chip.of(jax.local_devices()[0]), runs_here=True)  # its profile and memory, where JAX names the chip

    @classmethod
    def described(cls, cfg: "Config", devices: int | None = None) -> "Machine":
        """The machine the config describes, asking no JAX (`planning.machine`); `devices` overrides
        the device count."""
        count, per_host = planning.machine(cfg)
        return cls(devices or count, per_host)

    @property
    def platform(self) -> str | None:
        return self.chip.platform if self.chip else None


@dataclasses.dataclass
class Assembled:
    """A run's runtime: its plan, placed calls, roles on their home placements and the executor."""

    plan: "ExecutionPlan"
    cache: "CallCache"
    roles: dict[str, "Role"]
    executor: "Executor"


@dataclasses.dataclass
class RunSetup:
    """What every entry point knows about a run before it has devices' worth of state: the config,
    the algorithm, the machine, each role's model config (and its `init_from` sources'), the
    hardware profile, and the graph of the calls this run runs (the algorithm's, or a part)."""

    cfg: "Config"
    algorithm: "Algorithm"
    machine: Machine
    models: dict[str, Any]
    hardware: "HardwareProfile"
    graph: "CallGraph"

    @property
    def planned_models(self) -> dict[str, Any]:
        """Model configs of the roles the graph calls: what the planner prices."""
        return {r: self.models[r] for r in self.graph.roles}

    def choose_plan(self, strategy: str | None = None) -> "ExecutionPlan":
        """The plan (`planning.plan_for`): `strategy` overrides `plan.strategy` (evaluation's colocated
        generate). On the machine JAX runs on, process 0 searches and every process runs its pick: a
        search cut short by its time budget on one host and not another would give the processes
        different programs."""
        cfg = self.cfg
        if strategy and strategy != cfg.plan.strategy:
            cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, strategy=strategy, file=None))

        def choose() -> "ExecutionPlan":
            return planning.plan_for(cfg, self.algorithm, self.models, self.machine.devices,
                                     devices_per_host=self.machine.per_host, chip=self.machine.chip,
                                     graph=self.graph, hardware=self.hardware)

        if cfg.plan.strategy == "auto" and not cfg.plan.file and self.machine.runs_here:
            from jaxrlhf.planner.plan import ExecutionPlan
            from jaxrlhf.transfer.processes import main_text

            return ExecutionPlan.from_yaml(main_text("plan", lambda: choose().to_yaml()), where="process 0's plan")
        return choose()

    def staleness(self, plan: "ExecutionPlan") -> int:
        """How many steps the generator runs ahead of the trainer on `plan`: on an off-policy plan the
        plan's own `staleness` (the eta the search chose) when it has one, else the run's budget
        (`Config.generator_lead`: `Config.staleness_budget`, at least 1, as the planner's workload has
        it); 0 on any other plan, where every rollout is on-policy. A plan asking for more than the
        budget is refused: the budget is what the algorithm was told its rollouts may lag. With partial
        rollouts (`generation.partial_rollout`) the stream runs ahead by the budget on any plan: on one
        that is not off-policy it refills its decode pool with the next steps' prompts and decodes while
        the trainer waits for its batch (`rollouts.stream`)."""
        if not plan.offpolicy:
            return self.cfg.staleness_budget if self.cfg.generation.partial_rollout else 0
        budget = self.cfg.generator_lead
        if plan.staleness is not None and plan.staleness > budget:
            from jaxrlhf.planner.plan import PlanError

            raise PlanError(
                f"the plan's staleness={plan.staleness} runs the generator further ahead than "
                f"algorithm.max_staleness={self.cfg.staleness_budget} allows; set algorithm.max_staleness="
                f"{plan.staleness} or lower the plan's staleness")
        return plan.staleness or budget

    def search(self, *, time_budget_s: float = SEARCH_TIME_BUDGET_S, iterations: int | None = None,
               evaluations: int | None = None):
        """The planner's search over this machine (`planning.search_plan`): a SearchResult."""
        return planning.search_plan(self.cfg, self.algorithm, self.planned_models, self.machine.devices,
                                    self.hardware, time_budget_s=time_budget_s, iterations=iterations,
                                    evaluations=evaluations)

    def replan(self, current: "ExecutionPlan", hardware: "HardwareProfile"):
        """Search again on `hardware` (the run's profile corrected by its own call times) and decide
        against `current` (`planning.replan`): (Decision, SearchResult)."""
        return planning.replan(self.cfg, self.algorithm, self.planned_models, current, hardware,
                               self.machine.devices, self.machine.per_host)

    def cache(self, plan: "ExecutionPlan", like: "CallCache | None" = None) -> "CallCache":
        """Placed calls of `plan`, on the devices and axis rules of `like` when given (a warm-up or a
        re-plan of a running run), else on this JAX's devices with `plan.axis_rules`."""
        from jaxrlhf.placement.calls import CallCache
        from jaxrlhf.placement.layout import AxisRules

        if like is not None:
            return CallCache(plan, devices=like.devices, rules=like.rules)
        return CallCache(plan, rules=AxisRules.from_config(self.cfg.plan.axis_rules))

    def build(self, plan: "ExecutionPlan", tokenizer: Any, *, cache: "CallCache | None" = None,
              roles: Mapping[str, "Role"] | None = None, warm_up: Callable[["Role"], None] | None = None,
              total_updates: int | None = None) -> Assembled:
        """The graph's roles on their home placements of `plan` (built from the config, or the given
        `roles`, e.g. the actor a warm-up trains), bound to the algorithm and an executor. Roles the
        graph trains get their optimizer (`total_updates` long: default `run.steps` x the
        algorithm's updates per step); `warm_up(actor)` runs once the actor is built, before any
        role copies it."""
        from jaxrlhf.placement.executor import Executor
        from jaxrlhf.run.roles import build_roles

        cache = cache or self.cache(plan)
        whole = self.graph.names == self.algorithm.graph().names
        if roles is None:
            trained = {c.role for c in self.graph.calls if c.kind == "train"}
            specs = {r: dataclasses.replace(s, trained=s.trained and r in trained)
                     for r, s in self.algorithm.roles().items() if r in self.graph.roles or whole}
            views = {r: src for r, src in self.algorithm.base_views().items() if r in specs}
            updates = total_updates if total_updates is not None else \
                self.cfg.run.steps * self.algorithm.updates_per_step
            roles = build_roles(self.cfg, specs, self.models, cache, plan, total_updates=updates,
                                warm_up=warm_up, base_views=views)
        roles = dict(roles)
        self.algorithm.bind(tokenizer, roles, self.models, plan.execution)
        functions = {n: f for n, f in self.algorithm.functions().items() if n in self.graph.names}
        executor = Executor(plan, self.graph, roles, cache=cache, functions=functions,
                            host_steps=self.algorithm.host_steps() if whole else None,
                            state=self.algorithm.initial_state() if whole else None)
        executor.commit_state()
        return Assembled(plan, cache, roles, executor)


def setup(cfg: "Config", *, algorithm: "Algorithm | None" = None, machine: Machine | None = None,
          calls: tuple[str, ...] | None = None, runtime: bool = True) -> RunSetup:
    """A run's setup. `machine`: default this JAX's devices (`Machine.local`); a `Machine.described`
    plans a cluster without JAX. `algorithm`: default `algorithm.name` of `cfg`, with its runtime
    (`runtime=True`) or declared only (no JAX). `calls`: run only these calls of the algorithm's
    graph (evaluation's `actor.generate`)."""
    from jaxrlhf import algorithms

    if algorithm is None:
        algorithm = (algorithms.build_algorithm if runtime else algorithms.declare)(cfg)
    machine = machine or Machine.local()
    graph = algorithm.graph()
    if calls:
        graph = graph.only(*calls)
    roles = list(algorithm.roles()) if not calls else list(graph.roles)
    models = planning.role_configs(cfg, roles, machine.platform)
    hardware = planning.hardware_profile(cfg, machine.per_host, machine.chip)
    return RunSetup(cfg, algorithm, machine, models, hardware, graph)
