"""Rule rewards on decoded text: a registry of plain Python functions, combinable with weights.

A rule reward is registered with `@register_reward("name")` and called with keyword arguments only:

    fn(*, prompt: str, response: str, answer: str | None, **params) -> float

`CombinedReward([("exact_match", 1.0), ("format", 0.1)])` sums weighted
rewards (a third tuple element passes params, e.g. `("length_penalty", 1.0,
{"max_chars": 200})`). Rule rewards run on the host on decoded strings; their
scores are then shaped on device (`jaxrlhf.algorithms.rewards`). This module
needs no JAX, so config validation can check `rewards.rules` names.
"""

from __future__ import annotations

import math
import re
from typing import Any, Protocol, Sequence

import numpy as np

from jaxrlhf.registry import Registry

FINAL_ANSWER_MARKER = "####"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardFn(Protocol):
    def __call__(self, *, prompt: str, response: str, answer: str | None, **params: Any) -> float: ...


REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
register_reward = REWARD_FUNCTIONS.register


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`; a clear error naming the known ones otherwise."""
    return REWARD_FUNCTIONS.get(name)


# ---------------------------------------------------------------- text helpers


def normalize_text(text: str) -> str:
    """Strip and collapse whitespace: formatting noise must not decide correctness."""
    return " ".join(text.split())


def extract_final_answer(text: str, marker: str = FINAL_ANSWER_MARKER) -> str:
    """The text after the last `marker` (GSM8K's "#### 42"), or the whole text when there is none."""
    if marker and marker in text:
        text = text.rsplit(marker, 1)[1]
    return normalize_text(text)


def parse_number(text: str) -> float | None:
    """The first number in `text` ("1,234.5" -> 1234.5, "$-3" -> -3.0), or None."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    try:
        return float(match.group(0).replace(",", ""))
    except ValueError:
        return None


# ---------------------------------------------------------------- rule rewards


@register_reward("exact_match")
def exact_match(*, prompt: str, response: str, answer: str | None, marker: str = FINAL_ANSWER_MARKER) -> float:
    """1.0 when the response's final answer equals the reference answer (whitespace-normalised), else 0.0.

    Both sides go through `extract_final_answer`, so a reference written as a
    full GSM8K solution ("... #### 42") compares by its final answer.
    """
    del prompt
    if answer is None:
        raise ValueError("reward 'exact_match' needs a reference answer")
    return float(extract_final_answer(response, marker) == extract_final_answer(answer, marker))


@register_reward("numeric_match")
def numeric_match(
    *, prompt: str, response: str, answer: str | None, strict: bool = True, tol: float = 1e-6
) -> float:
    """1.0 when the response's final number equals the reference number (GSM8K-style "#### 42").

    `strict=True` reads only the number after the last "####" (no marker, no
    credit); `strict=False` falls back to the last number in the response.
    """
    del prompt
    if answer is None:
        raise ValueError("reward 'numeric_match' needs a reference answer")
    expected = parse_number(extract_final_answer(answer))
    if expected is None:
        raise ValueError(f"reference answer {answer!r} holds no number")
    if FINAL_ANSWER_MARKER in response:
        got = parse_number(extract_final_answer(response))
    elif strict:
        got = None
    else:
        numbers = _NUMBER.findall(response)
        got = parse_number(numbers[-1]) if numbers else None
    if got is None:
        return 0.0
    return float(math.isclose(got, expected, rel_tol=tol, abs_tol=tol))


@register_reward("format")
def format_reward(
    *, prompt: str, response: str, answer: str | None, pattern: str = r"####\s*-?[\d,]*\.?\d+\s*$"
) -> float:
    """1.0 when the response matches `pattern` (default: it ends with "#### <number>"), else 0.0.

    A small shaping term that teaches the answer format before answers are right.
    """
    del prompt, answer
    return float(re.search(pattern, response.strip()) is not None)


@register_reward("length_penalty")
def length_penalty(*, prompt: str, response: str, answer: str | None, max_chars: int = 512) -> float:
    """0 up to `max_chars` characters, then falling linearly to -1 at twice that length.

    Discourages rambling without punishing responses of a sensible length.
    """
    del prompt, answer
    if max_chars <= 0:
        raise ValueError(f"length_penalty max_chars must be > 0, got {max_chars}")
    excess = max(len(response) - max_chars, 0)
    return -min(excess / max_chars, 1.0)


class CombinedReward:
    """Weighted sum of registered rule rewards.

    `spec` is a list of (name, weight) or (name, weight, params) tuples; the
    names are checked when the object is built, so a typo fails at start-up.
    """

    def __init__(self, spec: Sequence[tuple[str, float] | tuple[str, float, dict[str, Any]]]):
        if not spec:
            raise ValueError("CombinedReward needs at least one (name, weight) entry")
        self.terms: list[tuple[str, RewardFn, float, dict[str, Any]]] = []
        for entry in spec:
            if len(entry) not in (2, 3):
                raise ValueError(f"reward entry {entry!r} must be (name, weight) or (name, weight, params)")
            name, weight = entry[0], float(entry[1])
            params = dict(entry[2]) if len(entry) == 3 else {}
            self.terms.append((name, get_reward(name), weight, params))

    def components(self, *, prompt: str, response: str, answer: str | None) -> dict[str, float]:
        """Unweighted score of every term, for per-component metrics."""
        return {
            name: float(fn(prompt=prompt, response=response, answer=answer, **params))
            for name, fn, _, params in self.terms
        }

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _, _ in self.terms)

    def combine(self, parts: dict[str, float]) -> float:
        """The weighted sum of `components(...)`."""
        return sum(weight * parts[name] for name, _, weight, _ in self.terms)

    def __call__(self, *, prompt: str, response: str, answer: str | None) -> float:
        return self.combine(self.components(prompt=prompt, response=response, answer=answer))

    def batch(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]
    ) -> np.ndarray:
        """Scores of a batch of decoded sequences as a float32 [B] array."""
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(
                f"batch lengths differ: {len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers"
            )
        return np.asarray(
            [self(prompt=p, response=r, answer=a) for p, r, a in zip(prompts, responses, answers)],
            dtype=np.float32,
        )
