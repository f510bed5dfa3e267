"""Steady-state step time of RLHF steps under a plan.

The step graph is unrolled over several iterations into operations: every
call, a reallocation before each call that runs away from its role's home
(occupying the home group and the call's group), and a shadow sync after each
train call of a role with persistent copies (likewise on both groups). An
operation waits for its dependencies in the same step and for its role's
train call of the previous step (a call on a shadow copy waits for the sync
instead; an off-policy plan's generate call of step i waits for the sync of
step i - (eta + 1), eta the steps its generator may run ahead). A generate
call may last differently from step to step (drawn response lengths, step i
taking batch i % K: `cost.generate_durations`). Operations that
share a device run one after another; disjoint ones overlap, unless their
devices share a host's cores (simulated CPU devices). A greedy list scheduler
always starts the ready operation that can start earliest. The
schedule is made longer until its step-to-step gaps repeat (or stop moving),
and the step time is their mean over the repeating period (`steady_state`).

`estimate_plan` puts cost, memory and schedule together for one plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.planner import knobs as knobs_lib
from jaxrlhf.planner.cost import CallCost, CostCache, generate_durations, offload_cost, optimizer_offload_cost
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.knobs import CallKnobs
from jaxrlhf.planner.memory import MemoryReport, optimizer_per_device
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, PlanError, layout_misfit, offpolicy_problem
from jaxrlhf.planner.rewards import score_seconds
from jaxrlhf.planner.workload import LENGTH_BATCHES, Workload


@dataclasses.dataclass(frozen=True)
class Op:
    """One scheduled unit: a call, a reallocation or a sync, on a set of device ranges."""

    name: str
    call: str
    kind: str  # "call" | "realloc" | "sync" | "host" (a host step: on no device)
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
    max_period: int = 0  # longest period `period` looks for; 0 = MAX_PERIOD
    period_unit: int = 1  # periods are multiples of it (calls cycling through K durations: K)

    @property
    def makespan(self) -> float:
        return float(max((s.end for s in self.spans), default=0.0))

    def step_end(self, step: int) -> float:
        return max((s.end for s in self.spans if s.op.step == step), default=0.0)

    def step_gaps(self) -> list[float]:
        """Seconds between consecutive step ends, leaving out the last END_STEPS steps: nothing of a
        later step competes for their devices, so they end early (70B/128: 7.5 s after 8.96 s gaps)."""
        ends = [0.0] * self.steps
        for s in self.spans:
            ends[s.op.step] = max(ends[s.op.step], s.end)
        ends = ends[:max(self.steps - END_STEPS, 2)]
        return [b - a for a, b in zip(ends, ends[1:])]

    def period(self) -> int | None:
        """The smallest number of steps p (up to `max_period`) after which the step gaps repeat: the last
        p gaps equal the p before them and the p before those (p a multiple of `period_unit`: three equal
        gaps in a row may be a stretch of short generate calls, not the cycle). None while the schedule
        is still settling."""
        gaps = self.step_gaps()
        for p in range(self.period_unit, (self.max_period or MAX_PERIOD) + 1, self.period_unit):
            if len(gaps) >= 3 * p and all(
                    math.isclose(gaps[-1 - i], gaps[-1 - i - k * p], rel_tol=1e-9, abs_tol=1e-12)
                    for i in range(p) for k in (1, 2)):
                return p
        return None

    @property
    def step_s(self) -> float:
        """Steady-state seconds per step: the mean gap over the repeating period when there is one,
        else over the second half of the steps (the first steps fill an empty pipeline)."""
        gaps = self.step_gaps()
        if not gaps:
            return self.makespan
        p = self.period()
        tail = gaps[-p:] if p else gaps[len(gaps) // 2:]
        return float(sum(tail) / len(tail))


def whole_hosts(ranges: tuple[tuple[int, int], ...], host_size: int) -> tuple[tuple[int, int], ...]:
    """`ranges` widened to the whole hosts they touch."""
    return tuple(dict.fromkeys((a // host_size * host_size, -(-b // host_size) * host_size) for a, b in ranges))


def schedule(ops: list[Op], num_devices: int, shared_host: int | None = None) -> Timeline:
    """List-schedule `ops`: each op starts when its deps are done and all its devices are free.

    `shared_host`: the devices per host when a host's devices share its cores (simulated CPU
    devices). Each op then holds every device of the hosts it touches: two calls on disjoint groups
    of one host would share the same cores, so running them at once finishes no sooner than one
    after the other (measured on 2 cores: a plan pricing its actor and critic side by side at 3.7 s
    per step ran 7.4 s, the sum of its calls)."""
    if shared_host:
        ops = [dataclasses.replace(o, ranges=whole_hosts(o.ranges, shared_host)) for o in ops]
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


def _seconds_at(call_s: float | Sequence[float], step: int) -> float:
    """A call's seconds in `step`: one number for every step, or a cycle of them (step i: i % len)."""
    return call_s if isinstance(call_s, (int, float)) else call_s[step % len(call_s)]


def host_links(graph: CallGraph, host: str) -> tuple[set[str], set[str]]:
    """The calls host step `host` reads from and the calls that read its outputs (either through
    other host steps)."""
    nodes = {n.name: n for n in graph.nodes}
    producer = {v: n.name for n in graph.nodes for v in n.outputs}
    calls = {c.name for c in graph.calls}
    up, down, seen = set(), set(), {host}
    todo = [host]
    while todo:  # upstream
        for v in nodes[todo.pop()].inputs:
            src = producer.get(v)
            if src is not None and src not in seen:
                seen.add(src)
                (up.add if src in calls else todo.append)(src)
    todo, seen = [host], {host}
    while todo:  # downstream
        made = set(nodes[todo.pop()].outputs)
        for n in graph.nodes:
            if n.name not in seen and made & set(n.inputs):
                seen.add(n.name)
                (down.add if n.name in calls else todo.append)(n.name)
    return up, down


def build_ops(graph: CallGraph, plan: ExecutionPlan, call_s: Mapping[str, float | Sequence[float]],
              move_s: Mapping[str, float], steps: int, staleness: int = 1,
              host_s: Mapping[str, float | Sequence[float]] | None = None) -> list[Op]:
    """Unroll `steps` steps of `graph` under `plan` into ops.

    `call_s[call]`: seconds of the call itself (or a cycle of per-step seconds). `move_s[call]`: seconds
    to bring its role's parameters to the call's placement (a reallocation, or for a role in
    `plan.shadow_roles` the sync after its train call); missing or 0 means none. `staleness`: on an
    off-policy plan, how many steps the generator runs ahead (generate of step i waits for the sync of
    step i - (staleness + 1)). `host_s[step]`: seconds of a host step (or a cycle), an op on no device
    after the calls it reads from and before those that read it (`planner.rewards`: `score_rules`).
    """
    ops: list[Op] = []
    order = graph.topological()
    hosts = {h: host_links(graph, h) for h, sec in (host_s or {}).items() if sec}
    after_host = {c.name: [h for h, (_, down) in hosts.items() if c.name in down] for c in order}
    for c in order:
        if c.name not in plan.calls:
            raise PlanError(f"plan has no placement for call {c.name!r}")
    # Per call, the same in every step: its group, its role's home group, train call, and whether it runs at home.
    groups = {c.name: plan.group_of(c.name) for c in order}
    homes = {r: plan.group_of(plan.home_call(r)) for r in graph.roles}
    trains = {r: graph.train_call(r) for r in graph.roles}
    at_homes = {c.name: _placed_at_home(plan, c.name) for c in order}
    for i in range(steps):
        for h, (up, _) in hosts.items():
            ops.append(Op(f"{h}@{i}", h, "host", i, (), _seconds_at(host_s[h], i),
                          tuple(f"{c.name}@{i}" for c in order if c.name in up)))
        for c in order:
            group = groups[c.name]
            home = homes[c.role]
            deps = [f"{d}@{i}" for d in c.deps] + [f"{h}@{i}" for h in after_host[c.name]]
            train = trains[c.role]
            at_home = at_homes[c.name]
            # a call that needs fresh weights (an off-policy correction's recompute) never reads the shadow
            shadow = c.role in plan.shadow_roles and not at_home and not c.fresh_weights
            if train is not None and train.name != c.name and shadow:
                back = staleness + 1 if plan.offpolicy and c.kind == "generate" else 1
                if i - back >= 0:
                    deps.append(f"{c.name}:sync@{i - back}")
            elif train is not None and i > 0:
                deps.append(f"{train.name}@{i - 1}")
            move = move_s.get(c.name, 0.0)
            if not at_home and not shadow and move > 0:
                ops.append(Op(f"{c.name}:realloc@{i}", c.name, "realloc", i, _ranges(home, group), move,
                              tuple(dict.fromkeys(deps))))
                deps = [f"{c.name}:realloc@{i}"]
            ops.append(Op(f"{c.name}@{i}", c.name, "call", i, (( group.start, group.stop),),
                          _seconds_at(call_s[c.name], i), tuple(dict.fromkeys(deps))))
        # Shadow syncs after each train call, one per shadowed call.
        for c in order:
            if c.role in plan.shadow_roles and not at_homes[c.name] and not c.fresh_weights:
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
    knobs: dict[str, CallKnobs] = dataclasses.field(default_factory=dict)  # per call: the knobs it runs with
    move_sources: dict[str, str] = dataclasses.field(default_factory=dict)  # call -> what priced its move


def call_durations(graph: CallGraph, plan: ExecutionPlan, models: Mapping[str, ModelConfig], wl: Workload,
                   hw: HardwareProfile, cache: CostCache | None = None, knobs: Mapping[str, CallKnobs] | None = None
                   ) -> tuple[dict[str, CallCost], dict[str, float], dict[str, str]]:
    """Cost of every call (under its `knobs`, else the workload's own settings), of the move
    (realloc or shadow sync) each one needs, and what priced that move ("measured" or "formula")."""
    cache = cache or CostCache(models, wl, hw)
    knobs = knobs or {}
    costs: dict[str, CallCost] = {}
    moves: dict[str, float] = {}
    sources: dict[str, str] = {}
    views = dict(wl.base_views)
    for c in graph.calls:
        p = plan.calls[c.name]
        costs[c.name] = cache.call(c, plan.group_of(c.name), p.layout, knobs.get(c.name))
        home_call = plan.home_call(views.get(c.role, c.role))  # a LoRA role's base moves from that role's home
        # a LoRA shadow's base is copied once; each sync sends only the adapters
        sync_adapters = (c.role in plan.shadow_roles and models[c.role].lora is not None and c.role not in views
                         and not c.fresh_weights)
        moves[c.name], sources[c.name] = cache.move_cost(c, plan.group_of(home_call), plan.calls[home_call].layout,
                                                         plan.group_of(c.name), p.layout, sync_adapters)
    return costs, moves, sources


def check_plan(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig],
               wl: Workload | None = None) -> str | None:
    """Structural problems the cost model cannot price, as a message (None if fine): also, given the
    workload, micro-batches of a fixed size that a layout cannot split (`Workload.micro_misfit`)."""
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
        if wl is not None and (reason := wl.micro_misfit(c, p.layout.batch_ways)):
            return reason
    return offpolicy_problem(plan, graph)  # what the runtime refuses, the search must not pick


END_STEPS = 2  # last steps left out of the gaps (an off-policy shadow lags 2 steps at eta = 1)


def plan_fit(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload,
             hw: HardwareProfile, cache: CostCache | None = None) -> tuple[dict[str, CallKnobs], MemoryReport]:
    """The knobs (micro-batches, remat) each call runs with on this plan and the plan's memory under them
    (`planner.knobs.choose`: the workload's own where it sets them, the fastest that fit where it leaves
    them to the planner)."""
    return knobs_lib.choose(plan, graph, models, wl, hw, cache or CostCache(models, wl, hw))


MIN_STEPS = 3 + END_STEPS + 1  # steps simulated first: 3 gaps, enough to see a period of 1 repeat
MAX_STEPS = 64
MAX_PERIOD = 3  # off-policy shadows lag 2 steps at eta = 1, so a schedule may repeat every 2 or 3 steps
SETTLED = 1e-3  # relative change of the estimate between n and 2n steps that counts as settled


def max_period(staleness: int, varying: bool) -> int:
    """The longest period a schedule may have: a generator eta steps ahead lags eta + 1 steps, so up to
    eta + 2 (MAX_PERIOD at eta = 1); generate calls cycling through K length batches repeat every K
    (looked for up to 2K)."""
    return max(MAX_PERIOD, staleness + 2, 2 * LENGTH_BATCHES if varying else 0)


def steady_state(graph: CallGraph, plan: ExecutionPlan, call_s: Mapping[str, float | Sequence[float]],
                 move_s: Mapping[str, float], steps: int = MIN_STEPS, shared_host: int | None = None,
                 staleness: int = 1, host_s: Mapping[str, float | Sequence[float]] | None = None) -> Timeline:
    """A schedule long enough to show the steady state: from `steps` steps, doubled until the step gaps
    repeat (`Timeline.period`) or the estimate moves by less than SETTLED (or MAX_STEPS). The first
    steps are faster than the rest (nothing waits yet for a previous step's train call), so a short
    schedule's mean gap is too small: 4 x 70B on 128 GPUs read 8.2 s after 3 steps, 9.0 s settled.
    `shared_host` as in `schedule`; `staleness` as in `build_ops`. Calls whose seconds change from step
    to step stop only at a period (or MAX_STEPS): their mean gap can look settled by chance."""
    varying = any(not isinstance(v, (int, float)) for v in (*call_s.values(), *(host_s or {}).values()))
    longest = max_period(staleness if plan.offpolicy else 1, varying)
    # enough steps that a longer period can show three times (else 6 steps may end before a long batch)
    n, before = max(steps, 2, 3 * longest + END_STEPS + 1 if longest > MAX_PERIOD else 0), None
    while True:
        tl = schedule(build_ops(graph, plan, call_s, move_s, n, staleness, host_s), plan.num_devices, shared_host)
        tl.max_period, tl.period_unit = longest, LENGTH_BATCHES if varying else 1
        if tl.period() is not None or n >= MAX_STEPS:
            return tl
        if not varying and before is not None and abs(tl.step_s - before) <= SETTLED * before:
            return tl
        n, before = min(2 * n, MAX_STEPS), tl.step_s


def plan_staleness(plan: ExecutionPlan, wl: Workload) -> int:
    """eta the plan runs with: its own `staleness` when set, else the workload's (the run's budget)."""
    return plan.staleness or wl.staleness


def generate_seconds(cost: CallCost, plan: ExecutionPlan, wl: Workload, call: CallSpec) -> tuple[float, ...]:
    """A generate call's seconds on `plan` for each batch of drawn response lengths (`cost.generate_durations`,
    a stream paced by the plan's eta); the call's own seconds when the lengths do not vary (but for a stream
    whose pool spans several batches: a batch has a share of its steps)."""
    ways = plan.calls[call.name].layout.batch_ways
    if not wl.priced_per_batch(call, ways):
        return (cost.seconds,)
    return generate_durations(cost, wl, call, ways, wl.gen_stream, eta=plan_staleness(plan, wl))


def reward_host_s(graph: CallGraph, wl: Workload, call_s: Mapping[str, float | Sequence[float]]
                  ) -> dict[str, float | tuple[float, ...]]:
    """`score_rules`'s seconds in each step (`planner.rewards.score_seconds`, against the generate
    call's seconds and response lengths of that step), or nothing when the graph scores no rules or
    their time is not measured."""
    generate = next((c.name for c in graph.calls if c.kind == "generate"), None)
    if wl.reward_row_s <= 0 or generate is None or "score_rules" not in {h.name for h in graph.host_steps}:
        return {}
    gen = call_s[generate]
    if isinstance(gen, (int, float)):
        return {"score_rules": score_seconds(wl, gen)}
    lengths = wl.response_lengths(wl.batch_size)
    return {"score_rules": tuple(score_seconds(wl, g, lengths[k % len(lengths)]) for k, g in enumerate(gen))}


def estimate_plan(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload,
                  hw: HardwareProfile, steps: int = MIN_STEPS, cache: CostCache | None = None) -> PlanEstimate:
    """Cost, memory and a steady-state schedule (`steady_state`, from `steps` steps) of `plan`;
    infeasible plans carry the reason."""
    problem = check_plan(plan, graph, models, wl)
    if problem:
        return PlanEstimate(plan, False, problem, None, None, {}, {}, {}, None)
    cache = cache or CostCache(models, wl, hw)
    knobs, mem = plan_fit(plan, graph, models, wl, hw, cache)
    costs, moves, sources = call_durations(graph, plan, models, wl, hw, cache, knobs)
    reloads = {
        c.name: offload_cost(models[c.role], c.head, plan.calls[c.name].layout, hw)
        for c in graph.calls if c.role in mem.offloaded
    }
    for c in graph.calls:
        if c.kind == "train" and c.role in mem.offloaded_optimizers:
            state = optimizer_per_device(models[c.role], c.head, plan.calls[c.name].layout, wl, c.role)
            reloads[c.name] = reloads.get(c.name, 0.0) + optimizer_offload_cost(state, hw)
    if not mem.feasible:
        return PlanEstimate(plan, False, mem.reason, None, None, costs, moves, reloads, mem, knobs, sources)
    call_s: dict[str, float | tuple[float, ...]] = {n: c.seconds + reloads.get(n, 0.0) for n, c in costs.items()}
    for c in (c for c in graph.calls if c.kind == "generate"):
        call_wl = cache.for_call(c, knobs.get(c.name))  # the engine's pool as chosen for it
        if call_wl.priced_per_batch(c, plan.calls[c.name].layout.batch_ways):
            reload = reloads.get(c.name, 0.0)
            call_s[c.name] = tuple(d + reload for d in generate_seconds(costs[c.name], plan, call_wl, c))
    timeline = steady_state(graph, plan, call_s, moves, steps, hw.shared_host, plan_staleness(plan, wl),
                            reward_host_s(graph, wl, call_s))
    return PlanEstimate(plan, True, None, timeline.step_s, timeline, costs, moves, reloads, mem, knobs, sources)
