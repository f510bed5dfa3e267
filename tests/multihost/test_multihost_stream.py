"""Partial rollouts (`generation.partial_rollout`) on 2 local processes x 2 CPU devices against the
1-process 4-device run of the same config.

Every host decision of the streaming generator (admission, which groups are done, when a batch is
complete) comes from stream values read alike on every process, and every timing (reward workers'
progress, decoding while the trainer trains) is agreed through the coordination service, so both
processes issue the same programs in the same order. Colocated with eta = 1: the stream admits the next
step's prompts and decodes only between updates, so rows run across a weight update at points that do
not depend on timing, and the 2-process metrics equal the 1-process run's. Disaggregated (generator on
process 0's devices, trainer on process 1's): decoding overlaps the update for as long as the update
runs, which is a timing, so that run (DAPO with dynamic sampling, reward workers, whose progress is a
timing as well, and KV recompute) is checked for the staleness bound, not for equality.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing import compile_cache

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
STREAM = [
    "model.actor.preset=tiny", "run.steps=3", "run.checkpoint_every=0", "run.save_checkpoints=false",
    "run.tensorboard=false", "run.export_hf=false", "data.batch_size=4", "data.max_prompt_len=16",
    "generation.max_new_tokens=6", "generation.engine=continuous", "generation.partial_rollout=true",
    "generation.stream_chunk=2", "algorithm.max_staleness=1", "algorithm.name=grpo", "algorithm.group_size=4",
    "algorithm.kl_coef=0", "algorithm.minibatches=2", "sft.steps=0", "optimizer.actor.lr=1e-3",
    "rewards.eos_only=false", 'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-m]"}}]',
    compile_cache.override(),
]  # no KL term: no reference model, fewer programs to compile
EQUAL = [*STREAM, "plan.strategy=colocated"]
# scored by 2 worker processes per run process as samples end (each process scores the same rows); while
# a batch waits for its scores the stream decodes on, for as long as the workers take: a timing too. DAPO's
# dynamic sampling admits a step's next prompt as a group's scores come out all equal (when they are in on
# every process), and the rows in flight get their KV recomputed at each update
OVERLAPPED = [*STREAM, "plan.strategy=disaggregated", "rewards.workers=2", "algorithm.name=dapo",
              "algorithm.dynamic_sampling_factor=2", "generation.partial_recompute=true"]
KEYS = ("reward/mean", "loss/policy", "entropy", "clipfrac", "advantages/mean", "response/length_mean",
        "rollout/staleness", "rollout/staleness_mean", "rollout/partial_frac")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(out, pid: int) -> str:
    with open(os.path.join(out, f"process-{pid}.log")) as f:
        return f.read()


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """One 2-process session (both runs) while this process runs the 1-process reference."""
    out = tmp_path_factory.mktemp("multihost-stream")
    runs = {"equal": [*EQUAL, f"run.output_dir={out / 'equal'}"],
            "overlapped": [*OVERLAPPED, f"run.output_dir={out / 'overlapped'}"]}
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    procs = []
    for pid in range(2):
        spec = dict(out=str(out), port=port, processes=2, process_id=pid, devices=2, runs=runs)
        with open(out / f"process-{pid}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        ref = out / "reference"
        train.run(cfglib.load_config(None, [*EQUAL, "run.devices=4", f"run.output_dir={ref}"]))
        deadline = time.monotonic() + 900
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], f"exit codes {codes}\n{_log(out, 0)[-3000:]}\n{_log(out, 1)[-3000:]}"
    return {name: read_metrics(str(out / name / "metrics.jsonl")) for name in (*runs, "reference")}


def test_streamed_rollouts_on_two_processes_match_one(streamed):
    got, want = streamed["equal"], streamed["reference"]
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want, strict=True):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=2e-5), (a["step"], key)
    assert max(r["rollout/staleness"] for r in got) == 1  # the stream ran a step ahead
    assert any(r["rollout/partial_frac"] > 0 for r in got)  # and rows went on under new weights


def test_a_generator_on_one_process_overlaps_a_trainer_on_the_other(streamed):
    records = streamed["overlapped"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 <= r["rollout/staleness"] <= 1 for r in records)
    for r in records:
        assert sum(r[f"rollout/staleness_frac/{k}"] for k in range(2)) == pytest.approx(1.0)
        assert 0.0 <= r["reward/hidden_frac"] <= 1.0  # scored by the workers as samples ended
        # 4 informative groups kept, or every informative one when the feed's 8 prompts ran out first
        assert r["dynamic_sampling/kept_groups"] == min(4, r["dynamic_sampling/informative_groups"])
        assert 4 <= r["dynamic_sampling/pool_groups"] <= 8
        assert r["time/kv_recompute_s"] >= 0
    assert sum(r["time/generate_overlap_s"] for r in records) > 0  # decoded while process 1 trained
