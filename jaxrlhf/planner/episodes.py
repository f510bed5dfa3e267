"""What a generate call costs as its rollout kind runs it (`jaxrlhf.rollouts`), and what multi-turn episodes
cost it, as the multi-turn engine runs them (`env.name`).

Every generate call's price goes through `rollout_cost`: the price registered in `ROLLOUT_PRICES` for the
kind its workload describes (`rollout_kind`): `generation` (the engine's single-turn generation, its
streaming and response lengths already in the call's cost) or `episodes` (below). A rollout kind tells the
planner what it runs through its workload fields (`Rollout.workload_fields`); one that costs otherwise
registers its price here, so the cost model and the search need no change.

Why: an episode is several turns, each ending on an environment step the batch may wait for and an
observation prefilled onto the row's cache (an extend forward); priced as one turn to the cap, a run whose
environments take seconds a step (a sandbox, a judge, a browser) is mis-priced, and a re-plan cannot see it.

`models.multiturn.generate_multiturn` prefills the prompts, then loops: a decode chunk of every row (rows
waiting on their environment ride along masked), the environment steps of the rows that ended a turn on
host threads while the next chunk decodes, and one extend forward over every row for the observations that
came back; when no row is left to decode it waits for an environment. Every device runs the whole batch
(the engine's pool is not sharded: `Workload.generate_shape`). So a batch costs

    prefill + decode x steps / gen_len + extends x prefill x extend_width / prompt_len + wait

with `cost` the call priced as single-turn generation of gen_len steps (its tables or formulas on the
placement), `steps`, `extends` and `wait` what the run measured per batch (`environments.EpisodeTiming`,
`Workload.env_*`): the engine's decode steps, its extend forwards and its seconds blocked on environments.
An extend is priced as a prefill of its tokens (per token as the prompts' prefill; the longer cache it
attends to is left out: it errs short by that attention). Measured quantities are the batch's, not the
placement's: a faster placement decodes a chunk sooner, so more of the environments' time shows as wait
than the run that measured it saw (the estimate errs short there too). Before a batch was measured
(steps 0) the call is priced as one turn to the cap, with no extend and no wait.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from jaxrlhf.registry import Registry

if TYPE_CHECKING:  # cost.py imports this module
    from jaxrlhf.planner.cost import CallCost
    from jaxrlhf.planner.workload import Workload


def episode_parts(parts: dict[str, float], wl: Workload) -> dict[str, float]:
    """A single-turn generate call's `parts` as an episode batch runs them (module docstring): the prefill
    kept, every other part (decode, its collectives and launches over gen_len steps) scaled to the measured
    steps, and the extends and the environments' wait added."""
    prefill = parts.get("prefill", 0.0)
    scale = (wl.env_decode_steps or wl.gen_len) / wl.gen_len
    return {**{k: v if k == "prefill" else v * scale for k, v in parts.items()},
            "extend": prefill * wl.env_extends * wl.env_extend_width / wl.prompt_len, "env_wait": wl.env_wait_s}


def episode_cost(cost: CallCost, wl: Workload) -> CallCost:
    """`cost` (the generate call priced as one turn) as an episode batch costs it."""
    parts = episode_parts(cost.parts, wl)
    return dataclasses.replace(cost, seconds=sum(parts.values()), parts=parts)


RolloutPrice = Callable[["CallCost", "Workload"], "CallCost"]  # (the call priced as one turn, workload) -> its cost
ROLLOUT_PRICES: Registry[RolloutPrice] = Registry("rollout price", entries={
    "generation": lambda cost, wl: cost,  # the engine's call as the cost model priced it
    "episodes": episode_cost,
})


def rollout_kind(wl: Workload) -> str:
    """The price a generate call of `wl` takes: its rollout's episodes (`multi_turn`), else generation."""
    return "episodes" if wl.multi_turn else "generation"


def rollout_cost(cost: CallCost, wl: Workload) -> CallCost:
    """A generate call's `cost` (priced as one turn) as its rollout kind runs it."""
    return ROLLOUT_PRICES.get(rollout_kind(wl))(cost, wl)

