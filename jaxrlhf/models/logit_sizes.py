"""How the log-prob calls split their logits into chunks, JAX-free: the runtime (`logit_chunks`) and the
planner's memory model (`planner/memory.py`) size the chunks with the same functions."""

from __future__ import annotations

import math


def chunk_count(rows: int, length: int, budget: int | None, batch_ways: int = 1, length_ways: int = 1) -> int:
    """Into how many chunks a [rows, length] read is split: enough that a chunk holds at most `budget`
    positions a device (`algorithm.logit_chunk_tokens`; None: one chunk), and no more than one position a
    row each (a device's rows are the least a chunk holds)."""
    per_device = rows * length / max(batch_ways * length_ways, 1)
    if budget is None or per_device <= budget:
        return 1
    return max(min(math.ceil(per_device / budget), length // length_ways), 1)


def chunk_positions(per_device: float, rows_per_device: float, budget: int | None) -> float:
    """The positions a device builds logits for at once, out of `per_device` read positions over
    `rows_per_device` rows: what `chunk_count` gives, as the planner's memory model counts it (to within
    a position a row, where the length does not divide evenly)."""
    return per_device if budget is None else min(per_device, max(budget, rows_per_device))
