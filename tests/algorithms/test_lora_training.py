"""LoRA through the full `train.run` path: a LoRA GRPO run learns, a disaggregated plan sends only the
adapters to the generation copy after each step, and the run exports the merged model and the adapter."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.metrics import read_metrics
from jaxrlhf.models.config import LoraConfig, preset
from jaxrlhf.models.hf_io import save_hf_checkpoint
from jaxrlhf.models.transformer import build_model
from jaxrlhf.planner.sizes import lora_param_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = "model.actor.lora={rank: 16, alpha: 32, targets: [" + ", ".join(ALL) + "]}"
DIGIT = 'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[0-9]"}}]'


def pretrained_like_base(folder) -> str:
    """The tiny preset with its LM head scaled to a trained model's logit range (std 0.2, not the init's
    0.02), written as an HF checkpoint. Adapters can only steer the hidden state; through a freshly
    initialised head even a perfect hidden state moves a logit by about 1, so a random base is no
    fair test of whether LoRA learns."""
    cfg = preset("tiny")
    model = build_model(cfg, seed=0)
    model.lm_head.value = model.lm_head.value * 10
    save_hf_checkpoint(model, cfg, folder)
    return str(folder)


STEPS = 20


@pytest.mark.slow
def test_lora_grpo_raises_a_discoverable_reward(tmp_path):
    """configs/grpo_lora.yaml on the digit reward of the learning tests (no warm-up): the adapters alone
    find and reinforce digit tokens, with the KL measured against the actor's base."""
    out = tmp_path / "run"
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "grpo_lora.yaml"), [
        f"run.output_dir={out}", f"run.steps={STEPS}", "run.checkpoint_every=0", "run.save_checkpoints=false",
        "run.tensorboard=false",
        "run.export_hf=false", "model.actor.preset=null", f"model.actor.path={pretrained_like_base(tmp_path / 'b')}",
        "rewards.eos_only=false", DIGIT,
    ])
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    rewards = np.array([r["reward/mean"] for r in records])
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    assert last > first + 0.3, rewards
    assert records[-1]["kl/mean"] > 0.0  # the reference (the base without adapters) stayed behind


@pytest.mark.slow
def test_disaggregated_lora_syncs_only_adapters_and_exports_both_forms(tmp_path):
    out = tmp_path / "run"
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "grpo_lora.yaml"), [
        f"run.output_dir={out}", "run.steps=3", "run.checkpoint_every=0", "run.save_checkpoints=false",
        "run.tensorboard=false",
        "plan.strategy=disaggregated", "algorithm.kl_coef=0.0", "data.batch_size=4", "algorithm.group_size=2",
        "algorithm.minibatches=1", "algorithm.epochs=1",
    ])
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    adapter_bytes = 4 * lora_param_count(preset("tiny").replace(lora=LoraConfig(16, 32.0, tuple(ALL))))
    model_bytes = 4 * preset("tiny").num_params() + adapter_bytes
    # step 1 makes the generation copy (the whole model) and syncs it; later steps send the adapters only
    assert records[0]["realloc/bytes"] == model_bytes + adapter_bytes
    assert [r["realloc/bytes"] for r in records[1:]] == [adapter_bytes] * 2
    assert os.path.exists(out / "actor_hf" / "model.safetensors")
    adapter = json.loads((out / "actor_lora" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32 and sorted(adapter["target_modules"]) == sorted(ALL)
    assert os.path.exists(out / "actor_lora" / "adapter_model.safetensors")
