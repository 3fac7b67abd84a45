#!/usr/bin/env bash
# Set up (first time only) and run the appliance on the shipped appliance.yaml.
# The demo models are written under ./data/models if missing; then http://127.0.0.1:8080/v1/health and
# the socket ./data/appliance.sock answer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/appliance run --config "${APPLIANCE_CONFIG:-appliance.yaml}" "$@"
