"""The agent endpoint's service: episodes by id, the chat template and tokenizer, the limits, and one chat
request's dispatch (its place in its episode's record, the generation, the reply), over a backend
(`environments.backends`). The HTTP transport is `environments.server`; what an episode records,
`environments.records`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from typing import Any

from jaxrlhf.environments.backends import Batcher, GenerateBackend, Request
from jaxrlhf.environments.chat import ChatRequest, EndpointError, cut_at_stop
from jaxrlhf.environments.records import Episode, decode_with_special_tokens
from jaxrlhf.environments.tool_calls import ParsedToolCalls, ToolSchemaError, detect_tool_format, parse_tool_calls
from jaxrlhf.models.chat_template import ChatTemplate, ChatTemplateError
from jaxrlhf.models.tokenizer import Tokenizer, prompt_prefix


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
    prefill_tokens: int = 0  # context tokens a forward computed (a backend's cache holds the rest)
    segments: int = 0  # of closed episodes
    matches: dict[str, int] = dataclasses.field(default_factory=lambda: {"tokens": 0, "text": 0, "rewrite": 0})


class ChatService:
    """Episodes by id, the chat template and tokenizer, the batcher, the limits; one request's dispatch.

    Limits, each refused with 400 (`context_length_exceeded`) before anything is recorded: a context (the
    segment's ids plus the request's new tokens) over the model's positions less max_new_tokens; a request
    that starts a segment with a prompt over `max_prompt_tokens`; with `max_response_tokens` (the trainer's
    response width), a continuation whose segment has no room left after its observation tokens (an answer
    is cut to the room there is, finish_reason "length").
    tool_format: a `tools.TOOL_CALL_FORMATS` name; None detects it from the template.
    """

    def __init__(self, backend: GenerateBackend, tokenizer: Tokenizer, *, template: ChatTemplate | None = None,
                 batch_size: int = 8, window_s: float = 0.01, max_prompt_tokens: int | None = None,
                 max_response_tokens: int | None = None, tool_format: str | None = None, model_name: str = "policy"):
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
        self.batcher = Batcher(backend, batch_size=batch_size, window_s=window_s)

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
        self.backend.release(episode.episode_id)
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
        self.batcher.close()

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"endpoint/requests": s.requests, "endpoint/refused": s.refused,
                "endpoint/prompt_tokens": s.prompt_tokens, "endpoint/completion_tokens": s.completion_tokens,
                "endpoint/tool_call_errors": s.tool_call_errors,
                "endpoint/temperature_overridden": s.temperature_overridden,
                "endpoint/prefill_tokens": s.prefill_tokens,
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
            sample = self.batcher.submit(Request(episode.episode_id, context)).result()  # a failure raises here
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
        sampling = self.backend.sampling  # the run's: a request's temperature is not honoured, only counted
        run_temperature = request.temperature if sampling is None else sampling.temperature
        self.count(requests=1, prompt_tokens=len(context), completion_tokens=len(tokens),
                   temperature_overridden=int(request.temperature not in (None, run_temperature)),
                   prefill_tokens=sample.prefilled)
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
