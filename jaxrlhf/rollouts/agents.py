"""The `agents` rollout (`env.name: openai_agent`): each step's prompts played by agents on the official `openai`
client against the run's endpoint (`environments.agents.AgentEpisodes`), generating with the actor's parameters
on the generate call's placement through the multi-turn engine's cache; every segment of an episode is a row.

Priced by the planner as single-turn generation (agents' episodes report no engine measurements).
"""

from __future__ import annotations

from typing import Any

from jaxrlhf.rollouts.episodes import PlayedRollout


class AgentsRollout(PlayedRollout):
    """Agents through the endpoint; the server is started at the first step (its rows: that step's batch) and
    stops with the run."""

    name = "agents"

    def player(self, feed: Any) -> Any:
        from jaxrlhf.config_schema import AgentServerConfig
        from jaxrlhf.environments.agents import AgentEpisodes

        alg = self.algorithm
        cfg, s = alg.cfg, alg.settings()
        budget = cfg.env.max_tokens or s.max_new_tokens
        return AgentEpisodes(cfg.env.server or AgentServerConfig(), cfg.env.agent,
                             graphdef=alg.models["actor"].graphdef, tokenizer=alg.tokenizer, sampling=s.sampling,
                             max_new_tokens=s.max_new_tokens, turn_tokens=cfg.env.max_turn_tokens or budget,
                             response_budget=budget, batch_size=len(feed["prompts"]),
                             max_positions=alg.model_configs["actor"].max_position_embeddings)
