"""Rule rewards on decoded text (a registry, combinable with weights) and score shaping.

A rule reward is a plain Python function of the decoded text, registered with
`@register_reward("name")` and called with keyword arguments only:

    fn(*, prompt: str, response: str, answer: str | None, **params) -> float

`CombinedReward([("exact_match", 1.0), ("format", 0.1)])` sums weighted
rewards (a third tuple element passes params, e.g. `("length_penalty", 1.0,
{"max_chars": 200})`). Rule rewards run on the host on decoded strings;
their scores, like the reward model's, then go through `shape_scores`
(bias/scale, clip at ±20, EOS gating) on device.
"""

from __future__ import annotations

import math
import re
from typing import Any, Protocol, Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.algorithms.stats import last_token_onehot
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


# ---------------------------------------------------------------- shaping


def sequence_ended_with_eos(
    tokens: Int[Array, "batch time"],
    mask: Float[Array, "batch time"] | Bool[Array, "batch time"],
    eos_token_id: int | Sequence[int],
) -> Bool[Array, "batch"]:
    """True where the last response token is an EOS (the model chose to stop, it was not cut off).

    `eos_token_id` may list several ids (Llama 3.1 ends turns with any of three); each counts.
    """
    onehot = last_token_onehot(mask)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, (int, np.integer)) else list(eos_token_id)
    is_eos = jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32)).astype(jnp.float32)
    return jnp.sum(is_eos * onehot, axis=-1) > 0


def shape_scores(
    scores: Float[Array, "batch"],
    ended_with_eos: Bool[Array, "batch"] | None = None,
    *,
    bias: float = 0.0,
    scale: float = 1.0,
    clip: float | None = 20.0,
    eos_only: bool = True,
    no_eos_score: float = 0.0,
) -> Float[Array, "batch"]:
    """(score - bias) * scale, clipped to ±clip; `no_eos_score` for sequences that did not end with EOS.

    Used for reward-model and rule scores alike (ReaLHF defaults):
    the bias/scale put the reward model's output on a sane scale, the clip
    stops one outlier from dominating a batch, and a truncated sequence gets
    no credit (a reward model scores half an answer unreliably). Set
    `eos_only=False` to keep the score of truncated sequences.
    """
    shaped = (jnp.asarray(scores, jnp.float32) - bias) * scale
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"reward clip must be > 0 or None, got {clip}")
        shaped = jnp.clip(shaped, -clip, clip)
    if eos_only:
        if ended_with_eos is None:
            raise ValueError("shape_scores(eos_only=True) needs ended_with_eos")
        shaped = jnp.where(jnp.asarray(ended_with_eos), shaped, jnp.float32(no_eos_score))
    return shaped


def overlong_penalty(
    lengths: Int[Array, "batch"] | Float[Array, "batch"], *, max_len: int, buffer: int, penalty: float = 1.0
) -> Float[Array, "batch"]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to `max_len - buffer` response
    tokens, then falling linearly to `-penalty` at `max_len`.

    A hard cut-off gives a correct answer that ran a little long the same score as nonsense; the
    ramp tells the policy that length costs before it costs everything. `lengths` count the
    response tokens including the EOS token (verl's valid response length).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_new_tokens={max_len}], got {buffer}")
    excess = jnp.asarray(lengths, jnp.float32) - (max_len - buffer)
    return -penalty * jnp.clip(excess / buffer, 0.0, 1.0)
