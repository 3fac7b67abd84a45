#!/usr/bin/env bash
# Idempotent set-up for a fresh machine, at one of two levels:
#   scripts/setup.sh [run]  what running needs and nothing else: a virtualenv in .venv with the appliance and its
#                           dependencies (pip install -e .); no test tools, no system packages. scripts/run.sh and a
#                           service install use it.
#   scripts/setup.sh test   that, plus the test tools (pip install -e '.[test]': pytest, playwright, the openai and
#                           anthropic clients, ruff, ...) and the system tools the tests use (below). scripts/test.sh
#                           uses it.
# Each level leaves a stamp in .venv and is skipped while the stamp is newer than pyproject.toml.
# llama-cpp-python compiles from source (CPU build; about 3 minutes measured on a 2-core box); pip caches the wheel in
# ~/.cache/pip, so only the first set-up on a machine pays for it.
# APPLIANCE_SETUP_DRY_RUN=1 prints each command the set-up would run ("setup: would run: ...") and runs none.
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-run}
if [ "$level" != run ] && [ "$level" != test ]; then
    echo "usage: scripts/setup.sh [run|test] (got '$level')" >&2
    exit 2
fi
dry_run=${APPLIANCE_SETUP_DRY_RUN:-0}
exec 3>&2  # the dry run's plan goes here: stderr, even from a step whose own output is sent to /dev/null
step() {  # step <command> [args...]: run it, or only print it (on stderr) under APPLIANCE_SETUP_DRY_RUN=1
    if [ "$dry_run" = 1 ]; then
        echo "setup: would run:$(printf ' %q' "$@")" >&3
    else
        "$@"
    fi
}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    step "$PY" -m venv .venv
fi
if [ -x .venv/bin/python ]; then
    . .venv/bin/activate
fi
stamp=.venv/.appliance-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    step .venv/bin/python -m pip install --quiet --upgrade pip wheel
    echo "setup: installing the appliance (llama-cpp-python builds from source the first time: be patient)" >&2
    step env CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        .venv/bin/python -m pip install --progress-bar off -e .
    step touch "$stamp"
fi
# The package's bytecode, written now: Python does not write it under PYTHONDONTWRITEBYTECODE (or into a folder it
# cannot write), and then every start compiles each module in memory (measured: 1.7 MiB more resident before the
# model loads, 0.1-0.2 MiB after; benchmarks/README.md, idle_memory.py). Only what changed since is compiled again.
step .venv/bin/python -m compileall -q appliance
# --- GPU build (APPLIANCE_GPU=cuda) -------------------------------------------------------------------------------
# APPLIANCE_GPU=cuda rebuilds llama-cpp-python (the version pyproject.toml pins) from source with CUDA
# (CMAKE_ARGS=-DGGML_CUDA=on, plus the CMAKE_ARGS given, e.g. -DCMAKE_CUDA_ARCHITECTURES=native for a faster build),
# past pip's cache and over the build installed (a CPU wheel), unless the installed one already offloads to a GPU.
# It needs the CUDA toolkit (nvcc) and PyPI, or PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder with the sdist> offline. Then
# llama_supports_gpu_offload() must be true, or the set-up fails with one line saying so. Unset: nothing here runs.
gpu=${APPLIANCE_GPU:-}
if [ -n "$gpu" ]; then
    if [ "$gpu" != cuda ]; then
        echo "setup: APPLIANCE_GPU must be cuda or unset (got '$gpu')" >&2
        exit 2
    fi
    llama_version=$(sed -n 's/^[[:space:]]*"llama-cpp-python==\([^"]*\)",*[[:space:]]*$/\1/p' pyproject.toml)
    if [ -z "$llama_version" ]; then
        echo "setup: pyproject.toml pins no llama-cpp-python==VERSION: nothing to build with CUDA" >&2
        exit 1
    fi
    if [ -x .venv/bin/python ] && .venv/bin/python -m appliance.engine.gpubuild --quiet --version "$llama_version" \
            2>/dev/null; then
        echo "setup: llama-cpp-python $llama_version already offloads to a GPU: kept" >&2
    else
        echo "setup: building llama-cpp-python $llama_version with CUDA (several minutes)" >&2
        if ! step env CMAKE_ARGS="-DGGML_CUDA=on${CMAKE_ARGS:+ $CMAKE_ARGS}" FORCE_CMAKE=1 \
                CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
                .venv/bin/python -m pip install --progress-bar off --no-cache-dir --force-reinstall --no-deps \
                "llama-cpp-python==$llama_version"; then
            echo "setup: the CUDA build of llama-cpp-python $llama_version failed: pip's output above says why (it" \
                 "needs the CUDA toolkit, nvcc and cuBLAS, and a GPU to build for); the build installed before is" \
                 "kept" >&2
            exit 1
        fi
        step .venv/bin/python -m appliance.engine.gpubuild --version "$llama_version" >&2 || exit 1
    fi
fi
# --- end of the GPU build -----------------------------------------------------------------------------------------
if [ "$level" = test ]; then
    test_stamp=.venv/.appliance-test-installed
    if [ ! -f "$test_stamp" ] || [ pyproject.toml -nt "$test_stamp" ]; then
        echo "setup: installing the test tools (the appliance's [test] extras)" >&2
        step .venv/bin/python -m pip install --progress-bar off -e '.[test]'
        step touch "$test_stamp"
    fi
fi

# The test level only: system tools the tests need, installed with apt-get when missing (cheap when present):
# systemd-analyze (tests/test_systemd_unit.py verifies and scores the unit) and Debian's chromium
# (tests/test_admin_browser.py drives it with Playwright; the pip package's own browser download is never used), and
# Debian's prometheus for its promtool (tests/test_metrics_promtool.py lints /metrics; the server the package starts
# is stopped and disabled again).
# Installed when we are root or have passwordless sudo; else we say why not.
apt_install() {  # apt_install <package> <what needs it>
    local package=$1 needed_by=$2 sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            echo "setup: $package is missing and we are not root (no passwordless sudo): install Debian's" \
                 "$package package, or $needed_by fails" >&2
            return 0
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: $package is missing and there is no apt-get: install it with this system's" \
             "package manager, or $needed_by fails" >&2
        return 0
    fi
    echo "setup: installing $package with apt-get (for $needed_by)" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! step $sudo apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1; then
        step $sudo apt-get update -qq >/dev/null 2>&1 || true
        if ! step $sudo apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1; then
            echo "setup: apt-get could not install $package (offline?): $needed_by fails" >&2
        fi
    fi
}
if [ "$level" = test ]; then
    if ! command -v systemd-analyze >/dev/null 2>&1; then
        apt_install systemd tests/test_systemd_unit.py
    fi
    if [ ! -x /usr/bin/chromium ]; then
        apt_install chromium tests/test_admin_browser.py
    fi
    if ! command -v promtool >/dev/null 2>&1; then
        apt_install prometheus tests/test_metrics_promtool.py
        if command -v promtool >/dev/null 2>&1 && command -v systemctl >/dev/null 2>&1; then
            step systemctl disable --now prometheus >/dev/null 2>&1 || true  # only its promtool is needed here
        fi
    fi
fi
