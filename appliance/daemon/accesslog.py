"""The access log: one line per request, whatever its surface, from the request log's records (an observer of
:class:`~appliance.daemon.requestlog.RequestLog`, so no surface can be left out).

The lines go to their own logger, :data:`LOGGER` (``appliance.access``), at INFO, so that they can be filtered
(``journalctl -u appliance | grep appliance.access:``) or kept out: a log level above INFO drops them with the rest.
A line is the line protocol's ``key=value`` fields, values escaped as there (a model name a client sent can add no
line)::

    surface=lines task=generate model=demo agent=a prompt_tokens=2 prompt_evaluated=2 generated_tokens=16
    ttft_ms=1.204 tokens_per_s=412.500 elapsed_ms=7.816 outcome=ok error=none stop=length

``tokens_per_s`` is the decode speed after the first token (the generated tokens but the first, over the
generation's time after its first token), ``none`` below two tokens; ``ttft_ms`` is from the generation's start on
the engine to its first token; ``elapsed_ms`` is the whole request as its surface saw it (waiting included).
A request the HTTP surface refuses before it runs has no record; it gets a line of its own (:func:`refusal_line`),
with its status and error code, never its token or its body::

    surface=http method=POST path=/v1/chat/completions status=401 outcome=refused error=UNAUTHORIZED client=10.0.0.7

(the guard's refusals: a bad or missing API token, a ``Host`` it does not answer to, a cross-origin or CSRF refusal;
no route, a method the route does not take, a body too large or malformed, a name that names no model; a
connection over ``max_connections`` or a request that is not HTTP/1.1, refused before its route, with ``method``
and ``path`` ``none`` when its head was not read). A socket request refused before it runs (a malformed line or
frame) has no line: its error reply is its trace. Pure but for the logging calls."""

from __future__ import annotations

import logging
from typing import Any

from appliance.daemon.requestlog import RequestRecord
from appliance.errors import ApplianceError
from appliance.protocol.lines import format_fields

LOGGER = "appliance.access"
MAX_PATH_CHARS = 256
"""A refused request's path is written cut to this many characters (the client chose it)."""
log = logging.getLogger(LOGGER)


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def tokens_per_second(record: RequestRecord) -> float | None:
    """The decode speed after the first token; None when fewer than two tokens came, or no time passed."""
    if record.generated_tokens < 2 or record.ttft_s is None or record.generation_s is None:
        return None
    decoding_s = record.generation_s - record.ttft_s
    if decoding_s <= 0:
        return None
    return (record.generated_tokens - 1) / decoding_s


def access_fields(record: RequestRecord) -> dict[str, Any]:
    """The access line's fields, in order."""
    return {"surface": record.surface, "task": record.task, "model": record.model, "agent": record.agent,
            "prompt_tokens": record.prompt_tokens, "prompt_evaluated": record.prompt_evaluated,
            "generated_tokens": record.generated_tokens, "ttft_ms": milliseconds(record.ttft_s),
            "tokens_per_s": tokens_per_second(record), "elapsed_ms": milliseconds(record.elapsed_s),
            "outcome": record.outcome, "error": record.error, "stop": record.stop_reason}


def access_line(record: RequestRecord) -> str:
    return format_fields(access_fields(record))


def log_request(record: RequestRecord) -> None:
    """The request log's observer: one INFO line on :data:`LOGGER` (never raises into the request's path)."""
    if not log.isEnabledFor(logging.INFO):
        return
    try:
        log.info("%s", access_line(record))
    except Exception:
        log.exception("access log: a request record could not be written")


def refusal_line(method: str | None, path: str | None, status: int, error: ApplianceError,
                 client: str | None) -> str:
    """The line of a refused HTTP request (``status``: the one sent, which may not be the error's own: an admin
    page's 401 is a redirect to the login form)."""
    return format_fields({"surface": "http", "method": method,
                          "path": None if path is None else path[:MAX_PATH_CHARS], "status": status,
                          "outcome": "refused", "error": error.code, "client": client})


def log_refusal(method: str | None, path: str | None, status: int, error: ApplianceError,
                client: str | None) -> None:
    """One INFO line on :data:`LOGGER` for an HTTP request refused before it ran (never raises into its reply)."""
    if not log.isEnabledFor(logging.INFO):
        return
    try:
        log.info("%s", refusal_line(method, path, status, error, client))
    except Exception:
        log.exception("access log: a refused request could not be written")
