#!/usr/bin/env bash
# A multi-host run on a Cloud TPU pod slice: create it, copy this checkout, install, run on every
# worker (logs streamed here), delete it. JAX finds the workers itself on Cloud TPU.
#
#   scripts/launch_tpu_pod.sh [--dry-run] --name NAME --zone ZONE --type ACCELERATOR_TYPE \
#       [--version RUNTIME] [--project PROJECT] [--keep] -- TRAIN_ARGS...
#
# e.g. --type v5litepod-16 (4 hosts x 4 chips). --keep leaves the slice up. See docs/multihost.md.
set -euo pipefail
# shellcheck source=scripts/launch_lib.sh
source "$(dirname "$0")/launch_lib.sh"

name="" zone="" type="" version="v2-alpha-tpuv5-lite" project="" keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --name) name=$2; shift ;;
    --zone) zone=$2; shift ;;
    --type) type=$2; shift ;;
    --version) version=$2; shift ;;
    --project) project=$2; shift ;;
    --keep) keep=1 ;;
    --) shift; break ;;
    *) die "unknown option $1 (put training arguments after --)" ;;
  esac
  shift
done
[ -n "$name" ] || die "--name NAME is missing (the TPU VM to create)"
[ -n "$zone" ] || die "--zone ZONE is missing (one that offers the accelerator type)"
[ -n "$type" ] || die "--type ACCELERATOR_TYPE is missing (e.g. v5litepod-16)"

where=("--zone=$zone")
[ -n "$project" ] && where+=("--project=$project")
tpu=(gcloud compute tpus tpu-vm)
train=$(printf '%q ' python -m jaxrlhf.train "$@" run.distributed=true run.platform=tpu)

run "${tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$type" "--version=$version"
if [ "$keep" = 0 ] && [ "$DRY_RUN" = 0 ]; then
  trap 'run "${tpu[@]}" delete "$name" "${where[@]}" --quiet' EXIT
fi
run "${tpu[@]}" scp --recurse "$(pwd)" "$name:jaxrlhf" --worker=all "${where[@]}"
run "${tpu[@]}" ssh "$name" --worker=all "${where[@]}" \
  --command="cd ~/jaxrlhf && pip install -q -e . 'jax[tpu]'"
# --worker=all streams every worker's output here, each line prefixed by its worker.
run "${tpu[@]}" ssh "$name" --worker=all "${where[@]}" --command="cd ~/jaxrlhf && ${train% }"
if [ "$keep" = 0 ] && [ "$DRY_RUN" = 1 ]; then
  run "${tpu[@]}" delete "$name" "${where[@]}" --quiet
fi
