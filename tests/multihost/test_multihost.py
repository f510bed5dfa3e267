"""Multi-process runs: 2 local processes x 4 CPU devices (gloo) against the 1-process 8-device run.

One shared 2-process session (`session` fixture) trains every case and checks cross-host
reallocation while this process trains the 1-process references; the tests below read what they
found. Kept small (tiny model, 3 steps, 8 prompts), and every 2-process run covers more than one
thing: interleaved is checked on the step it trains after resuming the reference's checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing import compile_cache
from jaxrlhf.testing.replan import write_wrong_profile

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
BASE = [
    "model.actor.preset=tiny", "run.steps=3", "run.checkpoint_every=0", "run.tensorboard=false",
    "run.export_hf=false", "data.batch_size=8", "data.max_prompt_len=16", "generation.max_new_tokens=4",
    "algorithm.minibatches=2", "sft.steps=0", "optimizer.actor.lr=1e-3", "optimizer.critic.lr=1e-3",
    "rewards.eos_only=false", 'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
    compile_cache.override(),
]
GRPO = ["algorithm.name=grpo", "algorithm.group_size=4", "algorithm.kl_coef=0.05"]
# 3 steps: the warm-up learning rate rises from 0 over them, so the final loss is on trained weights
WARM_UP = ["sft.steps=3", "sft.batch_size=8"]
PPO_KEYS = ("reward/mean", "kl/mean", "loss/policy", "loss/value", "entropy", "clipfrac", "approx_kl")
GRPO_KEYS = ("reward/mean", "kl/mean", "loss/policy", "entropy", "clipfrac", "advantages/mean")
# name -> (overrides, reference run, compared keys)
CASES = {
    # every group spans both processes; the exported HF files are gathered across them. The PPO runs start
    # with the actor's SFT warm-up (its own plan, data stream, seed and schedule), then the reference and
    # critic copied from the warmed-up actor; the warm-up's final loss is compared too (test below)
    "ppo-colocated": (["plan.strategy=colocated", "run.export_hf=true", *WARM_UP], "ppo", PPO_KEYS),
    # generation on process 0, training on 1; checkpoints every step, for the 2 -> 1 process resume
    "ppo-disaggregated": (["plan.strategy=disaggregated", "run.checkpoint_every=1", *WARM_UP], "ppo", PPO_KEYS),
    # GRPO's groups over both processes: searched on a profile that says generation on all 8 devices is
    # nearly free (jaxrlhf.testing.replan), re-planned after step 2 from process 0's call times: both
    # processes switch alike, mid-run
    "grpo-replanned": ([*GRPO, "plan.strategy=auto", "plan.replan_every=2"], "grpo", GRPO_KEYS),
}
REFERENCES = {"ppo": ["plan.strategy=colocated", "run.checkpoint_every=1", "run.export_hf=true", *WARM_UP],
              "grpo": [*GRPO, "plan.strategy=colocated"]}
# The 1-process reference's step-2 checkpoint, continued on 2 processes with actor and critic on
# different processes (interleaved).
RESUMED = "ppo-interleaved-resumed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, runs: dict, *, processes=2, devices=4, **extra) -> list[subprocess.Popen]:
    """Start the worker processes of one run (they write worker-<i>.json and their logs into `out`)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    procs = []
    for pid in range(processes):
        spec = dict(out=str(out), port=port, processes=processes, process_id=pid, devices=devices, runs=runs,
                    **extra)
        log = open(os.path.join(out, f"process-{pid}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, out, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"processes still running after {timeout} s; logs in {out}")
    return codes


def log_of(out, pid: int) -> str:
    with open(os.path.join(out, f"process-{pid}.log")) as f:
        return f.read()


def without_last_checkpoint(src, dst):
    """A copy of a run folder as if the run had died after step 2's checkpoint (appears at once: the
    workers wait for it)."""
    tmp = dst.with_name(dst.name + ".partial")
    shutil.copytree(src, tmp)
    shutil.rmtree(tmp / "checkpoints" / "3")
    if (tmp / "actor_hf").exists():
        shutil.rmtree(tmp / "actor_hf")
    os.rename(tmp, dst)


def one_process(out, name: str, overrides: list[str]) -> list[dict]:
    cfg = cfglib.load_config(None, [*BASE, *overrides, f"run.output_dir={out / name}"])
    train.run(cfg)
    return read_metrics(str(out / name / "metrics.jsonl"))


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """The 1-process references (here, 8 devices) and one 2-process session running every case."""
    out = tmp_path_factory.mktemp("multihost")
    runs = {name: [*BASE, *o, f"run.output_dir={out / name}"] for name, (o, _, _) in CASES.items()}
    runs["grpo-replanned"].append(f"plan.profile={write_wrong_profile([*BASE, *GRPO], str(out / 'wrong.yaml'))}")
    runs[RESUMED] = [*BASE, *WARM_UP, "plan.strategy=interleaved", "run.resume=true",
                     f"run.output_dir={out / RESUMED}"]
    # The workers start at once and wait for the reference's checkpoint only before the resumed run.
    # The re-planned case's two searches run 500 iterations, as tests/test_replan.py's (16000: 17 s each
    # on process 0 while process 1 waits); they still put generation on the wrong placement first.
    procs = launch(out, runs, realloc=True, wait_for={RESUMED: str(out / RESUMED)}, search_iterations=500)
    try:
        refs = {name: one_process(out, f"ref-{name}", o) for name, o in REFERENCES.items()}
        without_last_checkpoint(out / "ref-ppo", out / RESUMED)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    codes = wait_all(procs, out, timeout=1200)
    assert codes == [0, 0], f"exit codes {codes}\n{log_of(out, 0)[-3000:]}\n{log_of(out, 1)[-3000:]}"
    found = [json.load(open(out / f"worker-{i}.json")) for i in range(2)]
    records = {name: read_metrics(str(out / name / "metrics.jsonl")) for name in runs}
    return dict(out=out, refs=refs, found=found, records=records)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_match_one(session, case):
    _, ref, keys = CASES[case]
    got, want = session["records"][case], session["refs"][ref]
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        assert_same(a, b, keys, case)


def test_warm_up_alike_on_two_processes(session):
    """The SFT warm-up's final loss (step 1's `sft/final_loss`) is the one-process run's."""
    got, want = session["records"]["ppo-colocated"][0], session["refs"]["ppo"][0]
    assert got["sft/final_loss"] == pytest.approx(want["sft/final_loss"], rel=1e-5)


def test_two_processes_replan_alike(session):
    """The re-planned case checked its plan at step 2 on both processes (it matches the one-process
    run above whether or not it switched; on a switch both went on, on the same plan)."""
    step2 = session["records"]["grpo-replanned"][1]
    assert "replan/switched" in step2 and "replan/predicted_gain" in step2
    lines = [[line for line in log_of(session["out"], pid).splitlines() if "re-plan:" in line] for pid in (0, 1)]
    assert lines[0] and lines[0][0].startswith("step 2: re-plan:") and lines[0] == lines[1]


def test_process_zero_searches_the_first_plan_and_every_process_runs_it(session):
    """With `plan.strategy=auto` only process 0 searches (a time budget could cut one host's search
    short and not another's); the others print the plan it sent. The only auto case is re-planned."""
    logs = [log_of(session["out"], pid) for pid in (0, 1)]
    assert [log.count("plan.strategy=auto: ") for log in logs] == [1, 0]  # searched, or its kept search
    tables = [[line for line in log.splitlines() if line.startswith(("actor.generate ", "ref.inference "))]
              for log in logs]
    assert tables[0] and tables[0] == tables[1]


def test_only_process_zero_writes_metrics(session):
    for case in CASES:  # one record per step, not one per process
        assert [r["step"] for r in session["records"][case]] == [1, 2, 3]


def test_cross_host_reallocation_is_exact_under_transfer_guards(session):
    for found in session["found"]:
        assert found["realloc"] and all(found["realloc"].values()), found["realloc"]


def assert_same(got: dict, want: dict, keys, label):
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-3, abs=2e-5), (label, got["step"], key)


def test_export_gathers_every_tensor(session):
    from safetensors.numpy import load_file

    got = load_file(str(session["out"] / "ppo-colocated" / "actor_hf" / "model.safetensors"))
    want = load_file(str(session["out"] / "ref-ppo" / "actor_hf" / "model.safetensors"))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_checkpoint_from_one_process_resumes_on_two(session):
    records = session["records"][RESUMED]
    assert [r["step"] for r in records] == [1, 2, 3]  # steps 1-2 kept from the 1-process log, 3 trained
    assert_same(records[2], session["refs"]["ppo"][2], PPO_KEYS, RESUMED)


def test_checkpoint_from_two_processes_resumes_on_one(session):
    out = session["out"]
    without_last_checkpoint(out / "ppo-disaggregated", out / "resumed-on-one")
    cfg = cfglib.load_config(None, [*BASE, *WARM_UP, "plan.strategy=colocated", "run.resume=true",
                                    f"run.output_dir={out / 'resumed-on-one'}"])
    train.run(cfg)
    records = read_metrics(str(out / "resumed-on-one" / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert_same(records[2], session["refs"]["ppo"][2], PPO_KEYS, "2 -> 1 process resume")


def test_a_failed_or_killed_process_stops_the_other(tmp_path):
    """An exception in process 1, and process 1 killed: process 0 exits non-zero within 60 s, saying why."""
    runs = {"ppo": [*BASE, "plan.strategy=colocated", f"run.output_dir={tmp_path / 'run'}"]}
    (tmp_path / "raises").mkdir()
    (tmp_path / "killed").mkdir()
    raising = launch(tmp_path / "raises", runs, fail=1, heartbeat_s=5)
    killed = launch(tmp_path / "killed", {"ppo": [*runs["ppo"][:-1], f"run.output_dir={tmp_path / 'run2'}"]},
                    heartbeat_s=5)
    deadline = time.monotonic() + 300
    while "joined" not in log_of(tmp_path / "killed", 1) and time.monotonic() < deadline:
        time.sleep(0.5)
    killed[1].kill()
    t_kill = time.monotonic()
    code = killed[0].wait(timeout=120)
    assert code != 0 and time.monotonic() - t_kill < 60, (code, time.monotonic() - t_kill)
    # The raising process exits at once with its error; its peer stops on the missed heartbeats.
    assert raising[1].wait(timeout=300) != 0
    t_raise = time.monotonic()
    assert "injected failure" in log_of(tmp_path / "raises", 1)
    code = raising[0].wait(timeout=120)
    assert code != 0 and time.monotonic() - t_raise < 60
    for out in ("raises", "killed"):  # JAX's message, or ours when a barrier or a host read notices first
        log = log_of(tmp_path / out, 0)
        assert any(m in log for m in ("another task died", "failed, was killed or is stuck")), (out, log[-2000:])
