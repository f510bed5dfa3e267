"""Agents written against the official `openai` client, trained through the run's endpoint (`env.name:
openai_agent`): each row is played by one agent (`env.agent`, "module:function") in a thread of its own with a
client on its episode's base URL; its episode's segments come back as the rollout's rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxrlhf.environments.backends import CachedBackend, PlacedBackend
from jaxrlhf.environments.base import Trajectory
from jaxrlhf.environments.records import Episode
from jaxrlhf.environments.server import ChatEndpoint
from jaxrlhf.models.tokenizer import Tokenizer

AgentFn = Callable[[Any, Any], "float | None"]


def load_agent(spec: str) -> AgentFn:
    """`module:function` (env.agent) as the function; one clear error when it cannot be found."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"env.agent={spec!r}: write it as 'module:function', e.g. 'my_agents:solve'")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.agent={spec!r}: {e}") from None
    if not callable(function):
        raise ValueError(f"env.agent={spec!r} is not a function")
    return function


def openai_client(base_url: str, **kwargs: Any) -> Any:
    """An `openai.OpenAI` client on one episode's base URL, never through a proxy (the endpoint is local)."""
    try:
        import openai
    except ImportError:
        raise ImportError("env.name=openai_agent gives agents an openai.OpenAI client: pip install openai") from None
    kwargs.setdefault("api_key", "jaxrlhf")  # the endpoint checks no key, the client insists on one
    kwargs.setdefault("max_retries", 0)  # a refused request is the agent's to handle, not to repeat
    kwargs.setdefault("http_client", openai.DefaultHttpxClient(trust_env=False))
    return openai.OpenAI(base_url=base_url, **kwargs)


@dataclasses.dataclass
class AgentResult:
    """One episode after its agent returned: the record, its return value (None when it returned none or
    raised), and the error text when it raised."""

    episode: Episode
    reward: float | None
    error: str | None = None


def run_agents(endpoint: ChatEndpoint, agent: AgentFn, rows: Sequence[Any], *,
               client: Callable[[str], Any] = openai_client, timeout_s: float | None = None) -> list[AgentResult]:
    """One thread per row, each calling `agent(client, row)` with a client on its own episode; wait for all.
    An agent that raises (or returns something that is not a number or None) is recorded as failed, the
    rest go on. Each episode is closed when its agent returns, so its record is final."""
    results: list[AgentResult | None] = [None] * len(rows)
    episodes = [endpoint.open_episode(row) for row in rows]

    def one(i: int) -> None:
        episode = episodes[i]
        reward, error, session = None, None, None
        try:
            session = client(endpoint.base_url(episode))
            value = agent(session, rows[i])
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                        or not np.isfinite(value):
                    raise TypeError(f"the agent returned {value!r}; return a finite number or None")
                reward = float(value)
        except Exception as e:  # noqa: BLE001 - an agent's failure is its episode's, not the run's
            error = f"{type(e).__name__}: {e}"
        finally:
            if hasattr(session, "close"):  # its kept-alive connections, so no server thread waits on them
                session.close()
        results[i] = AgentResult(endpoint.close_episode(episode), reward, error)

    threads = [threading.Thread(target=one, args=(i,), name=f"agent-{i}", daemon=True) for i in range(len(rows))]
    for t in threads:
        t.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in threads:
        t.join(None if deadline is None else max(deadline - time.monotonic(), 0))
    for i, result in enumerate(results):
        if result is None:  # still running past the timeout: its episode ends now (later requests get 404)
            results[i] = AgentResult(endpoint.close_episode(episodes[i]), None, f"timed out after {timeout_s} s")
    return list(results)  # type: ignore[arg-type] - a thread past the timeout may still write its slot


def episode_trajectories(result: AgentResult, *, failure: float = 0.0) -> list[Trajectory]:
    """An agent's episode as the trainer's trajectories: one per segment (a rewritten history is a sequence
    of its own), each with the episode's reward: the agent's return value, `failure` when it raised or timed
    out, 0 when it returned None (rule rewards on `Episode.final_text` are added by the rollout, as for
    environments). The episode's counts (`requests`, `rewrite`, `agent_error`) ride on its last trajectory,
    so summing over trajectories counts each episode once."""
    episode = result.episode
    reward = failure if result.error is not None else (result.reward or 0.0)
    finish = "error" if result.error is not None else "done"
    out = [Trajectory(list(seg.prompt), list(seg.tokens), list(seg.logprobs), list(seg.loss_mask), reward=reward,
                      turns=seg.turns, finish=finish) for seg in episode.segments]
    if out:
        out[-1].counters = {"requests": float(episode.requests), "rewrite": float(episode.matches["rewrite"]),
                            "agent_error": float(result.error is not None)}
    return out


def agent_output(results: Sequence[AgentResult], *, prompt_width: int | None, response_width: int, pad_id: int,
                 failure: float = 0.0) -> Any:
    """The agents' episodes as the multi-turn rollout's batch (`models.multiturn.MultiTurnOutput`), every segment
    a row of its own with its episode's reward (an agent that rewrote its history sampled every segment: all of
    them are trained, as peers train an agent's requests): rows [0, E) hold each episode's last segment, in
    order (its final answer is in it), rows [kE, (k+1)E) the k-th segment before the last of each episode, or,
    for an episode with fewer, an empty row (no response: nothing to train) that still carries its episode's
    reward. So every block of E rows is the episodes in the batch's order, and a group baseline over adjacent
    rows (GRPO's) compares the same episodes' rewards in every block. The episodes' metrics are their first
    rows' (`MultiTurnOutput.episodes`). Prompts are left-padded to `prompt_width` (None: the bucket of the
    longest), responses right-padded to `response_width`. An episode without a request (its agent failed first)
    is a row of one pad token with no response, scored as it failed. The endpoint's `max_prompt_tokens` /
    `max_response_tokens` keep every segment inside the widths; a longer one is an error here."""
    from jaxrlhf.models.lengths import bucket_length
    from jaxrlhf.models.multiturn import MultiTurnOutput

    episodes = len(results)
    trajectories = [episode_trajectories(result, failure=failure) for result in results]
    lasts = [t[-1] if t else Trajectory([pad_id], reward=failure, finish="error") for t in trajectories]
    blocks = max([1, *map(len, trajectories)])
    table = [lasts]  # block k: each episode's k-th segment before its last, or an empty row with its reward
    for k in range(1, blocks):
        table.append([t[-1 - k] if len(t) > k else Trajectory([pad_id], reward=last.reward, finish=last.finish)
                      for t, last in zip(trajectories, lasts)])
    segments = [trajectory for block in table for trajectory in block]
    rows = len(segments)
    if prompt_width is None:
        prompt_width = bucket_length(max((len(seg.prompt_ids) for seg in segments), default=1))
    prompts = np.full((rows, prompt_width), pad_id, np.int32)
    prompt_mask = np.zeros((rows, prompt_width), bool)
    tokens = np.full((rows, response_width), pad_id, np.int32)
    response_mask = np.zeros((rows, response_width), bool)
    loss_mask = np.zeros((rows, response_width), bool)
    logprobs = np.zeros((rows, response_width), np.float32)
    lengths, rewards, turns = np.zeros(rows, np.int32), np.zeros(rows, np.float32), np.zeros(rows, np.int32)
    counters, finish = [], []
    for r, seg in enumerate(segments):
        result = results[r % episodes]
        if len(seg.prompt_ids) > prompt_width or len(seg.token_ids) > response_width:
            raise ValueError(f"episode {result.episode.episode_id}: a prompt of {len(seg.prompt_ids)} and a response "
                             f"of {len(seg.token_ids)} tokens do not fit widths {prompt_width} and {response_width}; "
                             "give the endpoint max_prompt_tokens and max_response_tokens")
        n = len(seg.token_ids)
        prompts[r, prompt_width - len(seg.prompt_ids):] = seg.prompt_ids
        prompt_mask[r, prompt_width - len(seg.prompt_ids):] = True
        tokens[r, :n], response_mask[r, :n] = seg.token_ids, True
        loss_mask[r, :n], logprobs[r, :n] = np.asarray(seg.loss_mask, bool), seg.logprobs
        lengths[r], rewards[r], turns[r] = n, seg.reward, seg.turns
        if r < episodes:  # an episode's counts ride on its row (`episode_trajectories`)
            counters.append({**(seg.counters or {"agent_error": float(result.error is not None)}),
                             "segments": float(len(trajectories[r]))})
        else:
            counters.append({})
        finish.append(seg.finish)
    return MultiTurnOutput(prompts, prompt_mask, tokens, response_mask, loss_mask, logprobs, lengths, rewards,
                           turns, counters, finish, episodes=episodes)


@dataclasses.dataclass
class AgentBatch:
    """One step's agent episodes: the rollout's rows (`output.rollout_batch()` is the generate call's layout plus
    `action_mask` and `env_reward`), each episode's final answer (what rule rewards score) and the step's
    `endpoint/*` (this step's counts) and `env/*` metrics."""

    output: Any  # models.multiturn.MultiTurnOutput
    final_texts: list[str]
    metrics: dict[str, float]


class AgentRollout:
    """env.name=openai_agent: a step's rows are played by agents (`env.agent`) against the endpoint, one
    thread and one episode each, and come back as the multi-turn rollout's rows. The endpoint's limits are
    set to the batch's widths, so every episode fits them."""

    def __init__(self, endpoint: ChatEndpoint, agent: AgentFn, *, prompt_width: int | None, response_width: int,
                 pad_id: int, failure: float = 0.0, timeout_s: float | None = None,
                 client: Callable[[str], Any] = openai_client, warn: Callable[[str], None] = print):
        self.endpoint, self.agent, self.client, self.warn = endpoint, agent, client, warn
        self.prompt_width, self.response_width, self.pad_id = prompt_width, response_width, pad_id
        self.failure, self.timeout_s = failure, timeout_s
        endpoint.max_prompt_tokens = min(endpoint.max_prompt_tokens, prompt_width or endpoint.max_prompt_tokens)
        endpoint.max_response_tokens = min(endpoint.max_response_tokens or response_width, response_width)

    @classmethod
    def for_run(cls, server: Any, agent: AgentFn | str, *, executor: Any, generate: Callable[..., Any],
                tokenizer: Tokenizer, batch_size: int, prompt_width: int | None, response_width: int,
                max_new_tokens: int,
                max_positions: int, sampling: Any = None, seed: int = 0, call: str = "actor.generate",
                min_bucket: int = 16, warn: Callable[[str], None] = print) -> "AgentRollout":
        """The run's agent rollout: `server` is the config's `env.server` (`config_schema.AgentServerConfig`),
        `agent` its `env.agent` ("module:function"), generation on `call`'s placement through `executor` with
        `generate` (the rollout's `generate_call` bound to the run's sampling settings, prefix "")."""
        backend = PlacedBackend(executor, generate, pad_id=tokenizer.pad_id, max_new_tokens=max_new_tokens,
                                max_positions=max_positions, batch_size=batch_size, sampling=sampling, call=call,
                                seed=seed, min_bucket=min_bucket)
        endpoint = ChatEndpoint(backend, tokenizer, host=server.host, port=server.port, batch_size=batch_size,
                                window_s=server.window_ms / 1000, warn=warn)
        return cls(endpoint, load_agent(agent) if isinstance(agent, str) else agent, prompt_width=prompt_width,
                   response_width=response_width, pad_id=tokenizer.pad_id, failure=server.failure,
                   timeout_s=server.agent_timeout_s)

    def close(self) -> None:
        self.endpoint.close()

    def __call__(self, rows: Sequence[Any]) -> AgentBatch:
        before = self.endpoint.metrics()
        results = run_agents(self.endpoint, self.agent, rows, client=self.client, timeout_s=self.timeout_s)
        output = agent_output(results, prompt_width=self.prompt_width, response_width=self.response_width,
                              pad_id=self.pad_id, failure=self.failure)
        errors = [r.error for r in results if r.error is not None]
        failed = len(errors)
        if errors:  # one line a step: a broken agent shows in the log, not only as a failure rate
            self.warn(f"{failed} of {len(results)} agents failed this step (env.agent); the first: {errors[0]}")
        after = self.endpoint.metrics()  # this step's counts: the endpoint's run totals less those before it
        step = {k: v - before[k] for k, v in after.items() if k != "endpoint/rows_per_call"}
        step["endpoint/rows_per_call"] = step["endpoint/requests"] / max(step["endpoint/generate_calls"], 1)
        metrics = {**step, **output.metrics(), "env/agent_failed": failed / max(len(rows), 1)}
        return AgentBatch(output, [r.episode.final_text for r in results], metrics)


class AgentEpisodes:
    """env.name=openai_agent in the step loop: the step's prompts played by agents, generating with the actor's
    parameters as the step loop hands them over (on the generate call's placement, as for environment
    episodes), returned as the generate call's outputs (the multi-turn layout: `action_mask`, `env_reward`,
    responses padded to `max_new_tokens`; every segment a row, `agent_output`) and metrics. Each request
    generates up to `turn_tokens` (default `max_new_tokens`); an episode's answers and observations together fit
    `response_budget`. Generation goes through the multi-turn engine's cache (`backends.CachedBackend`, a row per
    episode), so a request that continues its episode prefills only what is new. The server lives across
    steps; each call swaps in the step's parameters. A row given to an agent is {"prompt", "answer"}; when
    earlier segments add rows, the feed's row values (`prompts`, `answers`, ...) are repeated to match."""

    ROW_VALUES = ("prompts", "answers", "prompt_tokens", "prompt_mask")  # the feed's values with a row per prompt

    def __init__(self, server: Any, agent: AgentFn | str, *, graphdef: Any, tokenizer: Tokenizer, sampling: Any,
                 max_new_tokens: int, response_budget: int | None, batch_size: int, max_positions: int,
                 turn_tokens: int | None = None, max_prompt_tokens: int | None = None,
                 eos_ids: Sequence[int] | None = None, seed: int = 0, warn: Callable[[str], None] = print):
        from jaxrlhf.models.lengths import bucket_length

        self.params: Any = None
        self.max_new_tokens, self.pad_id = max_new_tokens, tokenizer.pad_id
        eos = tuple(tokenizer.eos_ids if eos_ids is None else eos_ids)  # the rollout's: the tokenizer's EOS ids
        budget = response_budget or max_new_tokens
        room = (max_positions - budget) // 16 * 16  # prompt columns beside a segment's budget, in pages of 16
        prompt_tokens = room if max_prompt_tokens is None else min(bucket_length(max_prompt_tokens), room)
        self.backend = CachedBackend(graphdef, lambda: self.params, rows=batch_size, prompt_tokens=prompt_tokens,
                                     response_tokens=budget, max_new_tokens=turn_tokens or max_new_tokens,
                                     sampling=sampling, eos_ids=eos, pad_id=tokenizer.pad_id,
                                     max_positions=max_positions, seed=seed)
        endpoint = ChatEndpoint(self.backend, tokenizer, host=server.host, port=server.port, batch_size=batch_size,
                                window_s=server.window_ms / 1000, max_prompt_tokens=prompt_tokens, warn=warn)
        self.rollout = AgentRollout(endpoint, load_agent(agent) if isinstance(agent, str) else agent,
                                    prompt_width=None, response_width=budget, pad_id=tokenizer.pad_id,
                                    failure=server.failure, timeout_s=server.agent_timeout_s)

    @property
    def endpoint(self) -> ChatEndpoint:
        return self.rollout.endpoint

    def close(self) -> None:
        self.rollout.close()

    def __call__(self, params: Any, feed: Mapping[str, Any], *, prefix: str = ""
                 ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        from jaxrlhf.environments.episodes import padded_to

        self.params = params
        try:
            step = self.rollout([{"prompt": p, "answer": a} for p, a in zip(feed["prompts"], feed["answers"])])
        finally:
            self.params = None  # the step's weights are not held past it
        values = {prefix + k: v for k, v in padded_to(step.output.rollout_batch(), self.max_new_tokens,
                                                       self.pad_id).items()}
        blocks = len(values[prefix + "tokens"]) // len(feed["prompts"])
        if blocks > 1:  # earlier segments' rows: the feed's row values once per block, as the rows are laid out
            values.update({k: _tiled(feed[k], blocks) for k in self.ROW_VALUES if k in feed})
        return values, step.metrics


def _tiled(value: Any, times: int) -> Any:
    """`value`'s rows `times` over (a list stays a list)."""
    if isinstance(value, (list, tuple)):
        return type(value)(list(value) * times)
    return np.concatenate([np.asarray(value)] * times)
