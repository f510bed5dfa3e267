"""The one error boundary of the command-line entry points (train, plan, generate).

A user's mistake (a config key, a data file, model files, a plan, the
platform, a checkpoint, a full disk) ends in one or two lines that name the
file or key and the fix, with exit code 2. Anything else is a bug and keeps
its traceback. `--debug` (or JAXRLHF_DEBUG=1) shows the traceback of
expected errors too. Each module defines its own error class; this module
only lists them, so it imports nothing heavy.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from typing import Callable, Sequence

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's code for a run stopped by SIGINT


class RunError(ValueError):
    """A run cannot start or go on as asked: its output folder, its platform, or training that stopped
    making progress."""


class EveryProcess:
    """Mixin of errors that every process of a run raises together, after agreeing on them: no process
    fails alone, so none says that the others will stop on missed heartbeats. (A module below this one
    marks its error class with `every_process = True` instead.)"""

    every_process = True


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped a run cleanly; the message says what was saved and how to resume."""


# The user's mistakes, by the module that raises them.
_EXPECTED = (
    ("jaxrlhf.config", "ConfigError"), ("jaxrlhf.planner.plan", "PlanError"), ("jaxrlhf.data.sources", "DataError"),
    ("jaxrlhf.models.hf_families", "CheckpointError"), ("jaxrlhf.models.tokenizer", "TokenizerError"),
    ("jaxrlhf.models.generation", "GenerationError"), ("jaxrlhf.algorithms.base", "AlgorithmConfigError"),
    ("jaxrlhf.transfer.processes", "DistributedError"),
)


def _expected() -> tuple[type[BaseException], ...]:
    """The error classes a user's mistake raises, of the modules imported so far: a module that was
    never imported raised nothing, and importing it here would load JAX to report a config typo."""
    loaded = (sys.modules.get(module) for module, _ in _EXPECTED)
    return (RunError, *(getattr(m, name) for m, (_, name) in zip(loaded, _EXPECTED) if m is not None))


# OS errors a user fixes (space, permissions, a path that is a file), with the fix to print.
_OS_FIXES = {
    errno.ENOSPC: "the disk is full: free space or choose another run.output_dir",
    errno.EDQUOT: "the disk quota is exceeded: free space or choose another run.output_dir",
    errno.EACCES: "permission denied: choose a folder you can write to",
    errno.EROFS: "the file system is read-only: choose another folder",
    errno.ENOTDIR: "a path component is a file, not a folder: choose another path",
    errno.EISDIR: "a folder is in the way where a file is expected: choose another path",
}


def _kind(e: BaseException) -> str:
    """The error's kind in words, from the first of its classes named ...Error: a DiskFull (a
    CheckpointError) reads "checkpoint error"."""
    name = next((c.__name__ for c in type(e).__mro__ if c.__name__.endswith("Error")), type(e).__name__)
    return name.replace("Error", " error").lower()


def run_cli(prog: str, body: Callable[[Sequence[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run `body(argv)` (argv without `--debug`) inside the error boundary; returns the exit code.

    In a multi-process run a process that fails exits at once, skipping JAX's orderly shutdown (which
    waits for the others, which may be waiting in a collective for it): its heartbeats stop, and the
    coordination service ends the other processes within `distributed.heartbeat_timeout_s`."""
    try:
        return _run_cli(prog, body, argv)
    except BaseException:
        if _multiprocess():
            traceback.print_exc()
            _exit_now(1)
        raise


def _run_cli(prog: str, body: Callable[[Sequence[str]], int], argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("JAXRLHF_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return body(argv)
    except Interrupted as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return _failed(EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (nothing was being trained yet, so nothing needed saving)", file=sys.stderr)
        return _failed(EXIT_INTERRUPTED)
    except OSError as e:
        if e.errno not in _OS_FIXES:
            raise
        if debug:
            traceback.print_exc()
        where = f" ({e.filename})" if e.filename else ""
        print(f"{prog}: {_OS_FIXES[e.errno]}{where}", file=sys.stderr)
        return _failed(EXIT_USER_ERROR)
    except _expected() as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: {_kind(e)}: {e}", file=sys.stderr)
        if not debug:
            print(f"{prog}: (run with --debug for the traceback)", file=sys.stderr)
        return _failed(EXIT_USER_ERROR, alone=not getattr(e, "every_process", False))


def _multiprocess() -> bool:
    """Whether this process is one of several joined by jax.distributed (without importing JAX)."""
    from jaxrlhf.jax_private import joined_several_processes

    return joined_several_processes()


def _exit_now(code: int, alone: bool = True) -> None:
    import jax

    if alone and code != EXIT_INTERRUPTED:  # a signal stops every process together, after the agreed save
        print(f"process {jax.process_index()} failed and exits now (code {code}); the other processes stop "
              "within distributed.heartbeat_timeout_s, when the coordination service misses its heartbeats",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


USER_ERROR_MEETING_S = 30  # how long a process with a user's mistake waits for the others to have it too


COORDINATOR_GRACE_S = 3.0  # how long process 0 outlives the others after they met to exit


def _leave_the_service_last() -> None:
    """Process 0 hosts the coordination service: where every process exits together it waits a moment, so
    the others have exited before the service ends. Each runs a thread that aborts its process (SIGABRT)
    as soon as the service is gone, which raced their own exit right after the meeting (CI saw -6, not 2)."""
    import time

    import jax

    if jax.process_index() == 0:
        time.sleep(COORDINATOR_GRACE_S)


def _failed(code: int, alone: bool = True) -> int:
    """`code` for the caller to return; with several processes, exit at once instead (see run_cli).

    A user's mistake every process makes (a config key no process can use) is found by each on its own,
    at its own pace: a process that exits first ends the coordination service (process 0's) while the
    others still use it, and JAX aborts them before they say why. So the processes meet before exiting;
    one that waits alone (its mistake is its own) exits after `USER_ERROR_MEETING_S`."""
    if _multiprocess():
        if alone and code == EXIT_USER_ERROR:
            from jaxrlhf.jax_private import all_processes_meet

            alone = not all_processes_meet("jaxrlhf/exit-on-user-error", USER_ERROR_MEETING_S)
        if not alone or code == EXIT_INTERRUPTED:  # every process exits at this point together
            _leave_the_service_last()
        _exit_now(code, alone)
    return code
