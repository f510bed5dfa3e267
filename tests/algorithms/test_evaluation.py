"""Held-out evaluation: the pass@k estimator by hand, `python -m jaxrlhf.eval` on a checkpoint the
SFT stage trained on the bundled task, and `run.eval_every` logging to metrics and TensorBoard."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.algorithms.evaluation import pass_at_k
from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pass_at_k_by_hand():
    # n = 5 samples, c = 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9; pass@4: any 4 of 5 hold a correct one -> 1
    assert [pass_at_k(5, 2, k) for k in (1, 2, 3, 4, 5)] == pytest.approx([0.4, 0.7, 0.9, 1.0, 1.0])
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    # against the binomial form on a grid, including n where C(n, k) is huge
    for n in (1, 7, 20, 200):
        for c in range(0, n + 1, max(1, n // 7)):
            for k in sorted({k for k in (1, 2, n // 2, n) if 1 <= k <= n}):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """The tiny actor after 150 SFT steps on the bundled arithmetic demonstrations, exported as HF."""
    out = tmp_path_factory.mktemp("sft") / "run"
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "sft.yaml"), [
        f"run.output_dir={out}", "run.steps=150", "run.checkpoint_every=0", "run.eval_every=0",
        "run.tensorboard=false"])
    train.run(cfg)
    return str(out)


@pytest.mark.slow
def test_eval_cli_reports_pass_at_k_on_the_held_out_split(sft_checkpoint, tmp_path):
    result = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "jaxrlhf.eval", "--config", "configs/quickstart-grpo.yaml", "--checkpoint",
           sft_checkpoint, "--output", str(result), "eval.samples=8", "eval.pass_k=[1,4,8]", "eval.max_prompts=64",
           "generation.temperature=1.0", compile_cache.override()]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(result.read_text()) == metrics
    assert metrics["eval/prompts"] == 64 and metrics["eval/samples_per_prompt"] == 8
    p1, p4, p8 = metrics["eval/pass_at_1"], metrics["eval/pass_at_4"], metrics["eval/pass_at_8"]
    # the SFT actor solves some held-out sums, not all; more samples find more (measured: greedy 0.06,
    # pass@1 0.064, pass@4 0.22, pass@8 0.38 on 64 prompts)
    assert 0.0 < p1 < p4 < p8 <= 1.0, metrics
    assert 0.0 < metrics["eval/greedy/accuracy"] < 1.0, metrics
    # exact_match is the judge here, so greedy accuracy is its mean
    assert metrics["eval/greedy/accuracy"] == pytest.approx(metrics["eval/greedy/exact_match"])
    # the file is never overwritten; a missing checkpoint is one line
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr
    missing = subprocess.run([*cmd[:6], str(tmp_path / "nothing")], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "no HF checkpoint" in missing.stderr


@pytest.mark.slow
def test_eval_every_logs_pass_at_k_to_metrics_and_tensorboard(tmp_path):
    out = tmp_path / "grpo"
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "quickstart-grpo.yaml"), [
        f"run.output_dir={out}", "run.steps=2", "run.eval_every=2", "run.checkpoint_every=0", "run.export_hf=false",
        "sft.steps=0", "data.batch_size=8", "algorithm.group_size=2", "eval.samples=4", "eval.pass_k=[1,2,4]",
        "eval.max_prompts=12"])
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert "eval/pass_at_1" not in records[0]
    last = records[-1]
    assert last["eval/prompts"] == 12.0
    values = [last[f"eval/pass_at_{k}"] for k in (1, 2, 4)]
    assert all(0.0 <= v <= 1.0 for v in values) and values == sorted(values)
    scalars = _tensorboard_scalars(out / "tensorboard")
    assert {"eval/pass_at_4", "eval/greedy/accuracy"} <= set(scalars)
    assert scalars["eval/pass_at_4"] == [(2, pytest.approx(last["eval/pass_at_4"]))]


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar in the event files (TFRecord framing: length, crc, event, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


@pytest.mark.parametrize("overrides, message", [
    (["eval.samples=4", "eval.pass_k=[1,8]"], "every k must be in [1, eval.samples=4]"),
    (["eval.samples=3"], "eval.samples=3 must divide the rollout batch"),
    (["eval.correct_rule=format"], "eval.correct_rule='format' is none of rewards.rules"),
])
def test_eval_config_errors(overrides, message):
    with pytest.raises(cfglib.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cfglib.load_config(os.path.join(ROOT, "configs", "quickstart-grpo.yaml"), overrides)


@pytest.mark.slow
def test_eval_reads_a_runs_training_checkpoints_as_its_export(tmp_path):
    """`--checkpoint RUN/checkpoints` (the newest step) and `RUN/checkpoints/N` evaluate the actor of
    that step: the last step's weights equal the exported HF actor's, and so does the evaluation."""
    import dataclasses

    import jax
    import numpy as np

    from jaxrlhf import eval as eval_cli
    from jaxrlhf.checkpoint import CheckpointManager
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.run.assembly import setup

    out = tmp_path / "grpo"
    overrides = [f"run.output_dir={out}", "run.steps=2", "run.eval_every=0", "run.checkpoint_every=1",
                 "run.tensorboard=false", "sft.steps=0", "data.batch_size=8", "eval.max_prompts=8"]
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides)  # PPO: every step moves
    train.run(cfg)
    ckpts = out / "checkpoints"
    assert eval_cli.find_checkpoint(str(out)) == eval_cli.Checkpoint(hf=str(out / "actor_hf"))
    assert eval_cli.find_checkpoint(str(ckpts)) == eval_cli.Checkpoint(orbax=str(ckpts), step=2)
    assert eval_cli.find_checkpoint(str(ckpts / "1")) == eval_cli.Checkpoint(orbax=str(ckpts), step=1)
    with pytest.raises(cfglib.ConfigError, match="no training checkpoint"):
        eval_cli.find_checkpoint(str(tmp_path / "nothing"))
    assert eval_cli.evaluate(cfg, str(ckpts)) == eval_cli.evaluate(cfg, str(out))

    def actor_params(config):
        run_setup = setup(config, calls=("actor.generate",))
        run = run_setup.build(run_setup.choose_plan("colocated"), load_tokenizer(config.model.tokenizer))
        return run.roles["actor"].params

    template = actor_params(cfg)  # the preset's initial weights, on evaluation's placement
    exported = actor_params(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, actor=dataclasses.replace(cfg.model.actor, path=str(out / "actor_hf"), preset=None))))
    reader = CheckpointManager(str(ckpts), max_to_keep=None)
    last, first = reader.restore_params(2, "actor", template), reader.restore_params(1, "actor", template)
    reader.close()
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), last, exported)
    assert all(jax.tree_util.tree_leaves(same))
    moved = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), first, last)
    assert not all(jax.tree_util.tree_leaves(moved))  # step 1's actor is not step 2's
    trained = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), first, template)
    assert not all(jax.tree_util.tree_leaves(trained))  # nor the untrained one
