"""Cross-origin browser clients of the API: ``http.cors_origins``, the web origins whose pages may call ``/v1/…``
and ``/health`` from a browser (CORS). Pure: the :class:`~appliance.http.security.Guard` asks it, per request.

* An allowed origin's requests to an API path get ``Access-Control-Allow-Origin`` (its own origin, or ``*`` when the
  list is ``*``), ``Access-Control-Expose-Headers`` and ``Vary: Origin``; its state-changing requests pass the
  cross-origin check that refuses every other origin. ``/admin/`` and ``/metrics`` are never opened to another
  origin.
* A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) from an allowed origin to an API
  path is answered 204 with the allowed methods, the requested headers (each one of :data:`ALLOWED_HEADERS`) and
  :data:`MAX_AGE_S`; any other preflight is a 403 ``FORBIDDEN`` that says why (the origin, the path, a method or a
  header). Browsers send no credentials on a preflight, so it needs no API token; the request that follows does.
* No ``Access-Control-Allow-Credentials``: a page sends the API token as a header (``Authorization`` or
  ``x-api-key``), never the admin page's session cookie, which does not count for a cross-origin request
  (:func:`appliance.http.security.refusal`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from appliance.config.schema import ANY_ORIGIN, parse_origin
from appliance.errors import ApplianceError

API_PREFIX = "/v1/"
API_PATHS = frozenset({"/health"})
"""What cross-origin pages may call: every path under :data:`API_PREFIX`, and these."""
ALLOWED_METHODS = ("GET", "POST", "DELETE")
ALLOWED_HEADERS = frozenset({
    "authorization", "content-type", "x-api-key", "x-agent-id",  # the token, JSON bodies, the agent header
    "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",  # Anthropic's clients
    "openai-organization", "openai-project", "openai-beta",  # OpenAI's clients
})
"""Request headers a cross-origin page may send (the browser asks for them in its preflight)."""
ALLOWED_HEADER_FAMILY = re.compile(r"x-stainless-[a-z0-9-]{1,64}", re.ASCII)
"""The header family the official OpenAI and Anthropic JavaScript clients send (``x-stainless-os`` …)."""
EXPOSED_HEADERS = ("retry-after", "x-appliance-instance", "x-appliance-agent")
"""Response headers a cross-origin page may read besides the CORS-safelisted ones."""
MAX_AGE_S = 600
"""How long a browser may cache a preflight's answer."""
MAX_REQUESTED_HEADERS = 64
"""A preflight naming more headers than this is refused (no client needs as many)."""


def is_api(path: str) -> bool:
    """``path`` is one that cross-origin pages may call (:data:`API_PREFIX`, :data:`API_PATHS`)."""
    return path.startswith(API_PREFIX) or path in API_PATHS


def canonical_origin(origin: str) -> str | None:
    """A request's ``Origin`` as ``http.cors_origins`` spells origins; None for one that is none (``null``)."""
    try:
        return parse_origin(origin)
    except ValueError:
        return None


def header_allowed(name: str) -> bool:
    return name in ALLOWED_HEADERS or ALLOWED_HEADER_FAMILY.fullmatch(name) is not None


@dataclass(frozen=True)
class CorsRule:
    """``http.cors_origins``: canonical origins, or ``("*",)`` for any."""

    origins: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str) -> bool:
        """A page of ``origin`` (an ``Origin`` header) may call the API."""
        if ANY_ORIGIN in self.origins:
            return True
        canonical = canonical_origin(origin)
        return canonical is not None and canonical in self.origins

    def response_headers(self, path: str, origin: str | None) -> list[tuple[str, str]]:
        """The CORS headers of a response to a request for ``path`` from ``origin`` (its ``Origin`` header):
        none unless the list is set and ``path`` is an API path; ``Vary: Origin`` on every such response (its
        headers depend on the origin), the others only for an allowed origin."""
        if not self.enabled or not is_api(path):
            return []
        headers = [("vary", "Origin")]
        if origin is not None and self.allows(origin):
            headers += [("access-control-allow-origin", ANY_ORIGIN if ANY_ORIGIN in self.origins else origin),
                        ("access-control-expose-headers", ", ".join(EXPOSED_HEADERS))]
        return headers

    def preflight(self, path: str, origin: str, method: str, requested: str) -> list[tuple[str, str]]:
        """The headers of a 204 answer to a preflight for ``path`` from ``origin`` asking for ``method`` and the
        ``requested`` headers (``Access-Control-Request-Headers``, comma-separated); FORBIDDEN (why, by name)
        when it is refused."""
        details: dict[str, object] = {"path": path, "origin": origin[:64]}
        if not is_api(path):
            raise ApplianceError("FORBIDDEN", "cross-origin requests are served on the API only (/v1/…, /health), "
                                              "never on the admin page or /metrics", details)
        if not self.allows(origin):
            reason = "none is allowed: http.cors_origins is empty" if not self.enabled else \
                "add it to http.cors_origins in the appliance's config"
            raise ApplianceError("FORBIDDEN", f"cross-origin requests from this origin are refused ({reason})",
                                 details)
        method = method.strip().upper()
        if method not in ALLOWED_METHODS:
            raise ApplianceError("FORBIDDEN", f"cross-origin {method[:16]} requests are refused (allowed: "
                                              f"{', '.join(ALLOWED_METHODS)})",
                                 {**details, "method": method[:16], "allowed_methods": list(ALLOWED_METHODS)})
        names = requested_headers(requested)
        refused = sorted(name for name in names if not header_allowed(name))
        if refused:
            raise ApplianceError("FORBIDDEN", f"cross-origin requests may not send the header {refused[0][:64]!r}",
                                 {**details, "headers": [name[:64] for name in refused[:8]],
                                  "allowed_headers": sorted(ALLOWED_HEADERS)})
        headers = [("vary", "Origin"),
                   ("access-control-allow-origin", ANY_ORIGIN if ANY_ORIGIN in self.origins else origin),
                   ("access-control-allow-methods", ", ".join(ALLOWED_METHODS)),
                   ("access-control-max-age", str(MAX_AGE_S))]
        if names:
            headers.append(("access-control-allow-headers", ", ".join(names)))
        return headers


def requested_headers(text: str) -> list[str]:
    """``Access-Control-Request-Headers`` as lower-cased names in order, each once; FORBIDDEN past
    :data:`MAX_REQUESTED_HEADERS`."""
    names: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if name and name not in names:
            names.append(name)
    if len(names) > MAX_REQUESTED_HEADERS:
        raise ApplianceError("FORBIDDEN", f"a preflight may ask for at most {MAX_REQUESTED_HEADERS} headers",
                             {"headers": len(names), "max_headers": MAX_REQUESTED_HEADERS})
    return names


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """A CORS preflight: ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``."""
    return method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers


def encoded(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Headers as an ASGI message carries them."""
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
