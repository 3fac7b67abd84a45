"""llama.cpp's C API as llama-cpp-python binds it (``llama_cpp.llama_cpp``: ctypes functions, structs, constants),
loaded without the package's ``__init__``, which also imports its high-level API (``Llama``, chat formats, the
disk cache) and with it jinja2 and diskcache: memory an idle serving process would hold and never use.

The two files are loaded under their own names (``llama_cpp._ctypes_extensions``, ``llama_cpp.llama_cpp``), so a
later ``import llama_cpp`` (a test, a trial process) finds them and binds the native library once. Like the
package's ``_logger``, loading puts a log callback in front of llama.cpp's default one: what llama.cpp logs
reaches stderr only at the levels the ``llama-cpp-python`` logger lets through."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "llama_cpp"
LOG_LEVELS = {0: logging.CRITICAL, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.DEBUG,
              5: logging.DEBUG}
"""ggml's log levels (``enum ggml_log_level``: none, info, warn, error, debug, cont) as logging's."""

chatter = logging.getLogger("llama-cpp-python")


def package_folder() -> Path:
    """Where llama-cpp-python is installed (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def load_submodule(folder: Path, name: str) -> ModuleType:
    """``llama_cpp.<name>`` as ``import`` would make it, its package left unimported (an imported one is reused)."""
    qualified = f"{PACKAGE}.{name}"
    loaded = sys.modules.get(qualified)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(qualified, folder / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {folder / name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified]
        raise
    return module


def log_passes(level: int, logger_level: int) -> bool:
    """Whether a line llama.cpp logs at ggml ``level`` reaches stderr (as llama-cpp-python's ``_logger`` decides:
    an unknown level counts as debug)."""
    return logger_level <= LOG_LEVELS.get(level, logging.DEBUG)


def _write_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if log_passes(level, chatter.level):
        sys.stderr.write(text.decode("utf-8", errors="replace"))
        sys.stderr.flush()


def _load() -> ModuleType:
    folder = package_folder()
    load_submodule(folder, "_ctypes_extensions")  # what ``llama_cpp.llama_cpp`` imports from its package
    module = load_submodule(folder, "llama_cpp")
    if f"{PACKAGE}._logger" not in sys.modules:  # an imported package put its own callback in already
        callback = module.llama_log_callback(_write_log)
        _kept.append(callback)  # C holds the pointer: it must outlive the process's use of llama.cpp
        module.llama_log_set(callback, ctypes.c_void_p(0))
    return module


_kept: list[object] = []
llama_cpp = _load()
"""The ``llama_cpp.llama_cpp`` module: every name ``import llama_cpp`` gives but the high-level API."""
