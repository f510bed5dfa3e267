"""Host values of global arrays, read alike on every process.

`host_get` reads global arrays to host the same way on every process (a
plain `device_get` fails on arrays with shards on other hosts); in a
one-process run it is `jax.device_get`. The way in, `put_host`, is in
`realloc` with the other placements of arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrlhf.transfer.realloc import reallocate


def host_get(tree: Any) -> Any:
    """Host (numpy) values of every array in `tree`, the same on every process.

    With one process this is `jax.device_get`. Otherwise the arrays of each
    mesh are replicated over it in one program (one round of collectives,
    not one per array); where that mesh has devices on every process each
    reads its local copy, otherwise (a group that lives on some hosts only)
    the replicas are copied device to device to one device of each process
    first. Call it on every process with the same tree: it runs collectives.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    # Every committed array, on every process alike: which arrays are fully addressable differs between
    # processes, and a gather one process skips would leave the others waiting in it.
    by_mesh: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and x.committed:
            leaves[i] = x = _named(x)
            by_mesh.setdefault((x.sharding.mesh, x.sharding.memory_kind), []).append(i)
    elsewhere: list[int] = []
    for (mesh, kind), idx in by_mesh.items():
        replicated = _replicate(mesh, kind, len(idx))(*[leaves[i] for i in idx])
        for i, y in zip(idx, replicated):
            leaves[i] = y
        if len({d.process_index for d in mesh.devices.flat}) < jax.process_count():
            elsewhere += idx
    if elsewhere:
        moved, _ = _to_every_process([leaves[i] for i in elsewhere])
        for i, y in zip(elsewhere, moved):
            leaves[i] = y
    out = [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) and x.committed else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, jax.device_get(out))


def _named(x: Any) -> Any:
    """`x` itself, or for a one-device array the same buffer viewed over a one-device mesh."""
    if isinstance(x.sharding, NamedSharding):
        return x
    if not isinstance(x.sharding, SingleDeviceSharding):
        raise TypeError(f"host_get reads arrays placed with a NamedSharding; got {type(x.sharding).__name__}")
    (device,) = x.sharding.device_set
    mesh = Mesh(np.array([device], dtype=object), ("one",), axis_types=(AxisType.Auto,))
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(mesh, PartitionSpec(), memory_kind=x.sharding.memory_kind),
        [s.data for s in x.addressable_shards], dtype=x.dtype)


def _identity(*xs: Any) -> tuple[Any, ...]:
    return xs


@functools.lru_cache(maxsize=None)
def _replicate(mesh: Any, memory_kind: str | None, n: int) -> Any:
    """One jitted program that replicates `n` arrays over `mesh`."""
    return jax.jit(_identity, out_shardings=(NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind),) * n)


def _to_every_process(arrays: list[Any]) -> Any:
    """Replicated arrays copied, device to device, to one device of each process."""
    firsts: dict[int, Any] = {}
    for d in jax.devices():
        firsts.setdefault(d.process_index, d)
    mesh = Mesh(np.array([firsts[p] for p in sorted(firsts)], dtype=object), ("process",),
                axis_types=(AxisType.Auto,))
    return reallocate(arrays, NamedSharding(mesh, PartitionSpec()), free_source=True)


class HostValues(dict):
    """A step's values, read to host on first access (every process reads the same keys in the same
    order, so the gathers match). For metrics and host logic that read a few of many values."""

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        host = host_get(value)
        super().__setitem__(key, host)
        return host

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default
