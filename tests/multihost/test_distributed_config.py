"""Start-up settings of multi-process runs: config keys, the launchers' environment variables, and
one-line errors for what is missing or inconsistent (no processes are started here)."""

from __future__ import annotations

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import distributed


def test_config_keys_win_over_environment(monkeypatch):
    monkeypatch.setenv("JAXRLHF_PROCESS_ID", "1")
    monkeypatch.setenv("JAXRLHF_COORDINATOR", "10.0.0.1:1234")
    dist = cfglib.load_config(None, ["distributed.process_id=0"]).distributed
    assert distributed._setting(dist, "process_id") == 0
    assert distributed._setting(dist, "coordinator_address") == "10.0.0.1:1234"
    assert distributed._setting(dist, "num_processes") is None


def test_environment_values_are_checked(monkeypatch):
    monkeypatch.setenv("JAXRLHF_NUM_PROCESSES", "two")
    with pytest.raises(distributed.DistributedError, match="JAXRLHF_NUM_PROCESSES='two' .*distributed.num_processes"):
        distributed._setting(cfglib.DistributedConfig(), "num_processes")


def test_process_id_must_be_below_the_count():
    dist = cfglib.load_config(None, ["distributed.num_processes=2", "distributed.process_id=2"]).distributed
    with pytest.raises(distributed.DistributedError, match="process_id=2 must be below .*num_processes=2"):
        distributed.initialize(dist, "cpu")


def test_keys_are_validated():
    with pytest.raises(cfglib.ConfigError, match="distributed.num_processes"):
        cfglib.load_config(None, ["distributed.num_processes=0"])


def test_one_process_helpers_do_nothing():
    distributed.barrier("nothing to wait for")
    assert distributed.any_process(False) is False and distributed.any_process(True) is True
    assert distributed.is_main()
