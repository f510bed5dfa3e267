"""An OpenAI-compatible chat endpoint on the run's policy, for agents written against the `openai` client.

With `env.server: {port, host}` the run serves `POST .../v1/chat/completions` and `GET .../v1/models`
on localhost. Each episode has its own base URL, `http://127.0.0.1:{port}/episodes/{episode_id}/v1`,
which the official client takes unchanged (`openai.OpenAI(base_url=..., api_key=...)`); the path is
how a request finds its episode, so an agent needs no extra headers or fields.

Why token-in/token-out: the trainer must see the tokens the policy sampled, with the log-probs it
sampled them with. An agent sees text, and when it sends the conversation back the chat template
re-renders the model's answer, whose re-tokenization need not equal the sampled ids (BPE has many
spellings of a string). So each request's prompt is compared with the episode's record: when it
extends the record (its token ids, or else the record's text), only the new part is tokenized and
recorded as observation tokens (loss mask 0), and the model generates after the record itself, so
the sampled tokens are kept exactly as sampled. A prompt that does not extend the record (the agent
rewrote its history: a trimmed context, a template that drops old reasoning) starts a new segment,
and is counted.

Concurrent requests of many episodes are gathered for a short window (up to the batch size) into one
generate call with the run's sampling settings and the policy's current weights (`GenerateBackend`).

Standard library only (`http.server`, threads); the `openai` package is needed by the agents
(`run_agents`), not by the server.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import ipaddress
import json
import queue
import re
import threading
import time
import uuid
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from jaxrlhf.environments import Trajectory
from jaxrlhf.models.chat_template import ChatTemplate, ChatTemplateError
from jaxrlhf.models.tokenizer import Tokenizer, prompt_prefix
from jaxrlhf.environments.tool_calls import ParsedToolCalls, ToolSchemaError, detect_tool_format, parse_tool_calls

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused before it is read
MAX_STOP_SEQUENCES = 4  # as OpenAI's API
IDLE_CONNECTION_S = 120  # an open connection's thread waits this long for its next request
EPISODE_PATH = re.compile(r"^/episodes/(?P<episode>[A-Za-z0-9_.-]+)/v1/(?P<route>chat/completions|models)/?$")


class EndpointError(Exception):
    """A request the endpoint refuses: an HTTP status and OpenAI's error body (`type`, `param`, `code`)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- what an episode records


@dataclasses.dataclass
class Segment:
    """One token sequence the policy saw: the prompt it started from, then sampled tokens (loss mask 1,
    their behaviour log-probs) and observation tokens (mask 0, log-prob 0) in the order they came."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0  # model answers recorded

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.tokens

    def append(self, tokens: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Sampled tokens with their log-probs, or observation tokens (logprobs None)."""
        self.tokens.extend(int(t) for t in tokens)
        self.logprobs.extend([0.0] * len(tokens) if logprobs is None else [float(x) for x in logprobs])
        self.loss_mask.extend([0 if logprobs is None else 1] * len(tokens))
        self.turns += logprobs is not None


@dataclasses.dataclass
class Episode:
    """Everything one agent's requests produced. `matches` counts how each request after the first found
    its place: "tokens" (its ids extend the record), "text" (its text extends the record's text, the
    new text tokenized alone) or "rewrite" (neither: a new segment)."""

    episode_id: str
    row: Any = None
    segments: list[Segment] = dataclasses.field(default_factory=list)
    requests: int = 0
    matches: dict[str, int] = dataclasses.field(default_factory=lambda: {"tokens": 0, "text": 0, "rewrite": 0})
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    closed: bool = False
    final_text: str = ""  # the last answer's content (what rule rewards score)

    def match(self, prompt_ids: list[int], text: str, tokenizer: Tokenizer, prefix: list[int]) -> tuple[str, list[int]]:
        """Where a request whose rendered prompt is `text` (`prompt_ids` = `prefix` + its tokens) goes:
        ("tokens" | "text", the observation ids it adds to the last segment) or ("new" | "rewrite", the
        prompt of a new segment). Records nothing (`extend` does)."""
        if not self.segments:
            return "new", list(prompt_ids)
        ids = self.segments[-1].ids
        if prompt_ids[:len(ids)] == ids:
            return "tokens", prompt_ids[len(ids):]
        if ids[:len(prefix)] == prefix:
            recorded = decode_with_special_tokens(tokenizer, ids[len(prefix):])
            if text.startswith(recorded):
                return "text", tokenizer.encode(text[len(recorded):])
        return "rewrite", list(prompt_ids)

    def context_of(self, how: str, ids: list[int]) -> list[int]:
        """The ids the model continues for a request `match` placed (nothing recorded yet)."""
        return self.segments[-1].ids + list(ids) if how in ("tokens", "text") else list(ids)

    def context_length(self, how: str, ids: list[int]) -> int:
        return len(self.segments[-1].ids) + len(ids) if how in ("tokens", "text") else len(ids)

    def extend(self, how: str, ids: list[int]) -> list[int]:
        """Record a request `match` placed; returns the ids the model continues."""
        self.requests += 1
        if how in self.matches:
            self.matches[how] += 1
        if how in ("tokens", "text"):
            self.segments[-1].append(ids, None)
        else:
            self.segments.append(Segment(list(ids)))
        return self.segments[-1].ids


def decode_with_special_tokens(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids` with special tokens written out, as a chat template writes them (`decode` drops
    them). A tokenizer without a raw `tokenizers` object decodes as it does."""
    raw = getattr(tokenizer, "_tok", None)  # HFTokenizer's `tokenizers.Tokenizer`
    if raw is None:
        return tokenizer.decode(ids)
    return raw.decode([int(i) for i in ids], skip_special_tokens=False)


# ---------------------------------------------------------------- generation behind the endpoint


@dataclasses.dataclass(frozen=True)
class Sample:
    """One row's generation: the sampled ids (EOS included when it ended there) and their log-probs."""

    tokens: list[int]
    logprobs: list[float]
    ended_with_eos: bool


class GenerateBackend(Protocol):
    """What the endpoint generates with: the policy's current weights and the run's sampling settings.
    `max_new_tokens` is fixed (one compiled program per prompt bucket); a request's `max_tokens` cuts
    its row afterwards, which changes nothing before the cut."""

    max_new_tokens: int
    max_positions: int  # prompt + max_new_tokens must fit

    def __call__(self, contexts: Sequence[Sequence[int]]) -> list[Sample]: ...


class ModelBackend:
    """A `GenerateBackend` on a `models.generation.Generator`: `state()` gives the weights to sample with
    (the actor's current state, read at every call); rows are padded to `batch_size` with copies of the
    first, so a run compiles one program per prompt bucket, not one per count of waiting requests."""

    def __init__(self, generator: Any, state: Callable[[], Any], *, max_new_tokens: int, sampling: Any,
                 max_positions: int, batch_size: int, seed: int = 0):
        import jax

        self.generator, self.state, self.sampling = generator, state, sampling
        self.max_new_tokens, self.max_positions, self.batch_size = max_new_tokens, max_positions, batch_size
        self._key = jax.random.key(seed)
        self._calls = 0

    def __call__(self, contexts: Sequence[Sequence[int]]) -> list[Sample]:
        import jax

        if len(contexts) > self.batch_size:
            raise ValueError(f"{len(contexts)} contexts for a generate call of {self.batch_size} rows")
        padded = [list(c) for c in contexts] + [list(contexts[0])] * (self.batch_size - len(contexts))
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        out = self.generator(self.state(), padded, max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                             rng=key)
        tokens, mask, logprobs, eos = (np.asarray(x) for x in jax.device_get(
            (out.response_tokens, out.response_mask, out.logprobs, out.ended_with_eos)))
        return [Sample(tokens[r][mask[r]].tolist(), logprobs[r][mask[r]].tolist(), bool(eos[r]))
                for r in range(len(contexts))]


class PlacedBackend:
    """A `GenerateBackend` on the run's own generate placement: `executor.run_at(call, generate, ...)` runs
    `generate(params, inputs)` (e.g. the rollout's `generate_call` bound to the run's sampling settings, prefix
    "") where the plan places `call`, with the role's current parameters brought there. Rows are padded to
    `batch_size` (the rollout batch, which the placement's batch split divides), so a run compiles one program
    per prompt bucket."""

    def __init__(self, executor: Any, generate: Callable[..., Any], *, pad_id: int, max_new_tokens: int,
                 max_positions: int, batch_size: int, sampling: Any = None, call: str = "actor.generate",
                 seed: int = 0, min_bucket: int = 16):
        import jax

        self.executor, self.generate, self.call, self.sampling = executor, generate, call, sampling
        self.pad_id, self.max_new_tokens, self.max_positions = pad_id, max_new_tokens, max_positions
        self.batch_size, self.min_bucket = batch_size, min_bucket
        self._key = jax.random.key(seed)
        self._calls = 0

    def __call__(self, contexts: Sequence[Sequence[int]]) -> list[Sample]:
        import jax

        from jaxrlhf.models.generation import pad_prompts

        if len(contexts) > self.batch_size:
            raise ValueError(f"{len(contexts)} contexts for a generate call of {self.batch_size} rows")
        rows = [list(c) for c in contexts] + [list(contexts[0])] * (self.batch_size - len(contexts))
        tokens, mask = pad_prompts(rows, self.pad_id, self.min_bucket)
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        out = self.executor.run_at(self.call, self.generate,
                                   {"prompt_tokens": tokens, "prompt_mask": mask, "rng_generate": key})
        tokens, mask, logprobs, eos = (np.asarray(out[k]) for k in
                                       ("response_tokens", "response_mask", "behaviour_logp", "ended_with_eos"))
        return [Sample(tokens[r][mask[r]].tolist(), logprobs[r][mask[r]].tolist(), bool(eos[r]))
                for r in range(len(contexts))]


class Batcher:
    """Gathers concurrent requests for `window_s` seconds (or until `batch_size` wait) into one backend
    call on a thread of its own. A backend error fails every request of that call."""

    def __init__(self, backend: GenerateBackend, *, batch_size: int, window_s: float = 0.01):
        self.backend, self.batch_size, self.window_s = backend, batch_size, window_s
        self._queue: queue.Queue[tuple[list[int], concurrent.futures.Future] | None] = queue.Queue()
        self.calls, self.rows = 0, 0
        self._thread = threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True)
        self._thread.start()

    def submit(self, context: list[int]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((context, future))
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
                samples = self.backend([context for context, _ in batch])
                self.calls, self.rows = self.calls + 1, self.rows + len(batch)
                for (_, future), sample in zip(batch, samples):
                    future.set_result(sample)
            except Exception as e:  # noqa: BLE001 - handed to every waiting request as its error
                for _, future in batch:
                    future.set_exception(e)
            if stop:
                return


# ---------------------------------------------------------------- the OpenAI request and response


def _text_content(content: Any, where: str) -> str | None:
    """A message's content as text: a string, None, or OpenAI's list of {"type": "text", "text"} parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise EndpointError(400, f"{where}.content: only text is supported (a string or text parts)", param=where)


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them (transformers' convention): text content, and tool
    calls' `arguments` as objects (the API sends a JSON string)."""
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise EndpointError(400, f"{where} must be an object with a 'role'", param=where)
        m = {k: v for k, v in message.items() if v is not None}
        m["content"] = _text_content(message.get("content"), where)
        calls = []
        for call in message.get("tool_calls") or []:
            function = dict(call.get("function") or {}) if isinstance(call, Mapping) else {}
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template writes a string as it is
            calls.append({**call, "function": function})
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """The parts of a chat completion request the endpoint honours (see docs/agentic.md)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    logprobs: bool
    stop: tuple[str, ...]
    model: str
    temperature: float | None

    @classmethod
    def parse(cls, body: Any) -> "ChatRequest":
        if not isinstance(body, Mapping):
            raise EndpointError(400, "the request body must be a JSON object")
        if body.get("stream"):
            raise EndpointError(400, "'stream': true is not supported; send stream=false", param="stream")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise EndpointError(400, f"'n' must be 1 (one sample per request), got {n!r}", param="n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise EndpointError(400, f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
        stop = body.get("stop")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not (isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_SEQUENCES
                and all(isinstance(s, str) and s for s in stop)):
            raise EndpointError(400, f"'stop' must be a string or up to {MAX_STOP_SEQUENCES} non-empty strings",
                                param="stop")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) for t in tools)):
            raise EndpointError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}",
                                param="tools")
        temperature = body.get("temperature")
        if temperature is not None and not isinstance(temperature, (int, float)):
            raise EndpointError(400, f"'temperature' must be a number, got {temperature!r}", param="temperature")
        return cls(template_messages(body.get("messages")), tools, max_tokens, bool(body.get("logprobs")),
                   tuple(stop), str(body.get("model") or "policy"), temperature)


def cut_at_stop(tokenizer: Tokenizer, tokens: list[int], stop: Sequence[str]) -> tuple[int, str] | None:
    """The fewest leading tokens whose text holds a stop string, and the text before it; None if none."""
    if not stop:
        return None
    text = tokenizer.decode(tokens)
    if not any(s in text for s in stop):
        return None
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        found = [text.index(s) for s in stop if s in text]
        if found:
            return k, text[:min(found)]
    return None  # unreachable: the whole text holds one


# ---------------------------------------------------------------- the server


@dataclasses.dataclass
class EndpointStats:
    """Counts for the run's metrics (`endpoint/*`); how requests found their place in their episode's record
    (`Episode.matches`) and the segments, over the episodes closed so far."""

    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_call_errors: int = 0
    temperature_overridden: int = 0
    segments: int = 0  # of closed episodes
    matches: dict[str, int] = dataclasses.field(default_factory=lambda: {"tokens": 0, "text": 0, "rewrite": 0})


class ChatEndpoint:
    """The server: episodes by id, the chat template and tokenizer, the batcher, the limits.

    Limits, each refused with 400 (`context_length_exceeded`) before anything is recorded: a context (the
    segment's ids plus the request's new tokens) over the model's positions less max_new_tokens; a request
    that starts a segment with a prompt over `max_prompt_tokens`; with `max_response_tokens` (the trainer's
    response width), a continuation whose segment has no room left after its observation tokens (an answer
    is cut to the room there is, finish_reason "length").
    tool_format: a `tools.TOOL_CALL_FORMATS` name; None detects it from the template.
    """

    def __init__(self, backend: GenerateBackend, tokenizer: Tokenizer, *, template: ChatTemplate | None = None,
                 host: str = "127.0.0.1", port: int = 0, batch_size: int = 8, window_s: float = 0.01,
                 max_prompt_tokens: int | None = None, max_response_tokens: int | None = None,
                 tool_format: str | None = None, model_name: str = "policy", warn: Callable[[str], None] = print):
        template = template if template is not None else getattr(tokenizer, "chat_template", None)
        if template is None:
            raise ValueError(f"the endpoint renders chat messages with the tokenizer's chat template, and "
                             f"{tokenizer!r} ships none (tokenizer_config.json 'chat_template' or chat_template.jinja)")
        self.max_context_tokens = backend.max_positions - backend.max_new_tokens
        self.max_prompt_tokens = min(max_prompt_tokens or self.max_context_tokens, self.max_context_tokens)
        self.max_response_tokens = max_response_tokens
        self.backend, self.tokenizer, self.template, self.model_name = backend, tokenizer, template, model_name
        self.tool_format = tool_format or detect_tool_format(template.tool_source)
        self.prefix = prompt_prefix(tokenizer)
        self.stats = EndpointStats()
        self.episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        if host not in LOCAL_HOSTS and not _is_loopback(host):
            warn(f"warning: the agent endpoint listens on {host}:{port}, reachable from other machines "
                 "(env.server.host); anyone who can reach it can sample from the policy")
        try:
            self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as e:
            raise ValueError(f"the agent endpoint cannot listen on {host}:{port} ({e}): choose another "
                             "env.server.port (0 = any free port) or env.server.host") from None
        self.httpd.daemon_threads = True
        self.batcher = Batcher(backend, batch_size=batch_size, window_s=window_s)
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="endpoint-http",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def host(self) -> str:
        return self.httpd.server_address[0]

    def base_url(self, episode: Episode | str) -> str:
        """What an agent's client takes as `base_url` for this episode."""
        episode_id = episode if isinstance(episode, str) else episode.episode_id
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)  # all interfaces: reach it locally
        host = host if ":" not in host else f"[{host}]"
        return f"http://{host}:{self.port}/episodes/{episode_id}/v1"

    def open_episode(self, row: Any = None, episode_id: str | None = None) -> Episode:
        episode = Episode(episode_id or uuid.uuid4().hex[:16], row)
        with self._lock:
            if episode.episode_id in self.episodes:
                raise ValueError(f"episode {episode.episode_id!r} is open already")
            self.episodes[episode.episode_id] = episode
        return episode

    def close_episode(self, episode: Episode) -> Episode:
        """Stop serving an episode (later requests get 404) and return its record."""
        with self._lock:
            open_before = self.episodes.pop(episode.episode_id, None) is not None
        with episode.lock:
            episode.closed = True
        if open_before:
            with self._lock:
                for how, n in episode.matches.items():
                    self.stats.matches[how] += n
                self.stats.segments += len(episode.segments)
        return episode

    def count(self, **counts: int) -> None:
        """Add to `stats` (handler threads count at the same time)."""
        with self._lock:
            for key, n in counts.items():
                setattr(self.stats, key, getattr(self.stats, key) + n)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.batcher.close()

    def __enter__(self) -> "ChatEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"endpoint/requests": s.requests, "endpoint/refused": s.refused,
                "endpoint/prompt_tokens": s.prompt_tokens, "endpoint/completion_tokens": s.completion_tokens,
                "endpoint/tool_call_errors": s.tool_call_errors,
                "endpoint/temperature_overridden": s.temperature_overridden,
                "endpoint/generate_calls": self.batcher.calls,
                "endpoint/rows_per_call": self.batcher.rows / max(self.batcher.calls, 1),
                "endpoint/segments": s.segments, **{f"endpoint/match_{k}": v for k, v in s.matches.items()}}

    # -------------------------------------------------------------- one request

    def episode(self, episode_id: str) -> Episode:
        with self._lock:
            episode = self.episodes.get(episode_id)
        if episode is None:
            raise EndpointError(404, f"no open episode {episode_id!r}: use the base_url the run gave the agent",
                                param="episode", code="episode_not_found")
        return episode

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxrlhf"}]}

    def chat(self, episode: Episode, body: Any) -> dict[str, Any]:
        request = ChatRequest.parse(body)
        try:
            text = self.template.render(request.messages, add_generation_prompt=True, tools=request.tools)
        except (ChatTemplateError, ToolSchemaError) as e:
            raise EndpointError(400, f"the chat template cannot render these messages: {e}",
                                param="messages") from None
        prompt_ids = self.prefix + self.tokenizer.encode(text)
        with episode.lock:
            if episode.closed:
                raise EndpointError(404, f"episode {episode.episode_id!r} has ended", code="episode_not_found")
            how, ids = episode.match(prompt_ids, text, self.tokenizer, self.prefix)
            room = self._check_limits(episode, how, ids)  # refused before recording: a refusal leaves no trace
            context = episode.context_of(how, ids)
            sample = self.batcher.submit(context).result()  # a failed call raises here: nothing recorded
            tokens, logprobs = sample.tokens, sample.logprobs
            finish = "stop" if sample.ended_with_eos else "length"
            cap = min(request.max_tokens or len(tokens), room)
            if len(tokens) > cap:
                tokens, logprobs, finish = tokens[:cap], logprobs[:cap], "length"
            content_ids = tokens[:-1] if finish == "stop" else tokens  # the EOS token is not text
            content = self.tokenizer.decode(content_ids)
            cut = cut_at_stop(self.tokenizer, content_ids, request.stop)
            if cut is not None:
                k, content = cut
                tokens, logprobs, finish = tokens[:k], logprobs[:k], "stop"
            episode.extend(how, ids)
            episode.segments[-1].append(tokens, logprobs)
            episode.final_text = content
        run_temperature = getattr(getattr(self.backend, "sampling", None), "temperature", request.temperature)
        self.count(requests=1, prompt_tokens=len(context), completion_tokens=len(tokens),
                   temperature_overridden=int(request.temperature not in (None, run_temperature)))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if request.tools is not None and self.tool_format is not None:
            parsed = parse_tool_calls(content, self.tool_format, request.tools)
            if isinstance(parsed, ParsedToolCalls):
                message["content"] = parsed.content or (None if parsed.calls else "")
                if parsed.reasoning is not None:
                    message["reasoning_content"] = parsed.reasoning
                if parsed.calls:
                    message["tool_calls"] = [
                        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                        for c in parsed.calls]
                    if finish == "stop":
                        finish = "tool_calls"
            else:  # the model's mistake stays its text: the agent sees what it wrote
                self.count(tool_call_errors=1)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = {"content": [
                {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                for piece, lp in zip((decode_with_special_tokens(self.tokenizer, [t]) for t in tokens), logprobs)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.model, "choices": [choice],
                "usage": {"prompt_tokens": len(context), "completion_tokens": len(tokens),
                          "total_tokens": len(context) + len(tokens)}}


    def _check_limits(self, episode: Episode, how: str, ids: list[int]) -> int:
        """Refuse a request over a limit (see the class); else the most tokens its answer may have."""
        length = episode.context_length(how, ids)
        if length > self.max_context_tokens:
            raise _too_long(f"this request's context is {length} tokens, over the endpoint's limit of "
                            f"{self.max_context_tokens} (the model's positions less generation.max_new_tokens)")
        if how in ("new", "rewrite"):
            if len(ids) > self.max_prompt_tokens:
                raise _too_long(f"this request's prompt is {len(ids)} tokens, over the endpoint's limit of "
                                f"{self.max_prompt_tokens} (env.server.max_prompt_tokens)")
            return self.backend.max_new_tokens if self.max_response_tokens is None else self.max_response_tokens
        if self.max_response_tokens is None:
            return self.backend.max_new_tokens
        used = len(episode.segments[-1].tokens) + len(ids)
        if used >= self.max_response_tokens:
            raise _too_long(f"this episode's answers and observations take {used} tokens after its prompt, and "
                            f"its budget is {self.max_response_tokens} (env.server.max_response_tokens)")
        return self.max_response_tokens - used


def _too_long(message: str) -> EndpointError:
    return EndpointError(400, message + ": shorten the conversation", param="messages",
                         code="context_length_exceeded")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_CONNECTION_S  # a kept-alive connection no request comes on is closed (its thread ends)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # one line per request would flood the run's log

        def _send(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str] = {}) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            try:
                match = EPISODE_PATH.match(self.path.split("?", 1)[0])
                if match is None:
                    raise EndpointError(404, f"no route {self.path!r}: an episode's routes are "
                                             "/episodes/{episode_id}/v1/chat/completions and .../v1/models",
                                        code="not_found")
                allowed = "POST" if match["route"] == "chat/completions" else "GET"
                if method != allowed:
                    self._read_body()  # keep the connection usable
                    endpoint.count(refused=1)
                    self._send(405, EndpointError(405, f"{method} {self.path}: use {allowed}").body(),
                               {"Allow": allowed})
                    return
                episode = endpoint.episode(match["episode"])
                if method == "GET":
                    self._send(200, endpoint.models())
                    return
                raw = self._read_body()
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise EndpointError(400, f"the request body is not JSON: {e}") from None
                self._send(200, endpoint.chat(episode, body))
            except EndpointError as e:
                endpoint.count(refused=1)
                self._send(e.status, e.body())
            except Exception as e:  # noqa: BLE001 - a bug or a failed generate call: the agent gets a 500
                endpoint.count(refused=1)
                self._send(500, EndpointError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

        def _read_body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                raise EndpointError(413, f"the request body is {length} bytes, over {MAX_BODY_BYTES}")
            return self.rfile.read(length)

        def do_POST(self) -> None:
            self._route("POST")

        def do_GET(self) -> None:
            self._route("GET")

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler


# ---------------------------------------------------------------- the agents


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
    """The agents' episodes as the multi-turn rollout's batch (`models.multiturn.MultiTurnOutput`), one row per
    episode in order: its last segment (the one its final answer is in; the trainer's batch has a row per
    prompt), prompts left-padded to `prompt_width` (None: the bucket of the longest), responses right-padded
    to `response_width`. Earlier segments of an episode are not trained (counted in
    `counters["dropped_segments"]`). An episode without a request (its agent failed first) is a row of one pad
    token with no response: nothing to train, scored as it failed. The endpoint's `max_prompt_tokens` /
    `max_response_tokens` keep every segment inside the widths; a longer one is an error here."""
    from jaxrlhf.models.lengths import bucket_length
    from jaxrlhf.models.multiturn import MultiTurnOutput

    rows = len(results)
    trajectories = [episode_trajectories(result, failure=failure) for result in results]
    lasts = [t[-1] if t else Trajectory([pad_id], reward=failure, finish="error") for t in trajectories]
    if prompt_width is None:
        prompt_width = bucket_length(max((len(last.prompt_ids) for last in lasts), default=1))
    prompts = np.full((rows, prompt_width), pad_id, np.int32)
    prompt_mask = np.zeros((rows, prompt_width), bool)
    tokens = np.full((rows, response_width), pad_id, np.int32)
    response_mask = np.zeros((rows, response_width), bool)
    loss_mask = np.zeros((rows, response_width), bool)
    logprobs = np.zeros((rows, response_width), np.float32)
    lengths, rewards, turns = np.zeros(rows, np.int32), np.zeros(rows, np.float32), np.zeros(rows, np.int32)
    counters, finish = [], []
    for r, (result, last) in enumerate(zip(results, lasts)):
        if len(last.prompt_ids) > prompt_width or len(last.token_ids) > response_width:
            raise ValueError(f"episode {result.episode.episode_id}: a prompt of {len(last.prompt_ids)} and a response "
                             f"of {len(last.token_ids)} tokens do not fit widths {prompt_width} and {response_width}; "
                             "give the endpoint max_prompt_tokens and max_response_tokens")
        n = len(last.token_ids)
        prompts[r, prompt_width - len(last.prompt_ids):] = last.prompt_ids
        prompt_mask[r, prompt_width - len(last.prompt_ids):] = True
        tokens[r, :n], response_mask[r, :n] = last.token_ids, True
        loss_mask[r, :n], logprobs[r, :n] = np.asarray(last.loss_mask, bool), last.logprobs
        lengths[r], rewards[r], turns[r] = n, last.reward, last.turns
        counters.append({**(last.counters or {"agent_error": float(result.error is not None)}),
                         "dropped_segments": float(max(len(trajectories[r]) - 1, 0))})
        finish.append(last.finish)
    return MultiTurnOutput(prompts, prompt_mask, tokens, response_mask, loss_mask, logprobs, lengths, rewards,
                           turns, counters, finish)


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
    responses padded to `max_new_tokens`) and metrics. Each request generates up to `turn_tokens` (default
    `max_new_tokens`); an episode's answers and observations together fit `response_budget`. The server lives
    across steps; each call swaps in the step's parameters. A row given to an agent is {"prompt", "answer"}."""

    def __init__(self, server: Any, agent: AgentFn | str, *, graphdef: Any, tokenizer: Tokenizer, sampling: Any,
                 max_new_tokens: int, response_budget: int | None, batch_size: int, max_positions: int,
                 turn_tokens: int | None = None,
                 max_prompt_tokens: int | None = None, eos_ids: Sequence[int] | None = None, seed: int = 0,
                 min_bucket: int = 16, warn: Callable[[str], None] = print):
        from jaxrlhf.models.generation import Generator

        self.params: Any = None
        self.max_new_tokens, self.pad_id = max_new_tokens, tokenizer.pad_id
        eos = tuple(tokenizer.eos_ids if eos_ids is None else eos_ids)  # the rollout's: the tokenizer's EOS ids
        generator = Generator(graphdef, eos_id=eos, pad_id=tokenizer.pad_id, min_bucket=min_bucket)
        backend = ModelBackend(generator, lambda: self.params, max_new_tokens=turn_tokens or max_new_tokens,
                               sampling=sampling,
                               max_positions=max_positions, batch_size=batch_size, seed=seed)
        endpoint = ChatEndpoint(backend, tokenizer, host=server.host, port=server.port, batch_size=batch_size,
                                window_s=server.window_ms / 1000, max_prompt_tokens=max_prompt_tokens, warn=warn)
        self.rollout = AgentRollout(endpoint, load_agent(agent) if isinstance(agent, str) else agent,
                                    prompt_width=None, response_width=response_budget or max_new_tokens,
                                    pad_id=tokenizer.pad_id, failure=server.failure, timeout_s=server.agent_timeout_s)

    @property
    def endpoint(self) -> ChatEndpoint:
        return self.rollout.endpoint

    def close(self) -> None:
        self.rollout.close()

    def __call__(self, params: Any, feed: Mapping[str, Any], *, prefix: str = ""
                 ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        self.params = params
        try:
            step = self.rollout([{"prompt": p, "answer": a} for p, a in zip(feed["prompts"], feed["answers"])])
        finally:
            self.params = None  # the step's weights are not held past it
        values = step.output.rollout_batch()
        pad = self.max_new_tokens - values["response_tokens"].shape[1]
        for name in ("response_tokens", "response_mask", "behaviour_logp", "action_mask", "tokens", "mask"):
            values[name] = np.pad(values[name], ((0, 0), (0, pad)),
                                  constant_values=self.pad_id if name.endswith("tokens") else 0)
        values["positions"] = np.maximum(np.cumsum(values["mask"], axis=1) - 1, 0).astype(np.int32)
        return {prefix + k: v for k, v in values.items()}, step.metrics


EpisodeValues = tuple[dict[str, np.ndarray], dict[str, float]]  # the generate call's outputs, the episodes' metrics


def episode_player(algorithm: Any) -> Callable[[Any, Mapping[str, Any]], EpisodeValues]:
    """What plays a step's episodes for the step loop (`env.name`): the rollout's own environments
    (`algorithm.episode_values`), or with env.name=openai_agent the run's `AgentEpisodes`, built at the first
    step (its batch size is the feed's rows) and kept on the algorithm for the next ones."""
    from jaxrlhf.config_schema import AGENT_ENVIRONMENT

    cfg = algorithm.cfg
    if cfg.env.name != AGENT_ENVIRONMENT:
        return algorithm.episode_values

    def play(params: Any, feed: Mapping[str, Any]) -> EpisodeValues:
        episodes = getattr(algorithm, "_agent_episodes", None)
        if episodes is None:
            from flax import nnx

            graphdef, s = algorithm.models["actor"].graphdef, algorithm.settings()
            budget = cfg.env.max_tokens or s.max_new_tokens
            from jaxrlhf.config_schema import AgentServerConfig

            episodes = AgentEpisodes(
                cfg.env.server or AgentServerConfig(), cfg.env.agent, graphdef=graphdef, tokenizer=algorithm.tokenizer,
                sampling=s.sampling,
                max_new_tokens=s.max_new_tokens, turn_tokens=cfg.env.max_turn_tokens or budget, response_budget=budget,
                batch_size=len(feed["prompts"]),
                max_positions=nnx.merge(graphdef, params).config.max_position_embeddings)
            algorithm._agent_episodes = episodes
            weakref.finalize(algorithm, episodes.close)  # the server stops with the run that made it
        return episodes(params, feed, prefix=algorithm.generated_prefix)

    return play
