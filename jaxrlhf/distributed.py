"""Starting a multi-process (multi-host) run on JAX's multi-controller runtime.

`initialize`: `jax.distributed.initialize` from the `distributed` config
section, the JAXRLHF_* variables the launchers set, or JAX's own cluster
detection (Cloud TPU, SLURM), before any device is touched. On CPU it also
turns on gloo collectives and gives each process its own loopback port for
cross-process device-to-device copies. What differs between processes once
they run (who writes, barriers, host reads) is in `jaxrlhf.transfer`.
"""

from __future__ import annotations

import os
from typing import Any

from jaxrlhf import jax_private
from jaxrlhf.transfer.processes import DistributedError

# Environment variables the launchers in scripts/ set (one per config key they stand for).
ENV_KEYS = {
    "coordinator_address": "JAXRLHF_COORDINATOR",
    "num_processes": "JAXRLHF_NUM_PROCESSES",
    "process_id": "JAXRLHF_PROCESS_ID",
}


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
        port = dist.transfer_port_base + jax_private.process_id()
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
