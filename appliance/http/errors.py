"""The one mapping from an :class:`~appliance.errors.ApplianceError` to an HTTP response (SPEC P4), for every
route and for the :class:`~appliance.http.security.Guard`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from appliance.errors import ApplianceError

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
"""OpenAI's ``error.type`` for an HTTP status (anything else, 5xx: ``server_error``)."""
RETRY_AFTER_S = 1
"""``Retry-After`` on a retryable 429 or 503 (a ledger denial, the connection cap, shutting down)."""
ANTHROPIC_PATHS = "/v1/messages"
"""Paths whose errors are in Anthropic's envelope (:func:`appliance.http.anthropic_schema.error_document`)."""


def error_body(error: ApplianceError) -> dict[str, Any]:
    """The P4 error (``code``, ``message``, ``retryable``, ``details``) with OpenAI's envelope fields beside it
    (``type``, ``param``; ``code`` and ``message`` are shared), so the official clients read it too."""
    body = error.to_dict()
    body["type"] = OPENAI_TYPES.get(error.http_status, "server_error")
    body["param"] = error.details.get("param")
    return {"error": body}


def error_response(error: ApplianceError, request: Request | None = None) -> JSONResponse:
    """The one mapping from an :class:`ApplianceError` to an HTTP response, for every route; with the ``request``
    it answers, the error is counted for the metrics (``appliance_errors_total{surface="http"}``)."""
    if request is not None:
        daemon = request.app.state.appliance.daemon
        if daemon is not None:
            daemon.errors["http", error.code] += 1
    headers = {}
    if error.retryable and error.http_status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    body = error_body(error)
    if request is not None and request.url.path.startswith(ANTHROPIC_PATHS):
        from appliance.http import anthropic_schema  # imported with the Anthropic routes, not before

        body = anthropic_schema.error_document(error)
    return JSONResponse(body, status_code=error.http_status, headers=headers)
