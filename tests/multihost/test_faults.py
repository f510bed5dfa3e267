"""Faults of a 2-process run (2 processes x 4 CPU devices, started as scripts/launch_env.sh starts them):
a second run into the folder of a running one is refused; a signal to one process stops both after one
agreed checkpoint, with exit code 130 and no failure reported; a newest checkpoint damaged for every
process is moved aside once (by process 0) and both resume from the step before, continuing the run's
metrics; processes given different counts or a repeated id are refused in one line; a disk that fills
for one process during a save stops both in one line, and damage only one process sees is agreed on.
Each resume reproduces the interrupted run's metrics."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing import compile_cache

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# test_multihost.py's run (its BASE), colocated: the programs of the worker.py runs below, so each is
# compiled once for the whole file and loaded from the test run's compilation cache after that
BASE = [
    "model.actor.preset=tiny", "run.tensorboard=false", "run.export_hf=false", "data.batch_size=8",
    "data.max_prompt_len=16", "generation.max_new_tokens=4", "algorithm.minibatches=2", "sft.steps=0",
    "optimizer.actor.lr=1e-3", "optimizer.critic.lr=1e-3", "rewards.eos_only=false",
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]', compile_cache.override(),
    "plan.strategy=colocated", "run.checkpoint_every=1", "distributed.heartbeat_timeout_s=10",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out, *overrides: str, claims=((0, 2), (1, 2))) -> list[subprocess.Popen]:
    """The processes of one run, with the environment variables launch_env.sh --local sets (`claims`: the
    JAXRLHF_PROCESS_ID and JAXRLHF_NUM_PROCESSES each is given)."""
    port = _free_port()
    procs = []
    for pid, count in claims:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
                   JAXRLHF_COORDINATOR=f"127.0.0.1:{port}", JAXRLHF_NUM_PROCESSES=str(count),
                   JAXRLHF_PROCESS_ID=str(pid))
        cmd = [sys.executable, "-m", "jaxrlhf.train", *BASE, f"run.output_dir={out}", *overrides,
               "run.distributed=true", "run.platform=cpu", "run.devices=4",
               f"distributed.transfer_port_base={_free_port()}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _values(records: list[dict]) -> list[dict]:
    """Metrics records without their timings (which differ between runs)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in records]


def _worker_launcher():
    """test_multihost.py's launcher of worker.py (with --import-mode=importlib tests are loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("multihost_launcher",
                                                  os.path.join(os.path.dirname(__file__), "test_multihost.py"))
    mh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mh)
    return mh


def _finish(procs, timeout: float) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process of the run was still going after the others stopped")
        out.append((p.returncode, err))
    return out


def test_signal_to_one_process_then_damaged_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    log = out / "metrics.jsonl"
    procs = _start(out, "run.steps=200")
    deadline = time.time() + 900
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if log.exists() and len(read_metrics(str(log))) >= 2:
            break
        time.sleep(0.2)
    # A second 2-process run started into the same folder meanwhile is refused by both its processes.
    for code, err in _finish(_start(out, "run.steps=200", "run.overwrite=true"), 600):
        assert code == 2 and "is in use by another run that is still going" in err, err
    assert all(p.poll() is None for p in procs)
    procs[1].send_signal(signal.SIGTERM)  # one process only, as a preempted host
    results = _finish(procs, 600)
    for code, err in results:
        assert code == 130, err
        assert "Traceback" not in err and "failed and exits" not in err, err
    assert "stopped by SIGTERM after step" in results[1][1]
    assert "stopped by a signal to another process after step" in results[0][1]
    reached = read_metrics(str(log))[-1]["step"]
    steps = sorted(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
    assert steps[-1] == reached and len(steps) >= 2

    # The newest checkpoint is damaged for both processes: process 0 moves it aside, once; both resume
    # from the step before and train step `reached` again, with the metrics it had.
    before = _values(read_metrics(str(log)))
    for dirpath, _, files in os.walk(out / "checkpoints" / str(reached) / "arrays" / "d"):
        for f in files:
            os.truncate(os.path.join(dirpath, f), 1)
    results = _finish(_start(out, f"run.steps={reached + 1}", "run.resume=true"), 900)
    for code, err in results:
        assert code == 0, err
    assert f"checkpoint step {reached}" in results[0][1] and f"using step {reached - 1}" in results[0][1]
    aside = [n for n in os.listdir(out / "checkpoints") if n.startswith(f"damaged-step-{reached}-")]
    assert len(aside) == 1, os.listdir(out / "checkpoints")
    after = read_metrics(str(log))
    assert [r["step"] for r in after] == list(range(1, reached + 2))
    for got, want in zip(_values(after[:reached]), before, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    shutil.rmtree(out)


@pytest.mark.parametrize("claims, message", [
    (((0, 3), (1, 2)), "distributed.num_processes differs between processes: process 0 was given 3, process 1"),
    (((0, 3), (1, 3), (1, 3)), "distributed.process_id=1 was given to two processes"),
], ids=["counts", "repeated-id"])
def test_launch_parameters_that_differ_end_every_process_in_one_line(tmp_path, claims, message):
    """Process 0 given a larger distributed.num_processes than process 1, and a repeated process id: every
    process exits with code 2 and the same line naming the key, before JAX starts (JAX waited 300 s and
    aborted)."""
    t0 = time.monotonic()
    for code, err in _finish(_start(tmp_path / "run", "run.steps=1", claims=claims), 300):
        assert code == 2 and message in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 120
    assert not (tmp_path / "run").exists()


def test_a_plan_process_zero_cannot_make_ends_every_process_in_one_line(tmp_path):
    """With plan.strategy=auto only process 0 searches (`transfer.processes.main_text`); a config no
    process can plan with (an unknown plan.hardware) is refused by every process at once, each with the
    reason, while it assembles the run (`run.assembly.setup` resolves the hardware profile before any
    search), instead of the others waiting for a plan."""
    t0 = time.monotonic()
    ends = _finish(_start(tmp_path / "run", "run.steps=1", "plan.strategy=auto", "plan.hardware=h101"), 300)
    for code, err in ends:
        assert code == 2 and "plan.hardware='h101': unknown hardware 'h101'" in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 120


def test_a_signal_during_a_save_stops_every_process_at_the_same_step(tmp_path):
    """SIGTERM reaches process 1 while it saves step 1's checkpoint, after this step's stop was agreed: both
    processes train step 2, agree to stop, save it and exit 130 (a process acting on its own flag stopped
    alone, leaving the other in step 2's collectives)."""
    mh = _worker_launcher()
    out = tmp_path
    run = [*mh.BASE, "run.steps=6", "run.checkpoint_every=1", f"run.output_dir={out / 'run'}"]
    codes = mh.wait_all(mh.launch(out, {"run": run}, signal_in_save=1, heartbeat_s=10), out, 900)
    assert codes == [130, 130], [mh.log_of(out, 0), mh.log_of(out, 1)]
    assert "stopped by SIGTERM after step 2" in mh.log_of(out, 1)
    assert "stopped by a signal to another process after step 2" in mh.log_of(out, 0)
    assert sorted(os.listdir(out / "run" / "checkpoints")) == ["1", "2"]
    assert [r["step"] for r in read_metrics(str(out / "run" / "metrics.jsonl"))] == [1, 2]


def test_disk_full_on_one_process_then_damage_one_process_sees(tmp_path):
    """Process 1's writes of step 3 fail for want of space (as TensorStore's do, in Orbax's save thread):
    it tells process 0, which stops waiting for it, and both exit with the same line (code 2), step 3's
    partial folder removed and steps 1-2 intact. Then step 2 is damaged in the shard files only process 1
    reads: the resumed run agrees on step 1 (the newest every process can read), process 0 moves step 2
    aside once, and steps 2-3 come out as the first run had them."""
    mh = _worker_launcher()
    run = [*mh.BASE, "run.steps=4", "run.checkpoint_every=1", "plan.strategy=colocated",
           f"run.output_dir={tmp_path / 'run'}"]
    checkpoints, log = tmp_path / "run" / "checkpoints", str(tmp_path / "run" / "metrics.jsonl")
    for name in ("full", "resumed"):
        (tmp_path / name).mkdir()
    codes = mh.wait_all(mh.launch(tmp_path / "full", {"run": run}, disk_full=[1, 3], heartbeat_s=10), tmp_path, 900)
    said = [mh.log_of(tmp_path / "full", i) for i in (0, 1)]
    assert codes == [2, 2], said
    for text in said:
        assert (f"worker: checkpoint error: cannot save checkpoint step 3 in {checkpoints}: the disk is full (no space "
                "left on device); the newest intact checkpoint is step 2. Free space") in text, text
        assert "Traceback" not in text and "failed and exits" not in text, text
    assert sorted(os.listdir(checkpoints)) == ["1", "2"]
    first = _values(read_metrics(log))
    assert [r["step"] for r in first] == [1, 2, 3]

    for f in os.listdir(checkpoints / "2" / "arrays" / "ocdbt.process_1" / "d"):
        os.truncate(checkpoints / "2" / "arrays" / "ocdbt.process_1" / "d" / f, 1)
    codes = mh.wait_all(mh.launch(tmp_path / "resumed", {"run": [*run, "run.resume=true"]}, heartbeat_s=10),
                        tmp_path, 900)
    said = [mh.log_of(tmp_path / "resumed", i) for i in (0, 1)]
    assert codes == [0, 0], said
    assert "checkpoint step 2 in" in said[0] and "using step 1" in said[0], said[0]
    assert len([n for n in os.listdir(checkpoints) if n.startswith("damaged-step-2-")]) == 1
    after = read_metrics(log)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    for got, want in zip(_values(after[:3]), first, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
