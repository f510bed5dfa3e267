"""What scoring a step's rule rewards adds to the step, as the runtime scores them (`rewards.workers`).

Why: a reward that waits on a judge or runs a program's tests can take as long as generation, so a plan
that ignores it mis-prices the step (and a re-plan cannot see it). The scoring is the graph's
`score_rules` host step; the simulator runs it as an op on no device between the generate call and the
calls that read the scores, lasting `score_seconds`:

- `rewards.workers=0`: the trainer scores the batch after generation, `at_once` rows in the time of one
  (`rewards.pool.rows_at_once`: `remote`'s `concurrency`): ceil(B / at_once) rounds.
- workers W, a batch at a time: `RewardPool.score` splits the batch into W contiguous chunks, one per
  worker: ceil(ceil(B / W) / at_once) rounds.
- workers W, streamed (`generation.partial_rollout` with eta >= 1): each sample is scored as it ends,
  beside decoding, so the step waits only for the tail: the rows that end in the batch's last decode
  chunk (those within `gen_chunk` tokens of its longest; every row when lengths do not vary) spread over
  the workers, or, when the workers score slower than the batch is generated, their backlog (all of the
  batch's rounds over the workers, less the batch's generation seconds), whichever is longer. The
  stream's decoding of the next step during that wait is not counted as hiding it (conservative).

A round lasts `Workload.reward_row_s`: the seconds of one row measured by the run
(`rewards.pool.RewardTiming`, read by `Algorithm.workload`); 0 (not measured yet) prices nothing.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrlhf.planner.workload import Workload


def rounds(rows: int, at_once: int | None) -> int:
    """Rounds one process takes to score `rows` rows, `at_once` at a time (None: one at a time)."""
    return math.ceil(rows / (at_once or 1)) if rows > 0 else 0


def tail_rows(lengths: np.ndarray, chunk: int) -> int:
    """Rows of a batch of response `lengths` that end in its last decode chunk of `chunk` steps."""
    return int(np.sum(lengths > lengths.max() - chunk))


def score_seconds(wl: Workload, generate_s: float, lengths: np.ndarray | None = None) -> float:
    """Seconds the step waits for its rule scores (the module docstring's three cases). `generate_s`:
    the batch's generation seconds; `lengths`: its response lengths (default: every row at the cap)."""
    if wl.reward_row_s <= 0:
        return 0.0
    rows, at_once, workers = wl.batch_size, wl.reward_at_once, wl.reward_workers
    if workers == 0:
        return rounds(rows, at_once) * wl.reward_row_s
    if not wl.gen_stream:
        return rounds(math.ceil(rows / workers), at_once) * wl.reward_row_s
    lengths = np.full(rows, wl.gen_len) if lengths is None else lengths
    tail = rounds(math.ceil(tail_rows(lengths, wl.gen_chunk) / workers), at_once) * wl.reward_row_s
    backlog = rounds(math.ceil(rows / workers), at_once) * wl.reward_row_s - generate_s
    return max(tail, backlog)
