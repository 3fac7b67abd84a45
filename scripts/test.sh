#!/usr/bin/env bash
# Set up the test tools (first time only: scripts/setup.sh test) and run ruff, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if [ "${APPLIANCE_SETUP_DRY_RUN:-0}" = 1 ]; then  # the set-up's dry run: print what would run, run nothing
    echo "test: would run: ruff check . && python -m pytest$(printf ' %q' "$@")" >&2
    exit 0
fi
. .venv/bin/activate
# The real tokenizers and chat templates of the real-vocab tests, from the pinned llama-cpp-python sdist (once per
# machine, cached under ~/.cache/appliance; offline, those tests skip and say why).
python tests/vendored.py >/dev/null || echo "test: the llama-cpp-python sdist could not be had: the real-vocab tests skip" >&2
ruff check .
python -m pytest "$@"
