"""Run a candidate Python program against tests in a subprocess with limits (no JAX).

    verdict = run_sandboxed(code, tests, SandboxLimits(timeout_seconds=5))
    verdict.passed, verdict.total, verdict.status, verdict.limit

One file over 600 lines, and on purpose: it imports the standard library only and nothing of jaxrlhf, so it
runs as a copied standalone file (a non-root process starting sandboxes, `tests/test_sandbox.py`), and the
child's program (`HARNESS`) is a string inside it for the same reason.

The tests are Python source: every top-level `assert` statement is one test, every top-level
function `test_*` is one test (called with no arguments after the top level has run; the last
definition of a name counts); other top-level statements (imports, helpers) run as setup. The
tests run in the candidate's namespace, after the candidate's code, so they call its functions by
name. A test passes when it raises nothing; an `async def test_*` is run with asyncio.

What each run gets (the `isolation` field of a `Verdict` says which of these were in force):

- its own temporary folder, removed afterwards: the working directory, HOME and TMPDIR;
- an environment of PATH, HOME, TMPDIR and LANG only (none of the parent's variables), and
  `python -I -S` (no user site, no site-packages, no PYTHON* variables);
- a new session: on a timeout the whole process group is killed (SIGKILL);
- resource limits set before the interpreter starts: RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE
  (file size; SIGXFSZ is ignored so a write past it raises), RLIMIT_NPROC (processes), RLIMIT_CORE 0,
  and a wall-clock timeout and a cap on the bytes of stdout + stderr enforced by the parent;
- when the parent runs as root: a uid of its own (`SANDBOX_UID_BASE + slot`, no passwd entry,
  one per concurrent run, also across processes: a lock file per slot), so the kernel's file
  permissions keep it from writing (and reading) the files of root and of every other user,
  RLIMIT_NPROC binds (it does not bind root), it cannot signal or read the parent's process
  (/proc/PID/environ), and every process left behind with that uid is killed after the run;
- when unprivileged user namespaces work (`unshare -Urnpfm`; probed once per uid kind): an empty
  network namespace (no interface but a down loopback: no network at all, also for code that gets
  past Python), a PID namespace (the run sees only its own processes in a fresh /proc, cannot
  signal anything outside, and when its first process ends the kernel kills every process in it,
  also those that called setsid), and a mount namespace in which the run's folder is a tmpfs of
  `folder_bytes` (nothing the program writes reaches the disk), every other mount is read-only,
  and an empty tmpfs hides /run, /var/run and /tmp/.X11-unix (the Unix sockets
  of the machine's services and the user's session); the process that runs the program then
  enters a user namespace below that one, so the kernel locks those mounts (the program cannot
  remount them writable or unmount one);
- always, inside the interpreter: an audit hook that refuses network sockets (a socketpair is
  allowed, for asyncio), connect/bind/sendto on any socket, and opening or changing files outside
  the run's folder. This is a best effort, NOT a security boundary: code
  that calls libc through ctypes, or runs another program, gets past it. It names the block in the
  verdict (status "network" or "filesystem"); the kernel mechanisms above are what contain.

What it does NOT protect against (read docs/agentic.md before pointing it at untrusted code):

- without user namespaces and as a non-root user: writes to any path the same user may write (an
  absolute path to the user's own files succeeds; RLIMIT_FSIZE only bounds each file's size), the
  network (only the audit hook refuses sockets), the parent's environment through
  /proc/PID/environ of the user's other processes, and a process that leaves the session (setsid)
  survives the process-group kill;
- without user namespaces: the size of the run's folder (many files, each under RLIMIT_FSIZE,
  can fill its disk until the run ends), and with a uid of its own writes to world-writable
  places (/tmp, /dev/shm), bounded per file by RLIMIT_FSIZE, not in total;
- Unix sockets outside the hidden places that the run's uid may connect to (as a non-root
  trainer: the user's own, e.g. in /tmp), also with namespaces: a read-only mount does not stop
  a connect();
- as a non-root user, RLIMIT_NPROC counts every process and thread of the user, so the limit is set
  to the user's current count plus `max_processes` (racy when other work starts processes);
  concurrent runs as root each have their own uid and their own count;
- reading world-readable files (the source tree, /etc), CPU and memory side channels, the kernel's
  attack surface (no seccomp filter);
- a hostile program forging its verdict: the tests run in the candidate's interpreter, and the
  harness reports each result with a per-run random token on a pipe of its own (so printing a fake
  verdict does nothing) and keeps its reporter off the __main__ module, but code that walks its
  callers' frames (sys._getframe, a traceback) or the garbage collector reaches the reporter and
  can forge passes. A policy trained on this reward can learn to do that; read the stderr tails.
"""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import json
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

STATUSES = ("ok", "failed", "timeout", "memory", "processes", "file_size", "disk", "output", "network",
            "filesystem", "crashed", "error")
FAILURE_STATUSES = frozenset(STATUSES) - {"ok", "failed"}  # scored with a rule's failure value
SANDBOX_UID_BASE = 1_879_000_000  # root path: the run in slot k has uid SANDBOX_UID_BASE + k
SANDBOX_UID_SLOTS = 256
_TAIL = 2000  # characters of stderr kept in a verdict


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (see the module docstring for what each does and does not stop)."""

    cpu_seconds: float = 5.0  # RLIMIT_CPU of each process (SIGXCPU, then SIGKILL a second later)
    memory_bytes: int = 512 << 20  # RLIMIT_AS: address space of each process
    max_processes: int = 16  # RLIMIT_NPROC: processes and threads of the sandbox's user
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file a process may write
    timeout_seconds: float = 10.0  # wall clock of the whole run; then the group is killed
    output_bytes: int = 1 << 20  # stdout + stderr; beyond it the run is killed (status "output")
    folder_bytes: int = 64 << 20  # the run's folder: a tmpfs of this size where mount namespaces
    #                               work (status "disk" when full); else a plain folder, no quota
    python: str | None = None  # the interpreter; None = this one, or /usr/bin/python3 when the
    #                            sandbox's uid cannot run this one (root path)

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "max_processes", "max_file_bytes", "timeout_seconds",
                     "output_bytes", "folder_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass
class Verdict:
    """The outcome of one run: `passed` of `total` tests, and how the run ended.

    status: "ok" (every test passed), "failed" (the tests ran, some failed), "timeout" (wall
    clock or CPU), "memory", "processes", "file_size", "disk", "network", "filesystem" (a limit
    or a block was hit: `limit` names the SandboxLimits field, or the block), "output" (too much
    output), "crashed" (the interpreter died before the tests finished), "error" (the run could
    not start, or the tests do not parse).

    isolation: which mechanisms were in force (`uid`, `own_uid`, `network_namespace`,
    `pid_namespace`, `read_only_view` and `view_locked`, `folder` ("tmpfs", "bind" or "plain"),
    `nproc_limit`, `python`).
    """

    passed: int
    total: int
    status: str
    limit: str | None = None
    stderr_tail: str = ""
    seconds: float = 0.0
    failures: dict[str, str] = dataclasses.field(default_factory=dict)  # test -> its error, short
    isolation: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def failure(self) -> bool:
        """The run ended on a limit, a crash or an error (not by the tests' own verdict)."""
        return self.status in FAILURE_STATUSES

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- the tests' shape


def tests_in(tests: str) -> list[str]:
    """The tests of a tests file, in the order the harness runs them (SyntaxError if it does not parse)."""
    tree = ast.parse(tests, "tests.py")
    asserts = [f"assert@{s.lineno}" for s in tree.body if isinstance(s, ast.Assert)]
    functions = [s.name for s in tree.body
                 if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name.startswith("test_")]
    return asserts + list(dict.fromkeys(functions))


# The program run in the child: `python -I -S harness.py FD` in the run's folder, the token on stdin.
# Records go to fd FD as JSON lines carrying the token; a supervisor process waits for the process
# that runs the tests and reports how it ended (in a PID namespace the supervisor is its init, which
# the processes inside cannot kill).
HARNESS = r'''

def _harness():
    import ast, errno, json, os, signal, sys, traceback

    FD = int(sys.argv[1])
    TOKEN = sys.stdin.readline().strip()
    _null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(_null, 0)
    os.close(_null)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def emit(**record):
        record["token"] = TOKEN
        data = (json.dumps(record) + "\n").encode()
        try:
            os.write(FD, data)
        except OSError:
            pass

    class NetworkBlocked(PermissionError):
        pass

    class WriteBlocked(PermissionError):
        pass

    socket_family_unix = 1  # AF_UNIX on Linux
    HOME = os.path.realpath(os.getcwd())
    WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    CHANGES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
               "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile")

    def outside(path):
        if isinstance(path, int):
            return False
        path = os.path.realpath(os.fsdecode(path))
        return path != os.devnull and not (path == HOME or path.startswith(HOME + os.sep))

    def audit(event, args):
        if event == "socket.__new__" and args[1] != socket_family_unix:  # a socketpair (asyncio's) is local
            raise NetworkBlocked("network access is blocked in the sandbox")
        if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            raise NetworkBlocked("network access is blocked in the sandbox")
        if event == "open" and args and not isinstance(args[0], int):
            mode, flags = args[1], args[2]
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITES)
            if writes and outside(args[0]):
                raise WriteBlocked(f"writing outside the run's folder is blocked: {args[0]!r}")
        elif event in CHANGES:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and outside(path):
                    raise WriteBlocked(f"changing files outside the run's folder is blocked: {path!r}")

    MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
    MOUNT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000

    def _unescape(path):
        return path.encode().decode("unicode_escape")  # mountinfo writes a space as \040

    def read_only_view(folder_bytes):
        """In the run's own user and mount namespaces: the run's folder a tmpfs of `folder_bytes` (its
        files copied in; else a bind mount of itself), every other mount read-only. Returns the
        mounts that could not be made so, and how the folder is mounted."""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        home = HOME.encode()
        files = {}
        for name in ("solution.py", "tests.py"):
            with open(name, "rb") as f:
                files[name] = f.read()
        options = f"size={folder_bytes},mode=700".encode()
        if libc.mount(b"tmpfs", home, b"tmpfs", 2 | 4, options) == 0:
            folder = "tmpfs"
            os.chdir(HOME)  # into the new mount: the old working directory is the folder below it
            for name, data in files.items():
                with open(name, "wb") as f:
                    f.write(data)
            os.mkdir("tmp")
        elif libc.mount(home, home, None, MS_BIND | MS_REC, None) == 0:
            folder = "bind"
            os.chdir(HOME)
        else:
            return ["bind of the run's folder: " + os.strerror(ctypes.get_errno())], "none"
        failed = []
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f.read().splitlines()]
        for fields in mounts:
            point = _unescape(fields[4])
            if point in (HOME, "/proc") or point.startswith((HOME + "/", "/proc/")):
                continue
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY
            for option in fields[5].split(","):
                flags |= MOUNT_FLAGS.get(option, 0)
            if libc.mount(None, point.encode(), None, flags, None) != 0:
                failed.append(f"{point}: {os.strerror(ctypes.get_errno())}")
        # the Unix sockets of the machine's services and of the user's session live here (a network
        # namespace does not cover sockets in the file system): an empty read-only tmpfs over them
        for place in sorted({os.path.realpath(p) for p in ("/run", "/var/run", "/tmp/.X11-unix")}):
            if os.path.isdir(place) and not (HOME == place or HOME.startswith(place + "/")):
                if libc.mount(b"none", place.encode(), b"tmpfs", MS_RDONLY | 2 | 4 | 8, b"size=4k") != 0:
                    failed.append(f"tmpfs over {place}: {os.strerror(ctypes.get_errno())}")
        return failed, folder

    def lock_view():
        """A user namespace below ours, with its own copy of the mounts: the kernel locks the read-only
        mounts copied into a less privileged namespace, so the program cannot make them writable again."""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare: " + os.strerror(ctypes.get_errno()))
        for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)

    def limit_of(exc):
        if isinstance(exc, MemoryError):
            return "memory_bytes"
        if isinstance(exc, NetworkBlocked):
            return "network"
        if isinstance(exc, WriteBlocked):
            return "filesystem"
        if isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
            return "max_processes"
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            return "max_file_bytes"
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return "folder_bytes"
        return None

    def run_tests():
        sys.addaudithook(audit)
        with open("solution.py", encoding="utf-8") as f:
            code = f.read()
        with open("tests.py", encoding="utf-8") as f:
            tests = f.read()
        tree = ast.parse(tests, "tests.py")
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        hits = []

        def note(exc):
            lim = limit_of(exc)
            if lim and lim not in hits:
                hits.append(lim)
                emit(event="limit", limit=lim)

        try:
            exec(compile(code, "solution.py", "exec"), ns)
        except BaseException as exc:  # the candidate's own failure: its tests fail, they still run
            note(exc)
            emit(event="candidate_error", error=repr(exc)[:300])
            traceback.print_exc()
        functions = {}
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test_"):
                functions[stmt.name] = None
            name = f"assert@{stmt.lineno}" if isinstance(stmt, ast.Assert) else None
            try:
                exec(compile(ast.Module([stmt], []), "tests.py", "exec"), ns)
            except BaseException as exc:
                note(exc)
                if name:
                    emit(event="test", name=name, ok=False, error=repr(exc)[:300])
                else:
                    emit(event="setup_error", line=stmt.lineno, error=repr(exc)[:300])
                    traceback.print_exc()
            else:
                if name:
                    emit(event="test", name=name, ok=True)
        for name in functions:
            try:
                result = ns[name]()
                if type(result).__name__ == "coroutine":  # an async def test_*
                    import asyncio
                    asyncio.run(result)
            except BaseException as exc:
                note(exc)
                emit(event="test", name=name, ok=False, error=repr(exc)[:300])
            else:
                emit(event="test", name=name, ok=True)
        emit(event="done")

    VIEW = len(sys.argv) > 3 and sys.argv[3] == "namespaces" and os.getpid() == 1
    if VIEW:
        try:
            failed, folder = read_only_view(int(sys.argv[2]))
        except Exception as exc:
            failed, folder = [repr(exc)], "none"
        emit(event="view", failed=failed, folder=folder)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if VIEW:
                lock_view()
                emit(event="locked")
            run_tests()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    else:
        while True:
            try:
                _, status, usage = os.wait4(pid, 0)
                break
            except InterruptedError:
                continue
        emit(event="exit", code=os.waitstatus_to_exitcode(status), cpu=usage.ru_utime + usage.ru_stime)
        if os.getpid() == 1:  # the init of a PID namespace: end and reap whatever the run left behind
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            while True:
                try:
                    os.wait()
                except ChildProcessError:
                    break
                except InterruptedError:
                    continue


# the harness's names live only inside _harness: the program cannot pick `emit` or the token off
# the __main__ module (it runs in this interpreter; its frames and the gc still reach them)
globals().pop("_harness")()
'''


# ---------------------------------------------------------------- isolation probes


_UID_LOCK = threading.Lock()
_UIDS_IN_USE: dict[int, int] = {}  # slot -> the descriptor holding its lock file
# One lock file per uid slot, so that runs in different processes (reward workers, two trainers on one machine)
# never share a uid: a shared uid would share RLIMIT_NPROC, and one run's cleanup would kill the other's processes.
SLOT_LOCK_FOLDER = os.path.join(tempfile.gettempdir(), "jaxrlhf-uid-locks")


def _reserve_slot() -> int | None:
    """A uid slot that no other run holds, in this process or another: an exclusive `flock` on the slot's file
    (the kernel drops it with the descriptor, also when the process dies). None when every slot is taken."""
    os.makedirs(SLOT_LOCK_FOLDER, mode=0o700, exist_ok=True)
    info = os.lstat(SLOT_LOCK_FOLDER)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(f"{SLOT_LOCK_FOLDER} must be a folder of uid {os.geteuid()} with mode 0700")
    with _UID_LOCK:
        for slot in range(SANDBOX_UID_SLOTS):
            if slot in _UIDS_IN_USE:
                continue
            fd = os.open(os.path.join(SLOT_LOCK_FOLDER, str(slot)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _UIDS_IN_USE[slot] = fd
            return slot
    return None


def _release_slot(slot: int) -> None:
    with _UID_LOCK:
        os.close(_UIDS_IN_USE.pop(slot))  # closing the descriptor drops the flock
_UNSHARE_OK: dict[int | None, bool] = {}
UNSHARE = ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
           "--mount-proc")


def _others_can_run(path: str) -> bool:
    """Every folder above `path` is searchable by others and `path` is executable by others."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _interpreter(limits: SandboxLimits, uid: int | None) -> str:
    if limits.python:
        return limits.python
    if uid is None or _others_can_run(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _others_can_run(candidate):
            return candidate
    return sys.executable


def _as(uid: int | None) -> dict[str, Any]:
    """Popen's arguments that start the child as `uid` (done in C between fork and exec)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _unshare_works(uid: int | None, python: str) -> bool:
    """Whether `unshare -Urnpf` runs `python` for this uid (probed once per uid kind)."""
    key = None if uid is None else -1
    if key not in _UNSHARE_OK:
        ok = False
        if shutil.which("unshare"):
            try:
                proc = subprocess.run([*UNSHARE, python, "-I", "-S", "-c", "pass"], env={"PATH": "/usr/bin:/bin"},
                                      capture_output=True, timeout=20, cwd="/", **_as(uid))
                ok = proc.returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
        _UNSHARE_OK[key] = ok
    return _UNSHARE_OK[key]


def _user_task_count(uid: int) -> int:
    """Processes and threads of `uid` now (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


def _kill_uid(uid: int, python: str) -> None:
    """Kill every process of `uid` (root path): a process of that uid that signals -1."""
    try:
        subprocess.run([python, "-I", "-S", "-c", "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
                        "except ProcessLookupError:\n    pass"], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                       capture_output=True, timeout=20, **_as(uid))
    except (OSError, subprocess.SubprocessError):
        pass


def _rmtree(path: str) -> None:
    def retry(func, p, _exc):  # a folder the program made unreadable or unwritable
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=retry)


# ---------------------------------------------------------------- the run


def run_sandboxed(code: str, tests: str, limits: SandboxLimits | None = None) -> Verdict:
    """Run `code` and then `tests` (see the module docstring) in a sandboxed subprocess."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    try:
        names = tests_in(tests)
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte
        return Verdict(0, 0, "error", stderr_tail=f"the tests do not parse: {exc}")
    if not names:
        return Verdict(0, 0, "error", stderr_tail="the tests hold no assert statement and no test_* function")
    root = os.geteuid() == 0
    slot = None
    if root:
        try:
            slot = _reserve_slot()
        except OSError as exc:  # the lock folder cannot be made or is not the trainer's own
            return Verdict(0, len(names), "error", stderr_tail=f"no sandbox uid: {exc}")
        if slot is None:
            return Verdict(0, len(names), "error", stderr_tail="all sandbox uids are in use")
    uid = SANDBOX_UID_BASE + slot if slot is not None else None
    python = _interpreter(limits, uid)
    folder = tempfile.mkdtemp(prefix="jaxrlhf-sandbox-")
    try:
        verdict = _run_in(folder, code, tests, names, limits, uid, python, start)
    finally:
        if uid is not None:
            _kill_uid(uid, python)
        _rmtree(folder)
        if slot is not None:
            _release_slot(slot)
    return verdict


def _run_in(folder: str, code: str, tests: str, names: list[str], limits: SandboxLimits, uid: int | None,
            python: str, start: float) -> Verdict:
    for name, text in (("solution.py", code), ("tests.py", tests), ("harness.py", HARNESS)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
    os.mkdir(os.path.join(folder, "tmp"))
    if uid is not None:
        for name in ("solution.py", "tests.py", "harness.py", "tmp", "."):
            os.chown(os.path.join(folder, name), uid, uid)
    os.chmod(folder, 0o700)
    namespaces = _unshare_works(uid, python)
    nproc = limits.max_processes if uid is not None else _user_task_count(os.getuid()) + limits.max_processes
    isolation = {"uid": uid if uid is not None else os.getuid(), "own_uid": uid is not None,
                 "network_namespace": namespaces, "pid_namespace": namespaces, "nproc_limit": nproc,
                 "python": python, "read_only_view": False, "view_locked": False, "folder": "plain"}
    env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": os.path.join(folder, "tmp"), "LANG": "C.UTF-8"}
    cpu = max(1, int(limits.cpu_seconds + 0.999))

    def preexec() -> None:  # after the switch to `uid`; lowering limits needs no privilege
        os.umask(0o077)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    read_fd, write_fd = os.pipe()
    argv = [python, "-I", "-S", "harness.py", str(write_fd), str(limits.folder_bytes)]
    if namespaces:
        argv = [*UNSHARE, *argv, "namespaces"]
    token = secrets.token_hex(16)
    try:
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(write_fd,), preexec_fn=preexec, **_as(uid),
                                start_new_session=True)
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        return Verdict(0, len(names), "error", stderr_tail=f"the sandbox did not start: {exc}",
                       isolation=isolation)
    os.close(write_fd)
    try:
        proc.stdin.write((token + "\n").encode())
        proc.stdin.close()
    except OSError:
        pass
    records, stderr, killed = _collect(proc, read_fd, limits, start)
    return _verdict(names, records, token, stderr, killed, proc.returncode, limits, isolation, start)


def _collect(proc: subprocess.Popen, read_fd: int, limits: SandboxLimits,
             start: float) -> tuple[bytes, bytes, str | None]:
    """Read the records, stdout and stderr until the run ends, is out of time or says too much."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    records_file = os.fdopen(read_fd, "rb", buffering=0)
    sel.register(records_file, selectors.EVENT_READ, "records")
    records, stderr = bytearray(), bytearray()
    output = 0
    killed = None
    deadline = start + limits.timeout_seconds
    exited_at = None
    while sel.get_map():
        now = time.monotonic()
        if killed is None and now >= deadline:
            killed = "timeout_seconds"
            _kill_group(proc)
        if exited_at is None and proc.poll() is not None:
            exited_at = now
            _kill_group(proc)  # what the run left behind in its group
        if exited_at is not None and now - exited_at > 1.0:
            break  # a process outside the group still holds a pipe
        if killed is not None and now - deadline > 2.0:
            break
        for key, _ in sel.select(timeout=0.05):
            data = os.read(key.fileobj.fileno(), 65536)
            if not data:
                sel.unregister(key.fileobj)
                continue
            if key.data == "records":
                if len(records) < 4 << 20:
                    records += data
                continue
            output += len(data)
            if key.data == "stderr":
                stderr = (stderr + data)[-4 * _TAIL:]
            if output > limits.output_bytes and killed is None:
                killed = "output_bytes"
                _kill_group(proc)
    _kill_group(proc)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for f in (proc.stdout, proc.stderr, records_file):
        f.close()
    sel.close()
    return bytes(records), bytes(stderr), killed


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _verdict(names: list[str], records: bytes, token: str, stderr: bytes, killed: str | None,
             returncode: int | None, limits: SandboxLimits, isolation: dict[str, Any], start: float) -> Verdict:
    results: dict[str, bool] = {}
    failures: dict[str, str] = {}
    hits: list[str] = []
    done = False
    exit_record: dict[str, Any] | None = None
    for line in records.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("token") != token:
            continue
        event = rec.get("event")
        if event == "test" and rec.get("name") in names and rec["name"] not in results:
            results[rec["name"]] = rec.get("ok") is True
            if rec.get("ok") is not True:
                failures[rec["name"]] = str(rec.get("error", ""))[:300]
        elif event == "limit" and rec.get("limit") not in hits:
            hits.append(str(rec.get("limit")))
        elif event == "done":
            done = True
        elif event == "exit" and exit_record is None:
            exit_record = rec
        elif event == "view" and "read_only_view_failed" not in isolation:
            failed = rec.get("failed")
            isolation["read_only_view_failed"] = [str(f)[:200] for f in failed][:20] if isinstance(failed, list) else []
            isolation["read_only_view"] = failed == []
            isolation["folder"] = str(rec.get("folder"))
        elif event == "locked":
            isolation["view_locked"] = True
    passed = sum(results.values())
    tail = stderr.decode("utf-8", "replace")[-_TAIL:]
    v = Verdict(passed, len(names), "failed", None, tail, time.monotonic() - start, failures, isolation)
    code = exit_record.get("code") if exit_record else returncode
    cpu_used = float(exit_record.get("cpu", 0.0)) if exit_record else 0.0
    cpu_limit = max(1, int(limits.cpu_seconds + 0.999))
    if killed == "timeout_seconds":
        v.status, v.limit = "timeout", killed
    elif killed == "output_bytes":
        v.status, v.limit = "output", killed
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu_used >= 0.9 * cpu_limit):
        v.status, v.limit = "timeout", "cpu_seconds"
    elif hits:
        v.limit = hits[0]
        v.status = {"memory_bytes": "memory", "max_processes": "processes", "max_file_bytes": "file_size",
                    "folder_bytes": "disk", "network": "network", "filesystem": "filesystem"}.get(hits[0], "crashed")
    elif not done:
        v.status = "crashed"
        if isinstance(code, int) and code < 0:
            v.stderr_tail = (tail + f"\n[killed by signal {-code}]")[-_TAIL:]
    else:
        v.status = "ok" if passed == len(names) else "failed"
    return v
