"""Environments for multi-turn rollouts: the interface, a registry, the trajectory record and the measured
cost of episode batches. The built-in tool environment is `environments.tools`.

An environment plays the other side of a conversation with the policy (docs/agentic.md,
"Environments"). The rollout calls

    observation = env.reset(row)            # the episode's first observation (the prompt)
    result = env.step(action_text)          # after each of the model's turns: StepResult(observation,
                                            #   reward, done, info)

and appends `result.observation.text`'s tokens to the row's sequence (prefilled onto its KV cache,
masked out of the loss) until `done`, a turn limit or the token budget ends the episode. Actions
are the decoded text of the model's turn (without its end-of-turn token); observations are text,
tokenised by the rollout with the policy's tokenizer, so the tokens trained are the tokens sampled
plus the observation tokens exactly as the tokenizer writes them (`Trajectory`).

Environments are registered by name (`@register_environment("name")` on a factory called with the
config's `env.args` and a `EnvironmentContext`), as rule rewards are; `env.name` picks one. This module
needs no JAX, so config validation can check the names.

Faults are values: a tool call the model got wrong (bad JSON, an unknown tool, wrong arguments) or a
tool that raised becomes an error observation the model sees, counted in `StepResult.info` (and so in
the trajectory's `counters` and the step's `env/...` metrics), never an exception.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any, Callable, Mapping, Protocol, Sequence

from jaxrlhf.registry import Registry

# A multi-turn batch's column [batch, response]: 1 on the tokens the policy sampled, 0 on observation tokens
# and padding; the RL math (losses, advantages, KL, entropy, value targets) counts only its tokens, where a
# single-turn batch, which has none, counts `response_mask`'s.
ACTION_MASK = "action_mask"

# ---------------------------------------------------------------- the interface


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the environment shows the model: text the rollout tokenises and appends to the sequence."""

    text: str


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One environment step: the next observation (None when `done`), the reward this step earned, whether the
    episode ended, and counts for metrics (e.g. {"malformed_tool_call": 1.0}); summed over the episode."""

    observation: Observation | None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """One episode at a time: `reset` for a dataset row, then `step` once per model turn."""

    def reset(self, row: Mapping[str, Any]) -> Observation: ...

    def step(self, action_text: str) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class EnvironmentContext:
    """What a factory may need from the run: the policy's tokenizer and chat template (None for raw
    prompts), the template family whose tool-call format the model writes, and the end-of-turn texts (the
    tokenizer's EOS tokens as text) that close an assistant turn in a rendered conversation."""

    tokenizer: Any = None
    chat_template: Any = None
    tool_format: str | None = None
    end_of_turn: tuple[str, ...] = ()


EnvironmentFactory = Callable[..., Environment]  # factory(context, **env.args) -> Environment

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry("environment")
register_environment = ENVIRONMENTS.register


def make_environment(name: str, context: EnvironmentContext, args: Mapping[str, Any] | None = None) -> Environment:
    """A fresh environment (one per episode) from the factory registered as `name`."""
    return ENVIRONMENTS.get(name)(context, **dict(args or {}))


# ---------------------------------------------------------------- the trajectory


@dataclasses.dataclass
class Trajectory:
    """One episode, token in / token out: `prompt_ids` (the first observation), then `token_ids`, the model's
    sampled tokens and the observations' tokens interleaved, with the behaviour policy's log-probs
    (`logprobs`, 0 on observation tokens) and `loss_mask` (1 on tokens the model sampled, 0 on observation
    tokens: only the model's tokens carry loss). `reward` is the environment's (summed over steps), `turns`
    the model turns taken, `counters` the steps' `info` summed, `finish` why it ended ("done": the
    environment said so, "max_turns", "max_tokens": the trajectory's budget, "env_error": a step raised)."""

    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    finish: str = ""

    def add_model_tokens(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.token_ids += [int(i) for i in ids]
        self.logprobs += [float(x) for x in logprobs]
        self.loss_mask += [1] * len(ids)

    def add_observation_tokens(self, ids: Sequence[int]) -> None:
        self.token_ids += [int(i) for i in ids]
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def add_step(self, result: StepResult) -> None:
        self.reward += float(result.reward)
        for key, value in result.info.items():
            self.counters[key] = self.counters.get(key, 0.0) + float(value)


class EpisodeTiming:
    """What the multi-turn engine spent on the run's episode batches, as it measured them
    (`models.multiturn.MultiTurnOutput`): per batch, the decode steps it ran, its extend forwards (observations
    prefilled onto the cache) and the seconds it waited on environments with no row left to decode; the
    median of each over the latest WINDOW batches. The planner prices a multi-turn generate call with them
    (`Workload.env_decode_steps`, `env_extends`, `env_wait_s`; `planner.episodes`); all 0 before a batch ran."""

    WINDOW = 32

    def __init__(self):
        self._batches: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=self.WINDOW)

    def record(self, decode_steps: int, extends: int, wait_s: float) -> None:
        self._batches.append((decode_steps, extends, wait_s))

    def fields(self) -> dict[str, float]:
        """The workload's measured episode fields: medians, or 0 before anything was measured."""
        if not self._batches:
            return {"env_decode_steps": 0.0, "env_extends": 0.0, "env_wait_s": 0.0}
        steps, extends, wait = zip(*self._batches)
        return {"env_decode_steps": float(statistics.median(steps)), "env_extends": float(statistics.median(extends)),
                "env_wait_s": float(statistics.median(wait))}
