"""Rollouts: what produces a step's samples, behind one interface whatever produces them.

The step loop (`run.stages.run_steps`) asks the algorithm's rollout for each step's batch (`Rollout.step`)
and hands it to the executor; the step graph's generate call takes its function from the rollout too
(`Rollout.generate_function`). The kinds, registered by name in `ROLLOUTS`:

- `graph`: the step's feed as drawn; the generate call runs inside the step graph on the static or
  continuous engine (`generation.engine`, `models.engines`) where the plan places it; on an off-policy plan
  the next steps' rollouts start while this one trains (`staleness`);
- `stream`: partial rollouts (`generation.partial_rollout`): the streaming engine (`models.streaming`) runs
  across steps on the generate placement, admits prompts per group and takes new weights mid-response;
- `episodes`: environment episodes (`env.name`) on the multi-turn engine (`models.multiturn`);
- `agents`: agents on the official `openai` client through the run's endpoint (`env.name: openai_agent`),
  answered by the multi-turn engine's cache (`environments.backends`).

Every kind but `graph` produces the generate call's outputs itself, with the actor's parameters on the
generate call's placement (`executor.params_for`), and hands them in with the feed: the executor skips a
node whose outputs it is given, so the step graph, the executor and the planner are the same for every
kind. What a kind costs the planner sees through the workload fields it reports (`workload_fields`, priced
by `planner.episodes.rollout_cost`). A new kind subclasses `Rollout`, registers itself and is chosen with
`generation.rollout: NAME` (docs/architecture.md, "A new rollout kind").

This module imports no JAX (config validation checks names against `ROLLOUTS`); the kinds do.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from jaxrlhf.environments.base import ACTION_MASK
from jaxrlhf.registry import Registry

if TYPE_CHECKING:
    from jaxrlhf.placement.executor import Executor

# The rollout batch's values, as the generate call outputs them (prompt left-padded, then the response).
SEQUENCE = ("tokens", "mask", "positions")
RESPONSE = ("response_tokens", "response_mask")
GENERATED = (*SEQUENCE, *RESPONSE, "behaviour_logp", "ended_with_eos")
ENV_GENERATED = (ACTION_MASK, "env_reward")  # an episode's values beside GENERATED (`env.name`)
# router replay: every token's experts per layer as the generate call routed it, [batch, prompt + response,
# layers, k] (`GenerationOutput.experts`); a sequence value (cut and packed as `tokens` are)
ROUTED = "router_experts"
GENERATE_CALL = "actor.generate"

Draw = Callable[[int], dict[str, Any]]  # step -> {"feed", "data_state"}: the step's batch, drawn once, in order


@dataclasses.dataclass
class RolloutStep:
    """What a rollout hands the step loop for one step: the feed (with the generate call's outputs when the
    rollout produced them), the data position after the step's batch (where a run resumed from this step
    continues), the feeds of later steps whose rollouts start while this one trains (an off-policy plan), the
    rollout's metrics, the seconds it spent on the batch outside the executor's step (they count in
    `time/step_s`) and host work to run while the train calls run (`overlap`)."""

    feed: dict[str, Any]
    data_state: dict
    ahead: tuple[Mapping[str, Any], ...] = ()
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    overlap: Callable[[], None] | None = None


class Rollout(abc.ABC):
    """One kind of rollout for one run: built with the algorithm (its runtime: settings, tokenizer, models),
    started once the executor exists (`begin`), asked for each step's batch in order (`step`), told when the
    step's update is done (`trained`) and when a re-plan moves the run to another plan (`before_move`, then
    `moved_to`)."""

    name: ClassVar[str] = ""

    def __init__(self, algorithm: Any):
        self.algorithm = algorithm
        self.executor: "Executor | None" = None
        self.draw: Draw | None = None
        self.staleness = 0

    def begin(self, executor: "Executor", *, draw: Draw, start: int, stop: int, staleness: int = 0) -> None:
        """Steps `start + 1 .. stop` follow on `executor`; `draw(step)` gives a step's batch; `staleness`: how
        many updates a trained rollout's policy may lag (0: on-policy)."""
        self.executor, self.draw, self.staleness = executor, draw, staleness

    @abc.abstractmethod
    def step(self, step: int) -> RolloutStep:
        """The batch of `step` (steps come in order)."""

    def trained(self) -> None:
        """The step's update is done and synced: later samples may use the new weights."""

    def before_move(self) -> dict[str, float]:
        """A re-plan is about to move the weights to another plan: leave nothing in flight; returns metrics."""
        return {}

    def moved_to(self, executor: "Executor") -> None:
        """Go on on `executor` (the plan a re-plan switched to)."""
        self.executor = executor

    def generate_function(self) -> Callable[..., Any]:
        """The generate call's function in the step graph. A kind that produces the call's outputs itself
        gives a function that says so if it is ever run."""
        kind = self.name

        def produced_by_the_rollout(params: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
            raise RuntimeError(f"the {kind!r} rollout hands the generate call's outputs to the step; the "
                               "executor runs this call only when they are missing from the feed")

        return produced_by_the_rollout

    def workload_fields(self) -> dict[str, Any]:
        """The planner's workload fields this kind sets (`planner.workload.Workload`); none: the generate call
        is priced as the engine's single-turn generation."""
        return {}

    def close(self) -> None:
        """Stop what the rollout started (worker processes, a server)."""


# name -> the kind's class, or "module:Class" for the built-in kinds (imported on first use: their modules
# import JAX, and config validation must not)
ROLLOUTS: Registry[Any] = Registry("rollout kind", entries={
    "graph": "jaxrlhf.rollouts.graph:GraphRollout",
    "stream": "jaxrlhf.rollouts.stream:StreamRollout",
    "episodes": "jaxrlhf.rollouts.episodes:EpisodesRollout",
    "agents": "jaxrlhf.rollouts.agents:AgentsRollout",
})
register_rollout = ROLLOUTS.register


def rollout_class(name: str) -> type[Rollout]:
    """The class of rollout kind `name` (a built-in kind's module imported now)."""
    entry = ROLLOUTS.get(name)
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry


def make_rollout(algorithm: Any) -> Rollout:
    """The rollout of the kind `algorithm.rollout_kind` names, for `algorithm`."""
    return rollout_class(algorithm.rollout_kind)(algorithm)


__all__ = ["ENV_GENERATED", "GENERATED", "GENERATE_CALL", "RESPONSE", "ROLLOUTS", "ROUTED", "SEQUENCE", "Rollout",
           "RolloutStep", "make_rollout", "register_rollout", "rollout_class"]
