"""Step graphs of real algorithms for planner and placement tests (built from configs, as training does)."""

from __future__ import annotations

from jaxrlhf.graph import CallGraph


def algorithm_graph(name: str = "ppo", *overrides: str) -> CallGraph:
    """The step graph `algorithm.name=name` declares under the default config plus `overrides`."""
    from jaxrlhf.algorithms import declare
    from jaxrlhf.config import load_config

    return declare(load_config(None, [f"algorithm.name={name}", *overrides])).graph()


def ppo_graph(reward_model: bool = True) -> CallGraph:
    """PPO's full graph: generate, reward / reference / critic inference, actor and critic training."""
    extra = ("rewards.model=true", "model.reward.init_from=actor") if reward_model else ()
    return algorithm_graph("ppo", *extra)
