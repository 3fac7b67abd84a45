"""Secret settings are never shown (:mod:`appliance.config.secrets`): not in a validation problem, a redacted text or
a log line."""

from __future__ import annotations

import logging

import pytest

from appliance.config import schema, secrets
from appliance.config.validate import ConfigInvalid, parse_config

TYPED = "987654321"  # an unquoted number: the intended token, refused as not a string


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigInvalid) as info:
        parse_config(text, check_files=False)
    return [str(problem) for problem in info.value.problems]


def test_the_schema_marks_the_api_token_secret() -> None:
    assert [setting.key for setting in secrets.SECRET_SETTINGS] == ["http.api_token"]
    assert schema.BY_KEY["http.api_token"].secret and not schema.BY_KEY["http.host"].secret


@pytest.mark.parametrize("text", [
    f"http: {{api_token: {TYPED}}}\n",
    f"http:\n  api_token: {TYPED}\n",
    f"http:\n  api_token: [{TYPED}]\n",
    f"http:\n  api_token: {{a: {TYPED}}}\n",
    "http:\n  api_token: \uff19\uff18\uff17\uff16\n",  # non-ASCII digits
])
def test_a_refused_secret_is_not_in_its_problem(text: str) -> None:
    found = problems_of(text)
    assert len(found) == 1 and found[0].startswith("appliance.yaml:") and "http.api_token" in found[0]
    assert TYPED not in found[0] and "\uff19" not in found[0]
    assert secrets.HIDDEN_VALUE in found[0]


def test_a_refused_ordinary_value_is_still_shown() -> None:
    assert "(got 'lots')" in problems_of("http:\n  port: lots\n")[0]


def test_the_hint_to_quote_stays() -> None:
    assert "quote it" in problems_of(f"http: {{api_token: {TYPED}}}\n")[0]


def test_hidden_value_words_a_message_without_its_value() -> None:
    assert secrets.hidden_value("must be a string (got 12)") == f"must be a string {secrets.HIDDEN_VALUE}"
    assert secrets.hidden_value("must not be empty") == f"must not be empty {secrets.HIDDEN_VALUE}"


@pytest.mark.parametrize(("text", "kept"), [
    ("http:\n  api_token: s3cret-token\n", "http:\n  api_token: "),
    ("http: {host: 0.0.0.0}\n  'api_token':   abc\n", "  'api_token':   "),
    ("- api_token: abc # comment\n", "- api_token: "),
    ("http: {host: h, api_token: abc, port: 1}\n", "api_token: "),
    ('http: {"api_token": "a,b\\"c", port: 1}\n', '"api_token": '),
])
def test_redact_hides_every_line_that_sets_a_secret(text: str, kept: str) -> None:
    clean = secrets.redact(text)
    assert kept + secrets.REDACTED in clean
    assert "s3cret" not in clean and "abc" not in clean and "b\\" not in clean
    assert "port: 1" in clean or "port" not in text


def test_redact_hides_a_known_secret_anywhere_but_not_a_too_short_one() -> None:
    clean = secrets.redact("the token was s3cret-token, then x", ["s3cret-token", "x"])
    assert clean == f"the token was {secrets.REDACTED}, then x"


def seen_by(handler: logging.Handler, seen: list[str]):  # type: ignore[no-untyped-def]
    def emit(record: logging.LogRecord) -> None:
        seen.append(handler.format(record))

    return emit


def test_the_log_filter_hides_secrets_in_arguments_and_tracebacks() -> None:
    logger = logging.getLogger("test-secrets")
    handler = logging.Handler()
    seen: list[str] = []
    handler.emit = seen_by(handler, seen)  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.propagate = False
    secrets.remember(["tok-123456"])
    secrets.guard_logs(logger)
    secrets.guard_logs(logger)  # idempotent
    try:
        assert handler.filters.count(secrets.FILTER) == 1
        logger.warning("sent %s to %s", "tok-123456", "x")
        try:
            raise ValueError("bad tok-123456")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert seen[0] == f"sent {secrets.REDACTED} to x"
    assert "tok-123456" not in seen[1] and "ValueError: bad" in seen[1]
