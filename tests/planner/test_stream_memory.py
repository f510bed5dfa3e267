"""The planner's memory model holds a partial-rollout stream's page pool where the runtime keeps it."""

from __future__ import annotations

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner.plan import ExecutionPlan
from jaxrlhf.planner.workload import Workload


def test_a_partial_rollout_stream_is_resident_on_the_generators_devices():
    """The stream's page pool (prompts of staleness + 1 batches) stays on the generate call's devices
    between steps: the memory model counts it under every call there, and the generate call's own peak
    is the pool it runs with, not the pool twice."""
    import dataclasses

    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.memory import plan_memory
    from jaxrlhf.planner.plan import DeviceGroup, Layout, Placement
    from jaxrlhf.testing.graphs import algorithm_graph

    graph = algorithm_graph("grpo", "algorithm.group_size=4")
    cfg = preset("small")
    models = {r: cfg for r in graph.roles}
    wl = Workload(batch_size=64, prompt_len=64, gen_len=512, minibatches=4, gen_engine="continuous", gen_group=4,
                  staleness=2)
    plan = ExecutionPlan("t", 2, {"gen": DeviceGroup("gen", 0, 1), "train": DeviceGroup("train", 1, 1)},
                         {c: Placement("gen" if c == "actor.generate" else "train", Layout()) for c in graph.names})
    hw = get_profile("h100")
    alone, streamed = (plan_memory(plan, graph, models, w, hw) for w in (wl, dataclasses.replace(wl, gen_stream=True)))
    generate = CallSpec("actor.generate", "actor", "generate")
    pool = dataclasses.replace(wl, gen_stream=True).stream_columns(generate, 1)
    assert pool > wl.generate_kv_columns(generate, 1) / 2  # the prompts of 3 batches, not 1
    assert streamed.resident[0] > alone.resident[0] and streamed.resident[1] == alone.resident[1]
    assert streamed.call_bytes["actor.generate"] >= alone.call_bytes["actor.generate"]
