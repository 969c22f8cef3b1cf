#!/usr/bin/env bash
# The main job on this machine: start a local Ray head (dashboard and job server on loopback
# only), submit pipelines/full.py with `ray job submit`, stream its output, stop Ray again.
#   scripts/run_local.sh [key=value ...]     e.g. scripts/run_local.sh student.train.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
[ -f "$HOME/.ray/auth_token" ] && export RAY_AUTH_MODE=token
port=${HLLM_DASHBOARD_PORT:-8265}
ray start --head --num-cpus="${HLLM_RAY_CPUS:-4}" --dashboard-host=127.0.0.1 --dashboard-port="$port" \
  --include-dashboard=true --disable-usage-stats >/dev/null
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
ray job submit --address "http://127.0.0.1:$port" --working-dir . -- \
  python pipelines/full.py "output_dir=$PWD/runs/default" "$@"
