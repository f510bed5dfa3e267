#!/usr/bin/env bash
# The measurements only a GPU can give, in one short run of at most 9 minutes (BUDGET=540 s: a lent GPU
# machine is held by the minute):
#   0. jaxrlhf against its peers on the same GPU, same work, bf16, 1.24B (`llama3.2-1b`): PPO with TRL
#      (scripts/bench_ppo.py --device cuda), GRPO with TRL (bench_grpo_trl.py) and, when tunix imports,
#      with tunix (bench_grpo_tunix.py); their JSON has the ratio, per-call seconds and generate shares;
#   1. a GPU profile for the planner (python -m jaxrlhf.profile), kept in profiles/;
#   2. static vs continuous engine on long-tailed response lengths (bench_generate.py --workload rl);
#   3. per-call estimates vs measured times and train MFU (scripts/validate_estimator.py, 1 device);
#   4. decode tokens/s against the HBM roofline (scripts/bench_generate.py --workload decode);
#   5. where a whole PPO and GRPO step goes (python -m jaxrlhf.train with a profiled last step, then
#      scripts/step_breakdown.py, each call's MFU against the estimator step's measured matmul rate, and
#      scripts/trace_summary.py; the trace comes back as NAME-trace.json.gz);
#   rl and decode run at 100M parameters and again at 1.2B (-1b); ppo-1b and grpo-1b at 1.2B, on the
#   peer benchmarks' workloads (EOS ignored: a random 1.2B model almost never samples it anyway), so
#   their programs come from the compile cache the benchmarks filled.
#
#   OUT=results/gpu bash scripts/gpu_checks.sh             # on the GPU host, from the repository root
#   SMOKE=1 OUT=/tmp/gpu-smoke bash scripts/gpu_checks.sh  # the same commands at toy sizes on CPU
#   STEPS='estimator decode' OUT=... bash scripts/gpu_checks.sh  # only these steps
#
# It needs jaxrlhf's dependencies importable with the GPU's jax (`pip install -e .` on a machine with
# a package index). An offline image with jax, flax, optax, orbax, torch and transformers lacks the
# wheels scripts/gpu_wheels.txt lists: with WHEELS=DIR (default .whl/ when it exists) they are installed
# from DIR first, each group of that file into its own folder under $SITE.
# Each step has its own time limit, cut to what is left of BUDGET, and writes its JSON/YAML under $OUT
# (the output also goes to $OUT/log.txt), so a step that fails or runs out of time costs only itself;
# the most wanted run first, and a step with under 20 s of the budget left is skipped.
set -uo pipefail
OUT=${OUT:?set OUT to the folder for results}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
PY=${PY:-python3}
SITE=${SITE:-/tmp/gpu-checks-site}
WHEELS=${WHEELS:-$([[ -d .whl ]] && echo .whl)}

install_wheels() {  # install_wheels DIR: each [group] of scripts/gpu_wheels.txt from DIR into $SITE/group
  local dir=$1 group=jaxrlhf line name file
  declare -A files=()
  shopt -s nocaseglob nullglob
  while read -r line; do
    line=${line%%#*}; line=${line//[[:space:]]/}
    [[ -n $line ]] || continue
    if [[ $line == \[*\] ]]; then group=${line:1:-1}; continue; fi
    name=${line%%==*}; name=${name//[-.]/_}  # a wheel's file name spells - and . as _
    file=("$dir/$name-${line#*==}-"*.whl)
    if ((${#file[@]} == 0)); then echo "gpu_checks: no wheel of $line in $dir" >&2; continue; fi
    files[$group]+="${files[$group]:+ }${file[0]}"
  done <scripts/gpu_wheels.txt
  shopt -u nocaseglob nullglob
  for group in "${!files[@]}"; do
    # shellcheck disable=SC2086  # the group's wheel paths, one word each
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE/$group" \
      ${files[$group]} || echo "gpu_checks: the [$group] wheels did not install" >&2
  done
}
if [[ -n $WHEELS ]]; then
  install_wheels "$WHEELS"
  export PYTHONPATH="$SITE/jaxrlhf:$PYTHONPATH"
fi
site() { echo "PYTHONPATH=$SITE/$1:$PYTHONPATH"; }  # `env "$(site GROUP)" CMD`: that group's wheels too

if [[ -n "${SMOKE:-}" ]]; then  # toy sizes: checks the commands, not the hardware
  export JAX_PLATFORMS=cpu
  GEN=(--preset tiny --batches "1,4" --new-tokens 8 --prompt-len 8)
  RL=(--preset tiny --groups 2 --group-size 4 --prompt-len 16 --new-tokens 32 --median-len 8)
  EST=(--hidden 64 --layers 2 --heads 4 --vocab 384 --batch 8 --prompt-len 16 --gen-len 4)
  PROF=(run.platform=cpu run.devices=1 model.actor.preset=tiny generation.max_new_tokens=8 data.batch_size=4)
  BIG=(--preset small)
  RUN=(run.platform=cpu run.devices=1 model.actor.preset=tiny generation.max_new_tokens=8)
  PEER=(--device cpu --steps 1 --warmup 1)
  PPO=(run.devices=1 model.actor.preset=tiny generation.max_new_tokens=8 data.batch_size=8)
  GRPO=(run.devices=1 model.actor.preset=tiny generation.max_new_tokens=8 data.batch_size=4 algorithm.group_size=4)
  T=5  # CPU is slower: more time per step
else
  export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  GEN=(--preset llama-100m --batches "1,16,64" --new-tokens 128 --prompt-len 128)
  RL=(--preset llama-100m --groups 8 --group-size 8 --prompt-len 256 --new-tokens 512 --median-len 64)
  EST=(--hidden 2048 --layers 8 --heads 16 --vocab 32000 --batch 32 --prompt-len 512 --gen-len 64)
  PROF=(run.platform=gpu run.devices=null plan.hardware=h200 model.actor.preset=llama3.2-1b data.max_prompt_len=128
        generation.max_new_tokens=256 data.batch_size=16)
  BIG=(--preset llama3.2-1b)  # a size where weights, not launches, bound a decode step
  RUN=(run.platform=gpu run.devices=null model.actor.preset=llama3.2-1b generation.max_new_tokens=256)
  PEER=(--device cuda --steps 2 --warmup 1)
  PPO=(model.actor.preset=llama3.2-1b generation.max_new_tokens=256 data.batch_size=64)
  GRPO=(model.actor.preset=llama3.2-1b generation.max_new_tokens=256 data.batch_size=16)
  T=1
fi
BUDGET=${BUDGET:-$((540 * T))}  # seconds for the whole run, start-up and wheels included
"$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

# a subset reruns only those
STEPS=${STEPS:-ppo-trl grpo-trl grpo-tunix profile rl rl-1b estimator decode decode-1b ppo-1b grpo-1b}
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output to the screen and $OUT/log.txt
  local name=$1 limit=$2 left=$((BUDGET - SECONDS - 5)); shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  if ((left < 20)); then echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"; return 0; fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  # -k: a run told to stop (SIGTERM) may finish its step first; it gets 10 s, then is killed
  timeout -k 10 "$limit" "$@" 2>&1 | grep -v "donated buffers\|warnings.warn\|buffer-donation" | tee -a "$OUT/log.txt"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

# Same work on both sides: every response max_new_tokens long (EOS ignored), as the peer benchmarks run it.
# On a bare H200 (2026-11-29) TRL's side took 66 s (PPO) and 57 s (GRPO), and jaxrlhf's first step (compiling
# a 1.2B actor, critic and reference from nothing) did not end in the 74 and 63 s the old limits left: the peer
# steps alone fill most of one lease, so run them by themselves (STEPS='ppo-trl grpo-trl') and the rest in another.
SAME=(generation.ignore_eos=true rewards.eos_only=false)
step ppo-trl $((240 * T)) env "$(site trl-ppo)" "$PY" scripts/bench_ppo.py "${PEER[@]}" --strategies colocated \
  --out "$OUT/ppo-trl.json" "${PPO[@]}" "${SAME[@]}"
step grpo-trl $((200 * T)) env "$(site trl-grpo)" "$PY" scripts/bench_grpo_trl.py "${PEER[@]}" \
  --out "$OUT/grpo-trl.json" "${GRPO[@]}"
if env "$(site tunix)" "$PY" -c "import tunix.rl.grpo.grpo_learner" >/dev/null 2>&1; then
  step grpo-tunix $((120 * T)) env "$(site tunix)" "$PY" scripts/bench_grpo_tunix.py "${PEER[@]}" \
    --devices 1 --out "$OUT/grpo-tunix.json" "${GRPO[@]}" "${SAME[@]}"
else
  echo "=== grpo-tunix: skipped, tunix does not import (its wheels: scripts/gpu_wheels.txt [tunix])"
fi
# The limits below add up, with the peers' and the start-up, to the budget; each step's "exit after N s"
# line says how to re-size them.
step profile $((30 * T)) "$PY" -m jaxrlhf.profile --config configs/quickstart-grpo.yaml --repeats 3 \
  --sizes 1 --out "$OUT/profile.yaml" "${PROF[@]}"
step rl $((20 * T)) "$PY" scripts/bench_generate.py --workload rl --dtype bfloat16 --repeats 2 \
  "${RL[@]}" --out "$OUT/rl.json"
step rl-1b $((25 * T)) "$PY" scripts/bench_generate.py --workload rl --dtype bfloat16 --repeats 2 \
  "${RL[@]}" "${BIG[@]}" --out "$OUT/rl-1b.json"
step estimator $((25 * T)) "$PY" scripts/validate_estimator.py --devices 1 --dtype bfloat16 --repeats 3 \
  "${EST[@]}" --profile "$OUT/estimator-hardware.yaml" --json "$OUT/estimator.json"
rl_step() {  # rl_step NAME CONFIG OVERRIDES...: 7 training steps, the last one profiled; its breakdown
  local name=$1 config=$2 dir=${RUNS:-/tmp/gpu-checks}/$1; shift 2
  "$PY" -m jaxrlhf.train --config "$config" "${RUN[@]}" "$@" sft.steps=0 run.steps=7 "run.profile_steps=[7]" \
    run.save_checkpoints=false run.export_hf=false run.tensorboard=false run.overwrite=true "run.output_dir=$dir" || return
  head -n 6 "$dir/metrics.jsonl" >"$dir/unprofiled.jsonl"  # steps 1-6: the profiler's own cost left out
  local profile=()  # MFU against the matmul rate the estimator step measured, when it ran first
  [[ -f "$OUT/estimator-hardware.yaml" ]] && profile=(--profile "$OUT/estimator-hardware.yaml")
  "$PY" scripts/step_breakdown.py "$dir/unprofiled.jsonl" --skip 2 --out "$OUT/$name-breakdown.json" \
    --config "$config" --set "${RUN[@]}" "$@" sft.steps=0 "${profile[@]}"
  "$PY" scripts/trace_summary.py "$dir/profile/step_7" --top 30 --out "$OUT/$name-ops.json"
  "$PY" scripts/trace_summary.py "$dir/profile/step_7" --top 30 --call actor.train --out "$OUT/$name-train-ops.json"
  find "$dir/profile/step_7" -name perfetto_trace.json.gz -exec cp {} "$OUT/$name-trace.json.gz" \;
}
export -f rl_step
export PY OUT
export RUN_ARGS="${RUN[*]}"

step decode $((15 * T)) "$PY" scripts/bench_generate.py --workload decode --dtype bfloat16 --skip-hf \
  --repeats 3 "${GEN[@]}" --out "$OUT/decode.json"
step decode-1b $((20 * T)) "$PY" scripts/bench_generate.py --workload decode --dtype bfloat16 --skip-hf \
  --repeats 3 "${GEN[@]}" "${BIG[@]}" --out "$OUT/decode-1b.json"
# shellcheck disable=SC2016  # the inner bash expands them
step ppo-1b $((35 * T)) bash -c 'RUN=($RUN_ARGS); rl_step "$@"' _ ppo-1b configs/quickstart.yaml \
  plan.strategy=colocated data.batch_size=64 "${SAME[@]}"
# shellcheck disable=SC2016
step grpo-1b $((30 * T)) bash -c 'RUN=($RUN_ARGS); rl_step "$@"' _ grpo-1b configs/quickstart-grpo.yaml \
  data.batch_size=16 "${SAME[@]}"
