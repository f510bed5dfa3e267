"""Plan search: simulated annealing over per-call placements, seeded from every preset.

The search space gives each call a device group and a layout:
- groups respect hosts: sizes that are powers of two up to a host, aligned so
  they never straddle one, and whole hosts (powers of two of them, or all);
- layouts divide the model: tensor size divides heads, kv heads, the MLP and
  the vocabulary and stays inside a host; data x fsdp divides the call's
  batch (a minibatch for train); generation uses no FSDP (it would gather all
  weights for every token) and no pipeline (the runtime never pipelines it);
  train and inference calls may use pipeline stages that divide the layers.
Moves: re-place one call, change its layout, copy another call's placement,
move a role's home together with the calls that share it (half the time into
one of its fast layouts that fit), put two roles' homes side by side on
disjoint groups, toggle a shadow copy for a trained role. The polish adds
moves of several calls at once that no single move reaches: independent calls
split side by side over a group, and a call moved to a faster, hungrier
layout while its neighbours take leaner ones. From the best polished plan,
kicks (a shadow copy toggled with one of its role's calls moved, then a sweep)
reach plans the polish cannot. The energy is the
simulated steady-state step time; infeasible plans (over memory) get a large
energy that still shrinks as they approach fitting, so chains walk out of
them, but they are never returned.

Plans whose roles live in different places (all on all devices vs actor and
critic on disjoint halves, say) are separated by plans over memory, so a
chain rarely crosses from one such basin to another. The search therefore
starts from seeds in several basins, gives each a coordinate-descent sweep
and a short chain, and narrows by successive halving that keeps the best of
each basin before a second of any; the finalists are polished.

Deterministic for a seed: the schedule is driven by iteration counts and the
time budget only cuts a run short (reported in `SearchResult.budget_hit`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import random
import time
from typing import Iterator, Mapping

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.planner import knobs as knobs_lib
from jaxrlhf.planner import presets
from jaxrlhf.planner.cost import CostCache
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.memory import optimizer_per_device, params_per_device
from jaxrlhf.planner.plan import (
    CONTEXT_MIN_TOKENS,
    DeviceGroup,
    ExecutionPlan,
    Layout,
    Placement,
    PlanError,
    home_call_of,
)
from jaxrlhf.planner.simulator import MIN_STEPS, PlanEstimate, estimate_plan
from jaxrlhf.planner.sizes import optimizer_bytes_per_param, shard_bytes, trained_shard_count
from jaxrlhf.planner.workload import Workload

Slot = tuple[int, int, Layout]  # (group start, group size, layout)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_groups(num_devices: int, devices_per_host: int) -> list[tuple[int, int]]:
    """(start, size) of every group a call may use; none straddles a host unless it spans whole hosts."""
    per_host = min(devices_per_host, num_devices)
    sizes = [1 << i for i in range(per_host.bit_length()) if (1 << i) <= per_host and per_host % (1 << i) == 0]
    if per_host not in sizes:
        sizes.append(per_host)
    hosts = num_devices // per_host
    sizes += [per_host * k for k in range(2, hosts + 1) if (k & (k - 1)) == 0 or k == hosts]
    out = [(0, num_devices)]
    for size in sizes:
        k = size // per_host
        step = size if size <= per_host or k & (k - 1) == 0 else per_host
        out += [(s, size) for s in range(0, num_devices - size + 1, step)]
    return sorted(set(out), key=lambda g: (g[1], g[0]))


def context_degrees(call: CallSpec, wl: Workload, rest: int) -> list[int]:
    """Context degrees `call` may split its sequences over within `rest` devices: 1, and for train and
    inference calls on sequences of CONTEXT_MIN_TOKENS or more every divisor of `rest` that divides the
    sequence length (`planner.plan.layout_misfit`'s rule)."""
    if call.kind == "generate" or wl.seq_len < CONTEXT_MIN_TOKENS:
        return [1]
    return [c for c in _divisors(rest) if wl.seq_len % c == 0]


def expert_degrees(cfg: ModelConfig, rest: int) -> list[int]:
    """Expert-parallel degrees within `rest` devices: 1, and for a mixture of experts every divisor of `rest`
    that divides num_experts (`planner.plan.layout_misfit`'s rule)."""
    return [e for e in _divisors(rest) if cfg.num_experts % e == 0] if cfg.num_experts else [1]


def valid_layouts(call: CallSpec, cfg: ModelConfig, size: int, wl: Workload, max_tensor: int) -> list[Layout]:
    """Layouts of `size` devices under which `call` can run with model `cfg`, tensor parallelism at most
    `max_tensor` ways (`HardwareProfile.max_tensor`: the devices of one host), context parallelism for
    long sequences (`context_degrees`, with or without pipeline stages), and for a mixture of experts every
    expert degree that divides num_experts (`expert_degrees`; never with pipeline stages or context)."""
    batch = wl.call_batch(call.kind)
    out = []
    stages = [1] if call.kind == "generate" else [s for s in _divisors(size) if cfg.num_layers % s == 0]
    for t in _divisors(size):
        if t > max_tensor or cfg.num_heads % t or cfg.num_kv_heads % t or cfg.intermediate_size % t \
                or (cfg.num_experts and cfg.expert_intermediate_size % t):
            continue
        if call.head == "lm" and cfg.vocab_size % t:
            continue
        for p in stages:
            if (size // t) % p:
                continue
            for c in context_degrees(call, wl, size // t // p):  # the ring runs inside a stage's layers too
                for e in expert_degrees(cfg, size // t // p // c) if p == c == 1 else [1]:
                    rest = size // t // p // c // e
                    for f in _divisors(rest):
                        d = rest // f
                        if batch % (d * f * e) or cfg.hidden_size % f or wl.micro_misfit(call, d * f * e):
                            continue
                        if call.kind == "generate" and f > 1:
                            continue
                        out.append(Layout(d, f, t, p, c, e))
    return out


class LayoutTable(dict):
    """(call, group size) -> valid layouts, computed on first use. A preset or seed may use a group
    size the candidate groups lack (2 of 6 devices, say), and its moves then ask for that size."""

    def __init__(self, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload, max_tensor: int):
        super().__init__()
        self.graph, self.models, self.wl, self.max_tensor = graph, models, wl, max_tensor

    def __missing__(self, key: tuple[str, int]) -> list[Layout]:
        call, size = key
        spec = self.graph[call]
        self[key] = valid_layouts(spec, self.models[spec.role], size, self.wl, self.max_tensor)
        return self[key]


@dataclasses.dataclass
class SearchSpace:
    """Candidate (group, layout) slots per call."""

    graph: CallGraph
    num_devices: int
    devices_per_host: int
    groups: list[tuple[int, int]]
    layouts: LayoutTable  # (call, group size) -> layouts

    @classmethod
    def build(cls, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload, num_devices: int,
              hw: HardwareProfile) -> "SearchSpace":
        groups = candidate_groups(num_devices, hw.devices_per_host)
        return cls(graph, num_devices, hw.devices_per_host, groups,
                   LayoutTable(graph, models, wl, hw.max_tensor))

    def slots(self, call: str) -> list[Slot]:
        return [(s, n, lay) for s, n in self.groups for lay in self.layouts[(call, n)]]


@dataclasses.dataclass(frozen=True)
class State:
    slots: tuple[tuple[str, Slot], ...]  # in graph order
    shadow: frozenset[str] = frozenset()
    offpolicy: bool = False
    staleness: int | None = None  # off-policy only: eta in 1..Workload.staleness; None = the workload's

    def get(self, call: str) -> Slot:
        return dict(self.slots)[call]

    def with_slot(self, call: str, slot: Slot) -> "State":
        return dataclasses.replace(self, slots=tuple((c, slot if c == call else s) for c, s in self.slots))


def _group_name(start: int, size: int, num_devices: int) -> str:
    return "all" if (start, size) == (0, num_devices) else f"dev{start}-{start + size - 1}"


def state_to_plan(state: State, num_devices: int, strategy: str = "searched", notes: str = "") -> ExecutionPlan:
    groups: dict[str, DeviceGroup] = {}
    calls: dict[str, Placement] = {}
    for call, (start, size, layout) in state.slots:
        name = _group_name(start, size, num_devices)
        groups[name] = DeviceGroup(name, start, size)
        calls[call] = Placement(name, layout)
    slots = dict(state.slots)
    # A shadow is a copy somewhere other than home: drop it where every call of the role runs at home.
    shadow = tuple(sorted(r for r in state.shadow if any(
        c.split(".")[0] == r and slot != slots.get(f"{r}.train", slot) for c, slot in state.slots)))
    offpolicy = state.offpolicy and bool(shadow)
    return ExecutionPlan(strategy, num_devices, groups, calls, shadow, offpolicy, notes,
                         staleness=state.staleness if offpolicy else None)


def plan_to_state(plan: ExecutionPlan, graph: CallGraph) -> State:
    slots = tuple((c.name, (plan.group_of(c.name).start, plan.group_of(c.name).size, plan.calls[c.name].layout))
                  for c in graph.calls)
    return State(slots, frozenset(plan.shadow_roles), plan.offpolicy, plan.staleness if plan.offpolicy else None)


# ---- preset seeds ---------------------------------------------------------------------------------

def preset_plans(num_devices: int, models: Mapping[str, ModelConfig], graph: CallGraph, wl: Workload,
                 hw: HardwareProfile) -> dict[str, ExecutionPlan | str]:
    """Every registered strategy preset's plan, or the reason it does not apply."""
    out: dict[str, ExecutionPlan | str] = {}
    for name in presets.STRATEGIES:
        try:
            out[name] = presets.build_plan(name, num_devices, models, graph, batch_size=wl.batch_size,
                                           devices_per_host=hw.devices_per_host, workload=wl, hardware=hw)
        except (PlanError, ValueError) as e:
            out[name] = str(e)
    return out


def greedy_seed(ann: "_Annealer") -> State:
    """Every call on all devices in its fastest layout that fits alone (any layout when none does):
    a sensible start when no preset fits."""
    space, n = ann.space, ann.space.num_devices
    slots = []
    for c in space.graph.calls:
        fitting = [(0, n, lay) for lay in ann.ranked(c.name, 0, n)[:1]]
        cands = fitting or [s for s in space.slots(c.name) if s[1] == n] or space.slots(c.name)
        if not cands:
            raise PlanError(f"no valid layout for {c.name} on {n} devices with this model and batch")
        best = min(cands, key=lambda s: ann.cache.call(c, DeviceGroup("g", s[0], s[1]), s[2]).seconds)
        slots.append((c.name, best))
    return State(tuple(slots))


def split_seeds(ann: "_Annealer", greedy: State) -> list[State]:
    """For every pair of trained roles: `greedy` with one role's home on the first half of the
    devices and the other's on the second (each in its fastest layout that fits alone), both
    keeping shadow copies for their other calls. The plans between such a split and all-on-all
    starts are mostly over memory, so single-call moves rarely cross from one to the other."""
    n, half = ann.space.num_devices, ann.space.num_devices // 2
    if n % 2 or not {(0, half), (half, half)} <= ann.group_set:
        return []
    trained = [c for c in ann.space.graph.calls if c.kind == "train"]
    out = []
    for a, b in itertools.combinations(trained, 2):
        st = greedy
        for call, start in ((a, 0), (b, half)):
            lays = ann.ranked(call.name, start, half)
            if not lays:
                break
            st = ann.place_home(st, call.role, (start, half, lays[0]))
        else:
            out.append(dataclasses.replace(st, shadow=frozenset({a.role, b.role})))
    return out


def disaggregated_seeds(ann: "_Annealer", greedy: State) -> list[State]:
    """With off-policy plans allowed, for every trained role that generates: `greedy` with the role's
    generate calls on the first half of the devices and its training on the second, each in its fastest
    layout that fits alone, a shadow copy generating ahead of the trainer; every other call then on
    whichever of the two halves or its place in `greedy` gives the fastest plan. Between all-on-all plans
    and such a split lie plans over memory or with one side idle, so a sweep from a colocated start does
    not cross to it, nor one from the disaggregated preset, whose trainer layout suits its whole group (a
    30B MoE on 128 H20: 273 s from those starts, 245 s from this one)."""
    n, half = ann.space.num_devices, ann.space.num_devices // 2
    sides = {"generate": (0, half), "train": (half, half)}
    if not ann.allow_offpolicy or n % 2 or not set(sides.values()) <= ann.group_set:
        return []
    out = []
    for role in ann.trained:
        own = [c for c in ann.space.graph.calls if c.role == role and c.kind in sides]
        if not any(c.kind == "generate" for c in own):
            continue
        st = dataclasses.replace(greedy, shadow=greedy.shadow | {role}, offpolicy=True, staleness=None)
        for c in own:
            lays = ann.ranked(c.name, *sides[c.kind])
            if not lays:
                break
            st = st.with_slot(c.name, (*sides[c.kind], lays[0]))
        else:
            for c in ann.space.graph.calls:
                if c.role != role:
                    options = [st] + [st.with_slot(c.name, (*side, fast[0])) for side in sides.values()
                                      if (fast := ann.ranked(c.name, *side))]
                    st = min(options, key=lambda o: ann.energy(o)[0])
            out.append(st)
    return out


# ---- annealing ------------------------------------------------------------------------------------

@dataclasses.dataclass
class SearchResult:
    best: PlanEstimate
    runners_up: list[PlanEstimate]
    presets: dict[str, PlanEstimate | str]  # estimate, or why the preset does not apply
    seconds: float
    evaluations: int
    budget_hit: bool
    # the best plan whose rollouts are all on-policy: `best` itself, or (where off-policy plans were
    # searched and one won) what the generator running ahead buys against it
    best_sync: PlanEstimate | None = None
    offpolicy_searched: bool = False
    kept_in: str | None = None  # the folder this search was read back from (`search(cache_dir=...)`), if any
    # packed calls without a budget set: (budget, best step seconds or None: nothing fits) per candidate
    # the search tried (`planner.budget.choose_token_budget`); the plan carries the chosen one
    token_budgets: tuple[tuple[int | None, float | None], ...] = ()

    @property
    def async_gain(self) -> float | None:
        """Predicted step time of the best on-policy plan over the best plan's (1.0 when an on-policy
        plan is best); None when off-policy plans were not searched or no on-policy plan fits."""
        if not self.offpolicy_searched or self.best_sync is None:
            return None
        return self.best_sync.step_s / self.best.step_s


class _Annealer:
    def __init__(self, space: SearchSpace, models: Mapping[str, ModelConfig], wl: Workload, hw: HardwareProfile,
                 steps: int, allow_offpolicy: bool, budget: int = 10**9, deadline: float = math.inf):
        self.space, self.models, self.wl, self.hw = space, models, wl, hw
        self.steps, self.allow_offpolicy = steps, allow_offpolicy
        self.budget = self.phase_end = budget  # plans to evaluate, over the whole search / up to this phase's end
        self.deadline = deadline  # the wall-clock safety net (`time.perf_counter` seconds)
        self.clock_hit = False
        self.cache = CostCache(models, wl, hw)
        self.seen: dict[State, tuple[float, PlanEstimate]] = {}
        self.slots = {c.name: space.slots(c.name) for c in space.graph.calls}
        # Trained roles with a call besides training: only those can keep a shadow copy somewhere else.
        self.trained = [c.role for c in space.graph.calls if c.kind == "train"
                        and any(o.role == c.role and o.kind != "train" for o in space.graph.calls)]
        self.roles = list(dict.fromkeys(c.role for c in space.graph.calls))
        names = tuple(c.name for c in space.graph.calls)  # every state places every call, so homes are fixed
        self.home = {r: home_call_of(names, r) for r in self.roles}
        self.group_set = set(space.groups)
        self._ranked: dict[tuple[str, int, int], list[Layout]] = {}
        self._bytes_alone: dict[tuple[str, Layout], float] = {}
        self._fastest_alone: dict[tuple[str, int, int, Layout], tuple[float, float] | None] = {}
        upstream: dict[str, set[str]] = {}
        for c in space.graph.topological():
            upstream[c.name] = set(c.deps).union(*(upstream[d] for d in c.deps))
        # Calls of different roles with no dependency path between them: they can run at the same time.
        self.independent = [(a.name, b.name) for a, b in itertools.permutations(space.graph.calls, 2)
                            if a.role != b.role and a.name not in upstream[b.name] and b.name not in upstream[a.name]]
        self._independent_set = set(self.independent)

    def resident_alone(self, call: str, lay: Layout) -> float:
        """Bytes per device of `call`'s role under `lay` between calls: its parameters and, for a train
        call, its optimizer state."""
        spec = self.space.graph[call]
        cfg = self.models[spec.role]
        own = params_per_device(cfg, spec.head, lay)
        if spec.kind == "train":
            own += optimizer_per_device(cfg, spec.head, lay, self.wl, spec.role)
        return own

    def bytes_alone(self, call: str, lay: Layout) -> float:
        """Bytes per device of `call` under `lay` on its own at its leanest knobs (`planner.knobs`): its
        role's parameters (and optimizer state, for a train call) plus the call's working set."""
        if (call, lay) not in self._bytes_alone:
            spec = self.space.graph[call]
            lean = knobs_lib.options(spec, lay, self.wl)
            work = min(knobs_lib.working_bytes(spec, self.models[spec.role], lay, self.wl, k) for k in lean)
            self._bytes_alone[(call, lay)] = self.resident_alone(call, lay) + work
        return self._bytes_alone[(call, lay)]

    def fastest_alone(self, call: str, start: int, size: int, lay: Layout) -> tuple[float, float] | None:
        """(seconds, bytes per device) of `call` under `lay` on the group (start, size), on its own, at the
        fastest of its knob options that fits a device's usable memory (None: none does)."""
        key = (call, start, size, lay)
        if key not in self._fastest_alone:
            spec, group = self.space.graph[call], DeviceGroup("g", start, size)
            resident, found = self.resident_alone(call, lay), None
            if resident <= self.hw.usable_memory:
                cfg = self.models[spec.role]
                for k in knobs_lib.front(spec, group, lay, self.wl, self.cache):
                    need = resident + knobs_lib.working_bytes(spec, cfg, lay, self.wl, k)
                    if need <= self.hw.usable_memory:
                        found = (self.cache.call(spec, group, lay, k).seconds, need)
                        break
            self._fastest_alone[key] = found
        return self._fastest_alone[key]

    def ranked(self, call: str, start: int, size: int) -> list[Layout]:
        """`call`'s layouts on the group (start, size) that fit on their own and that no other such
        layout beats on both time and memory, fastest first (so each next one needs less memory).
        Fitting alone: the role's parameters and the call's working set at the fastest knobs that fit
        (`fastest_alone`) within a device's usable memory. In a plan, other roles' parameters
        share the devices, so the fastest layout alone is often not the one that fits; the
        time-memory front holds the one that does."""
        key = (call, start, size)
        if key not in self._ranked:
            priced = {lay: self.fastest_alone(call, start, size, lay) for lay in self.space.layouts[(call, size)]}
            # by (time, memory); an exact tie keeps the layouts' own order (layouts do not compare)
            fits = sorted(((p, lay) for lay, p in priced.items() if p is not None), key=lambda pl: pl[0])
            front: list[Layout] = []
            for (_, need), lay in fits:
                if not front or need < priced[front[-1]][1]:
                    front.append(lay)
            self._ranked[key] = front
        return self._ranked[key]

    def energy(self, state: State) -> tuple[float, PlanEstimate]:
        if state not in self.seen:
            plan = state_to_plan(state, self.space.num_devices)
            est = estimate_plan(plan, self.space.graph, self.models, self.wl, self.hw, self.steps, self.cache)
            if est.feasible:
                e = float(est.step_s)
            elif est.memory is not None:  # over memory: penalise by how far over
                e = 1e6 * (1.0 + est.memory.max_peak / est.memory.capacity)
            else:
                e = 1e9
            self.seen[state] = (e, est)
        return self.seen[state]

    def best_state(self) -> State:
        """The lowest-energy state seen (ties broken by the order states were first seen)."""
        return min(self.seen, key=lambda st: self.seen[st][0])

    def polish(self, start: State, passes: int | None = None) -> tuple[State, bool]:
        """Coordinate descent from `start` until nothing improves (or for `passes` sweeps, then over
        the narrow slot set only): each call alone, and with the calls of its role that share its
        placement, moved to every slot (when a call has more than POLISH_SLOTS slots, or in a
        limited sweep: every layout of its group, and the GOOD_LAYOUTS fastest front layouts on
        every group the plan uses and on all devices), then the side-by-side moves and, in a full
        polish, the repaired ones. Brings a start to the bottom of its basin; returns the state
        reached and True if the budget (`stop`) cut it short."""
        cur = start
        e_cur, _ = self.energy(cur)
        improved, sweep = True, 0
        while improved and (passes is None or sweep < passes):
            improved, sweep = False, sweep + 1
            for call, _ in cur.slots:
                slots = self.slots[call] if passes is None and len(self.slots[call]) <= POLISH_SLOTS else \
                    self.near_slots(cur, call)
                for slot in slots:
                    if self.stop():
                        return cur, True
                    for cand in (cur.with_slot(call, slot), self._move_role(cur, call, slot)):
                        e, _ = self.energy(cand)
                        if e < e_cur * (1 - 1e-9):
                            cur, e_cur, improved = cand, e, True
            for cand in itertools.chain(self.side_by_side(cur), self.repaired_moves(cur) if passes is None else ()):
                if self.stop():
                    return cur, True
                e, _ = self.energy(cand)
                if e < e_cur * (1 - 1e-9):
                    cur, e_cur, improved = cand, e, True
        return cur, False

    def near_slots(self, st: State, call: str) -> list[Slot]:
        """Every layout of `call`'s group, and its GOOD_LAYOUTS fastest front layouts on every group
        `st` uses and on all devices: the slots a limited sweep tries."""
        start, size, _ = st.get(call)
        groups = {(0, self.space.num_devices), *((s0, sn) for s0, sn, _ in dict(st.slots).values())}
        return [(start, size, lay) for lay in self.space.layouts[(call, size)]] + [
            (g0, gn, lay) for g0, gn in groups for lay in self.ranked(call, g0, gn)[:GOOD_LAYOUTS]]

    def shadow_moves(self, st: State) -> Iterator[State]:
        """A trained role's shadow copy added or dropped together with one of that role's calls
        moved to a near slot. A shadow copy changes what fits and what the role's calls cost
        elsewhere, so these are slower than a polished plan but lead, after a sweep, to plans no
        polish reaches (70B on 64 GPUs: a critic shadow with critic training leaner by FSDP 2 is
        14.6 -> 16.4 s, and 13.9 s after one sweep)."""
        for role in self.trained:
            toggled = self._toggle_shadow(st, role)
            yield toggled
            for call, _ in st.slots:
                if call.split(".")[0] == role:
                    for slot in self.near_slots(st, call):
                        yield toggled.with_slot(call, slot)
                        yield self._move_role(toggled, call, slot)

    def kicked(self, st: State) -> tuple[State, bool]:
        """Iterated local search from a polished `st`: the KICKS best shadow moves, each
        followed by one polish sweep, and the best of those polished to its bottom if that beats
        `st`; repeated while it does. Returns the state reached and True if the budget ran out."""
        e_cur, _ = self.energy(st)
        while not self.stop():
            kicks = sorted(dict.fromkeys(self.shadow_moves(st)), key=lambda c: self.energy(c)[0])[:KICKS]
            best, e_best = st, e_cur
            for kick in kicks:
                landed, hit = self.polish(kick, passes=1)
                if hit:
                    return st, True
                e_landed, _ = self.energy(landed)
                if e_landed < e_best * (1 - 1e-9):
                    best, e_best = landed, e_landed
            if best == st:
                return st, False
            st, hit = self.polish(best)
            e_cur, _ = self.energy(st)
            if hit:
                return st, True

    def repaired_moves(self, st: State) -> Iterator[State]:
        """Each call (with the calls of its role sharing its placement) moved to a layout of its
        group that needs more memory, then every call of another role on those devices moved in
        turn to whichever of its current layout and its leaner front layouts gives the fastest
        plan (on a tie, the fastest leaner one). A faster layout often fits only once its
        neighbours make room, and making room alone is slower: no single move, and no pair of
        moves, gets there."""
        for call, (start, size, lay) in st.slots:
            for new in self.ranked(call, start, size):
                if self.bytes_alone(call, new) <= self.bytes_alone(call, lay):
                    continue
                cand = self._move_role(st, call, (start, size, new))
                role = call.split(".")[0]
                for other, (o_start, o_size, o_lay) in st.slots:
                    if other.split(".")[0] == role or o_start >= start + size or start >= o_start + o_size:
                        continue
                    options = [cand] + [self._move_role(cand, other, (o_start, o_size, leaner))
                                        for leaner in self.ranked(other, o_start, o_size)
                                        if self.bytes_alone(other, leaner) < self.bytes_alone(other, o_lay)]
                    # on a tie (often: a role stays offloaded until its neighbours shrink too), the
                    # fastest leaner layout rather than none
                    cand = min(enumerate(options), key=lambda io: (self.energy(io[1])[0], io[0] == 0, io[0]))[1]
                yield cand

    def side_by_side(self, st: State) -> list[State]:
        """Independent calls that share a group split over its halves, and three over a half and two
        quarters. Each call is placed in turn, in one of its GOOD_LAYOUTS fastest front layouts there,
        alone or with the calls of its role that share its placement (a trained role's call placed
        away from home also tries a shadow copy), keeping the SIDE_BY_SIDE_KEEP best plans so far
        for the next call. No single-call move reaches these plans: each call alone is slower on
        part of its group; only the calls running at the same time together are faster."""
        placed = dict(st.slots)

        def place(states: list[State], call: str, start: int, size: int) -> list[State]:
            role, nxt = call.split(".")[0], []
            for lay in self.ranked(call, start, size)[:GOOD_LAYOUTS] if (start, size) in self.group_set else []:
                for s in states:
                    for cand in (s.with_slot(call, (start, size, lay)), self._move_role(s, call, (start, size, lay))):
                        nxt.append(cand)
                        if role in self.trained and call != self.home[role]:
                            nxt.append(dataclasses.replace(cand, shadow=cand.shadow | {role}))
            return sorted(dict.fromkeys(nxt), key=lambda c: self.energy(c)[0])[:SIDE_BY_SIDE_KEEP]

        out: list[State] = []
        for a, b in self.independent:
            start, size = placed[a][:2]
            if placed[b][:2] != (start, size) or size % 2:
                continue
            half = size // 2
            first = place([st], a, start, half)
            out += place(first, b, start + half, half)[:1]
            if half % 2:
                continue
            for c in self.calls_independent_of(a):
                if c > b and (b, c) in self._independent_set and placed[c][:2] == (start, size):
                    out += place(place(first, b, start + half, half // 2), c, start + half + half // 2,
                                 half // 2)[:1]
        return out

    def calls_independent_of(self, call: str) -> list[str]:
        """The calls that can run at the same time as `call`."""
        return [b for a, b in self.independent if a == call]

    @staticmethod
    def _toggle_shadow(st: State, role: str) -> State:
        """`role`'s shadow copy added or dropped; a plan without shadow copies cannot be off-policy."""
        shadow = st.shadow ^ {role}
        offpolicy = st.offpolicy and bool(shadow)
        return dataclasses.replace(st, shadow=shadow, offpolicy=offpolicy,
                                   staleness=st.staleness if offpolicy else None)

    def _move_role(self, st: State, call: str, slot: Slot) -> State:
        """`call` and the calls of its role that share its placement, moved to `slot` where they can."""
        role, old = call.split(".")[0], st.get(call)
        for c, s in st.slots:
            if c.split(".")[0] == role and s == old and slot[2] in self.space.layouts[(c, slot[1])]:
                st = st.with_slot(c, slot)
        return st

    def _move_home(self, st: State, role: str, group: tuple[int, int], rng: random.Random, fast: bool) -> State:
        """`role`'s home and the calls sharing it moved to `group`, in one of the home call's fast
        layouts (`fast`) or any layout; calls that cannot use that layout stay."""
        home = self.home[role]
        lays = self.ranked(home, *group)[:GOOD_LAYOUTS] if fast else self.space.layouts[(home, group[1])]
        if not lays:
            return st
        return self._move_role(st, home, (*group, rng.choice(lays)))

    def place_home(self, st: State, role: str, slot: Slot) -> State:
        """`role`'s home and the calls sharing it moved to `slot` (those that can use its layout)."""
        return self._move_role(st, self.home[role], slot)

    def restaled(self, st: State, rng: random.Random) -> State:
        """The off-policy `st` with its generator one step more or less ahead, within 1..the budget."""
        eta = st.staleness or self.wl.staleness
        options = [e for e in (eta - 1, eta + 1) if 1 <= e <= self.wl.staleness]
        return dataclasses.replace(st, staleness=rng.choice(options))

    def freshest(self, st: State) -> State:
        """`st` with the fewest steps ahead that keep its step time (each eta in 1..the budget tried):
        a staler rollout that buys no speed only costs learning."""
        if not st.offpolicy or self.wl.staleness == 1:
            return st
        e_best = self.energy(st)[0]
        for eta in range(1, self.wl.staleness + 1):
            fresher = dataclasses.replace(st, staleness=eta)
            if self.energy(fresher)[0] <= e_best * (1 + 1e-9):
                return fresher
        return st

    def propose(self, st: State, rng: random.Random) -> State:
        calls = [c for c, _ in st.slots]
        call = rng.choice(calls)
        start, size, layout = st.get(call)
        r = rng.random()
        if r < 0.3:  # another layout on the same group
            lays = self.space.layouts[(call, size)]
            if lays:
                return st.with_slot(call, (start, size, rng.choice(lays)))
        if r < 0.6:  # anywhere
            return st.with_slot(call, rng.choice(self.slots[call]))
        if r < 0.75:  # share another call's placement
            other = st.get(rng.choice(calls))
            if other[2] in self.space.layouts[(call, other[1])]:
                return st.with_slot(call, other)
            return st.with_slot(call, rng.choice(self.slots[call]))
        if r < 0.85:  # move a role's home and the calls that share it (half the time to a fast layout)
            return self._move_home(st, call.split(".")[0], rng.choice(self.space.groups), rng,
                                   fast=rng.random() < 0.5)
        if r < 0.92 and len(self.roles) > 1:  # two roles' homes side by side on disjoint groups
            start, size = rng.choice(self.space.groups)
            nxt = (start + size, size) if (start + size, size) in self.group_set else (start - size, size)
            if nxt in self.group_set:
                first, second = rng.sample(self.roles, 2)
                st = self._move_home(st, first, (start, size), rng, fast=True)
                return self._move_home(st, second, nxt, rng, fast=True)
            return st
        if self.trained:  # shadow copies / off-policy
            role = rng.choice(self.trained)
            if self.allow_offpolicy and role in st.shadow and rng.random() < 0.5:
                if st.offpolicy and self.wl.staleness > 1 and rng.random() < 0.5:
                    return self.restaled(st, rng)
                return dataclasses.replace(st, offpolicy=not st.offpolicy, staleness=None)
            return self._toggle_shadow(st, role)
        return st.with_slot(call, rng.choice(self.slots[call]))

    def chain(self, start: State, iterations: int, rng: random.Random, t0: float, t1: float) -> tuple[State, bool]:
        """One annealing chain from `start`, cooling from t0 to t1; returns the best state it saw
        and True if the budget (`stop`) cut it short."""
        cur = best = start
        e_cur, _ = self.energy(cur)
        e_best = e_cur
        for i in range(iterations):
            if self.stop():
                return best, True
            temp = t0 * (t1 / t0) ** (i / max(iterations - 1, 1))
            cand = self.propose(cur, rng)
            e_new, _ = self.energy(cand)
            if e_new <= e_cur or rng.random() < math.exp(-(e_new / e_cur - 1.0) / temp):
                cur, e_cur = cand, e_new
                if e_cur < e_best:
                    best, e_best = cur, e_cur
        return best, False

    def basin(self, st: State) -> tuple:
        """Where each role's parameters live: plans that differ here are separated by plans over
        memory or by several coordinated moves, so the search keeps them apart while it narrows."""
        return tuple(st.get(self.home[r])[:2] for r in self.roles)

    def successive_halving(self, starts: list[State], iterations: int, rng: random.Random) -> tuple[list[State], bool]:
        """Anneal every start briefly, keep the better half (each continuing from the best state of
        its own chain, cooler, with twice the iterations) until FINALISTS are left, which get a last
        chain each. Survivors are picked best first but one per basin before a basin gets a second,
        so a basin that descends slowly to a deeper bottom is not dropped for a fast shallow one.
        The rounds share `iterations` equally. Returns the finalists' best states (when the budget cuts it
        short, the best so far of each basin) and True if it did."""
        pool = list(dict.fromkeys(starts))
        rounds = max(0, math.ceil(math.log2(max(len(pool), 1) / FINALISTS))) + 1
        temps = [T_START * (T_END / T_START) ** (k / rounds) for k in range(rounds + 1)]
        for k in range(rounds):
            per_chain = max(1, iterations // rounds // len(pool))
            ends = []
            hit = False
            for i, st in enumerate(pool):
                end, hit = self.chain(st, per_chain, random.Random(rng.getrandbits(64)), temps[k], temps[k + 1])
                ends.append(end)
                if hit:
                    return self.survivors(ends + pool[i + 1:], FINALISTS), True
            keep = max(FINALISTS, len(ends) // 2) if k < rounds - 1 else FINALISTS
            pool = self.survivors(ends, keep)
        return pool, False

    def survivors(self, states: list[State], keep: int) -> list[State]:
        """The `keep` best of `states`, best first but the best of each basin before any second one."""
        ends = sorted(dict.fromkeys(states), key=lambda st: self.energy(st)[0])
        firsts, seen = [], set()
        for st in ends:  # the best of each basin, in order
            if self.basin(st) not in seen:
                seen.add(self.basin(st))
                firsts.append(st)
        return (firsts + [st for st in ends if st not in firsts])[:keep]

    def spend(self, share: float) -> None:
        """Let the next phase evaluate up to `share` of the budget more plans (all of what is left at 1)."""
        self.phase_end = min(self.budget, len(self.seen) + math.ceil(share * self.budget))

    def stop(self) -> bool:
        """Whether the phase's share of the evaluation budget is spent (deterministic), or the wall-clock
        safety net ran out (`clock_hit`: the only way a search depends on the machine)."""
        if len(self.seen) >= self.phase_end:
            return True
        if time.perf_counter() > self.deadline:
            self.clock_hit = True
            return True
        return False


DEFAULT_ITERATIONS = 16000
# The search's budget in plans evaluated (deterministic: the same question gets the same plan on any
# machine). The seeds' first sweep gets up to SWEEP_SHARE of it, the annealing CHAIN_SHARE, the polish and
# kicks what is left; a half-size seed search gets a quarter (none under MIN_EVALUATIONS).
DEFAULT_EVALUATIONS = 12000
SWEEP_SHARE, CHAIN_SHARE = 0.3, 0.4
MIN_EVALUATIONS = 1000
GiB = 2**30
SAFETY_NET_S = 600.0  # wall-clock cap: only a safety net; hit, the answer depends on the machine
POLISH_SLOTS = 600  # a call with more candidate slots is polished over its group's layouts only
T_START, T_END = 0.05, 0.0005  # annealing temperature, as a relative step-time increase accepted 1 time in e
FINALISTS = 2  # plans (from different basins where there are) that get the last chain and a full polish
SIDE_BY_SIDE_KEEP = 2  # partial plans a side-by-side move carries from one call to the next
KICKS = 16  # shadow moves an iterated-local-search step polishes from a finalist's bottom
GOOD_LAYOUTS = 4  # a macro move or a polish across groups tries a call's this many fastest front layouts there
_RESULTS: dict[str, SearchResult] = {}  # finished searches, so the n -> 2n seeding reuses the n-device search


def state_bytes(models: Mapping[str, ModelConfig], graph: CallGraph, wl: Workload) -> float:
    """Bytes any plan must hold on its devices at once: the trained roles' parameters, and the largest of
    what waits in host memory between its own calls (a frozen role's parameters, `ExecutionPlan.offload_roles`;
    a trained role's optimizer state, `.offload_optimizer`), on device while that call runs."""
    trained, parked = 0.0, [0.0]
    views = dict(wl.base_views)
    for role in graph.roles:
        if views.get(role) in graph.roles:  # a LoRA role's base: its weights are counted with that role
            continue
        cfg, head = models[role], graph.head(role)
        if graph.train_call(role) is None:
            parked.append(shard_bytes(cfg, head, Layout()))
            continue
        trained += shard_bytes(cfg, head, Layout())
        parked.append(trained_shard_count(cfg, head, Layout()) * optimizer_bytes_per_param(cfg, wl, role))
    return trained + max(parked)


def _cannot_fit(models: Mapping[str, ModelConfig], graph: CallGraph, wl: Workload, hw: HardwareProfile,
                n: int) -> bool:
    """True when the parameters and the largest optimizer state alone exceed `n` devices' memory (no plan
    fits)."""
    return state_bytes(models, graph, wl) > n * hw.usable_memory


class NoPlanFits(PlanError):
    """No plan fits in memory. `largest_call`: on the plan closest to fitting, the call whose peak on its
    busiest device is the largest (None where no candidate was sound enough to measure), so a caller can say
    which setting outside the search would close the gap (`run.planning.search_plan`: the generation engine)."""

    def __init__(self, message: str, largest_call: str | None = None):
        super().__init__(message)
        self.largest_call = largest_call


def no_fit_error(ann: "_Annealer", presets: Mapping[str, PlanEstimate | str], num_devices: int) -> NoPlanFits:
    """Why no plan fits, in one line: the plan the search found closest to fitting (every knob at its
    leanest there, `planner.knobs`), by how much its fullest device overflows, and what would close it."""
    hw = ann.hw
    over = [est for _, est in ann.seen.values() if est.memory is not None and not est.memory.feasible]
    if not over:
        reasons = {n: (p if isinstance(p, str) else p.reason) for n, p in presets.items()}
        return NoPlanFits(f"no plan fits on {num_devices} x {hw.name}: every candidate was invalid (presets: "
                          f"{reasons}); use another device count, batch size or model")
    # the least peak, ties broken by the plan's text: built only for the tied plans (for every one of a
    # search's thousands of plans it took 18 s)
    least = min(est.memory.max_peak for est in over)
    closest = min((est for est in over if est.memory.max_peak == least), key=lambda est: est.plan.to_yaml())
    mem = closest.memory
    short = mem.max_peak - mem.capacity
    knobs = knobs_lib.with_knobs(closest.plan, ann.space.graph, ann.wl, closest.knobs).knob_text()
    groups = closest.plan.groups
    layouts = ", ".join(f"{c} {p.layout} on devices {groups[p.group].start}-{groups[p.group].stop - 1}"
                        for c, p in closest.plan.calls.items())
    capacity = mem.max_peak / (1.0 - hw.memory_reserve) / GiB
    return NoPlanFits(
        f"no plan fits on {num_devices} x {hw.name}: the closest ({layouts}" + (f"; {knobs}" if knobs else "")
        + f") is {short / GiB:.1f} GiB over on its fullest device ({mem.reason}); it would fit on devices of "
        f"{capacity:.0f} GiB; otherwise use more devices, a smaller batch (data.batch_size), shorter sequences or "
        "smaller models", max(mem.call_bytes, key=mem.call_bytes.get) if mem.call_bytes else None)


def embed(plan: ExecutionPlan, graph: CallGraph, num_devices: int) -> ExecutionPlan:
    """`plan` on the first devices of a larger machine, the rest idle: same groups and layouts."""
    return state_to_plan(plan_to_state(plan, graph), num_devices, strategy="embedded",
                         notes=f"the best plan for {plan.num_devices} devices, the others idle")


def _cyclic_gc_paused(fn):
    """`fn` with Python's cycle collector paused (restored after, as it was). A search builds millions of
    short-lived objects and next to no cycles (a 4 x 70B search on 512 devices: 19 full collections found
    nothing, about 1,200 cyclic objects in all, freed by the next collection after it), so the collector's
    passes over the search's caches were 10-15 % of its time, and the share varied with what ran before."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


@_cyclic_gc_paused
def search(models: Mapping[str, ModelConfig], wl: Workload, hw: HardwareProfile, num_devices: int,
           graph: CallGraph, *, seed: int = 0, iterations: int = DEFAULT_ITERATIONS,
           evaluations: int = DEFAULT_EVALUATIONS, time_budget_s: float = SAFETY_NET_S, top_k: int = 4,
           steps: int = MIN_STEPS, allow_offpolicy: bool = False, seeds: Mapping[str, ExecutionPlan] | None = None,
           cache_dir: str | None = None) -> SearchResult:
    """Best feasible plan for `models` on `num_devices` devices of `hw`, with runners-up and presets.

    The seed plans are every preset that applies, a greedy one, splits of the
    greedy one (two trained roles on disjoint halves; with off-policy plans, a
    role's generation and training on the two halves) and the best plan for
    half the devices embedded in these, so more devices are never estimated
    slower than fewer. Each gets one coordinate-descent sweep, then
    `iterations` annealing steps are shared by successive-halving rounds over
    them (`_Annealer.successive_halving`), the finalists are polished to
    their bottom and the best plan then gets iterated-local-search kicks
    (`_Annealer.kicked`) into basins the polish cannot reach.

    The work is counted in plans evaluated, not in seconds, so the same question gets the same answer on
    any machine however busy: `evaluations` distinct plans at most, the seeds' sweep taking up to
    SWEEP_SHARE of them and the annealing up to CHAIN_SHARE, the polish and kicks the rest. The
    presets are estimated (with the memory knobs they need to fit, `planner.knobs`) before anything
    else, so a plan that fits is known from the start. `time_budget_s` is only a safety net: hit, the
    best plan so far is returned and `SearchResult.budget_hit` says the answer depended on the clock.
    The half-size search is the same call for num_devices / 2 with a quarter of the evaluations (none
    below MIN_EVALUATIONS; reused when already done in this process). `seeds`
    replaces the presets and the half-size seed, e.g. for tests. One-step
    off-policy plans are explored only with `allow_offpolicy`, because they
    change the algorithm, not just its speed. With `cache_dir`, a finished
    search is kept there and the same question (the same models, workload,
    hardware, devices, calls, seed and planner code) is answered from it.
    """
    missing = [c.role for c in graph.calls if c.role not in models]
    if missing:
        raise PlanError(f"no model config for roles {sorted(set(missing))}")
    measured = hw.measured.to_dict() if hw.measured else None  # not in the profile's repr, but it prices calls
    key = repr((sorted(models.items()), wl, hw, measured, num_devices, graph.calls, seed, iterations, evaluations,
                steps, allow_offpolicy))
    if seeds is None and key in _RESULTS:
        return _RESULTS[key]
    kept = _kept_search(cache_dir, key) if seeds is None else None
    if kept is not None:
        _RESULTS[key] = kept
        return kept
    if _cannot_fit(models, graph, wl, hw, num_devices):
        need = state_bytes(models, graph, wl)
        raise NoPlanFits(
            f"no plan fits on {num_devices} x {hw.name}: the trained models and the largest state that can wait "
            "in host memory alone take "
            f"{need / 2**30:.0f} GiB and the devices hold {num_devices * hw.usable_memory / 2**30:.0f} GiB usable; "
            f"use at least {math.ceil(need / hw.usable_memory)} devices (more for activations), "
            "smaller models or another hardware profile")
    t_start = time.perf_counter()
    raw: dict[str, ExecutionPlan | str] = dict(seeds) if seeds is not None else preset_plans(
        num_devices, models, graph, wl, hw)
    half = num_devices // 2
    if seeds is None and num_devices % 2 == 0 and half >= 1 and evaluations // 4 >= MIN_EVALUATIONS \
            and not _cannot_fit(models, graph, wl, hw, half):
        try:
            smaller = search(models, wl, hw, half, graph, seed=seed, iterations=iterations // 4,
                             evaluations=evaluations // 4, top_k=top_k, steps=steps, allow_offpolicy=allow_offpolicy,
                             time_budget_s=max(t_start + time_budget_s - time.perf_counter(), 0.0),
                             cache_dir=cache_dir)
            raw[f"best of {half}"] = embed(smaller.best.plan, graph, num_devices)
        except PlanError:  # nothing fits on half the devices: no half-size seed
            pass
    space = SearchSpace.build(graph, models, wl, num_devices, hw)
    ann = _Annealer(space, models, wl, hw, steps, allow_offpolicy, evaluations, t_start + time_budget_s)

    presets: dict[str, PlanEstimate | str] = {}
    starts: list[State] = []
    for name, plan in raw.items():
        if isinstance(plan, str):
            presets[name] = plan
            continue
        est = estimate_plan(plan, graph, models, wl, hw, steps, ann.cache)
        presets[name] = dataclasses.replace(est, plan=knobs_lib.with_knobs(est.plan, graph, wl, est.knobs))
        if est.reason is None or est.memory is not None:  # structurally sound: a usable start
            state = plan_to_state(plan, graph)
            ann.seen[state] = (est.step_s if est.feasible else 1e6 * (1 + est.memory.max_peak / est.memory.capacity),
                               est)
            if allow_offpolicy or not state.offpolicy:
                starts.append(state)
    try:
        greedy = greedy_seed(ann)
        starts += [greedy, *split_seeds(ann, greedy), *disaggregated_seeds(ann, greedy)]
    except PlanError:
        if not starts:
            raise
    ann.spend(SWEEP_SHARE)
    polished = []
    for st in starts:  # one sweep of coordinate descent shows roughly where each start's basin bottoms out
        polished.append(st if ann.stop() else ann.polish(st, passes=1)[0])
    ann.spend(CHAIN_SHARE)
    finalists, _ = ann.successive_halving(polished, iterations, random.Random(seed))
    ann.spend(1.0)
    for st in finalists:
        ann.polish(st)
    ann.kicked(ann.best_state())
    budget_hit = ann.clock_hit

    presets.pop(f"best of {half}", None)  # a seed, not a preset
    fresh = ann.freshest(ann.best_state())  # the best, with the fewest steps ahead that keep its time
    ranked = sorted(ann.seen.items(), key=lambda kv: (kv[0] != fresh, kv[1][0]))
    feasible = [(e, est) for _, (e, est) in ranked if est.feasible]
    if not feasible:
        raise no_fit_error(ann, presets, num_devices)
    best = feasible[0][1]
    origin = best.plan.strategy
    best = dataclasses.replace(best, plan=dataclasses.replace(
        knobs_lib.with_knobs(best.plan, graph, wl, best.knobs), strategy="searched",
        offload_roles=best.memory.offloaded if best.memory else (),
        offload_optimizer=best.memory.offloaded_optimizers if best.memory else (),
        notes=f"searched (seed {seed}, {len(ann.seen)} plans evaluated; best found from {origin!r})"))
    runners: list[PlanEstimate] = []
    seen_times = {round(feasible[0][0], 9)}
    for e, est in feasible[1:]:  # distinct step times, so near-copies of the best do not crowd the list
        if len(runners) >= top_k:
            break
        if round(e, 9) not in seen_times:
            seen_times.add(round(e, 9))
            runners.append(est)
    on_policy = [est for _, est in feasible if not est.plan.offpolicy]
    best_sync = best if not best.plan.offpolicy else (on_policy[0] if on_policy else None)
    result = SearchResult(best, runners, presets, time.perf_counter() - t_start, len(ann.seen), budget_hit,
                          best_sync, allow_offpolicy)
    if seeds is None and not budget_hit:  # deterministic: a search cut short by the clock is not kept
        _RESULTS[key] = result
        _keep_search(cache_dir, key, result)
    return result


@functools.cache
def _planner_code() -> str:
    """A digest of the planner's and the call graph's source: a kept search is only as good as the code
    that ran it."""
    import hashlib
    import pathlib

    here = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for path in [*sorted(here.glob("*.py")), here.parent / "graph.py"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _kept_path(cache_dir: str, key: str) -> str:
    import hashlib
    import os

    name = hashlib.sha256((_planner_code() + key).encode()).hexdigest()[:32]
    return os.path.join(cache_dir, f"search-{name}.pkl")


def _kept_search(cache_dir: str | None, key: str) -> SearchResult | None:
    """The search kept for `key` in `cache_dir`, or None (none kept, or a file that does not read back:
    the search runs again and replaces it)."""
    import pickle

    if cache_dir is None:
        return None
    try:
        with open(_kept_path(cache_dir, key), "rb") as f:
            found = pickle.load(f)
    except Exception:  # noqa: BLE001 - absent, truncated or from other code: search again
        return None
    if not isinstance(found, tuple) or len(found) != 2 or found[0] != key:
        return None
    return dataclasses.replace(found[1], kept_in=cache_dir)


def _keep_search(cache_dir: str | None, key: str, result: SearchResult) -> None:
    """Write `result` for `key` into `cache_dir` atomically (a folder that cannot be written is no error:
    the next run searches again)."""
    import os
    import pickle
    import tempfile

    if cache_dir is None:
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump((key, result), f)
        os.replace(tmp, _kept_path(cache_dir, key))
    except OSError:  # a full or read-only disk: nothing kept, the next run searches again
        pass
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
