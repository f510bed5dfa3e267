"""End-to-end training: every strategy reproduces colocated, kill + resume reproduces an
uninterrupted run, and user mistakes get specific messages instead of tracebacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")

# A small, fast PPO run: tiny model, 8 prompts per step, 4 new tokens.
BASE = [
    "model.actor.preset=tiny",
    "run.steps=3",
    "run.checkpoint_every=0",
    "run.tensorboard=false",
    "run.export_hf=false",
    "data.batch_size=8",
    "data.max_prompt_len=16",
    "generation.max_new_tokens=4",
    "algorithm.minibatches=2",
    "sft.steps=0",
    "optimizer.actor.lr=1e-3",
    "optimizer.critic.lr=1e-3",
    "rewards.eos_only=false",
    # A dense rule reward (about a third of random responses hold a lowercase letter or digit), so
    # gradients carry signal: Adam would turn float-noise-sized gradients into full-size steps.
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
]
# runs that are compared, not resumed, write no checkpoint (orbax's save of every role costs seconds)
NO_CKPT = "run.save_checkpoints=false"
COMPARED = ("reward/mean", "kl/mean", "loss/policy", "loss/value", "entropy", "clipfrac", "approx_kl")


def _run(tmp_path, name: str, *overrides: str) -> list[dict]:
    out = tmp_path / name
    cfg = cfglib.load_config(None, [*BASE, f"run.output_dir={out}", *overrides])
    train.run(cfg)
    return read_metrics(str(out / "metrics.jsonl"))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("colocated"), "run", "plan.strategy=colocated", NO_CKPT)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["interleaved", "disaggregated", "reallocated"])
def test_strategy_matches_colocated(strategy, colocated, tmp_path):
    # two steps: step 2 is the first after an update (a third repeats what step 2 proves)
    records = _run(tmp_path, strategy, f"plan.strategy={strategy}", "run.steps=2", NO_CKPT)
    _assert_same_metrics(colocated[:2], records, strategy)
    if strategy in ("disaggregated", "reallocated"):
        # Parameters really moved between placements, device to device.
        assert all(r["realloc/bytes"] > 0 for r in records)
    else:
        # Interleaved: rollout data crosses between the groups; the actor generates on a tensor-parallel copy
        # in its own group (moved inside it, as the colocated hybrid engine does), never across groups.
        assert all(r["transfer/bytes"] > 0 for r in records)


def _assert_same_metrics(ref_records, records, label):
    assert [r["step"] for r in records] == [r["step"] for r in ref_records]
    for ref, got in zip(ref_records, records):
        for key in COMPARED:
            assert got[key] == pytest.approx(ref[key], rel=1e-3, abs=2e-5), (label, ref["step"], key)


@pytest.mark.slow
def test_pipelined_actor_and_critic_match_colocated(colocated, tmp_path):
    """Actor and critic train (critic and reference infer) as 2-stage GPipe pipelines over 2 micro-batches;
    the actor is reallocated to an unstaged tensor-parallel layout to generate. Micro-batching and
    pipelining change no math, so the colocated run (neither) is the reference."""
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement

    staged = Layout(stage=2, data=2, tensor=2)
    calls = {c: Placement("all", staged) for c in ("actor.train", "critic.train", "critic.inference", "ref.inference")}
    calls["actor.generate"] = Placement("all", Layout(data=4, tensor=2))
    plan = tmp_path / "plan.yaml"
    ExecutionPlan("pipelined", 8, {"all": DeviceGroup("all", 0, 8)}, calls).save(str(plan))
    records = _run(tmp_path, "pipelined", f"plan.file={plan}", "algorithm.micro_batch_size=2", "run.steps=2",
                   NO_CKPT)
    _assert_same_metrics(colocated[:2], records, "pipelined")
    assert all(r["realloc/bytes"] > 0 for r in records)  # the actor moved between its staged home and generation


@pytest.mark.slow
def test_a_generator_two_steps_ahead_trains_on_weights_two_updates_old(colocated, tmp_path):
    """algorithm.max_staleness=2 on a disaggregated plan: step 1 is identical to on-policy; the shadow
    generator starts steps 2 and 3 while step 1 trains, so both rollouts come from the initial weights,
    which equal the reference (KL zero, unlike on-policy); step 4's comes from the weights after
    update 1 (KL no longer zero). `plan.offpolicy=true` is the same with a budget of one."""
    records = _run(tmp_path, "stale", "plan.strategy=disaggregated", "algorithm.max_staleness=2", "run.steps=4")
    _assert_same_metrics(colocated[:1], records[:1], "max_staleness=2 step 1")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["rollout/staleness"] for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/policy_version"] for r in records] == [0.0, 0.0, 0.0, 1.0]
    assert abs(records[1]["kl/mean"]) < 1e-5 < abs(colocated[1]["kl/mean"])
    assert abs(records[2]["kl/mean"]) < 1e-5 < abs(colocated[2]["kl/mean"])
    assert abs(records[3]["kl/mean"]) > 1e-5
    assert all(np.isfinite(r["loss/policy"]) for r in records)
    alias = cfglib.load_config(None, [*BASE, "plan.strategy=disaggregated", "plan.offpolicy=true"])
    assert alias.staleness_budget == 1


def test_colocated_metrics_are_complete(colocated):
    needed = {
        "step", "reward/mean", "kl/mean", "loss/policy", "loss/value", "entropy", "clipfrac", "time/step_s",
        "time/realloc_s", "throughput/tokens_per_s", "time/actor.generate_s", "time/ref.inference_s",
        "time/critic.inference_s", "time/actor.train_s", "time/critic.train_s",
    }
    for r in colocated:
        assert needed <= set(r), needed - set(r)
        assert all(v is None or np.isfinite(v) for v in r.values() if isinstance(v, float))
    # The policy moved: KL to the reference is non-zero after the first update.
    assert colocated[-1]["kl/mean"] != 0.0


# ------------------------------------------------------------------ kill and resume


def _train_cmd(out: str, steps: int, *extra: str) -> list[str]:
    # the `colocated` fixture's config on its 8 CPU devices: the CLI runs load its programs from the test
    # run's compilation cache instead of compiling (and planning) their own
    return [
        sys.executable, "-m", "jaxrlhf.train", *BASE, "plan.strategy=colocated", "run.platform=cpu",
        f"run.steps={steps}", f"run.output_dir={out}", "run.checkpoint_every=1", "run.devices=8",
        compile_cache.override(), *extra,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _strip_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in records]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_and_resume_equals_uninterrupted(tmp_path):
    root = ROOT
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    subprocess.run(_train_cmd(full, 4), cwd=root, env=_env(), check=True, capture_output=True, timeout=900)

    proc = subprocess.Popen(
        _train_cmd(killed, 4), cwd=root, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ckpt2 = os.path.join(killed, "checkpoints", "2")
    deadline = time.time() + 900
    while not os.path.isdir(ckpt2) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(ckpt2), "the run never reached its step-2 checkpoint"

    subprocess.run(
        _train_cmd(killed, 4, "run.resume=true"), cwd=root, env=_env(), check=True, capture_output=True,
        timeout=900,
    )
    a = _strip_times(read_metrics(os.path.join(full, "metrics.jsonl")))
    b = _strip_times(read_metrics(os.path.join(killed, "metrics.jsonl")))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b


# ------------------------------------------------------------------ user mistakes


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.kl_cof=0.1"], "unknown config key 'algorithm.kl_cof'; did you mean 'algorithm.kl_coef'?"),
        (["run.steps=ten"], "config key 'run.steps' expects int"),
        (["plan.strategy=collocated"], "plan.strategy"),
        # the quickstart's planner (auto) finds a plan on 3 devices; the colocated preset has none
        (["plan.strategy=colocated", "run.devices=3"], "plan error: colocated: no layout of 3 devices fits role 'actor'"),
    ],
)
def test_cli_errors_are_specific(overrides, message, tmp_path):
    root = ROOT
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config", "configs/quickstart.yaml", *BASE,
         f"run.output_dir={tmp_path}", compile_cache.override(), *overrides],
        cwd=root, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_print_config_round_trips(capsys):
    assert train.main(["--config", QUICKSTART, "--print-config", "run.steps=7"]) == 0
    text = capsys.readouterr().out
    assert cfglib.from_dict(__import__("yaml").safe_load(text)).run.steps == 7


def test_quickstart_config_plans_abstractly():
    cfg = cfglib.load_config(QUICKSTART)
    assert cfg.run.devices == 2 and cfg.run.platform == "cpu"
    json.dumps(cfglib.to_dict(cfg))


@pytest.mark.slow
def test_plan_cli_output_trains(tmp_path):
    """`python -m jaxrlhf.plan` writes a plan.yaml that training runs as `plan.file=`."""
    from jaxrlhf import plan as plan_cli

    out = tmp_path / "planned"
    assert plan_cli.main([
        "--config", QUICKSTART, "--model-preset", "tiny", "--hardware", "cpu", "--devices", "8", "--batch", "8", "--out", str(out),
        # a 3 s search (the test is about the file, not the search; on 8 CPUs it writes the plan 20 s find)
        "--iterations", "300", "--evaluations", "200",
    ]) == 0
    records = _run(tmp_path, "run", f"plan.file={out / 'plan.yaml'}", "run.steps=2", "run.save_checkpoints=false")
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss/policy"]) for r in records)
    # the run folder keeps the plan it ran and the profile it was priced with (scripts/step_breakdown.py)
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import ExecutionPlan

    assert ExecutionPlan.load(str(tmp_path / "run" / "plan.yaml")) == ExecutionPlan.load(str(out / "plan.yaml"))
    assert get_profile(str(tmp_path / "run" / "hardware.yaml")).name == "cpu"
    assert not os.listdir(tmp_path / "run" / "checkpoints")  # run.save_checkpoints=false: not even the last step


@pytest.mark.slow
def test_optimizer_state_in_host_memory_matches_colocated_and_resumes(colocated, tmp_path):
    """plan.offload_optimizer: actor and critic keep their optimizer state in host memory between train
    calls; the run is the colocated one, its checkpoint saves that state from host memory and a resume
    restores it there."""
    offload = "plan.offload_optimizer=[actor, critic]"
    first = _run(tmp_path, "run", "plan.strategy=colocated", offload, "run.steps=2")
    assert all(r["time/optimizer_offload_s"] > 0 for r in first)
    records = _run(tmp_path, "run", "plan.strategy=colocated", offload, "run.steps=3", "run.resume=true")
    assert [r["step"] for r in records] == [1, 2, 3]
    _assert_same_metrics(colocated, records, "optimizer state in host memory, resumed")
    assert "offload_optimizer" in (tmp_path / "run" / "plan.yaml").read_text()


@pytest.mark.slow
def test_resume_onto_a_different_plan(colocated, tmp_path):
    """A colocated checkpoint restores under the interleaved plan and continues the same run."""
    _run(tmp_path, "run", "plan.strategy=colocated", "run.steps=2")
    records = _run(tmp_path, "run", "plan.strategy=interleaved", "run.steps=3", "run.resume=true")
    assert [r["step"] for r in records] == [1, 2, 3]
    _assert_same_metrics(colocated, records, "colocated -> interleaved resume")
