"""`transfer.processes` in a one-process run: every helper is the obvious answer and none of them
talks to a coordination service (there is none; the stand-in below fails the test if asked)."""

from __future__ import annotations

import pytest

from jaxrlhf import jax_private
from jaxrlhf.transfer import processes


@pytest.fixture(autouse=True)
def no_coordination_service(monkeypatch):
    def refuse():
        raise AssertionError("a one-process helper asked for the coordination service")

    monkeypatch.setattr(jax_private, "coordination_client", refuse)


def test_is_main():
    assert processes.is_main() is True


def test_barrier_returns_at_once_and_can_be_reached_again():
    for _ in range(3):
        assert processes.barrier("same name") is None
    assert processes.barrier("short timeout", timeout_s=0.001) is None


@pytest.mark.parametrize("flag", [False, True])
def test_any_process_is_this_processs_flag(flag):
    assert processes.any_process(flag) is flag
    assert processes.any_process_at("agreement", flag) is flag


def test_main_values_are_this_processs_values_unrounded():
    values = [0.1, 1e-9, 123456789.125, -2.0]  # none survives a float32 round trip exactly but -2.0
    got = processes.main_values(values)
    assert got == values and got is not values
    assert processes.main_values([]) == []


def test_main_text_runs_make_once_and_returns_its_text():
    calls = []

    def make():
        calls.append(1)
        return "plan: colocated\n"

    assert processes.main_text("plan", make) == "plan: colocated\n"
    assert calls == [1]


def test_main_text_raises_makes_own_error():
    def make():
        raise ValueError("search failed")

    with pytest.raises(ValueError, match="search failed"):
        processes.main_text("plan", make)


def test_agreed_steps_are_this_processs_steps():
    steps = [10, 20, 30]
    got = processes.agreed_steps(steps)
    assert got == [10, 20, 30] and got is not steps
    assert processes.agreed_steps([]) == []


def test_post_is_a_no_op():
    assert processes.post("key", "text") is None
