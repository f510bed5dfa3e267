"""Host values of global arrays, read alike on every process.

`host_get` reads global arrays to host the same way on every process (a
plain `device_get` fails on arrays with shards on other hosts); in a
one-process run it is `jax.device_get`. The way in, `put_host`, is in
`realloc` with the other placements of arrays.

Values that live on some processes only (a device group on one host) reach
the others through the coordination service's key-value store when they are
small (metrics, rewards, sampled tokens: up to `KV_BYTES` per read), and
device to device otherwise. A device-to-device copy across processes is a
transfer followed by a barrier, and measured on 2 x 4 CPU devices it was a
third of an interleaved step; a key-value read is one message, and only the
processes that need the values wait for it.
"""

from __future__ import annotations

import functools
import io
import itertools
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrlhf import jax_private
from jaxrlhf.transfer.processes import BARRIER_TIMEOUT_S, DistributedError
from jaxrlhf.transfer.realloc import reallocate

KV_BYTES = 1 << 20  # values of one read up to this size travel through the key-value store
_reads = itertools.count()  # every process reads in the same order, so the n-th read has one key everywhere


def host_get(tree: Any) -> Any:
    """Host (numpy) values of every array in `tree`, the same on every process.

    With one process this is `jax.device_get`. Otherwise the arrays of each
    mesh with devices on several processes are replicated over it in one
    program (one round of collectives, not one per array) and each of its
    processes reads its local copy; a mesh on one process is read there
    directly. Processes that hold none of an array (a group that lives on
    some hosts only) get its value through the key-value store (small reads)
    or device to device. Call it on every process with the same tree: it
    runs collectives.
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
    owners = {i: frozenset(d.process_index for d in leaves[i].sharding.mesh.devices.flat)
              for idx in by_mesh.values() for i in idx}  # leaf -> the processes that hold it
    elsewhere = [i for i in owners if len(owners[i]) < jax.process_count()]
    small = sum(leaves[i].nbytes for i in elsewhere) <= KV_BYTES
    for (mesh, kind), idx in by_mesh.items():
        # Shards on several processes: one program gathers them. A group on one process needs none when
        # the key-value store carries its values (its process reads the shards itself; on CPU even a
        # collective between the devices of one process is a gloo message in a multi-process run).
        if len(owners[idx[0]]) > 1 or not small:
            for i, y in zip(idx, _replicate(mesh, kind, len(idx))(*[leaves[i] for i in idx])):
                leaves[i] = y
    if elsewhere and small:
        _share_small(leaves, elsewhere, owners)
    elif elsewhere:
        moved, _ = _to_every_process([leaves[i] for i in elsewhere])  # frees the replicas made above
        for i, y in zip(elsewhere, moved):
            leaves[i] = y
    out = [_local_value(x) if isinstance(x, jax.Array) and x.committed else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, jax.device_get(out))


def _local_value(x: jax.Array) -> np.ndarray:
    """The host value of an array this process holds whole: one replica, or all shards of a group that
    lives on this process alone."""
    return np.asarray(x.addressable_data(0)) if x.is_fully_replicated else np.asarray(jax.device_get(x))


def _share_small(leaves: list[Any], elsewhere: list[int], owners: dict[int, frozenset[int]]) -> None:
    """Replace the replicated arrays `leaves[i]` (i in `elsewhere`) by their host values on every process:
    the lowest process holding them writes them to the key-value store, each process holding none reads
    them, and the last reader deletes the entry (a counter of reads), so nothing accumulates over a run."""
    me = jax.process_index()
    client = jax_private.coordination_client()
    groups: dict[frozenset[int], list[int]] = {}
    for i in elsewhere:
        groups.setdefault(owners[i], []).append(i)
    read = next(_reads)
    for holders, idx in sorted(groups.items(), key=lambda kv: sorted(kv[0])):
        writer, key = min(holders), f"jaxrlhf/host_get/{read}/{min(holders)}-{len(holders)}"
        if me in holders:
            values = [_local_value(leaves[i]) for i in idx]
            if me == writer:
                buffer = io.BytesIO()
                np.savez(buffer, *values)
                client.key_value_set_bytes(key, buffer.getvalue())
        else:
            try:
                data = client.blocking_key_value_get_bytes(key, int(BARRIER_TIMEOUT_S * 1000))
            except Exception as e:  # the coordination service reports a dead writer as a generic error
                raise DistributedError(
                    f"process {me} waited in vain for host values from process {writer} ({str(e).strip()[:200]});"
                    " that process failed, was killed or is stuck: its output has the first error") from None
            with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
                values = [arrays[f"arr_{k}"] for k in range(len(idx))]
            if client.key_value_increment(key + "/reads", 1) == jax.process_count() - len(holders):
                client.key_value_delete(key + "/reads")
                client.key_value_delete(key)
        for i, v in zip(idx, values):
            leaves[i] = v


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
