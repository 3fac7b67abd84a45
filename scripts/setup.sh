#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a virtualenv in .venv with the appliance and its test tools.
# llama-cpp-python compiles from source (CPU build; about 3 minutes measured on a 2-core box); pip caches the wheel in
# ~/.cache/pip, so only the first set-up on a machine pays for it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.appliance-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    python -m pip install --quiet --upgrade pip wheel
    echo "setup: installing the appliance (llama-cpp-python builds from source the first time: be patient)" >&2
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        python -m pip install --progress-bar off -e '.[test]'
    touch "$stamp"
fi
