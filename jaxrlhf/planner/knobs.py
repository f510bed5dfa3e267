"""The memory knobs a plan runs its calls with, chosen with the placement.

A train or inference call may run its rows in micro-batches (`algorithm.micro_batch_size`: one
micro-batch's activations at a time, the weights gathered again for each under FSDP), and a trained
role's decoder layers may be rematerialised for the backward (`model.<role>.remat`: `dots` keeps the
matmul outputs, `full` only each layer's input; less memory for up to a forward's more compute).
Which settings are fastest while the plan fits depends on the placement: 4 x 70B on 64 H100 needs
both where a call shares its devices with three other models, and neither on a group of its own.

So every plan the search weighs gets its knobs here, priced by the same cost and memory models as
everything else (`CostCache.call`, `memory.working_set`): each call's options (the settings the
config leaves unset, `workload.AUTO`; a key it sets is the only option) reduced to their time-memory
front (`front`: fastest first, each next one leaner), every call starting at its fastest and, while
the plan is over memory, the calls that overflow the fullest device stepping to their next leaner
option (`choose`): what a practitioner does, the fewest micro-batches and the least remat that fit,
and only where none fits, trained roles' optimizer state in host memory between their train calls.
The plan carries what was chosen (`ExecutionPlan.micro_batch_size`, `.remat`) and the run executes
exactly that (`ExecutionPlan.execution`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Mapping

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.models.packing import one_row_rule
from jaxrlhf.planner.memory import MemoryReport, plan_memory, working_set
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout
from jaxrlhf.planner.workload import AUTO, Workload

if TYPE_CHECKING:
    from jaxrlhf.models.config import ModelConfig
    from jaxrlhf.planner.cost import CostCache
    from jaxrlhf.planner.hardware import HardwareProfile

MAX_MICRO = 64  # most micro-batches a call is split into when the planner picks the count
MIN_SLOT_SHARE = 64  # the smallest pool the planner tries: a 64th of a shard's rows (at least one row)
# `plan.REMAT_POLICIES` from fastest to leanest: each recomputes more of the forward and keeps less of it
REMAT_ORDER = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class CallKnobs:
    """How one call runs: `micro` micro-batches (None: as the workload sets it, a fixed size or a packed
    call's token budget), for a train call its role's remat `policy`, for a generate call on the
    continuous engine its pool of `slots` rows decoding at once (None: the workload's)."""

    micro: int | None = None
    remat: str | None = None
    slots: int | None = None
    # a packed call's shared packing as the plan lays it (`shared_packings`), where it is not the call's own:
    # not a choice, what the other readers of the packing impose
    packing: tuple[int, tuple[int, int] | None] | None = None

    def __str__(self) -> str:
        parts = [f"{self.micro} micro-batches"] if self.micro and self.micro > 1 else []
        parts += [f"remat {self.remat}"] if self.remat and self.remat != "none" else []
        return ", ".join(parts + ([f"{self.slots} slots"] if self.slots else [])) or "-"


def options(call: CallSpec, layout: Layout, wl: Workload) -> list[CallKnobs]:
    """Every setting of `call` under `layout` the planner may choose: micro-batch counts dividing the rows
    each device feeds (up to MAX_MICRO; a packed call's micro-batches follow its token budget) where
    `algorithm.micro_batch_size` is unset, times the remat policies of a train call's role where its
    `model.<role>.remat` is unset; for a generate call on the continuous engine with `generation.slots` unset,
    its pool from every row of a shard's batch at once down by halves (fewer rows decoding at once hold less
    KV cache and take more rounds: vLLM's max_num_seqs); a stream's also up by doubling to every row its group
    slots hold (several batches' rows side by side when the generator runs ahead)."""
    if call.kind == "generate":
        if wl.gen_slots != AUTO or wl.gen_engine != "continuous" or wl.multi_turn:
            return [CallKnobs()]
        rows = wl.call_seqs(call)
        if rows % layout.batch_ways and not wl.streams:
            return [CallKnobs()]
        ways = layout.batch_ways
        batch, most = -(-rows // ways), wl.engine_rows(call, ways) // ways  # per shard
        wider, width = [], 2 * batch
        while width < most:  # a stream's: several batches' rows at once
            wider.append(width)
            width *= 2
        per_shard, narrower = batch, []
        while per_shard >= 1 and (not narrower or per_shard * MIN_SLOT_SHARE >= batch):
            narrower.append(per_shard)
            per_shard //= 2
        widths = ([most] if most > batch else []) + wider[::-1] + narrower
        return [CallKnobs(slots=w * ways) for w in widths]
    micros: list[int | None] = [None]
    if wl.micro_batch_for(call.name) == AUTO and not wl.packed:
        per_device = max(wl.call_batch(call.kind) // layout.batch_ways, 1)
        micros = [m for m in range(1, min(per_device, MAX_MICRO) + 1) if per_device % m == 0]
    policies: list[str | None] = [None]
    if call.kind == "train" and wl.remat_setting(call.role) == AUTO:
        policies = list(REMAT_ORDER)
    return [CallKnobs(m, r) for r in policies for m in micros]


def front(call: CallSpec, group: DeviceGroup, layout: Layout, wl: Workload, cache: "CostCache") -> list[CallKnobs]:
    """`call`'s options (`options`) that no other beats on both time and working-set bytes, fastest first
    (so each next one is leaner): time as a step prices it (`cache.step_seconds`: a generate pool's drawn
    lengths, its tail and refill rounds, not its seconds at the cap), bytes from `memory.working_set`."""
    key = ("knob front", call.name, group.start, group.size, layout)
    if key not in cache.memory:
        cfg = cache.models[call.role]
        opts = options(call, layout, wl)
        if len(opts) == 1:
            cache.memory[key] = opts
        else:
            work = {k: sum(working_set(call, cfg, layout, cache.for_call(call, k)).values()) for k in opts}
            out: list[CallKnobs] = []
            for k in sorted(opts, key=lambda k: (cache.step_seconds(call, group, layout, k), work[k])):
                if not out or work[k] < work[out[-1]]:
                    out.append(k)
            cache.memory[key] = out
    return cache.memory[key]


def working_bytes(call: CallSpec, cfg: "ModelConfig", layout: Layout, wl: Workload, knobs: CallKnobs) -> float:
    """Bytes one device needs on top of resident parameters while `call` runs under `knobs`."""
    return sum(working_set(call, cfg, layout, wl.for_call(call, knobs.micro, knobs.remat, knobs.slots,
                                                          knobs.packing)).values())


def choose(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, "ModelConfig"], wl: Workload,
           hw: "HardwareProfile", cache: "CostCache", best_effort: bool = False
           ) -> tuple[dict[str, CallKnobs], MemoryReport]:
    """Each call's knobs for this plan and the plan's memory under them: every call at the fastest of its
    `front`, then, while the plan is over memory, each call whose peak overflows the fullest device
    steps to its next leaner option. When even the leanest options do not fit, those and their report
    (the smallest shortfall there is); with `best_effort`, the calls that can fit stop at the fastest
    knobs that fit and only those that cannot are at their leanest (a placement priced for its time
    although this runtime's memory would not hold it)."""
    shared = shared_packings(plan, graph, models, wl)
    fronts = {c.name: front(c, plan.group_of(c.name), plan.calls[c.name].layout, wl, cache) for c in graph.calls}
    fronts.update({c: [dataclasses.replace(k, packing=packing) for k in fronts[c]] for c, packing in shared.items()})
    leanest = {c: opts[-1] for c, opts in fronts.items()}

    def settle(offload_optimizers: bool) -> tuple[dict[str, CallKnobs], MemoryReport]:
        at = dict.fromkeys(fronts, 0)
        lean_checked = all(len(opts) == 1 for opts in fronts.values())
        while True:
            knobs = {c: fronts[c][i] for c, i in at.items()}
            mem = plan_memory(plan, graph, models, wl, hw, cache.memory, knobs, offload_optimizers)
            if mem.feasible:
                return knobs, mem
            if not lean_checked and not best_effort:  # most plans the search tries do not fit at all: say so
                lean_checked = True
                lean = plan_memory(plan, graph, models, wl, hw, cache.memory, leanest, offload_optimizers)
                if not lean.feasible:
                    return leanest, lean
            worst = int(mem.peak.argmax())
            over = [c for c in at if plan.group_of(c).start <= worst < plan.group_of(c).stop
                    and mem.call_bytes[c] > mem.capacity and at[c] + 1 < len(fronts[c])]
            if not over:  # the resident bytes alone overflow, or only calls at their leanest do
                return knobs, mem
            for c in over:
                at[c] += 1

    # The knobs first, as a practitioner turns them: optimizer state goes to host memory (two copies of it
    # over the host link per step) only where no setting of them fits without.
    knobs, mem = settle(False)
    if mem.feasible or not mem.parkable:  # most plans the search tries: offload cannot help where they overflow
        return knobs, mem
    offloaded_knobs, offloaded = settle(True)
    return (offloaded_knobs, offloaded) if offloaded.feasible or offloaded.offloaded_optimizers else (knobs, mem)


def shared_packings(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, "ModelConfig"], wl: Workload
                    ) -> dict[str, tuple[int, tuple[int, int] | None]]:
    """The packed calls whose packing `plan` lays out other than each alone would, and how: a host step packs
    each packing it outputs once for every call reading it (`HostStep.shards_of`: an RL step's inference calls
    share one, DPO's calls one), over the lcm of the readers' batch ways, one row a shard only where every
    reader's model attends such a row blockwise and no reader splits rows over context devices
    (`packing.one_row_rule`), as the runtime packs it (`algorithms.rollout`, `algorithms.dpo`). A call whose
    shards and rule are its own is left out: it is priced as before, from the same cache entries."""
    if not wl.packed or wl.varlen:
        return {}
    out: dict[str, tuple[int, tuple[int, int] | None]] = {}
    for step in graph.host_steps:
        for packing in step.outputs:
            readers = [c for c in graph.calls if c.name in step.shards_of and packing in c.inputs and c.name in plan.calls]
            if len(readers) < 2:
                continue
            layouts = {c.name: plan.calls[c.name].layout for c in readers}
            shards = math.lcm(*(lay.batch_ways for lay in layouts.values()))
            rule = one_row_rule([models[c.role] for c in readers], [lay.context for lay in layouts.values()])
            for c in readers:
                own = (layouts[c.name].batch_ways, one_row_rule([models[c.role]], [layouts[c.name].context]))
                if (shards, rule) != own:
                    out[c.name] = (shards, rule)
    return out


def fixed_by(plan: ExecutionPlan, wl: Workload) -> Workload:
    """`wl` with the memory knobs `plan` carries fixed, as a run executing `plan` runs them: each call's
    micro-batch rows (a call the plan lists none for in one micro-batch), each trained role's remat, the
    engine's pool and the token budget. A plan carrying none leaves `wl` as it is."""
    if not (plan.micro_batch_size or plan.remat or plan.gen_slots is not None or plan.token_budget is not None
            or plan.gen_pages is not None):
        return wl
    roles = wl.remat.keys() if isinstance(wl.remat, Mapping) else plan.remat.keys()
    return dataclasses.replace(
        wl, micro_batch=dict(plan.micro_batch_size), remat={r: plan.remat.get(r, "none") for r in roles},
        gen_slots=plan.gen_slots if plan.gen_slots is not None else wl.slots,
        gen_pages=plan.gen_pages if plan.gen_pages is not None else None if wl.gen_pages == AUTO else wl.gen_pages,
        token_budget=plan.token_budget if wl.packed and plan.token_budget is not None else wl.token_budget)


def knob_tag(call: CallSpec, wl: Workload) -> str:
    """The knobs a run's time of `call` depends on beyond its micro-batches (which `measured.Run` keys by
    already): a train call's remat, a continuous-engine generate call's pool. "" where none."""
    if call.kind == "train":
        return f"remat={wl.remat_for(call.role)}"
    if call.kind == "generate" and wl.gen_engine == "continuous" and not wl.multi_turn:
        return f"slots={wl.engine_pool(call, 1)}"
    return ""


def with_knobs(plan: ExecutionPlan, graph: CallGraph, wl: Workload, knobs: Mapping[str, CallKnobs]) -> ExecutionPlan:
    """`plan` carrying what the run executes (`ExecutionPlan.micro_batch_size`, `.remat`, `.token_budget`,
    `.gen_slots`, `.gen_pages`): each micro-batched call's rows per micro-batch, every trained role's remat
    policy and the continuous engine's pool, from `knobs` where they chose, else as `wl` sets them, its page
    pool sized to the drawn lengths where the config leaves it unset (`Workload.held_pages`), and a packed
    run's token budget."""
    micro: dict[str, int] = {}
    remat: dict[str, str] = {}
    slots, pages = wl.slots, None if wl.gen_pages == AUTO else wl.gen_pages
    for c in graph.calls:
        k = knobs.get(c.name, CallKnobs())
        if c.kind == "generate" and k.slots is not None:
            slots = k.slots
        if c.kind == "generate" and wl.gen_pages == AUTO and c.name in plan.calls:  # sized for its pool and shards
            pages = wl.for_call(c, slots=slots).kv_pages(c, plan.calls[c.name].layout.batch_ways)
        if c.kind != "generate" and not wl.packed:
            count = k.micro if k.micro is not None else wl.micro_batches(c)
            if count > 1:
                micro[c.name] = wl.call_batch(c.kind) // count
        if c.kind == "train":
            remat[c.role] = k.remat if k.remat is not None else wl.remat_for(c.role)
    return dataclasses.replace(plan, micro_batch_size=micro, remat=remat,
                               token_budget=wl.token_budget if wl.packed else None,
                               gen_slots=slots if wl.gen_engine == "continuous" else None,
                               gen_pages=pages if wl.gen_engine == "continuous" else None)
