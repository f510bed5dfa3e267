"""Makespan of several consecutive RLHF steps under a plan.

The step graph is unrolled over `steps` iterations into operations: every
call, a reallocation before each call that runs away from its role's home
(occupying the home group and the call's group), and a shadow sync after each
train call of a role with persistent copies (likewise on both groups). An
operation waits for its dependencies in the same step and for its role's
train call of the previous step (a call on a shadow copy waits for the sync
instead, one step further back when the plan is off-policy). Operations that
share a device run one after another; disjoint ones overlap. A greedy list
scheduler always starts the ready operation that can start earliest.

`estimate_plan` puts cost, memory and schedule together for one plan.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxrlhf.planner.cost import CallCost, CostCache, Workload, offload_cost
from jaxrlhf.graph import CallGraph
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.memory import MemoryReport, plan_memory
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, PlanError, layout_misfit
from jaxrlhf.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Op:
    """One scheduled unit: a call, a reallocation or a sync, on a set of device ranges."""

    name: str
    call: str
    kind: str  # "call" | "realloc" | "sync"
    step: int
    ranges: tuple[tuple[int, int], ...]  # [start, stop) device ranges it occupies
    duration: float
    deps: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Span:
    op: Op
    start: float
    end: float


@dataclasses.dataclass
class Timeline:
    spans: list[Span]
    steps: int

    @property
    def makespan(self) -> float:
        return float(max((s.end for s in self.spans), default=0.0))

    def step_end(self, step: int) -> float:
        return max((s.end for s in self.spans if s.op.step == step), default=0.0)

    @property
    def step_s(self) -> float:
        """Steady-state seconds per step: the spacing of step ends after the first step."""
        if self.steps < 2:
            return self.makespan
        return float(self.step_end(self.steps - 1) - self.step_end(0)) / (self.steps - 1)


def schedule(ops: list[Op], num_devices: int) -> Timeline:
    """List-schedule `ops`: each op starts when its deps are done and all its devices are free."""
    by_name = {o.name: o for o in ops}
    for o in ops:
        for d in o.deps:
            if d not in by_name:
                raise ValueError(f"op {o.name!r} depends on unknown op {d!r}")
    # Devices between consecutive range boundaries are always busy together: track them as one.
    cuts = sorted({0, num_devices, *(x for o in ops for r in o.ranges for x in r)})
    index = {x: i for i, x in enumerate(cuts)}
    segments = {o.name: [i for a, b in o.ranges for i in range(index[a], index[b])] for o in ops}
    free = [0.0] * (len(cuts) - 1)
    end: dict[str, float] = {}
    order = {o.name: i for i, o in enumerate(ops)}
    waiting = {o.name: len(set(o.deps)) for o in ops}  # deps not yet done
    dependents: dict[str, list[Op]] = {o.name: [] for o in ops}
    for o in ops:
        for d in set(o.deps):
            dependents[d].append(o)
    ready = [o for o in ops if not waiting[o.name]]
    spans: list[Span] = []
    while ready:
        best: tuple[float, int, Op] | None = None
        for o in ready:  # the earliest start, then the first in `ops`
            t = max([end[d] for d in o.deps] + [free[i] for i in segments[o.name]], default=0.0)
            if best is None or (t, order[o.name]) < best[:2]:
                best = (t, order[o.name], o)
        t, _, o = best
        finish = t + o.duration
        for i in segments[o.name]:
            free[i] = finish
        end[o.name] = finish
        spans.append(Span(o, t, finish))
        ready.remove(o)
        for nxt in dependents[o.name]:
            waiting[nxt.name] -= 1
            if not waiting[nxt.name]:
                ready.append(nxt)
    if len(spans) < len(ops):
        raise ValueError(f"dependency cycle among {[o.name for o in ops if o.name not in end]}")
    return Timeline(spans, 1 + max((o.step for o in ops), default=0))


def _ranges(*groups: DeviceGroup) -> tuple[tuple[int, int], ...]:
    return tuple(dict.fromkeys((g.start, g.stop) for g in groups))


def _placed_at_home(plan: ExecutionPlan, call: str) -> bool:
    home = plan.home_call(call.split(".")[0])
    a, b = plan.group_of(call), plan.group_of(home)
    return (a.start, a.size, plan.calls[call].layout) == (b.start, b.size, plan.calls[home].layout)


def build_ops(graph: CallGraph, plan: ExecutionPlan, call_s: Mapping[str, float],
              move_s: Mapping[str, float], steps: int) -> list[Op]:
    """Unroll `steps` steps of `graph` under `plan` into ops.

    `call_s[call]`: seconds of the call itself. `move_s[call]`: seconds to bring
    its role's parameters to the call's placement (a reallocation, or for a role
    in `plan.shadow_roles` the sync after its train call); missing or 0 means none.
    """
    ops: list[Op] = []
    order = graph.topological()
    for c in order:
        if c.name not in plan.calls:
            raise PlanError(f"plan has no placement for call {c.name!r}")
    # Per call, the same in every step: its group, its role's home group, train call, and whether it runs at home.
    groups = {c.name: plan.group_of(c.name) for c in order}
    homes = {r: plan.group_of(plan.home_call(r)) for r in graph.roles}
    trains = {r: graph.train_call(r) for r in graph.roles}
    at_homes = {c.name: _placed_at_home(plan, c.name) for c in order}
    for i in range(steps):
        for c in order:
            group = groups[c.name]
            home = homes[c.role]
            deps = [f"{d}@{i}" for d in c.deps]
            train = trains[c.role]
            at_home = at_homes[c.name]
            shadow = c.role in plan.shadow_roles and not at_home
            if train is not None and train.name != c.name and shadow:
                back = 2 if plan.offpolicy and c.kind == "generate" else 1
                if i - back >= 0:
                    deps.append(f"{c.name}:sync@{i - back}")
            elif train is not None and i > 0:
                deps.append(f"{train.name}@{i - 1}")
            move = move_s.get(c.name, 0.0)
            if not at_home and not shadow and move > 0:
                ops.append(Op(f"{c.name}:realloc@{i}", c.name, "realloc", i, _ranges(home, group), move,
                              tuple(dict.fromkeys(deps))))
                deps = [f"{c.name}:realloc@{i}"]
            ops.append(Op(f"{c.name}@{i}", c.name, "call", i, (( group.start, group.stop),), call_s[c.name],
                          tuple(dict.fromkeys(deps))))
        # Shadow syncs after each train call, one per shadowed call.
        for c in order:
            if c.role in plan.shadow_roles and not at_homes[c.name]:
                train = trains[c.role]
                if train is None:
                    continue
                group = groups[c.name]
                home = groups[train.name]
                ops.append(Op(f"{c.name}:sync@{i}", c.name, "sync", i, _ranges(home, group),
                              move_s.get(c.name, 0.0), (f"{train.name}@{i}",)))
    return ops


@dataclasses.dataclass
class PlanEstimate:
    """Everything the planner knows about one plan."""

    plan: ExecutionPlan
    feasible: bool
    reason: str | None
    step_s: float | None
    timeline: Timeline | None
    calls: dict[str, CallCost]
    moves: dict[str, float]  # seconds of the realloc / sync serving each call
    reloads: dict[str, float]  # seconds of host -> device reloads added to a call
    memory: MemoryReport | None


def call_durations(graph: CallGraph, plan: ExecutionPlan, models: Mapping[str, ModelConfig], wl: Workload,
                   hw: HardwareProfile, cache: CostCache | None = None) -> tuple[dict[str, CallCost], dict[str, float]]:
    """Cost of every call and of the move (realloc or shadow sync) each one needs."""
    cache = cache or CostCache(models, wl, hw)
    costs: dict[str, CallCost] = {}
    moves: dict[str, float] = {}
    for c in graph.calls:
        p = plan.calls[c.name]
        costs[c.name] = cache.call(c, plan.group_of(c.name), p.layout)
        home_call = plan.home_call(c.role)
        moves[c.name] = cache.move(c, plan.group_of(home_call), plan.calls[home_call].layout,
                                   plan.group_of(c.name), p.layout)
    return costs, moves


def check_plan(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig]) -> str | None:
    """Structural problems the cost model cannot price, as a message (None if fine)."""
    for c in graph.calls:
        if c.name not in plan.calls:
            return f"plan has no placement for call {c.name!r}"
        if c.role not in models:
            return f"no model config for role {c.role!r}; have {sorted(models)}"
        p = plan.calls[c.name]
        if p.group not in plan.groups:
            return f"call {c.name!r} uses unknown group {p.group!r}; groups are {sorted(plan.groups)}"
        g = plan.groups[p.group]
        if g.start < 0 or g.stop > plan.num_devices:
            return f"group {g.name!r} ({g.start}..{g.stop - 1}) lies outside the plan's {plan.num_devices} devices"
        if p.layout.num_devices != g.size:
            return f"call {c.name!r}: layout {p.layout} has {p.layout.num_devices} devices, group {g.name!r} has {g.size}"
        if p.layout.stage > 1:  # pipelines the cost model cannot price (the runtime would refuse them too)
            reason = layout_misfit(p.layout, models[c.role], kind=c.kind)
            if reason:
                return f"call {c.name!r}: {reason}"
    return None


def estimate_plan(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload,
                  hw: HardwareProfile, steps: int = 3, cache: CostCache | None = None) -> PlanEstimate:
    """Cost, memory and a `steps`-step schedule of `plan`; infeasible plans carry the reason."""
    problem = check_plan(plan, graph, models)
    if problem:
        return PlanEstimate(plan, False, problem, None, None, {}, {}, {}, None)
    cache = cache or CostCache(models, wl, hw)
    costs, moves = call_durations(graph, plan, models, wl, hw, cache)
    mem = plan_memory(plan, graph, models, wl, hw, cache.memory)
    reloads = {
        c.name: offload_cost(models[c.role], c.head, plan.calls[c.name].layout, hw)
        for c in graph.calls if c.role in mem.offloaded
    }
    if not mem.feasible:
        return PlanEstimate(plan, False, mem.reason, None, None, costs, moves, reloads, mem)
    call_s = {n: c.seconds + reloads.get(n, 0.0) for n, c in costs.items()}
    timeline = schedule(build_ops(graph, plan, call_s, moves, steps), plan.num_devices)
    return PlanEstimate(plan, True, None, timeline.step_s, timeline, costs, moves, reloads, mem)
