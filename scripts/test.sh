#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite, then ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest "$@"
