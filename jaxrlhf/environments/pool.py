"""Environments in worker processes (`env.workers`): each episode lives in one worker, beside the trainer.

Why: `generate_multiturn` steps environments on host threads of the trainer's process, so a Python-heavy
environment (parsing, a simulation, a judge) holds the GIL against the host loop that feeds the decode
chunks. With workers the steps run in other processes; the host loop's threads only wait on a pipe.

Episode-sticky: an episode's environment is built (by registry name + `env.args`, as in the trainer) and
reset in one worker, which keeps the object, and every step of the episode goes to that worker. Episodes
are dealt to the workers in turn. A worker serves one request at a time, so N workers step up to N
episodes at once.

Faults end the episode, never the run (`EnvStepFailed.kind`, counted by `generate_multiturn` as
`env_error/<kind>`): `raised` (the step raised; the worker and its other episodes go on), `timeout` (the
step ran past `step_timeout_s`: the worker is killed and a fresh one started), `worker_crash` (the worker
died during the step, e.g. a segfault or `os._exit`), `worker_lost` (the episode lived in a worker that
was killed or died since: its environment object is gone). Faults while resetting (a row the environment
cannot start, a factory's bad `env.args`) are the run's errors, as in-process.

Workers are started with `forkserver` (never forked from the trainer's JAX threads) and import
`imports` (`env.imports`: the user modules that register custom environments) before building any. The
environment's name, `EnvironmentContext` and args must pickle (a config's args do; a `ChatTemplate`
pickles as its texts). No JAX here.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import multiprocessing
import pickle
import threading
import traceback
from typing import Any, Mapping, Sequence

from jaxrlhf.environments.base import EnvironmentContext, Observation, StepResult, make_environment

FAULT_KINDS = ("raised", "timeout", "worker_crash", "worker_lost")


class EnvStepFailed(RuntimeError):
    """A step that gave no result; `kind` (one of `FAULT_KINDS`) names how, for the metrics."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"environment step {kind}: {message}")
        self.kind = kind


class EnvWorkerError(RuntimeError):
    """A worker could not start (an `env.imports` module failed) or could not reset an episode."""


def import_modules(modules: Sequence[str]) -> None:
    """`env.imports`: the user modules that register environments, imported (in the trainer and in each
    worker) before `env.name` is looked up; one clear line when one fails."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise ImportError(f"env.imports: cannot import {module!r} ({type(e).__name__}: {e}); put its folder on "
                              "PYTHONPATH") from None


# ---------------------------------------------------------------- in a worker


def _portable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling (a factory's ValueError stays one), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return EnvWorkerError(f"{type(error).__name__}: {error}")


def _reply(conn: Any, message: tuple) -> None:
    try:
        conn.send(message)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # pickled before any byte is written
        conn.send(("error", EnvWorkerError(f"the environment returned a value that does not pickle: {e}"), ""))


def _serve(conn: Any, name: str, context: EnvironmentContext, args: Mapping[str, Any], imports: Sequence[str]) -> None:
    """A worker's loop: ("reset", [(episode, row)]), ("step", episode, text), ("release", [episode]), each
    answered ("ok", value) or ("error", exception, traceback text); ends at ("close",) or a closed pipe."""
    try:
        import_modules(imports)
    except ImportError as e:
        conn.send(("error", EnvWorkerError(f"in an environment worker: {e}"), traceback.format_exc()))
        return
    conn.send(("ok", None))
    envs: dict[int, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        if op == "close":
            return
        try:
            if op == "reset":
                observations = []
                for episode, row in message[1]:
                    env = make_environment(name, context, args)
                    observations.append(env.reset(row))
                    envs[episode] = env
                _reply(conn, ("ok", observations))
            elif op == "step":
                _reply(conn, ("ok", envs[message[1]].step(message[2])))
            elif op == "release":
                for episode in message[1]:
                    envs.pop(episode, None)
                _reply(conn, ("ok", None))
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as e:  # the environment's fault is its episode's, not the worker's
            _reply(conn, ("error", _portable(e), traceback.format_exc()))


# ---------------------------------------------------------------- in the trainer


class _Worker:
    """One worker process and its pipe; `generation` counts restarts (an episode of an older one is lost)."""

    def __init__(self, pool: EnvPool, index: int):
        self.pool, self.index = pool, index
        self.lock = threading.Lock()  # one request at a time on the pipe
        self.generation = 0
        self.ready = False
        self._start()

    def _start(self) -> None:
        p = self.pool
        self.conn, child = p._context.Pipe()
        self.process = p._context.Process(target=_serve, args=(child, p.name, p.env_context, p.args, p.imports),
                                          name=f"jaxrlhf-env-{self.index}", daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def _restart(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()
        self.generation += 1
        self._start()

    def _wait_ready(self) -> None:
        """The worker's start-up answer (its imports done); no timeout: a worker that dies closes the pipe."""
        try:
            status, *rest = self.conn.recv()
        except (EOFError, OSError):
            self.process.join()
            raise EnvWorkerError(f"environment worker {self.index} exited while starting "
                                 f"(exit code {self.process.exitcode})") from None
        if status != "ok":
            raise rest[0]
        self.ready = True

    def call(self, message: tuple, generation: int | None = None, requests: int = 1) -> Any:
        """Send `message` (`requests` resets or one step), wait at most `pool.step_timeout_s` per request for
        the answer. An episode made by an older `generation` of this worker is lost; a timeout or a dead
        worker restarts it."""
        timeout = None if self.pool.step_timeout_s is None else self.pool.step_timeout_s * requests
        with self.lock:
            if generation is not None and generation != self.generation:
                raise EnvStepFailed("worker_lost", f"its worker {self.index} was restarted after a fault")
            if not self.ready:
                self._wait_ready()
            try:
                self.conn.send(message)
                answered = self.conn.poll(timeout)
                reply = self.conn.recv() if answered else None
            except (EOFError, OSError):
                reply, answered = None, True
            if reply is None:
                if answered:  # the pipe closed: the worker is exiting
                    self.process.join(timeout=5)
                code = self.process.exitcode
                self._restart()
                if not answered:
                    raise EnvStepFailed("timeout", f"no answer within {timeout:g} s (env.step_timeout_s="
                                                   f"{self.pool.step_timeout_s} per request)")
                raise EnvStepFailed("worker_crash", f"worker {self.index} died (exit code {code})")
        status, value, *trace = reply
        if status != "ok":
            raise value
        return value


class RemoteEpisode:
    """One episode's environment in a worker: `step` as `Environment.step`, blocking (the host loop calls it
    on its threads); a step that gives no result raises `EnvStepFailed`."""

    def __init__(self, worker: _Worker, episode: int, generation: int):
        self.worker, self.episode, self.generation = worker, episode, generation

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """A fresh environment for this episode in its worker, reset with `row` (as `EnvPool.reset` does)."""
        return self.worker.call(("reset", [(self.episode, row)]), self.generation)[0]

    def step(self, action_text: str) -> StepResult:
        try:
            return self.worker.call(("step", self.episode, action_text), self.generation)
        except EnvStepFailed:
            raise
        except Exception as e:
            raise EnvStepFailed("raised", f"{type(e).__name__}: {e}") from e


class EnvPool:
    """`workers` processes holding episodes of the environment `name` (built with `context` and `args`, after
    importing `imports`); a step that runs past `step_timeout_s` seconds (None: no limit) is stopped."""

    def __init__(self, name: str, context: EnvironmentContext, args: Mapping[str, Any] | None = None, *,
                 workers: int, step_timeout_s: float | None = 60.0, imports: Sequence[str] = ()):
        if workers < 1:
            raise ValueError(f"env.workers: an environment pool needs at least one worker, got {workers}")
        self.name, self.env_context, self.args = name, context, dict(args or {})
        self.imports, self.step_timeout_s = tuple(imports), step_timeout_s
        try:
            pickle.dumps((name, context, self.args))
        except Exception as e:
            raise ValueError(f"env.workers={workers}: the environment's context and env.args must pickle to reach "
                             f"the workers ({type(e).__name__}: {e}); pass plain values, or set env.workers=0") from None
        self._context = multiprocessing.get_context("forkserver")
        self._episodes = itertools.count()
        self._next = 0  # the worker the next episode goes to
        self._workers = [_Worker(self, i) for i in range(workers)]

    @property
    def workers(self) -> int:
        return len(self._workers)

    def reset(self, rows: Sequence[Mapping[str, Any]]) -> tuple[list[RemoteEpisode], list[Observation]]:
        """A new episode per row, dealt to the workers in turn and reset there (the workers in parallel):
        the episodes and their first observations, in the rows' order."""
        placed: dict[int, list[tuple[int, int]]] = {}  # worker -> (row, episode)
        for i in range(len(rows)):
            placed.setdefault((self._next + i) % self.workers, []).append((i, next(self._episodes)))
        self._next = (self._next + len(rows)) % self.workers
        episodes: list[Any] = [None] * len(rows)
        observations: list[Any] = [None] * len(rows)

        def reset_on(w: int) -> None:
            worker = self._workers[w]
            generation = worker.generation
            try:
                got = worker.call(("reset", [(e, rows[i]) for i, e in placed[w]]), requests=len(placed[w]))
            except EnvStepFailed as e:
                raise EnvWorkerError(f"env.name={self.name}: resetting episodes in worker {w} failed: {e}") from None
            for (i, e), observation in zip(placed[w], got):
                episodes[i], observations[i] = RemoteEpisode(worker, e, generation), observation

        with concurrent.futures.ThreadPoolExecutor(len(placed) or 1) as threads:
            for future in [threads.submit(reset_on, w) for w in placed]:
                future.result()
        return episodes, observations

    def release(self, episodes: Sequence[RemoteEpisode]) -> None:
        """Drop the episodes' environments from their workers (those of a restarted worker are gone)."""
        for worker in self._workers:
            ids = [e.episode for e in episodes if e.worker is worker and e.generation == worker.generation]
            if ids:
                try:
                    worker.call(("release", ids))
                except EnvStepFailed:
                    pass  # the worker died and was restarted: nothing left to drop

    def close(self) -> None:
        for worker in self._workers:
            with worker.lock:
                try:
                    worker.conn.send(("close",))
                except OSError:
                    pass
                worker.process.join(timeout=5)
                if worker.process.is_alive():
                    worker.process.kill()
                    worker.process.join()
                worker.conn.close()
