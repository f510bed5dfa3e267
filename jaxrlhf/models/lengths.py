"""Padded sequence lengths: the one bucketing rule, so a run sees few distinct shapes and compiles few programs."""

from __future__ import annotations

import numpy as np


def bucket_length(length: int, minimum: int = 16, *, multiple: int | None = None, cap: int | None = None) -> int:
    """The padded length for sequences of up to `length` tokens.

    Without `multiple`: `minimum` doubled until it holds `length` (powers of two for a power-of-two
    minimum), which bounds the number of shapes by log2 of the longest. With `multiple`: the smallest
    multiple of it that holds `length` and `minimum`. Never above `cap` when given.
    """
    size = max(int(length), 1)
    if multiple:
        out = max(-(-size // multiple) * multiple, minimum)
    else:
        out = max(int(minimum), 1)
        while out < size:
            out *= 2
    return min(out, cap) if cap is not None else out


TRIM_WIDTHS = 4  # response widths a trimmed rollout batch may take: max_new_tokens, 1/2, 1/4 and 1/8 of it


def response_widths(max_new_tokens: int) -> tuple[int, ...]:
    """The widths (response columns) a rollout batch may be cut to after generation, narrowest first:
    `max_new_tokens` / 2^k for k < `TRIM_WIDTHS`, rounded up to a multiple of 8 (at most
    `max_new_tokens`). Few widths: each is one compiled program per train or inference call."""
    n = int(max_new_tokens)
    return tuple(sorted({bucket_length(-(-n // 2**k), 1, multiple=8, cap=n) for k in range(TRIM_WIDTHS)}))


def response_width(longest: int, max_new_tokens: int) -> int:
    """The narrowest of `response_widths` that holds a batch whose longest response has `longest` tokens."""
    return next(w for w in response_widths(max_new_tokens) if w >= min(int(longest), int(max_new_tokens)))


def lognormal_lengths(z: np.ndarray, median: int, sigma: float, cap: int) -> np.ndarray:
    """Response lengths median x exp(sigma x z) for standard normal draws `z`, rounded, in [1, cap]: the
    long-tailed lengths of reasoning rollouts. The planner prices generation with them
    (`planner.workload.Workload.response_lengths`) and `generation.simulated_lengths` makes a run's responses
    end at them, so a plan is measured on the workload it was priced on."""
    return np.clip(np.rint(median * np.exp(sigma * np.asarray(z, np.float64))), 1, cap).astype(np.int64)
