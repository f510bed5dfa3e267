"""Layouts become meshes; logical axis names become PartitionSpecs.

A `Layout` (stage x data x fsdp x expert x context x tensor) over a `DeviceGroup` is a
`jax.sharding.Mesh` with axes ("stage", "data", "fsdp", ["expert",] ["context",] "tensor"), tensor
innermost so tensor-parallel peers are neighbouring devices (same host), context
next (a ring's neighbours close), stage outermost. The stage axis shards only the
stacked decoder layers ("layers"); everything else is replicated over it (see
`jaxrlhf.models.pipeline`). The context axis shards only activations, along the
sequence ("length"); parameters are replicated over it, as over data (see
`jaxrlhf.models.context`). The expert axis (only where a layout has expert > 1,
between fsdp and context) shards a sparse MLP's stacked expert weights along "expert" and the batch
(beside data and fsdp) everywhere else; the sparse MLP gathers its tokens over it
(`jaxrlhf.models.moe`). Meshes are
always built with explicit `axis_types` (Auto: the compiler propagates
shardings from parameters and `constrain` hints), because the defaults of
`Mesh` and `jax.make_mesh` differ between JAX versions.

`AxisRules` holds two tables, one for parameters and one for activations
(the same name may map differently: "embed" is FSDP-sharded in a weight but
replicated in an activation whose batch is already split over fsdp). A rule
skips mesh axes of size 1 and never shards a dimension that the axes' size
does not divide; that dimension stays replicated (`planner.plan.layout_misfit`
reports the cases that matter: tensor vs heads / kv_heads / mlp, batch vs
data x fsdp).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrlhf.models import axes as ax
from jaxrlhf.placement.devices import Device, group_devices
from jaxrlhf.planner.plan import MESH_AXES, DeviceGroup, Layout, PlanError

MeshAxes = tuple[str, ...]
STAGE_AXIS = "stage"  # the mesh axis of pipeline stages
CONTEXT_AXIS = "context"  # the mesh axis sequences are split over (context parallelism)
EXPERT_AXIS = "expert"  # the mesh axis a mixture of experts' experts are split over (expert parallelism)
RuleTable = Mapping[str, MeshAxes]


def _as_axes(value: Any, where: str) -> MeshAxes:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value)
    for n in names:
        if n not in MESH_AXES:
            raise PlanError(f"{where}: {n!r} is not a mesh axis; use one of {list(MESH_AXES)} or null")
    if len(set(names)) != len(names):
        raise PlanError(f"{where}: mesh axis repeated in {list(names)}")
    return names


def _table(d: Mapping[str, Any], where: str) -> RuleTable:
    return MappingProxyType({str(k): _as_axes(v, f"{where}.{k}") for k, v in d.items()})


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axes, separately for parameters and activations."""

    params: RuleTable
    activations: RuleTable

    def with_overrides(
        self, params: Mapping[str, Any] | None = None, activations: Mapping[str, Any] | None = None
    ) -> "AxisRules":
        return AxisRules(
            _table({**self.params, **(params or {})}, "rules.params"),
            _table({**self.activations, **(activations or {})}, "rules.activations"),
        )

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None, base: "AxisRules | None" = None) -> "AxisRules":
        """Overrides from config: {"params": {...}, "activations": {...}} or one flat
        {name: axis | [axes] | null} table applied to both."""
        base = base or DEFAULT_RULES
        if not cfg:
            return base
        if set(cfg) <= {"params", "activations"}:
            return base.with_overrides(cfg.get("params"), cfg.get("activations"))
        return base.with_overrides(cfg, cfg)

    def to_dict(self) -> dict[str, dict[str, list[str] | None]]:
        conv = lambda t: {k: (list(v) if v else None) for k, v in t.items()}  # noqa: E731
        return {"params": conv(self.params), "activations": conv(self.activations)}


DEFAULT_RULES = AxisRules(
    params=_table(
        {
            ax.LAYERS: "stage",  # pipeline stages own consecutive blocks of layers (replicated when stage=1)
            ax.VOCAB: "tensor",
            ax.EMBED: "fsdp",
            ax.HEADS: "tensor",
            ax.KV_HEADS: "tensor",
            ax.HEAD_DIM: None,
            ax.MLP: "tensor",
            ax.EXPERT: "expert",  # expert parallelism: each device holds num_experts / expert experts
        },
        "rules.params",
    ),
    activations=_table(
        {
            ax.LAYERS: None,
            ax.STAGE: "stage",  # a pipeline's per-stage activations
            ax.BATCH: ("data", "fsdp", "expert"),  # expert splits the batch outside the experts
            ax.LENGTH: "context",  # context parallelism: each device holds a block of every sequence
            ax.EMBED: None,
            ax.VOCAB: "tensor",
            ax.HEADS: "tensor",
            ax.KV_HEADS: "tensor",
            ax.HEAD_DIM: None,
            ax.MLP: "tensor",
            ax.EXPERT: "expert",  # what `moe.SparseMLP` reads its expert degree and mesh axis from
        },
        "rules.activations",
    ),
)


# ---- meshes ---------------------------------------------------------------------------
def make_mesh(group: DeviceGroup, layout: Layout, devices: Sequence[Device] | None = None) -> Mesh:
    """Mesh ("stage", "data", "fsdp", "expert", "context", "tensor") over the group's devices, tensor
    innermost; the "expert" and "context" axes only where the layout has them (> 1), so every other
    layout's mesh, and the programs compiled on it, are what they were before those axes."""
    if layout.num_devices != group.size:
        raise PlanError(
            f"layout {layout} uses {layout.num_devices} devices but group {group.name!r} has {group.size}; "
            f"make stage*data*fsdp*expert*context*tensor = {group.size}"
        )
    devs = np.array(group_devices(group, devices), dtype=object)
    optional = {CONTEXT_AXIS: layout.context, EXPERT_AXIS: layout.expert}
    names = tuple(a for a in MESH_AXES if optional.get(a, 2) > 1)
    shape = tuple(layout.axis_sizes[a] for a in names)
    return Mesh(devs.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def _axis_sizes(mesh_or_layout: Mesh | Layout) -> Mapping[str, int]:
    if isinstance(mesh_or_layout, Layout):
        return mesh_or_layout.axis_sizes
    return dict(mesh_or_layout.shape)


# ---- logical axes -> PartitionSpec ----------------------------------------------------
def logical_to_spec(
    names: ax.LogicalAxes,
    shape: Sequence[int] | None,
    mesh_or_layout: Mesh | Layout,
    table: RuleTable,
) -> PartitionSpec:
    """PartitionSpec for one array: skip size-1 axes, never reuse an axis, never shard
    a dimension the axes do not divide (it stays replicated instead)."""
    sizes = _axis_sizes(mesh_or_layout)
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for i, name in enumerate(names):
        chosen: list[str] = []
        for a in table.get(name, ()) if name is not None else ():
            if sizes.get(a, 1) > 1 and a not in used:
                chosen.append(a)
        if shape is not None:
            while chosen and shape[i] % math.prod(sizes[a] for a in chosen):
                chosen.pop()
        used.update(chosen)
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _leaves_with_axes(tree: Any) -> tuple[list[Any], list[ax.LogicalAxes], Any]:
    """Array-like leaves of `tree`, their logical axes, and the full tree structure."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    logical = jax.tree_util.tree_leaves(ax.param_logical_axes(tree), is_leaf=lambda x: isinstance(x, tuple))
    if len(logical) != len(leaves):
        raise ValueError(
            f"tree has {len(leaves)} array leaves but {len(logical)} logical-axis entries; "
            "every nnx.Variable must hold exactly one array"
        )
    for leaf, names in zip(leaves, logical):
        if len(names) != len(np.shape(leaf)):
            raise ValueError(f"logical axes {names} do not match an array of shape {np.shape(leaf)}")
    return leaves, logical, treedef


def param_specs(tree: Any, layout: Layout | Mesh, rules: AxisRules | None = None) -> Any:
    """PartitionSpec per parameter (same structure as `tree`); works on abstract trees too."""
    rules = rules or DEFAULT_RULES
    leaves, logical, treedef = _leaves_with_axes(tree)
    specs = [logical_to_spec(n, np.shape(x), layout, rules.params) for x, n in zip(leaves, logical)]
    return jax.tree_util.tree_unflatten(treedef, specs)


def param_shardings(tree: Any, mesh: Mesh, rules: AxisRules | None = None, memory_kind: str | None = None) -> Any:
    """NamedSharding per parameter of an nnx State (or any pytree; leaves without
    `logical_axes` metadata are replicated), with the structure of `tree`."""
    specs = param_specs(tree, mesh, rules)
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


OPTIMIZER_AXES = ("data", EXPERT_AXIS)  # the data-parallel axes optimizer state is split over (ZeRO-1)


def optimizer_spec(spec: PartitionSpec, shape: Sequence[int], mesh_or_layout: Mesh | Layout) -> PartitionSpec:
    """`spec` of a parameter, further split for optimizer state that mirrors it over the data-parallel axes its
    parameter is replicated over: data, and expert for weights outside the experts (ZeRO-1).

    Replicas that split the batch hold the same parameters and, after the gradient all-reduce, compute the
    same update; each keeps only its slice of the moments (and fp32 master) and updates that, and the
    compiler all-gathers the new parameters. Each axis goes on the dimension with the most elements per
    shard that it divides; where it divides none, the state stays as its parameter is along that axis.
    """
    sizes = _axis_sizes(mesh_or_layout)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    names = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
    for axis in OPTIMIZER_AXES:
        ways = sizes.get(axis, 1)
        if ways == 1 or any(axis in n for n in names):
            continue
        per_shard = [dim // math.prod(sizes[a] for a in n) for dim, n in zip(shape, names)]
        fits = [i for i, n in enumerate(per_shard) if n % ways == 0]
        if fits:
            best = max(fits, key=lambda i: per_shard[i])
            names[best] = names[best] + (axis,)
    entries = [None if not n else n[0] if len(n) == 1 else n for n in names]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def activation_resolver(mesh: Mesh, rules: AxisRules | None = None) -> Callable[[ax.LogicalAxes], NamedSharding]:
    """Resolver for `axes.activation_sharding`: logical names -> NamedSharding on `mesh`."""
    table = (rules or DEFAULT_RULES).activations
    cache: dict[ax.LogicalAxes, NamedSharding] = {}

    def resolve(names: ax.LogicalAxes) -> NamedSharding:
        if names not in cache:
            cache[names] = NamedSharding(mesh, logical_to_spec(names, None, mesh, table))
        return cache[names]

    return resolve


def batch_spec(ndim: int, mesh_or_layout: Mesh | Layout, rules: AxisRules | None = None) -> PartitionSpec:
    """Spec for a batch-major input/output: leading dim "batch", the rest replicated."""
    names = (ax.BATCH,) + (None,) * (ndim - 1) if ndim else ()
    return logical_to_spec(names, None, mesh_or_layout, (rules or DEFAULT_RULES).activations)


def batch_axes(rules: AxisRules | None = None) -> tuple[str, ...]:
    """Mesh axes a batch is split over under `rules` (what `layout_misfit` checks divisibility by)."""
    return tuple((rules or DEFAULT_RULES).activations.get(ax.BATCH, ()))
