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


HONEST_DATA_GROUPS = (8, 4, 2)  # data-parallel placements where the wrong profile tells the truth


def wrong_profile(overrides: list[str], hardware: str = "cpu"):
    """`hardware`'s profile with prefill and decode tables claiming the config's generation takes 1 us
    on all 8 devices (data 4 x tensor 2), some 10^4 times less than any run measures there: a search
    on it puts generation there, and the first re-plan moves it away. Its tables on data-parallel
    groups of `HONEST_DATA_GROUPS` devices hold `hardware`'s own estimates, so the one wrong placement
    does not shift the placements the profile did not time (the planner scales those by the median
    error of the timed ones, `planner.cost.measured_cost`)."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.algorithms import declare
    from jaxrlhf.planner.cost import profile_call_cost
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.measured import Measured, Table, model_key
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.run import planning

    cfg = cfglib.load_config(None, overrides)
    algorithm = declare(cfg)
    graph, wl = algorithm.graph(), algorithm.workload()
    actor = planning.role_configs(cfg, graph.roles)["actor"]
    gen = graph["actor.generate"]
    key = model_key(actor, gen.head)
    truth = get_profile(hardware)
    points = tuple((float(r), float(n), 1e-6) for r in (16, 32) for n in (16, 20))
    tables = [Table(key, phase, WRONG_DEVICES, WRONG_LAYOUT, points) for phase in ("prefill", "decode")]
    rows = float(wl.call_seqs(gen))
    for n in HONEST_DATA_GROUPS:  # the whole call as decode steps: the tables then price it as `truth` does
        seconds = profile_call_cost(gen, actor, DeviceGroup("g", 0, n), Layout(data=n), wl, truth).seconds
        tables += [Table(key, "prefill", n, str(Layout(data=n)), ((rows, float(wl.prompt_len), 0.0),)),
                   Table(key, "decode", n, str(Layout(data=n)), ((rows, float(wl.seq_len), seconds / wl.gen_len),))]
    return dataclasses.replace(truth, name="wrong", measured=Measured(tables))


def write_wrong_profile(overrides: list[str], path: str, hardware: str = "cpu") -> str:
    """`wrong_profile` written to `path` (a `plan.profile` file); returns `path`."""
    wrong_profile(overrides, hardware).save(path)
    return path
