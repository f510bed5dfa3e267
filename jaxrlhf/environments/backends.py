"""What generates behind the agent endpoint: one backend call answers a batch of requests gathered by the
`Batcher` (concurrent requests of many episodes within a short window, up to the batch size).

- `PlacedBackend`: the run's own generate call where the plan places it (`executor.run_at`);
- `ModelBackend`: a `models.generation.Generator` on weights it is handed (tests, tools);
- `CachedBackend`: the multi-turn engine's paged cache (`models.multiturn`), one row per open episode: a
  request that continues its episode's record extends the row's cache with the new tokens only (an
  observation, the agent's next message), never prefilling the context again (`prefill_tokens` counts what
  was prefilled). The run's agents (`env.name: openai_agent`) generate through it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
    """One chat request's generation: its episode (a backend that keeps state per episode finds it by this) and
    the token ids the model continues."""

    episode: str
    context: list[int]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One row's generation: the sampled ids (EOS included when it ended there), their log-probs, and how many
    tokens of the context a forward computed for it (all of them, unless a cache held the rest)."""

    tokens: list[int]
    logprobs: list[float]
    ended_with_eos: bool
    prefilled: int = 0


class GenerateBackend(Protocol):
    """What the endpoint generates with: the policy's current weights and the run's sampling settings.
    `max_new_tokens` is fixed (one compiled program per prompt bucket); a request's `max_tokens` cuts
    its row afterwards, which changes nothing before the cut. `release(episode)`: the episode ended."""

    max_new_tokens: int
    max_positions: int  # prompt + max_new_tokens must fit
    sampling: Any  # the run's sampling settings (`models.sampling.SamplingParams`), None when unknown

    def __call__(self, requests: Sequence[Request]) -> list[Sample]: ...

    def release(self, episode: str) -> None: ...


class Stateless:
    """A backend that keeps nothing per episode: each call pads its contexts to `batch_size` rows (copies of the
    first), so a run compiles one program per prompt bucket, not one per count of waiting requests, and every
    context is prefilled whole. Subclasses generate (`_generate`) for the padded rows with a call's key."""

    batch_size: int

    def __init__(self, batch_size: int, seed: int = 0):
        import jax

        self.batch_size = batch_size
        self._key = jax.random.key(seed)
        self._calls = 0

    def release(self, episode: str) -> None:
        pass

    def _generate(self, rows: list[list[int]], key: Any) -> tuple[np.ndarray, ...]:
        """(response tokens, response mask, log-probs, ended with EOS) of every row, on host."""
        raise NotImplementedError

    def __call__(self, requests: Sequence[Request]) -> list[Sample]:
        import jax

        contexts = [r.context for r in requests]
        if len(contexts) > self.batch_size:
            raise ValueError(f"{len(contexts)} contexts for a generate call of {self.batch_size} rows")
        rows = [list(c) for c in contexts] + [list(contexts[0])] * (self.batch_size - len(contexts))
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        tokens, mask, logprobs, eos = self._generate(rows, key)
        return [Sample(tokens[r][mask[r]].tolist(), logprobs[r][mask[r]].tolist(), bool(eos[r]), len(contexts[r]))
                for r in range(len(contexts))]


class ModelBackend(Stateless):
    """A `GenerateBackend` on a `models.generation.Generator`: `state()` gives the weights to sample with
    (the actor's current state, read at every call)."""

    def __init__(self, generator: Any, state: Callable[[], Any], *, max_new_tokens: int, sampling: Any,
                 max_positions: int, batch_size: int, seed: int = 0):
        super().__init__(batch_size, seed)
        self.generator, self.state, self.sampling = generator, state, sampling
        self.max_new_tokens, self.max_positions = max_new_tokens, max_positions

    def _generate(self, rows: list[list[int]], key: Any) -> tuple[np.ndarray, ...]:
        import jax

        out = self.generator(self.state(), rows, max_new_tokens=self.max_new_tokens, sampling=self.sampling, rng=key)
        return tuple(np.asarray(x) for x in jax.device_get(
            (out.response_tokens, out.response_mask, out.logprobs, out.ended_with_eos)))


class PlacedBackend(Stateless):
    """A `GenerateBackend` on the run's own generate placement: `executor.run_at(call, generate, ...)` runs
    `generate(params, inputs)` (e.g. the rollout's `generate_call` bound to the run's sampling settings, prefix
    "") where the plan places `call`, with the role's current parameters brought there. `batch_size` is the
    rollout batch, which the placement's batch split divides."""

    def __init__(self, executor: Any, generate: Callable[..., Any], *, pad_id: int, max_new_tokens: int,
                 max_positions: int, batch_size: int, sampling: Any = None, call: str = "actor.generate",
                 seed: int = 0, min_bucket: int = 16):
        super().__init__(batch_size, seed)
        self.executor, self.generate, self.call, self.sampling = executor, generate, call, sampling
        self.pad_id, self.max_new_tokens, self.max_positions = pad_id, max_new_tokens, max_positions
        self.min_bucket = min_bucket

    def _generate(self, rows: list[list[int]], key: Any) -> tuple[np.ndarray, ...]:
        from jaxrlhf.models.generation import pad_prompts

        tokens, mask = pad_prompts(rows, self.pad_id, self.min_bucket)
        out = self.executor.run_at(self.call, self.generate,
                                   {"prompt_tokens": tokens, "prompt_mask": mask, "rng_generate": key})
        return tuple(np.asarray(out[k]) for k in ("response_tokens", "response_mask", "behaviour_logp",
                                                  "ended_with_eos"))


class CachedBackend:
    """A `GenerateBackend` on the multi-turn engine's paged cache (`models.multiturn`): one row per open
    episode, holding the KV of everything the episode's requests fed so far. A request whose context continues
    what its row holds (the record's ids, then the agent's new message: an observation) extends the row's
    cache by the new tokens only (`extend`), after cutting the row back to the record where the endpoint cut
    an answer (`rewind`); any other request (a new episode, a rewritten history) prefills its context into the
    row afresh (`admit`). Then every row of the call decodes until its turn ends (an EOS id, `max_new_tokens`
    tokens, or the row's `response_tokens` budget). Greedy rows answer as the static engine does.

    Sizes are static (one compiled program each): `rows` episodes at once, prompts of up to `prompt_tokens`
    (the endpoint's `max_prompt_tokens`), `response_tokens` after a segment's prompt (the endpoint's
    `max_response_tokens`, which keeps every continuation inside the row). `state()` gives the weights; rows
    cached under other weights (a new step's) are prefilled again. `prefill_tokens` counts the context tokens
    forwards computed (`Sample.prefilled`)."""

    def __init__(self, graphdef: Any, state: Callable[[], Any], *, rows: int, prompt_tokens: int,
                 response_tokens: int, max_new_tokens: int, sampling: Any, eos_ids: Sequence[int], pad_id: int,
                 max_positions: int, seed: int = 0):
        import jax

        from jaxrlhf.models import multiturn

        self.graphdef, self.state, self.sampling = graphdef, state, sampling
        self.max_new_tokens, self.max_positions = max_new_tokens, max_positions
        self.spec = multiturn.MultiTurnSpec(
            rows=rows, prompt_bucket=prompt_tokens, max_tokens=response_tokens, max_turn_tokens=max_new_tokens,
            sampling=sampling, eos_ids=tuple(eos_ids), pad_id=pad_id, max_observation_tokens=response_tokens - 1)
        self._key = jax.random.key(seed)
        self._calls = 0
        self._lock = threading.Lock()
        self.row_of: dict[str, int] = {}  # episode -> its row
        self.free = list(range(rows))
        self.held: dict[int, list[int]] = {}  # row -> the ids its cache holds: prompt, then response (last pending)
        self.prompt_len: dict[int, int] = {}
        self.cache: Any = None  # the engine's state, from the first call
        self.weights: Any = None  # the weights the cache was computed with
        self.prefill_tokens = 0

    def release(self, episode: str) -> None:
        """The episode's row is free; with no episode left the cache goes (the trainer gets its memory back)."""
        with self._lock:
            row = self.row_of.pop(episode, None)
            if row is not None:
                self.held.pop(row, None)
                self.free.append(row)
            if not self.row_of:
                self.cache, self.weights = None, None
                self.held.clear()

    def _row(self, episode: str) -> int:
        with self._lock:
            if episode not in self.row_of:
                if not self.free:
                    raise RuntimeError(f"{self.spec.rows} episodes are open at once, the backend's rows: close one")
                self.row_of[episode] = self.free.pop(0)
            return self.row_of[episode]

    def _continues(self, row: int, context: list[int]) -> int:
        """How many response tokens of `row`'s cache `context` keeps (>= 1: it extends them), or 0 (prefill)."""
        held = self.held.get(row)
        if held is None:
            return 0
        same = next((i for i, (a, b) in enumerate(zip(held, context)) if a != b), min(len(held), len(context)))
        kept = same - self.prompt_len[row]
        room = self.spec.max_tokens - kept - (len(context) - same)  # the observation and one token must fit
        return kept if kept >= 1 and room >= 1 else 0

    def __call__(self, requests: Sequence[Request]) -> list[Sample]:
        import jax
        import jax.numpy as jnp

        from jaxrlhf.models import multiturn

        spec, R, P = self.spec, self.spec.rows, self.spec.prompt_bucket
        params = self.state()
        if params is not self.weights:  # another step's weights: nothing cached is theirs
            self.held.clear()
        self.weights = params
        rows = [self._row(r.episode) for r in requests]
        if len(set(rows)) < len(rows):
            raise RuntimeError("two requests of one episode in one generate call")
        kept = [self._continues(row, r.context) for row, r in zip(rows, requests)]
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        admit, extend = np.zeros(R, bool), np.zeros(R, bool)
        prompts = np.full((R, P), spec.pad_id, np.int32)
        prompt_mask = np.zeros((R, P), bool)
        prompt_mask[:, -1] = True  # a row not admitted prefills a one-token stand-in (its state is kept)
        n, length = np.zeros(R, np.int32), np.zeros(R, np.int32)
        observation = np.full((R, spec.extend_width - 1), spec.pad_id, np.int32)
        for row, request, k in zip(rows, requests, kept):
            context = request.context
            if k:  # the row's cache holds the prompt and k response tokens of this context: extend it
                start = self.prompt_len[row] + k
                extend[row], n[row], length[row] = True, k, len(context) - start
                observation[row, :length[row]] = context[start:]
                continue
            if len(context) > P:
                raise ValueError(f"a context of {len(context)} tokens does not fit the backend's prompt bucket of "
                                 f"{P} (the endpoint's max_prompt_tokens)")
            admit[row] = True
            prompts[row, P - len(context):] = context
            prompt_mask[row] = np.arange(P) >= P - len(context)
            self.prompt_len[row] = len(context)
        st = self.cache
        if st is None:
            st = multiturn.start_fn(self.graphdef, params, jnp.asarray(prompts), jnp.asarray(prompt_mask), key,
                                    spec=spec)
        elif admit.any():
            st = multiturn.admit_fn(self.graphdef, params, st, jnp.asarray(prompts), jnp.asarray(prompt_mask),
                                    jnp.asarray(admit), key, spec=spec)
        if extend.any():
            st = multiturn.rewind_fn(st, jnp.asarray(extend), jnp.asarray(n), spec=spec)
            st, _ = multiturn.extend_fn(self.graphdef, params, st, jnp.asarray(observation), jnp.asarray(length),
                                        jnp.asarray(extend), spec=spec)
        running = np.asarray(jax.device_get(st.status)) == multiturn.RUNNING
        if (running & ~(admit | extend)).any():  # a row not in this call (a stand-in) would decode: stop it
            st = multiturn.stop_fn(st, jnp.asarray(running & ~(admit | extend)), jnp.zeros(R, np.int32))
        st = multiturn.decode_fn(self.graphdef, params, st, spec=spec, steps=spec.max_turn_tokens)
        self.cache = st
        tokens, logp, count, ended = (np.asarray(x) for x in jax.device_get((st.tokens, st.logp, st.n, st.ended)))
        out = []
        for row, request, k in zip(rows, requests, kept):
            first = len(request.context) - self.prompt_len[row]  # the response index this request samples from
            self.held[row] = list(request.context) + tokens[row, first:count[row]].tolist()
            prefilled = len(request.context) if not k else len(request.context) - self.prompt_len[row] - k + 1
            self.prefill_tokens += prefilled
            out.append(Sample(tokens[row, first:count[row]].tolist(), logp[row, first:count[row]].tolist(),
                              bool(ended[row]), prefilled))
        return out


class Batcher:
    """Gathers concurrent requests for `window_s` seconds (or until `batch_size` wait) into one backend
    call on a thread of its own. A backend error fails every request of that call."""

    def __init__(self, backend: GenerateBackend, *, batch_size: int, window_s: float = 0.01):
        self.backend, self.batch_size, self.window_s = backend, batch_size, window_s
        self._queue: queue.Queue[tuple[Request, concurrent.futures.Future] | None] = queue.Queue()
        self.calls, self.rows = 0, 0
        self._thread = threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((request, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.window_s
            stop = False
            while len(batch) < self.batch_size:
                try:
                    item = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            try:
                samples = self.backend([request for request, _ in batch])
                self.calls, self.rows = self.calls + 1, self.rows + len(batch)
                for (_, future), sample in zip(batch, samples):
                    future.set_result(sample)
            except Exception as e:  # noqa: BLE001 - handed to every waiting request as its error
                for _, future in batch:
                    future.set_exception(e)
            if stop:
                return
