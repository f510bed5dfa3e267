"""PPO learns: on a reward a tiny model can discover, the mean reward clearly rises.

The end-to-end guard against sign, alignment and masking bugs that unit tests
of the single pieces can miss (advantage sign, log-prob / value alignment,
reward placement): the full `jaxrlhf.train.run` path, no SFT warm-up, a
randomly initialised tiny actor and a rule reward it can reach by exploration.
"""

from __future__ import annotations

import numpy as np

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics

STEPS = 20


def test_ppo_raises_a_discoverable_reward(tmp_path):
    out = tmp_path / "run"
    cfg = cfglib.load_config(
        None,
        [
            f"run.output_dir={out}",
            f"run.steps={STEPS}",
            "run.seed=0",
            "run.checkpoint_every=0",
            "run.tensorboard=false",
            "run.export_hf=false",
            "plan.strategy=colocated",
            "model.actor.preset=tiny",
            "sft.steps=0",
            "data.source=arithmetic",
            "data.batch_size=16",
            "data.max_prompt_len=16",
            "generation.max_new_tokens=4",
            "algorithm.minibatches=2",
            "algorithm.epochs=2",
            "algorithm.kl_coef=0.01",
            "optimizer.actor.lr=3e-3",
            "optimizer.critic.lr=2e-3",
            "rewards.eos_only=false",
            # 1 when the response holds a digit. A random byte-level policy emits one in about 10 % of
            # its 4-token responses; the policy has to find and reinforce digit tokens.
            'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[0-9]"}}]',
        ],
    )
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = np.array([r["reward/mean"] for r in records])
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    assert first < 0.25, rewards  # the reward is not already solved at the start
    assert last > first + 0.4, rewards  # a clear rise, far beyond batch noise (std ~0.1 per step)
    assert last > 0.6, rewards
    assert records[-1]["kl/mean"] > 0.0  # the policy moved away from the reference to get there
