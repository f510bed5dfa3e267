"""Run assembly: every entry point builds its run through `jaxrlhf.run.assembly.setup`, and a preset
is the same plan from `train` as from `python -m jaxrlhf.plan`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import types

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import plan as plan_cli
from jaxrlhf.run import assembly
from jaxrlhf.run.assembly import Machine, setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


class Assembling(Exception):
    """Raised by the spy in place of `setup`: the entry point reached the one assembly function."""


@pytest.fixture
def spy(monkeypatch):
    calls: list[dict] = []

    def fake_setup(cfg, **kwargs):
        calls.append({"algorithm": cfg.algorithm.name, **kwargs})
        raise Assembling

    monkeypatch.setattr(assembly, "setup", fake_setup)
    return calls


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _quickstart(tmp_path, *overrides: str) -> cfglib.Config:
    return cfglib.load_config(QUICKSTART, [f"run.output_dir={tmp_path / 'run'}", "run.devices=8", *overrides])


def test_every_entry_point_assembles_its_run_through_setup(spy, tmp_path):
    from jaxrlhf import eval as eval_cli
    from jaxrlhf import profile, train
    from jaxrlhf.run import stages

    cfg = _quickstart(tmp_path)
    entry_points = {
        "train": lambda: train.run(cfg),
        "eval": lambda: eval_cli.evaluate(cfg, str(hf)),
        "warm-up": lambda: stages.warm_up_actor(types.SimpleNamespace(cfg=cfg, machine=Machine(8)),
                                                None, None, None, None),
        "profile": lambda: profile.profile(cfg),
        "plan": lambda: plan_cli._main(["--config", QUICKSTART, "--out", str(tmp_path / "plan")]),
        "step_breakdown": lambda: _script("step_breakdown").call_bounds(QUICKSTART, [], 8, None),
        "validate_planner": lambda: _script("validate_planner").predict(cfg, {}, types.SimpleNamespace(num_devices=8),
                                                                        None),
    }
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for name, enter in entry_points.items():
        before = len(spy)
        with pytest.raises(Assembling):
            enter()
        assert len(spy) == before + 1, name
    assert spy[1]["calls"] == ("actor.generate",)  # evaluation runs the generate call alone
    assert spy[2]["machine"] == Machine(8) and spy[2]["algorithm"].name == "sft"  # the warm-up: the run's machine
    assert spy[4]["runtime"] is False  # the plan CLI plans without JAX


def test_replanning_searches_through_the_runs_setup(monkeypatch, tmp_path):
    """The re-planner asks its run's setup (the path `plan_for` takes), with the run's profile
    corrected by the measured call times."""
    from jaxrlhf.run.stages import Replanner

    cfg = _quickstart(tmp_path, "plan.strategy=auto", "plan.replan_every=1")
    run_setup = setup(cfg, machine=Machine.described(cfg, 8), runtime=False)
    plan = run_setup.choose_plan("colocated")  # the plan the run is on
    asked = []

    def replan(current, hardware):
        asked.append((current, hardware))
        raise Assembling

    monkeypatch.setattr(run_setup, "replan", replan)
    replanner = Replanner(run_setup, plan, make_cache=lambda p: None, write=False)
    calls = len(replanner.calls)
    replanner(1, {"time/step_s": 1.0, **{f"time/{c}_s": 0.1 for c in replanner.calls}}, executor=None)
    with pytest.raises(Assembling):
        replanner(2, {"time/step_s": 1.0, **{f"time/{c}_s": 0.1 for c in replanner.calls}}, executor=None)
    assert asked[0][0] is plan and calls == 5
    assert asked[0][1].measured is not None  # the run's own call times, not the bare profile


MULTI_HOST = ["run.distributed=true", "distributed.num_processes=8", "distributed.coordinator_address=localhost:1234",
              "distributed.process_id=0", "run.devices=8"]


@pytest.mark.parametrize("strategy, model, overrides", [
    ("verl", "llama2-7b", ["run.devices=8"]),  # on this JAX's 8 devices, as `train` runs it here
    ("heuristic", "llama2-70b", MULTI_HOST),  # 8 hosts of 8: memory makes it pipeline across hosts
])
def test_a_preset_is_the_same_plan_from_train_and_from_the_plan_cli(strategy, model, overrides, capsys):
    """`heuristic` and `verl` size themselves by the workload and the hardware: the plan a run's setup
    chooses is the one `python -m jaxrlhf.plan` prices for that preset, and not the one the preset
    makes blind to both (which is what `train` ran before)."""
    from jaxrlhf.planner.presets import build_plan

    args = plan_cli.parse_args(["--config", QUICKSTART, "--model-preset", model, "--hardware", "h100",
                                f"plan.strategy={strategy}", *overrides])
    cfg = plan_cli.resolve_config(args)
    cli = setup(cfg, machine=Machine.described(cfg), runtime=False)
    priced = cli.search(iterations=1, time_budget_s=30).presets[strategy].plan
    hosts = cfg.run.distributed
    run_setup = setup(cfg, machine=Machine.described(cfg)) if hosts else setup(cfg)
    assert run_setup.machine.devices == (64 if hosts else 8) and run_setup.machine.runs_here != hosts
    chosen = run_setup.choose_plan()
    assert chosen.groups == priced.groups and chosen.calls == priced.calls
    machine, algorithm = run_setup.machine, run_setup.algorithm
    blind = build_plan(strategy, machine.devices, cli.planned_models, cli.graph, batch_size=algorithm.batch_rows,
                       devices_per_host=machine.per_host)
    assert (blind.groups, blind.calls) != (chosen.groups, chosen.calls)


def test_the_plan_cli_and_step_breakdown_agree_on_the_described_machine(tmp_path, capsys):
    """A machine the run is not on is planned from the config alone: `run.devices` x processes."""
    cfg = _quickstart(tmp_path, "run.distributed=true", "distributed.num_processes=2",
                      "distributed.coordinator_address=localhost:1234", "distributed.process_id=0", "run.devices=4")
    assert Machine.described(cfg) == Machine(8, 4)
    assert Machine.described(cfg, 16) == Machine(16, 4)
    assert plan_cli._main(["--config", QUICKSTART, "--devices", "8", "--out", str(tmp_path / "p"), "--json",
                           "--iterations", "20"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["algorithm"] == "ppo" and os.path.exists(tmp_path / "p" / "plan.yaml")


def test_the_run_runs_the_plans_staleness_within_its_budget():
    """An off-policy plan's own staleness (the search's eta) is what the run uses; none = the budget;
    one above algorithm.max_staleness is refused with both numbers; a plan file may not ask for one
    on an on-policy plan."""
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement, PlanError

    groups = {"gen": DeviceGroup("gen", 0, 1), "train": DeviceGroup("train", 1, 1)}
    calls = {"actor.generate": Placement("gen", Layout()), "actor.train": Placement("train", Layout())}
    plan = ExecutionPlan("test", 2, groups, calls, ("actor",), True)
    cfg = cfglib.load_config(None, ["plan.strategy=auto", "algorithm.max_staleness=3"])
    run = types.SimpleNamespace(cfg=cfg)
    assert assembly.RunSetup.staleness(run, plan) == 3
    assert assembly.RunSetup.staleness(run, dataclasses.replace(plan, staleness=2)) == 2
    assert assembly.RunSetup.staleness(run, dataclasses.replace(plan, offpolicy=False, staleness=None)) == 0
    with pytest.raises(PlanError, match="the plan's staleness=4 runs the generator further ahead than "
                                        "algorithm.max_staleness=3 allows"):
        assembly.RunSetup.staleness(run, dataclasses.replace(plan, staleness=4))
    text = dataclasses.replace(plan, staleness=2).to_yaml()
    assert ExecutionPlan.from_yaml(text).staleness == 2 and "staleness" not in plan.to_yaml()
    with pytest.raises(PlanError, match=r"plan.staleness=2 needs offpolicy: true"):
        ExecutionPlan.from_yaml(text.replace("offpolicy: true", "offpolicy: false"))
    with pytest.raises(PlanError, match=r"plan.staleness must be an integer >= 1"):
        ExecutionPlan.from_yaml(text.replace("staleness: 2", "staleness: 0"))


@pytest.mark.slow
def test_the_run_executes_the_plans_memory_knobs(tmp_path):
    """What the plan chose (a plan file here: micro-batches of 8 rows for the actor's update, the critic's
    value pass in micro-batches of 16, the actor rematerialised) is what the run runs: its roles are built
    with that remat, its calls bound with those micro-batch sizes, and a step runs with them. A key the
    config sets wins over the plan's."""
    from flax import nnx

    from jaxrlhf import train
    from jaxrlhf.models.tokenizer import load_tokenizer

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("""
strategy: custom
num_devices: 2
groups: {all: {start: 0, size: 2}}
calls:
  actor.generate: {group: all, data: 2}
  ref.inference: {group: all, data: 2}
  critic.inference: {group: all, data: 2}
  actor.train: {group: all, data: 2}
  critic.train: {group: all, data: 2}
micro_batch_size: {actor.train: 8, critic.inference: 16}
remat: {actor: full, critic: none}
""")
    cfg = cfglib.load_config(QUICKSTART, [f"run.output_dir={tmp_path / 'run'}", "run.devices=2", "sft.steps=0",
                                          "run.steps=1", f"plan.file={plan_file}", "run.save_checkpoints=false",
                                          "run.export_hf=false", "run.tensorboard=false"])
    run = setup(cfg)
    plan = run.choose_plan()
    assert plan.micro_batch_size == {"actor.train": 8, "critic.inference": 16} and plan.remat["actor"] == "full"
    built = run.build(plan, load_tokenizer(cfg.model.tokenizer))
    assert run.algorithm.execution.micro_batch("actor.train") == 8
    assert run.algorithm.execution.micro_batch("ref.inference") is None
    actor = built.roles["actor"]
    assert nnx.merge(actor.graphdef, actor.params).model.remat == "full"
    assert train.run(cfg) is not None and (tmp_path / "run" / "metrics.jsonl").exists()
    # a key the config sets wins over the plan's
    own = setup(cfglib.with_overrides(cfg, ["model.actor.remat=dots", "algorithm.micro_batch_size=16"]))
    plan = own.choose_plan()
    assert plan.remat["actor"] == "dots" and set(plan.micro_batch_size.values()) == {16}
