"""Rule rewards scored in worker processes (`rewards.workers`), beside the step instead of in it.

Why: a reward that runs a program against its tests or waits for a scoring service can take as long
as generation (for code RL, verl#980 measured 140 s of rewards against 180 s of rollout), and the
host step that scores a batch runs only after the whole batch is generated. With workers, the
`score_rules` host step spreads a batch over them (CPU-bound rules use every core), and the streaming
generator (`generation.partial_rollout`) hands each group of samples to them as soon as it is done, so
the batch's rewards are computed while its other groups, and the next steps', are still decoding: only
the last groups' scoring is left when the batch completes (`time/reward_wait_s`, `reward/hidden_frac`).

The workers are started with `forkserver` (never forked from the trainer, whose JAX runtime has
threads), each builds the run's `CombinedReward` once, and a batch is scored with `batch_components`,
so a rule with a batch function (`remote`) still scores its rows concurrently inside a worker.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from typing import Any, Sequence

from jaxrlhf.algorithms.rules import CombinedReward

RulesSpec = list[tuple[str, float, dict[str, Any]]]

_rules: CombinedReward | None = None  # a worker's rules, built once by `_start`


def _start(spec: RulesSpec) -> None:
    global _rules
    _rules = CombinedReward(spec)


def _score(prompts: Sequence[str], responses: Sequence[str],
           answers: Sequence[str | None]) -> tuple[list[dict[str, float]], float]:
    """In a worker: every row's components and the seconds they took."""
    start = time.perf_counter()
    assert _rules is not None, "a reward worker scores only after `_start`"
    parts = _rules.batch_components(list(prompts), list(responses), list(answers))
    return parts, time.perf_counter() - start


class RewardPool:
    """`workers` processes scoring rows with the rules `spec` ((name, weight, args) entries)."""

    def __init__(self, spec: RulesSpec, workers: int):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.workers = workers
        context = multiprocessing.get_context("forkserver")
        self._pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                                            initargs=(spec,))

    def submit(self, prompts: Sequence[str], responses: Sequence[str],
               answers: Sequence[str | None]) -> concurrent.futures.Future:
        """Score rows in a worker; the future holds (components per row, the worker's seconds)."""
        return self._pool.submit(_score, tuple(prompts), tuple(responses), tuple(answers))

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str | None]) -> list[dict[str, float]]:
        """Every row's components, the rows spread over the workers in contiguous chunks."""
        n = len(prompts)
        size = max(1, -(-n // self.workers))
        futures = [self.submit(prompts[i:i + size], responses[i:i + size], answers[i:i + size])
                   for i in range(0, n, size)]
        return [row for f in futures for row in f.result()[0]]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
