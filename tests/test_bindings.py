"""llama.cpp's C API loaded without llama-cpp-python's high-level API (``appliance.engine.bindings``): each check
runs in a fresh interpreter, since what matters is what a process imports and what llama.cpp writes to its stderr."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.engine.bindings import LOG_LEVELS, log_passes

CHILD_TIMEOUT_S = 120


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_c_api_loads_without_the_high_level_api_and_a_later_package_import_reuses_it() -> None:
    done = run_child(
        "import sys\n"
        "from appliance.engine.bindings import llama_cpp as bound\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'numpy', 'jinja2', 'diskcache')))\n"
        "import llama_cpp\n"
        "print(llama_cpp.llama_decode is bound.llama_decode, llama_cpp.Llama.__name__)\n")
    modules, same = done.stdout.splitlines()
    assert modules == "['llama_cpp._ctypes_extensions', 'llama_cpp.llama_cpp']"
    assert same == "True Llama"  # one binding of the native library, the whole package still importable


def test_an_imported_package_is_reused() -> None:
    done = run_child(
        "import llama_cpp\n"
        "from appliance.engine.bindings import llama_cpp as bound\n"
        "print(bound is llama_cpp.llama_cpp, bound.llama_decode is llama_cpp.llama_decode)\n")
    assert done.stdout.strip() == "True True"


def test_llama_cpp_logs_only_what_the_logger_lets_through(tiny_model: Path) -> None:
    """Loading a model makes llama.cpp log many info lines; the engine keeps only errors, as llama-cpp-python's
    own logger does (without the callback they would all reach stderr)."""
    done = run_child(
        "from pathlib import Path\n"
        "from appliance.engine.batched import ModelWeights\n"
        f"with ModelWeights(Path({str(tiny_model)!r})) as weights:\n"
        "    print('loaded')\n")
    assert done.stdout.strip() == "loaded"
    assert "llama_model_loader" not in done.stderr
    assert "print_info" not in done.stderr


@pytest.mark.parametrize(("level", "logger_level", "passes"), [
    (1, logging.ERROR, False),  # info
    (2, logging.ERROR, False),  # warn
    (3, logging.ERROR, True),  # error
    (1, logging.NOTSET, True),  # a logger nobody set lets everything through
    (4, logging.INFO, False),  # debug
    (5, logging.DEBUG, True),  # cont: a continued line counts as debug
    (9, logging.DEBUG, True),  # a level ggml adds later counts as debug
    (9, logging.INFO, False),
])
def test_log_passes(level: int, logger_level: int, passes: bool) -> None:
    assert log_passes(level, logger_level) is passes


def test_every_ggml_level_has_a_logging_level() -> None:
    assert sorted(LOG_LEVELS) == [0, 1, 2, 3, 4, 5]
