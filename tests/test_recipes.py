"""The shipped recipes run end to end with their model given as a local HF folder: a tiny generated
Qwen2-style checkpoint with a ChatML template stands in for the instruct model, and tiny GSM8K- and
HH-RLHF-shaped JSONL folders for the data sets. Only sizes, steps and the platform are overridden."""

from __future__ import annotations

import json
import math
import os

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import eval as eval_cli
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics
from jaxrlhf.testing.models import save_tiny_hf_checkpoint, save_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TINY = ["run.platform=cpu", "run.devices=8", "plan.hardware=cpu", "plan.strategy=colocated", "run.steps=2",
        "run.checkpoint_every=0", "run.tensorboard=false", "run.eval_every=2", "model.actor.remat=none",
        "algorithm.micro_batch_size=null", "data.batch_size=8", "data.max_prompt_len=192",
        "generation.max_new_tokens=8"]


@pytest.fixture(scope="module")
def instruct_model(tmp_path_factory):
    """A tiny random Qwen2 checkpoint with a tokenizer whose config ships a chat template."""
    folder = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen2")
    save_tiny_tokenizer(folder, "qwen2")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHATML
    config_file.write_text(json.dumps(config))
    return str(folder)


def _folder(path, rows: list[dict]) -> str:
    path.mkdir()
    for split in ("train", "test"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_gsm8k_dapo_recipe_then_eval(instruct_model, tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(4) for b in range(4)]
    out = tmp_path / "run"
    overrides = [*TINY, f"run.output_dir={out}", f"model.actor.path={instruct_model}",
                 f"model.tokenizer={instruct_model}", f"data.source={_folder(tmp_path / 'gsm8k', rows)}",
                 "algorithm.group_size=2", "algorithm.minibatches=2", "algorithm.overlong_buffer=2",
                 "eval.samples=2", "eval.pass_k=[1,2]", "eval.max_prompts=8"]
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "qwen2.5-0.5b-instruct-gsm8k-dapo.yaml"), overrides)
    assert cfg.data.prompt_format == "chat" and cfg.algorithm.name == "dapo"
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2] and records[-1]["data/skipped"] == 0.0
    assert "eval/pass_at_2" in records[-1] and "dynamic_sampling/pool_groups" in records[-1]
    # the exported actor evaluates through the CLI's path
    metrics = eval_cli.evaluate(cfg, str(out))
    assert metrics["eval/prompts"] == 8.0
    assert 0.0 <= metrics["eval/pass_at_1"] <= metrics["eval/pass_at_2"] <= 1.0


@pytest.mark.slow
def test_hh_rlhf_dpo_recipe(instruct_model, tmp_path):
    rows = [{"chosen": f"\n\nHuman: what is {a} + 1?\n\nAssistant: {a + 1}",
             "rejected": f"\n\nHuman: what is {a} + 1?\n\nAssistant: {a + 2}"} for a in range(16)]
    out = tmp_path / "dpo"
    overrides = [*TINY, f"run.output_dir={out}", f"model.actor.path={instruct_model}",
                 f"model.tokenizer={instruct_model}", f"data.source={_folder(tmp_path / 'hh', rows)}",
                 "data.max_seq_len=64"]
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "hh-rlhf-dpo.yaml"), overrides)
    assert cfg.data.prompt_key is None
    train.run(cfg)
    last = read_metrics(str(out / "metrics.jsonl"))[-1]
    assert math.isfinite(last["loss/dpo"]) and math.isfinite(last["eval/rewards_accuracy"])
    assert last["data/skipped"] == 0.0


@pytest.mark.slow
def test_qwen25_calculator_tools_recipe(tmp_path):
    """The tool-use recipe on a tiny Qwen2 checkpoint whose tokenizer ships a Qwen2.5 tool template: each GSM8K-shaped
    problem is an episode with the calculator described, turns end on <|im_end|>, the final answer is scored by
    numeric_match (env.args.reward) and GRPO trains on the model's tokens. A random tiny model writes no
    well-formed call (the calls are tested in tests/algorithms/test_environments.py); this checks the recipe's keys."""
    from tests.algorithms.test_environments import QWEN25

    folder = save_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen2")
    save_tiny_tokenizer(folder, "qwen2", corpus=["<tool_call> calculator expression ####"])
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": QWEN25,
                                       "eos_token": "<|im_end|>"}))
    rows = [{"question": f"What is {a} * {b}?", "answer": f"{a} * {b} = {a * b}\n#### {a * b}"}
            for a in range(4) for b in range(4)]
    out = tmp_path / "run"
    overrides = [*TINY, f"run.output_dir={out}", f"model.actor.path={folder}", f"model.tokenizer={folder}",
                 f"data.source={_folder(tmp_path / 'gsm8k', rows)}", "run.eval_every=0", "algorithm.group_size=2",
                 "algorithm.minibatches=2", "generation.max_new_tokens=32", "env.max_turns=2",
                 "env.max_turn_tokens=12", "env.args.system=Use the calculator."]
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "qwen2.5-1.5b-instruct-calculator-tools.yaml"), overrides)
    assert cfg.env.name == "tools" and cfg.env.args["tool_format"] == "qwen2.5" and cfg.generation.engine == "continuous"
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1 <= r["env/turns"] <= 2 and 0.0 <= r["env/reward"] <= 1.0 and math.isfinite(r["loss/policy"])
        assert r["env/finish/done"] + r["env/finish/max_turns"] + r["env/finish/max_tokens"] == pytest.approx(1.0)
