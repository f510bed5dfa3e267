"""The `episodes` rollout: each step's prompts played as environment episodes (`env.name`) on the multi-turn
engine, with the actor's parameters on the generate call's placement (`environments.episodes.EpisodePlayer`).

The episodes are the generate call's outputs: they go to the executor with the feed, which then skips the
call. Their seconds count in the step (`time/episodes_s`, added to `time/step_s`), and the engine's measured
work per batch prices the generate call for the planner (`workload_fields`: `planner.episodes`).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from jaxrlhf.environments.base import EpisodeTiming
from jaxrlhf.rollouts import GENERATE_CALL, Rollout, RolloutStep

Played = tuple[dict[str, np.ndarray], dict[str, float]]  # the generate call's outputs, the episodes' metrics


class PlayedRollout(Rollout):
    """A rollout whose batches are played on host (episodes, agents): each step's feed is drawn, played with the
    actor's parameters on the generate call's placement, and handed in with the generate call's outputs."""

    def __init__(self, algorithm: Any):
        super().__init__(algorithm)
        self.played: Any = None  # what plays the steps (`player()`), built at the first step
        self._closer: weakref.finalize | None = None  # closes it once: at `close`, or when the run drops this

    def player(self, feed: Any) -> Any:
        """What plays the steps, built at the first (`feed` is its batch): `player(params, feed, prefix=...) ->
        (outputs, metrics)`, with a `close()`."""
        raise NotImplementedError

    def step(self, step: int) -> RolloutStep:
        this = self.draw(step)
        began = time.perf_counter()
        params, _ = self.executor.params_for("actor", GENERATE_CALL)
        if self.played is None:
            self.played = self.player(this["feed"])
            self._closer = weakref.finalize(self, self.played.close)  # its workers or server stop with the run
        values, metrics = self.played(params, this["feed"], prefix=self.algorithm.generated_prefix)
        seconds = time.perf_counter() - began
        metrics["time/episodes_s"] = seconds
        return RolloutStep({**this["feed"], **values}, this["data_state"], metrics=metrics, seconds=seconds)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()


class EpisodesRollout(PlayedRollout):
    """Environment episodes (`env.name`), played by the multi-turn engine."""

    name = "episodes"

    def __init__(self, algorithm: Any):
        super().__init__(algorithm)
        self.timing = EpisodeTiming()  # the episode batches' measured work, for the planner (`workload_fields`)

    def player(self, feed: Any) -> Any:
        from jaxrlhf.environments.episodes import EpisodeLimits, EpisodePlayer

        alg = self.algorithm
        actor = alg.model_configs.get("actor")
        limits = EpisodeLimits.of(alg.cfg, alg.settings().max_new_tokens,
                                  actor.max_position_embeddings if actor is not None else None)
        return EpisodePlayer(alg.cfg, alg.tokenizer, alg.models["actor"].graphdef, alg.settings().sampling, limits,
                             self.timing)

    def workload_fields(self) -> dict[str, Any]:
        """The multi-turn fields (`planner.episodes`): the extend width the engine's spec gives and the measured
        episode work (0 until a batch ran)."""
        env = self.algorithm.cfg.env
        return {"multi_turn": True, "env_extend_width": 1 + env.max_observation_tokens, **self.timing.fields()}
