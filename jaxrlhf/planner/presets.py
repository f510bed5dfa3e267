"""Strategy presets: families of execution plans built from device count and model sizes.

Each preset builds a plan or raises PlanError saying why it cannot apply.
They are heuristics (the planner's search starts from them and improves):

- generation is memory-bound, so it gets tensor parallelism inside a host
  (each decode step reads every weight once, split over the tensor group);
- training and inference get FSDP over the group (ZeRO-3 style: params,
  grads and optimizer state all sharded), falling back to tensor parallelism
  only for the part of the group the batch cannot be split over;
- group sizes follow a rough FLOP share per call: train 3 units per
  parameter, generate 3 (memory-bound decoding is slow per FLOP), inference 1.

`heuristic` (the Megatron-style plan ReaLHF compares with) and `verl` (a
verl-style hybrid engine: FSDP, generation on a tensor-parallel copy) are the
expert baselines the search is measured against (see their docstrings).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Mapping

from jaxrlhf.graph import CallGraph
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.planner.plan import (
    CONTEXT_MIN_TOKENS,
    DeviceGroup,
    ExecutionPlan,
    Layout,
    Placement,
    PlanError,
    host_rule_violation,
    layout_misfit,
    valid_group_sizes,
    validate,
)
from jaxrlhf.registry import Registry

if TYPE_CHECKING:
    from jaxrlhf.planner.hardware import HardwareProfile
    from jaxrlhf.planner.memory import MemoryReport
    from jaxrlhf.planner.workload import Workload

Builder = Callable[..., ExecutionPlan]
STRATEGIES: Registry[Builder] = Registry("strategy", PlanError)
# fn(num_devices, models, graph, *, batch_size, minibatch_size, devices_per_host, workload, hardware[, offpolicy]);
# workload and hardware may be None (then a preset that sizes itself by memory assumes it fits).
register_strategy = STRATEGIES.register

KIND_WEIGHT = {"train": 3.0, "generate": 3.0, "inference": 1.0}


def build_plan(
    strategy: str,
    num_devices: int,
    models: Mapping[str, ModelConfig],
    graph: CallGraph,
    *,
    batch_size: int | None = None,
    minibatch_size: int | None = None,
    devices_per_host: int | None = None,
    offpolicy: bool = False,
    workload: "Workload | None" = None,
    hardware: "HardwareProfile | None" = None,
    check: bool = True,
) -> ExecutionPlan:
    """Plan for `strategy` on `num_devices`, validated (unless `check=False`: a caller that validates
    the plan it ends with); PlanError with the reason if it cannot apply.

    `minibatch_size`: the rows one update of a train call feeds (default: the batch); a trained role's
    layout splits them evenly, as the search's layouts do (`Workload.call_batch`). `workload` and
    `hardware` let presets that size themselves by memory (heuristic) check it."""
    builder = STRATEGIES.get(strategy)
    if num_devices < 1:
        raise PlanError(f"{strategy}: num_devices={num_devices}; need at least one device")
    if devices_per_host is not None and devices_per_host < 1:
        raise PlanError(f"{strategy}: devices_per_host={devices_per_host}; need at least one")
    missing = [r for r in graph.roles if r not in models]
    if missing:
        raise PlanError(f"{strategy}: no model config for role(s) {missing}; given {sorted(models)}")
    if offpolicy and strategy != "disaggregated":
        raise PlanError(
            f"{strategy}: offpolicy=true needs a shadow actor on its own devices; use strategy 'disaggregated'"
        )
    if minibatch_size is None and workload is not None:
        minibatch_size = workload.minibatch_size
    kwargs = dict(batch_size=batch_size, minibatch_size=minibatch_size, devices_per_host=devices_per_host,
                  workload=workload, hardware=hardware)
    if strategy == "disaggregated":
        kwargs["offpolicy"] = offpolicy
    plan = builder(num_devices, models, graph, **kwargs)
    if check:
        validate(plan, graph, models, batch_size=batch_size, devices_per_host=devices_per_host)
    return plan


# ---- layout choices ---------------------------------------------------------------------
def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def generation_layout(cfg: ModelConfig, n: int, batch_size: int | None, max_tensor: int | None) -> Layout | None:
    """Widest tensor parallelism that fits the model, at most `max_tensor` ways (`tensor_cap`); data parallel for
    the rest."""
    cap = min(n, max_tensor or n)
    for t in _divisors_desc(n):
        if t > cap:
            continue
        layout = Layout(data=n // t, tensor=t)
        if layout_misfit(layout, cfg, batch_size) is None:
            return layout
    return None


def sharded_layout(cfg: ModelConfig, n: int, batch_size: int | None) -> Layout | None:
    """FSDP over as much of the group as the batch and hidden size allow; tensor for the rest."""
    for f in _divisors_desc(n):
        if cfg.hidden_size % f:
            continue
        layout = Layout(fsdp=f, tensor=n // f)
        if layout_misfit(layout, cfg, batch_size) is None:
            return layout
    return None


def _layout_for(kind: str, cfg: ModelConfig, n: int, batch_size: int | None, max_tensor: int | None) -> Layout | None:
    return generation_layout(cfg, n, batch_size, max_tensor) if kind == "generate" else sharded_layout(cfg, n, batch_size)


def tensor_cap(devices_per_host: int | None, hardware: "HardwareProfile | None") -> int | None:
    """The generic presets' widest tensor parallelism: one host's devices, or on a TPU slice, whose chips share
    its torus whatever their host, the hardware's (`HardwareProfile.max_tensor`: two hosts' chips)."""
    return hardware.max_tensor if hardware is not None and hardware.torus_dims else devices_per_host


def call_rows(kind: str, batch_size: int | None, minibatch_size: int | None) -> int | None:
    """Rows a call of `kind` feeds at once, which its layout must split evenly: a train call one minibatch
    (4 rows on an 8-way FSDP layout leave half the devices computing padding and make XLA move shards
    between devices at every reshape), every other call the batch (`Workload.call_batch`)."""
    return minibatch_size if kind == "train" and minibatch_size is not None else batch_size


def role_rows(graph: CallGraph, role: str, batch_size: int | None, minibatch_size: int | None) -> int | None:
    """Rows a role's one layout (shared by all its calls) must split evenly: a trained role's minibatch."""
    return call_rows("train" if graph.train_call(role) is not None else "inference", batch_size, minibatch_size)


def _require(layout: Layout | None, strategy: str, what: str, cfg: ModelConfig, n: int, batch_size: int | None) -> Layout:
    if layout is None:
        raise PlanError(
            f"{strategy}: no layout of {n} devices fits {what} (heads={cfg.num_heads}, kv_heads={cfg.num_kv_heads}, "
            f"mlp={cfg.intermediate_size}, hidden={cfg.hidden_size}, batch={batch_size}); "
            "try another device count or batch size"
        )
    return layout


def _load(graph: CallGraph, models: Mapping[str, ModelConfig], calls: list[str]) -> float:
    return sum(KIND_WEIGHT[graph[c].kind] * models[graph[c].role].num_params() for c in calls)


def _two_way_split(
    strategy: str,
    n: int,
    dph: int | None,
    share: float,
    fits: Callable[[int, int], bool],
) -> int:
    """Size of the first of two side-by-side groups: the feasible one closest to `share` * n."""
    if n < 2:
        raise PlanError(f"{strategy}: needs at least 2 devices to give models their own groups, got {n}")
    sizes = set(valid_group_sizes(n, dph))
    candidates = []
    for s in range(1, n):
        if s not in sizes or (n - s) not in sizes:
            continue
        if host_rule_violation(DeviceGroup("b", s, n - s), dph) or host_rule_violation(DeviceGroup("a", 0, s), dph):
            continue
        if fits(s, n - s):
            candidates.append(s)
    if not candidates:
        raise PlanError(
            f"{strategy}: no split of {n} devices into two host-respecting groups fits both sides' models "
            f"and batch (devices per host: {dph or n}); try colocated or another batch size"
        )
    return min(candidates, key=lambda s: (abs(s - share * n), -s))


def _trainers(graph: CallGraph) -> list[str]:
    return [r for r in graph.roles if graph.train_call(r) is not None]


# ---- presets ----------------------------------------------------------------------------
@register_strategy("colocated")
def colocated(n, models, graph, *, batch_size=None, minibatch_size=None, devices_per_host=None, hardware=None,
              **_) -> ExecutionPlan:
    """Every call on all devices, one FSDP layout per role, as DeepSpeed-Chat's hybrid engine runs
    it: generation gathers the weights once into a tensor-parallel layout (a reallocation before
    the call, dropped after) instead of gathering them for every generated token."""
    group = DeviceGroup("all", 0, n)
    layouts = {
        r: _require(sharded_layout(models[r], n, rows), "colocated", f"role {r!r}", models[r], n, rows)
        for r in graph.roles
        for rows in [role_rows(graph, r, batch_size, minibatch_size)]
    }
    calls = {}
    for c in graph.calls:
        layout = layouts[c.role]
        if c.kind == "generate":
            layout = _require(generation_layout(models[c.role], n, batch_size, tensor_cap(devices_per_host, hardware)),
                              "colocated",
                              f"call {c.name!r}", models[c.role], n, batch_size)
        calls[c.name] = Placement("all", layout)
    return ExecutionPlan("colocated", n, {"all": group}, calls,
                         notes="every call on all devices; generation on a tensor-parallel copy (hybrid engine)")


@register_strategy("interleaved")
def interleaved(n, models, graph, *, batch_size=None, minibatch_size=None, devices_per_host=None, hardware=None,
                **_) -> ExecutionPlan:
    """Trained models on exclusive groups (their train calls run concurrently); frozen
    models share the first trainer's group, apart from the other trainer, so inference
    calls overlap too. With one trainer, the frozen models get the second group."""
    trainers = _trainers(graph)
    if not trainers:
        raise PlanError("interleaved: the graph has no train call, nothing to interleave")
    first = trainers[0]
    second_roles = trainers[1:2] or [r for r in graph.roles if r != first]
    if not second_roles:
        raise PlanError("interleaved: the graph has a single role; use colocated")
    side = {r: (1 if r in second_roles else 0) for r in graph.roles}
    if len(trainers) > 2:
        for r in trainers[2:]:
            side[r] = 1
    calls_of = {i: [c.name for c in graph.calls if side[c.role] == i] for i in (0, 1)}
    rows = {r: role_rows(graph, r, batch_size, minibatch_size) for r in graph.roles}
    l0, l1 = _load(graph, models, calls_of[0]), _load(graph, models, calls_of[1])

    def fits(a: int, b: int) -> bool:
        return all(sharded_layout(models[r], a if side[r] == 0 else b, rows[r]) for r in graph.roles)

    s = _two_way_split("interleaved", n, devices_per_host, l0 / (l0 + l1), fits)
    names = (first, second_roles[0] if len(trainers) > 1 else "frozen")
    groups = {names[0]: DeviceGroup(names[0], 0, s), names[1]: DeviceGroup(names[1], s, n - s)}
    sizes = (s, n - s)
    calls = {}
    cap = tensor_cap(devices_per_host, hardware)
    for c in graph.calls:  # generation on a tensor-parallel copy in its group, as colocated's hybrid engine
        size = sizes[side[c.role]]
        layout = generation_layout(models[c.role], size, batch_size, cap) if c.kind == "generate" else None
        calls[c.name] = Placement(names[side[c.role]], layout or sharded_layout(models[c.role], size, rows[c.role]))
    return ExecutionPlan(
        "interleaved", n, groups, calls,
        notes=f"{'+'.join(r for r in graph.roles if side[r] == 0)} | {'+'.join(r for r in graph.roles if side[r] == 1)}",
    )


@register_strategy("disaggregated")
def disaggregated(n, models, graph, *, batch_size=None, minibatch_size=None, devices_per_host=None, offpolicy=False,
                  hardware=None, **_) -> ExecutionPlan:
    """Generation on its own group with a shadow copy of the generating model in a
    tensor-parallel layout (refreshed after each train call); everything else on the rest."""
    gens = [c for c in graph.calls if c.kind == "generate"]
    if not gens:
        raise PlanError("disaggregated: the graph has no generate call to give its own devices")
    gen_roles = {c.role for c in gens}
    rest = [c.name for c in graph.calls if c.kind != "generate"]
    if not rest:
        raise PlanError("disaggregated: the graph has only generate calls; use colocated")
    lg = _load(graph, models, [c.name for c in gens])
    lr = _load(graph, models, rest)
    rows = {r: role_rows(graph, r, batch_size, minibatch_size) for r in graph.roles}
    cap = tensor_cap(devices_per_host, hardware)

    def fits(a: int, b: int) -> bool:
        return all(generation_layout(models[c.role], a, batch_size, cap) for c in gens) and all(
            sharded_layout(models[r], b, rows[r]) for r in graph.roles
        )

    s = _two_way_split("disaggregated", n, devices_per_host, lg / (lg + lr), fits)
    groups = {"gen": DeviceGroup("gen", 0, s), "train": DeviceGroup("train", s, n - s)}
    calls = {}
    for c in graph.calls:
        if c.kind == "generate":
            calls[c.name] = Placement("gen", generation_layout(models[c.role], s, batch_size, cap))
        else:
            calls[c.name] = Placement("train", sharded_layout(models[c.role], n - s, rows[c.role]))
    shadows = tuple(r for r in graph.roles if r in gen_roles and graph.train_call(r) is not None)
    return ExecutionPlan(
        "disaggregated", n, groups, calls, shadow_roles=shadows, offpolicy=offpolicy,
        notes="generation on its own devices" + ("; one step off-policy" if offpolicy else ""),
    )


@register_strategy("reallocated")
def reallocated(n, models, graph, *, batch_size=None, minibatch_size=None, devices_per_host=None, hardware=None,
                **_) -> ExecutionPlan:
    """Each call its own layout (ReaLHF): generation tensor-parallel and train calls FSDP,
    both on all devices (parameters resharded before generation, copy dropped after);
    frozen models' inference calls on two disjoint halves so they run concurrently."""
    if n < 2:
        raise PlanError("reallocated: with 1 device every call has the same layout; use colocated")
    groups = {"all": DeviceGroup("all", 0, n)}
    frozen_calls = [c for c in graph.calls if graph.train_call(c.role) is None]
    halves: dict[str, str] = {}
    h = n // 2
    if len(frozen_calls) >= 2 and n % 2 == 0:
        lo, hi = DeviceGroup("lo", 0, h), DeviceGroup("hi", h, h)
        ok = not host_rule_violation(lo, devices_per_host) and not host_rule_violation(hi, devices_per_host)
        ok = ok and all(sharded_layout(models[c.role], h, batch_size) for c in frozen_calls)
        if ok:
            groups.update(lo=lo, hi=hi)
            halves = {c.name: ("lo", "hi")[i % 2] for i, c in enumerate(frozen_calls)}
    calls = {}
    for c in graph.calls:
        where = halves.get(c.name, "all")
        size = groups[where].size
        rows = call_rows(c.kind, batch_size, minibatch_size)
        layout = _layout_for(c.kind, models[c.role], size, rows, tensor_cap(devices_per_host, hardware))
        calls[c.name] = Placement(where, _require(layout, "reallocated", f"call {c.name!r}", models[c.role], size, rows))
    return ExecutionPlan("reallocated", n, groups, calls, notes="per-call layouts; parameters resharded between calls")


def _heuristic_tensor(cfg: ModelConfig, head: str, n: int, dph: int) -> int:
    """Widest tensor parallelism up to min(8, devices per host) that divides the model and `n`."""
    for t in _divisors_desc(min(8, dph, n)):
        dims = [cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size] + ([cfg.vocab_size] if head == "lm" else [])
        if n % t == 0 and all(v % t == 0 for v in dims):
            return t
    return 1


def _heuristic_ladder(cfg: ModelConfig, n: int, t: int, dph: int, batches: list[int | None],
                      seq_len: int | None = None) -> list[Layout]:
    """A role's layouts from least to most memory-saving, Megatron practice: tensor inside a node,
    then pipeline stages across nodes (2, 4, ... up to one stage per node), then FSDP on top; for
    sequences long enough that the search weighs context parallelism (`plan.CONTEXT_MIN_TOKENS`),
    then context parallelism over 2, 4, ... of the devices outside the node (Megatron's `--cp`), unstaged."""
    rest = n // t
    hosts = max(n // dph, 1)
    stages = [s for s in range(1, rest + 1) if rest % s == 0 and cfg.num_layers % s == 0 and (s == 1 or s <= hosts)]
    top = stages[-1]
    ladder = [Layout(data=rest // s, tensor=t, stage=s) for s in stages]
    ladder += [Layout(data=rest // top // f, fsdp=f, tensor=t, stage=top) for f in range(2, rest // top + 1)
               if (rest // top) % f == 0 and cfg.hidden_size % f == 0]
    if seq_len is not None and seq_len >= CONTEXT_MIN_TOKENS:
        ladder += [Layout(data=rest // c, tensor=t, context=c) for c in range(2, rest + 1)
                   if rest % c == 0 and seq_len % c == 0]
    return [lay for lay in ladder if all(layout_misfit(lay, cfg, b, seq_len=seq_len) is None for b in batches)]


@register_strategy("heuristic")
def heuristic(n, models, graph, *, batch_size=None, devices_per_host=None, workload=None, hardware=None,
              **_) -> ExecutionPlan:
    """The Megatron-style plan ReaLHF compares against, as a fair baseline for the search.

    All calls on all devices; one layout per role for all its calls: tensor parallel inside a node
    (min(8, devices per host), dividing the heads), pipeline stages across nodes only when memory
    needs them, FSDP only where memory still forces it, data parallel for the rest. Generation
    is never pipelined (the runtime refuses it) and never FSDP: it runs on the role's layout with
    stages and FSDP turned into data parallelism, a reshard before the call (once per generation,
    like DeepSpeed-Chat's hybrid engine). Roles start at the cheapest rung of their ladder; while
    the plan does not fit `hardware`'s memory (each call split into the micro-batches
    `simulator.plan_fit` gives it), the role with the most bytes on the fullest device
    climbs one rung; then each role tries every rung of its ladder, keeping what is faster and fits
    (a Megatron user tunes the pipeline depth: with ZeRO-1's optimizer split a 70B model fits without
    stages, which is not always fastest). Without `workload` and `hardware` the cheapest rungs are
    taken as they are.
    """
    # memory imports the cost model; imported here so the other presets stay light
    from jaxrlhf.planner.memory import optimizer_per_device, params_per_device
    from jaxrlhf.planner.simulator import plan_fit

    dph = devices_per_host or (hardware.devices_per_host if hardware else n)
    ladders: dict[str, list[Layout]] = {}
    for r in graph.roles:
        cfg, head = models[r], graph.head(r)
        kinds = {c.kind for c in graph.calls if c.role == r}
        batches = [workload.call_batch(k) for k in kinds] if workload else [batch_size]
        ladders[r] = _heuristic_ladder(cfg, n, _heuristic_tensor(cfg, head, n, dph), dph, batches,
                                       workload.seq_len if workload else None)
        if not ladders[r]:
            raise PlanError(f"heuristic: no layout of {n} devices fits role {r!r} and its batch {batches}; "
                            "try another device count or batch size")
    rung = {r: 0 for r in graph.roles}

    def make() -> ExecutionPlan:
        calls = {}
        for c in graph.calls:
            lay = ladders[c.role][rung[c.role]]
            if c.kind == "generate":
                lay = Layout(data=lay.data * lay.stage * lay.fsdp * lay.context, tensor=lay.tensor)
                if layout_misfit(lay, models[c.role], workload.batch_size if workload else batch_size):
                    lay = _require(generation_layout(models[c.role], n, batch_size, dph), "heuristic",
                                   f"call {c.name!r}", models[c.role], n, batch_size)
            calls[c.name] = Placement("all", lay)
        return ExecutionPlan("heuristic", n, {"all": DeviceGroup("all", 0, n)}, calls,
                             notes="Megatron-style: tensor in a node, stages across nodes, data parallel rest")

    plan = make()
    if workload is None or hardware is None:
        return plan
    closest: tuple[float, str, str] | None = None
    while True:
        mem = plan_fit(plan, graph, models, workload, hardware)[1]
        if mem.feasible:
            return _tuned(make, [(rung, r, len(ladders[r])) for r in graph.roles], graph, models, workload, hardware)
        closest = _closer(closest, mem, {r: ladders[r][rung[r]] for r in graph.roles})
        climbable = [r for r in graph.roles if rung[r] + 1 < len(ladders[r])]
        if not climbable:
            raise PlanError(f"heuristic: does not fit even with the most memory-saving layouts; {_closest_text(closest)}")

        def held(r: str) -> float:
            lay = ladders[r][rung[r]]
            trained = graph.train_call(r) is not None
            return params_per_device(models[r], graph.head(r), lay) + (
                optimizer_per_device(models[r], graph.head(r), lay, workload, r) if trained else 0.0)

        r = max(climbable, key=held)  # every call uses every device: each device holds every role
        rung[r] += 1
        plan = make()


def _verl_ladder(cfg: ModelConfig, head: str, n: int, dph: int, batches: list[int | None],
                 seq_len: int | None = None) -> list[Layout]:
    """A role's train/inference layouts, verl practice (FSDP, or Megatron tensor parallelism inside a
    node): FSDP over 1, 2, 4 ... nodes (data parallel across the rest), alone or on top of tensor
    parallelism 2, 4 or 8 inside a node; for sequences long enough that the search weighs context
    parallelism (`plan.CONTEXT_MIN_TOKENS`) also FSDP over every device with the sequences split over 2,
    4 or 8 of a node's devices (verl's Ulysses sequence parallelism, `ulysses_sequence_parallel_size`,
    here the runtime's ring attention); least to most memory-saving (parameters, then activations)."""
    from jaxrlhf.planner.memory import params_per_device

    ladder = []
    for t in (1, 2, 4, 8):
        if t > min(dph, n) or n % t:
            continue
        for f in range(min(dph, n) // t, n // t + 1):
            if (n // t) % f == 0 and (f * t <= dph or f * t % dph == 0) and cfg.hidden_size % f == 0:
                ladder.append(Layout(data=n // t // f, fsdp=f, tensor=t))
    if seq_len is not None and seq_len >= CONTEXT_MIN_TOKENS:
        ladder += [Layout(fsdp=n // c, context=c) for c in (2, 4, 8)
                   if c <= min(dph, n) and n % c == 0 and seq_len % c == 0 and cfg.hidden_size % (n // c) == 0]
    ladder = [lay for lay in ladder if all(layout_misfit(lay, cfg, b, seq_len=seq_len) is None for b in batches)]
    return sorted(ladder, key=lambda lay: (-params_per_device(cfg, head, lay), -lay.batch_ways))


def _closer(closest: tuple[float, str, str] | None, mem: "MemoryReport", layouts: Mapping[str, Layout]
            ) -> tuple[float, str, str]:
    """The rung of a preset's climb nearest to fitting so far (its overflow, layouts and reason): the last rung
    saves the most parameters but may hold the most activations (64 pipeline stages of one data shard), so
    a preset that fits nowhere reports the closest, not the last."""
    over = mem.max_peak - mem.capacity
    if closest is not None and closest[0] <= over:
        return closest
    return over, ", ".join(f"{r} {lay}" for r, lay in layouts.items()), mem.reason or ""


def _closest_text(closest: tuple[float, str, str]) -> str:
    over, layouts, reason = closest
    return f"the closest ({layouts}) is {over / 2**30:.1f} GiB over ({reason})"


def _footprint(graph: CallGraph, role: str, cfg: ModelConfig, layout: Layout, workload: "Workload") -> float:
    """Bytes per device of `role` under `layout` alone: its parameters (and optimizer state, trained) and
    the largest working set of its train and inference calls at their leanest knobs (`planner.knobs`)."""
    from jaxrlhf.planner import knobs
    from jaxrlhf.planner.memory import optimizer_per_device, params_per_device

    head = graph.head(role)
    own = params_per_device(cfg, head, layout)
    if graph.train_call(role) is not None:
        own += optimizer_per_device(cfg, head, layout, workload, role)
    work = [min(knobs.working_bytes(c, cfg, layout, workload, k) for k in knobs.options(c, layout, workload))
            for c in graph.calls if c.role == role and c.kind != "generate"]
    return own + max(work, default=0.0)


@register_strategy("verl")
def verl(n, models, graph, *, batch_size=None, devices_per_host=None, workload=None, hardware=None,
         **_) -> ExecutionPlan:
    """A verl-style hybrid engine, the expert baseline beside `heuristic`: every call on all devices;
    training and inference sharded as verl's FSDP or Megatron backends do (`_verl_ladder`);
    generation on a tensor-parallel copy resharded from the training weights before each rollout
    (verl's vLLM/SGLang rollout). Tuned as a practitioner would with `workload` and `hardware`: the
    least sharded rungs first, the role holding the most bytes on the fullest device climbing while
    the plan does not fit; then one pass over the roles and the rollout trying each of their other
    layouts, keeping what the cost model says is faster and still fits. Without them: the first rungs
    and the widest rollout tensor size inside a node."""
    from jaxrlhf.planner.memory import optimizer_per_device, params_per_device
    from jaxrlhf.planner.simulator import plan_fit

    dph = devices_per_host or (hardware.devices_per_host if hardware else n)
    group = DeviceGroup("all", 0, n)
    ladders: dict[str, list[Layout]] = {}
    for r in graph.roles:
        kinds = {c.kind for c in graph.calls if c.role == r and c.kind != "generate"}
        batches = [workload.call_batch(k) for k in kinds] if workload else [batch_size]
        ladders[r] = _verl_ladder(models[r], graph.head(r), n, dph, batches,
                                  workload.seq_len if workload else None) if kinds else [Layout(data=n)]
        if workload is not None and kinds:  # least to most memory-saving, activations counted too
            ladders[r].sort(key=lambda lay, r=r: -_footprint(graph, r, models[r], lay, workload))
        if not ladders[r]:
            raise PlanError(f"verl: no FSDP layout of {n} devices fits role {r!r} and its batch {batches}; "
                            "try another device count or batch size")
    rollouts: dict[str, list[Layout]] = {}
    for c in graph.calls:
        if c.kind == "generate":
            lays = [Layout(data=n // t, tensor=t) for t in range(min(dph, n), 0, -1) if n % t == 0]
            rows = workload.batch_size if workload else batch_size
            rollouts[c.name] = [lay for lay in lays if layout_misfit(lay, models[c.role], rows) is None]
            if not rollouts[c.name]:
                raise PlanError(f"verl: no tensor-parallel rollout layout of {n} devices fits {c.name!r}")
    rung = dict.fromkeys(graph.roles, 0)
    tp = dict.fromkeys(rollouts, 0)

    def make() -> ExecutionPlan:
        calls = {c.name: Placement("all", rollouts[c.name][tp[c.name]] if c.kind == "generate"
                                   else ladders[c.role][rung[c.role]]) for c in graph.calls}
        return ExecutionPlan("verl", n, {"all": group}, calls,
                             notes="verl-style hybrid engine: FSDP/TP training, generation on a tensor-parallel copy")

    if workload is None or hardware is None:
        return make()

    def resident(r: str) -> float:
        lay, head = ladders[r][rung[r]], graph.head(r)
        return params_per_device(models[r], head, lay) + (
            optimizer_per_device(models[r], head, lay, workload, r) if graph.train_call(r) else 0.0)

    closest: tuple[float, str, str] | None = None
    while not (mem := plan_fit(make(), graph, models, workload, hardware)[1]).feasible:
        closest = _closer(closest, mem, {r: ladders[r][rung[r]] for r in graph.roles})
        climbable = [r for r in graph.roles if rung[r] + 1 < len(ladders[r])]
        if not climbable:
            raise PlanError(f"verl: does not fit even with the most memory-saving layouts; {_closest_text(closest)}")
        rung[max(climbable, key=resident)] += 1
    return _tuned(make, [*((rung, r, len(ladders[r])) for r in graph.roles),
                         *((tp, c, len(rollouts[c])) for c in rollouts)], graph, models, workload, hardware)


def _tuned(make: Callable[[], ExecutionPlan], choices: list[tuple[dict, str, int]], graph: CallGraph,
           models: Mapping[str, ModelConfig], workload: "Workload", hardware: "HardwareProfile") -> ExecutionPlan:
    """A fitting preset tuned as a practitioner would: one pass over `choices` (a dict of chosen indices, the
    key, how many options), each tried at every option with the others held, keeping what the cost model
    says is faster and still fits."""
    from jaxrlhf.planner.cost import CostCache
    from jaxrlhf.planner.simulator import estimate_plan

    cache = CostCache(models, workload, hardware)  # most calls keep their placement from one try to the next
    start = estimate_plan(make(), graph, models, workload, hardware, cache=cache)
    # the start may not fit after all (a fixed micro-batch size its layouts cannot split, say): any option that does wins
    best = start.step_s if start.feasible else math.inf
    for knob, key, count in choices:
        chosen = knob[key]
        for i in range(count):
            if i == chosen:
                continue
            knob[key] = i
            est = estimate_plan(make(), graph, models, workload, hardware, cache=cache)
            if est.feasible and est.step_s < best:
                best, chosen = est.step_s, i
        knob[key] = chosen
    return make()
