"""Start-up settings of multi-process runs: config keys, the launchers' environment variables, and
one-line errors for what is missing or inconsistent (no processes are started here)."""

from __future__ import annotations

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import distributed
from jaxrlhf.transfer import processes


def _dist(*keys: str) -> cfglib.DistributedConfig:
    return cfglib.load_config(None, ["run.distributed=true", *keys]).distributed


def test_config_keys_win_over_environment(monkeypatch):
    monkeypatch.setenv("JAXRLHF_PROCESS_ID", "1")
    monkeypatch.setenv("JAXRLHF_COORDINATOR", "10.0.0.1:1234")
    dist = _dist("distributed.process_id=0")
    assert distributed._setting(dist, "process_id") == 0
    assert distributed._setting(dist, "coordinator_address") == "10.0.0.1:1234"
    assert distributed._setting(dist, "num_processes") is None


def test_environment_values_are_checked(monkeypatch):
    monkeypatch.setenv("JAXRLHF_NUM_PROCESSES", "two")
    with pytest.raises(distributed.DistributedError, match="JAXRLHF_NUM_PROCESSES='two' .*distributed.num_processes"):
        distributed._setting(cfglib.DistributedConfig(), "num_processes")


def test_process_id_must_be_below_the_count():
    dist = _dist("distributed.num_processes=2", "distributed.process_id=2")
    with pytest.raises(distributed.DistributedError, match="process_id=2 must be below .*num_processes=2"):
        distributed.initialize(dist, "cpu")


def test_keys_are_validated():
    with pytest.raises(cfglib.ConfigError, match="distributed.num_processes"):
        cfglib.load_config(None, ["distributed.num_processes=0"])


def test_one_process_helpers_do_nothing():
    processes.barrier("nothing to wait for")
    assert processes.any_process(False) is False and processes.any_process(True) is True
    assert processes.is_main()


@pytest.mark.parametrize("address", ["localhost", "10.0.0.1:", ":47600", "10.0.0.1:http", "10.0.0.1:70000"])
def test_coordinator_address_without_a_port_is_one_line(address):
    dist = _dist(f"distributed.coordinator_address={address}", "distributed.num_processes=2",
                 "distributed.process_id=1")
    with pytest.raises(distributed.DistributedError, match=r"distributed.coordinator_address=.* must be host:port"):
        distributed.initialize(dist, "cpu")


def test_unreachable_coordinator_is_one_line_naming_the_key():
    """Nothing listens on the port: process 1 says so after distributed.initialization_timeout_s (instead of
    JAX's C++ abort when it gives up)."""
    import socket
    import time

    with socket.socket() as s:  # a port that was free a moment ago, and that no one listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist = _dist(f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                 "distributed.process_id=1", "distributed.initialization_timeout_s=1")
    t0 = time.monotonic()
    with pytest.raises(distributed.DistributedError, match=rf"distributed.coordinator_address=127.0.0.1:{port}: "
                                                           r"process 1 could not reach the coordinator within "
                                                           r"distributed.initialization_timeout_s=1 \(.*refused"):
        distributed.initialize(dist, "cpu")
    assert time.monotonic() - t0 < 10


def test_distributed_keys_without_run_distributed_are_refused():
    """Otherwise each process would train alone into the same output folder."""
    keys = ["distributed.num_processes=2", "distributed.process_id=1"]
    with pytest.raises(cfglib.ConfigError, match=r"distributed.num_processes, distributed.process_id set, but "
                                                 r"run.distributed=false: .* Add run.distributed=true"):
        cfglib.load_config(None, keys)
    assert _dist(*keys).num_processes == 2


def test_mpi_collectives_with_several_devices_per_process_are_refused():
    """XLA:CPU's MPI collectives create communicators from the MPI thread only ("Multiple threads/devices
    per process are not yet supported"): refused at load time, not at the first collective."""
    with pytest.raises(cfglib.ConfigError, match=r"distributed.cpu_collectives=mpi with run.devices=4: .* "
                                                 r"set run.devices=1"):
        cfglib.load_config(None, ["run.distributed=true", "distributed.cpu_collectives=mpi", "run.devices=4"])
    ok = cfglib.load_config(None, ["run.distributed=true", "distributed.cpu_collectives=mpi", "run.devices=1"])
    assert ok.distributed.cpu_collectives == "mpi"


def test_a_second_process_0_is_one_line():
    """Two processes given distributed.process_id=0 on one host: the second finds the coordinator's port
    taken (here by a socket that stands for the first) and says so, instead of JAX's abort after 300 s."""
    import socket

    with socket.socket() as first:
        first.bind(("", 0))
        first.listen()
        port = first.getsockname()[1]
        dist = _dist(f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                     "distributed.process_id=0")
        with pytest.raises(distributed.DistributedError, match=rf"process 0 cannot start the coordinator, port {port} "
                                                               r"is taken .*another process was given "
                                                               r"distributed.process_id=0"):
            distributed.initialize(dist, "cpu")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_check(port: int, claims: list[tuple[int, int]], timeout_s: float = 30) -> list[str]:
    """`distributed._check_launch` of processes given (process_id, num_processes), each in a thread;
    what each one raised ("" for a go-ahead). Process 0 starts first, as it listens."""
    import threading
    import time

    said = [""] * len(claims)

    def one(i, pid, count):
        try:
            distributed._check_launch(f"127.0.0.1:{port}", "127.0.0.1", port, count, pid, timeout_s)
        except distributed.DistributedError as e:
            said[i] = str(e)

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(claims)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=timeout_s + 70)
    return said


def test_launch_parameters_are_compared_before_jax_joins_the_processes():
    """Process 0 collects every process's id and count on the coordinator's port: a repeated id or
    different counts end every process at once with the same line (JAX would abort after its 300 s
    initialization timeout); a process missing after distributed.initialization_timeout_s is named."""
    assert _launch_check(free_port(), [(0, 2), (1, 2)]) == ["", ""]
    dup = "distributed.process_id=1 was given to two processes (on 127.0.0.1 and 127.0.0.1); give each process " \
          "its own id, 0 to 2"
    assert _launch_check(free_port(), [(0, 3), (1, 3), (1, 3)]) == [dup] * 3
    counts = "distributed.num_processes differs between processes: process 0 was given 3, process 1 (on " \
             "127.0.0.1) 2; give every process the same distributed.num_processes"
    assert _launch_check(free_port(), [(0, 3), (1, 2)]) == [counts] * 2
    missing = _launch_check(free_port(), [(0, 3), (1, 3)], timeout_s=1)
    assert missing[0] == missing[1] and "process(es) 2 never joined" in missing[0], missing
