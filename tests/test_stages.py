"""The stage loop (`run.stages`): step numbering and random keys, resume windows, the off-policy
feed, the `around`/`after` hooks; the data check before a run; the warm-up's plan.

`run_steps` is driven with stand-ins for the algorithm, executor and data stream that record what
they were given, so every expectation below is counted by hand: no model, no compile."""

from __future__ import annotations

import collections
import contextlib
import functools

import jax
import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.data.sources import DataError
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
from jaxrlhf.run.stages import open_checked_data, run_steps, warmup_plan


class Stream:
    """Batch i is the integer i; the state is how many batches were drawn."""

    def __init__(self, pos: int = 0):
        self.pos = pos

    def next_batch(self) -> int:
        self.pos += 1
        return self.pos - 1

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def metrics(self) -> dict:
        return {"data/pos": self.pos}


class Algorithm:
    """Draws its batches as the step graph's rollout does (`rollouts.graph`: the feed as drawn)."""

    @functools.cached_property
    def rollout(self):
        from jaxrlhf.rollouts.graph import GraphRollout

        return GraphRollout(self)

    def feed(self, batch, key):
        return {"batch": batch, "key": key}

    def metric_values(self):
        return ("batch",)

    def metrics(self, result):
        return {"batch": result.values["batch"], "ran_on": result.values["executor"],
                **({"staleness": result.values["staleness"]} if result.values["staleness"] else {})}


class Result:
    def __init__(self, values):
        self.values = values

    def metrics(self):
        return {"time/step_s": 0.25}


class Executor:
    """Records each step's (feed, ahead, read) and, as the real one does, trains the oldest rollout
    started ahead, else the step's own feed; the rollouts in `ahead` start after this step's training
    is dispatched and before its weights reach the generator, so they carry the update count the
    generator holds then (`updates` before this step's)."""

    def __init__(self, name: str = "first", log: list | None = None):
        self.name, self.calls, self.log = name, [], log if log is not None else []
        self.pending: collections.deque = collections.deque()
        self.updates = 0  # weight updates the trainer made so far
        self.trained: list[tuple[int, int]] = []  # (batch, updates of the policy that generated it)

    def step(self, feed, ahead=(), read=(), overlap=None):
        self.calls.append((feed, tuple(f["batch"] for f in ahead), tuple(read)))
        batch, version = self.pending.popleft() if self.pending else (feed["batch"], self.updates)
        assert batch == feed["batch"]  # the loop hands each step the feed of the rollout it trains
        self.trained.append((batch, version))
        self.pending.extend((f["batch"], self.updates) for f in ahead)
        self.updates += 1
        self.log.append(("step", self.name, batch))
        return Result({"batch": batch, "executor": self.name, "staleness": self.updates - 1 - version})


RNG = jax.random.key(11)


def key_of(step: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.fold_in(RNG, step)))


def same_key(a, b) -> bool:
    return np.array_equal(np.asarray(jax.random.key_data(a)), np.asarray(jax.random.key_data(b)))


def test_steps_are_numbered_from_one_and_each_draws_its_own_key_and_batch():
    ex, data = Executor(), Stream()
    out = list(run_steps(Algorithm(), ex, data, RNG, 0, 3))
    assert [s for s, _, _ in out] == [1, 2, 3]
    assert [m["batch"] for _, m, _ in out] == [0, 1, 2]
    for step, (feed, next_feed, read) in enumerate(ex.calls, start=1):
        assert np.array_equal(np.asarray(jax.random.key_data(feed["key"])), key_of(step))
        assert next_feed == () and read == ("batch",)
    # the algorithm's metrics, the executor result's and the stream's, merged
    _, m, _ = out[0]
    assert m == {"batch": 0, "ran_on": "first", "time/step_s": 0.25, "data/pos": 1}
    # the position yielded with a step is where a run resumed from that step continues
    assert [d for _, _, d in out] == [{"pos": 1}, {"pos": 2}, {"pos": 3}]


def test_a_resumed_window_continues_the_same_steps_keys_and_batches():
    whole_ex = Executor()
    whole = list(run_steps(Algorithm(), whole_ex, Stream(), RNG, 0, 5))
    # stop after step 2 (the checkpoint), then resume from what step 2 yielded
    first = list(run_steps(Algorithm(), Executor(), Stream(), RNG, 0, 2))
    resumed_data = Stream()
    resumed_data.load_state_dict(first[-1][2])
    resumed_ex = Executor()
    rest = list(run_steps(Algorithm(), resumed_ex, resumed_data, RNG, 2, 5))
    assert [s for s, _, _ in rest] == [3, 4, 5]
    assert [m["batch"] for _, m, _ in first + rest] == [m["batch"] for _, m, _ in whole] == [0, 1, 2, 3, 4]
    for (feed, _, _), (want, _, _) in zip(resumed_ex.calls, whole_ex.calls[2:]):
        assert same_key(feed["key"], want["key"])


def test_start_equal_to_stop_runs_nothing_and_draws_nothing():
    ex, data = Executor(), Stream(pos=7)
    assert list(run_steps(Algorithm(), ex, data, RNG, 4, 4)) == []
    assert ex.calls == [] and data.pos == 7


def test_offpolicy_feeds_the_next_batch_with_this_one_and_draws_each_batch_once():
    on_ex, off_ex, off_data = Executor(), Executor(), Stream()
    on = list(run_steps(Algorithm(), on_ex, Stream(), RNG, 0, 3))
    off = list(run_steps(Algorithm(), off_ex, off_data, RNG, 0, 3, staleness=1))
    # the same steps, batches and resume positions as on-policy; 3 steps draw 3 batches
    assert [(s, m["batch"], d) for s, m, d in off] == [(s, m["batch"], d) for s, m, d in on]
    assert off_data.pos == 3
    feeds = [(f["batch"], ahead) for f, ahead, _ in off_ex.calls]
    assert feeds == [(0, (1,)), (1, (2,)), (2, ())]  # the last step has no next step to start
    for step, (feed, _, _) in enumerate(off_ex.calls, start=1):  # each feed is built with its step's key
        assert np.array_equal(np.asarray(jax.random.key_data(feed["key"])), key_of(step))
    assert [m["rollout/staleness"] for _, m, _ in off] == [0.0, 1.0, 1.0]
    assert [m["rollout/policy_version"] for _, m, _ in off] == [0.0, 0.0, 1.0]
    assert "rollout/staleness" not in on[0][1]


def test_offpolicy_resumed_window_starts_from_its_own_batch():
    data = Stream(pos=2)  # a run resumed after step 2
    ex = Executor()
    out = list(run_steps(Algorithm(), ex, data, RNG, 2, 4, staleness=1))
    assert [(s, m["batch"]) for s, m, _ in out] == [(3, 2), (4, 3)]
    assert [ahead for _, ahead, _ in ex.calls] == [(3,), ()]


@pytest.mark.parametrize("eta", [1, 2, 3, 5])
def test_staleness_never_exceeds_eta_and_every_batch_trains_once_in_order(eta):
    """Random run lengths and resume points: the generator runs up to eta steps ahead (the staleness
    of a trained rollout, counted independently by the stand-in executor, is at most eta and reaches
    eta in steady state), every batch is trained exactly once and in order across resumes, and the
    loop's staleness metrics agree with the executor's count."""
    rng = np.random.default_rng(eta)
    for _ in range(20):
        stop = int(rng.integers(1, 3 * eta + 4))
        cuts = sorted(set(int(c) for c in rng.integers(0, stop, size=int(rng.integers(0, 3)))))
        data, trained, seen = Stream(), [], []
        for lo, hi in zip([0, *cuts], [*cuts, stop]):
            if lo == hi:
                continue
            ex = Executor()  # a resumed run starts a fresh executor: nothing in flight
            resumed = Stream()
            resumed.load_state_dict(data.state_dict())
            data = resumed
            out = list(run_steps(Algorithm(), ex, data, RNG, lo, hi, staleness=eta))
            resumed.load_state_dict(out[-1][2])  # where the checkpoint of the window's last step continues
            trained += [b for b, _ in ex.trained]
            for (step, m, _), (feed, ahead, _) in zip(out, ex.calls):
                assert m["rollout/staleness"] == m.get("staleness", 0) <= eta
                assert all(step < b + 1 <= min(step + eta, hi) for b in ahead)  # admission pacing
                seen.append(m["rollout/staleness"])
        assert trained == list(range(stop))
    assert max(seen) == eta


def test_around_wraps_each_executor_step():
    log: list = []

    @contextlib.contextmanager
    def around(step):
        log.append(("enter", step))
        yield
        log.append(("exit", step))

    list(run_steps(Algorithm(), Executor(log=log), Stream(), RNG, 1, 3, around=around))
    assert log == [("enter", 2), ("step", "first", 0), ("exit", 2),
                   ("enter", 3), ("step", "first", 1), ("exit", 3)]


def test_after_adds_metrics_and_can_switch_the_executor_for_the_next_steps():
    log: list = []
    second = Executor("second", log)
    seen = []

    def after(step, metrics, executor):
        seen.append((step, executor.name))
        metrics["after/step"] = step
        return second if step == 2 else executor

    out = list(run_steps(Algorithm(), Executor("first", log), Stream(), RNG, 0, 4, after=after))
    assert seen == [(1, "first"), (2, "first"), (3, "second"), (4, "second")]
    assert [(m["ran_on"], m["after/step"]) for _, m, _ in out] == [
        ("first", 1), ("first", 2), ("second", 3), ("second", 4)]
    # the data stream goes on unchanged across the switch
    assert [m["batch"] for _, m, _ in out] == [0, 1, 2, 3]
    assert [(name, b) for _, name, b in log] == [("first", 0), ("first", 1), ("second", 2), ("second", 3)]


def test_after_runs_before_the_step_is_yielded():
    order = []

    def after(step, metrics, executor):
        order.append(("after", step))
        return executor

    for step, _, _ in run_steps(Algorithm(), Executor(), Stream(), RNG, 0, 2, after=after):
        order.append(("yield", step))
    assert order == [("after", 1), ("yield", 1), ("after", 2), ("yield", 2)]


# ---- open_checked_data ---------------------------------------------------------------------

def _open(*overrides: str):
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.models.tokenizer import load_tokenizer

    cfg = cfglib.load_config(None, list(overrides))
    return open_checked_data(cfg, build_algorithm(cfg), load_tokenizer(cfg.model.tokenizer))


@pytest.mark.parametrize("overrides, label", [
    (["sft.steps=5", "sft.split=nosuch"], "sft warm-up data: "),
    (["run.eval_every=1", "data.eval_split=nosuch"], "data.eval_split=nosuch: "),
])
def test_a_later_streams_data_error_names_its_stream(overrides, label):
    with pytest.raises(DataError) as e:
        _open(*overrides)
    text = str(e.value)
    assert text.startswith(label) and "no split 'nosuch'" in text
    assert "\n" not in text


def test_the_training_stream_comes_back_unread_and_unchecked_streams_are_not_opened():
    # resume: the warm-up does not run again, so its (broken) data is not opened
    data = _open("sft.steps=5", "sft.split=nosuch", "run.resume=true")
    state = data.state_dict()
    assert state["index"] == 0 and state["epoch"] == 0  # one batch was encoded to check, none consumed
    # eval_every=0: the held-out split is not read
    _open("run.eval_every=0", "data.eval_split=nosuch")


# ---- warmup_plan ---------------------------------------------------------------------------

def test_the_warm_up_plan_is_the_actors_training_placement_only():
    groups = {"train": DeviceGroup("train", 0, 4), "gen": DeviceGroup("gen", 4, 2), "ref": DeviceGroup("ref", 6, 2)}
    calls = {
        "actor.generate": Placement("gen", Layout(tensor=2)),
        "ref.inference": Placement("ref", Layout(fsdp=2)),
        "critic.train": Placement("ref", Layout(fsdp=2)),
        "actor.train": Placement("train", Layout(data=2, fsdp=2)),
    }
    plan = ExecutionPlan("hand", 8, groups, calls, shadow_roles=("actor",), offpolicy=True, offload_roles=("ref",))
    w = warmup_plan(plan)
    assert w.num_devices == 8
    assert w.groups == {"train": DeviceGroup("train", 0, 4)}
    assert w.calls == {"actor.train": Placement("train", Layout(data=2, fsdp=2))}
    # nothing of the RL plan's other machinery: no shadow copy, no off-policy feed, no offload
    assert w.shadow_roles == () and not w.offpolicy and w.offload_roles == ()
    assert w.home("actor") == plan.home("actor")  # the warmed-up weights are where the RL plan trains them
