"""Execution plans: where every model call runs.

A plan names device groups (contiguous ranges of the global device list,
sorted by process then device id, so a range means the same devices on every
process; a group never splits a host unless it is smaller than one) and
gives each call of the graph a `Placement`: a group plus a `Layout`
(mesh axis sizes). The plan is pure data: YAML in and out, a printable
table, and validation with specific messages. Turning it into meshes is
`jaxrlhf.placement.layout`'s job; moving parameters between placements is
`jaxrlhf.transfer.realloc`'s.

Where a role's parameters live ("home") is the placement of its train call
if it has one, else of its first call. A call placed elsewhere works on a
copy: with `shadow_roles` containing the role the copy is persistent and
refreshed after every train call (disaggregated), otherwise it is made
before the call and dropped after (reallocated).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import yaml

from jaxrlhf.yaml_input import read as read_yaml

if TYPE_CHECKING:
    import jax

    from jaxrlhf.graph import CallGraph
    from jaxrlhf.models.config import ModelConfig

# stage outermost (pipeline stages may span hosts), tensor innermost; context beside tensor, so a ring's
# neighbours are near each other; expert (the mixture-of-experts' expert parallelism) beside the batch axes
MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
# the mesh axes a batch is split over (placement's default axis rules): the expert axis splits the batch
# as data parallelism does outside the experts
BATCH_AXES = ("data", "fsdp", "expert")


class PlanError(ValueError):
    """A plan that cannot run, with the reason and, where possible, the fix."""


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """A contiguous range of global device indices [start, start + size)."""

    name: str
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def indices(self) -> range:
        return range(self.start, self.stop)

    def overlaps(self, other: "DeviceGroup") -> bool:
        return self.start < other.stop and other.start < self.stop


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axis sizes over a group: pipeline stages x data parallel x FSDP x context x tensor parallel.

    `stage` splits the stacked decoder layers into consecutive pipeline stages (1 = no pipeline);
    `context` splits every sequence into consecutive blocks of tokens, one per device, attention then
    running as ring attention (`models/context.py`; 1 = no context parallelism). Parameters are
    replicated over `context`, as over `data`. `expert` (expert parallelism, mixture-of-experts models
    only; 1 = none) splits a sparse MLP's experts over its devices, num_experts / expert each, and
    splits the batch as `data` does everywhere else (`models/moe.py`).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    context: int = 1
    expert: int = 1

    @property
    def num_devices(self) -> int:
        return self.stage * self.data * self.fsdp * self.expert * self.context * self.tensor

    @property
    def batch_ways(self) -> int:
        """The batch's shards: data x fsdp x expert (`BATCH_AXES`)."""
        return self.data * self.fsdp * self.expert

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"stage": self.stage, "data": self.data, "fsdp": self.fsdp, "expert": self.expert,
                "context": self.context, "tensor": self.tensor}

    @property
    def serialised(self) -> dict[str, int]:
        """Axis sizes as plan files write them: `stage`, `expert` and `context` only when > 1."""
        return {a: n for a, n in self.axis_sizes.items() if a not in ("stage", "expert", "context") or n > 1}

    def __str__(self) -> str:
        return (f"d{self.data}f{self.fsdp}t{self.tensor}" + (f"p{self.stage}" if self.stage > 1 else "")
                + (f"c{self.context}" if self.context > 1 else "") + (f"e{self.expert}" if self.expert > 1 else ""))

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """The layout `str(layout)` wrote ("d4f1t2", "d1f2t1p2", "d2f1t1c4", "d2f1t1e4")."""
        m = re.fullmatch(r"d(\d+)f(\d+)t(\d+)(?:p(\d+))?(?:c(\d+))?(?:e(\d+))?", text)
        if not m:
            raise ValueError(
                f"layout {text!r} is not of the form d<data>f<fsdp>t<tensor>[p<stages>][c<context>][e<expert>]")
        return cls(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 1), int(m[5] or 1), int(m[6] or 1))


@dataclasses.dataclass(frozen=True)
class Placement:
    group: str
    layout: Layout


# remat policies of a trained role's decoder layers (`models.transformer.remat_policy`)
REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class Execution:
    """The memory knobs a run executes a plan with (`ExecutionPlan.execution`): rows per micro-batch of each
    micro-batched call, each trained role's remat policy, a packed run's token budget, the continuous engine's
    slot pool and page pool. The algorithms and
    role builders read these, never the config's keys, so the run does what the plan was priced with."""

    micro_batch_size: Mapping[str, int] = dataclasses.field(default_factory=dict)
    remat: Mapping[str, str] = dataclasses.field(default_factory=dict)
    token_budget: int | None = None
    gen_slots: int | None = None  # the continuous engine's rows decoding at once; None: the config's
    gen_pages: int | None = None  # the continuous engine's response pages (all shards); None: the config's
    # the context degree of each call whose layout splits its rows over devices (absent: 1): a packing read
    # by such a call keeps rows as wide as the batch (`models.packing.one_row_rule`)
    contexts: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def micro_batch(self, call: str) -> int | None:
        """Rows per micro-batch of `call` (None: the whole batch, or minibatch, at once)."""
        return self.micro_batch_size.get(call)

    def remat_of(self, role: str) -> str:
        return self.remat.get(role, "none")


def seconds_text(seconds: float) -> str:
    """A time as a reader takes it: three significant digits, and whole seconds with thousands separators from
    1,000 s on (4,010, not 4.01e+03)."""
    return f"{seconds:,.0f}" if abs(seconds) >= 1000 else f"{seconds:.3g}"


@functools.lru_cache(maxsize=4096)
def home_call_of(calls: tuple[str, ...], role: str) -> str:
    """Of the call names `calls`, the one holding `role`'s parameters: its train call if it has one,
    else its first call."""
    mine = [c for c in calls if c.startswith(role + ".")]
    if not mine:
        raise PlanError(f"plan has no call for role {role!r}")
    return next((c for c in mine if c.endswith(".train")), mine[0])


@dataclasses.dataclass
class ExecutionPlan:
    """A placement for every call of a graph, over `num_devices` devices."""

    strategy: str
    num_devices: int
    groups: dict[str, DeviceGroup]
    calls: dict[str, Placement]
    shadow_roles: tuple[str, ...] = ()  # roles whose off-home copies persist (disaggregated)
    offpolicy: bool = False  # generate step i+1 while training step i (needs a shadow actor)
    offload_roles: tuple[str, ...] = ()  # frozen roles kept in host memory between their calls
    # trained roles whose optimizer state waits in host memory between their train calls (it comes back to
    # device for each train call and goes out again after it): ZeRO-Offload's trade of two host copies of
    # the state per step for its device memory
    offload_optimizer: tuple[str, ...] = ()
    notes: str = ""
    # off-policy only: steps the generator may run ahead of the trainer (eta, chosen by the search);
    # None = the run's budget (`Config.generator_lead`)
    staleness: int | None = None
    # packed calls only: real tokens per micro-batch (chosen by the search when the run's
    # algorithm.max_tokens_per_micro_batch is unset; that key, when set, wins); None = no budget chosen
    token_budget: int | None = None
    # the memory knobs the run executes with (`planner.knobs`; a key the run's config sets wins): rows per
    # micro-batch of each micro-batched call (absent: one micro-batch), remat policy of each trained role
    # (absent: none)
    micro_batch_size: dict[str, int] = dataclasses.field(default_factory=dict)
    remat: dict[str, str] = dataclasses.field(default_factory=dict)
    gen_slots: int | None = None  # the continuous engine's rows decoding at once (generation.slots); None = all
    # the continuous engine's response pages over all shards (generation.kv_pages), sized by the planner to the
    # drawn lengths where the config leaves it unset; None = every slot holds a full response
    gen_pages: int | None = None

    # ---- queries -----------------------------------------------------------------
    def group_of(self, call: str) -> DeviceGroup:
        return self.groups[self.calls[call].group]

    def home_call(self, role: str) -> str:
        """The call whose placement holds `role`'s parameters."""
        return home_call_of(tuple(self.calls), role)  # the search asks this ~10^6 times

    def home(self, role: str) -> Placement:
        return self.calls[self.home_call(role)]

    @property
    def execution(self) -> "Execution":
        """The memory knobs the run executes this plan's calls with."""
        return Execution(dict(self.micro_batch_size), dict(self.remat), self.token_budget, self.gen_slots,
                         self.gen_pages, {c: p.layout.context for c, p in self.calls.items() if p.layout.context > 1})

    # ---- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "num_devices": self.num_devices,
            "groups": {n: {"start": g.start, "size": g.size} for n, g in self.groups.items()},
            "calls": {
                c: {"group": p.group, **p.layout.serialised} for c, p in self.calls.items()
            },
            "shadow_roles": list(self.shadow_roles),
            "offpolicy": self.offpolicy,
            "offload_roles": list(self.offload_roles),
            **({"offload_optimizer": list(self.offload_optimizer)} if self.offload_optimizer else {}),
            "notes": self.notes,
            **({"staleness": self.staleness} if self.staleness is not None else {}),
            **({"token_budget": self.token_budget} if self.token_budget is not None else {}),
            **({"micro_batch_size": dict(self.micro_batch_size)} if self.micro_batch_size else {}),
            **({"remat": dict(self.remat)} if self.remat else {}),
            **({"gen_slots": self.gen_slots} if self.gen_slots is not None else {}),
            **({"gen_pages": self.gen_pages} if self.gen_pages is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "plan") -> "ExecutionPlan":
        known = {"strategy", "num_devices", "groups", "calls", "shadow_roles", "offpolicy", "offload_roles", "notes",
                 "offload_optimizer", "staleness", "token_budget", "micro_batch_size", "remat", "gen_slots", "gen_pages"}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"{where}: unknown keys {sorted(unknown)}; valid keys are {sorted(known)}")
        for key in ("num_devices", "groups", "calls"):
            if key not in d:
                raise PlanError(f"{where}: missing key {key!r}")
        try:
            groups = {
                n: DeviceGroup(n, int(g["start"]), int(g["size"])) for n, g in dict(d["groups"]).items()
            }
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{where}.groups: each group needs integer 'start' and 'size' ({e})") from None
        calls = {}
        for c, p in dict(d["calls"]).items():
            p = dict(p)
            bad = set(p) - {"group", *MESH_AXES}
            if bad or "group" not in p:
                raise PlanError(
                    f"{where}.calls.{c}: needs 'group' and optional {list(MESH_AXES)}, got {sorted(p)}"
                )
            try:
                layout = Layout(**{a: int(p[a]) for a in MESH_AXES if a in p})
            except (TypeError, ValueError) as e:
                raise PlanError(f"{where}.calls.{c}: axis sizes must be integers ({e})") from None
            calls[c] = Placement(str(p["group"]), layout)
        staleness = d.get("staleness")
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1):
            raise PlanError(f"{where}.staleness must be an integer >= 1 (steps the generator runs ahead), "
                            f"got {staleness!r}")
        if staleness is not None and not d.get("offpolicy", False):
            raise PlanError(f"{where}.staleness={staleness} needs offpolicy: true (only an off-policy plan's "
                            "generator runs ahead); drop staleness or set offpolicy")
        budget = d.get("token_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise PlanError(f"{where}.token_budget must be an integer >= 1 (real tokens per packed micro-batch), "
                            f"got {budget!r}")
        micro = d.get("micro_batch_size") or {}
        if not isinstance(micro, Mapping) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in micro.values()):
            raise PlanError(f"{where}.micro_batch_size must map call names to rows per micro-batch (integers >= 1), "
                            f"got {micro!r}")
        remat = d.get("remat") or {}
        if not isinstance(remat, Mapping) or any(v not in REMAT_POLICIES for v in remat.values()):
            raise PlanError(f"{where}.remat must map trained roles to one of {list(REMAT_POLICIES)}, got {remat!r}")
        slots = d.get("gen_slots")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise PlanError(f"{where}.gen_slots must be an integer >= 1 (rows decoding at once), got {slots!r}")
        pages = d.get("gen_pages")
        if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int) or pages < 1):
            raise PlanError(f"{where}.gen_pages must be an integer >= 1 (the KV cache's response pages), got {pages!r}")
        return cls(
            strategy=str(d.get("strategy", "custom")),
            num_devices=int(d["num_devices"]),
            groups=groups,
            calls=calls,
            shadow_roles=tuple(d.get("shadow_roles", ()) or ()),
            offpolicy=bool(d.get("offpolicy", False)),
            offload_roles=tuple(d.get("offload_roles", ()) or ()),
            offload_optimizer=tuple(d.get("offload_optimizer", ()) or ()),
            notes=str(d.get("notes", "") or ""),
            staleness=staleness,
            token_budget=budget,
            micro_batch_size={str(k): int(v) for k, v in micro.items()},
            remat={str(k): str(v) for k, v in remat.items()},
            gen_slots=slots,
            gen_pages=pages,
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, where: str = "plan") -> "ExecutionPlan":
        try:
            data = read_yaml(text, where)
        except ValueError as e:
            raise PlanError(str(e)) from None
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: expected a mapping at the top level")
        return cls.from_dict(data, where)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_yaml())

    @classmethod
    def load(cls, path: str) -> "ExecutionPlan":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror}") from None
        return cls.from_yaml(text, where=str(path))

    # ---- display -----------------------------------------------------------------
    def knob_text(self) -> str:
        """The memory knobs in words ("" when none is set): remat per role, micro-batch rows per call."""
        parts = [f"remat {', '.join(f'{r} {p}' for r, p in self.remat.items())}"] if any(
            p != "none" for p in self.remat.values()) else []
        if self.micro_batch_size:
            parts.append("micro-batches of " + ", ".join(f"{rows} rows ({c})" for c, rows in self.micro_batch_size.items()))
        if self.gen_slots is not None:
            parts.append(f"generation {self.gen_slots} rows at once")
        if self.gen_pages is not None:
            parts.append(f"{self.gen_pages} KV pages")
        return "; ".join(parts)

    def table(self) -> str:
        rows = [("call", "group", "devices", "layout (data x fsdp x tensor [x stages] [x context] [x expert])")]
        for c, p in self.calls.items():
            g = self.groups.get(p.group)
            span = f"{g.start}-{g.stop - 1}" if g else "?"
            stages = f" x {p.layout.stage}" if p.layout.stage > 1 else ""
            stages += f" x context {p.layout.context}" if p.layout.context > 1 else ""
            stages += f" x expert {p.layout.expert}" if p.layout.expert > 1 else ""
            rows.append((c, p.group, span, f"{p.layout.data} x {p.layout.fsdp} x {p.layout.tensor}{stages}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"strategy: {self.strategy} on {self.num_devices} devices"]
        if self.shadow_roles:
            lines[0] += f"; shadow copies: {', '.join(self.shadow_roles)}"
        if self.offload_roles:
            lines[0] += f"; offloaded to host between calls: {', '.join(self.offload_roles)}"
        if self.offload_optimizer:
            lines[0] += f"; optimizer state in host memory between train calls: {', '.join(self.offload_optimizer)}"
        if self.offpolicy and self.staleness:
            lines[0] += f"; off-policy, the generator up to {self.staleness} steps ahead"
        elif self.offpolicy:
            lines[0] += "; off-policy, the generator ahead by the run's algorithm.max_staleness (at least 1)"
        if self.token_budget:
            lines[0] += f"; packed micro-batches of at most {self.token_budget} tokens"
        knobs = self.knob_text()
        if knobs:
            lines[0] += f"; {knobs}"
        for i, r in enumerate(rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        idle = self.idle_devices()
        if idle:
            spans = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in idle)
            count = sum(b - a + 1 for a, b in idle)
            lines.append(f"devices {spans} idle ({count} of {self.num_devices}): no call of this plan runs there")
        return "\n".join(lines)

    def idle_devices(self) -> list[tuple[int, int]]:
        """The spans of devices (first, last) that no call's group covers: a device count the calls' rows
        cannot split over (1,000 devices, batches of powers of two) leaves some unused, which the plan says."""
        used = sorted((g.start, g.stop) for g in (self.groups.get(p.group) for p in self.calls.values()) if g)
        spans, at = [], 0
        for start, stop in used:
            if start > at:
                spans.append((at, start - 1))
            at = max(at, stop)
        if at < self.num_devices:
            spans.append((at, self.num_devices - 1))
        return spans


# ---- device groups and hosts ----------------------------------------------------------
def host_rule_violation(group: DeviceGroup, devices_per_host: int | None) -> str | None:
    """Why `group` breaks the host rule, or None when it respects it."""
    if not devices_per_host or group.size <= 0:
        return None
    dph = devices_per_host
    if group.size <= dph:
        if group.start // dph != (group.stop - 1) // dph:
            first = group.start // dph * dph
            return (
                f"group {group.name!r} (devices {group.start}-{group.stop - 1}) straddles two hosts of "
                f"{dph} devices; start it at a multiple of {dph} or inside one host (e.g. start={first + dph})"
            )
        return None
    if group.start % dph or group.size % dph:
        return (
            f"group {group.name!r} (devices {group.start}-{group.stop - 1}) splits a host: a group larger than one "
            f"host ({dph} devices) must start at a multiple of {dph} and cover whole hosts"
        )
    return None


def check_group(group: DeviceGroup, num_devices: int, devices_per_host: int | None = None) -> None:
    """Raise PlanError unless `group` lies inside [0, num_devices) and respects hosts."""
    if group.size < 1:
        raise PlanError(f"group {group.name!r} has size {group.size}; a group needs at least one device")
    if group.start < 0 or group.stop > num_devices:
        raise PlanError(
            f"group {group.name!r} covers devices {group.start}-{group.stop - 1} but only devices "
            f"0-{num_devices - 1} exist; shrink or move the group"
        )
    reason = host_rule_violation(group, devices_per_host)
    if reason:
        raise PlanError(reason)


def carve(
    sizes: Mapping[str, int],
    num_devices: int,
    devices_per_host: int | None = None,
    start: int = 0,
) -> dict[str, DeviceGroup]:
    """Lay groups of the given sizes side by side from `start`, checking every one.

    Example: carve({"gen": 4, "train": 4}, 8) -> gen = 0-3, train = 4-7.
    """
    groups: dict[str, DeviceGroup] = {}
    offset = start
    for name, size in sizes.items():
        g = DeviceGroup(name, offset, int(size))
        check_group(g, num_devices, devices_per_host)
        groups[name] = g
        offset = g.stop
    return groups


def valid_group_sizes(num_devices: int, devices_per_host: int | None = None) -> list[int]:
    """Sizes a group may take: anything up to one host, then whole hosts."""
    dph = devices_per_host or num_devices
    small = list(range(1, min(dph, num_devices) + 1))
    return small + [k * dph for k in range(2, num_devices // dph + 1)]


# ---- fit checks -----------------------------------------------------------------------
# Context parallelism is weighed (the search's layouts, the heuristic preset's ladder) for sequences of
# at least this many tokens: below it a sequence's activations are small beside the weights, and a data
# or FSDP axis gives the same speed-up without a ring's K/V traffic, so the extra layouts would only
# slow the search down.
CONTEXT_MIN_TOKENS = 8192


def layout_misfit(
    layout: Layout,
    config: "ModelConfig | None" = None,
    batch_size: int | None = None,
    batch_axes: Sequence[str] = BATCH_AXES,
    kind: str | None = None,
    seq_len: int | None = None,
) -> str | None:
    """Why `layout` cannot run `config` at `batch_size` (and sequences of `seq_len` tokens) in a call of
    `kind`, or None when it fits."""
    for a, size in layout.axis_sizes.items():
        if size < 1:
            return f"mesh axis {a}={size}; every axis needs size >= 1"
    if layout.context > 1:
        if kind == "generate":
            return (f"layout {layout}: generation (prefill and decode with a KV cache) is never context-parallel "
                    f"but the layout has context={layout.context}; use context=1 "
                    f"(e.g. data={layout.data * layout.context}) for the generate call")
        if seq_len is not None and seq_len % layout.context:
            ok = [c for c in range(layout.context, 0, -1) if seq_len % c == 0]
            return (f"layout {layout}: context={layout.context} does not divide the sequence length {seq_len}; "
                    f"use context={ok[0]} (degrees that divide it: {sorted(ok)}) or pad sequences to a "
                    f"multiple of {layout.context} ({-(-seq_len // layout.context) * layout.context} tokens)")
    if layout.expert > 1:
        experts = getattr(config, "num_experts", 0) if config is not None else None
        if experts == 0:
            return (f"layout {layout}: expert={layout.expert} splits a mixture of experts' experts but the model "
                    f"has none (num_experts=0); use expert=1 (e.g. data={layout.data * layout.expert})")
        if experts and experts % layout.expert:
            ok = [e for e in range(1, experts + 1) if experts % e == 0]
            return (f"layout {layout}: expert={layout.expert} does not divide num_experts={experts}; "
                    f"expert degrees that fit: {ok}")
        if layout.stage > 1:
            return (f"layout {layout}: expert parallelism is not pipelined; use stage=1 or expert=1 "
                    f"(e.g. {Layout(layout.data, layout.fsdp, layout.tensor, 1, layout.context, layout.expert * layout.stage)})")
    if layout.stage > 1 and kind == "generate":
        return (f"generation is never pipelined but the layout has stage={layout.stage}; "
                f"use stage=1 (e.g. data={layout.data * layout.stage}) for the generate call")
    if config is not None and config.num_layers % layout.stage:
        ok = [s for s in range(1, config.num_layers + 1) if config.num_layers % s == 0]
        return (f"stage={layout.stage} does not divide num_layers={config.num_layers}; "
                f"pipeline stages that fit: {ok}")
    if config is not None and layout.tensor > 1:
        dims = {
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "intermediate_size (mlp)": config.intermediate_size,
        }
        if getattr(config, "num_experts", 0):  # each expert's MLP is split the same way
            dims["moe_intermediate_size (each expert's mlp)"] = config.expert_intermediate_size
        for what, n in dims.items():
            if n % layout.tensor:
                ok = [t for t in range(1, layout.num_devices + 1) if all(v % t == 0 for v in dims.values())]
                return f"tensor={layout.tensor} does not divide {what}={n}; tensor sizes that fit: {ok}"
    if batch_size is not None:
        split = math.prod(layout.axis_sizes[a] for a in batch_axes)
        if batch_size % split:
            axes = "data*fsdp*expert" if layout.expert > 1 else "data*fsdp"
            return (
                f"batch size {batch_size} is not divisible by {axes} = {split}; "
                f"use a batch that is a multiple of {split} or a layout with fewer {axes.replace('*', '/')} devices"
            )
    return None


# ---- validation -----------------------------------------------------------------------
def offpolicy_problem(plan: ExecutionPlan, graph: CallGraph) -> str | None:
    """Why an off-policy plan cannot run (None if it can, or is not off-policy): the generator needs a
    shadow copy of its role and devices no train call uses, since it generates the next steps while
    training runs. The runtime (`validate`) and the planner's search (`simulator.check_plan`) both ask."""
    if not plan.offpolicy:
        return None
    gens = [c.name for c in graph.calls if c.kind == "generate"]
    if not gens:
        return "offpolicy=true but the graph has no generate call"
    for gen in gens:
        role = graph[gen].role
        if role not in plan.shadow_roles:
            return (f"offpolicy=true needs a shadow {role!r} for {gen!r} (add {role!r} to shadow_roles): "
                    "generation of the next step cannot read weights that training is updating")
        for c in graph.calls:
            if c.kind == "train" and plan.group_of(gen).overlaps(plan.group_of(c.name)):
                return (f"offpolicy=true runs {gen!r} and {c.name!r} at the same time, but their groups "
                        f"{plan.calls[gen].group!r} and {plan.calls[c.name].group!r} share devices; "
                        "put generation on devices no train call uses")
    return None


def validate(
    plan: ExecutionPlan,
    graph: "CallGraph",
    models: Mapping[str, "ModelConfig"] | None = None,
    *,
    devices: "int | Sequence[jax.Device] | None" = None,
    batch_size: int | None = None,
    devices_per_host: int | None = None,
    batch_axes: Sequence[str] = BATCH_AXES,
    seq_len: int | None = None,
) -> None:
    """Raise PlanError naming the first problem that would stop `plan` from running.

    Checks, in order: device count against what is available; groups (inside
    the plan's devices, respecting hosts); every call of `graph` placed and no
    unknown call; each placement's group exists and its layout uses exactly the
    group's devices; the layout divides the model (`models`: role -> config)
    and the batch (and a context-parallel layout the sequence length `seq_len`); shadow roles and off-policy generation, which must not share
    devices with any train call because the two run at the same time.
    """

    if plan.num_devices < 1:
        raise PlanError(f"plan.num_devices={plan.num_devices}; a plan needs at least one device")
    if devices is not None:
        available = devices if isinstance(devices, int) else len(devices)
        if plan.num_devices > available:
            raise PlanError(
                f"plan needs {plan.num_devices} devices but only {available} are available; "
                f"build a plan for {available} devices"
            )
    if not plan.groups:
        raise PlanError("plan defines no device groups")
    for name, g in plan.groups.items():
        if g.name != name:
            raise PlanError(f"group key {name!r} does not match its name {g.name!r}")
        check_group(g, plan.num_devices, devices_per_host)

    missing = [c for c in graph.names if c not in plan.calls]
    if missing:
        raise PlanError(f"plan has no placement for call(s) {missing}; every call of the graph needs one")
    extra = [c for c in plan.calls if c not in graph.names]
    if extra:
        raise PlanError(f"plan places unknown call(s) {extra}; the graph's calls are {list(graph.names)}")

    for call, p in plan.calls.items():
        if p.group not in plan.groups:
            raise PlanError(
                f"call {call!r} uses group {p.group!r}, which the plan does not define; "
                f"defined groups: {sorted(plan.groups)}"
            )
        g = plan.groups[p.group]
        for axis, size in p.layout.axis_sizes.items():
            if size < 1:
                raise PlanError(f"call {call!r}: mesh axis {axis}={size}; every axis needs size >= 1")
        if p.layout.num_devices != g.size:
            raise PlanError(
                f"call {call!r}: layout stage={p.layout.stage} x data={p.layout.data} x fsdp={p.layout.fsdp} x "
                + (f"expert={p.layout.expert} x " if p.layout.expert > 1 else "")
                + (f"context={p.layout.context} x " if p.layout.context > 1 else "")
                + f"tensor={p.layout.tensor} uses {p.layout.num_devices} devices but group {p.group!r} has {g.size}; "
                f"make stage*data*fsdp*{'expert*' if p.layout.expert > 1 else ''}"
                f"{'context*' if p.layout.context > 1 else ''}tensor = {g.size}"
            )
        role = graph[call].role
        cfg = None
        if models is not None:
            if role not in models:
                raise PlanError(f"no model config for role {role!r} (call {call!r}); given: {sorted(models)}")
            cfg = models[role]
        reason = layout_misfit(p.layout, cfg, batch_size, batch_axes, kind=graph[call].kind, seq_len=seq_len)
        if reason:
            raise PlanError(f"call {call!r} on group {p.group!r} (role {role!r}): {reason}")

    for role in plan.shadow_roles:
        if role not in graph.roles:
            raise PlanError(f"shadow role {role!r} is not a role of the graph {list(graph.roles)}")
        home = plan.home(role)
        if all(plan.calls[c] == home for c in plan.calls if c.split(".")[0] == role):
            raise PlanError(
                f"shadow role {role!r} has no call placed away from its home {home.group}:{home.layout}; "
                "a shadow copy would be identical, so drop it from shadow_roles"
            )
    trained = {c.role for c in graph.calls if c.kind == "train"}
    for role in plan.offload_roles:
        if role not in graph.roles:
            raise PlanError(f"offload role {role!r} is not a role of the graph {list(graph.roles)}")
        if role in trained:
            raise PlanError(
                f"offload role {role!r} is trained every step: only frozen roles "
                f"{sorted(set(graph.roles) - trained)} can wait in host memory between their calls"
            )
        if role in plan.shadow_roles:
            raise PlanError(f"role {role!r} is both offloaded and shadowed; choose one")
    for role in plan.offload_optimizer:
        if role not in trained:
            raise PlanError(
                f"offload_optimizer role {role!r} has no train call in this graph: only trained roles "
                f"{sorted(trained)} have optimizer state to keep in host memory"
            )
    if plan.staleness is not None and (not plan.offpolicy or plan.staleness < 1):
        raise PlanError(f"staleness={plan.staleness} needs an off-policy plan (offpolicy=true) and eta >= 1")
    problem = offpolicy_problem(plan, graph)
    if problem:
        raise PlanError(problem)
