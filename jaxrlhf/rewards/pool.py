"""Rule rewards scored in worker processes (`rewards.workers`), beside the step instead of in it.

Why: a reward that runs a program against its tests or waits for a scoring service can take as long
as generation (for code RL, verl#980 measured 140 s of rewards against 180 s of rollout), and the
host step that scores a batch runs only after the whole batch is generated. With workers, the
`score_rules` host step spreads a batch over them (CPU-bound rules use every core), and the streaming
generator (`generation.partial_rollout`) hands each sample to them as soon as it ends (not when its
group ends), so the batch's rewards are computed while its other samples, and the next steps', are
still decoding: only the last chunk's samples are left when the batch completes (`time/reward_wait_s`,
`reward/hidden_frac`).

Order: the pool holds at most one task per worker and keeps the rest in a queue by priority (the
streaming generator's is the step a sample trains in), so samples of the next step that end early
never delay the scores the trainer waits for now; a plain FIFO would score them first.

Size: when a worker frees, it takes every queued task of the most urgent priority at once, up to the
rows its rules score at once (`rows_at_once`: `remote`'s `concurrency`). Samples are handed over a few
at a time as they end, and a rule that waits on a service takes as long for 1 row as for 8: one task
per hand-off left the rule's concurrency unused, and a worker fell behind the stream (bench_rewards:
54 % hidden).

The workers are started with `forkserver` (never forked from the trainer, whose JAX runtime has
threads), each builds the run's `CombinedReward` once, and a batch is scored with `batch_components`,
so a rule with a batch function (`remote`) still scores its rows concurrently inside a worker.
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import itertools
import math
import multiprocessing
import statistics
import threading
import time
from typing import Any, Sequence

from jaxrlhf.rewards.rules import CombinedReward

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


def rows_at_once(spec: RulesSpec) -> int | None:
    """Rows a worker's rules score in the time of one (the largest concurrency among the rules that
    score a batch concurrently: the argument a rule names in its `parallel_arg`), or None when no rule
    does (rows are then scored one after another, and a task of any size costs its rows' time)."""
    import inspect

    from jaxrlhf.rewards.rules import get_reward

    found = []
    for name, _, args in spec:
        fn = get_reward(name)
        arg = getattr(fn, "parallel_arg", None)
        if arg is not None:
            found.append(int(args.get(arg, inspect.signature(fn).parameters[arg].default)))
    return max(found) if found else None


class RewardTiming:
    """The rules' seconds per row as the run measures them (one round: `at_once` rows take as long as
    one), from the batches it scores, in the step or in the workers: the median over the latest
    WINDOW batches. The planner prices the `score_rules` host step with it (`Workload.reward_row_s`)."""

    WINDOW = 32

    def __init__(self, at_once: int | None):
        self.at_once = at_once
        self._rounds: collections.deque[float] = collections.deque(maxlen=self.WINDOW)

    def record(self, seconds: float, rows: int) -> None:
        """A batch of `rows` rows scored in one process in `seconds`."""
        if rows > 0:
            self._rounds.append(seconds / math.ceil(rows / (self.at_once or 1)))

    @property
    def row_s(self) -> float:
        """Seconds of one round; 0 before anything was scored."""
        return statistics.median(self._rounds) if self._rounds else 0.0


def _ready() -> None:
    """In a worker: nothing (submitted once per worker at start, so the processes start, import and
    build their rules while the trainer compiles, not when the first samples end)."""


class RewardPool:
    """`workers` processes scoring rows with the rules `spec` ((name, weight, args) entries)."""

    def __init__(self, spec: RulesSpec, workers: int, timing: RewardTiming | None = None):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.workers = workers
        self.task_rows = rows_at_once(spec)  # most rows one task gathers from the queue (None: all)
        self.timing = timing or RewardTiming(self.task_rows)  # every task's seconds per round
        context = multiprocessing.get_context("forkserver")
        self._pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                                            initargs=(spec,))
        # tasks not yet given to a worker: (priority, arrival, args, future), lowest first
        self._queue: list[tuple[int, int, tuple, concurrent.futures.Future]] = []
        self._arrival = itertools.count()
        self._lock = threading.RLock()  # a task done at once runs its callback in the submitting thread
        self._running = 0
        for _ in range(workers):
            self._pool.submit(_ready)

    def submit(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
               priority: int = 0) -> concurrent.futures.Future:
        """Score rows in a worker, lower `priority` first (then in arrival order); the future holds
        (components per row, the worker's seconds)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            heapq.heappush(self._queue, (priority, next(self._arrival),
                                         (tuple(prompts), tuple(responses), tuple(answers)), future))
            self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Give queued tasks to idle workers, most urgent first: each worker takes the queued tasks of
        the head's priority together, up to `task_rows` rows (a task is never split)."""
        with self._lock:
            while self._queue and self._running < self.workers:
                taken = [heapq.heappop(self._queue)]
                rows = len(taken[0][2][0])
                while (self._queue and self._queue[0][0] == taken[0][0]
                       and (self.task_rows is None or rows + len(self._queue[0][2][0]) <= self.task_rows)):
                    taken.append(heapq.heappop(self._queue))
                    rows += len(taken[-1][2][0])
                args = tuple(tuple(v for entry in taken for v in entry[2][k]) for k in range(3))
                self._running += 1
                task = self._pool.submit(_score, *args)
                sizes = [(entry[3], len(entry[2][0])) for entry in taken]
                task.add_done_callback(lambda task, sizes=sizes: self._finished(task, sizes))

    def _finished(self, task: concurrent.futures.Future,
                  sizes: list[tuple[concurrent.futures.Future, int]]) -> None:
        """Each gathered task's rows back to its own future, with its share (by rows) of the seconds."""
        with self._lock:
            self._running -= 1
        total, start = sum(n for _, n in sizes), 0
        for future, n in sizes:
            if task.cancelled():
                future.cancel()
            elif task.exception() is not None:
                future.set_exception(task.exception())
            else:
                parts, seconds = task.result()
                if start == 0:
                    self.timing.record(seconds, total)
                future.set_result((parts[start:start + n], seconds * n / max(total, 1)))
            start += n
        self._dispatch()

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str | None]) -> list[dict[str, float]]:
        """Every row's components, the rows spread over the workers in contiguous chunks."""
        n = len(prompts)
        size = max(1, -(-n // self.workers))
        futures = [self.submit(prompts[i:i + size], responses[i:i + size], answers[i:i + size])
                   for i in range(0, n, size)]
        return [row for f in futures for row in f.result()[0]]

    def close(self) -> None:
        with self._lock:
            for *_, future in self._queue:
                future.cancel()
            self._queue.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
