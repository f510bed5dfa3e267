"""Logical axis names: the only thing `models/` knows about placement.

Every parameter carries a `logical_axes` tuple in its metadata; activations
are annotated with `constrain(x, names)`. The placement layer
(`jaxrlhf.placement.layout`) turns names into `PartitionSpec`s by installing a resolver with
`activation_sharding(...)` while a call is traced. Outside such a context
`constrain` is the identity, so models run unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
from flax import nnx

# Parameter axes.
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP = "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"
# The experts of a mixture-of-experts MLP (`moe.py`): its stacked expert weights [expert, embed, mlp] and
# router [embed, expert]. Placement maps it to the "expert" mesh axis (expert parallelism; a layout's
# `expert` degree), whose size `expert_ways` tells the sparse MLP.
EXPERT = "expert"
# The leading axis of the stacked decoder-layer parameters and KV cache (the axis the layer scan runs over).
LAYERS = "layers"
# Activation axes. STAGE is the leading axis of a pipeline's per-stage activations (see `pipeline.py`).
BATCH, LENGTH, STAGE = "batch", "length", "stage"

LogicalAxes = tuple[str | None, ...]
Resolver = Callable[[LogicalAxes], Any]  # logical names -> jax.sharding.Sharding (or None)

_resolver: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("axis_resolver", default=None)


@contextlib.contextmanager
def activation_sharding(resolver: Resolver | None) -> Iterator[None]:
    """Make `constrain` emit sharding constraints while tracing inside this block."""
    token = _resolver.set(resolver)
    try:
        yield
    finally:
        _resolver.reset(token)


def constrain(x: jax.Array, names: LogicalAxes) -> jax.Array:
    """Annotate an activation with logical axes (identity without a resolver)."""
    resolver = _resolver.get()
    if resolver is None:
        return x
    sharding = resolver(names)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def resolved(names: LogicalAxes) -> Any:
    """The sharding the current resolver gives an activation with logical axes `names` (None without a
    resolver)."""
    resolver = _resolver.get()
    return None if resolver is None else resolver(names)


def _ways(name: str) -> int:
    """How many shards the activation axis `name` has under the current resolver (1 without one)."""
    sharding = resolved((name,))
    if sharding is None or not hasattr(sharding, "spec") or not sharding.spec:
        return 1
    names = sharding.spec[0]
    names = () if names is None else names if isinstance(names, tuple) else (names,)
    ways = 1
    for n in names:
        ways *= sharding.mesh.shape[n]
    return ways


def batch_ways() -> int:
    """How many shards the batch axis of activations has under the current resolver (1 without one):
    what a batch dimension created inside a traced call must be a multiple of."""
    return _ways(BATCH)


def length_ways() -> int:
    """How many devices the length axis of activations is split over under the current resolver (1
    without one): the context-parallel degree. Above 1, attention without a KV cache runs as ring
    attention (`context.ring_attention`), which finds the mesh and its axes through `resolved`."""
    return _ways(LENGTH)


def expert_ways() -> int:
    """How many devices a mixture of experts' experts are split over under the current resolver (1 without
    one): the expert-parallel degree. Above 1, `moe.SparseMLP` runs each device's own experts
    (`moe.expert_parallel`), which finds the mesh and its axis through `resolved`."""
    return _ways(EXPERT)


def param_logical_axes(tree: Any) -> Any:
    """Pytree of logical-axis tuples matching `nnx.state(model)` (or a sub-state).

    Variables without `logical_axes` metadata are treated as replicated.
    """

    def axes_of(v):
        if isinstance(v, nnx.Variable):
            meta = v.get_metadata()
            return meta.get("logical_axes", (None,) * v.value.ndim)
        return (None,) * getattr(v, "ndim", 0)

    return jax.tree_util.tree_map(axes_of, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
