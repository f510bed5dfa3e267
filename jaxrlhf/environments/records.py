"""What an agent's episode recorded through the endpoint, token in / token out (docs/agentic.md, "The agent
endpoint").

The trainer must see the tokens the policy sampled, with the log-probs it sampled them with. An agent sees
text, and when it sends the conversation back the chat template re-renders the model's answer, whose
re-tokenization need not equal the sampled ids (BPE has many spellings of a string). So each request's
prompt is compared with the episode's record (`Episode.match`): when it extends the record (its token ids,
or else the record's text), only the new part is tokenized and recorded as observation tokens (loss mask 0),
and the model generates after the record itself, so the sampled tokens are kept exactly as sampled. A prompt
that does not extend the record (the agent rewrote its history: a trimmed context, a template that drops old
reasoning, tools sent on one request and not the next) starts a new segment; every segment is trained as a
row of its own (`environments.agents.agent_output`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

from jaxrlhf.models.tokenizer import Tokenizer


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
