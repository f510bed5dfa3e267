#!/usr/bin/env bash
# Start processes of a multi-process run from plain environment variables (any cluster, or one machine).
#
#   scripts/launch_env.sh [--dry-run] --coordinator HOST:PORT --num-processes N --process-id I -- TRAIN_ARGS...
#       one process of an N-process run (run it on every host with its own --process-id)
#   scripts/launch_env.sh [--dry-run] --local N [--devices D] -- TRAIN_ARGS...
#       N processes on this machine, CPU, D simulated devices each (tests, laptops); logs in OUT/process-I.log
#
# The variables set are JAXRLHF_COORDINATOR, JAXRLHF_NUM_PROCESSES, JAXRLHF_PROCESS_ID (the
# distributed.* config keys stand for them). See docs/multihost.md.
set -euo pipefail
# shellcheck source=scripts/launch_lib.sh
source "$(dirname "$0")/launch_lib.sh"

coordinator="" num="" pid="" local_n="" devices=4 port=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --coordinator) coordinator=$2; shift ;;
    --num-processes) num=$2; shift ;;
    --process-id) pid=$2; shift ;;
    --local) local_n=$2; shift ;;
    --devices) devices=$2; shift ;;
    --port) port=$2; shift ;;
    --) shift; break ;;
    *) die "unknown option $1 (put training arguments after --)" ;;
  esac
  shift
done

if [ -n "$local_n" ]; then
  port=${port:-47600}
  out=${OUT:-runs/local-$local_n}
  run mkdir -p "$out"
  pids=()
  for ((i = 0; i < local_n; i++)); do
    if [ "$DRY_RUN" = 1 ]; then
      echo "JAXRLHF_COORDINATOR=127.0.0.1:$port JAXRLHF_NUM_PROCESSES=$local_n JAXRLHF_PROCESS_ID=$i" \
        "$(run python -m jaxrlhf.train "$@" run.distributed=true run.platform=cpu "run.devices=$devices")" \
        "> $out/process-$i.log 2>&1 &"
      continue
    fi
    JAXRLHF_COORDINATOR=127.0.0.1:$port JAXRLHF_NUM_PROCESSES=$local_n JAXRLHF_PROCESS_ID=$i \
      python -m jaxrlhf.train "$@" run.distributed=true run.platform=cpu "run.devices=$devices" \
      >"$out/process-$i.log" 2>&1 &
    pids+=("$!")
  done
  [ "$DRY_RUN" = 1 ] && { echo wait; exit 0; }
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=$?; done
  tail -n 5 "$out/process-0.log"
  exit "$status"
fi

[ -n "$coordinator" ] || die "--coordinator HOST:PORT is missing (process 0's host and a free port)"
[ -n "$num" ] || die "--num-processes N is missing"
[ -n "$pid" ] || die "--process-id I is missing (0 on the coordinator's host)"
if [ "$DRY_RUN" = 1 ]; then
  echo "JAXRLHF_COORDINATOR=$coordinator JAXRLHF_NUM_PROCESSES=$num JAXRLHF_PROCESS_ID=$pid" \
    "$(run python -m jaxrlhf.train "$@" run.distributed=true)"
  exit 0
fi
export JAXRLHF_COORDINATOR=$coordinator JAXRLHF_NUM_PROCESSES=$num JAXRLHF_PROCESS_ID=$pid
exec python -m jaxrlhf.train "$@" run.distributed=true
