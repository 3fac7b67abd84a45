"""Secret settings (``Setting.secret`` in :mod:`appliance.config.schema`, e.g. ``http.api_token``) are never shown:
not in a validation problem, a log line, the SIGUSR1 dump, STATUS, ``/v1/health`` or a page. This is the one place
that hides them:

* :func:`hidden_value` words a problem about a secret setting without its value (the value may be the intended
  secret with a typo, say an unquoted number);
* :func:`redact` takes the configured secrets, and every ``name: value`` line of a secret setting, out of a text
  (the admin Config page shows the file through it);
* :class:`SecretFilter` does the same to every log record a handler emits (installed on the root logger's handlers
  by :func:`guard_logs`; the appliance tells it the secrets of each config it runs, :func:`remember`).

Pure, except :func:`guard_logs` (it attaches the filter to logging handlers).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from appliance.config import schema

REDACTED = "\u2022\u2022\u2022\u2022\u2022\u2022\u2022\u2022 (hidden)"
"""What a secret is replaced with."""
HIDDEN_VALUE = "(got a value that is not shown: the setting is secret)"
_GOT = re.compile(r"\(got .*\)\s*$", re.DOTALL)
MIN_SECRET_CHARS = 4
"""Shorter secrets are not searched for in prose (a one-letter token would redact that letter everywhere); they are
still hidden where they are a setting's value."""

SECRET_SETTINGS: tuple[schema.Setting, ...] = tuple(setting for setting in schema.SETTINGS if setting.secret)
SECRET_NAMES: frozenset[str] = frozenset(setting.name for setting in SECRET_SETTINGS)
_NAMES = "|".join(re.escape(name) for name in sorted(SECRET_NAMES))
_SECRET_LINE = re.compile(
    r"((?<![A-Za-z0-9_])[\"']?(?:" + _NAMES + r")[\"']?[ \t]*:[ \t]*)"
    r"(\"(?:[^\"\\\n]|\\.)*\"?|'(?:[^'\n]|'')*'?|[^\s,}#][^,}\n#]*)",
)
"""Where a text sets a secret setting (block or flow style, a quoted key or value): the value is group 2."""


def hidden_value(message: str) -> str:
    """A problem's ``message`` with its ``(got …)`` part, the offending value, replaced by :data:`HIDDEN_VALUE`."""
    if _GOT.search(message):
        return _GOT.sub(HIDDEN_VALUE, message)
    return f"{message} {HIDDEN_VALUE}"


def values_of(config: object) -> tuple[str, ...]:
    """The secret settings' values in a validated config (the ones set)."""
    found = []
    for setting in SECRET_SETTINGS:
        value: object = config
        for name in setting.key.split("."):
            value = getattr(value, name, None)
        if isinstance(value, str) and value:
            found.append(value)
    return tuple(found)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every secret of ``secrets`` (at least :data:`MIN_SECRET_CHARS` long) and the value of every
    line that sets a secret setting (``api_token: …``) replaced by :data:`REDACTED`."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= MIN_SECRET_CHARS:
            text = text.replace(secret, REDACTED)
    return _SECRET_LINE.sub(r"\g<1>" + REDACTED, text)


class SecretFilter(logging.Filter):
    """A handler filter that redacts the remembered secrets from each record's formatted message (its arguments
    included), so that no log line, the state dump's included, can carry them."""

    def __init__(self) -> None:
        super().__init__("appliance-secrets")
        self.secrets: frozenset[str] = frozenset()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        message = record.getMessage()
        clean = redact(message, self.secrets)
        if clean != message:
            record.msg = clean
            record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        return True


FILTER = SecretFilter()
"""The process's one filter: a process runs one appliance."""


def remember(secrets: Iterable[str]) -> None:
    """Keep ``secrets`` out of log lines from now on. A reload adds the new config's secrets; the old ones stay
    hidden too (a token that was changed may still be in use somewhere)."""
    FILTER.secrets = FILTER.secrets | frozenset(secret for secret in secrets if len(secret) >= MIN_SECRET_CHARS)


def guard_logs(logger: logging.Logger | None = None) -> None:
    """Attach :data:`FILTER` to every handler of ``logger`` (the root logger by default) that lacks it."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if FILTER not in handler.filters:
            handler.addFilter(FILTER)
