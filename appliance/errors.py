"""The one error table (SPEC P4) shared by every surface: MAGN frames, the line protocol and HTTP.

Every error a client can see is an :class:`ApplianceError` whose ``code`` is a key of :data:`TABLE`.
Its wire shape is always ``{code, message, retryable, details}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ErrorKind:
    code: str
    http_status: int
    retryable: bool
    summary: str


_KINDS = [
    ErrorKind("BAD_MAGIC", 400, False, "the stream does not start with the MAGN magic"),
    ErrorKind("UNSUPPORTED_VERSION", 400, False, "the frame version is not one this daemon speaks"),
    ErrorKind("FRAME_TOO_LARGE", 413, False, "the frame's payload length is above max_frame_bytes"),
    ErrorKind("BAD_PAYLOAD", 400, False, "the payload is not base64 of a UTF-8 JSON object of a known schema"),
    ErrorKind("BAD_REQUEST", 400, False, "the request is malformed or has invalid arguments"),
    ErrorKind("UNKNOWN_COMMAND", 400, False, "the line protocol has no such command"),
    ErrorKind("NOT_FOUND", 404, False, "no such HTTP resource"),
    ErrorKind("METHOD_NOT_ALLOWED", 405, False, "the HTTP resource does not take this method"),
    ErrorKind("UNKNOWN_MODEL", 404, False, "no such model is configured or allowed"),
    ErrorKind("UNKNOWN_AGENT", 404, False, "no such agent is registered"),
    ErrorKind("AGENT_EXISTS", 409, False, "an agent with this id is already registered"),
    ErrorKind("VRAM_LEDGER_DENY", 503, True, "the VRAM ledger has no room for this model"),
    ErrorKind("TOO_MANY_CONNECTIONS", 429, True, "the daemon is at max_connections"),
    ErrorKind("TOO_MANY_TASKS", 429, True, "the connection is at max_tasks_per_connection"),
    ErrorKind("TOO_MANY_AGENTS", 429, True, "the daemon holds max_agents agents"),
    ErrorKind("HOST_KV_DENY", 507, True, "the host KV budget has no room for this agent's state"),
    ErrorKind("CONTEXT_OVERFLOW", 400, False, "the request does not fit in the model's context"),
    ErrorKind("TIMEOUT", 504, True, "the operation took too long"),
    ErrorKind("OOM", 507, True, "the device ran out of memory"),
    ErrorKind("MODEL_LOAD_FAILED", 500, False, "the model file could not be loaded"),
    ErrorKind("MODEL_BUSY", 409, True, "the model is in use and cannot be changed now"),
    ErrorKind("MODEL_MISSING", 503, False, "the model is configured but its file is missing"),
    ErrorKind("MODEL_EXISTS", 409, False, "a model with this name or alias is already configured"),
    ErrorKind("HUB_UNAVAILABLE", 502, True, "the model hub cannot be reached, or it failed"),
    ErrorKind("BENCHMARK_RUNNING", 409, True, "a benchmark is already running: one at a time"),
    ErrorKind("CANCELLED", 499, False, "the task was cancelled"),
    ErrorKind("SHUTTING_DOWN", 503, True, "the daemon is stopping"),
    ErrorKind("CONFIG_INVALID", 400, False, "the configuration file is invalid"),
    ErrorKind("UNAUTHORIZED", 401, False, "the request lacks the API token (http.api_token)"),
    ErrorKind("FORBIDDEN", 403, False, "the request is not allowed"),
    ErrorKind("INTERNAL", 500, False, "an unexpected internal error"),
]

TABLE: dict[str, ErrorKind] = {kind.code: kind for kind in _KINDS}


@dataclass(eq=False)
class ApplianceError(Exception):
    """An error with a code from :data:`TABLE`; raise it anywhere, every surface knows how to send it.

    Not a frozen dataclass: Python sets ``__traceback__`` (and ``__context__``) on an exception as it travels,
    for example through a ``@contextmanager`` generator, and a frozen one turns that into FrozenInstanceError."""

    code: str
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in TABLE:
            raise ValueError(f"unknown error code {self.code!r}")
        if not self.message:
            object.__setattr__(self, "message", TABLE[self.code].summary)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @property
    def retryable(self) -> bool:
        return TABLE[self.code].retryable

    @property
    def http_status(self) -> int:
        return TABLE[self.code].http_status

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable,
                "details": dict(self.details)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ApplianceError:
        code = data.get("code")
        if code not in TABLE:
            code = "INTERNAL"
        details = data.get("details")
        return cls(code, str(data.get("message") or ""), details if isinstance(details, dict) else {})


STARTUP_EXIT_CODES: dict[str, int] = {"busy": 3, "filesystem": 4, "device": 5}
"""The exit code of ``appliance run`` for each kind of :class:`StartupError` (2 is an invalid config)."""


class StartupError(Exception):
    """The appliance cannot start (a busy port, a socket path another instance serves): a problem for the
    operator, reported as one line by the CLI, never sent to a client as a P4 error.

    ``kind`` is the failure class, a key of :data:`STARTUP_EXIT_CODES`: ``busy`` (another instance, a port in
    use), ``filesystem`` (a path that cannot be used: missing, unwritable, too long, not a socket) or ``device``
    (the memory device cannot be opened)."""

    def __init__(self, message: str, *, path: str | None = None, kind: str = "busy") -> None:
        if kind not in STARTUP_EXIT_CODES:
            raise ValueError(f"unknown start-up failure kind {kind!r}")
        super().__init__(message)
        self.message = message
        self.path = path
        self.kind = kind

    @property
    def exit_code(self) -> int:
        return STARTUP_EXIT_CODES[self.kind]


def internal(exc: BaseException) -> ApplianceError:
    """Wrap an unexpected exception so that a client still gets the P4 shape: the generic INTERNAL summary, never
    the exception's text (it can name files, memory or secrets); the caller logs ``exc`` with its traceback.

    INTERNAL is not retryable: the same request would most likely fail the same way."""
    return ApplianceError("INTERNAL", TABLE["INTERNAL"].summary)
