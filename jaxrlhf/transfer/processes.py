"""Processes of a run: which one logs and writes, and the barriers and agreements between them.

Every process runs the same program: the same calls, compilations and
collectives in the same order. With one process each function here is a
no-op or the obvious answer.
"""

from __future__ import annotations

import itertools

from jaxrlhf import jax_private

BARRIER_TIMEOUT_S = 600  # a process that does not reach a barrier in this time is stuck or dead

_barriers = itertools.count()


class DistributedError(RuntimeError):
    """The processes of a run could not start together or one of them failed; the message says which
    setting to change or which process to look at."""


def is_main() -> bool:
    """The process that prints progress and writes logs, metrics and exported files."""
    import jax

    return jax.process_index() == 0


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process reaches this point (no-op with one process). Every process must call
    barriers in the same order; each call gets a fresh id, so the same `name` can be used again."""
    import jax

    if jax.process_count() == 1:
        return
    client = jax_private.coordination_client()
    barrier_id = f"jaxrlhf/{name}/{next(_barriers)}"
    try:
        client.wait_at_barrier(barrier_id, int(timeout_s * 1000))
    except Exception as e:  # the coordination service reports a missing peer as a generic error
        raise DistributedError(
            f"process {jax.process_index()} stopped waiting for another process at {name!r} "
            f"({_first_line(e)}); a process failed, was killed or is stuck: its output has the first error"
        ) from None


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a signal may reach only some hosts, but the
    checkpoint it asks for is a collective all must join)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def agreed_steps(steps: list[int]) -> list[int]:
    """The checkpoint steps every process lists (the same list on each), so all try the same steps in
    the same order when they look for one to resume from."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(steps)
    longest = int(np.max(multihost_utils.process_allgather(np.array(len(steps)))))
    padded = np.full(max(longest, 1), -1, np.int64)
    padded[: len(steps)] = steps
    lists = multihost_utils.process_allgather(padded)
    common = set(steps)
    for row in np.asarray(lists).reshape(-1, padded.size):
        common &= {int(s) for s in row if s >= 0}
    return sorted(common)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def main_values(values: list[float]) -> list[float]:
    """Process 0's `values` on every process (the same length everywhere): decisions made from
    measurements, such as a re-plan from call times, must come out the same on every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(values)
    return [float(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32)))]
