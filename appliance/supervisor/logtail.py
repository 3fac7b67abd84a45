"""The last log lines in memory, for the admin page's live log tail: :class:`LogTail`, a ``logging.Handler`` on the
``appliance`` logger that keeps the newest :data:`TAIL_LINES` records as :class:`LogLine` s, each numbered, so that a
reader asks only for what is newer than the last line it saw.

Secrets never reach it: the handler carries :data:`appliance.config.secrets.FILTER`, which redacts the configured
secrets (the API token) from each record before it is kept, as on every other handler. The appliance attaches it
at start and detaches it at stop (:meth:`LogTail.attach`, :meth:`LogTail.detach`).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

from appliance.config.secrets import FILTER

TAIL_LINES = 200
"""Log lines kept (the oldest is dropped first)."""
MAX_LINE_CHARS = 2000
"""A longer message (a traceback included) is cut to this many characters, marked with an ellipsis."""
LOGGER = "appliance"
"""The logger whose records (its children's included) the tail keeps."""


@dataclass(frozen=True)
class LogLine:
    """One kept record: ``seq`` counts from 1 in the order records arrived; ``at`` is its epoch time."""

    seq: int
    at: float
    level: str
    logger: str
    message: str


class LogTail(logging.Handler):
    """A ring buffer of the newest log records (see the module docstring). Thread-safe: records arrive from any
    thread (the engine thread, ``asyncio.to_thread`` workers), readers are on the event loop."""

    def __init__(self, capacity: int = TAIL_LINES) -> None:
        super().__init__(logging.NOTSET)
        self.addFilter(FILTER)
        self._lines: collections.deque[LogLine] = collections.deque(maxlen=capacity)
        self._seq = 0
        self._guard = threading.Lock()
        self._logger: logging.Logger | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_text:  # set by the secrets filter, redacted
                message = f"{message}\n{record.exc_text}"
            elif record.exc_info:
                message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            if len(message) > MAX_LINE_CHARS:
                message = message[:MAX_LINE_CHARS - 1] + "\u2026"
            with self._guard:
                self._seq += 1
                self._lines.append(LogLine(self._seq, record.created, record.levelname, record.name, message))
        except Exception:
            self.handleError(record)

    @property
    def last_seq(self) -> int:
        """The number of the newest line (0 before any)."""
        with self._guard:
            return self._seq

    def lines(self, after: int = 0) -> list[LogLine]:
        """The kept lines newer than line ``after``, oldest first."""
        with self._guard:
            return [line for line in self._lines if line.seq > after]

    def attach(self, logger_name: str = LOGGER) -> None:
        """Start keeping ``logger_name``'s records (once)."""
        if self._logger is None:
            self._logger = logging.getLogger(logger_name)
            self._logger.addHandler(self)

    def detach(self) -> None:
        """Stop keeping records; the lines kept so far stay readable."""
        if self._logger is not None:
            self._logger.removeHandler(self)
            self._logger = None
