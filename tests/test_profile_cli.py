"""`python -m jaxrlhf.profile`: a measured profile that plan choice reads back."""

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import profile as prof
from jaxrlhf.algorithms import build_algorithm
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.simulator import estimate_plan
from jaxrlhf.run import planning
from jaxrlhf.testing import compile_cache


def test_profile_never_replaces_a_file_and_bad_sizes_are_one_line(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    out.write_text("kept")
    assert prof.main(["--config", "configs/sft.yaml", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "kept"
    assert prof.main(["--config", "configs/sft.yaml", "--out", str(tmp_path / "q.yaml"), "--sizes", "4x"]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_the_grid_times_generation_under_fsdp_too():
    """The interleaved preset generates at its role's FSDP home, so the profile times that layout beside
    data parallelism (the search itself never generates under FSDP)."""
    cfg = cfglib.load_config("configs/quickstart.yaml")
    algorithm = build_algorithm(cfg)
    graph, wl = algorithm.graph(), algorithm.workload()
    actor = planning.role_configs(cfg, list(graph.roles))["actor"]
    layouts = {str(lay) for lay in prof.grid_layouts(graph["actor.generate"], actor, 4, wl, max_tensor=4)}
    assert {"d4f1t1", "d1f4t1"} <= layouts


@pytest.mark.slow
def test_profile_of_sft_feeds_the_train_estimate(tmp_path):
    """SFT's one call (actor.train) on all 8 devices in every single-axis layout, 2 rows x 2 lengths:
    the tables load back, and the plan `train` would run prices its train call from them."""
    out = str(tmp_path / "sft.yaml")
    argv = ["--config", "configs/sft.yaml", "--out", out, "--repeats", "1", "--sizes", "8", "--search-budget", "0",
            "run.devices=8", compile_cache.override()]  # the grid alone (the planned placements: below)
    assert prof.main(argv) == 0
    hw = HardwareProfile.load(out)
    tables = list(hw.measured.tables.values())
    assert {t.phase for t in tables} == {"train"} and {t.devices for t in tables} == {8}
    assert {t.layout for t in tables} >= {"d8f1t1", "d1f8t1"}
    # rows 16 / 32 of the 32-row batch, lengths 10 / 20 (16 prompt + 4 new tokens)
    assert all(sorted((r, n) for r, n, _ in t.points) == [(16, 10), (16, 20), (32, 10), (32, 20)] for t in tables)
    assert all(s > 0 for t in tables for _, _, s in t.points)
    assert {m["what"] for m in hw.measured.moves} == {"params", "batch"}

    cfg = cfglib.load_config("configs/sft.yaml", [f"plan.profile={out}"])
    algorithm = build_algorithm(cfg)
    models = planning.role_configs(cfg, list(algorithm.roles()))
    plan = planning.plan_for(cfg, algorithm, models, 8, chip=planning.Chip("cpu"))
    est = estimate_plan(plan, algorithm.graph(), models, algorithm.workload(), planning.hardware_profile(cfg))
    train = est.calls["actor.train"]
    assert train.source == "measured"
    table = hw.measured.find(tables[0].model, "train", 8, str(plan.calls["actor.train"].layout))
    assert train.seconds == pytest.approx(table.seconds(32, 20))


@pytest.mark.slow
@pytest.mark.parametrize("head", ["value", "reward"])
def test_timer_times_models_without_a_cache_argument(head):
    """A critic's or reward model's inference and train calls are timed too (their forward takes no KV
    cache: the profiler once passed one and failed on every PPO config)."""
    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    timer = prof.Timer(preset("tiny"), head, DeviceGroup("profile", 0, 2), Layout(data=2), repeats=1)
    assert timer.time("inference", 2, 8) > 0 and timer.time("train", 2, 8) > 0


GPU_PROFILE = "profiles/h200-llama3.2-1b-grpo.yaml"
GPU_WORKLOAD = ["run.platform=gpu", "run.devices=null", "model.actor.preset=llama3.2-1b", "data.max_prompt_len=128",
                "generation.max_new_tokens=256", "data.batch_size=16"]


def test_the_stored_gpu_profile_prices_the_workload_it_measured():
    """The H200 profile kept in the repository still loads, and plan choice for the GRPO workload it
    was recorded on prices every call from its tables (the file format and the table lookup agree)."""
    hw = HardwareProfile.load(GPU_PROFILE)
    assert {t.phase for t in hw.measured.tables.values()} == {"prefill", "decode", "inference", "train"}
    cfg = cfglib.load_config("configs/quickstart-grpo.yaml", [*GPU_WORKLOAD, f"plan.profile={GPU_PROFILE}"])
    algorithm = build_algorithm(cfg)
    models = planning.role_configs(cfg, list(algorithm.roles()))
    plan = planning.plan_for(cfg, algorithm, models, 1, chip=planning.Chip("gpu"))
    est = estimate_plan(plan, algorithm.graph(), models, algorithm.workload(), planning.hardware_profile(cfg))
    assert {c.source for c in est.calls.values()} == {"measured"}, {k: c.source for k, c in est.calls.items()}
    # train: 2 minibatches x 2 epochs of the 64-row x 384-token point the profile timed
    (table,) = [t for t in hw.measured.tables.values() if t.phase == "train"]
    assert est.calls["actor.train"].seconds == pytest.approx(4 * table.seconds(64, 384), rel=0.05)


GRPO_8 = ["run.devices=8", "generation.engine=continuous", "data.batch_size=2", "plan.strategy=colocated"]


def _colocated_generate(cfg):
    """(call, devices, layout) the colocated preset gives GRPO's generate call, as the tables are keyed."""
    from jaxrlhf.planner.measured import timed_placement

    algorithm = build_algorithm(cfg)
    models = planning.role_configs(cfg, list(algorithm.roles()))
    plan = planning.plan_for(cfg, algorithm, models, 8, chip=planning.Chip("cpu"))
    placement = plan.calls["actor.generate"]
    return algorithm, models, plan, ("actor.generate", *timed_placement(plan.groups[placement.group].size,
                                                                        placement.layout))


def test_the_profile_proposes_the_layouts_the_planner_weighs():
    """Colocated GRPO generates data 4 x tensor 2 on 8 devices (the tiny model's 4 heads), a layout the
    single-axis grid never times: the planner's own candidates put it on the profile's list."""
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.run.assembly import setup

    cfg = cfglib.load_config("configs/quickstart-grpo.yaml", GRPO_8)
    algorithm, models, _, colocated = _colocated_generate(cfg)
    _, devices, layout = colocated
    assert layout.data > 1 and layout.tensor > 1
    grid = prof.grid_layouts(algorithm.graph()["actor.generate"], models["actor"], devices, algorithm.workload(), 8)
    assert layout not in grid
    planned = prof.planned_placements(cfg, setup(cfg), get_profile("cpu"), budget_s=1.0)
    assert colocated in planned
    assert {name for name, _, _ in planned} == {c.name for c in algorithm.graph().calls}


@pytest.mark.slow
def test_a_profile_prices_the_colocated_generate_call_from_its_own_table(tmp_path, monkeypatch):
    """End to end, generate alone and without the grid (cheap): the profile holds prefill and decode
    tables of the colocated plan's generate layout, the decode timed through the continuous engine, and
    plan choice prices that call from them (`source == "measured"`), not from other layouts' errors."""
    monkeypatch.setattr(prof, "grid_layouts", lambda *a: [])
    cfg = cfglib.load_config("configs/quickstart-grpo.yaml", GRPO_8)
    hw = prof.profile(cfg, repeats=1, sizes=[8], calls=["actor.generate"], search_budget_s=1.0)
    out = str(tmp_path / "grpo.yaml")
    hw.save(out)
    cfg = cfglib.with_overrides(cfg, [f"plan.profile={out}"])
    algorithm, models, plan, (_, devices, layout) = _colocated_generate(cfg)
    key = next(iter(HardwareProfile.load(out).measured.tables))[0]
    for phase in ("prefill", "decode"):
        assert hw.measured.find(key, phase, devices, str(layout)) is not None, phase
    # decode points at prompt + 3 and + 4 new tokens (max_new_tokens 4: the engine's own cache widths)
    assert {n for _, n, _ in hw.measured.find(key, "decode", devices, str(layout)).points} == {19, 20}
    est = estimate_plan(plan, algorithm.graph(), models, algorithm.workload(), planning.hardware_profile(cfg))
    assert est.calls["actor.generate"].source == "measured"
