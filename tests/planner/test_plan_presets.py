"""Execution plans: presets, YAML round trip, validation messages."""

import dataclasses

import pytest

from jaxrlhf.models.config import preset
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement, PlanError, validate
from jaxrlhf.planner.presets import STRATEGIES, build_plan, generation_layout, sharded_layout
from jaxrlhf.testing.graphs import ppo_graph

PPO_GRAPH = ppo_graph()
ROLES = PPO_GRAPH.roles

TINY = {r: preset("tiny") for r in ROLES}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_presets_on_eight_devices_validate_and_round_trip(strategy, tmp_path):
    plan = build_plan(strategy, 8, TINY, PPO_GRAPH, batch_size=8)
    validate(plan, PPO_GRAPH, TINY, devices=8, batch_size=8)
    assert set(plan.calls) == set(PPO_GRAPH.names)
    path = tmp_path / "plan.yaml"
    plan.save(str(path))
    again = ExecutionPlan.load(str(path))
    assert again == plan
    assert ExecutionPlan.from_yaml(plan.to_yaml()) == plan
    assert strategy in plan.table() and "actor.generate" in plan.table()


def test_preset_shapes():
    inter = build_plan("interleaved", 8, TINY, PPO_GRAPH, batch_size=8)
    actor, critic = inter.group_of("actor.train"), inter.group_of("critic.train")
    assert not actor.overlaps(critic)  # the two train calls run concurrently
    assert inter.group_of("ref.inference") == inter.group_of("reward.inference") == actor

    dis = build_plan("disaggregated", 8, TINY, PPO_GRAPH, batch_size=8, offpolicy=True)
    assert dis.shadow_roles == ("actor",) and dis.offpolicy
    assert not dis.group_of("actor.generate").overlaps(dis.group_of("actor.train"))
    assert dis.calls["actor.generate"].layout.tensor == 2  # tiny has 2 kv heads

    re = build_plan("reallocated", 8, TINY, PPO_GRAPH, batch_size=8)
    assert re.calls["actor.generate"].layout != re.calls["actor.train"].layout
    assert re.group_of("actor.generate") == re.group_of("actor.train")
    assert not re.group_of("ref.inference").overlaps(re.group_of("reward.inference"))


def test_presets_at_cluster_scale_respect_hosts():
    big = {r: preset("llama2-70b") for r in ROLES}
    for s in STRATEGIES:
        plan = build_plan(s, 128, big, PPO_GRAPH, batch_size=512, devices_per_host=8)
        for p in plan.calls.values():
            assert p.layout.tensor <= 8
    gen = build_plan("disaggregated", 128, big, PPO_GRAPH, batch_size=512, devices_per_host=8).calls["actor.generate"]
    assert gen.layout.tensor == 8


def test_layout_choices():
    cfg = preset("llama2-7b")
    assert generation_layout(cfg, 8, 64, 8) == Layout(tensor=8)
    assert generation_layout(cfg, 16, 64, 8) == Layout(data=2, tensor=8)
    assert sharded_layout(cfg, 8, 64) == Layout(fsdp=8)
    assert sharded_layout(cfg, 8, 4) == Layout(fsdp=4, tensor=2)  # batch 4 cannot split 8 ways


@pytest.mark.parametrize(
    "strategy,n,kwargs,message",
    [
        ("interleaved", 1, {}, "needs at least 2 devices"),
        ("disaggregated", 1, {}, "needs at least 2 devices"),
        ("reallocated", 1, {}, "use colocated"),
        ("colocated", 8, {"offpolicy": True}, "use strategy 'disaggregated'"),
        ("colocted", 8, {}, "Did you mean 'colocated'"),
        ("colocated", 8, {"batch_size": 3}, "no layout of 8 devices fits"),
        ("interleaved", 8, {"batch_size": 1, "devices_per_host": 8}, "no split of 8 devices"),
    ],
)
def test_presets_refuse_with_reason(strategy, n, kwargs, message):
    with pytest.raises(PlanError, match=message):
        build_plan(strategy, n, TINY, PPO_GRAPH, **kwargs)


def test_missing_model_config():
    with pytest.raises(PlanError, match=r"no model config for role\(s\) \['critic'\]"):
        build_plan("colocated", 8, {r: preset("tiny") for r in ROLES if r != "critic"}, PPO_GRAPH)


# ---- invalid plans, each with its own message -----------------------------------------------
def _base() -> ExecutionPlan:
    return build_plan("disaggregated", 8, TINY, PPO_GRAPH, batch_size=8)


def _with_call(plan, call, **changes):
    p = plan.calls[call]
    layout = dataclasses.replace(p.layout, **{k: v for k, v in changes.items() if k != "group"})
    plan.calls[call] = Placement(changes.get("group", p.group), layout)
    return plan


def _drop_call(plan):
    del plan.calls["critic.train"]
    return plan


def _extra_call(plan):
    plan.calls["actor.sing"] = plan.calls["actor.train"]
    return plan


def _group(plan, name, start, size):
    plan.groups[name] = DeviceGroup(name, start, size)
    return plan


INVALID = [
    ("too many devices", lambda p: dataclasses.replace(p, num_devices=16), {"devices": 8},
     "plan needs 16 devices but only 8 are available"),
    ("group outside", lambda p: _group(p, "train", 4, 8), {},
     "group 'train' covers devices 4-11 but only devices 0-7 exist"),
    ("group splits a host", lambda p: _group(p, "train", 2, 6), {"devices_per_host": 4},
     "splits a host"),
    ("missing call", _drop_call, {}, r"no placement for call\(s\) \['critic.train'\]"),
    ("unknown call", _extra_call, {}, r"unknown call\(s\) \['actor.sing'\]"),
    ("unknown group", lambda p: _with_call(p, "critic.train", group="trian"), {},
     "uses group 'trian', which the plan does not define"),
    ("layout size", lambda p: _with_call(p, "actor.train", fsdp=8), {},
     "uses 8 devices but group 'train' has 4"),
    ("zero axis", lambda p: _with_call(p, "actor.train", data=0, fsdp=4), {}, "mesh axis data=0"),
    ("tensor vs kv heads", lambda p: _with_call(p, "actor.generate", data=1, tensor=4), {},
     "tensor=4 does not divide num_kv_heads=2"),
    ("batch", lambda p: p, {"batch_size": 6}, "batch size 6 is not divisible by data\\*fsdp = 4"),
    ("shadow without off-home call", lambda p: dataclasses.replace(p, shadow_roles=("critic",)), {},
     "shadow role 'critic' has no call placed away from its home"),
    ("unknown shadow role", lambda p: dataclasses.replace(p, shadow_roles=("policy",)), {},
     "shadow role 'policy' is not a role"),
    ("offpolicy without shadow", lambda p: dataclasses.replace(p, offpolicy=True, shadow_roles=()), {},
     "needs a shadow 'actor'"),
    ("offpolicy sharing devices", lambda p: dataclasses.replace(
        _with_call(p, "actor.generate", group="train"), offpolicy=True), {},
     "share devices; put generation on devices no train call uses"),
]


@pytest.mark.parametrize("name,mutate,kwargs,message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_plans_rejected_with_specific_message(name, mutate, kwargs, message):
    plan = mutate(_base())
    with pytest.raises(PlanError, match=message):
        validate(plan, PPO_GRAPH, TINY, **{"batch_size": 8, **kwargs})


def test_invalid_yaml_messages():
    with pytest.raises(PlanError, match="unknown keys \\['stratgy'\\]"):
        ExecutionPlan.from_yaml("stratgy: x\nnum_devices: 8\ngroups: {}\ncalls: {}\n")
    with pytest.raises(PlanError, match="needs 'group'"):
        ExecutionPlan.from_yaml("num_devices: 8\ngroups: {a: {start: 0, size: 8}}\ncalls: {x: {fsdp: 8}}\n")
    with pytest.raises(PlanError, match="cannot read plan file"):
        ExecutionPlan.load("/nonexistent/plan.yaml")


# ---- heuristic and colocated baselines -------------------------------------------------------
@pytest.mark.parametrize("size,n", [("7b", 8), ("13b", 16), ("70b", 64), ("70b", 128)])
def test_heuristic_is_megatron_style_and_fits(size, n):
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.memory import plan_memory
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.planner.workload import Workload

    hw, models = get_profile("h100"), {r: preset(f"llama2-{size}") for r in ROLES}
    wl = Workload.from_tokens(2**17, 128, 128, micro_batch=16)
    plan = build_plan("heuristic", n, models, PPO_GRAPH, batch_size=wl.batch_size, devices_per_host=8,
                      workload=wl, hardware=hw)
    validate(plan, PPO_GRAPH, models, batch_size=wl.batch_size, devices_per_host=8)
    assert plan_memory(plan, PPO_GRAPH, models, wl, hw).feasible
    assert set(plan.groups) == {"all"}
    for role in ROLES:  # one layout per role: tensor 8 inside a node
        lays = {plan.calls[c.name].layout for c in PPO_GRAPH.calls if c.role == role and c.kind != "generate"}
        assert len(lays) == 1 and lays.pop().tensor == 8
    gen, train = plan.calls["actor.generate"].layout, plan.calls["actor.train"].layout
    assert gen.stage == 1 and gen.fsdp == 1 and gen.tensor == train.tensor
    if size == "70b":  # pipeline stages across nodes, not FSDP: at 64 devices memory needs them; at 128 the
        # optimizer split over 16 data replicas (ZeRO-1) fits unpipelined, but the tuned depth is faster
        assert train.stage > 1 and train.fsdp == 1 and train.num_devices // train.stage >= 8
        unpipelined = dataclasses.replace(plan, calls={c: Placement("all", Layout(
            data=p.layout.data * p.layout.stage, tensor=p.layout.tensor)) for c, p in plan.calls.items()})
        if n == 128:
            est = estimate_plan(unpipelined, PPO_GRAPH, models, wl, hw)
            assert est.feasible and est.step_s > estimate_plan(plan, PPO_GRAPH, models, wl, hw).step_s
    else:
        assert train.stage == 1 and train.fsdp == 1


@pytest.mark.parametrize("strategy", ["colocated", "interleaved", "disaggregated", "reallocated"])
def test_trained_roles_layouts_split_one_minibatch_evenly(strategy):
    """Batch 8 in 2 minibatches on 8 devices: a train call feeds 4 rows at a time, so a trained role's
    layout splits at most 4 ways over data x fsdp (an 8-way FSDP train call computed padding on half
    the devices and moved shards at every reshape: the tiny PPO step took 0.173 instead of 0.115 s);
    the frozen reference keeps splitting the whole batch."""
    plan = build_plan(strategy, 8, TINY, PPO_GRAPH, batch_size=8, minibatch_size=4)
    for call in PPO_GRAPH.calls:
        layout = plan.calls[call.name].layout
        if call.kind == "train":
            assert 4 % (layout.data * layout.fsdp) == 0, (call.name, layout)
    if strategy == "colocated":  # one layout per role: the critic's inference runs on its train layout
        assert plan.calls["ref.inference"].layout == Layout(fsdp=8)
        assert plan.calls["actor.train"].layout == Layout(fsdp=4, tensor=2)
        assert plan.calls["critic.inference"].layout == plan.calls["critic.train"].layout
    assert build_plan(strategy, 8, TINY, PPO_GRAPH, batch_size=8).calls["actor.train"].layout.fsdp >= 4


def test_colocated_generates_on_a_tensor_parallel_copy():
    plan = build_plan("colocated", 8, TINY, PPO_GRAPH, batch_size=8)
    assert plan.calls["actor.generate"].layout == Layout(data=4, tensor=2)  # gathered once per generation
    assert plan.calls["actor.train"].layout.fsdp == 8


@pytest.mark.parametrize("size,n", [("7b", 16), ("70b", 64)])
def test_verl_is_a_tuned_hybrid_engine_that_fits(size, n):
    """verl-style: everything on all devices, FSDP (over a node, data parallel across nodes) or tensor
    parallelism inside a node for training, generation on a tensor-parallel copy inside a node; its
    tuning never makes the plan slower than its untuned first fit."""
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.memory import plan_memory
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.planner.workload import Workload

    hw, models = get_profile("h100"), {r: preset(f"llama2-{size}") for r in ROLES}
    wl = Workload.from_tokens(2**17, 128, 128, micro_batch="auto")
    plan = build_plan("verl", n, models, PPO_GRAPH, batch_size=wl.batch_size, devices_per_host=8,
                      workload=wl, hardware=hw)
    validate(plan, PPO_GRAPH, models, batch_size=wl.batch_size, devices_per_host=8)
    assert set(plan.groups) == {"all"} and plan.strategy == "verl"
    assert estimate_plan(plan, PPO_GRAPH, models, wl, hw).feasible
    gen = plan.calls["actor.generate"].layout
    assert gen.fsdp == 1 and gen.stage == 1 and 1 <= gen.tensor <= 8 and gen.num_devices == n
    for c in PPO_GRAPH.calls:
        lay = plan.calls[c.name].layout
        assert lay.stage == 1 and lay.tensor <= 8
        if c.kind != "generate":
            assert lay.fsdp * lay.tensor <= 8 or (lay.fsdp * lay.tensor) % 8 == 0  # whole nodes
    untuned = build_plan("verl", n, models, PPO_GRAPH, batch_size=wl.batch_size, devices_per_host=8)
    if plan_memory(untuned, PPO_GRAPH, models, wl, hw).feasible:
        assert estimate_plan(plan, PPO_GRAPH, models, wl, hw).step_s <= \
            estimate_plan(untuned, PPO_GRAPH, models, wl, hw).step_s


@pytest.mark.parametrize("strategy", ["heuristic", "verl"])
def test_an_expert_preset_that_fits_nowhere_reports_its_closest_rung(strategy):
    """Climbing a preset's ladder saves parameters but may add activations (Qwen3-32B on 512 v5e: the
    heuristic's 64 pipeline stages held 924 GiB of one data shard's hidden states, its first rung 36 GiB),
    so the error reports the rung nearest to fitting, not the last one it tried."""
    import types

    from jaxrlhf.planner import presets
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.workload import Workload

    hw, models = get_profile("h100"), {r: preset("llama2-70b") for r in ROLES}
    wl = Workload.from_tokens(2**17, 128, 128, micro_batch="auto")
    with pytest.raises(PlanError, match=r"the closest \((actor|critic|ref|reward) d\S+(, (actor|critic|ref|reward) d\S+){3}\) "
                                        r"is [\d.]+ GiB over \(out of memory on device"):
        build_plan(strategy, 8, models, PPO_GRAPH, batch_size=wl.batch_size, devices_per_host=8,
                   workload=wl, hardware=hw)
    closest = None
    for over, name in [(30, "first"), (10, "second"), (50, "last")]:
        report = types.SimpleNamespace(max_peak=(80 + over) * 2**30, capacity=80 * 2**30, reason=f"{name} rung")
        closest = presets._closer(closest, report, {"actor": Layout(data=8)})
    assert presets._closest_text(closest) == "the closest (actor d8f1t1) is 10.0 GiB over (second rung)"
