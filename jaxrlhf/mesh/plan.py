"""Execution plans: where every model call runs.

A plan names device groups (contiguous ranges of the global device list),
and gives each call of the graph a `Placement`: a group plus a `Layout`
(mesh axis sizes). The plan is pure data: YAML in and out, a printable
table, and validation with specific messages. Turning it into meshes is
`layout.py`'s job; moving parameters between placements is `realloc.py`'s.

Where a role's parameters live ("home") is the placement of its train call
if it has one, else of its first call. A call placed elsewhere works on a
copy: with `shadow_roles` containing the role the copy is persistent and
refreshed after every train call (disaggregated), otherwise it is made
before the call and dropped after (reallocated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import yaml

MESH_AXES = ("data", "fsdp", "tensor")


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
    """Mesh axis sizes over a group: data parallel x FSDP x tensor parallel."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

    def __str__(self) -> str:
        return f"d{self.data}f{self.fsdp}t{self.tensor}"


@dataclasses.dataclass(frozen=True)
class Placement:
    group: str
    layout: Layout


@dataclasses.dataclass
class ExecutionPlan:
    """A placement for every call of a graph, over `num_devices` devices."""

    strategy: str
    num_devices: int
    groups: dict[str, DeviceGroup]
    calls: dict[str, Placement]
    shadow_roles: tuple[str, ...] = ()  # roles whose off-home copies persist (disaggregated)
    offpolicy: bool = False  # generate step i+1 while training step i (needs a shadow actor)
    notes: str = ""

    # ---- queries -----------------------------------------------------------------
    def group_of(self, call: str) -> DeviceGroup:
        return self.groups[self.calls[call].group]

    def home_call(self, role: str) -> str:
        """The call whose placement holds `role`'s parameters."""
        names = [c for c in self.calls if c.split(".")[0] == role]
        if not names:
            raise PlanError(f"plan has no call for role {role!r}")
        trains = [c for c in names if c.endswith(".train")]
        return trains[0] if trains else names[0]

    def home(self, role: str) -> Placement:
        return self.calls[self.home_call(role)]

    # ---- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "num_devices": self.num_devices,
            "groups": {n: {"start": g.start, "size": g.size} for n, g in self.groups.items()},
            "calls": {
                c: {"group": p.group, **p.layout.axis_sizes} for c, p in self.calls.items()
            },
            "shadow_roles": list(self.shadow_roles),
            "offpolicy": self.offpolicy,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "plan") -> "ExecutionPlan":
        known = {"strategy", "num_devices", "groups", "calls", "shadow_roles", "offpolicy", "notes"}
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
        return cls(
            strategy=str(d.get("strategy", "custom")),
            num_devices=int(d["num_devices"]),
            groups=groups,
            calls=calls,
            shadow_roles=tuple(d.get("shadow_roles", ()) or ()),
            offpolicy=bool(d.get("offpolicy", False)),
            notes=str(d.get("notes", "") or ""),
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, where: str = "plan") -> "ExecutionPlan":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PlanError(f"{where}: not valid YAML: {e}") from None
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
    def table(self) -> str:
        rows = [("call", "group", "devices", "layout (data x fsdp x tensor)")]
        for c, p in self.calls.items():
            g = self.groups.get(p.group)
            span = f"{g.start}-{g.stop - 1}" if g else "?"
            rows.append((c, p.group, span, f"{p.layout.data} x {p.layout.fsdp} x {p.layout.tensor}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"strategy: {self.strategy} on {self.num_devices} devices"]
        if self.shadow_roles:
            lines[0] += f"; shadow copies: {', '.join(self.shadow_roles)}"
        if self.offpolicy:
            lines[0] += "; one-step off-policy"
        for i, r in enumerate(rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)
