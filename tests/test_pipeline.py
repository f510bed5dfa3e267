"""The InstructGPT pipeline (scripts/pipeline.sh) runs end to end on the bundled data: SFT exports an
actor, the reward model starts from that export and is exported with its head, and PPO loads both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_sft_rm_ppo_pipeline_runs_end_to_end(tmp_path):
    out = tmp_path / "pipeline"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        # every stage in the test run's compilation cache (as the other CLI runs tests start), never ~/.cache
        ["bash", "scripts/pipeline.sh", str(out), "run.steps=3", "run.eval_every=3", "run.tensorboard=false",
         compile_cache.override()],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each stage wrote its export and the next stage read it.
    assert json.loads((out / "rm" / "reward_hf" / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"]
    sft, rm, ppo = (read_metrics(str(out / s / "metrics.jsonl")) for s in ("sft", "rm", "ppo"))
    assert [r["step"] for r in ppo] == [1, 2, 3]
    assert "eval/loss" in sft[-1] and 0.0 <= rm[-1]["eval/rm_accuracy"] <= 1.0
    assert "reward/model_mean" in ppo[-1] and "eval/greedy/exact_match" in ppo[-1]
    assert (out / "ppo" / "actor_hf" / "model.safetensors").exists()
