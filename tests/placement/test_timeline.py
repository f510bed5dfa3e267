"""The step breakdown on hand-made timelines: starts derived from device order, parts that add up to
the step, compute before move before host where they overlap; and on a real executor step."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.placement.timeline import Op, Timeline, breakdown


def _op(category, name, devices, dispatched, done, start=None, what="") -> Op:
    op = Op(category, name, frozenset(devices), dispatched, done=done, start=start, what=what)
    op.finished.set()
    return op


def test_parts_add_up_with_precedence():
    # step [0, 10]: a move on devices {0,1} 1-3, a call on {0,1} dispatched at 2 that starts when the move is
    # done (3) and ends at 7, host work 6-8 (overlaps the call for 1 s), nothing 8-10.
    move = _op("move", "actor.train", {0, 1}, 1.0, 3.0, start=1.0, what="params")
    call = _op("compute", "actor.train", {0, 1}, 2.0, 7.0, start=3.0)
    host = _op("host", "score", set(), 6.0, 8.0, start=6.0)
    t = breakdown([move, call, host], 0.0, 10.0)
    assert t.split == pytest.approx({"compute": 4.0, "move": 2.0, "host": 1.0, "other": 3.0})
    assert sum(t.split.values()) == pytest.approx(t.seconds) == 10.0
    assert t.calls["actor.train"] == pytest.approx({"run": 4.0, "wait": 1.0, "move": 2.0})
    assert t.moves == pytest.approx({"params": 2.0})
    m = t.metrics()
    assert m["time/actor.train_s"] == 4.0 and m["time/actor.train/wait_s"] == 1.0 and m["time/realloc_s"] == 2.0


def test_start_is_the_end_of_earlier_work_on_shared_devices():
    timeline = Timeline()
    gate = threading.Event()
    slow = jnp.zeros(3)

    class Pending:  # outputs that become ready when the gate opens (block_until_ready waits on it)
        def block_until_ready(self):
            gate.wait()
            return self

    first = timeline.device("compute", "a", Pending(), frozenset({0}))
    second = timeline.device("compute", "b", slow, frozenset({0, 1}))  # ready at once, but shares device 0
    other = timeline.device("compute", "c", slow, frozenset({2}))
    gate.set()
    timeline.finish([first, second, other])
    assert second.start == pytest.approx(max(second.dispatched, first.done))
    assert other.start == other.dispatched  # no shared device: starts when dispatched
    assert first.wait == 0.0 and second.wait >= 0.0


def test_an_output_donated_before_its_waiter_looks_still_finishes_the_op():
    """A later call may donate an op's output before the op's waiter thread gets to it (the optimizer state
    reloaded for a train call): the waiter's error must not leave the op unfinished, or whoever waits for
    its devices would hang (a CI worker did, until pytest's faulthandler timeout ended it)."""
    timeline = Timeline()
    donated = jnp.ones(4)
    donated.delete()  # what donation does to the Python array
    op = timeline.device("move", "actor.train", donated, frozenset({0}), what="opt_reload")
    assert op.finished.wait(timeout=60), "the op's waiter died without finishing it"
    timeline.wait_for_devices(frozenset({0}))
    timeline.finish([op])
    assert op.done is not None and op.start is not None


def test_a_waiter_reraises_errors_other_than_a_consumed_output():
    timeline = Timeline()

    class Failing:
        def block_until_ready(self):
            raise ValueError("device lost")

    seen = []
    hook, threading.excepthook = threading.excepthook, lambda args: seen.append(args.exc_value)
    try:
        op = timeline.device("compute", "a", Failing(), frozenset({0}))
        timeline.finish([op])
    finally:
        threading.excepthook = hook
    assert op.finished.is_set() and [str(e) for e in seen] == ["device lost"]


@pytest.mark.slow
def test_executor_step_explains_its_time(devices):
    """A real step (reference inference on one group, actor training on the other): the parts add up to
    the step, both calls are timed, and the values asked for come back on host."""
    from tests.placement.test_donation_offload import FEED, _executor

    executor = _executor()
    for _ in range(2):  # the first step compiles
        result = executor.step(FEED, read=("ref_mean", "loss"))
    assert isinstance(result.values["loss"], np.ndarray)  # read to host in the step's one gather
    t = result.times
    assert sum(t.split.values()) == pytest.approx(t.seconds)
    assert set(t.calls) == {"ref.inference", "actor.train"}
    assert all(c["run"] > 0 for c in t.calls.values())


@pytest.mark.slow
def test_a_launch_that_runs_the_program_counts_as_the_call(devices, monkeypatch):
    """XLA:GPU drives a while loop from the host, so there a call's launch returns only when its program
    is done: that time is the call's run (it was counted as 'other', the call as 0 s, on an H200)."""
    import time

    import jax

    from jaxrlhf.placement.calls import PlacedFunction
    from tests.placement.test_donation_offload import FEED, _executor

    executor = _executor()
    executor.step(FEED, read=("loss",))  # the first step compiles
    compiled = PlacedFunction.compiled

    def launch_runs_it(self, *args):
        program = compiled(self, *args)

        def run(*a):
            out = jax.block_until_ready(program(*a))
            time.sleep(0.3)  # the rest of a program run from the host
            return out

        return run

    monkeypatch.setattr(PlacedFunction, "compiled", launch_runs_it)
    t = executor.step(FEED, read=("loss",)).times
    assert set(t.calls) == {"ref.inference", "actor.train"}
    assert all(c["run"] >= 0.3 for c in t.calls.values())
    assert t.split["compute"] >= 0.6 and t.split["other"] < 0.3


@pytest.mark.slow
def test_calls_ready_together_move_their_inputs_before_either_runs(devices, monkeypatch):
    """Calls on disjoint groups that become ready together run side by side: every one of them has its
    inputs in place before the first is dispatched. (On CPU a move waits for the work on its source
    devices, so a move dispatched after the first call would wait for that call to finish.)"""
    import jax
    from flax import nnx

    from jaxrlhf.graph import CallGraph, CallSpec
    from jaxrlhf.models.config import preset
    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
    from tests.placement.test_donation_offload import FEED, _functions

    graph = CallGraph(
        tuple(CallSpec(f"{r}.inference", r, "inference", inputs=("tokens",), outputs=(f"{r}_mean",))
              for r in ("actor", "ref")),
        feed=("tokens",),
    )
    plan = ExecutionPlan("test", 8, {"a": DeviceGroup("a", 0, 4), "b": DeviceGroup("b", 4, 4)},
                         {"actor.inference": Placement("a", Layout(fsdp=4)),
                          "ref.inference": Placement("b", Layout(fsdp=4))})
    cache = CallCache(plan)
    graphdef, state = nnx.split(build_model(preset("tiny"), seed=0))
    roles = {r: Role(r, graphdef, jax.device_put(state, cache.placed(f"{r}.inference").param_shardings(state)))
             for r in ("actor", "ref")}
    infer = _functions(graphdef)["ref.inference"]

    def mean_logit_as(name):  # the same forward, its output named for the role that runs it
        return lambda params, inputs: {name: infer(params, inputs)["ref_mean"]}

    functions = {f"{r}.inference": mean_logit_as(f"{r}_mean") for r in ("actor", "ref")}
    executor = Executor(plan, graph, roles, cache=cache, functions=functions)
    executor.step(FEED)  # compile
    events = []
    place_inputs, run_call = executor.place_inputs, executor.run_call
    monkeypatch.setattr(executor, "place_inputs", lambda inputs, call: events.append(("place", call))
                        or place_inputs(inputs, call))
    monkeypatch.setattr(executor, "run_call", lambda spec, args: events.append(("run", spec.name))
                        or run_call(spec, args))
    result = executor.step(FEED, read=("actor_mean", "ref_mean"))
    assert events == [("place", "actor.inference"), ("place", "ref.inference"),
                      ("run", "actor.inference"), ("run", "ref.inference")]
    np.testing.assert_allclose(result.values["actor_mean"], result.values["ref_mean"], rtol=1e-6)
