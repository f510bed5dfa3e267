"""The planner's memory model holds a partial-rollout stream's page pool where the runtime keeps it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner.plan import ExecutionPlan
from jaxrlhf.planner.workload import Workload


def test_a_partial_rollout_stream_is_resident_on_the_generators_devices():
    """The stream's page pool (prompts of staleness + 1 batches) stays on the generate call's devices
    between steps: the memory model counts it under every call there, and the generate call's own peak
    is the pool it runs with, not the pool twice."""
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


def test_a_streams_resident_pool_is_the_one_its_knobs_chose():
    """The stream stays resident at the pool the plan runs (`gen_slots`, here a knob): a narrower pool holds
    fewer pages between steps. The memory model had sized it at the workload's pool whatever the knob, so no
    knob could make a stream fit."""
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.knobs import CallKnobs
    from jaxrlhf.planner.memory import plan_memory
    from jaxrlhf.planner.plan import DeviceGroup, Layout, Placement
    from jaxrlhf.testing.graphs import algorithm_graph

    graph = algorithm_graph("grpo", "algorithm.group_size=4")
    models = {r: preset("small") for r in graph.roles}
    wl = Workload(batch_size=64, prompt_len=64, gen_len=512, minibatches=4, gen_engine="continuous", gen_group=4,
                  staleness=2, gen_stream=True, gen_len_median=128, gen_len_sigma=0.8)
    plan = ExecutionPlan("t", 2, {"gen": DeviceGroup("gen", 0, 1), "train": DeviceGroup("train", 1, 1)},
                         {c: Placement("gen" if c == "actor.generate" else "train", Layout()) for c in graph.names})
    generate, hw = graph["actor.generate"], get_profile("h100")
    wide, narrow = (plan_memory(plan, graph, models, wl, hw, knobs={"actor.generate": CallKnobs(slots=s)})
                    for s in (64, 8))
    kv = (wl.for_call(generate, slots=s).stream_columns(generate, 1) for s in (64, 8))
    assert next(kv) > next(kv)
    assert wide.resident[0] > narrow.resident[0] and wide.resident[1] == narrow.resident[1]


@pytest.mark.parametrize("ways,eta,slots", [(1, 1, None), (2, 2, 16), (2, 3, 64), (4, 2, 200), (2, 1, 24)])
def test_the_planner_sizes_a_stream_as_the_runtime_builds_it(ways, eta, slots):
    """A stream's group slots hold the prompts of eta + 1 batches, so its pool may be wider than one batch
    (`generation.slots`): the planner's pool, group slots and page columns per shard are the runtime's
    (`rollouts.stream` builds its `StreamSpec` with `models.slots.stream_groups`), at every width."""
    from jaxrlhf.models import slots as sz
    from jaxrlhf.models import streaming

    prompts, group, prompt_len, gen_len = 8, 4, 16, 64
    wl = Workload(batch_size=prompts * group, prompt_len=prompt_len, gen_len=gen_len, minibatches=2,
                  gen_engine="continuous", gen_group=group, gen_slots=slots, staleness=eta, gen_stream=True)
    spec = streaming.StreamSpec.make(groups=sz.stream_groups(prompts, eta, ways), group_size=group,
                                     max_new_tokens=gen_len, prompt_bucket=prompt_len, sampling=None, eos_id=None,
                                     pad_id=0, slots=slots or prompts * group, kv_pages=None, batch_ways=ways)
    generate = CallSpec("actor.generate", "actor", "generate")
    assert wl.engine_rows(generate, ways) == spec.rows
    assert wl.engine_pool(generate, ways) // ways == spec.slots_per_shard
    assert wl.stream_columns(generate, ways) == sz.kv_columns(prompt_len, gen_len, spec.rows, group, spec.slots,
                                                              None, ways)[1]
    assert wl.generate_shape(generate, ways)[1] == spec.slots_per_shard
    if slots and slots > prompts * group:  # rows of several batches decode side by side
        assert spec.slots_per_shard * ways > prompts * group


def test_a_stream_pool_wider_than_a_batch_decodes_a_batch_in_fewer_seconds():
    """With the generator eta = 3 steps ahead and a pool of four batches' rows, each step reads the weights
    once for up to four times the rows: a batch's decode costs less than with a pool of one batch
    (memory-bound decode, a GQA model whose KV reads stay below its weights), as NeMo-RL's and verl's
    asynchronous generators run. Not four times less: admission pacing holds the fifth batch until the
    first is trained, so the pool narrows while a batch's long tail finishes."""
    from jaxrlhf.planner.cost import CostCache, generate_durations
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    cfg = preset("qwen2-7b")
    generate = CallSpec("actor.generate", "actor", "generate")
    base = Workload(batch_size=64, prompt_len=128, gen_len=1024, minibatches=2, gen_engine="continuous", gen_group=8,
                    staleness=3, gen_stream=True, gen_len_median=400, gen_len_sigma=0.6)
    seconds = {}
    for slots in (64, 256):
        wl = dataclasses.replace(base, gen_slots=slots)
        cost = CostCache({"actor": cfg}, wl, get_profile("h100")).call(generate, DeviceGroup("g", 0, 1), Layout())
        seconds[slots] = float(np.mean(generate_durations(cost, wl, generate, 1, streamed=True)))
    assert seconds[256] < 0.75 * seconds[64]


def test_the_search_offers_a_stream_pools_wider_than_a_batch_and_the_batch_itself():
    """The synchronous engine's pools (one batch's rows per shard down by halves), and for a stream also
    doubling up to every row its group slots hold: a generator eta = 4 ahead may decode five batches at once."""
    from jaxrlhf.planner.knobs import options
    from jaxrlhf.planner.plan import Layout
    from jaxrlhf.planner.workload import AUTO

    generate = CallSpec("actor.generate", "actor", "generate")
    wl = Workload(batch_size=1024, gen_group=16, gen_engine="continuous", gen_slots=AUTO, staleness=4)
    pools = lambda w: [k.slots for k in options(generate, Layout(data=16), w)]  # noqa: E731
    assert pools(wl) == [1024, 512, 256, 128, 64, 32, 16]
    assert pools(dataclasses.replace(wl, gen_stream=True)) == [5120, 4096, 2048, *pools(wl)]
