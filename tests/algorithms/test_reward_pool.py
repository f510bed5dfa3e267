"""`rewards.workers`: rule rewards scored in worker processes give the scores the step's host step
gives, and with partial rollouts each group is scored while the rest of the batch decodes."""

from __future__ import annotations

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.algorithms.reward_pool import RewardPool
from jaxrlhf.algorithms.rules import CombinedReward
from jaxrlhf.metrics import read_metrics

SPEC = [("exact_match", 1.0, {}), ("format", 0.5, {"pattern": "[0-9]+"})]


def test_workers_score_what_the_rules_score():
    prompts = [f"{i}+1=" for i in range(7)]
    responses = ["1", "2", "x", "3", "4", "", "7"]
    answers = ["1", "3", "3", "3", "5", "6", "7"]
    pool = RewardPool(SPEC, workers=2)
    try:
        assert pool.score(prompts, responses, answers) == CombinedReward(SPEC).batch_components(
            prompts, responses, answers)
        parts, seconds = pool.submit(prompts[:2], responses[:2], answers[:2]).result()
        assert len(parts) == 2 and seconds >= 0
    finally:
        pool.close()
    with pytest.raises(ValueError, match="at least one worker"):
        RewardPool(SPEC, workers=0)


@pytest.mark.slow
def test_a_stream_scored_by_workers_trains_like_one_scored_in_the_step(tmp_path):
    """GRPO with partial rollouts: the same run with the rules scored in the step's host step and by two
    worker processes as groups finish (the host step skipped): the same rewards and updates."""
    base = ["model.actor.preset=tiny", "run.devices=2", "run.steps=2", "run.checkpoint_every=0",
            "run.save_checkpoints=false", "run.tensorboard=false", "run.export_hf=false", "data.batch_size=4",
            "data.max_prompt_len=16", "generation.max_new_tokens=8", "generation.engine=continuous",
            "generation.partial_rollout=true", "generation.stream_chunk=3", "algorithm.name=grpo",
            "algorithm.group_size=2", "algorithm.minibatches=2", "algorithm.max_staleness=1", "sft.steps=0",
            "rewards.eos_only=false", 'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
            "plan.strategy=colocated"]
    runs = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        train.run(cfglib.load_config(None, [*base, f"rewards.workers={workers}", f"run.output_dir={out}"]))
        runs[workers] = read_metrics(str(out / "metrics.jsonl"))
    for ref, got in zip(runs[0], runs[2]):
        for key in ("reward/mean", "reward/rule_mean", "loss/policy", "entropy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (ref["step"], key)
        assert 0.0 <= got["reward/hidden_frac"] <= 1.0 and got["time/reward_work_s"] > 0
        assert "reward/hidden_frac" not in ref
