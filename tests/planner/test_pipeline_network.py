"""Pipeline stages and the shared-NIC network model (JAX-free, fast)."""

import dataclasses

import pytest

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner.cost import call_cost
from jaxrlhf.planner.hardware import GB, get_profile
from jaxrlhf.planner.memory import params_per_device, working_set
from jaxrlhf.planner.plan import DeviceGroup, Layout, PlanError, layout_misfit, validate
from jaxrlhf.planner.presets import build_plan
from jaxrlhf.planner.sizes import layer_param_count, param_count
from jaxrlhf.planner.workload import Workload
from jaxrlhf.testing.graphs import ppo_graph

H100 = get_profile("h100")
CFG = preset("llama2-7b")
TRAIN = CallSpec("actor.train", "actor", "train")
INF = CallSpec("ref.inference", "ref", "inference")


def cost(call, layout, wl, hw=H100, cfg=CFG):
    return call_cost(call, cfg, DeviceGroup("g", 0, layout.num_devices), layout, wl, hw)


# ---- network ------------------------------------------------------------------------------------
def test_a_ring_across_hosts_gets_its_members_share_of_the_nic():
    nic = H100.inter_host_bandwidth * H100.link_efficiency
    # 8 devices of a host send at once: a ring with one member there gets 1/8 of the NICs, with 8 all.
    assert H100.link_bandwidth(True, 8, 1) == pytest.approx(nic / 8)
    assert H100.link_bandwidth(True, 8, 4) == pytest.approx(nic / 2)
    # The more devices of the host send at once, the less each ring gets.
    assert H100.link_bandwidth(True, 2, 1) > H100.link_bandwidth(True, 4, 1) > H100.link_bandwidth(True, 8, 1)


def test_ring_cost_follows_the_bytes_that_cross_the_nic():
    """7B on two hosts: d1f16t1 (one ring of 16) vs d1f2t8 (8 rings of 2) with the NIC as the bottleneck:
    FSDP time is in proportion to the bytes each node's NICs carry (15/16 vs 8 x 1/16 of the weights)."""
    slow = H100.with_inter_host_bandwidth(25 * GB)
    wl = Workload.from_tokens(2**17, 128, 128)
    f16 = cost(TRAIN, Layout(fsdp=16), wl, slow).parts["fsdp_comm"]
    f2t8 = cost(TRAIN, Layout(fsdp=2, tensor=8), wl, slow).parts["fsdp_comm"]
    assert f16 / f2t8 == pytest.approx((15 / 16) / (8 * 1 / 16), rel=0.05)
    # The old model charged each device 1/8 of the NIC however many ring members shared it: ~15x.
    assert f16 / f2t8 < 2


def test_inter_node_bandwidth_override_is_checked():
    assert H100.with_inter_host_bandwidth(100 * GB).inter_host_bandwidth == 100 * GB
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            H100.with_inter_host_bandwidth(bad)


# ---- pipelines ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 8), (4, 8), (8, 16)])
def test_pipeline_compute_pays_the_bubble(stages, micro):
    wl = Workload(batch_size=512, prompt_len=128, gen_len=128, minibatches=4, micro_batch=128 // micro)
    one = cost(TRAIN, Layout(tensor=8), wl).parts["compute"]
    piped = cost(TRAIN, Layout(tensor=8, stage=stages), wl, dataclasses.replace(H100, devices_per_host=8 * stages))
    # Each stage runs num_layers / S layers on M + S - 1 micro-batch passes (plus the head on M).
    layer_share = layer_param_count(CFG) / param_count(CFG, "lm")
    expected = one * (layer_share * (micro + stages - 1) / micro / stages + (1 - layer_share))
    assert piped.parts["compute"] == pytest.approx(expected, rel=0.1)
    assert piped.parts["stage_comm"] > 0


def test_stage_hand_offs_across_hosts_cost_more_than_inside_one():
    wl = Workload(batch_size=512, minibatches=4, micro_batch=16)
    inside = cost(INF, Layout(tensor=4, stage=2), wl)  # 8 devices, one host
    across = cost(INF, Layout(tensor=4, stage=2), wl, dataclasses.replace(H100, devices_per_host=4))
    assert across.parts["stage_comm"] > inside.parts["stage_comm"] > 0


def test_stages_split_layers_but_not_embedding_and_head():
    whole = params_per_device(CFG, "lm", Layout())
    rest = whole - layer_param_count(CFG) * 2
    assert params_per_device(CFG, "lm", Layout(stage=4)) == pytest.approx(layer_param_count(CFG) * 2 / 4 + rest)
    wl = Workload(batch_size=64, minibatches=1, micro_batch=8)
    # GPipe keeps the saved activations of M + S - 1 passes of num_layers / S layers per stage.
    act1 = working_set(TRAIN, CFG, Layout(data=4), wl)["activations"]
    act4 = working_set(TRAIN, CFG, Layout(stage=4), wl)["activations"]
    assert act4 > act1


def test_generation_with_stages_and_stages_not_dividing_layers_are_rejected():
    assert "never pipelined" in layout_misfit(Layout(tensor=4, stage=2), CFG, kind="generate")
    assert "stage=3 does not divide num_layers=32" in layout_misfit(Layout(stage=3), CFG, kind="train")
    assert layout_misfit(Layout(tensor=4, stage=2), CFG, kind="train") is None
    graph = ppo_graph()
    tiny = {r: preset("tiny") for r in graph.roles}
    plan = build_plan("colocated", 8, tiny, graph, batch_size=8)
    plan.calls["actor.generate"] = dataclasses.replace(plan.calls["actor.generate"], layout=Layout(data=4, stage=2))
    with pytest.raises(PlanError, match="generation is never pipelined.*use stage=1"):
        validate(plan, graph, tiny, batch_size=8)
    plan.calls["actor.generate"] = dataclasses.replace(plan.calls["actor.generate"], layout=Layout(data=8))
    plan.calls["actor.train"] = dataclasses.replace(plan.calls["actor.train"], layout=Layout(data=2, stage=4))
    with pytest.raises(PlanError, match="stage=4 does not divide num_layers=2"):
        validate(plan, graph, tiny, batch_size=8)
