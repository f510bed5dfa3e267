"""The continuous engine's slot pool size, JAX-free: the runtime (`continuous.py`) and the planner's
cost and memory model (`planner/cost.py`) size it with the same function."""

from __future__ import annotations


def default_slots(rows: int) -> int:
    """A quarter of the batch: with long-tailed lengths (mean well under a quarter of the longest) the
    pool stays busy until the longest row, while each step runs a quarter of the rows."""
    return max(rows // 4, 1)


def pool_size(rows: int, slots: int | None, batch_ways: int = 1) -> int:
    """Slots the engine runs: `slots` (None = `default_slots`) rounded up to a multiple of the batch's
    shards (a sharded batch axis must divide evenly), at most the batch."""
    s = default_slots(rows) if slots is None else int(slots)
    if s < 1:
        raise ValueError(f"generation slots must be >= 1, got {s}")
    return min(-(-s // batch_ways) * batch_ways, rows)
