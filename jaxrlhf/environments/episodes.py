"""A step's prompts played as environment episodes (`env.name`) by the multi-turn engine (`models.multiturn`).

Each row's prompt is its environment's first observation (`reset`), tokenized; the engine decodes every row,
steps the environments of rows that ended a turn while the others decode, and extends each row's cache with
its observation. What comes back is the generate call's layout (`rollouts.GENERATED`, responses padded to
`generation.max_new_tokens`) with `action_mask` and `env_reward`, and the `env/...` metrics; the engine's work
per batch is kept (`EpisodeTiming`) for the planner. With `env.workers` the environments live in worker
processes (`environments.pool`), started at the first batch and kept for the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from jaxrlhf.environments.base import ACTION_MASK, EnvironmentContext, EpisodeTiming, make_environment
from jaxrlhf.environments.tool_calls import detect_tool_format


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """What bounds a batch of episodes: the response width of the rollout batch (`max_new_tokens`), a
    trajectory's budget, its turns and a turn's tokens, an observation's tokens, the actor's positions (None:
    unknown, room for the longest prompt), and the reward of an episode whose environment failed."""

    max_new_tokens: int
    max_tokens: int
    max_turns: int
    max_turn_tokens: int
    max_observation_tokens: int
    max_positions: int | None = None
    threads: int = 4
    failure: float = 0.0

    @classmethod
    def of(cls, cfg: Any, max_new_tokens: int, max_positions: int | None) -> "EpisodeLimits":
        """The limits `cfg.env` sets for a rollout batch of `max_new_tokens` response columns."""
        env = cfg.env
        budget = env.max_tokens or max_new_tokens
        return cls(max_new_tokens, budget, env.max_turns, env.max_turn_tokens or budget, env.max_observation_tokens,
                   max_positions, max(env.threads, env.workers), env.failure)


class EpisodePlayer:
    """Plays a step's rows (the feed's `prompts` and `answers`) as episodes of `env.name` with the actor's
    parameters it is handed (on the generate call's placement): see the module docstring."""

    def __init__(self, cfg: Any, tokenizer: Any, graphdef: Any, sampling: Any, limits: EpisodeLimits,
                 timing: EpisodeTiming | None = None):
        self.cfg, self.tokenizer, self.graphdef, self.sampling, self.limits = cfg, tokenizer, graphdef, sampling, limits
        self.timing = timing if timing is not None else EpisodeTiming()  # what each batch cost the engine
        self.pool: Any = None  # the environments' worker processes (`env.workers`), from the first batch
        template = getattr(tokenizer, "chat_template", None)  # a ByteTokenizer has none
        raw = getattr(tokenizer, "_tok", None)  # HFTokenizer's `tokenizers.Tokenizer`: special tokens as text
        end_of_turn = tuple(raw.id_to_token(i) for i in tokenizer.eos_ids) if raw is not None else ()
        self.context = EnvironmentContext(tokenizer=tokenizer, chat_template=template, end_of_turn=end_of_turn,
                                          tool_format=detect_tool_format(template.tool_source) if template else None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _environments(self, rows: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
        """Each row's environment, reset: in the trainer's process, or in the workers (`env.workers`)."""
        env = self.cfg.env
        if not env.workers:
            envs = [make_environment(env.name, self.context, env.args) for _ in rows]
            return envs, [e.reset(row) for e, row in zip(envs, rows)]
        if self.pool is None:
            from jaxrlhf.environments.pool import EnvPool

            self.pool = EnvPool(env.name, self.context, env.args, workers=env.workers,
                                step_timeout_s=env.step_timeout_s, imports=env.imports)
        return self.pool.reset(rows)

    def __call__(self, params: Any, feed: Mapping[str, Any], *, prefix: str = ""
                 ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The generate call's outputs (named with `prefix`) and the `env/...` metrics of the feed's episodes."""
        from jaxrlhf.models import multiturn
        from jaxrlhf.models.lengths import bucket_length

        tok, lim, env = self.tokenizer, self.limits, self.cfg.env
        rows = [{"prompt": p, "answer": a} for p, a in zip(feed["prompts"], feed["answers"])]
        envs, first = self._environments(rows)
        prefix_ids = [] if self.context.chat_template is not None else list(tok.special_prefix)  # a template has BOS
        prompt_ids = [prefix_ids + tok.encode(observation.text) for observation in first]
        longest = max(len(p) for p in prompt_ids)
        positions = lim.max_positions if lim.max_positions is not None else longest + lim.max_tokens + 16
        room = (positions - lim.max_tokens) // 16 * 16  # prompt columns left beside the trajectory, in pages of 16
        if longest > room:
            raise ValueError(
                f"env.name={env.name}: a first observation (the environment's prompt, e.g. with its tools described) "
                f"of {longest} tokens and a trajectory of env.max_tokens={lim.max_tokens} exceed the actor's "
                f"{positions} positions: shorten the prompts (data.max_prompt_len) or env.max_tokens")
        spec = multiturn.MultiTurnSpec(
            rows=len(rows), prompt_bucket=bucket_length(longest, cap=room), max_tokens=lim.max_tokens,
            max_turn_tokens=lim.max_turn_tokens, sampling=self.sampling, eos_ids=tuple(tok.eos_ids),
            pad_id=tok.pad_id, max_observation_tokens=lim.max_observation_tokens)
        try:  # with workers, a thread per worker waits on its pipe
            out = multiturn.generate_multiturn(self.graphdef, params, envs=envs, rows=rows, encode=tok.encode,
                                               decode_text=tok.decode, rng=feed["rng_generate"], spec=spec,
                                               max_turns=lim.max_turns, threads=lim.threads, prompt_ids=prompt_ids,
                                               failure_reward=lim.failure)
        finally:
            if self.pool is not None:
                self.pool.release(envs)
        self.timing.record(out.decode_steps, out.extends, out.env_wait_s)
        values = padded_to(out.rollout_batch(), lim.max_new_tokens, tok.pad_id)
        return {prefix + k: v for k, v in values.items()}, out.metrics()


def padded_to(values: dict[str, np.ndarray], width: int, pad_id: int) -> dict[str, np.ndarray]:
    """A multi-turn batch (`MultiTurnOutput.rollout_batch`) with its responses right-padded to `width` columns
    (the generate call's response width) and its positions counted over the real tokens again."""
    pad = width - values["response_tokens"].shape[1]
    for name in ("response_tokens", "response_mask", "behaviour_logp", ACTION_MASK, "tokens", "mask"):
        values[name] = np.pad(values[name], ((0, 0), (0, pad)),
                              constant_values=pad_id if name.endswith("tokens") else 0)
    values["positions"] = np.maximum(np.cumsum(values["mask"], axis=1) - 1, 0).astype(np.int32)
    return values
