"""A deliberately wrong planner profile and the small GRPO run it misleads (re-planning's test and
`scripts/bench_replan.py`)."""

from __future__ import annotations

import dataclasses

# GRPO with a tiny actor on 8 simulated CPU devices: a few seconds per step, compiled in under a minute.
TINY_GRPO = [
    "model.actor.preset=tiny", "run.checkpoint_every=0", "run.tensorboard=false", "run.export_hf=false",
    "data.batch_size=8", "data.max_prompt_len=16", "generation.max_new_tokens=4", "sft.steps=0",
    "optimizer.actor.lr=1e-3", "rewards.eos_only=false",
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
    "algorithm.name=grpo", "algorithm.group_size=4", "algorithm.minibatches=2", "algorithm.kl_coef=0.05",
]
WRONG_DEVICES, WRONG_LAYOUT = 8, "d4f1t2"  # where the wrong profile says generation is nearly free


def wrong_profile(overrides: list[str], hardware: str = "cpu"):
    """`hardware`'s profile with prefill and decode tables claiming the config's generation takes 1 us
    on all 8 devices (data 4 x tensor 2), some 10^4 times less than any run measures there: a search
    on it puts generation there, and the first re-plan moves it away."""
    from jaxrlhf import config as cfglib
    from jaxrlhf import planning
    from jaxrlhf.algorithms import declare
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.measured import Measured, Table, model_key

    cfg = cfglib.load_config(None, overrides)
    graph = declare(cfg).graph()
    actor = planning.role_configs(cfg, graph.roles)["actor"]
    key = model_key(actor, graph["actor.generate"].head)
    points = tuple((float(r), float(n), 1e-6) for r in (16, 32) for n in (16, 20))
    tables = [Table(key, phase, WRONG_DEVICES, WRONG_LAYOUT, points) for phase in ("prefill", "decode")]
    return dataclasses.replace(get_profile(hardware), name="wrong", measured=Measured(tables))


def write_wrong_profile(overrides: list[str], path: str, hardware: str = "cpu") -> str:
    """`wrong_profile` written to `path` (a `plan.profile` file); returns `path`."""
    wrong_profile(overrides, hardware).save(path)
    return path
