#!/usr/bin/env bash
# Set up what running needs (first time only: scripts/setup.sh run, no test tools) and run the appliance on the
# shipped appliance.yaml.
# The demo models are written under ./data/models if missing; then http://127.0.0.1:8080/v1/health and
# the socket ./data/appliance.sock answer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh run
if [ "${APPLIANCE_SETUP_DRY_RUN:-0}" = 1 ]; then  # the set-up's dry run: print what would run, run nothing
    echo "run: would run: .venv/bin/appliance run --config ${APPLIANCE_CONFIG:-appliance.yaml}$(printf ' %q' "$@")" >&2
    exit 0
fi
exec .venv/bin/appliance run --config "${APPLIANCE_CONFIG:-appliance.yaml}" "$@"
