"""A PPO run whose actor and critic train (and the critic and reference infer) as 2-stage pipelines,
with the actor reallocated to an unstaged tensor-parallel layout to generate, matches colocated."""

from __future__ import annotations

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement

BASE = [
    "model.actor.preset=tiny", "run.steps=2", "run.checkpoint_every=0", "run.tensorboard=false",
    "run.export_hf=false", "data.batch_size=8", "data.max_prompt_len=16", "generation.max_new_tokens=4",
    "algorithm.minibatches=1", "algorithm.micro_batch_size=4", "sft.steps=0", "optimizer.actor.lr=1e-3",
    "optimizer.critic.lr=1e-3", "rewards.eos_only=false",
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
]
COMPARED = ("reward/mean", "kl/mean", "loss/policy", "loss/value", "entropy", "clipfrac", "approx_kl")
PIPELINED = Layout(stage=2, data=2, fsdp=2)  # 2 micro-batches of 4 rows, each split over data x fsdp


def _plan(path) -> str:
    calls = {c: Placement("all", PIPELINED) for c in ("actor.train", "critic.train", "critic.inference", "ref.inference")}
    calls["actor.generate"] = Placement("all", Layout(data=4, tensor=2))
    ExecutionPlan("pipelined", 8, {"all": DeviceGroup("all", 0, 8)}, calls).save(str(path))
    return str(path)


def _run(tmp_path, name: str, *overrides: str) -> list[dict]:
    out = tmp_path / name
    train.run(cfglib.load_config(None, [*BASE, f"run.output_dir={out}", *overrides]))
    return read_metrics(str(out / "metrics.jsonl"))


@pytest.mark.slow
def test_pipelined_actor_and_critic_match_colocated(tmp_path):
    colocated = _run(tmp_path, "colocated", "plan.strategy=colocated")
    pipelined = _run(tmp_path, "pipelined", f"plan.file={_plan(tmp_path / 'plan.yaml')}")
    assert [r["step"] for r in pipelined] == [r["step"] for r in colocated] == [1, 2]
    for ref, got in zip(colocated, pipelined):
        for key in COMPARED:
            assert got[key] == pytest.approx(ref[key], rel=1e-3, abs=2e-5), (ref["step"], key)
        assert got["realloc/bytes"] > 0  # the actor really moved between its staged home and generation layout
