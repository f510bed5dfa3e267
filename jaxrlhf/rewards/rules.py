"""Rule rewards on decoded text: a registry of plain Python functions, combinable with weights.

A rule reward is registered with `@register_reward("name")` and called with keyword arguments only:

    fn(*, prompt: str, response: str, answer: str | None, **params) -> float

`CombinedReward([("exact_match", 1.0), ("format", 0.1)])` sums weighted
rewards (a third tuple element passes params, e.g. `("length_penalty", 1.0,
{"max_chars": 200})`). Rule rewards run on the host on decoded strings; their
scores are then shaped on device (`jaxrlhf.algorithms.rewards`). This module
needs no JAX, so config validation can check `rewards.rules` names.

Two optional attributes of a rule function: `counters`, the names of counts it reports beside its
score (it returns a `RuleScore(value, name=count, ...)`; `CombinedReward.components` gives each as
"rule/name", 0 when not reported, so they reach the metrics as `reward/rule/<rule>/<name>`), and
`batch`, a function `(*, prompts, responses, answers, **params) -> list of scores` that scores a
whole batch at once (`CombinedReward.batch_components` and `batch` use it: rules that run outside
the step, `sandboxed_python` and `remote`, score a batch's rows concurrently).
"""

from __future__ import annotations

import concurrent.futures
import math
import re
from typing import Any, Protocol, Sequence

import numpy as np

from jaxrlhf.registry import Registry
from jaxrlhf.rewards import remote as remote_scoring
from jaxrlhf.rewards import sandbox

FINAL_ANSWER_MARKER = "####"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RuleScore(float):
    """A rule's score with counts for metrics: `RuleScore(0.0, timeout=1.0)` (names in its `counters`)."""

    counts: dict[str, float]

    def __new__(cls, value: float, **counts: float) -> "RuleScore":
        score = super().__new__(cls, value)
        score.counts = counts
        return score


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


# ---------------------------------------------------------------- rules that run outside the step

_PYTHON_BLOCK = re.compile(r"```(?:python3|python|py)[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_program(text: str) -> str:
    """The last ```python fenced block of `text` (the final answer; one the response ends inside, cut
    off by the token limit, runs to the end), else the whole text."""
    blocks = _PYTHON_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def _sandbox_score(verdict: sandbox.Verdict, all_or_nothing: bool, failure: float) -> RuleScore:
    if verdict.failure:
        kind = (verdict.status if verdict.status in ("timeout", "memory", "processes", "crashed", "error")
                else "blocked")
        return RuleScore(failure, failure=1.0, **{kind: 1.0})
    return RuleScore(float(verdict.passed == verdict.total) if all_or_nothing else verdict.score)


def _sandbox_limits(timeout: float, cpu_seconds: float, memory_mb: float, max_processes: int, max_file_mb: float,
                    output_kb: float, folder_mb: float) -> sandbox.SandboxLimits:
    return sandbox.SandboxLimits(cpu_seconds=cpu_seconds, memory_bytes=int(memory_mb * 2**20),
                                 max_processes=int(max_processes), max_file_bytes=int(max_file_mb * 2**20),
                                 timeout_seconds=timeout, output_bytes=int(output_kb * 2**10),
                                 folder_bytes=int(folder_mb * 2**20))


@register_reward("sandboxed_python")
def sandboxed_python(
    *, prompt: str, response: str, answer: str | None, all_or_nothing: bool = False, failure: float = 0.0,
    timeout: float = 10.0, cpu_seconds: float = 5.0, memory_mb: float = 512, max_processes: int = 16,
    max_file_mb: float = 16, output_kb: float = 1024, folder_mb: float = 64, workers: int = 2,
) -> float:
    """The fraction of the row's tests (its reference answer: asserts and test_* functions) that the
    response's program passes in a sandboxed subprocess (`jaxrlhf.rewards.sandbox`).

    The program is the response's last ```python fenced block, else the whole response.
    `all_or_nothing=True` scores 1 only when every test passes. A run that hits a limit (time, CPU,
    memory, processes, file size, folder size, output), is blocked (network, writes outside its folder),
    crashes or cannot run scores `failure` instead, counted as `failure` and by kind. `workers`:
    the sandboxes a batch runs at once.
    """
    del prompt, workers
    if answer is None:
        raise ValueError("reward 'sandboxed_python' needs the tests as the reference answer (data.answer_key)")
    limits = _sandbox_limits(timeout, cpu_seconds, memory_mb, max_processes, max_file_mb, output_kb, folder_mb)
    return _sandbox_score(sandbox.run_sandboxed(extract_program(response), answer, limits), all_or_nothing, failure)


def _sandboxed_python_batch(*, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                            workers: int = 2, **params: Any) -> list[float]:
    if workers < 1:
        raise ValueError(f"sandboxed_python workers must be >= 1, got {workers}")
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda row: sandboxed_python(prompt=row[0], response=row[1], answer=row[2], **params),
                             zip(prompts, responses, answers)))


sandboxed_python.counters = ("failure", "timeout", "memory", "processes", "blocked", "crashed", "error")  # type: ignore[attr-defined]
sandboxed_python.batch = _sandboxed_python_batch  # type: ignore[attr-defined]
sandboxed_python.parallel_arg = "workers"  # type: ignore[attr-defined]  # rows its batch scores at once


def _remote_score(result: remote_scoring.RemoteScore, failure: float) -> RuleScore:
    if result.score is None:
        return RuleScore(failure, failure=1.0, **{result.status: 1.0})
    return RuleScore(result.score)


@register_reward("remote")
def remote(
    *, prompt: str, response: str, answer: str | None, url: str = "", timeout: float = 10.0, retries: int = 2,
    backoff: float = 0.5, concurrency: int = 8, failure: float = 0.0,
) -> float:
    """The score an HTTP service gives the row (`jaxrlhf.rewards.remote`: POST {prompt, response,
    answer} to `url`, JSON {"score": x} back), with `retries` retries `backoff` seconds apart (doubling)
    and at most `concurrency` requests in flight to `url`; a service that is down, too slow
    (`timeout` seconds) or answers garbage scores `failure`, counted as `failure` and by kind."""
    result = remote_scoring.score_one(url, prompt, response, answer, timeout=timeout, retries=retries,
                                      backoff=backoff, concurrency=concurrency)
    return _remote_score(result, failure)


def _remote_batch(*, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                  url: str = "", timeout: float = 10.0, retries: int = 2, backoff: float = 0.5, concurrency: int = 8,
                  failure: float = 0.0) -> list[float]:
    results = remote_scoring.score_batch(url, prompts, responses, answers, timeout=timeout, retries=retries,
                                         backoff=backoff, concurrency=concurrency)
    return [_remote_score(r, failure) for r in results]


remote.counters = ("failure", *remote_scoring.FAILURES)  # type: ignore[attr-defined]
remote.batch = _remote_batch  # type: ignore[attr-defined]
remote.parallel_arg = "concurrency"  # type: ignore[attr-defined]  # rows its batch scores at once


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
        """Unweighted score of every term, and its counts ("rule/count"), for per-component metrics."""
        out: dict[str, float] = {}
        for name, fn, _, params in self.terms:
            out.update(_parts(name, fn, fn(prompt=prompt, response=response, answer=answer, **params)))
        return out

    def batch_components(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]
    ) -> list[dict[str, float]]:
        """`components` of every row; a rule with a `batch` function scores all rows in one call."""
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(
                f"batch lengths differ: {len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers"
            )
        rows: list[dict[str, float]] = [{} for _ in prompts]
        for name, fn, _, params in self.terms:
            batch = getattr(fn, "batch", None)
            if batch is not None:
                values = list(batch(prompts=prompts, responses=responses, answers=answers, **params))
            else:
                values = [fn(prompt=p, response=r, answer=a, **params) for p, r, a in zip(prompts, responses, answers)]
            for row, value in zip(rows, values):
                row.update(_parts(name, fn, value))
        return rows

    @property
    def names(self) -> tuple[str, ...]:
        """The keys of `components`: every term's name, then its counts."""
        return tuple(name for name, _, _, _ in self.terms) + tuple(
            f"{name}/{count}" for name, fn, _, _ in self.terms for count in getattr(fn, "counters", ()))

    def combine(self, parts: dict[str, float]) -> float:
        """The weighted sum of `components(...)`."""
        return sum(weight * parts[name] for name, _, weight, _ in self.terms)

    def __call__(self, *, prompt: str, response: str, answer: str | None) -> float:
        return self.combine(self.components(prompt=prompt, response=response, answer=answer))

    def batch(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]
    ) -> np.ndarray:
        """Scores of a batch of decoded sequences as a float32 [B] array."""
        return np.asarray([self.combine(c) for c in self.batch_components(prompts, responses, answers)],
                          dtype=np.float32)


def _parts(name: str, fn: RewardFn, value: float) -> dict[str, float]:
    counts = getattr(value, "counts", {})
    return {name: float(value), **{f"{name}/{c}": float(counts.get(c, 0.0)) for c in getattr(fn, "counters", ())}}
