"""Rollout kinds (`jaxrlhf.rollouts`): one interface whatever produces the samples. A toy kind (the one
docs/architecture.md's recipe writes) plugs in by implementing the interface and registering it, and a GRPO
step trains on what it produced; the built-in kinds are picked from the config, and the planner prices each
through its workload fields."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.rollouts import ROLLOUTS, Rollout, RolloutStep, rollout_class

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
GRPO = ["algorithm.name=grpo", "algorithm.group_size=2", "model.actor.preset=tiny", "model.tokenizer=byte",
        "data.batch_size=2", "data.max_prompt_len=16", "generation.max_new_tokens=8", "algorithm.minibatches=1",
        "algorithm.kl_coef=0.0", "sft.steps=0", "run.steps=1", "run.checkpoint_every=0", "run.tensorboard=false",
        "run.export_hf=false", "run.save_checkpoints=false", "plan.strategy=colocated"]


def _canned_rollout() -> type[Rollout]:
    """The toy kind of docs/architecture.md ("A new rollout kind"), as written there."""
    text = DOC.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("### A new rollout kind"):], re.S).group(1)
    namespace = {"register_rollout": lambda name: (lambda cls: cls), "Rollout": Rollout, "RolloutStep": RolloutStep,
                 "np": np}
    exec(code, namespace)
    return namespace["CannedRollout"]


def test_the_config_picks_the_kind():
    from jaxrlhf.algorithms import declare

    def kind(*overrides):
        return declare(cfglib.load_config(None, ["algorithm.name=grpo", "algorithm.group_size=2", *overrides]))

    assert kind().rollout_kind == "graph"
    assert kind("generation.engine=continuous", "generation.partial_rollout=true").rollout_kind == "stream"
    assert kind("generation.engine=continuous", "env.name=tools", "rewards.rules=[]").rollout_kind == "episodes"
    assert kind("env.name=openai_agent", "env.agent=m:f", "rewards.rules=[]").rollout_kind == "agents"
    assert declare(cfglib.load_config(None, ["algorithm.name=sft"])).rollout_kind == "graph"  # a stage's feed
    with pytest.raises(cfglib.ConfigError, match="unknown rollout kind 'canned'"):
        cfglib.load_config(None, [*GRPO, "generation.rollout=canned"])
    with pytest.raises(cfglib.ConfigError, match="generation.rollout=graph applies to rollouts"):
        cfglib.load_config(None, ["algorithm.name=sft", "generation.rollout=graph"])
    for name in ("graph", "stream", "episodes", "agents"):  # the built-in kinds, imported on first use
        assert issubclass(rollout_class(name), Rollout) and rollout_class(name).name == name


def test_a_toy_rollout_kind_plugs_in_and_trains_a_step(tmp_path):
    """The recipe's kind registered, chosen by `generation.rollout`, and a GRPO step trained on its responses:
    the rule reward scores every canned answer 1 (they are the references), the planner prices its generate
    call as single-turn generation, and nothing else of the run changed."""
    from jaxrlhf import train
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.metrics import read_metrics

    canned = _canned_rollout()
    with ROLLOUTS.temporarily("canned", canned):
        cfg = cfglib.load_config(None, [*GRPO, "generation.rollout=canned", f"run.output_dir={tmp_path / 'run'}"])
        algorithm = build_algorithm(cfg)
        assert isinstance(algorithm.rollout, canned) and not algorithm.workload().multi_turn
        train.run(cfg)
    assert "canned" not in ROLLOUTS
    step, = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert step["reward/rule_mean"] == 1.0 and step["response/eos_frac"] == 1.0
    assert np.isfinite(step["loss/policy"]) and "time/actor.generate_s" not in step  # the step graph skipped it
