"""The planner prices multi-turn episodes (`planner.episodes`) as the multi-turn engine runs them: every row
on every device, the measured decode steps, extend forwards and waits on environments. Numbers by hand."""

import dataclasses

import pytest

from jaxrlhf.environments import EpisodeTiming
from jaxrlhf.planner.cost import CallCost
from jaxrlhf.planner.episodes import episode_cost
from jaxrlhf.planner.workload import Workload

EPISODES = dict(multi_turn=True, env_extend_width=33)
MEASURED = dict(env_decode_steps=48.0, env_extends=3.0, env_wait_s=0.5)


def test_episode_cost_by_hand():
    """A call priced 0.2 s of prefill (16-token prompts) and 1.1 s over 64 decode steps: 48 steps measured
    scale the rest by 3/4, three extends of 33 tokens a row cost 3 x 33/16 prefills, the wait is added."""
    wl = Workload(batch_size=8, prompt_len=16, gen_len=64, minibatches=1, **EPISODES, **MEASURED)
    single = CallCost(1.3, 0.0, 0.0, 0.0, {"prefill": 0.2, "decode": 1.0, "tensor_comm": 0.1})
    cost = episode_cost(single, wl)
    assert cost.parts == pytest.approx({"prefill": 0.2, "decode": 0.75, "tensor_comm": 0.075,
                                        "extend": 0.2 * 3 * 33 / 16, "env_wait": 0.5})
    assert cost.seconds == pytest.approx(sum(cost.parts.values()))
    # nothing measured yet: one turn to the cap
    unmeasured = episode_cost(single, dataclasses.replace(wl, env_decode_steps=0.0, env_extends=0.0, env_wait_s=0.0))
    assert unmeasured.seconds == pytest.approx(1.3)


def test_every_device_runs_the_whole_episode_batch():
    """The multi-turn engine's pool is not sharded: a data axis splits nothing (prompts, rows per step,
    steps), where the continuous engine splits its rows over it."""
    wl = Workload(batch_size=8, prompt_len=16, gen_len=64, minibatches=1, gen_engine="continuous", **EPISODES)
    from jaxrlhf.testing.graphs import algorithm_graph

    gen = next(c for c in algorithm_graph("grpo", "algorithm.group_size=4").calls if c.kind == "generate")
    assert wl.generate_shape(gen, 4) == (8, 8, 64)
    assert dataclasses.replace(wl, multi_turn=False).generate_shape(gen, 4)[1] == 2
    assert not dataclasses.replace(wl, gen_len_median=16, gen_len_sigma=1.0).lengths_vary  # steps are measured


def test_a_measured_episode_batch_lengthens_the_planned_step():
    """A real GRPO graph on a colocated plan: the planner's step grows by the measured wait and the extends,
    and a data-parallel generate layout costs what one device costs (each device decodes every row)."""
    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.cost import CostCache
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.testing.graphs import algorithm_graph

    graph = algorithm_graph("grpo", "algorithm.group_size=4", "data.batch_size=2", "algorithm.kl_coef=0")
    gen = next(c for c in graph.calls if c.kind == "generate")
    models, hw = {r: preset("tiny") for r in graph.roles}, get_profile("h100")
    wl = Workload(batch_size=8, prompt_len=16, gen_len=64, minibatches=1, gen_engine="continuous", gen_group=4,
                  **EPISODES)
    p = build_plan("colocated", 2, models, graph, batch_size=wl.batch_size, devices_per_host=8)
    step = lambda w: estimate_plan(p, graph, models, w, hw).step_s  # noqa: E731
    before = step(wl)
    measured = dataclasses.replace(wl, env_decode_steps=64.0, env_extends=2.0, env_wait_s=0.75)
    cache = CostCache(models, measured, hw)
    group = p.groups[p.calls[gen.name].group]
    call = cache.call(gen, group, p.calls[gen.name].layout)
    assert step(measured) - before == pytest.approx(0.75 + call.parts["extend"], rel=1e-6)
    assert call.parts["extend"] == pytest.approx(call.parts["prefill"] * 2 * 33 / 16)
    one = cache.call(gen, DeviceGroup("one", 0, 1), Layout())
    two = cache.call(gen, DeviceGroup("two", 0, 2), Layout(data=2))
    assert two.seconds == pytest.approx(one.seconds, rel=1e-6)


def test_episode_timing_is_the_median_of_the_latest_batches():
    timing = EpisodeTiming()
    assert timing.fields() == {"env_decode_steps": 0.0, "env_extends": 0.0, "env_wait_s": 0.0}
    for steps, extends, wait in [(40, 2, 0.1), (48, 3, 0.5), (64, 9, 3.0)]:
        timing.record(steps, extends, wait)
    assert timing.fields() == {"env_decode_steps": 48.0, "env_extends": 3.0, "env_wait_s": 0.5}


def test_the_workload_of_an_environment_run_carries_its_measured_episodes():
    """`Algorithm.workload` of a run with env.name: multi-turn, the engine's extend width (1 +
    env.max_observation_tokens), and what its episode batches measured; agents' episodes and single-turn
    runs are priced as today."""
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.config import load_config

    base = ["algorithm.name=grpo", "algorithm.group_size=4", "model.actor.preset=tiny", "model.tokenizer=byte",
            "generation.engine=continuous", "rewards.rules=[]", "rewards.eos_only=false"]
    alg = build_algorithm(load_config(None, [*base, "env.name=tools", "env.max_observation_tokens=31"]))
    wl = alg.workload()
    assert wl.multi_turn and wl.env_extend_width == 32 and wl.env_decode_steps == 0.0
    alg.rollout.timing.record(40, 2, 0.25)  # what the episodes rollout measured
    assert (alg.workload().env_decode_steps, alg.workload().env_extends, alg.workload().env_wait_s) == (40.0, 2.0, 0.25)
    single = build_algorithm(load_config(None, [*base[:-2], "rewards.rules=[{name: exact_match, weight: 1.0}]"]))
    assert not single.workload().multi_turn
