"""Rewards that run outside the step: the sandbox (jaxrlhf.rewards.sandbox), its reward rule
`sandboxed_python`, the `remote` rule against a real local HTTP server, and the sandbox CLI.

The hostile battery runs each program once (concurrently, in a module fixture) and checks that it
is contained, scored as a failure, and that nothing outside its folder changed."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from jaxrlhf.rewards import sandbox
from jaxrlhf.rewards.rules import CombinedReward, extract_program
from jaxrlhf.rewards.sandbox import SandboxLimits, run_sandboxed

ROOT = Path(__file__).resolve().parents[1]
ADD_TESTS = """\
assert add(1, 2) == 3
assert add(-1, 1) == 0
def test_zero():
    assert add(0, 0) == 0
def test_large():
    assert add(10**12, 1) == 10**12 + 1
"""
SECRET = "s3cr3t-7f0c2a-do-not-leak"
FAST = SandboxLimits(cpu_seconds=2, timeout_seconds=6, max_processes=12)


def _sandbox_leftovers() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("jaxrlhf-sandbox-")}


def _sandbox_processes() -> list[str]:
    """Live processes of a sandbox uid (the root path gives each run its own uid); a killed process
    may stay a zombie for a moment until init reaps it, which holds nothing but its pid."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if entry.isdigit() and state != "Z" and 0 <= uid - sandbox.SANDBOX_UID_BASE < sandbox.SANDBOX_UID_SLOTS:
            found.append(f"{entry}:{state}")
    return found


# ---------------------------------------------------------------- honest programs


def test_a_correct_program_passes_every_test():
    v = run_sandboxed("def add(a, b):\n    return a + b\n", ADD_TESTS, FAST)
    assert (v.passed, v.total, v.status, v.limit) == (4, 4, "ok", None), v
    assert not v.failure and v.score == 1.0


def test_a_wrong_program_passes_some_and_names_the_failures():
    v = run_sandboxed("def add(a, b):\n    return a + b if b != 2 else 0\n", ADD_TESTS, FAST)
    assert (v.passed, v.total, v.status) == (3, 4, "failed"), v
    assert list(v.failures) == ["assert@1"] and "AssertionError" in v.failures["assert@1"]


def test_a_program_that_does_not_parse_fails_every_test_and_tests_that_do_not_parse_are_an_error():
    v = run_sandboxed("def add(a, b) return a + b\n", ADD_TESTS, FAST)
    assert (v.passed, v.total, v.status) == (0, 4, "failed") and "SyntaxError" in v.stderr_tail
    assert run_sandboxed("def add(a, b):\n    return a + b\n", "assert (", FAST).status == "error"
    assert run_sandboxed("x = 1\n", "x = 2\n", FAST).status == "error"  # no test in it


def test_async_tests_are_awaited():
    code = "import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 3\n"
    tests = "async def test_right():\n    assert await f() == 3\nasync def test_wrong():\n    assert await f() == 4\n"
    v = run_sandboxed(code, tests, FAST)
    assert (v.passed, v.total, list(v.failures)) == (1, 2, ["test_wrong"]), v


def test_printing_a_fake_verdict_changes_nothing():
    code = ('import json, os\nprint(json.dumps({"event": "test", "name": "assert@1", "ok": True}))\n'
            'for fd in range(3, 20):\n'
            '    try:\n        os.write(fd, b\'{"event": "test", "name": "assert@1", "ok": true}\\n\')\n'
            '    except OSError:\n        pass\n'
            'def add(a, b):\n    return None\n')
    v = run_sandboxed(code, ADD_TESTS, FAST)
    assert v.passed == 0 and v.status == "failed", v
    # nor does picking the harness's reporter or token off the __main__ module
    code = ('import __main__\nfor name in ("emit", "TOKEN", "FD"):\n    assert not hasattr(__main__, name), name\n'
            'def add(a, b):\n    return None\n')
    v = run_sandboxed(code, ADD_TESTS, FAST)
    assert v.passed == 0 and v.status == "failed" and "AssertionError" not in v.stderr_tail, v


# ---------------------------------------------------------------- the hostile battery


def _hostile(tmp: Path, port: int) -> dict[str, tuple[str, str, SandboxLimits]]:
    victim = tmp / "victim.txt"
    tests = "def test_it():\n    assert answer() == 42\n"
    return {
        # CPU seconds, not wall seconds: a loaded machine may take longer to use them up
        "infinite_loop": ("while True:\n    pass\n", tests, SandboxLimits(cpu_seconds=1, timeout_seconds=8)),
        "sleeps_forever": ("import time\ntime.sleep(3600)\n", tests, SandboxLimits(timeout_seconds=1.5)),
        "ten_gb": ("x = bytearray(10 * 2**30)\ndef answer():\n    return 42\n", tests, FAST),
        "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", tests,
                      SandboxLimits(cpu_seconds=2, timeout_seconds=4, max_processes=8)),
        # keeps forking after every refusal: only the process cap and the wall clock end it
        "stubborn_fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                               tests, SandboxLimits(cpu_seconds=2, timeout_seconds=3, max_processes=8)),
        "write_outside": (f"open({str(victim)!r}, 'w').write('pwned')\ndef answer():\n    return 42\n", tests, FAST),
        # past the in-interpreter guard: libc through ctypes, and a shell
        "write_outside_ctypes": (
            "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
            f"fd = libc.open({str(victim).encode()!r}, os.O_WRONLY | os.O_TRUNC)\n"
            "assert fd >= 0, 'open refused'\nlibc.write(fd, b'pwned', 5)\n"
            f"os.system('echo pwned > {victim}')\n"
            "def answer():\n    return 42\n", tests, FAST),
        "big_file": ("with open('big.bin', 'wb') as f:\n    f.write(b'0' * (64 << 20))\n", tests,
                     SandboxLimits(cpu_seconds=2, timeout_seconds=6, max_file_bytes=1 << 20)),
        # many files, each under the file-size limit: the folder's own size stops them
        "fills_folder": ("for i in range(64):\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20))\n", tests,
                         SandboxLimits(cpu_seconds=2, timeout_seconds=6, max_file_bytes=2 << 20, folder_bytes=8 << 20)),
        "floods_output": ("while True:\n    print('x' * 10000)\n", tests,
                          SandboxLimits(cpu_seconds=2, timeout_seconds=6, output_bytes=100_000)),
        "socket": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", tests, FAST),
        # past the audit hook: another interpreter, which has none
        "socket_subprocess": (
            "import subprocess, sys\n"
            f"r = subprocess.run([sys.executable, '-c', \"import socket; socket.create_connection(('127.0.0.1', {port}), "
            "timeout=1)\"], capture_output=True)\n"
            "assert r.returncode == 0, r.stderr.decode()[-200:]\n", tests, FAST),
        # reads every environment it can reach; the tests check the parent's secret is not in it
        # reads its own environment and every other process's it can reach; the tests check the
        # parent's secret is in neither
        "reads_environment": (
            "import os, sys\n"
            "def own():\n"
            "    return repr(dict(os.environ))\n"
            "def others():\n"
            "    seen = []\n"
            "    for pid in os.listdir('/proc'):\n"
            "        try:\n"
            "            seen.append(open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1'))\n"
            "        except (OSError, ValueError):\n"
            "            pass\n"
            "    return '\\n'.join(seen)\n"
            "sys.stderr.write(own() + others()[-1000:])\n",
            f"assert 'TMPDIR' in own()\nassert {SECRET!r} not in own()\n"
            f"def test_other_processes():\n    assert {SECRET!r} not in others()\n", FAST),
    }


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outside")
    victim = tmp / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    before = _sandbox_leftovers()
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXRLHF_SANDBOX_TEST_SECRET", SECRET)
    # a process started with the secret in its environment, as a trainer's is (/proc/PID/environ
    # shows the environment a process started with, not what it set later)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ))
    cases = _hostile(tmp, listener.getsockname()[1])
    start = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            futures = {name: pool.submit(run_sandboxed, *case) for name, case in cases.items()}
            verdicts = {name: f.result() for name, f in futures.items()}
    finally:
        mp.undo()
        holder.kill()
        holder.wait()
    seconds = time.monotonic() - start
    try:
        listener.accept()
        connected = True
    except BlockingIOError:
        connected = False
    listener.close()
    yield {"verdicts": verdicts, "victim": victim, "connected": connected, "seconds": seconds,
           "leftovers": _sandbox_leftovers() - before}


@pytest.mark.parametrize("name, status, limit", [
    ("infinite_loop", "timeout", "cpu_seconds"),
    ("sleeps_forever", "timeout", "timeout_seconds"),
    ("ten_gb", "memory", "memory_bytes"),
    ("fork_bomb", "processes", "max_processes"),
    ("stubborn_fork_bomb", "timeout", "timeout_seconds"),
    ("write_outside", "filesystem", "filesystem"),
    ("big_file", "file_size", "max_file_bytes"),
    ("fills_folder", "disk", "folder_bytes"),
    ("floods_output", "output", "output_bytes"),
    ("socket", "network", "network"),
])
def test_each_hostile_program_is_stopped_by_its_limit_and_scored_a_failure(battery, name, status, limit):
    v = battery["verdicts"][name]
    if name == "fills_folder" and v.isolation["folder"] != "tmpfs":
        pytest.skip("no mount namespace here: the run's folder has no size limit (documented)")
    assert (v.status, v.limit) == (status, limit), v
    assert v.failure and v.passed == 0 and v.total == 1


def test_the_battery_is_bounded_and_leaves_nothing_behind(battery):
    assert battery["seconds"] < 15, battery["seconds"]  # every run ended by its own limit
    assert battery["leftovers"] == set()  # every run's folder is removed
    assert battery["victim"].read_text() == "original"
    assert _sandbox_processes() == []  # no fork-bomb child outlived its run
    fork_bomb = battery["verdicts"]["stubborn_fork_bomb"]
    assert fork_bomb.isolation["nproc_limit"] >= 8


def test_writes_outside_the_folder_past_the_python_guard(battery):
    """The kernel keeps a file outside the folder unchanged where the run has a read-only view of
    the file system (user namespaces) or a uid of its own (the parent is root); without either, a
    write through libc to the user's own file is NOT stopped (docs/agentic.md), and this test says
    so instead of passing."""
    v = battery["verdicts"]["write_outside_ctypes"]
    iso = v.isolation
    if not (iso["own_uid"] or (iso["read_only_view"] and iso["view_locked"])):
        pytest.skip("neither root nor user namespaces: the sandbox cannot stop writes to its user's files (documented)")
    assert battery["victim"].read_text() == "original"
    assert v.passed == 0 and "open refused" in v.stderr_tail, v


NON_ROOT = """\
import os, sys
sys.path.insert(0, sys.argv[1])
import sandbox
victim = sys.argv[2]
code = ("import ctypes, os\\nlibc = ctypes.CDLL(None)\\n"
        f"fd = libc.open({victim.encode()!r}, os.O_WRONLY | os.O_TRUNC)\\n"
        "if fd >= 0:\\n    libc.write(fd, b'pwned', 5)\\n"
        f"os.system('echo pwned > {victim}')\\n"
        "open('mine.txt', 'w').write('x')\\n")
tests = "assert fd < 0\\ndef test_mine():\\n    assert open('mine.txt').read() == 'x'\\n"
v = sandbox.run_sandboxed(code, tests, sandbox.SandboxLimits(timeout_seconds=8))
print(v.status, v.passed, v.isolation["own_uid"], v.isolation["read_only_view"], v.isolation["view_locked"])
"""


def test_as_a_user_the_read_only_view_keeps_the_users_own_files(tmp_path):
    """The path a non-root trainer takes: the sandbox's parent runs as `nobody` and the victim is
    nobody's own file, so only the read-only view of the file system can keep it unchanged."""
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (to start a process as nobody) and /usr/bin/python3")
    home = Path(tempfile.mkdtemp(prefix="sandbox-as-user-"))
    try:
        shutil.copy(Path(sandbox.__file__), home / "sandbox.py")  # the module is the standard library only
        victim = home / "victim.txt"
        victim.write_text("original")
        (home / "probe.py").write_text(NON_ROOT)
        for path in (home, victim, home / "sandbox.py", home / "probe.py"):
            os.chown(path, 65534, 65534)

        def as_nobody():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)

        out = subprocess.run(["/usr/bin/python3", "-I", str(home / "probe.py"), str(home), str(victim)],
                             capture_output=True, text=True, timeout=60, preexec_fn=as_nobody,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(home)}, cwd=str(home))
        assert out.returncode == 0, out.stderr
        status, passed, own_uid, view, locked = out.stdout.split()
        assert own_uid == "False"
        if view != "True":
            pytest.skip("no user namespaces for nobody here: same-user writes are not stopped (documented)")
        assert (status, passed, locked) == ("ok", "2", "True")  # the open refused, its own folder writable
        assert victim.read_text() == "original"
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_network_past_the_audit_hook(battery):
    v = battery["verdicts"]["socket_subprocess"]
    if not v.isolation["network_namespace"]:
        pytest.skip("no user namespaces here: only the in-interpreter audit hook blocks sockets (documented)")
    assert not battery["connected"]
    assert v.passed == 0 and v.status in ("failed", "crashed"), v
    assert "unreachable" in v.stderr_tail or "Errno" in v.stderr_tail, v.stderr_tail


def test_the_machines_unix_sockets_are_hidden():
    """A network namespace does not cover Unix sockets in the file system: the read-only view lays an
    empty tmpfs over /run (where docker.sock and the session's sockets live). The socket here is
    world-writable, so only the hiding can stop the connection."""
    if os.geteuid() != 0 or not os.path.isdir("/run"):
        pytest.skip("needs root to make a socket in /run")
    path = f"/run/jaxrlhf-sandbox-test-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(1)
    server.setblocking(False)
    try:
        code = ("import subprocess, sys\n"  # another interpreter: past the audit hook
                f"r = subprocess.run([sys.executable, '-c', \"import socket; socket.socket(socket.AF_UNIX).connect({path!r})\"],"
                " capture_output=True)\nsys.stderr.write(r.stderr.decode()[-300:])\n"
                "def connected():\n    return r.returncode == 0\n")
        v = run_sandboxed(code, "assert not connected()\n", FAST)
        if not v.isolation["read_only_view"]:
            pytest.skip("no mount namespace here: the machine's Unix sockets are reachable (documented)")
        assert (v.passed, v.status) == (1, "ok") and "FileNotFoundError" in v.stderr_tail, v
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        os.unlink(path)


def test_the_parents_environment_does_not_reach_the_run(battery):
    v = battery["verdicts"]["reads_environment"]
    assert SECRET not in v.stderr_tail and "TMPDIR" in v.stderr_tail  # its own environment, minimal
    if not (v.isolation["own_uid"] or v.isolation["pid_namespace"]):
        # the same uid, the same /proc: another process's environment is readable (documented)
        assert v.passed >= 2 and set(v.failures) <= {"test_other_processes"}, v
        pytest.skip("neither root nor a PID namespace: the user's other processes' environments are readable")
    assert (v.passed, v.total, v.status) == (3, 3, "ok"), v


def test_without_namespaces_the_limits_and_guards_still_hold(monkeypatch, tmp_path):
    """The path of a machine without user namespaces: no network, PID or mount namespace, only the
    limits, the session kill, the own uid (as root) and the in-interpreter guard."""
    monkeypatch.setattr(sandbox, "_unshare_works", lambda uid, python: False)
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    cases = [
        ("def add(a, b):\n    return a + b\n", ADD_TESTS),
        (f"open({str(victim)!r}, 'a').write('pwned')\n", "assert True\n"),
        ("import socket\nsocket.socket()\n", "assert True\n"),
        ("import os\nwhile True:\n    os.fork()\n", "assert True\n"),
    ]
    limits = SandboxLimits(cpu_seconds=2, timeout_seconds=6, max_processes=8)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        verdicts = list(pool.map(lambda case: run_sandboxed(*case, limits), cases))
    assert [(v.status, v.limit) for v in verdicts] == [
        ("ok", None), ("filesystem", "filesystem"), ("network", "network"), ("processes", "max_processes")]
    assert not any(v.isolation["network_namespace"] or v.isolation["read_only_view"] for v in verdicts)
    assert victim.read_text() == "original"
    assert _sandbox_processes() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the own-uid path is root's")
def test_a_uid_slot_held_by_another_process_is_not_reused():
    """Reward worker processes each run sandboxes: a uid slot is locked across processes, so two runs at once
    never share a uid (one's cleanup killed the other's program, scored `crashed`, before the lock file)."""
    held = sandbox._reserve_slot()  # this process holds a slot, as a run in another worker would
    try:
        script = ("import json; from jaxrlhf.rewards.sandbox import *; "
                  "v = run_sandboxed('x = 1', 'assert x == 1', SandboxLimits()); print(json.dumps([v.status, v.isolation['uid']]))")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        status, uid = json.loads(out.stdout)
        assert status == "ok" and uid != sandbox.SANDBOX_UID_BASE + held
    finally:
        sandbox._release_slot(held)


# ---------------------------------------------------------------- the sandboxed_python rule


def test_sandboxed_python_rule_scores_a_batch_and_counts_its_failures():
    rule = CombinedReward([("sandboxed_python", 1.0, {"failure": -1.0, "timeout": 6, "cpu_seconds": 2,
                                                      "max_processes": 12, "workers": 3})])
    assert rule.names[:2] == ("sandboxed_python", "sandboxed_python/failure")
    responses = [
        "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",
        "def add(a, b):\n    return a + b if b != 2 else 0\n",  # no fence: the whole text
        "```python\nx = bytearray(10 * 2**30)\n```",
        "```python\nimport socket\nsocket.socket()\n```",
        "```python\nimport os\nwhile True:\n    os.fork()\n```",
    ]
    parts = rule.batch_components(["p"] * 5, responses, [ADD_TESTS] * 5)
    assert [p["sandboxed_python"] for p in parts] == [1.0, 0.75, -1.0, -1.0, -1.0]
    assert [p["sandboxed_python/failure"] for p in parts] == [0, 0, 1, 1, 1]
    assert parts[2]["sandboxed_python/memory"] == 1 and parts[3]["sandboxed_python/blocked"] == 1
    assert parts[4]["sandboxed_python/processes"] == 1
    assert set(parts[0]) == set(rule.names)  # every row has every metric the rollout reads
    one = CombinedReward([("sandboxed_python", 1.0, {"all_or_nothing": True})])
    assert one.components(prompt="p", response=responses[1], answer=ADD_TESTS)["sandboxed_python"] == 0.0


def test_extract_program_takes_the_last_python_block_else_the_text():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```\n") == "x = 2\n"
    assert extract_program("```py\ny = 3\n```") == "y = 3\n"
    assert extract_program("x = 1  # no fence") == "x = 1  # no fence"
    assert extract_program("```python\nx = 1\n```\nthen\n```python\ndef f():\n    return") == "def f():\n    return"


# ---------------------------------------------------------------- the remote rule


class _Scorer(http.server.BaseHTTPRequestHandler):
    inflight = 0
    most = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/ok":  # the score proves the body arrived: 1 when the response is the answer
            self._reply(200, json.dumps({"score": float(row["response"] == row["answer"])}).encode())
        elif self.path == "/slow":
            time.sleep(1.0)
            self._reply(200, b'{"score": 1.0}')
        elif self.path == "/garbage":
            self._reply(200, b"<html>not json</html>")
        elif self.path == "/error":
            self._reply(503, b"{}")
        elif self.path == "/busy":
            with _Scorer.lock:
                _Scorer.inflight += 1
                _Scorer.most = max(_Scorer.most, _Scorer.inflight)
            time.sleep(0.2)
            with _Scorer.lock:
                _Scorer.inflight -= 1
            self._reply(200, b"0.5")


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("path, kind", [("/slow", "timeout"), ("down", "unreachable"), ("/garbage", "garbage"),
                                        ("/error", "http")])
def test_remote_rule_scores_a_failing_server_with_the_failure_value(server, path, kind):
    url = f"http://127.0.0.1:{_closed_port()}/score" if path == "down" else server + path
    rule = CombinedReward([("remote", 1.0, {"url": url, "timeout": 0.3, "retries": 1, "backoff": 0.05,
                                            "failure": -2.0})])
    start = time.monotonic()
    parts = rule.batch_components(["q1", "q2"], ["a", "b"], ["a", "c"])
    seconds = time.monotonic() - start
    assert [p["remote"] for p in parts] == [-2.0, -2.0]
    assert all(p["remote/failure"] == 1 and p[f"remote/{kind}"] == 1 for p in parts), parts
    assert sum(v for k, v in parts[0].items() if k.startswith("remote/")) == 2  # failure + one kind
    # bounded: at most (retries + 1) timeouts and the backoff, the rows side by side
    assert seconds < 2 * 0.3 + 0.05 + 1.0, seconds


def test_remote_rule_scores_a_good_server(server):
    rule = CombinedReward([("remote", 1.0, {"url": server + "/ok", "failure": -2.0})])
    assert rule(prompt="q", response="42", answer="42") == 1.0
    parts = rule.batch_components(["q", "q", "q"], ["1", "2", "3"], ["1", "x", "3"])
    assert [p["remote"] for p in parts] == [1.0, 0.0, 1.0]
    assert all(p["remote/failure"] == 0 for p in parts)


def test_remote_rule_keeps_to_its_concurrency_limit(server):
    _Scorer.most = 0
    rule = CombinedReward([("remote", 1.0, {"url": server + "/busy", "concurrency": 3})])
    start = time.monotonic()
    scores = rule.batch(["q"] * 9, ["r"] * 9, [None] * 9)
    seconds = time.monotonic() - start
    assert scores.tolist() == [0.5] * 9
    assert 2 <= _Scorer.most <= 3  # concurrent, and never more than three at a time
    assert 0.55 < seconds < 3.0, seconds  # 9 rows of 0.2 s, 3 at a time (1.8 s one by one)


# ---------------------------------------------------------------- the CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "jaxrlhf.sandbox", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_cli_prints_the_verdict_and_refuses_bad_paths_in_one_line(tmp_path):
    code, tests = tmp_path / "solution.md", tmp_path / "tests.py"
    code.write_text("Answer:\n```python\ndef add(a, b):\n    return a + b\n```\n")
    tests.write_text(ADD_TESTS)
    out = _cli("--code", str(code), "--tests", str(tests), "--extract", "--timeout", "5")
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)
    assert (verdict["passed"], verdict["total"], verdict["status"]) == (4, 4, "ok")
    bad = _cli("--code", str(tmp_path / "missing.py"), "--tests", str(tests))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == f"error: code file not found: {tmp_path / 'missing.py'}"
    folder = _cli("--code", str(code), "--tests", str(tmp_path))
    assert folder.returncode == 2 and len(folder.stderr.strip().splitlines()) == 1
