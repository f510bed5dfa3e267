#!/usr/bin/env bash
# A multi-host run on a SLURM GPU cluster: one process per node, JAX finds the others from SLURM.
#
#   scripts/launch_slurm.sh [--dry-run] --nodes N [--gpus-per-node G] [--partition P] [--time HH:MM:SS] \
#       -- TRAIN_ARGS...
#
# Runs `srun` (inside an allocation, or it asks for one). See docs/multihost.md.
set -euo pipefail
# shellcheck source=scripts/launch_lib.sh
source "$(dirname "$0")/launch_lib.sh"

nodes="" gpus=8 partition="" time_limit="01:00:00"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --nodes) nodes=$2; shift ;;
    --gpus-per-node) gpus=$2; shift ;;
    --partition) partition=$2; shift ;;
    --time) time_limit=$2; shift ;;
    --) shift; break ;;
    *) die "unknown option $1 (put training arguments after --)" ;;
  esac
  shift
done
[ -n "$nodes" ] || die "--nodes N is missing"

args=(srun "--nodes=$nodes" --ntasks-per-node=1 "--gpus-per-node=$gpus" "--time=$time_limit" --kill-on-bad-exit=1)
[ -n "$partition" ] && args+=("--partition=$partition")
run "${args[@]}" python -m jaxrlhf.train "$@" run.distributed=true run.platform=gpu
