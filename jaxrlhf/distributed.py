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
        if count is not None and pid is not None:
            _check_launch(address, host, port, count, pid, dist.initialization_timeout_s)
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


# Marks a start-up claim (and is never in an answer from another program on the port, or from JAX's
# coordinator when it already runs).
_HANDSHAKE = "jaxrlhf-start/1"


def _check_launch(address: str, host: str, port: int, count: int, pid: int, timeout_s: float) -> None:
    """Compare every process's distributed.process_id and num_processes before JAX joins them.

    JAX reports a repeated id or a different count only by aborting after its initialization timeout (or
    takes process 0's count without a word). So process 0 first listens on the coordinator's port itself:
    every other process connects, says which id and count it was given, and process 0 answers all at once,
    with the first mismatch in one line or with a go-ahead; then it frees the port for JAX's coordinator
    (which the others retry until it is up)."""
    if pid == 0:
        _collect_claims(address, port, count, timeout_s)
    else:
        _send_claim(address, host, port, count, pid, timeout_s)


def _collect_claims(address: str, port: int, count: int, timeout_s: float) -> None:
    import json
    import socket
    import time

    dual = socket.has_dualstack_ipv6()  # as JAX's coordinator, which listens on [::]
    try:
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      dualstack_ipv6=dual)  # SO_REUSEADDR: a previous run's TIME_WAIT is no owner
    except OSError as e:
        raise DistributedError(
            f"distributed.coordinator_address={address}: process 0 cannot start the coordinator, port {port} "
            f"is taken on this host ({e.strerror}): another process was given distributed.process_id=0 "
            "(each process needs its own id), or another program uses the port (choose a free one)"
        ) from None
    joined = {0: "this host"}  # process id -> the host that claimed it
    conns, problem = [], None
    deadline = time.monotonic() + timeout_s
    with server:
        server.settimeout(0.5)
        while problem is None and len(joined) < count:
            if time.monotonic() >= deadline:
                missing = ", ".join(str(i) for i in range(count) if i not in joined)
                problem = (f"process 0 waited distributed.initialization_timeout_s={timeout_s} for the run's "
                           f"distributed.num_processes={count} processes; process(es) {missing} never joined: start "
                           "them with the same distributed.coordinator_address, or give every process the count "
                           "of processes you start")
                break
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            claim = _read_json(conn, timeout_s=10)
            if not isinstance(claim, dict) or claim.get("handshake") != _HANDSHAKE:
                conn.close()  # not one of ours (a port scanner, a health check): ignore it
                continue
            conns.append(conn)
            peer_host = peer[0].removeprefix("::ffff:")  # an IPv4 client of the dual-stack socket
            other, their_count = int(claim["process_id"]), int(claim["num_processes"])
            if their_count != count:
                problem = (f"distributed.num_processes differs between processes: process 0 was given {count}, "
                           f"process {other} (on {peer_host}) {their_count}; give every process the same "
                           "distributed.num_processes")
            elif other in joined:
                problem = (f"distributed.process_id={other} was given to two processes (on "
                           f"{joined[other]} and {peer_host}); give each process its own id, 0 to {count - 1}")
            joined.setdefault(other, peer_host)
        verdict = (json.dumps({"error": problem} if problem else {"ok": True}) + "\n").encode()
        for conn in conns:
            with conn:
                try:
                    conn.sendall(verdict)
                except OSError:
                    pass  # that process is gone; the others still hear the verdict
    if problem:
        raise DistributedError(problem)


def _send_claim(address: str, host: str, port: int, count: int, pid: int, timeout_s: float) -> None:
    """Process `pid` (not 0) retries until process 0 listens (an address no one listens on is reported
    here, in one line, instead of by a C++ abort when JAX gives up), then waits for its verdict."""
    import json
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=min(5.0, timeout_s))
            break
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"distributed.coordinator_address={address}: process {pid} could not reach the coordinator "
                f"within distributed.initialization_timeout_s={timeout_s} ({why}); start process 0 with the same "
                "address, and give a host:port every host can reach"
            )
        time.sleep(0.5)
    with conn:
        conn.sendall((json.dumps({"handshake": _HANDSHAKE, "process_id": pid, "num_processes": count})
                      + "\n").encode())
        verdict = _read_json(conn, timeout_s=timeout_s + 60)  # process 0 answers by its own deadline
    if not isinstance(verdict, dict) or not ("ok" in verdict or "error" in verdict):
        raise DistributedError(
            f"distributed.coordinator_address={address}: process {pid} got no start-up answer from process 0: "
            f"either the run there has all its processes already (was distributed.process_id={pid} given to two "
            "processes?), or process 0 stopped (its output says why)"
        )
    if "error" in verdict:
        raise DistributedError(str(verdict["error"]))


def _read_json(conn, timeout_s: float):
    """One JSON line from `conn` (None if the peer closed, timed out or sent something else)."""
    import json

    conn.settimeout(timeout_s)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < 4096:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        return json.loads(data.decode())
    except (OSError, ValueError):
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
