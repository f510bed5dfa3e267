"""Multi-process (multi-host) runs on JAX's multi-controller runtime.

Every process runs the same program: the same calls, compilations and
collectives in the same order. This module holds
the few things that differ from a one-process run:

- `initialize`: `jax.distributed.initialize` from the `distributed` config
  section, the JAXRLHF_* variables the launchers set, or JAX's own cluster
  detection (Cloud TPU, SLURM), before any device is touched. On CPU it also
  turns on gloo collectives and gives each process its own loopback port for
  cross-process device-to-device copies;
- `host_get`: host values of global arrays, gathered the same way on every
  process (a plain `device_get` fails on arrays with shards on other hosts);
- `barrier`: the coordination service's barrier, used after every
  cross-process copy so no process runs ahead into the next collective;
- `is_main`: the one process that logs and writes files.
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Any

# Environment variables the launchers in scripts/ set (one per config key they stand for).
ENV_KEYS = {
    "coordinator_address": "JAXRLHF_COORDINATOR",
    "num_processes": "JAXRLHF_NUM_PROCESSES",
    "process_id": "JAXRLHF_PROCESS_ID",
}
BARRIER_TIMEOUT_S = 600  # a process that does not reach a barrier in this time is stuck or dead

_barriers = itertools.count()


class DistributedError(RuntimeError):
    """The processes of a run could not start together or one of them failed; the message says which
    setting to change or which process to look at."""


def _setting(dist: Any, key: str) -> Any:
    """A `distributed.<key>` value: the config's, else its launcher environment variable, else None."""
    value = getattr(dist, key)
    if value is not None:
        return value
    text = os.environ.get(ENV_KEYS[key])
    if text is None or text == "":
        return None
    if key == "coordinator_address":
        return text
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{ENV_KEYS[key]}={text!r} is not a whole number (it stands for distributed.{key})")


def initialize(dist: Any, platform: str) -> None:
    """Join the run's other processes (`run.distributed=true`). Must run before any JAX backend starts.

    Unset keys are left to JAX's cluster detection; when that finds nothing, the error names the keys."""
    import jax
    from jax._src import distributed as jax_distributed

    address, count, pid = (_setting(dist, k) for k in ("coordinator_address", "num_processes", "process_id"))
    if count is not None and pid is not None and not 0 <= pid < count:
        raise DistributedError(f"distributed.process_id={pid} must be below distributed.num_processes={count}")
    if address is not None:
        host, port = _host_port(address)
        if pid not in (None, 0):
            _wait_for_coordinator(address, host, port, pid, dist.initialization_timeout_s)
        elif pid == 0:
            _check_port_free(address, port)
    cpu = platform == "cpu" or (platform == "auto" and os.environ.get("JAX_PLATFORMS", "") == "cpu")
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", dist.cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count, process_id=pid,
            initialization_timeout=dist.initialization_timeout_s,
            heartbeat_timeout_seconds=dist.heartbeat_timeout_s,
        )
    except (RuntimeError, ValueError, TypeError) as e:
        missing = [f"distributed.{k}" for k, v in
                   (("coordinator_address", address), ("num_processes", count), ("process_id", pid)) if v is None]
        if missing:
            raise DistributedError(
                f"run.distributed=true, but no cluster was detected and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set ({_first_line(e)}); set them (or "
                f"{', '.join(ENV_KEYS[m.split('.')[1]] for m in missing)}), run under SLURM or on a Cloud TPU "
                "slice, or set run.distributed=false for one process"
            ) from None
        raise DistributedError(
            f"run.distributed=true, but process {pid} could not join the coordinator at {address} within "
            f"distributed.initialization_timeout_s={dist.initialization_timeout_s} ({_first_line(e)}); start "
            f"all {count} processes with the same distributed.coordinator_address, reachable from every host"
        ) from None
    if cpu:
        # A distinct, fixed loopback port per process: with 0.0.0.0:0 a receiver was seen to hang.
        port = dist.transfer_port_base + jax_distributed.global_state.process_id
        jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{port}")
    if count is not None and jax.process_count() != count:  # the coordinator's count wins without a word
        raise DistributedError(
            f"distributed.num_processes={count} on process {jax.process_index()}, but process 0 started the run "
            f"with {jax.process_count()}; give every process the same distributed.num_processes"
        )


def _host_port(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6 address]:port`) split and checked, so a mistake is one line naming the key
    instead of an IndexError from inside JAX."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"distributed.coordinator_address={address!r} must be host:port (process 0's host and a free port, "
            "e.g. 10.0.0.1:47600)"
        )
    return host, int(port)


def _check_port_free(address: str, port: int) -> None:
    """Process 0 starts the coordinator on `port`: taken already, it is most often a second process 0 of
    the same run (a repeated distributed.process_id), which JAX would report only after its timeout."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a previous run's TIME_WAIT is no owner
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(
                f"distributed.coordinator_address={address}: process 0 cannot start the coordinator, port {port} "
                f"is taken on this host ({e.strerror}): another process was given distributed.process_id=0 "
                "(each process needs its own id), or another program uses the port (choose a free one)"
            ) from None


def _wait_for_coordinator(address: str, host: str, port: int, pid: int, timeout_s: float) -> None:
    """Process `pid` (not 0) waits until the coordinator's port accepts connections: an address no one
    listens on is reported here, in one line, instead of by a C++ abort when JAX gives up."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"distributed.coordinator_address={address}: process {pid} could not reach the coordinator "
                f"within distributed.initialization_timeout_s={timeout_s} ({why}); start process 0 with the same "
                "address, and give a host:port every host can reach"
            )
        time.sleep(0.5)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def process_count() -> int:
    import jax

    return jax.process_count()


def is_main() -> bool:
    """The process that prints progress and writes logs, metrics and exported files."""
    import jax

    return jax.process_index() == 0


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process reaches this point (no-op with one process). Every process must call
    barriers in the same order; each call gets a fresh id, so the same `name` can be used again."""
    import jax
    from jax._src import distributed as jax_distributed

    if jax.process_count() == 1:
        return
    client = jax_distributed.global_state.client
    barrier_id = f"jaxrlhf/{name}/{next(_barriers)}"
    try:
        client.wait_at_barrier(barrier_id, int(timeout_s * 1000))
    except Exception as e:  # the coordination service reports a missing peer as a generic error
        raise DistributedError(
            f"process {jax.process_index()} stopped waiting for another process at {name!r} "
            f"({_first_line(e)}); a process failed, was killed or is stuck: its output has the first error"
        ) from None


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a signal may reach only some hosts, but the
    checkpoint it asks for is a collective all must join)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def agreed_steps(steps: list[int]) -> list[int]:
    """The checkpoint steps every process lists (the same list on each), so all try the same steps in
    the same order when they look for one to resume from."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(steps)
    longest = int(np.max(multihost_utils.process_allgather(np.array(len(steps)))))
    padded = np.full(max(longest, 1), -1, np.int64)
    padded[: len(steps)] = steps
    lists = multihost_utils.process_allgather(padded)
    common = set(steps)
    for row in np.asarray(lists).reshape(-1, padded.size):
        common &= {int(s) for s in row if s >= 0}
    return sorted(common)


def host_get(tree: Any) -> Any:
    """Host (numpy) values of every array in `tree`, the same on every process.

    With one process this is `jax.device_get`. Otherwise the arrays of each
    mesh are replicated over it in one program (one round of collectives,
    not one per array); where that mesh has devices on every process each
    reads its local copy, otherwise (a group that lives on some hosts only)
    the replicas are copied device to device to one device of each process
    first. Call it on every process with the same tree: it runs collectives.
    """
    import jax

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
    import numpy as np

    out = [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) and x.committed else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, jax.device_get(out))


def _named(x: Any) -> Any:
    """`x` itself, or for a one-device array the same buffer viewed over a one-device mesh."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

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
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(_identity, out_shardings=(NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind),) * n)


def _to_every_process(arrays: list[Any]) -> Any:
    """Replicated arrays copied, device to device, to one device of each process."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    from jaxrlhf.placement.realloc import reallocate

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
