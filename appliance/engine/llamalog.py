"""What llama.cpp logs on one thread while it does one thing (it reports some of its choices nowhere else, e.g.
whether ``auto`` turned flash attention on: :mod:`appliance.engine.flash`)."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from appliance.engine.bindings import llama_cpp

_capture = threading.local()
_install_lock = threading.Lock()
_installed: list[object] = []  # the callback llama.cpp calls, and the one it replaced (kept alive: C holds them)


def _forward_to(previous: object) -> object:
    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        for lines in getattr(_capture, "open", ()):
            lines.append(text.decode("utf-8", errors="replace"))
        if previous:
            previous(level, text, user_data)  # type: ignore[operator]
        else:
            sys.stderr.write(text.decode("utf-8", errors="replace"))  # what llama.cpp does without a callback

    return record


def _install() -> None:
    """Put the recording callback in front of the current llama.cpp log callback, once per process (llama.cpp's
    log state is global and not thread-safe to change, so it is never changed again)."""
    with _install_lock:
        if _installed:
            return
        previous = llama_cpp.llama_log_callback()
        user_data = ctypes.c_void_p()
        llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(user_data))
        record = _forward_to(previous)
        _installed.extend([record, previous])
        llama_cpp.llama_log_set(record, user_data)


@contextmanager
def llama_log_lines() -> Iterator[list[str]]:
    """The lines llama.cpp logs on this thread meanwhile (they still reach the log as before)."""
    _install()
    lines: list[str] = []
    outer: tuple[list[str], ...] = getattr(_capture, "open", ())
    _capture.open = (*outer, lines)  # every capture open on this thread gets the line
    try:
        yield lines
    finally:
        _capture.open = outer
