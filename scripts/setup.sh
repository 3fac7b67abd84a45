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

# System tools the tests need, installed with apt-get when missing (cheap when present): systemd-analyze
# (tests/test_systemd_unit.py verifies and scores the unit) and Debian's chromium (tests/test_admin_browser.py drives
# it with Playwright; the pip package's own browser download is never used). Installed when we are root or have
# passwordless sudo; else we say why not.
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
    if ! $sudo apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1; then
        $sudo apt-get update -qq >/dev/null 2>&1 || true
        if ! $sudo apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1; then
            echo "setup: apt-get could not install $package (offline?): $needed_by fails" >&2
        fi
    fi
}
if ! command -v systemd-analyze >/dev/null 2>&1; then
    apt_install systemd tests/test_systemd_unit.py
fi
if [ ! -x /usr/bin/chromium ]; then
    apt_install chromium tests/test_admin_browser.py
fi
