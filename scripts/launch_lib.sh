# shellcheck shell=bash
# Shared by the scripts/launch_*.sh launchers (sourced, not run).
# `run CMD...` runs a command, or with DRY_RUN=1 prints it as one shell-quoted line.

DRY_RUN=${DRY_RUN:-0}

run() {
  if [ "$DRY_RUN" = 1 ]; then
    local quoted
    printf -v quoted '%q ' "$@"
    echo "${quoted% }"
  else
    "$@"
  fi
}

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

