"""Processes of a run: which one logs and writes, and the barriers and agreements between them.

Every process runs the same program: the same calls, compilations and
collectives in the same order. With one process each function here is a
no-op or the obvious answer.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable

from jaxrlhf import jax_private

BARRIER_TIMEOUT_S = 600  # a process that does not reach a barrier in this time is stuck or dead

_barriers = itertools.count()
_passes: dict[str, int] = {}  # how often this process reached each named agreement (`_next_pass`)
_passes_lock = threading.Lock()


class DistributedError(RuntimeError):
    """The processes of a run could not start together or one of them failed; the message says which
    setting to change or which process to look at."""


def is_main() -> bool:
    """The process that prints progress and writes logs, metrics and exported files."""
    import jax

    return jax.process_index() == 0


def _next_pass(name: str) -> int:
    """How often this process has now reached the agreement `name` (from any thread): every process
    counts alike, so the count names the same meeting on each."""
    with _passes_lock:
        _passes[name] = n = _passes.get(name, 0) + 1
    return n


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


class Abandoned(DistributedError):
    """Another process gave up on what this one waits for (`barrier_unless_posted`); the message is its reason."""


def post(key: str, text: str) -> None:
    """Publish `text` under `key` to every process of the run (no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        jax_private.coordination_client().key_value_set(f"jaxrlhf/{key}", text, allow_overwrite=True)


def barrier_unless_posted(name: str, timeout_s: float, abandon_key: str) -> None:
    """A barrier that another process can call off: waits until every process arrives at `name`, but
    raises `Abandoned` (with the posted reason) as soon as any process `post`s `abandon_key`, as a
    process whose checkpoint writes failed does: it never arrives, and the others would wait out the
    whole timeout. Every process must reach the same `name` equally often (from any thread: passes of one
    name are counted, not of all barriers as in `barrier`)."""
    import time

    import jax

    name = f"{name}/{_next_pass(name)}"
    client = jax_private.coordination_client()
    client.key_value_set(f"jaxrlhf/arrived/{name}/{jax.process_index()}", "1")
    deadline = time.monotonic() + timeout_s
    for other in range(jax.process_count()):
        while True:
            try:
                client.blocking_key_value_get(f"jaxrlhf/arrived/{name}/{other}", 200)
                break
            except Exception:  # noqa: BLE001 - not there yet (the client reports a timeout as a generic error)
                pass
            try:
                reason = client.key_value_try_get(f"jaxrlhf/{abandon_key}")
            except Exception:  # noqa: BLE001 - nothing posted
                reason = None
            if reason is not None:
                raise Abandoned(reason)
            if time.monotonic() >= deadline:
                raise DistributedError(f"process {jax.process_index()} stopped waiting for process {other} at "
                                       f"{name!r} after {timeout_s:.0f} s; it failed, was killed or is stuck")


def any_process_at(name: str, flag: bool, timeout_s: float = BARRIER_TIMEOUT_S) -> bool:
    """`any_process` through the coordination service instead of a device collective: safe from any
    thread, and where a device collective could meet another that a process reached by another path
    (after a failure). Every process must reach the same `name` equally often."""
    import jax

    if jax.process_count() == 1:
        return flag
    client = jax_private.coordination_client()
    key = f"jaxrlhf/any/{name}/{_next_pass(name)}"
    client.key_value_set(f"{key}/{jax.process_index()}", "1" if flag else "0")
    try:
        return any(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)) == "1"
                   for p in range(jax.process_count()))
    except Exception as e:  # noqa: BLE001 - the client reports a missing process as a generic error
        raise DistributedError(
            f"process {jax.process_index()} stopped waiting for another process at {name!r} ({_first_line(e)}); "
            "a process failed, was killed or is stuck: its output has the first error"
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


_FAILED = "jaxrlhf: process 0 failed: "  # what `main_text` sends when process 0's `make` raised


def main_text(name: str, make: Callable[[], str], timeout_s: float = BARRIER_TIMEOUT_S) -> str:
    """`make()` run on process 0 only, its text given to every process (through the coordination
    service): for a choice each process could make alike but need not, such as a plan search that a
    time budget may cut short on one host and not another. Every process must call it with the same
    `name` the same number of times."""
    import jax

    if jax.process_count() == 1:
        return make()
    client = jax_private.coordination_client()
    key = f"jaxrlhf/main_text/{name}/{_next_pass(f'main_text/{name}')}"
    if is_main():
        try:
            text = make()
        except Exception as e:  # the others stop too, with its reason, instead of waiting for a text
            client.key_value_set(key, _FAILED + _first_line(e))
            jax_private.all_processes_meet(f"{key}/failed", 60)
            raise
        client.key_value_set(key, text)
        return text
    try:
        text = client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the client reports a missing process as a generic error
        raise DistributedError(
            f"process {jax.process_index()} stopped waiting for process 0's {name!r} ({_first_line(e)}); "
            "process 0 failed, was killed or is stuck: its output has the first error"
        ) from None
    if text.startswith(_FAILED):
        jax_private.all_processes_meet(f"{key}/failed", 60)
        raise MainFailed(f"process 0 could not make the run's {name}: {text[len(_FAILED):]}")
    return text


class MainFailed(DistributedError):
    """Process 0 could not make what `main_text` shares; every process stops with its reason (together,
    as `errors.EveryProcess`)."""

    every_process = True


def main_values(values: list[float]) -> list[float]:
    """Process 0's `values` on every process (the same length everywhere): decisions made from
    measurements, such as a re-plan from call times, must come out the same on every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(values)
    return [float(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32)))]
