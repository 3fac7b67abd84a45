#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite, then ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
# The real tokenizers and chat templates of the real-vocab tests, from the pinned llama-cpp-python sdist (once per
# machine, cached under ~/.cache/appliance; offline, those tests skip and say why).
python tests/vendored.py >/dev/null || echo "test: the llama-cpp-python sdist could not be had: the real-vocab tests skip" >&2
ruff check .
python -m pytest "$@"
