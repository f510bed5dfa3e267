"""OpenAI's chat completion request and error as the agent endpoint reads and writes them (standard library
only): messages as chat templates read them, the parts of a request the endpoint honours, stop strings.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from jaxrlhf.models.tokenizer import Tokenizer

MAX_STOP_SEQUENCES = 4  # as OpenAI's API


class EndpointError(Exception):
    """A request the endpoint refuses: an HTTP status and OpenAI's error body (`type`, `param`, `code`)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}



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
