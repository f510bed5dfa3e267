"""Measured profiles: interpolation by hand, which estimates use them, files and the config key."""

import dataclasses

import pytest

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner.cost import call_cost
from jaxrlhf.planner.hardware import HardwareProfile, get_profile
from jaxrlhf.planner.measured import Measured, Table, model_key
from jaxrlhf.planner.plan import DeviceGroup, Layout
from jaxrlhf.planner.workload import Workload

CFG = preset("tiny")
KEY = model_key(CFG, "lm")
WL = Workload(batch_size=16, prompt_len=8, gen_len=8, minibatches=2)
GEN = CallSpec("actor.generate", "actor", "generate")
INF = CallSpec("ref.inference", "ref", "inference")
TRAIN = CallSpec("actor.train", "actor", "train")
GROUP, LAY = DeviceGroup("g", 0, 4), Layout(data=4)


def table(phase, points, layout=LAY, devices=4):
    return Table(KEY, phase, devices, str(layout), tuple(points))


# rows x length grid: seconds = 0.01 + 0.001 * rows + 0.0002 * rows * length (bilinear -> exact)
def line(r, n):
    return 0.01 + 0.001 * r + 0.0002 * r * n


GRID = [(r, n, line(r, n)) for r in (4, 8) for n in (8, 16)]


def test_bilinear_inside_and_linear_outside_the_grid():
    t = table("inference", GRID)
    assert t.seconds(6, 12) == pytest.approx(line(6, 12))  # inside
    assert t.seconds(16, 16) == pytest.approx(line(16, 16))  # rows past the grid: the end segment's slope
    assert t.seconds(8, 32) == pytest.approx(line(8, 32))  # length past the grid
    one = table("inference", [(4, 8, 0.5)])
    assert one.seconds(100, 100) == 0.5  # a single point: constant
    falling = table("inference", [(4, 8, 0.5), (8, 8, 0.1)])
    assert falling.seconds(100, 8) == 0.0  # never negative


def profile_with(*tables):
    return dataclasses.replace(get_profile("cpu"), measured=Measured(tables))


def test_calls_covered_by_tables_are_measured_by_hand_the_rest_formula():
    hw = profile_with(table("prefill", GRID), table("decode", GRID), table("inference", GRID), table("train", GRID))
    gen = call_cost(GEN, CFG, GROUP, LAY, WL, hw)
    assert gen.source == "measured"
    # prefill of 16 rows x 8 prompt tokens + 8 decode steps over a cache of 16 slots
    assert gen.seconds == pytest.approx(line(16, 8) + 8 * line(16, 16))
    inf = call_cost(INF, CFG, GROUP, LAY, WL, hw)
    assert (inf.source, inf.seconds) == ("measured", pytest.approx(line(16, 16)))
    train = call_cost(TRAIN, CFG, GROUP, LAY, WL, hw)  # 2 optimizer steps of an 8-row minibatch
    assert (train.source, train.seconds) == ("measured", pytest.approx(2 * line(8, 16)))
    # 2 micro-batches of 4 rows per minibatch: each a pass of 4 rows, all of it
    micro = dataclasses.replace(WL, micro_batch=4)
    split = call_cost(TRAIN, CFG, GROUP, LAY, micro, hw)
    assert (split.source, split.seconds) == ("measured", pytest.approx(2 * 2 * line(4, 16)))
    # another layout of a timed model: the formulas scaled by their error where timed (`calibrated`);
    # a missing decode table, another model, no tables: formulas
    assert call_cost(INF, CFG, GROUP, Layout(fsdp=4), WL, hw).source == "calibrated"
    assert call_cost(GEN, CFG, GROUP, LAY, WL, profile_with(table("prefill", GRID))).source == "formula"
    assert call_cost(INF, preset("small"), GROUP, LAY, WL, hw).source == "formula"
    assert call_cost(INF, CFG, GROUP, LAY, WL, get_profile("cpu")).source == "formula"


def test_a_continuous_pool_narrower_than_the_batch_decodes_at_its_width():
    """generation.slots = 8 of 16 rows: the engine runs 2 rounds of 8 decode steps, 8 rows wide (the decode
    table's rows are the rows a step runs), not 8 steps 16 rows wide."""
    hw = profile_with(table("prefill", GRID), table("decode", GRID))
    pool = dataclasses.replace(WL, gen_engine="continuous", gen_slots=8)
    gen = call_cost(GEN, CFG, GROUP, LAY, pool, hw)
    assert (gen.source, gen.seconds) == ("measured", pytest.approx(line(16, 8) + 2 * 8 * line(8, 16)))


def test_a_pipelined_layout_is_priced_from_one_stages_tables():
    """2 stages x data 2 on 4 devices, 4 micro-batches: M + S - 1 = 5 iterations; in each, both stages
    run their half of the layers on one micro-batch (rows / 4) on a stage's placement (data 2 on 2
    devices). One after the other (a host's devices share its cores) that is a whole pass per iteration;
    side by side, half of one."""
    staged = Layout(data=2, stage=2)
    stage_table = table("inference", GRID, layout=Layout(data=2), devices=2)
    micro = dataclasses.replace(WL, micro_batch=4)  # 16 rows in 4 micro-batches
    shared = profile_with(stage_table)
    assert shared.shares_cores
    cost = call_cost(INF, CFG, GROUP, staged, micro, shared)
    assert (cost.source, cost.seconds) == ("measured", pytest.approx(5 * line(4, 16)))
    own_cores = dataclasses.replace(shared, host_flops=None)
    assert call_cost(INF, CFG, GROUP, staged, micro, own_cores).seconds == pytest.approx(5 * line(4, 16) / 2)
    # no table of the stage's placement: the formulas, scaled
    assert call_cost(INF, CFG, GROUP, staged, micro, profile_with(table("inference", GRID))).source == "calibrated"


def test_a_mixed_layout_scales_the_formula_by_the_single_axis_errors():
    """data 2 x tensor 2 on 4 devices: the formula times the geometric mean of its error on data 4 and on
    tensor 4 (equal weights: 2 ways each); other placements: the median error over every timed placement."""
    from jaxrlhf.planner.cost import profile_call_cost

    formula = get_profile("cpu")
    mixed, tensor = Layout(data=2, tensor=2), Layout(tensor=4)
    at = {lay: profile_call_cost(INF, CFG, GROUP, lay, WL, formula).seconds for lay in (LAY, tensor, mixed)}
    hw = profile_with(table("inference", [(16, 16, 3.0 * at[LAY])]),
                      table("inference", [(16, 16, 12.0 * at[tensor])], layout=tensor))
    cost = call_cost(INF, CFG, GROUP, mixed, WL, hw)
    assert (cost.source, cost.seconds) == ("calibrated", pytest.approx(6.0 * at[mixed]))
    assert sum(cost.parts.values()) == pytest.approx(cost.seconds)
    # without the tensor table, the mixed layout takes the error of every placement timed (data 4 alone)
    only_data = profile_with(table("inference", [(16, 16, 3.0 * at[LAY])]))
    alone = call_cost(INF, CFG, GROUP, mixed, WL, only_data)
    assert (alone.source, alone.seconds) == ("calibrated", pytest.approx(3.0 * at[mixed]))
    # a group size the profile never timed: the median error over the timed placements (of 3 and 12)
    two = DeviceGroup("two", 0, 2)
    small = call_cost(INF, CFG, two, Layout(tensor=2), WL, hw)
    formula_two = profile_call_cost(INF, CFG, two, Layout(tensor=2), WL, formula).seconds
    assert (small.source, small.seconds) == ("calibrated", pytest.approx(7.5 * formula_two))
    assert call_cost(INF, CFG, GROUP, mixed, WL, formula).source == "formula"  # nothing timed


def test_layout_strings_parse_back():
    for lay in (Layout(), Layout(data=4, tensor=2), Layout(fsdp=2, stage=2)):
        assert Layout.parse(str(lay)) == lay
    with pytest.raises(ValueError, match="d<data>f<fsdp>t<tensor>"):
        Layout.parse("4x2")


def test_profile_file_round_trip_and_bad_entries(tmp_path):
    move = {"model": KEY, "what": "params", "src": "0+4:d4f1t1", "dst": "0+8:d8f1t1", "bytes": 1e6, "seconds": 0.01}
    hw = dataclasses.replace(get_profile("cpu"), measured=Measured([table("train", GRID)], [move]))
    path = str(tmp_path / "p.yaml")
    hw.save(path)
    back = HardwareProfile.load(path)
    assert back.measured.find(KEY, "train", 4, "d4f1t1").points == tuple(GRID)
    assert back.measured.moves == [move]
    assert "measured" not in get_profile("cpu").to_dict()  # profiles without tables keep their format
    bad = hw.to_dict()
    bad["measured"]["calls"][0]["phase"] = "backward"
    with pytest.raises(ValueError, match="phase 'backward'"):
        HardwareProfile.from_dict(bad, "p.yaml")
    bad["measured"]["calls"][0].update(phase="train", points=[[4, 8, 0.1], [4, 8, 0.2]])
    with pytest.raises(ValueError, match="same .rows, length."):
        HardwareProfile.from_dict(bad, "p.yaml")


def test_plan_profile_feeds_plan_choice_and_bad_paths_say_which_key(tmp_path):
    from jaxrlhf import config as cfglib
    from jaxrlhf.run import planning

    hw = profile_with(table("train", GRID))
    path = str(tmp_path / "measured.yaml")
    hw.save(path)
    cfg = cfglib.load_config(None, [f"plan.profile={path}"])
    got = planning.hardware_profile(cfg)
    assert got.measured.find(KEY, "train", 4, "d4f1t1") is not None
    with pytest.raises(cfglib.ConfigError, match="plan.profile: profile file not found"):
        cfglib.load_config(None, [f"plan.profile={tmp_path / 'missing.yaml'}"])
    with pytest.raises(cfglib.ConfigError, match="keep one"):
        cfglib.load_config(None, [f"plan.profile={path}", "plan.hardware=h100"])


def test_a_timed_parameter_move_prices_that_move_the_formulas_the_rest():
    from jaxrlhf.planner.cost import CostCache, realloc_cost

    half, other = DeviceGroup("a", 0, 4), DeviceGroup("b", 4, 4)
    move = {"model": KEY, "what": "params", "src": "0+4:d4f1t1", "dst": "4+4:d2f1t2", "bytes": 1e6, "seconds": 0.25}
    batch = dict(move, what="batch", seconds=9.0)  # a batch move never prices a parameter move
    hw = dataclasses.replace(get_profile("cpu"), measured=Measured([], [batch, move]))
    cache = CostCache({"actor": CFG}, WL, hw)
    assert cache.move_cost(GEN, half, LAY, other, Layout(data=2, tensor=2)) == (0.25, "measured")
    back = cache.move_cost(GEN, other, Layout(data=2, tensor=2), half, LAY)  # the other direction was not timed
    assert back == (realloc_cost(CFG, "lm", other, Layout(data=2, tensor=2), half, LAY, hw), "formula")
    # an adapters-only sync is never what the profiler timed
    assert cache.move_cost(GEN, half, LAY, other, Layout(data=2, tensor=2), adapters_only=True)[1] == "formula"
    assert cache.move(GEN, half, LAY, other, Layout(data=2, tensor=2)) == 0.25
