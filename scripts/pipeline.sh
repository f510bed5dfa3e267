#!/usr/bin/env bash
# The InstructGPT pipeline on the bundled data: SFT -> reward model -> PPO against the reward model.
# Each stage is `python -m jaxrlhf.train` on the same executor and plans, and consumes the HF
# checkpoint the previous stage exported:
#   1. SFT  (configs/sft.yaml):  tiny actor on arithmetic demonstrations        -> OUT/sft/actor_hf
#   2. RM   (configs/rm.yaml):   SFT trunk + score head on preference pairs       -> OUT/rm/reward_hf
#   3. PPO  (configs/quickstart.yaml): the SFT actor, scored by the reward model only
#      (the exact-match rule is kept with weight 0: measured, never rewarded).
# Usage: bash scripts/pipeline.sh [OUT] [extra key=value overrides for every stage ...]
set -euo pipefail
OUT=${1:-runs/pipeline}
shift || true
PY=${PYTHON:-python}

$PY -m jaxrlhf.train --config configs/sft.yaml "run.output_dir=$OUT/sft" "$@"
$PY -m jaxrlhf.train --config configs/rm.yaml "run.output_dir=$OUT/rm" "model.reward.path=$OUT/sft/actor_hf" "$@"
$PY -m jaxrlhf.train --config configs/quickstart.yaml "run.output_dir=$OUT/ppo" \
  "model.actor.path=$OUT/sft/actor_hf" sft.steps=0 \
  rewards.model=true "model.reward.path=$OUT/rm/reward_hf" \
  "rewards.rules=[{name: exact_match, weight: 0.0}]" algorithm.kl_coef=0.3 run.steps=100 run.eval_every=50 "$@"
