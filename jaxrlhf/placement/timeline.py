"""Where a step's time goes: a timeline of device work and host work, and the step's breakdown.

Device work is dispatched asynchronously, so time measured around a dispatch
says nothing. Every device operation (a model call, a move of parameters or
of a call's inputs) is recorded instead when it is dispatched, with the
devices it runs on, and a waiter thread records when its outputs are ready.
A model call is recorded from its launch (after any compiling), its dispatch
included: XLA:GPU drives a while loop (a decode loop, a train call's layer and
minibatch loops) from the host, so there a launch returns only when most of
the call has run, and time taken after it would leave the call at ~0 s.
A device runs its work in dispatch order, so an operation starts once it is
dispatched and every earlier operation on any of its devices is done:

    start = max(dispatch, done of every earlier operation sharing a device)
    wait  = start - dispatch     (its inputs or its devices were still busy)
    run   = done - start

Host work (host steps between calls, reads of device values to host) is
timed directly. The step's wall time is then split by a sweep over the
timeline, every instant counted once, in order of precedence:

    compute  a model call runs
    move     only moves run (parameters resharded, inputs sent to a call's layout)
    host     only host work runs (host steps, the host side of reads)
    other    none of those: Python between dispatches, tracing, dispatch itself

so compute + move + host + other = the step. Per call, `run` and `wait` say
whether a slow call was slow itself or queued behind other work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Iterator

import jax

CATEGORIES = ("compute", "move", "host")  # in order of precedence; what is left is "other"


@dataclasses.dataclass
class Op:
    """One piece of work: a model call, a move or host work."""

    category: str  # "compute", "move" or "host"
    name: str  # the call it is or serves ("actor.train"), or the host step ("score_rules", "read")
    devices: frozenset[int]  # device ids (empty for host work)
    dispatched: float
    done: float | None = None
    start: float | None = None  # derived for device work (see the module docstring); measured for host work
    what: str = ""  # for moves: "params", "batch", "reload", "opt_reload" or "opt_offload"
    nbytes: int = 0
    finished: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    @property
    def run(self) -> float:
        return max((self.done or 0.0) - (self.start if self.start is not None else self.dispatched), 0.0)

    @property
    def wait(self) -> float:
        return (self.start if self.start is not None else self.dispatched) - self.dispatched


def device_ids(tree: Any) -> frozenset[int]:
    """Ids of every device that holds a shard of an array in `tree`, or that a sharding in it names."""
    ids: set[int] = set()
    for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding)):
        sharding = x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None)
        if isinstance(x, (jax.Array, jax.sharding.Sharding)) and sharding is not None:
            ids.update(d.id for d in sharding.device_set)
    return frozenset(ids)


class Timeline:
    """Operations of a run, in dispatch order; see the module docstring.

    `device()` records a dispatched operation and returns at once (a daemon
    thread waits for its outputs); `host()` times a block of host work.
    `finish(ops)` waits for the given operations and derives their starts.
    Only device work is kept here (for the starts of later work); a step keeps
    the list of its own operations.
    """

    HISTORY = 256

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[Op] = []  # device work whose start is not derived yet, in dispatch order
        self._threads: dict[int, threading.Thread] = {}
        self._history: list[Op] = []  # the latest finished device work, for the starts of what follows

    def device(self, category: str, name: str, outputs: Any, devices: frozenset[int], *, what: str = "",
               nbytes: int = 0, dispatched: float | None = None) -> Op:
        """Record work dispatched at `dispatched` (a `time.perf_counter()` taken before the launch; now
        when not given) whose results are `outputs`."""
        op = Op(category, name, devices, time.perf_counter() if dispatched is None else dispatched,
                what=what, nbytes=nbytes)

        def wait():
            try:
                jax.block_until_ready(outputs)
            except Exception as e:  # noqa: BLE001 - re-raised below unless an output was already consumed
                # An output donated to (or deleted by) later work before this thread looked: that work was
                # dispatched after this op, so the op is done by now. Any other error is re-raised.
                if "deleted" not in str(e) and "donated" not in str(e):
                    raise
            finally:  # always: a waiter that never sets `finished` would hang whoever waits for the op
                op.done = time.perf_counter()
                op.finished.set()

        th = threading.Thread(target=wait, daemon=True)
        with self._lock:
            self._pending.append(op)
            self._threads[id(op)] = th
        th.start()
        return op

    @contextlib.contextmanager
    def host(self, name: str, ops: list[Op]) -> Iterator[Op]:
        """Time a block of host work; the op is appended to `ops` (the step's)."""
        op = Op("host", name, frozenset(), time.perf_counter())
        op.start = op.dispatched
        ops.append(op)
        try:
            yield op
        finally:
            op.done = time.perf_counter()

    def wait_for_devices(self, devices: frozenset[int]) -> None:
        """Block until every dispatched operation on any of `devices` is done."""
        with self._lock:
            running = [o for o in self._pending if o.done is None and o.devices & devices]
        for o in running:
            o.finished.wait()

    def finish(self, ops: list[Op]) -> None:
        """Wait until `ops` are done, then derive the start of every finished device operation from the
        finished ones dispatched before it (work still running belongs to a later step and is derived when
        that step finishes)."""
        for op in ops:
            th = self._threads.pop(id(op), None)
            if th is not None:
                th.join()
        with self._lock:
            finished = [op for op in self._pending if op.done is not None]
            self._pending = [op for op in self._pending if op.done is None]
            for op in finished:
                self._threads.pop(id(op), None)
                earlier = [h.done for h in self._history if h.dispatched < op.dispatched and h.devices & op.devices]
                op.start = max([op.dispatched, *earlier])
                self._history.append(op)
            del self._history[:-self.HISTORY]


@dataclasses.dataclass
class StepTimes:
    """A step's wall time split by category (they add up to `seconds`), and per-call figures."""

    seconds: float
    split: dict[str, float]  # compute, move, host, other
    calls: dict[str, dict[str, float]]  # call -> run, wait, move
    moves: dict[str, float]  # "params" / "batch" / "reload" / "opt_reload" / "opt_offload" -> seconds moves of that kind ran (may overlap compute)

    def metrics(self) -> dict[str, float]:
        out = {"time/step_s": self.seconds}
        out.update({f"time/step/{k}_s": v for k, v in self.split.items()})
        for call, t in self.calls.items():
            out[f"time/{call}_s"] = t["run"]
            out[f"time/{call}/wait_s"] = t["wait"]
            out[f"time/{call}/move_s"] = t["move"]
        out["time/realloc_s"] = self.moves.get("params", 0.0)
        out["time/transfer_s"] = self.moves.get("batch", 0.0)
        out["time/reload_s"] = self.moves.get("reload", 0.0)
        out["time/optimizer_offload_s"] = self.moves.get("opt_reload", 0.0) + self.moves.get("opt_offload", 0.0)
        return out


def breakdown(ops: list[Op], t0: float, t1: float) -> StepTimes:
    """The step [t0, t1] explained by its operations (finished, starts derived)."""
    calls: dict[str, dict[str, float]] = {}
    moves: dict[str, float] = {}
    for op in ops:
        if op.category == "compute":
            c = calls.setdefault(op.name, {"run": 0.0, "wait": 0.0, "move": 0.0})
            c["run"] += op.run
            c["wait"] += op.wait
        elif op.category == "move":
            calls.setdefault(op.name, {"run": 0.0, "wait": 0.0, "move": 0.0})["move"] += op.run
            moves[op.what] = moves.get(op.what, 0.0) + op.run
    # Sweep: at every instant the category of highest precedence that has work running.
    edges = []
    for op in ops:
        a, b = max(op.start if op.start is not None else op.dispatched, t0), min(op.done or t1, t1)
        if b > a:
            rank = CATEGORIES.index(op.category)
            edges += [(a, 1, rank), (b, -1, rank)]
    edges.sort()
    split = dict.fromkeys(CATEGORIES, 0.0)
    active = [0] * len(CATEGORIES)
    last = t0
    for t, delta, rank in edges:
        running = [i for i, n in enumerate(active) if n > 0]
        if running:
            split[CATEGORIES[running[0]]] += t - last
        last = t
        active[rank] += delta
    total = t1 - t0
    split["other"] = max(total - sum(split.values()), 0.0)
    return StepTimes(total, split, calls, moves)
