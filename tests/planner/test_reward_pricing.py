"""The planner prices rule rewards (`planner.rewards`): the `score_rules` host step as an op on no device,
in the step without reward workers, only its tail beside a streamed generation. Numbers by hand."""

import dataclasses

import numpy as np
import pytest

from jaxrlhf.graph import CallGraph, CallSpec, HostStep
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
from jaxrlhf.planner.rewards import score_seconds, tail_rows
from jaxrlhf.planner.simulator import build_ops, host_links, schedule, steady_state
from jaxrlhf.planner.workload import Workload

# generate -> [score_rules] -> train, as an RL graph with rule rewards declares it
G = CallGraph(
    (CallSpec("actor.generate", "actor", "generate", inputs=("prompts",), outputs=("responses",)),
     CallSpec("actor.train", "actor", "train", inputs=("responses", "scores"), outputs=("stats",))),
    host_steps=(HostStep("score_rules", ("responses",), ("scores",)),), feed=("prompts",))
T = {"actor.generate": 4.0, "actor.train": 3.0}
GROUPS = {"all": DeviceGroup("all", 0, 2), "lo": DeviceGroup("lo", 0, 1), "hi": DeviceGroup("hi", 1, 1)}


def plan(where: dict[str, str], **kw) -> ExecutionPlan:
    return ExecutionPlan("test", 2, GROUPS, {c: Placement(g, Layout(data=GROUPS[g].size)) for c, g in where.items()},
                         **kw)


def test_the_host_step_runs_between_the_calls_it_links_on_no_device():
    assert host_links(G, "score_rules") == ({"actor.generate"}, {"actor.train"})
    colocated = plan({"actor.generate": "all", "actor.train": "all"})
    assert steady_state(G, colocated, T, {}).step_s == pytest.approx(7.0)
    assert steady_state(G, colocated, T, {}, host_s={"score_rules": 2.0}).step_s == pytest.approx(9.0)
    tl = schedule(build_ops(G, colocated, T, {}, 1, host_s={"score_rules": 2.0}), 2)
    spans = {s.op.name: s for s in tl.spans}
    assert spans["score_rules@0"].op.ranges == () and spans["score_rules@0"].start == pytest.approx(4.0)
    assert spans["actor.train@0"].start == pytest.approx(6.0)
    # off-policy (eta 1), the generator on its own device: the next step decodes while this one is
    # scored. Generate of step i + 2 waits for the train call of step i: 4 + 3 s fit in the 8 s of two
    # generate calls, 4 + 2 + 3 s do not (9 s per two steps)
    apart = plan({"actor.generate": "lo", "actor.train": "hi"}, shadow_roles=("actor",), offpolicy=True)
    assert steady_state(G, apart, T, {}).step_s == pytest.approx(4.0)
    assert steady_state(G, apart, T, {}, host_s={"score_rules": 2.0}).step_s == pytest.approx(4.5)


def test_score_seconds_by_hand():
    """64 rows, a rule that scores 8 at once in 0.5 s (a judge with `concurrency: 8`)."""
    wl = Workload(batch_size=64, gen_len=256, minibatches=2, reward_row_s=0.5, reward_at_once=8)
    assert score_seconds(wl, 10.0) == pytest.approx(8 * 0.5)  # in the step: 64 / 8 rounds
    two = dataclasses.replace(wl, reward_workers=2)
    assert score_seconds(two, 10.0) == pytest.approx(4 * 0.5)  # 32 rows per worker, a batch at a time
    assert score_seconds(dataclasses.replace(wl, reward_at_once=None), 10.0) == pytest.approx(64 * 0.5)
    assert score_seconds(dataclasses.replace(wl, reward_row_s=0.0), 10.0) == 0.0  # not measured: not priced
    streamed = dataclasses.replace(two, gen_stream=True, gen_chunk=16)
    lengths = np.full(64, 40)
    lengths[:3] = [200, 190, 120]  # 2 rows end in the last chunk (longest 200: lengths > 184)
    assert tail_rows(lengths, 16) == 2
    assert score_seconds(streamed, 10.0, lengths) == pytest.approx(0.5)  # one round for the tail
    # workers slower than generation (4 rounds = 2 s per worker against 0.5 s of generation): the backlog
    assert score_seconds(streamed, 0.5, lengths) == pytest.approx(2.0 - 0.5)
    assert score_seconds(streamed, 10.0) == pytest.approx(2.0)  # equal lengths: every row ends last


def test_a_measured_reward_lengthens_the_planned_step_as_the_runtime_scores_it():
    """A real GRPO graph with a rule on a colocated plan: the planner's step grows by 64 / 8 x 0.5 s
    with the reward in the step, by 32 / 8 x 0.5 s with 2 workers a batch at a time, and by the
    tail's rounds only beside a stream of drawn lengths."""
    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.planner.rewards import rounds
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.testing.graphs import algorithm_graph

    graph = algorithm_graph("grpo", "algorithm.group_size=8", "data.batch_size=8", "algorithm.kl_coef=0",
                            'rewards.rules=[{name: exact_match, weight: 1.0}]')
    assert "score_rules" in {h.name for h in graph.host_steps}
    models, hw = {r: preset("tiny") for r in graph.roles}, get_profile("h100")
    wl = Workload(batch_size=64, prompt_len=16, gen_len=256, minibatches=2, gen_engine="continuous", gen_group=8)
    p = build_plan("colocated", 2, models, graph, batch_size=wl.batch_size, devices_per_host=8)
    step = lambda **kw: estimate_plan(p, graph, models, dataclasses.replace(wl, **kw), hw).step_s  # noqa: E731
    base = step()
    priced = {"reward_row_s": 0.5, "reward_at_once": 8}
    assert step(**priced) - base == pytest.approx(8 * 0.5)
    assert step(**priced, reward_workers=2) - base == pytest.approx(4 * 0.5)
    # streamed: a judge of 1 ms a round (the tiny model generates a batch in 7-30 ms on an H100, so the
    # two workers' 4 rounds keep up): the step waits for the rows of the last chunk only
    lengths = {"gen_len_median": 48, "gen_len_sigma": 1.0, "gen_stream": True, "staleness": 1}
    streamed = step(**lengths)
    drawn = dataclasses.replace(wl, **lengths).response_lengths(64)
    tails = [rounds(-(-tail_rows(b, wl.gen_chunk) // 2), 8) * 0.001 for b in drawn]
    judged = step(**lengths, reward_row_s=0.001, reward_at_once=8, reward_workers=2)
    assert judged - streamed == pytest.approx(np.mean(tails), rel=1e-6)
    assert np.mean(tails) < 4 * 0.001  # less than scoring the batch after it
