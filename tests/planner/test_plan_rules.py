"""Plan rules that need no devices: host boundaries of groups, and whether a layout fits a model and batch."""

import pytest

from jaxrlhf.models.config import preset
from jaxrlhf.planner import plan as groups
from jaxrlhf.planner.plan import DeviceGroup, Layout, PlanError


def test_carve_is_contiguous_and_checks_bounds():
    g = groups.carve({"gen": 2, "train": 6}, 8)
    assert (g["gen"].start, g["gen"].size, g["train"].start, g["train"].size) == (0, 2, 2, 6)
    with pytest.raises(PlanError, match="covers devices 6-9 but only devices 0-7 exist"):
        groups.carve({"a": 6, "b": 4}, 8)


@pytest.mark.parametrize(
    "start,size,ok",
    [(0, 4, True), (4, 4, True), (2, 2, True), (3, 2, False), (0, 8, True), (4, 8, True), (2, 8, False), (0, 6, False)],
)
def test_host_rule(start, size, ok):
    reason = groups.host_rule_violation(DeviceGroup("g", start, size), devices_per_host=4)
    assert (reason is None) == ok, reason


def test_valid_group_sizes():
    assert groups.valid_group_sizes(16, 4) == [1, 2, 3, 4, 8, 12, 16]
    assert groups.valid_group_sizes(4) == [1, 2, 3, 4]


def test_layout_misfit_messages():
    cfg = preset("tiny")  # heads 4, kv 2, mlp 128
    assert groups.layout_misfit(Layout(tensor=2, fsdp=4), cfg, 8) is None
    assert "tensor=4 does not divide num_kv_heads=2" in groups.layout_misfit(Layout(tensor=4), cfg)
    assert "batch size 6 is not divisible by data*fsdp = 4" in groups.layout_misfit(Layout(fsdp=4), cfg, 6)


@pytest.mark.parametrize("seconds, text", [(4010.26, "4,010"), (12345.6, "12,346"), (999.4, "999"), (101.4, "101"),
                                           (5.92, "5.92"), (0.0388, "0.0388")])
def test_times_print_as_a_reader_takes_them(seconds, text):
    # a step of 4,010 s printed as "4.01e+03 s" in the step table and the static engine's hint
    assert groups.seconds_text(seconds) == text


def test_a_plan_says_which_devices_it_leaves_idle():
    # 1,000 H100 for batches of powers of two: the searched plan ran on devices 0-511 and its table said
    # "searched on 1000 devices" with no word of the other 488
    lay = Layout(data=8)
    plan = groups.ExecutionPlan("searched", 12, {"a": DeviceGroup("a", 0, 8), "b": DeviceGroup("b", 9, 1)},
                                {"actor.generate": groups.Placement("a", lay), "actor.train": groups.Placement("b", Layout())})
    assert plan.idle_devices() == [(8, 8), (10, 11)]
    assert "devices 8, 10-11 idle (3 of 12): no call of this plan runs there" in plan.table()
    everywhere = groups.ExecutionPlan("searched", 8, {"a": DeviceGroup("a", 0, 8)},
                                      {"actor.generate": groups.Placement("a", lay)})
    assert everywhere.idle_devices() == [] and "idle" not in everywhere.table()
